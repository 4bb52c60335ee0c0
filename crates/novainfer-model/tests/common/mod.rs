//! A tiny random Qwen2 held in memory, shared by the model-level tests.
#![allow(dead_code)] // Each test binary uses its own part of this.

use std::borrow::Cow;
use std::collections::HashMap;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use novainfer_model::loader::{RawTensor, TensorSource};
use novainfer_model::{LoadOptions, ModelError, Qwen2Config, Qwen2Model};

/// A tensor as a test checkpoint stores it: dense, or GGUF blocks (rebuilt on each load,
/// since a `QTensor` cannot be cloned).
#[derive(Clone)]
pub enum Stored {
    Dense(Tensor),
    Quantized {
        dtype: GgmlDType,
        bytes: Vec<u8>,
        shape: Vec<usize>,
    },
}

impl Stored {
    pub fn quantize(t: &Tensor, dtype: GgmlDType) -> Self {
        let q = QTensor::quantize(t, dtype).expect("quantize");
        Stored::Quantized {
            dtype,
            bytes: q.data().expect("bytes").into_owned(),
            shape: t.dims().to_vec(),
        }
    }

    pub fn load(&self) -> RawTensor {
        match self {
            Stored::Dense(t) => RawTensor::Dense(t.clone()),
            Stored::Quantized {
                dtype,
                bytes,
                shape,
            } => {
                let storage = QStorage::from_data(Cow::Owned(bytes.clone()), &Device::Cpu, *dtype)
                    .expect("storage");
                RawTensor::Quantized(QTensor::new(storage, shape.as_slice()).expect("qtensor"))
            }
        }
    }

    pub fn dims(&self) -> Vec<usize> {
        match self {
            Stored::Dense(t) => t.dims().to_vec(),
            Stored::Quantized { shape, .. } => shape.clone(),
        }
    }

    /// The values in f32 (quantized ones through candle's dequantize).
    pub fn to_f32(&self) -> Tensor {
        match self.load() {
            RawTensor::Dense(t) => t.to_dtype(candle_core::DType::F32).expect("f32"),
            RawTensor::Quantized(q) => q.dequantize(&Device::Cpu).expect("dequantize"),
            RawTensor::Int4(_) | RawTensor::Fp8(_) => {
                unreachable!("the test source stores no int4 or FP8 tensors")
            }
        }
    }
}

pub struct MemorySource(pub HashMap<String, Stored>);

impl MemorySource {
    pub fn dense(w: HashMap<String, Tensor>) -> Self {
        Self(w.into_iter().map(|(k, t)| (k, Stored::Dense(t))).collect())
    }
}

impl TensorSource for MemorySource {
    fn names(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.get(name).map(Stored::dims)
    }
    fn load(&mut self, name: &str) -> novainfer_model::Result<RawTensor> {
        self.0
            .get(name)
            .map(Stored::load)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
    }
}

/// The tiny model of most tests: hidden 32, 4 heads of 8, 2 KV heads, 2 layers.
pub fn config(tie: bool) -> Qwen2Config {
    Qwen2Config {
        vocab_size: 50,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 64,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tie,
        torch_dtype: None,
        bos_token_id: None,
        eos_token_ids: vec![49],
    }
}

/// The GPU tests' tiny model: head_dim 64 (the smallest the attention kernels are built for),
/// hidden 256, 4 heads, 2 KV heads, 2 layers.
pub fn config_hd64(tie: bool) -> Qwen2Config {
    Qwen2Config {
        vocab_size: 96,
        hidden_size: 256,
        intermediate_size: 384,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 64,
        ..config(tie)
    }
}

/// Deterministic pseudo-random weights (no RNG crate needed for a fixture).
pub fn tensor(shape: &[usize], seed: usize, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i * 2654435761 + seed * 40503) % 10007) as f32 / 10007.0;
            (x - 0.5) * 2.0 * scale
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor")
}

pub fn weights(cfg: &Qwen2Config) -> HashMap<String, Tensor> {
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let kv = cfg.num_key_value_heads * cfg.head_dim();
    let mut w = HashMap::new();
    let mut seed = 0;
    let mut put = |name: String, shape: &[usize], scale: f32| {
        seed += 1;
        w.insert(name, tensor(shape, seed, scale));
    };
    put("model.embed_tokens.weight".into(), &[v, h], 1.0);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        put(format!("{p}.input_layernorm.weight"), &[h], 1.5);
        put(format!("{p}.post_attention_layernorm.weight"), &[h], 1.5);
        for (m, out) in [("q_proj", h), ("k_proj", kv), ("v_proj", kv)] {
            put(format!("{p}.self_attn.{m}.weight"), &[out, h], 0.4);
            put(format!("{p}.self_attn.{m}.bias"), &[out], 0.2);
        }
        put(format!("{p}.self_attn.o_proj.weight"), &[h, h], 0.3);
        put(format!("{p}.mlp.gate_proj.weight"), &[f, h], 0.3);
        put(format!("{p}.mlp.up_proj.weight"), &[f, h], 0.3);
        put(format!("{p}.mlp.down_proj.weight"), &[h, f], 0.3);
    }
    put("model.norm.weight".into(), &[h], 1.0);
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), &[v, h], 0.5);
    }
    w
}

/// Every tensor rounded to bf16 (kept in f32), so a bf16 device and the f32 CPU start from
/// the same weights and differ only in their arithmetic.
pub fn round_to_bf16(w: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    w.into_iter()
        .map(|(k, t)| {
            let r = t
                .to_dtype(candle_core::DType::BF16)
                .and_then(|t| t.to_dtype(candle_core::DType::F32))
                .expect("round");
            (k, r)
        })
        .collect()
}

pub fn build(cfg: Qwen2Config, w: HashMap<String, Tensor>) -> Result<Qwen2Model, ModelError> {
    Qwen2Model::build(cfg, MemorySource::dense(w), &LoadOptions::default())
}

/// [`build`] with its caches in `kv_cache_dtype` ("auto", "f32", "f16", "bf16", "q8_0").
pub fn build_kv(
    cfg: Qwen2Config,
    w: HashMap<String, Tensor>,
    kv_cache_dtype: &str,
) -> Result<Qwen2Model, ModelError> {
    let opts = LoadOptions {
        kv_cache_dtype: novainfer_model::KvCacheDtype::parse(kv_cache_dtype)?,
        ..LoadOptions::default()
    };
    Qwen2Model::build(cfg, MemorySource::dense(w), &opts)
}
