//! Decode attention bandwidth: bytes of K and V a decode step reads ÷ the time of the step's
//! attention (both phases, CUDA events around `ITERS` launches), for the grouped first phase
//! with whole groups per block, the one `paged_attention_decode` picks (where it differs) and
//! the per-head one, Qwen2.5-0.5B's and 1.5B's head geometry, batch 1/16/64 and
//! histories of 1k/4k/16k positions, next to the device's measured copy bandwidth.
//!
//! `cargo bench -p novainfer-cuda --features cuda --bench attention`; `scripts/gpu-test run`
//! runs the binary `scripts/gpu-test build` stages. Without a GPU it prints why and exits 0,
//! unless `NOVAINFER_REQUIRE_GPU` is set (then it exits 1).

use std::process::ExitCode;

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
fn main() -> ExitCode {
    common::run("decode attention", bench::run)
}

#[cfg(not(feature = "cuda"))]
fn main() -> ExitCode {
    println!("decode attention bench: skipped: built without the `cuda` feature");
    ExitCode::SUCCESS
}

#[cfg(feature = "cuda")]
mod bench {
    use half::bf16;
    use novainfer_cuda::cudarc::driver::CudaSlice;
    use novainfer_cuda::ops::paged_attention::{
        decode_kernel_for, paged_attention_decode_with, AttentionConfig, DecodeKernel,
        DecodeScratch, PagedKv,
    };
    use novainfer_cuda::GpuContext;

    use crate::common::{copy_bandwidth, time_us, Error};

    const BATCHES: [usize; 3] = [1, 16, 64];
    const CONTEXTS: [usize; 3] = [1024, 4096, 16384];
    const BLOCK_SIZE: usize = 16;
    const WARMUP: usize = 3;
    const ITERS: usize = 20;

    /// (name, num_heads, num_kv_heads, head_dim) of one layer.
    const MODELS: [(&str, usize, usize, usize); 2] = [
        ("Qwen2.5-0.5B (14/2 heads, head_dim 64)", 14, 2, 64),
        ("Qwen2.5-1.5B (12/2 heads, head_dim 128)", 12, 2, 128),
    ];

    /// xorshift values in [-1, 1) as bf16: cheap enough for a GiB of pool.
    fn random_bf16(n: usize, mut state: u64) -> Vec<bf16> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                bf16::from_f32((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect()
    }

    pub fn run(gpu: &GpuContext) -> Result<(), Error> {
        let copy = copy_bandwidth(gpu)?;
        println!(
            "decode attention on {} ({}): device-to-device copy {:.2} TB/s (read + written)",
            gpu.device_name(),
            gpu.arch(),
            copy / 1e12
        );
        println!("bytes = K and V rows read (batch · context · num_kv_heads · head_dim · 2 · 2 B)");
        for (name, num_heads, num_kv_heads, head_dim) in MODELS {
            println!("{name}, bf16, block size {BLOCK_SIZE}:");
            let max_batch = *BATCHES.iter().max().unwrap_or(&1);
            let max_ctx = *CONTEXTS.iter().max().unwrap_or(&1);
            let row = num_kv_heads * head_dim;
            let num_blocks = max_batch * max_ctx.div_ceil(BLOCK_SIZE);
            let pool = random_bf16(num_blocks * BLOCK_SIZE * row, 7);
            let k: CudaSlice<bf16> = gpu.stream().clone_htod(&pool)?;
            let v: CudaSlice<bf16> = gpu.stream().clone_htod(&pool)?;
            drop(pool);
            for batch in BATCHES {
                for ctx in CONTEXTS {
                    let max_blocks = ctx.div_ceil(BLOCK_SIZE);
                    // Sequence s owns blocks s, s + batch, s + 2·batch, …: not contiguous.
                    let tables: Vec<i32> = (0..batch)
                        .flat_map(|s| (0..max_blocks).map(move |b| (b * batch + s) as i32))
                        .collect();
                    let lens = vec![ctx as i32; batch];
                    let cfg = AttentionConfig {
                        num_heads,
                        num_kv_heads,
                        head_dim,
                        block_size: BLOCK_SIZE,
                        max_blocks_per_seq: max_blocks,
                    };
                    let dt = gpu.stream().clone_htod(&tables)?;
                    let dl = gpu.stream().clone_htod(&lens)?;
                    let q = gpu
                        .stream()
                        .clone_htod(&random_bf16(batch * num_heads * head_dim, 11))?;
                    let mut out = gpu
                        .stream()
                        .alloc_zeros::<bf16>(batch * num_heads * head_dim)?;
                    let mut scratch = DecodeScratch::new(gpu, &cfg, batch, ctx)?;
                    let bytes = (batch * ctx * row * 2 * 2) as f64;
                    let mut line = format!("  batch {batch:>2}, context {ctx:>5}:");
                    let picked = {
                        let kv = PagedKv {
                            k_cache: k.as_view(),
                            v_cache: v.as_view(),
                            block_tables: dt.as_view(),
                            seq_lens: dl.as_view(),
                        };
                        decode_kernel_for(gpu, &cfg, &kv, ctx)
                    };
                    let whole = DecodeKernel::Grouped {
                        heads_per_block: num_heads / num_kv_heads,
                    };
                    let mut kernels = vec![whole, DecodeKernel::PerHead];
                    if picked != whole {
                        kernels.insert(1, picked);
                    }
                    for kernel in kernels {
                        let us = time_us(gpu, (WARMUP, ITERS), || {
                            let kv = PagedKv {
                                k_cache: k.as_view(),
                                v_cache: v.as_view(),
                                block_tables: dt.as_view(),
                                seq_lens: dl.as_view(),
                            };
                            paged_attention_decode_with(
                                gpu,
                                kernel,
                                &cfg,
                                &q.as_view(),
                                kv,
                                ctx,
                                &mut scratch,
                                &mut out.as_view_mut(),
                            )?;
                            Ok(())
                        })?;
                        let rate = bytes / (us / 1e6);
                        let name = match kernel {
                            DecodeKernel::Grouped { heads_per_block } => {
                                format!("grouped/{heads_per_block}")
                            }
                            DecodeKernel::PerHead => "per-head".to_owned(),
                        };
                        line += &format!(
                            "  {name} {:>8.1} us {:>6.0} GB/s ({:>4.1}% of copy)",
                            us,
                            rate / 1e9,
                            100.0 * rate / copy
                        );
                    }
                    println!("{line}");
                }
            }
        }
        Ok(())
    }
}
