//! The Qwen2 decoder: embedding → N × block → norm → lm_head.
//!
//! Each block is `h += o_proj(attn(rope(q), rope(k), v))` on the RMS-normed
//! input, then `h += down(silu(gate(x)) · up(x))` on the RMS-normed result.
//! Q, K and V carry biases (Qwen2's one departure from Llama); o_proj and the
//! MLP do not.

use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use crate::config::{Qwen2Config, WeightDtype};
use crate::error::{ModelError, Result};
use crate::forward_batch::{ForwardBatch, ForwardOutput, SpanOutput};
use crate::gpu_weight_dtype::GpuWeightDtype;
use crate::kv_cache::SequenceKvCache;
use crate::kv_dtype::{KvCacheDtype, KvStorage};
use crate::layers::ops::{
    add_in_place, normalize_l2, rms_norm, rms_norm_into, silu_mul_into, Rope, RopeAngles,
};
use crate::layers::paged_attention::{paged_attention_into, AttnIsa, Plan as AttnPlan};
use crate::layers::{AttentionShape, Embedding, Linear};
use crate::lm_head_dtype::LmHeadDtype;
use crate::loader::{CheckedSource, Checkpoint, ModelFormat, RawTensor, TensorSource};
use crate::lora::apply::{add_updates, AdapterGroups, LoraScratch};
use crate::lora::Target;
use crate::paged_kv::PagedKvCache;
use crate::prepare::graph::CudaGraphs;
use crate::prepare::linear::{DecodeLinear, PackedGemm};
use crate::quant;
use crate::rope_scaling::RopeScaling;
use crate::weight_quantization::{QuantizedAtLoad, WeightQuantization};

