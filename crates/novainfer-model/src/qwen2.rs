//! The Qwen2 decoder: embedding → N × block → norm → lm_head.
//!
//! Each block is `h += o_proj(attn(rope(q), rope(k), v))` on the RMS-normed
//! input, then `h += down(silu(gate(x)) · up(x))` on the RMS-normed result.
//! Q, K and V carry biases (Qwen2's one departure from Llama); o_proj and the
//! MLP do not.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::config::{Qwen2Config, WeightDtype};
use crate::error::{ModelError, Result};
use crate::forward_batch::{ForwardBatch, ForwardOutput, SpanOutput};
use crate::kv_cache::SequenceKvCache;
use crate::kv_dtype::{KvCacheDtype, KvStorage};
use crate::layers::ops::{add_in_place, normalize_l2, rms_norm, silu_mul, Rope, RopeAngles};
use crate::layers::paged_attention::{paged_attention, AttnIsa};
use crate::layers::{AttentionShape, Embedding, Linear};
use crate::loader::{CheckedSource, Checkpoint, ModelFormat, RawTensor, TensorSource};
use crate::paged_kv::PagedKvCache;
use crate::quant;

/// How dense (safetensors) weights are stored in memory. GGUF tensors keep their own types.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DtypeChoice {
    /// f32 on CPU: exact for f32/bf16/f16 checkpoints and the fastest CPU matmul.
    #[default]
    Auto,
    Fixed(WeightDtype),
}

impl DtypeChoice {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            other => WeightDtype::parse(other)
                .map(Self::Fixed)
                .ok_or_else(|| ModelError::InvalidDtype(s.to_owned())),
        }
    }

    fn storage(self) -> DType {
        match self {
            Self::Auto => DType::F32,
            Self::Fixed(d) => d.candle(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub dtype: DtypeChoice,
    /// Re-encode Q5_0 GGUF tensors as Q8_0 (exact). Off by default: on x86-64 both
    /// formats have native kernels (`layers::qmatmul`), where this only costs memory
    /// (34/22 of the bytes; speed within noise); it can still help candle's fallback.
    pub requantize_q5_0: bool,
    /// How the KV cache stores keys and values ([`Qwen2Model::new_cache`]; the engine's
    /// pool). `Auto` is f16 on the CPU.
    pub kv_cache_dtype: KvCacheDtype,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DtypeChoice::Auto,
            requantize_q5_0: false,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }
}

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the last token: what generation needs, and far cheaper for long prompts.
    LastToken,
    AllTokens,
}

struct DecoderLayer {
    input_layernorm: Vec<f32>,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: Vec<f32>,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

pub struct Qwen2Model {
    cfg: Qwen2Config,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    kv_dtype: KvStorage,
    attn_isa: AttnIsa,
}

/// A loaded model plus what the engine needs from its files (tokenizer, templates).
pub struct LoadedModel {
    pub model: Qwen2Model,
    pub format: ModelFormat,
    /// GGUF metadata (tokenizer, chat template) when the model came from a GGUF file.
    pub gguf_metadata:
        Option<std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>>,
}

impl Qwen2Model {
    /// Loads an HF directory or a GGUF file, whichever `path` is.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
        let opened = Checkpoint::open(path)?;
        Ok(LoadedModel {
            model: Self::build(opened.config, opened.checkpoint, opts)?,
            format: opened.format,
            gguf_metadata: opened.gguf_metadata,
        })
    }

