//! Errors of model loading and execution.
//!
//! Every variant names the file, field or tensor at fault, so a user can act on
//! the message without reading our code.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("model path does not exist: {0}")]
    NotFound(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is neither a Hugging Face model directory (with config.json) nor a .gguf file"
    )]
    UnknownFormat { path: PathBuf },
    #[error("unsupported architecture {found:?}: NovaInfer runs Qwen2-family models ({expected})")]
    UnsupportedArchitecture {
        found: String,
        expected: &'static str,
    },
    #[error("invalid model config field `{field}`: {reason}")]
    InvalidConfig { field: String, reason: String },
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },
    #[error(
        "unexpected tensor `{name}` in the checkpoint (not part of a Qwen2 model with this config)"
    )]
    UnexpectedTensor { name: String },
    #[error("tensor `{name}` has shape {found:?} but the config implies {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedDtype { name: String, dtype: String },
    /// A `quantization_config` (config.json) this engine cannot load, naming the field.
    #[error("unsupported quantization_config: `{field}` = {value} ({supported})")]
    UnsupportedQuantization {
        field: String,
        value: String,
        supported: &'static str,
    },
    /// A quantized layer's tensors (`qweight`, `qzeros`, `scales`, `g_idx`) that do not fit
    /// together or the format.
    #[error("quantized tensor `{name}`: {reason}")]
    InvalidQuantTensor { name: String, reason: String },
    #[error("{path} is truncated or corrupt: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    #[error("unsupported dtype override {0:?}: expected one of auto, f32, bf16, f16")]
    InvalidDtype(String),
    #[error("sequence of {needed} tokens exceeds the KV cache capacity of {capacity} tokens")]
    ContextOverflow { needed: usize, capacity: usize },
    #[error("cannot embed an empty input")]
    EmptyInput,
    #[error("token id {id} is out of range for a vocabulary of {vocab_size}")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("unknown device {0:?}: expected one of {spellings}", spellings = crate::device::DEVICE_SPELLINGS)]
    InvalidDevice(String),
    /// The device asked for cannot be used here (no driver, no NVRTC, no GPU, or a build
    /// without CUDA). Never answered by silently running elsewhere.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable { device: String, reason: String },
    /// A feature this device's executor does not have (yet).
    #[error("{what} is not supported on {device}")]
    Unsupported { what: String, device: String },
    /// A LoRA adapter that cannot serve this base model, naming the field or tensor at fault.
    #[error("LoRA adapter {path}: `{field}` {reason}")]
    Adapter {
        path: PathBuf,
        field: String,
        reason: String,
    },
    /// A failure inside the GPU runtime (a launch, a copy, an allocation).
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("tensor computation failed: {0}")]
    Compute(#[from] candle_core::Error),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::NotFound(path)
        } else {
            ModelError::Io { path, source }
        }
    }

    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ModelError::InvalidConfig {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
