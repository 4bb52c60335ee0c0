//! Every kernel compiles with NVRTC for the architectures we ship (sm_80, sm_90), with no
//! GPU: CI runs this with the `nvidia-cuda-nvrtc==13.0.88` wheel.

#![cfg(feature = "cuda")]

mod common;

use novainfer_cuda::cache::KernelCache;
use novainfer_cuda::kernels::{self, entry_points, KernelSource, KERNELS};
use novainfer_cuda::{cached_cubin_with_origin, nvrtc};

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let Some(()) = common::nvrtc_or_skip() else {
        return;
    };
    let version = nvrtc::version().expect("nvrtc version");
    println!("NVRTC {}.{}", version.major, version.minor);
    let entries = entry_points();
    assert!(entries.iter().all(|(k, _)| KERNELS.contains(k)));
    for arch in ARCHS {
        for kernel in KERNELS {
            let cubin = nvrtc::compile_cubin(kernel, arch).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{} for {arch} is not an ELF cubin",
                kernel.name
            );
            for (_, name) in entries.iter().filter(|(k, _)| k == kernel) {
                // The symbol table holds each entry's name NUL-terminated.
                let symbol = [name.as_bytes(), b"\0"].concat();
                assert!(
                    contains(&cubin, &symbol),
                    "{arch} {}: no entry `{name}`",
                    kernel.name
                );
            }
            println!(
                "compiled kernels/{}.cu for {arch}: {} bytes",
                kernel.name,
                cubin.len()
            );
        }
    }
}

#[test]
fn the_disk_cache_compiles_once_then_hits() {
    let Some(()) = common::nvrtc_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = KernelCache::new(dir.path());
    let (first, hit) =
        cached_cubin_with_origin(&cache, &kernels::SILU_MUL, "sm_80").expect("compile");
    assert!(!hit, "an empty cache cannot hit");
    let (second, hit) =
        cached_cubin_with_origin(&cache, &kernels::SILU_MUL, "sm_80").expect("load");
    assert!(hit, "the second request must come from disk");
    assert_eq!(first, second);
    let (_, hit) = cached_cubin_with_origin(&cache, &kernels::SILU_MUL, "sm_90").expect("compile");
    assert!(!hit, "another arch is another key");
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 2);
}

#[test]
fn a_compile_error_carries_the_nvrtc_log() {
    let Some(()) = common::nvrtc_or_skip() else {
        return;
    };
    let broken = KernelSource {
        name: "broken",
        source: "extern \"C\" __global__ void f() { undeclared_thing(); }",
    };
    let err = nvrtc::compile_cubin(&broken, "sm_80").expect_err("must not compile");
    let text = err.to_string();
    assert!(
        text.contains("kernels/broken.cu") && text.contains("undeclared_thing"),
        "{text}"
    );
}

#[test]
fn split_and_thread_constants_agree_with_the_kernels() {
    use novainfer_cuda::ops::{
        paged_attention::{ATTN_MAX_GROUP, ATTN_SPLIT},
        rms_norm::RMS_THREADS,
        sampling::SAMPLE_THREADS,
    };
    let has =
        |k: &KernelSource, line: String| assert!(k.source.contains(&line), "{}: {line}", k.name);
    has(
        &kernels::PAGED_ATTENTION,
        format!("#define ATTN_SPLIT {ATTN_SPLIT}\n"),
    );
    has(
        &kernels::PAGED_ATTENTION,
        format!("#define ATTN_MAX_GROUP {ATTN_MAX_GROUP}\n"),
    );
    has(
        &kernels::RMS_NORM,
        format!("#define RMS_THREADS {RMS_THREADS}\n"),
    );
    has(
        &kernels::SAMPLING,
        format!("#define SAMPLE_THREADS {SAMPLE_THREADS}\n"),
    );
    use novainfer_cuda::gemm_tile::{THREADS, TILE_K, TILE_M, TILE_N};
    for (name, value) in [
        ("GEMM_TILE_M", TILE_M),
        ("GEMM_TILE_N", TILE_N),
        ("GEMM_TILE_K", TILE_K),
        ("GEMM_TILE_THREADS", THREADS),
    ] {
        has(&kernels::GEMV_QUANT, format!("#define {name} {value}\n"));
    }
    use novainfer_cuda::gemv_plan::{CHUNK, MAX_ROWS, WARPS};
    has(
        &kernels::GEMV_QUANT,
        format!("#define GEMV_WARPS {WARPS}\n"),
    );
    has(
        &kernels::GEMV_QUANT,
        format!("#define GEMV_MAX_ROWS {MAX_ROWS}\n"),
    );
    has(
        &kernels::GEMV_QUANT,
        format!("#define GEMV_CHUNK {CHUNK}\n"),
    );
    use novainfer_cuda::gemv_plan::{GemvWeights, MAX_PARTS, UNROLL};
    use novainfer_cuda::quant_type::QuantType;
    has(
        &kernels::GEMV_QUANT,
        format!("#define GEMV_MAX_PARTS {MAX_PARTS}\n"),
    );
    has(
        &kernels::GEMV_QUANT,
        format!("#define GEMV_UNROLL {UNROLL} "),
    );
    // A run's format travels as GemvWeights::index.
    for (name, weights) in [
        ("GEMV_Q4_K", GemvWeights::Packed(QuantType::Q4K)),
        ("GEMV_Q5_0", GemvWeights::Packed(QuantType::Q5_0)),
        ("GEMV_Q6_K", GemvWeights::Packed(QuantType::Q6K)),
        ("GEMV_Q8_0", GemvWeights::Packed(QuantType::Q8_0)),
        ("GEMV_INT4", GemvWeights::Packed(QuantType::Int4)),
        ("GEMV_FP8", GemvWeights::Packed(QuantType::Fp8)),
        ("GEMV_BF16W", GemvWeights::Bf16),
    ] {
        has(
            &kernels::GEMV_QUANT,
            format!("#define {name} {}\n", weights.index()),
        );
    }
}