    /// Builds the model from any checkpoint, checking every name and shape.
    pub fn build<S: TensorSource>(cfg: Qwen2Config, source: S, opts: &LoadOptions) -> Result<Self> {
        let mut b = Builder {
            src: CheckedSource::new(source),
            opts: *opts,
        };
        let (h, kv, ffn) = (
            cfg.hidden_size,
            cfg.num_key_value_heads * cfg.head_dim(),
            cfg.intermediate_size,
        );
        let embed_tokens = b.embedding("model.embed_tokens.weight", cfg.vocab_size, h)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(DecoderLayer {
                input_layernorm: b.vector(&format!("{p}.input_layernorm.weight"), h)?,
                q_proj: b.linear(&format!("{p}.self_attn.q_proj"), h, h, true)?,
                k_proj: b.linear(&format!("{p}.self_attn.k_proj"), kv, h, true)?,
                v_proj: b.linear(&format!("{p}.self_attn.v_proj"), kv, h, true)?,
                o_proj: b.linear(&format!("{p}.self_attn.o_proj"), h, h, false)?,
                post_attention_layernorm: b
                    .vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                gate_proj: b.linear(&format!("{p}.mlp.gate_proj"), ffn, h, false)?,
                up_proj: b.linear(&format!("{p}.mlp.up_proj"), ffn, h, false)?,
                down_proj: b.linear(&format!("{p}.mlp.down_proj"), h, ffn, false)?,
            });
        }
        let norm = b.vector("model.norm.weight", h)?;
        let lm_head = if cfg.tie_word_embeddings {
            // Some tied checkpoints still ship a copy of the table; it must not be used.
            b.src.skip("lm_head.weight");
            embed_tokens.as_linear()?
        } else {
            b.linear("lm_head", cfg.vocab_size, h, false)?
        };
        b.src.finish()?;
        let rope = Rope::new(cfg.head_dim(), cfg.rope_theta);
        Ok(Self {
            kv_dtype: opts.kv_cache_dtype.for_cpu(),
            attn_isa: AttnIsa::detect(cfg.head_dim()),
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
        })
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.cfg
    }

    /// A fresh cache for one sequence of up to `capacity` tokens, in the model's KV dtype.
    pub fn new_cache(&self, capacity: usize) -> SequenceKvCache {
        SequenceKvCache::new(&self.cfg, capacity, self.kv_dtype)
    }

    /// How this model's caches store keys and values (from [`LoadOptions::kv_cache_dtype`]).
    pub fn kv_dtype(&self) -> KvStorage {
        self.kv_dtype
    }

    /// Runs `tokens` at positions `cache.len()..` and appends their K/V to `cache`.
    /// Returns logits `[rows, vocab]`, with one row (`LastToken`) or one per token.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut SequenceKvCache,
        which: LogitsFor,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        cache.reserve(tokens.len())?;
        let start = cache.len();
        let mut batch = ForwardBatch::default();
        // The whole sequence lives in block 0, so slot = position.
        batch.push(
            tokens,
            start,
            (start..start + tokens.len()).collect(),
            vec![0],
            true,
        );
        let logits = self.forward_batch(&batch, &mut cache.pool, which)?;
        cache.advance(tokens.len());
        Ok(logits)
    }

    /// One step over many sequences: writes every token's K/V at its slot and returns
    /// logits `[rows, vocab]` for the last token of each sampled sequence (`LastToken`,
    /// in `batch.seqs` order) or for every token (`AllTokens`).
    pub fn forward_batch(
        &self,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
        which: LogitsFor,
    ) -> Result<Vec<f32>> {
        if batch.num_tokens() == 0 {
            return Ok(Vec::new());
        }
        let hidden = self.run_layers(batch, kv)?;
        let h = self.cfg.hidden_size;
        let selected: Vec<f32> = match which {
            LogitsFor::AllTokens => hidden,
            LogitsFor::LastToken => batch
                .logits_indices()
                .iter()
                .flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied())
                .collect(),
        };
        let normed = rms_norm(&selected, &self.norm, self.cfg.rms_norm_eps);
        self.lm_head.forward(&normed, selected.len() / h)
    }

    /// Embedding of a whole text: the final (normed) hidden state of its last token,
    /// scaled to unit L2 norm. A causal model's last position is the only one that has
    /// seen every token, which is why decoder embedders (gte-Qwen2, vLLM's default for
    /// decoder models) pool there rather than averaging. Computed apart from any pool, in
    /// one pass (the engine computes embeddings in chunks through its scheduler instead).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let mut cache = self.new_cache(tokens.len());
        cache.reserve(tokens.len())?;
        let mut batch = ForwardBatch::default();
        // The whole input lives in block 0, so slot = position.
        let n = tokens.len();
        batch.push_span(tokens, 0, (0..n).collect(), vec![0], SpanOutput::LastHidden);
        let mut v = self.forward_outputs(&batch, &mut cache.pool)?.hidden;
        normalize_l2(&mut v);
        Ok(v)
    }

    /// One step over many sequences, returning what each span asks for (see
    /// [`SpanOutput`]): logits rows and final hidden rows, in `batch.seqs` order.
    pub fn forward_outputs(
        &self,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
    ) -> Result<ForwardOutput> {
        if batch.num_tokens() == 0 {
            return Ok(ForwardOutput::default());
        }
        let hidden = self.run_layers(batch, kv)?;
        let h = self.cfg.hidden_size;
        let final_norm = |rows: &[usize]| {
            let selected: Vec<f32> = rows
                .iter()
                .flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied())
                .collect();
            rms_norm(&selected, &self.norm, self.cfg.rms_norm_eps)
        };
        let logits_rows = batch.logits_indices();
        let logits = if logits_rows.is_empty() {
            Vec::new()
        } else {
            self.lm_head
                .forward(&final_norm(&logits_rows), logits_rows.len())?
        };
        Ok(ForwardOutput {
            logits,
            hidden: final_norm(&batch.hidden_indices()),
        })
    }

    /// Embeds `batch`, writes its K/V and runs every decoder layer; returns the
    /// residual stream `[tokens, hidden]` before the final norm.
    fn run_layers(&self, batch: &ForwardBatch, kv: &mut PagedKvCache) -> Result<Vec<f32>> {
        let vocab_size = self.cfg.vocab_size;
        if let Some(&id) = batch.token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ModelError::TokenOutOfRange { id, vocab_size });
        }
        batch.validate(kv.block_size())?;
        kv.check_slots(&batch.slot_mapping)?;
        let mut hidden = self.embed_tokens.forward(&batch.token_ids)?;
        let angles = self.rope.angles(&batch.positions);
        for (i, layer) in self.layers.iter().enumerate() {
            self.block(i, layer, &mut hidden, batch, &angles, kv)?;
        }
        Ok(hidden)
    }

    fn block(
        &self,
        index: usize,
        layer: &DecoderLayer,
        hidden: &mut [f32],
        batch: &ForwardBatch,
        angles: &RopeAngles,
        kv: &mut PagedKvCache,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let n = batch.num_tokens();
        let eps = cfg.rms_norm_eps;
        let x = rms_norm(hidden, &layer.input_layernorm, eps);
        let [mut q, mut k, v]: [Vec<f32>; 3] =
            Linear::forward_many(&[&layer.q_proj, &layer.k_proj, &layer.v_proj], &x, n)?
                .try_into()
                .expect("three projections give three outputs: this is a bug");
        angles.apply(&mut q, cfg.head_dim());
        angles.apply(&mut k, cfg.head_dim());
        kv.write(index, &batch.slot_mapping, &k, &v);
        let shape = AttentionShape {
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim(),
        };
        let attn = paged_attention(
            &q,
            &batch.positions,
            &batch.seqs,
            kv.layer(index),
            shape,
            self.attn_isa,
        );
        add_in_place(hidden, &layer.o_proj.forward(&attn, n)?);

        let x = rms_norm(hidden, &layer.post_attention_layernorm, eps);
        let [gate, up]: [Vec<f32>; 2] =
            Linear::forward_many(&[&layer.gate_proj, &layer.up_proj], &x, n)?
                .try_into()
                .expect("two projections give two outputs: this is a bug");
        add_in_place(hidden, &layer.down_proj.forward(&silu_mul(&gate, &up), n)?);
        Ok(())
    }
}

