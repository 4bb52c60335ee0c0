//! Which library runs the executor's GEMMs (cuBLAS's `cublasGemmEx` by default; cuBLASLt with one
//! algorithm a shape, split-K avoided, with `NOVAINFER_CUDA_GEMM=lt`), read when a context opens.
//! cuBLASLt is opt-in until a GPU run has compared it (`parity.rs`, the `gemv` bench).

/// The environment variable choosing [`GemmLibrary`].
pub const GEMM_ENV: &str = "NOVAINFER_CUDA_GEMM";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmLibrary {
    /// `cublasGemmEx` with the default algorithm, its heuristic asked every call.
    #[default]
    Cublas,
    /// cuBLASLt: per shape, the fastest algorithm without split-K, chosen once and cached.
    CublasLt,
}

impl GemmLibrary {
    /// The choice `value` names; anything but `cublas`, `lt` or nothing is an error naming the
    /// variable.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "" | "cublas" => Ok(Self::Cublas),
            "lt" | "cublaslt" => Ok(Self::CublasLt),
            other => Err(format!("{GEMM_ENV}={other:?}: expected `cublas` or `lt`")),
        }
    }

    /// The choice in this process's environment.
    pub fn from_env() -> Result<Self, String> {
        Self::parse(&std::env::var(GEMM_ENV).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cublas_unless_lt_is_named() {
        assert_eq!(GemmLibrary::parse(""), Ok(GemmLibrary::Cublas));
        assert_eq!(GemmLibrary::parse("cublas"), Ok(GemmLibrary::Cublas));
        assert_eq!(GemmLibrary::parse(" lt "), Ok(GemmLibrary::CublasLt));
        let err = GemmLibrary::parse("fast").expect_err("not a choice");
        assert!(err.contains(GEMM_ENV), "{err}");
    }
}
