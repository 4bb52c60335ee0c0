//! Qwen2 model execution: checkpoint loading (HF safetensors, GGUF), the forward pass on
//! the CPU (and, with feature `cuda`, on a GPU) behind one [`Executor`] seam, a
//! per-sequence KV cache and the sampler.
//!
//! Activations are f32; weights are f32/bf16/f16 or GGUF-quantized. The crate
//! knows nothing about requests or scheduling: it maps token ids to logits.

pub mod capabilities;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod draw;
pub mod error;
pub mod executor;
pub mod forward_batch;
pub mod fp8_blocks;
pub mod gpu_weight_dtype;
pub mod int4;
pub mod kernel_select;
pub mod kv_cache;
pub mod kv_dtype;
mod large_buffer;
pub mod layers;
pub mod lm_head_dtype;
pub mod loader;
pub mod lora;
pub mod memory_bandwidth;
pub mod paged_kv;
pub mod parallel;
pub mod prepare;
pub mod quant;
pub mod qwen2;
pub mod rope_scaling;
pub mod sampler;
pub mod weight_quantization;

pub use capabilities::{Capabilities, DeviceSampling};
pub use config::{Qwen2Config, WeightDtype};
pub use cpu::{CpuExecutor, CpuWeights};
pub use device::{Device, DeviceChoice};
pub use error::{ModelError, Result};
pub use executor::{
    load_weights, DeviceMemory, DeviceWeights, Enqueued, Executor, PassTicket, StepLimits,
};
pub use forward_batch::{
    Adjust, Draw, DrawRule, DrawnToken, ForwardBatch, ForwardOutput, SeqSpan, SpanOutput,
};
pub use gpu_weight_dtype::GpuWeightDtype;
pub use kv_cache::SequenceKvCache;
pub use kv_dtype::{KvCacheDtype, KvStorage};
pub use lm_head_dtype::LmHeadDtype;
pub use loader::{Checkpoint, ModelFormat, OpenedCheckpoint};
pub use lora::{AdapterLimits, AdapterRef, LoraAdapter};
pub use novainfer_cuda::gemm_choice::{GemmLibrary, GEMM_ENV};
pub use paged_kv::PagedKvCache;
pub use parallel::{HeadShard, TensorParallel};
pub use prepare::graph::CudaGraphs;
pub use prepare::linear::{DecodeLinear, PackedGemm, DECODE_LINEAR_ENV, PACKED_GEMM_ENV};
pub use qwen2::{DtypeChoice, LoadOptions, LoadedModel, LogitsFor, Qwen2Model};
pub use rope_scaling::{RopeScaling, Yarn};
pub use weight_quantization::WeightQuantization;