struct Builder<S> {
    src: CheckedSource<S>,
    opts: LoadOptions,
}

impl<S: TensorSource> Builder<S> {
    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.src.take(name, &[len])?.to_f32_vec()
    }

    fn dense(&self, t: Tensor) -> Result<Tensor> {
        Ok(t.to_dtype(self.opts.dtype.storage())?)
    }

    fn linear(&mut self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let bias = if bias {
            Some(self.vector(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        match self.src.take(&format!("{prefix}.weight"), &[out, inp])? {
            RawTensor::Dense(t) => Linear::dense(self.dense(t)?, bias),
            RawTensor::Quantized(q) => Linear::quantized(Arc::new(self.requantize(q)?), bias),
        }
    }

    fn embedding(&mut self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        Ok(match self.src.take(name, &[vocab, hidden])? {
            RawTensor::Dense(t) => Embedding::Dense(self.dense(t)?),
            RawTensor::Quantized(q) => Embedding::Quantized(Arc::new(self.requantize(q)?)),
        })
    }

    fn requantize(
        &self,
        q: candle_core::quantized::QTensor,
    ) -> Result<candle_core::quantized::QTensor> {
        if self.opts.requantize_q5_0 {
            quant::to_fast_format(q)
        } else {
            Ok(q)
        }
    }
}
