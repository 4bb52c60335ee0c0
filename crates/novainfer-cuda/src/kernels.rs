//! The CUDA sources, embedded at build time, and what NVRTC is handed for each.
//!
//! Invariants: [`KERNELS`] lists every `kernels/*.cu` exactly once (a test reads the
//! directory); a kernel's only include is `common.cuh`, spliced in by [`KernelSource::expand`]
//! because NVRTC gets no include path; [`KernelSource::hash`] covers the expanded text, so
//! editing the header invalidates every cached binary. [`entry_points`] names every
//! `extern "C"` function a launcher uses; the context looks each one up once, and the NVRTC
//! test finds each one in the compiled binary.

use crate::error::{CudaError, Result};
use crate::gemv_plan::{GemvEpilogue, GemvFamily};

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
pub const QKV: KernelSource = kernel!("qkv");
pub const GATHER: KernelSource = kernel!("gather");
pub const FLASH_PREFILL: KernelSource = kernel!("flash_prefill");
pub const LORA: KernelSource = kernel!("lora");
pub const GEMV_QUANT: KernelSource = kernel!("gemv_quant");

pub const KERNELS: &[KernelSource] = &[
    EMBEDDING,
    RMS_NORM,
    ROPE,
    RESHAPE_AND_CACHE,
    PAGED_ATTENTION,
    SILU_MUL,
    SAMPLING,
    DEQUANT,
    QKV,
    GATHER,
    FLASH_PREFILL,
    LORA,
    GEMV_QUANT,
];

/// What NVRTC is handed besides the source. Part of the disk-cache key, so changing a flag
/// can never load a binary built without it.
///
/// `-lineinfo` keeps profiles readable; fmad stays on: kernels that need exact rounding spell
/// it with `__f*_rn` intrinsics, which are never contracted.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
        "-default-device".to_owned(),
        "-lineinfo".to_owned(),
    ]
}

/// An activation dtype a kernel is instantiated for: entry points end in `_f32` / `_bf16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeKind {
    F32,
    Bf16,
}

impl DtypeKind {
    pub const ALL: [DtypeKind; 2] = [DtypeKind::F32, DtypeKind::Bf16];

    pub fn suffix(self) -> &'static str {
        match self {
            DtypeKind::F32 => "f32",
            DtypeKind::Bf16 => "bf16",
        }
    }

    /// Head dims the attention kernels are instantiated for (f32 is a test dtype: no 256).
    pub fn attention_head_dims(self) -> &'static [usize] {
        match self {
            DtypeKind::F32 => &[64, 128],
            DtypeKind::Bf16 => &[64, 128, 256],
        }
    }
}

/// Entry points instantiated once per [`DtypeKind`], as `(kernel, base name)`.
pub const DTYPED_ENTRIES: &[(KernelSource, &str)] = &[
    (EMBEDDING, "embedding_gather"),
    (RMS_NORM, "rms_norm"),
    (RMS_NORM, "add_rms_norm"),
    (ROPE, "rope_neox"),
    (RESHAPE_AND_CACHE, "reshape_and_cache"),
    (SILU_MUL, "silu_mul"),
    (SAMPLING, "argmax"),
    (SAMPLING, "sample"),
    (SAMPLING, "adjust_rows"),
    (SAMPLING, "mask_rows"),
    (SAMPLING, "draw"),
    (DEQUANT, "dequant_q4_k"),
    (DEQUANT, "dequant_q5_0"),
    (DEQUANT, "dequant_q6_k"),
    (DEQUANT, "dequant_q8_0"),
    (DEQUANT, "dequant_int4"),
    (DEQUANT, "dequant_fp8"),
    (DEQUANT, "embed_q4_k"),
    (DEQUANT, "embed_q5_0"),
    (DEQUANT, "embed_q6_k"),
    (DEQUANT, "embed_q8_0"),
    (DEQUANT, "embed_int4"),
    (DEQUANT, "embed_fp8"),
    (QKV, "qkv_bias_rope_cache"),
    (GATHER, "gather_rows"),
    (GATHER, "gather_columns"),
    (LORA, "lora_shrink"),
    (LORA, "lora_expand"),
    (GEMV_QUANT, "gemm_packed"),
    (GEMV_QUANT, "gemm_packed_reduce"),
];

/// Entry points with no dtype suffix (they move token ids), as `(kernel, name)`.
pub const PLAIN_ENTRIES: &[(KernelSource, &str)] = &[(GATHER, "chain_tokens")];

/// The attention kernels' phases: `paged_attention_<phase>_<dtype>_hd<head_dim>`.
/// `decode_grouped` is decode's first phase with the query heads of one KV head in one block;
/// `decode` is the same phase one head per warp (for groups too large for one block).
pub const ATTENTION_PHASES: [&str; 4] = ["decode", "decode_grouped", "merge", "prefill"];

/// Head dims the tensor-core prefill kernel (`kernels/flash_prefill.cu`, bf16 only: the
/// executor's pool dtype) is instantiated for: Qwen2's 64 (0.5B) and 128 (1.5B, 7B).
pub const FLASH_PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

pub fn flash_prefill_entry(head_dim: usize) -> String {
    format!("flash_prefill_bf16_hd{head_dim}")
}

pub fn dtyped_entry(base: &str, dtype: DtypeKind) -> String {
    format!("{base}_{}", dtype.suffix())
}

pub fn attention_entry(phase: &str, dtype: DtypeKind, head_dim: usize) -> String {
    format!("paged_attention_{phase}_{}_hd{head_dim}", dtype.suffix())
}

/// Every entry point a launcher uses, with the file that defines it.
pub fn entry_points() -> Vec<(KernelSource, String)> {
    let mut out: Vec<(KernelSource, String)> = PLAIN_ENTRIES
        .iter()
        .map(|&(k, name)| (k, name.to_owned()))
        .collect();
    for hd in FLASH_PREFILL_HEAD_DIMS {
        out.push((FLASH_PREFILL, flash_prefill_entry(hd)));
    }
    for dtype in DtypeKind::ALL {
        for (kernel, base) in DTYPED_ENTRIES {
            out.push((*kernel, dtyped_entry(base, dtype)));
        }
        // The suffix is the output dtype; the activations are bf16 in every GEMV.
        for epilogue in GemvEpilogue::ALL {
            for family in GemvFamily::ALL {
                let base = family.entry_base(epilogue);
                out.push((GEMV_QUANT, dtyped_entry(&base, dtype)));
            }
        }
        for &hd in dtype.attention_head_dims() {
            for phase in ATTENTION_PHASES {
                out.push((PAGED_ATTENTION, attention_entry(phase, dtype, hd)));
            }
        }
    }
    out
}

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
    fn entry_points_are_unique() {
        let mut names: Vec<String> = entry_points().into_iter().map(|(_, n)| n).collect();
        let total = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), total);
        assert!(names.contains(&"paged_attention_merge_bf16_hd256".to_owned()));
        assert!(names.contains(&"paged_attention_decode_grouped_bf16_hd64".to_owned()));
        assert!(names.contains(&"qkv_bias_rope_cache_bf16".to_owned()));
        for name in [
            "gemv_packed_f32",
            "gemv_bf16w_bf16",
            "gemv_silu_packed_bf16",
            "gemv_qkv_bf16w_f32",
        ] {
            assert!(names.contains(&name.to_owned()), "{name}");
        }
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
