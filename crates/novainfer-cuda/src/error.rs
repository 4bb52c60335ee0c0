//! The crate's one error type. Every variant names what failed and, for bad arguments,
//! the parameter and the limit, so a caller can act on the message alone.

use thiserror::Error;

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum CudaError {
    /// No usable CUDA here: the feature is off, libcuda or libnvrtc is missing, or there is
    /// no GPU. Callers fall back to the CPU on this variant and only on this one.
    #[error("CUDA not available: {0}")]
    NotAvailable(String),
    #[error("NVRTC failed to compile kernels/{kernel}.cu for {arch}: {log}")]
    Compile {
        kernel: &'static str,
        arch: String,
        log: String,
    },
    #[error("kernels/{kernel}.cu includes \"{header}\", which is not an embedded header")]
    UnknownInclude {
        kernel: &'static str,
        header: String,
    },
    #[error("CUDA driver call `{op}` failed: {message}")]
    Driver { op: &'static str, message: String },
    #[error("invalid argument `{param}`: {reason}")]
    InvalidArgument { param: &'static str, reason: String },
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl CudaError {
    pub(crate) fn invalid(param: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            param,
            reason: reason.into(),
        }
    }
}
