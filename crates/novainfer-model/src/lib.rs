//! Qwen2 model execution on CPU: checkpoint loading (HF safetensors, GGUF), the
//! forward pass, a per-sequence KV cache and the sampler.
//!
//! Activations are f32; weights are f32/bf16/f16 or GGUF-quantized. The crate
//! knows nothing about requests or scheduling: it maps token ids to logits.

pub mod config;
pub mod error;
pub mod forward_batch;
pub mod kv_cache;
pub mod layers;
pub mod loader;
pub mod paged_kv;
pub mod quant;
pub mod qwen2;
pub mod sampler;

pub use config::{Qwen2Config, WeightDtype};
pub use error::{ModelError, Result};
pub use forward_batch::{ForwardBatch, SeqSpan};
pub use kv_cache::SequenceKvCache;
pub use loader::ModelFormat;
pub use paged_kv::PagedKvCache;
pub use qwen2::{DtypeChoice, LoadOptions, LoadedModel, LogitsFor, Qwen2Model};
