//! Decode linear layers' bandwidth: bytes of weights a GEMV reads ÷ its time (CUDA events around
//! `ITERS` launches), for each matrix of a Qwen2.5-0.5B and -1.5B layer, bf16 and packed (the
//! demo files' types), 1 and 8 rows, next to the device's measured copy bandwidth; the bf16 GEMV
//! beside cuBLAS, and the fused gate/up (SiLU·mul) and QKV (bias, RoPE, cache write) launches
//! beside the GEMV followed by the kernel they absorb; and steps of 16 to 256 rows over the packed
//! matrices: cuBLAS on bf16, expansion then cuBLAS, and the tiled GEMM over the blocks. Weights are random bytes (a packed
//! block's values do not change its speed); nothing is checked here (`parity.rs` does that).
//!
//! `cargo bench -p novainfer-cuda --features cuda --bench gemv`; `scripts/gpu-test run` runs
//! the binary `scripts/gpu-test build` stages. Without a GPU it prints why and exits 0, unless
//! `NOVAINFER_REQUIRE_GPU` is set (then it exits 1).

use std::process::ExitCode;

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
fn main() -> ExitCode {
    common::run("gemv", bench::run)
}

#[cfg(not(feature = "cuda"))]
fn main() -> ExitCode {
    println!("gemv bench: skipped: built without the `cuda` feature");
    ExitCode::SUCCESS
}

#[cfg(feature = "cuda")]
mod bench {
    use half::bf16;
    use novainfer_cuda::cudarc::driver::CudaSlice;
    use novainfer_cuda::ops::gemm::{gemm_bf16, GemmShape};
    use novainfer_cuda::ops::gemv_quant::{
        gemv, gemv_qkv, gemv_silu_mul, GemvWeights, OutColumns, QkvHeads, QkvTokens, WeightRun,
    };
    use novainfer_cuda::ops::kv::KvCacheMut;
    use novainfer_cuda::ops::qkv::{qkv_bias_rope_cache, QkvInput};
    use novainfer_cuda::ops::rope::{RopeHeads, RopeTable};
    use novainfer_cuda::ops::silu_mul::silu_mul_fused;
    use novainfer_cuda::quant_type::QuantType;
    use novainfer_cuda::GpuContext;

    use crate::common::{copy_bandwidth, time_us, Error};

    const ROWS: [usize; 2] = [1, 8];
    const WARMUP: usize = 3;
    const ITERS: usize = 50;
    const SLOTS: usize = 64;

    /// One layer's shape and the packed format of each of its matrices (as the demo GGUFs hold
    /// them: a hidden size that is no multiple of 256 takes Q8_0).
    struct Model {
        name: &'static str,
        hidden: usize,
        intermediate: usize,
        heads: QkvHeads,
        packed: [QuantType; 4],
    }

    const MODELS: [Model; 2] = [
        Model {
            name: "Qwen2.5-0.5B",
            hidden: 896,
            intermediate: 4864,
            heads: QkvHeads {
                num_heads: 14,
                num_kv_heads: 2,
                head_dim: 64,
            },
            packed: [QuantType::Q8_0; 4],
        },
        Model {
            name: "Qwen2.5-1.5B",
            hidden: 1536,
            intermediate: 8960,
            heads: QkvHeads {
                num_heads: 12,
                num_kv_heads: 2,
                head_dim: 128,
            },
            packed: [
                QuantType::Q4K,
                QuantType::Q4K,
                QuantType::Q4K,
                QuantType::Q6K,
            ],
        },
    ];

    /// `n` xorshift bytes; for a bf16 matrix, values in [-1, 1) (no NaN or inf to slow a path).
    fn random_bytes(n: usize, weights: GemvWeights, mut state: u64) -> Vec<u8> {
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        match weights {
            GemvWeights::Bf16 => (0..n / 2)
                .flat_map(|_| {
                    let v = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                    bf16::from_f32(v).to_le_bytes()
                })
                .collect(),
            GemvWeights::Packed(_) => (0..n).map(|_| next() as u8).collect(),
        }
    }

