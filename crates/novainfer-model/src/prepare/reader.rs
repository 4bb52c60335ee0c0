//! The checkpoint read layer by layer for a device executor, with the CPU builder's checks
//! ([`CheckedSource`]: every tensor present with its shape, none left over), into the
//! fused matrices of [`super::matrix`]. One layer at a time, so the host holds one layer's
//! weights while the device loads, not the model's.

use crate::config::Qwen2Config;
use crate::error::Result;
use crate::loader::{CheckedSource, TensorSource};

use super::matrix::HostMatrix;

/// One decoder layer, fused.
pub struct HostLayer {
    pub input_layernorm: Vec<f32>,
    /// `[(H + 2·KVH)·D, hidden]`: q rows, then k, then v.
    pub qkv: HostMatrix,
    /// `[(H + 2·KVH)·D]`, in the same order.
    pub qkv_bias: Vec<f32>,
    pub o_proj: HostMatrix,
    pub post_attention_layernorm: Vec<f32>,
    /// `[2·F, hidden]`: gate rows, then up.
    pub gate_up: HostMatrix,
    pub down_proj: HostMatrix,
}

/// Reads a Qwen2 checkpoint in the order `embedding`, `layer(0..n)`, `final_norm`,
/// `lm_head`, `finish`.
pub struct HostModelReader<S> {
    src: CheckedSource<S>,
    cfg: Qwen2Config,
}

impl<S: TensorSource> HostModelReader<S> {
    pub fn new(cfg: Qwen2Config, source: S) -> Self {
        Self {
            src: CheckedSource::new(source),
            cfg,
        }
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.cfg
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.src.take(name, &[len])?.to_f32_vec()
    }

    fn matrix(&mut self, m: &mut HostMatrix, name: &str, rows: usize) -> Result<()> {
        let raw = self.src.take(name, &[rows, m.cols])?;
        m.push(name, rows, raw)
    }

    /// `[vocab, hidden]`: the embedding table (and, when tied, the LM head).
    pub fn embedding(&mut self) -> Result<HostMatrix> {
        let (v, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let name = "model.embed_tokens.weight";
        HostMatrix::single(name, v, h, self.src.take(name, &[v, h])?)
    }

    pub fn layer(&mut self, index: usize) -> Result<HostLayer> {
        let cfg = &self.cfg;
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let (q, kv) = (
            cfg.num_attention_heads * cfg.head_dim(),
            cfg.num_key_value_heads * cfg.head_dim(),
        );
        let p = format!("model.layers.{index}");
        let input_layernorm = self.vector(&format!("{p}.input_layernorm.weight"), h)?;
        let mut qkv = HostMatrix {
            cols: h,
            parts: Vec::new(),
        };
        let mut qkv_bias = Vec::with_capacity(q + 2 * kv);
        for (m, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            qkv_bias.extend(self.vector(&format!("{p}.self_attn.{m}.bias"), rows)?);
            self.matrix(&mut qkv, &format!("{p}.self_attn.{m}.weight"), rows)?;
        }
        let mut o_proj = HostMatrix {
            cols: q,
            parts: Vec::new(),
        };
        self.matrix(&mut o_proj, &format!("{p}.self_attn.o_proj.weight"), h)?;
        let post_attention_layernorm =
            self.vector(&format!("{p}.post_attention_layernorm.weight"), h)?;
        let mut gate_up = HostMatrix {
            cols: h,
            parts: Vec::new(),
        };
        for m in ["gate_proj", "up_proj"] {
            self.matrix(&mut gate_up, &format!("{p}.mlp.{m}.weight"), f)?;
        }
        let mut down_proj = HostMatrix {
            cols: f,
            parts: Vec::new(),
        };
        self.matrix(&mut down_proj, &format!("{p}.mlp.down_proj.weight"), h)?;
        Ok(HostLayer {
            input_layernorm,
            qkv,
            qkv_bias,
            o_proj,
            post_attention_layernorm,
            gate_up,
            down_proj,
        })
    }

    pub fn final_norm(&mut self) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        self.vector("model.norm.weight", h)
    }

    /// The untied LM head `[vocab, hidden]`, or `None` when the embeddings are tied (a copy
    /// of the table that some tied checkpoints ship is skipped, as on the CPU).
    pub fn lm_head(&mut self) -> Result<Option<HostMatrix>> {
        if self.cfg.tie_word_embeddings {
            self.src.skip("lm_head.weight");
            return Ok(None);
        }
        let (v, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let name = "lm_head.weight";
        let raw = self.src.take(name, &[v, h])?;
        Ok(Some(HostMatrix::single(name, v, h, raw)?))
    }

    /// Fails on a tensor nobody asked for.
    pub fn finish(self) -> Result<()> {
        self.src.finish()
    }
}