/// How dense (safetensors) weights are stored in memory. GGUF tensors keep their own types.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DtypeChoice {
    /// Each tensor as stored (f32, bf16 or f16): exact, and on the CPU our dense kernel widens
    /// 16-bit weights in registers with the f32 path's bits at half the bytes.
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

    /// The dtype a dense tensor stored as `stored` is held in.
    fn storage(self, stored: DType) -> DType {
        match self {
            Self::Auto => stored,
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
    /// How the lm_head is stored ([`LmHeadDtype`]): the checkpoint's, or Q8_0 (lossy, opt-in).
    pub lm_head_dtype: LmHeadDtype,
    /// How the CUDA executor holds quantized matrices ([`GpuWeightDtype`]); the CPU ignores it.
    pub gpu_weight_dtype: GpuWeightDtype,
    /// Weights quantized at load ([`WeightQuantization`]): none, or FP8 decoder layers.
    pub quantization: WeightQuantization,
    /// How the KV cache stores keys and values ([`Qwen2Model::new_cache`]; the engine's
    /// pool). `Auto` is f16 on the CPU.
    pub kv_cache_dtype: KvCacheDtype,
    /// Whether the CUDA executor captures decode steps into graphs at load and replays them
    /// ([`crate::prepare::graph`]); eager by default. The CPU ignores it.
    pub cuda_graphs: CudaGraphs,
    /// How the CUDA executor runs the linear layers of steps of a few rows
    /// ([`DecodeLinear`]); separate kernels by default. The CPU ignores it.
    pub decode_linear: DecodeLinear,
    /// How the CUDA executor multiplies larger steps by packed matrices ([`PackedGemm`]);
    /// expanded for cuBLAS by default. The CPU ignores it.
    pub packed_gemm: PackedGemm,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DtypeChoice::Auto,
            requantize_q5_0: false,
            lm_head_dtype: LmHeadDtype::Auto,
            gpu_weight_dtype: GpuWeightDtype::Auto,
            quantization: WeightQuantization::None,
            kv_cache_dtype: KvCacheDtype::Auto,
            cuda_graphs: CudaGraphs::Eager,
            decode_linear: DecodeLinear::Separate,
            packed_gemm: PackedGemm::Expand,
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

/// The attention geometry of `cfg`'s layers.
fn attention_shape(cfg: &Qwen2Config) -> AttentionShape {
    AttentionShape {
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim(),
    }
}

pub struct Qwen2Model {
    cfg: Qwen2Config,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    rope_scaling: RopeScaling,
    kv_dtype: KvStorage,
    attn_isa: AttnIsa,
    /// Buffers of finished forwards, handed to the next ones (see [`Workspace`]).
    workspaces: Mutex<Vec<Workspace>>,
}

/// Every buffer one forward pass needs, kept between passes so that a decode step
/// allocates nothing once they have grown to its size. A forward takes one from the
/// model's stack (or makes one when concurrent forwards took them all) and returns it.
#[derive(Default)]
struct Workspace {
    hidden: Vec<f32>,
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    angles: RopeAngles,
    plan: AttnPlan,
    rows: Vec<usize>,
    selected: Vec<f32>,
    normed: Vec<f32>,
    /// The batch's rows by LoRA adapter (empty without adapters), and the products' buffers.
    lora_groups: AdapterGroups,
    lora: LoraScratch,
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
            model: Self::build_scaled(opened.config, opened.rope_scaling, opened.checkpoint, opts)?,
            format: opened.format,
            gguf_metadata: opened.gguf_metadata,
        })
    }

    /// Builds the model from any checkpoint, checking every name and shape (plain RoPE).
    pub fn build<S: TensorSource>(cfg: Qwen2Config, source: S, opts: &LoadOptions) -> Result<Self> {
        Self::build_scaled(cfg, RopeScaling::None, source, opts)
    }

    /// [`Self::build`] with the checkpoint's RoPE scaling ([`crate::OpenedCheckpoint::rope_scaling`]).
    pub fn build_scaled<S: TensorSource>(
        cfg: Qwen2Config,
        rope_scaling: RopeScaling,
        source: S,
        opts: &LoadOptions,
    ) -> Result<Self> {
        if opts.quantization == WeightQuantization::Fp8 {
            // The CPU has no FP8 arithmetic: the layers run as their dense values.
            tracing::warn!(
                "quantization=fp8 on the CPU runs the FP8 layers as dense f32 values (the weights a GPU \
                 multiplies as FP8), twice a bf16 checkpoint's bytes: for the same numbers, not for speed"
            );
        }
        let mut b = Builder {
            src: CheckedSource::new(QuantizedAtLoad::new(source, opts.quantization)),
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
        let lm_head = match opts.lm_head_dtype {
            LmHeadDtype::Auto => lm_head,
            LmHeadDtype::Q8_0 => lm_head.dense_to_q8_0()?,
        };
        b.src.finish()?;
        let rope = Rope::scaled(cfg.head_dim(), cfg.rope_theta, &rope_scaling);
        Ok(Self {
            kv_dtype: opts.kv_cache_dtype.for_cpu(),
            attn_isa: AttnIsa::select(attention_shape(&cfg), opts.kv_cache_dtype.for_cpu()),
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            rope_scaling,
            workspaces: Mutex::new(Vec::new()),
        })
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.cfg
    }

    /// How this model scales RoPE (none unless its checkpoint says so).
    pub fn rope_scaling(&self) -> &RopeScaling {
        &self.rope_scaling
    }

    /// A fresh cache for one sequence of up to `capacity` tokens, in the model's KV dtype.
    pub fn new_cache(&self, capacity: usize) -> SequenceKvCache {
        SequenceKvCache::new(&self.cfg, capacity, self.kv_dtype)
    }

    /// Weight bytes one decode step reads whatever its batch: every projection of every layer
    /// and the output head, each once; the norms' vectors are counted too, the embedding table
    /// is not (a step looks up one row of it). Divided into the machine's read bandwidth it
    /// bounds single-stream decode from above.
    pub fn weight_bytes_per_token(&self) -> usize {
        let vector = |v: &[f32]| std::mem::size_of_val(v);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let projections = [
                    &l.q_proj,
                    &l.k_proj,
                    &l.v_proj,
                    &l.o_proj,
                    &l.gate_proj,
                    &l.up_proj,
                    &l.down_proj,
                ];
                projections.iter().map(|w| w.weight_bytes()).sum::<usize>()
                    + vector(&l.input_layernorm)
                    + vector(&l.post_attention_layernorm)
            })
            .sum();
        layers + vector(&self.norm) + self.lm_head.weight_bytes()
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
        let mut ws = self.take_workspace();
        let result = self.run_layers(batch, kv, &mut ws).and_then(|()| {
            let h = self.cfg.hidden_size;
            let selected: Vec<f32> = match which {
                LogitsFor::AllTokens => ws.hidden.clone(),
                LogitsFor::LastToken => batch
                    .logits_indices()
                    .iter()
                    .flat_map(|&r| ws.hidden[r * h..(r + 1) * h].iter().copied())
                    .collect(),
            };
            let normed = rms_norm(&selected, &self.norm, self.cfg.rms_norm_eps);
            self.lm_head.forward(&normed, selected.len() / h)
        });
        self.return_workspace(ws);
        result
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
        let mut out = ForwardOutput::default();
        self.forward_outputs_into(batch, kv, &mut out)?;
        Ok(out)
    }

    /// [`Self::forward_outputs`] into `out` (its buffers' capacity reused). With packed
    /// (GGUF Q4_K/Q5_0/Q6_K/Q8_0) or dense f32 matmuls and an f32/f16/bf16 embedding table,
    /// a step allocates nothing once the model's workspace and `out` have grown to its size
    /// (tests/decode_allocations.rs counts).
    pub fn forward_outputs_into(
        &self,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
        out: &mut ForwardOutput,
    ) -> Result<()> {
        out.logits.clear();
        out.hidden.clear();
        if batch.num_tokens() == 0 {
            return Ok(());
        }
        let mut ws = self.take_workspace();
        let result = self
            .run_layers(batch, kv, &mut ws)
            .and_then(|()| self.outputs(batch, &mut ws, out));
        self.return_workspace(ws);
        result
    }

    /// The final norm of the rows each span asks for, and the logits of those that want them.
    fn outputs(
        &self,
        batch: &ForwardBatch,
        ws: &mut Workspace,
        out: &mut ForwardOutput,
    ) -> Result<()> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let Workspace {
            hidden,
            rows,
            selected,
            normed,
            ..
        } = ws;
        let gather = |rows: &[usize], selected: &mut Vec<f32>| {
            selected.clear();
            for &r in rows {
                selected.extend_from_slice(&hidden[r * h..(r + 1) * h]);
            }
        };
        batch.logits_indices_into(rows);
        if !rows.is_empty() {
            gather(rows, selected);
            rms_norm_into(selected, &self.norm, eps, normed);
            self.lm_head
                .forward_into(normed, rows.len(), &mut out.logits)?;
        }
        batch.hidden_indices_into(rows);
        gather(rows, selected);
        rms_norm_into(selected, &self.norm, eps, &mut out.hidden);
        Ok(())
    }

    fn take_workspace(&self) -> Workspace {
        self.workspaces
            .lock()
            .ok()
            .and_then(|mut stack| stack.pop())
            .unwrap_or_default()
    }

    fn return_workspace(&self, ws: Workspace) {
        if let Ok(mut stack) = self.workspaces.lock() {
            stack.push(ws);
        }
    }

    /// Embeds `batch`, writes its K/V and runs every decoder layer, leaving the residual
    /// stream `[tokens, hidden]` before the final norm in `ws.hidden`.
    fn run_layers(
        &self,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
        ws: &mut Workspace,
    ) -> Result<()> {
        let vocab_size = self.cfg.vocab_size;
        if let Some(&id) = batch.token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ModelError::TokenOutOfRange { id, vocab_size });
        }
        batch.validate(kv.block_size())?;
        kv.check_slots(&batch.slot_mapping)?;
        self.embed_tokens
            .forward_into(&batch.token_ids, &mut ws.hidden)?;
        self.rope.angles_into(&batch.positions, &mut ws.angles);
        ws.lora_groups.build(&batch.seqs);
        let result = self
            .layers
            .iter()
            .enumerate()
            .try_for_each(|(i, layer)| self.block(i, layer, batch, kv, ws));
        ws.lora_groups.clear();
        result
    }

    fn block(
        &self,
        index: usize,
        layer: &DecoderLayer,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
        ws: &mut Workspace,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let n = batch.num_tokens();
        let eps = cfg.rms_norm_eps;
        let Workspace {
            hidden,
            x,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            act,
            angles,
            plan,
            lora_groups,
            lora,
            ..
        } = ws;
        // LoRA updates go right after each base product, before anything reads its output.
        let adapted = !lora_groups.is_empty();
        rms_norm_into(hidden, &layer.input_layernorm, eps, x);
        Linear::forward_many_into(
            &[&layer.q_proj, &layer.k_proj, &layer.v_proj],
            x,
            n,
            &mut [q, k, v],
        )?;
        if adapted {
            let targets = [Target::Q, Target::K, Target::V];
            let h = cfg.hidden_size;
            add_updates(lora_groups, index, &targets, x, h, &mut [q, k, v], lora);
        }
        angles.apply(q, cfg.head_dim());
        angles.apply(k, cfg.head_dim());
        kv.write(index, &batch.slot_mapping, k, v);
        let shape = attention_shape(cfg);
        paged_attention_into(
            q,
            &batch.positions,
            &batch.seqs,
            kv.layer(index),
            shape,
            self.attn_isa,
            plan,
            attn,
        );
        layer.o_proj.forward_into(attn, n, proj)?;
        if adapted {
            let h = cfg.hidden_size;
            add_updates(lora_groups, index, &[Target::O], attn, h, &mut [proj], lora);
        }
        add_in_place(hidden, proj);

        rms_norm_into(hidden, &layer.post_attention_layernorm, eps, x);
        Linear::forward_many_into(&[&layer.gate_proj, &layer.up_proj], x, n, &mut [gate, up])?;
        if adapted {
            let targets = [Target::Gate, Target::Up];
            let h = cfg.hidden_size;
            add_updates(lora_groups, index, &targets, x, h, &mut [gate, up], lora);
        }
        silu_mul_into(gate, up, act);
        layer.down_proj.forward_into(act, n, proj)?;
        if adapted {
            let ffn = cfg.intermediate_size;
            add_updates(
                lora_groups,
                index,
                &[Target::Down],
                act,
                ffn,
                &mut [proj],
                lora,
            );
        }
        add_in_place(hidden, proj);
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
        let dtype = self.opts.dtype.storage(t.dtype());
        Ok(t.to_dtype(dtype)?)
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
            RawTensor::Int4(w) => Linear::int4(&w, bias),
            // The CPU has no FP8 arithmetic: the layer runs as its dense values.
            RawTensor::Fp8(w) => {
                let t = Tensor::from_vec(w.dequantize(), (out, inp), &candle_core::Device::Cpu)?;
                Linear::dense(self.dense(t)?, bias)
            }
        }
    }

    fn embedding(&mut self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        Ok(match self.src.take(name, &[vocab, hidden])? {
            RawTensor::Dense(t) => Embedding::Dense(self.dense(t)?),
            RawTensor::Quantized(q) => Embedding::Quantized(Arc::new(self.requantize(q)?)),
            // No checkpoint we read quantizes embeddings this way (AWQ, GPTQ and FP8 ones leave
            // them dense); a row lookup of dequantized values is exact.
            raw @ (RawTensor::Int4(_) | RawTensor::Fp8(_)) => {
                let t = Tensor::from_vec(
                    raw.to_f32_vec()?,
                    (vocab, hidden),
                    &candle_core::Device::Cpu,
                )?;
                Embedding::Dense(self.dense(t)?)
            }
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