    struct Line {
        text: String,
        copy: f64,
    }

    impl Line {
        fn add(&mut self, what: &str, us: f64, bytes: f64) {
            let rate = bytes / (us / 1e6);
            self.text += &format!(
                "  {what} {us:>7.1} us {:>5.0} GB/s ({:>4.1}%)",
                rate / 1e9,
                100.0 * rate / self.copy
            );
        }
    }

    pub fn run(gpu: &GpuContext) -> Result<(), Error> {
        let copy = copy_bandwidth(gpu)?;
        println!(
            "decode GEMVs on {} ({}): device-to-device copy {:.2} TB/s (read + written); \
             rates are weight bytes read / time, % of copy",
            gpu.device_name(),
            gpu.arch(),
            copy / 1e12
        );
        for model in MODELS {
            let Model {
                hidden: h,
                intermediate: f,
                heads,
                ..
            } = model;
            let hd = heads.head_dim;
            let qkv_rows = heads.total() * hd;
            // (name, rows, k, packed format)
            let mats = [
                ("qkv", qkv_rows, h, model.packed[0]),
                ("o_proj", h, heads.num_heads * hd, model.packed[1]),
                ("gate_up", 2 * f, h, model.packed[2]),
                ("down", h, f, model.packed[3]),
            ];
            let table = RopeTable::new(gpu, hd, 1_000_000.0, 4096)?;
            let bias = gpu.stream().alloc_zeros::<f32>(qkv_rows)?;
            let kv_row = heads.num_kv_heads * hd;
            let (mut kc, mut vc) = (
                gpu.stream().alloc_zeros::<bf16>(SLOTS * kv_row)?,
                gpu.stream().alloc_zeros::<bf16>(SLOTS * kv_row)?,
            );
            let max_rows = *ROWS.iter().max().unwrap_or(&1);
            let values: Vec<bf16> = random_bytes(2 * max_rows * f.max(h), GemvWeights::Bf16, 3)
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect();
            let x: CudaSlice<bf16> = gpu.stream().clone_htod(&values)?;
            let mut y = gpu
                .stream()
                .alloc_zeros::<bf16>(max_rows * 2 * f.max(qkv_rows))?;
            let mut mlp = gpu.stream().alloc_zeros::<bf16>(max_rows * f)?;
            let mut q = gpu
                .stream()
                .alloc_zeros::<bf16>(max_rows * heads.num_heads * hd)?;
            for weights_kind in ["bf16", "packed"] {
                println!("{} layer, {weights_kind} weights:", model.name);
                for &(name, rows, k, packed) in &mats {
                    let weights = if weights_kind == "bf16" {
                        GemvWeights::Bf16
                    } else {
                        GemvWeights::Packed(packed)
                    };
                    let bytes = weights.row_bytes(k) * rows;
                    let w = gpu.stream().clone_htod(&random_bytes(bytes, weights, 5))?;
                    let run = [WeightRun {
                        weights,
                        bytes: w.as_view(),
                        rows,
                    }];
                    for n in ROWS {
                        let mut line = Line {
                            text: format!(
                                "  {name:<7} {rows:>5} x {k:<5} ({weights:?}) {n} row(s):"
                            ),
                            copy,
                        };
                        let xv = x.slice(..n * k);
                        let out = OutColumns { ld: rows, col0: 0 };
                        let us = time_us(gpu, (WARMUP, ITERS), || {
                            let mut yv = y.slice_mut(..n * rows);
                            Ok(gemv(gpu, &run, k, &xv, n, &mut yv, out)?)
                        })?;
                        line.add("gemv", us, bytes as f64);
                        if weights == GemvWeights::Bf16 {
                            // SAFETY: the bytes are the bf16 matrix uploaded above.
                            let wb = unsafe { w.transmute::<bf16>(rows * k) }
                                .ok_or("a bf16 view of the matrix")?;
                            let shape = GemmShape { m: n, n: rows, k };
                            let us = time_us(gpu, (WARMUP, ITERS), || {
                                let mut yv = y.slice_mut(..n * rows);
                                Ok(gemm_bf16(gpu, &xv, &wb, shape, &mut yv)?)
                            })?;
                            line.add("cuBLAS", us, bytes as f64);
                        }
                        if name == "gate_up" {
                            let separate = time_us(gpu, (WARMUP, ITERS), || {
                                gemv(gpu, &run, k, &xv, n, &mut y.slice_mut(..n * rows), out)?;
                                let gu = y.slice(..n * rows);
                                Ok(silu_mul_fused(
                                    gpu,
                                    &gu,
                                    rows / 2,
                                    &mut mlp.slice_mut(..n * f),
                                )?)
                            })?;
                            line.add("gemv+silu", separate, bytes as f64);
                            let fused = time_us(gpu, (WARMUP, ITERS), || {
                                let mut mv = mlp.slice_mut(..n * f);
                                Ok(gemv_silu_mul(gpu, &run, k, &xv, n, &mut mv)?)
                            })?;
                            line.add("fused", fused, bytes as f64);
                        }
                        if name == "qkv" {
                            let positions: Vec<i32> = (0..n as i32).map(|i| 100 + i).collect();
                            let slots: Vec<i64> = (0..n as i64).collect();
                            let pos = gpu.stream().clone_htod(&positions)?;
                            let slot = gpu.stream().clone_htod(&slots)?;
                            let rope_heads = RopeHeads {
                                num_heads: heads.num_heads,
                                num_kv_heads: heads.num_kv_heads,
                            };
                            let separate = time_us(gpu, (WARMUP, ITERS), || {
                                gemv(gpu, &run, k, &xv, n, &mut y.slice_mut(..n * rows), out)?;
                                let input = QkvInput {
                                    qkv: y.slice(..n * rows),
                                    bias: Some(bias.as_view()),
                                    positions: pos.as_view(),
                                    slot_mapping: slot.as_view(),
                                };
                                let cache = KvCacheMut {
                                    k: kc.as_view_mut(),
                                    v: vc.as_view_mut(),
                                };
                                let mut qv = q.slice_mut(..n * heads.num_heads * hd);
                                Ok(qkv_bias_rope_cache(
                                    gpu, &table, rope_heads, input, &mut qv, cache,
                                )?)
                            })?;
                            line.add("gemv+qkv", separate, bytes as f64);
                            let fused = time_us(gpu, (WARMUP, ITERS), || {
                                let tokens = QkvTokens {
                                    bias: Some(bias.as_view()),
                                    positions: pos.as_view(),
                                    slot_mapping: slot.as_view(),
                                };
                                let cache = KvCacheMut {
                                    k: kc.as_view_mut(),
                                    v: vc.as_view_mut(),
                                };
                                let mut qv = q.slice_mut(..n * heads.num_heads * hd);
                                Ok(gemv_qkv(
                                    gpu, &table, heads, &run, k, &xv, &tokens, &mut qv, cache,
                                )?)
                            })?;
                            line.add("fused", fused, bytes as f64);
                        }
                        println!("{}", line.text);
                    }
                }
            }
        }
        batches(gpu, copy)
    }

