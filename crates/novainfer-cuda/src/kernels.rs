//! The CUDA sources, embedded at build time, and what NVRTC is handed for each.
//!
//! Invariants: [`KERNELS`] lists every `kernels/*.cu` exactly once (a test reads the
//! directory); a kernel's only include is `common.cuh`, spliced in by [`KernelSource::expand`]
//! because NVRTC gets no include path; [`KernelSource::hash`] covers the expanded text, so
//! editing the header invalidates every cached binary.

use crate::error::{CudaError, Result};

/// The shared header every kernel includes.
pub const COMMON_HEADER: &str = include_str!("../../../kernels/common.cuh");

/// One `kernels/<name>.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
}

macro_rules! kernel {
    ($name:literal) => {
        KernelSource {
            name: $name,
            source: include_str!(concat!("../../../kernels/", $name, ".cu")),
        }
    };
}

pub const EMBEDDING: KernelSource = kernel!("embedding");
pub const RMS_NORM: KernelSource = kernel!("rms_norm");
pub const ROPE: KernelSource = kernel!("rope");
pub const RESHAPE_AND_CACHE: KernelSource = kernel!("reshape_and_cache");
pub const PAGED_ATTENTION: KernelSource = kernel!("paged_attention");
pub const SILU_MUL: KernelSource = kernel!("silu_mul");
pub const SAMPLING: KernelSource = kernel!("sampling");
pub const DEQUANT: KernelSource = kernel!("dequant");

pub const KERNELS: &[KernelSource] = &[
    EMBEDDING,
    RMS_NORM,
    ROPE,
    RESHAPE_AND_CACHE,
    PAGED_ATTENTION,
    SILU_MUL,
    SAMPLING,
    DEQUANT,
];

impl KernelSource {
    /// The source with `#include "common.cuh"` replaced by the header's text.
    pub fn expand(&self) -> Result<String> {
        let mut out = String::with_capacity(self.source.len() + COMMON_HEADER.len());
        for line in self.source.lines() {
            let trimmed = line.trim_start();
            if let Some(rest) = trimmed.strip_prefix("#include") {
                let header = rest
                    .trim()
                    .trim_matches(|c| c == '"' || c == '<' || c == '>');
                if header != "common.cuh" {
                    return Err(CudaError::UnknownInclude {
                        kernel: self.name,
                        header: header.to_owned(),
                    });
                }
                out.push_str(COMMON_HEADER);
            } else {
                out.push_str(line);
            }
            out.push('\n');
        }
        Ok(out)
    }

    /// xxh3 of the expanded source: the source part of the cache key.
    pub fn hash(&self) -> Result<u64> {
        Ok(xxhash_rust::xxh3::xxh3_64(self.expand()?.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cu_file_is_embedded_once() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("kernels/ exists")
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(".cu").map(str::to_owned)
            })
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = KERNELS.iter().map(|k| k.name.to_owned()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
    }

    #[test]
    fn expand_splices_the_header_and_nothing_else_is_included() {
        for k in KERNELS {
            let text = k.expand().expect("only common.cuh is included");
            assert!(
                !text.lines().any(|l| l.trim_start().starts_with("#include")),
                "{} still includes a file",
                k.name
            );
            assert!(text.contains("f32_to_bf16"), "{} lacks the header", k.name);
        }
        let bad = KernelSource {
            name: "bad",
            source: "#include <cuda_bf16.h>\n",
        };
        assert!(matches!(
            bad.expand(),
            Err(CudaError::UnknownInclude { header, .. }) if header == "cuda_bf16.h"
        ));
    }

    #[test]
    fn hash_depends_on_the_source() {
        let a = KernelSource {
            name: "a",
            source: "x",
        };
        let b = KernelSource {
            name: "a",
            source: "y",
        };
        assert_ne!(a.hash().expect("hash"), b.hash().expect("hash"));
        assert_eq!(a.hash().expect("hash"), a.hash().expect("hash"));
    }
}
