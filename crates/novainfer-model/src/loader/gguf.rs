//! GGUF files (llama.cpp's format), architecture `qwen2`.
//!
//! Tensor names are translated to their HF spelling so the model builder sees
//! one vocabulary; quantized tensors stay quantized (see [`crate::quant`] for the
//! one load-time re-encoding we do).

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;

use super::{RawTensor, TensorSource};
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::rope_scaling::{self, ModelDims, RopeScaling};

pub struct GgufCheckpoint {
    path: PathBuf,
    file: BufReader<File>,
    content: Content,
    /// HF name → GGUF name.
    names: HashMap<String, String>,
}

impl GgufCheckpoint {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let mut file = BufReader::new(file);
        let content = Content::read(&mut file).map_err(|e| ModelError::Corrupt {
            path: path.to_owned(),
            detail: e.to_string(),
        })?;
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok());
        if arch.map(String::as_str) != Some("qwen2") {
            return Err(ModelError::UnsupportedArchitecture {
                found: arch.cloned().unwrap_or_else(|| "<none>".into()),
                expected: "GGUF general.architecture = qwen2",
            });
        }
        // Check every tensor's extent now, so a truncated download fails at once with a
        // clear message instead of half-way through loading.
        for (name, info) in &content.tensor_infos {
            let blocks = info.shape.elem_count() / info.ggml_dtype.block_size();
            let end = content.tensor_data_offset
                + info.offset
                + (blocks * info.ggml_dtype.type_size()) as u64;
            if end > file_len {
                return Err(ModelError::Corrupt {
                    path: path.to_owned(),
                    detail: format!(
                        "tensor `{name}` ends at byte {end} but the file has {file_len} bytes"
                    ),
                });
            }
        }
        let names = content
            .tensor_infos
            .keys()
            .map(|g| (hf_name(g), g.clone()))
            .collect();
        Ok(Self {
            path: path.to_owned(),
            file,
            content,
            names,
        })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn config(&self) -> Result<Qwen2Config> {
        let md = &self.content.metadata;
        let get = |key: &str| {
            md.get(key)
                .ok_or_else(|| ModelError::config(key, "missing from GGUF metadata"))
        };
        let usize_of = |key: &str| -> Result<usize> {
            let v = get(key)?;
            v.to_u64()
                .or_else(|_| v.to_u32().map(u64::from))
                .map(|n| n as usize)
                .map_err(|e| ModelError::config(key, e.to_string()))
        };
        let f64_of = |key: &str| -> Result<f64> {
            let v = get(key)?;
            v.to_f32()
                .map(f64::from)
                .or_else(|_| v.to_f64())
                .map_err(|e| ModelError::config(key, e.to_string()))
        };
        let u32_opt = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        let vocab_size = match md
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok())
        {
            Some(tokens) => tokens.len(),
            None => self
                .content
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or_else(|| {
                    ModelError::config("tokenizer.ggml.tokens", "missing from GGUF metadata")
                })?,
        };
        let heads = usize_of("qwen2.attention.head_count")?;
        let cfg = Qwen2Config {
            vocab_size,
            hidden_size: usize_of("qwen2.embedding_length")?,
            intermediate_size: usize_of("qwen2.feed_forward_length")?,
            num_hidden_layers: usize_of("qwen2.block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: usize_of("qwen2.attention.head_count_kv").unwrap_or(heads),
            max_position_embeddings: usize_of("qwen2.context_length")?,
            rope_theta: f64_of("qwen2.rope.freq_base").unwrap_or(10_000.0),
            rms_norm_eps: f64_of("qwen2.attention.layer_norm_rms_epsilon")?,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            torch_dtype: None,
            bos_token_id: u32_opt("tokenizer.ggml.bos_token_id"),
            eos_token_ids: u32_opt("tokenizer.ggml.eos_token_id").into_iter().collect(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The RoPE scaling of llama.cpp's `qwen2.rope.scaling.*` keys, for `cfg` (this file's
    /// [`Self::config`]); see `crate::rope_scaling`.
    pub fn rope_scaling(&self, cfg: &Qwen2Config) -> Result<RopeScaling> {
        rope_scaling::from_gguf(&self.content.metadata, "qwen2", ModelDims::of(cfg))
    }
}

/// Maps llama.cpp's tensor names to transformers' Qwen2 names; unknown names pass through.
fn hf_name(gguf: &str) -> String {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = top {
        return name.to_owned();
    }
    let Some(rest) = gguf.strip_prefix("blk.") else {
        return gguf.to_owned();
    };
    let Some((layer, rest)) = rest.split_once('.') else {
        return gguf.to_owned();
    };
    let Some((module, param)) = rest.split_once('.') else {
        return gguf.to_owned();
    };
    let module = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return gguf.to_owned(),
    };
    format!("model.layers.{layer}.{module}.{param}")
}

impl TensorSource for GgufCheckpoint {
    fn names(&self) -> Vec<String> {
        self.names.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let gguf = self.names.get(name)?;
        self.content
            .tensor_infos
            .get(gguf)
            .map(|t| t.shape.dims().to_vec())
    }

    fn load(&mut self, name: &str) -> Result<RawTensor> {
        let gguf = self
            .names
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })?;
        let q = self
            .content
            .tensor(&mut self.file, gguf, &Device::Cpu)
            .map_err(|e| ModelError::Corrupt {
                path: self.path.clone(),
                detail: format!("tensor `{gguf}`: {e}"),
            })?;
        use candle_core::quantized::GgmlDType as G;
        Ok(match q.dtype() {
            G::F32 | G::F16 | G::BF16 => RawTensor::Dense(q.dequantize(&Device::Cpu)?),
            _ => RawTensor::Quantized(q),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn llama_cpp_names_map_to_transformers_names() {
        assert_eq!(hf_name("token_embd.weight"), "model.embed_tokens.weight");
        assert_eq!(
            hf_name("blk.11.attn_q.bias"),
            "model.layers.11.self_attn.q_proj.bias"
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight"),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight"),
            "model.layers.3.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("rope_freqs.weight"), "rope_freqs.weight");
    }
}