    /// Steps of more rows than the GEMV takes, over each packed matrix of a layer: cuBLAS on the
    /// bf16 matrix, the packed matrix expanded into a scratch then cuBLAS
    /// (`NOVAINFER_CUDA_PACKED_GEMM=expand`), and the tiled GEMM decoding tiles in shared memory
    /// (`tile`). Rates are the weight bytes each reads (bf16 or packed) over its time.
    fn batches(gpu: &GpuContext, copy: f64) -> Result<(), Error> {
        use novainfer_cuda::ops::dequant::dequantize;
        use novainfer_cuda::ops::gemv_quant::gemm_packed;
        // Up to a 4,096-token prompt: where the tiled GEMM, which decodes each weight tile once per
        // 64 rows, may lose to one expansion and cuBLAS.
        const BATCH_ROWS: [usize; 5] = [16, 64, 256, 1024, 4096];
        let most = *BATCH_ROWS.iter().max().unwrap_or(&1);
        for model in MODELS {
            let Model {
                hidden: h,
                intermediate: f,
                heads,
                ..
            } = model;
            let hd = heads.head_dim;
            let mats = [
                ("qkv", heads.total() * hd, h, model.packed[0]),
                ("o_proj", h, heads.num_heads * hd, model.packed[1]),
                ("gate_up", 2 * f, h, model.packed[2]),
                ("down", h, f, model.packed[3]),
            ];
            println!("{} layer, steps of {BATCH_ROWS:?} rows:", model.name);
            let values: Vec<bf16> = random_bytes(2 * most * f.max(h), GemvWeights::Bf16, 7)
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect();
            let x: CudaSlice<bf16> = gpu.stream().clone_htod(&values)?;
            let mut y = gpu.stream().alloc_zeros::<bf16>(most * 2 * f.max(h))?;
            let mut partials = gpu
                .stream()
                .alloc_zeros::<f32>(novainfer_cuda::gemm_tile::PARTIALS)?;
            for &(name, rows, k, packed) in &mats {
                let weights = GemvWeights::Packed(packed);
                let packed_bytes = weights.row_bytes(k) * rows;
                let bf16_bytes = GemvWeights::Bf16.row_bytes(k) * rows;
                let wp = gpu
                    .stream()
                    .clone_htod(&random_bytes(packed_bytes, weights, 9))?;
                let wb = gpu.stream().clone_htod(
                    &random_bytes(bf16_bytes, GemvWeights::Bf16, 11)
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                        .collect::<Vec<_>>(),
                )?;
                let mut scratch = gpu.stream().alloc_zeros::<bf16>(rows * k)?;
                let run = [WeightRun {
                    weights,
                    bytes: wp.as_view(),
                    rows,
                }];
                for n in BATCH_ROWS {
                    let mut line = Line {
                        text: format!("  {name:<7} {rows:>5} x {k:<5} ({weights:?}) {n:>3} rows:"),
                        copy,
                    };
                    let xv = x.slice(..n * k);
                    let shape = GemmShape { m: n, n: rows, k };
                    let us = time_us(gpu, (WARMUP, ITERS), || {
                        let mut yv = y.slice_mut(..n * rows);
                        Ok(gemm_bf16(gpu, &xv, &wb.as_view(), shape, &mut yv)?)
                    })?;
                    line.add("cuBLAS bf16", us, bf16_bytes as f64);
                    let us = time_us(gpu, (WARMUP, ITERS), || {
                        let mut sv = scratch.as_view_mut();
                        dequantize(gpu, packed, &wp.as_view(), &mut sv)?;
                        let mut yv = y.slice_mut(..n * rows);
                        Ok(gemm_bf16(gpu, &xv, &scratch.as_view(), shape, &mut yv)?)
                    })?;
                    line.add("expand", us, packed_bytes as f64);
                    // As the executor splits it (16 MiB of partial sums).
                    let splits = novainfer_cuda::gemm_tile::splits(
                        rows,
                        n,
                        k,
                        gpu.multiprocessor_count(),
                        partials.len(),
                    );
                    let us = time_us(gpu, (WARMUP, ITERS), || {
                        let mut yv = y.slice_mut(..n * rows);
                        let mut pv = partials.as_view_mut();
                        let out = OutColumns { ld: rows, col0: 0 };
                        Ok(gemm_packed(
                            gpu, &run, k, &xv, n, &mut yv, out, splits, &mut pv,
                        )?)
                    })?;
                    line.add(&format!("tile/{splits}"), us, packed_bytes as f64);
                    println!("{}", line.text);
                }
            }
        }
        Ok(())
    }
}
