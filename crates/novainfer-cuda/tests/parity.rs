//! CPU ↔ CUDA parity: one body per op, the CPU (`novainfer-model`, candle, or this crate's
//! `reference`) as the oracle, within per-dtype tolerances, plus batch-invariance checks.
//!
//! These need a GPU. Without one each test prints "<op>: skipped: no CUDA device (<why>)"
//! and returns (a runtime skip, so the same `cargo test -p novainfer-cuda --features cuda`
//! runs them for real on a GPU machine; add `-- --nocapture` to see the skip lines).

#![cfg(feature = "cuda")]

mod common;
mod gemm_lt;
mod gemv_fused;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::host::{assert_close, cast, down, gemv_matrix, up, zeros, Rng, TestDtype};
use half::bf16;
use novainfer_cuda::gemv_plan::GemvWeights;
use novainfer_cuda::ops::dequant::{dequantize, QuantType};
use novainfer_cuda::ops::embedding::{embedding, EmbeddingShape};
use novainfer_cuda::ops::paged_attention::{
    paged_attention_decode, paged_attention_prefill, AttentionConfig, DecodeScratch, PagedKv,
};
use novainfer_cuda::ops::reshape_and_cache::reshape_and_cache;
use novainfer_cuda::ops::rms_norm::{add_rms_norm, rms_norm};
use novainfer_cuda::ops::rope::{rope_neox, RopeHeads, RopeTable};
use novainfer_cuda::ops::sampling::{
    adjust_rows, argmax, draw, mask_rows, sample, DrawMode, RowEdit, RowEdits, RowPenalties,
    TopLogprobs, MAX_TOP_LOGPROBS,
};
use novainfer_cuda::ops::silu_mul::{silu_mul, silu_mul_fused};
use novainfer_cuda::ops::DtypeKind;
use novainfer_cuda::{reference, GpuContext, SampleParams};
use novainfer_model::layers::{self, ops as cpu};

// ---- ops -------------------------------------------------------------------------------

fn embedding_body<T: TestDtype>(gpu: &GpuContext) {
    let (vocab, hidden) = (50, 96);
    let mut rng = Rng(1);
    let table_f32: Vec<f32> = rng.vec(vocab * hidden, 2.0);
    let table: Vec<bf16> = table_f32.iter().map(|&v| bf16::from_f32(v)).collect();
    let ids = [3u32, 0, 49, 3, 1000];
    let mut out = zeros::<T>(gpu, ids.len() * hidden);
    let shape = EmbeddingShape {
        vocab_size: vocab,
        hidden,
    };
    embedding(
        gpu,
        &up(gpu, &ids).as_view(),
        &up(gpu, &table).as_view(),
        shape,
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let got = down(gpu, &out);
    let cpu_table = Tensor::from_vec(table.clone(), (vocab, hidden), &Device::Cpu).expect("tensor");
    let expected = layers::Embedding::Dense(cpu_table)
        .forward(&ids[..4])
        .expect("cpu embedding");
    // bf16 → f32 and bf16 → bf16 are exact: no tolerance.
    for (i, (g, c)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.to_f32(), *c, "embedding element {i}");
    }
    assert!(
        got[4 * hidden..].iter().all(|v| v.to_f32() == 0.0),
        "out-of-vocab id gives zeros"
    );
}

#[test]
fn embedding_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("embedding") else {
        return;
    };
    embedding_body::<f32>(&gpu);
    embedding_body::<bf16>(&gpu);
}

fn rms_norm_body<T: TestDtype>(gpu: &GpuContext) {
    let (rows, dim, eps) = (5, 896, 1e-6f32);
    let mut rng = Rng(2);
    let (x, x32) = cast::<T>(&rng.vec(rows * dim, 3.0));
    let (res, res32) = cast::<T>(&rng.vec(rows * dim, 3.0));
    let w = rng.vec(dim, 1.5);
    let (dx, dw) = (up(gpu, &x), up(gpu, &w));
    let mut out = zeros::<T>(gpu, rows * dim);
    rms_norm(
        gpu,
        &dx.as_view(),
        &dw.as_view(),
        eps,
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let got = down(gpu, &out);
    assert_close("rms_norm", &got, &cpu::rms_norm(&x32, &w, f64::from(eps)));

    // Batch invariance: a row alone gives the same bits as inside the batch.
    let mut alone = zeros::<T>(gpu, dim);
    rms_norm(
        gpu,
        &up(gpu, &x[2 * dim..3 * dim]).as_view(),
        &dw.as_view(),
        eps,
        &mut alone.as_view_mut(),
    )
    .expect("launch");
    let alone = down(gpu, &alone);
    assert!(alone
        .iter()
        .zip(&got[2 * dim..])
        .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()));

    let mut dres = up(gpu, &res);
    add_rms_norm(
        gpu,
        &dx.as_view(),
        &mut dres.as_view_mut(),
        &dw.as_view(),
        eps,
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let summed: Vec<T> = x32
        .iter()
        .zip(&res32)
        .map(|(a, b)| T::from_f32(a + b))
        .collect();
    let summed32: Vec<f32> = summed.iter().map(|v| v.to_f32()).collect();
    // The residual add is one IEEE f32 addition rounded to T, on the device as here.
    let fused_residual = down(gpu, &dres);
    assert!(
        fused_residual
            .iter()
            .zip(&summed)
            .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
        "add_rms_norm residual [{}]: residual + x rounded once",
        T::KIND.suffix()
    );
    let fused = down(gpu, &out);
    assert_close(
        "add_rms_norm",
        &fused,
        &cpu::rms_norm(&summed32, &w, f64::from(eps)),
    );

    // The unfused pair — the add, then `rms_norm` of the stored sum — gives the same bits:
    // the fused kernel norms the residual as stored, in the same order.
    let mut unfused = zeros::<T>(gpu, rows * dim);
    rms_norm(
        gpu,
        &up(gpu, &summed).as_view(),
        &dw.as_view(),
        eps,
        &mut unfused.as_view_mut(),
    )
    .expect("launch");
    assert!(
        down(gpu, &unfused)
            .iter()
            .zip(&fused)
            .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
        "add_rms_norm [{}]: fused and unfused differ",
        T::KIND.suffix()
    );

    // Batch invariance of the fused kernel: row 3 alone, residual and output.
    let mut res_alone = up(gpu, &res[3 * dim..4 * dim]);
    let mut out_alone = zeros::<T>(gpu, dim);
    add_rms_norm(
        gpu,
        &up(gpu, &x[3 * dim..4 * dim]).as_view(),
        &mut res_alone.as_view_mut(),
        &dw.as_view(),
        eps,
        &mut out_alone.as_view_mut(),
    )
    .expect("launch");
    for (what, alone, batch) in [
        (
            "residual",
            down(gpu, &res_alone),
            &fused_residual[3 * dim..4 * dim],
        ),
        ("output", down(gpu, &out_alone), &fused[3 * dim..4 * dim]),
    ] {
        assert!(
            alone
                .iter()
                .zip(batch)
                .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
            "add_rms_norm {what} [{}]: a row alone differs from the batch",
            T::KIND.suffix()
        );
    }
}

#[test]
fn rms_norm_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("rms_norm") else {
        return;
    };
    rms_norm_body::<f32>(&gpu);
    rms_norm_body::<bf16>(&gpu);
}

fn rope_body<T: TestDtype>(gpu: &GpuContext) {
    let (n, nh, nkv, hd, theta) = (6, 14, 2, 64, 1_000_000.0);
    let positions = [0usize, 1, 7, 100, 4095, 31];
    let mut rng = Rng(3);
    let (q, mut q32) = cast::<T>(&rng.vec(n * nh * hd, 2.0));
    let (k, mut k32) = cast::<T>(&rng.vec(n * nkv * hd, 2.0));
    let table = RopeTable::new(gpu, hd, theta, 4096).expect("table");
    let (mut dq, mut dk) = (up(gpu, &q), up(gpu, &k));
    let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let heads = RopeHeads {
        num_heads: nh,
        num_kv_heads: nkv,
    };
    rope_neox(
        gpu,
        &table,
        &mut dq.as_view_mut(),
        &mut dk.as_view_mut(),
        &up(gpu, &pos_i32).as_view(),
        heads,
    )
    .expect("launch");
    let rope = cpu::Rope::new(hd, theta);
    rope.apply(&mut q32, &positions, hd);
    rope.apply(&mut k32, &positions, hd);
    let (gq, gk) = (down(gpu, &dq), down(gpu, &dk));
    if T::KIND == DtypeKind::F32 {
        // Same table, same unfused products: bit for bit.
        assert!(
            gq.iter()
                .zip(&q32)
                .all(|(g, c)| g.to_f32().to_bits() == c.to_bits()),
            "rope q"
        );
        assert!(
            gk.iter()
                .zip(&k32)
                .all(|(g, c)| g.to_f32().to_bits() == c.to_bits()),
            "rope k"
        );
    } else {
        assert_close("rope q", &gq, &q32);
        assert_close("rope k", &gk, &k32);
    }
}

#[test]
fn rope_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("rope") else {
        return;
    };
    rope_body::<f32>(&gpu);
    rope_body::<bf16>(&gpu);
}

fn silu_mul_body<T: TestDtype>(gpu: &GpuContext) {
    let (rows, d) = (3, 4864);
    let mut rng = Rng(4);
    let (gate, g32) = cast::<T>(&rng.vec(rows * d, 6.0));
    let (upv, u32_) = cast::<T>(&rng.vec(rows * d, 2.0));
    let mut out = zeros::<T>(gpu, rows * d);
    silu_mul(
        gpu,
        &up(gpu, &gate).as_view(),
        &up(gpu, &upv).as_view(),
        d,
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let expected = cpu::silu_mul(&g32, &u32_);
    assert_close("silu_mul", &down(gpu, &out), &expected);
    // The fused [rows, 2d] layout gives the same result.
    let mut fused = Vec::with_capacity(2 * rows * d);
    for r in 0..rows {
        fused.extend_from_slice(&gate[r * d..(r + 1) * d]);
        fused.extend_from_slice(&upv[r * d..(r + 1) * d]);
    }
    let mut out2 = zeros::<T>(gpu, rows * d);
    silu_mul_fused(gpu, &up(gpu, &fused).as_view(), d, &mut out2.as_view_mut()).expect("launch");
    assert_close("silu_mul_fused", &down(gpu, &out2), &expected);
}

#[test]
fn silu_mul_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("silu_mul") else {
        return;
    };
    silu_mul_body::<f32>(&gpu);
    silu_mul_body::<bf16>(&gpu);
}

#[test]
fn reshape_and_cache_writes_slots_and_skips_padding() {
    let Some(gpu) = common::gpu_or_skip("reshape_and_cache") else {
        return;
    };
    let (row, num_slots) = (2 * 64, 32);
    let mut rng = Rng(5);
    let k = rng.vec(3 * row, 1.0);
    let v = rng.vec(3 * row, 1.0);
    let slots = [17i64, -1, 3];
    let (mut kc, mut vc) = (
        zeros::<f32>(&gpu, num_slots * row),
        zeros::<f32>(&gpu, num_slots * row),
    );
    reshape_and_cache(
        &gpu,
        &up(&gpu, &k).as_view(),
        &up(&gpu, &v).as_view(),
        &mut kc.as_view_mut(),
        &mut vc.as_view_mut(),
        &up(&gpu, &slots).as_view(),
        row,
    )
    .expect("launch");
    let (kc, vc) = (down(&gpu, &kc), down(&gpu, &vc));
    let mut expected_k = vec![0f32; num_slots * row];
    let mut expected_v = vec![0f32; num_slots * row];
    for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let s = s as usize;
        expected_k[s * row..(s + 1) * row].copy_from_slice(&k[t * row..(t + 1) * row]);
        expected_v[s * row..(s + 1) * row].copy_from_slice(&v[t * row..(t + 1) * row]);
    }
    assert_eq!(kc, expected_k);
    assert_eq!(vc, expected_v);
}

/// The CPU attention's view of one sequence in a host copy of the pool.
struct HostView<'a> {
    k: &'a [f32],
    v: &'a [f32],
    table: &'a [i32],
    block_size: usize,
    row: usize,
    head_dim: usize,
}

impl HostView<'_> {
    fn at(&self, pos: usize, kv_head: usize) -> usize {
        let slot =
            self.table[pos / self.block_size] as usize * self.block_size + pos % self.block_size;
        slot * self.row + kv_head * self.head_dim
    }
}

impl layers::KvView for HostView<'_> {
    fn key(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.k[o..o + self.head_dim]
    }
    fn value(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.v[o..o + self.head_dim]
    }
}

fn attention_body<T: TestDtype>(gpu: &GpuContext, head_dim: usize) {
    let (nh, nkv, bs) = (14, 2, 16);
    // Lengths cover one position, one tile, and several 512-position splits.
    let seq_lens = [1usize, 37, 1300];
    let max_blocks = 1300usize.div_ceil(bs);
    let num_blocks = seq_lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 3;
    let row = nkv * head_dim;
    let mut rng = Rng(6);
    let (kc, kc32) = cast::<T>(&rng.vec(num_blocks * bs * row, 1.0));
    let (vc, vc32) = cast::<T>(&rng.vec(num_blocks * bs * row, 1.0));
    // Blocks handed out back to front, so tables are not the identity.
    let mut next = num_blocks;
    let mut tables = vec![0i32; seq_lens.len() * max_blocks];
    for (s, &len) in seq_lens.iter().enumerate() {
        for b in 0..len.div_ceil(bs) {
            next -= 1;
            tables[s * max_blocks + b] = next as i32;
        }
    }
    let cfg = AttentionConfig {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim,
        block_size: bs,
        max_blocks_per_seq: max_blocks,
    };
    let (dk, dv, dt) = (up(gpu, &kc), up(gpu, &vc), up(gpu, &tables));
    let lens_i32: Vec<i32> = seq_lens.iter().map(|&l| l as i32).collect();
    let dl = up(gpu, &lens_i32);
    let kv = || PagedKv {
        k_cache: dk.as_view(),
        v_cache: dv.as_view(),
        block_tables: dt.as_view(),
        seq_lens: dl.as_view(),
    };
    let views: Vec<HostView> = (0..seq_lens.len())
        .map(|s| HostView {
            k: &kc32,
            v: &vc32,
            table: &tables[s * max_blocks..(s + 1) * max_blocks],
            block_size: bs,
            row,
            head_dim,
        })
        .collect();
    let shape = layers::AttentionShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim,
    };

    // Decode: the last position of every sequence.
    let (q, q32) = cast::<T>(&rng.vec(seq_lens.len() * nh * head_dim, 1.0));
    let mut scratch = DecodeScratch::new(gpu, &cfg, 8, 2048).expect("scratch");
    let mut out = zeros::<T>(gpu, q.len());
    paged_attention_decode(
        gpu,
        &cfg,
        &up(gpu, &q).as_view(),
        kv(),
        1300,
        &mut scratch,
        &mut out.as_view_mut(),
    )
    .expect("decode");
    let decode = down(gpu, &out);
    let rows: Vec<layers::QueryRow> = seq_lens
        .iter()
        .enumerate()
        .map(|(s, &l)| layers::QueryRow {
            position: l - 1,
            seq: s,
        })
        .collect();
    assert_close(
        "decode attention",
        &decode,
        &layers::attention(&q32, &rows, &views, shape),
    );

    // Prefill over the same rows as one-token chunks: bit-identical to decode.
    let qsl = [0i32, 1, 2, 3];
    let mut out_p = zeros::<T>(gpu, q.len());
    paged_attention_prefill(
        gpu,
        &cfg,
        &up(gpu, &q).as_view(),
        kv(),
        &up(gpu, &qsl).as_view(),
        &up(gpu, &[0i32, 36, 1299]).as_view(),
        &mut out_p.as_view_mut(),
    )
    .expect("prefill");
    let prefill = down(gpu, &out_p);
    assert!(
        prefill
            .iter()
            .zip(&decode)
            .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
        "decode and prefill kernels must agree bit for bit"
    );

    // Chunked prefill: seq 1 whole (37 tokens), seq 2 a chunk of 40 ending at its end.
    let positions: Vec<i32> = (0..37).chain(1260..1300).collect();
    let qsl = [0i32, 0, 37, 77];
    let (qc, qc32) = cast::<T>(&rng.vec(positions.len() * nh * head_dim, 1.0));
    let mut out_c = zeros::<T>(gpu, qc.len());
    paged_attention_prefill(
        gpu,
        &cfg,
        &up(gpu, &qc).as_view(),
        kv(),
        &up(gpu, &qsl).as_view(),
        &up(gpu, &positions).as_view(),
        &mut out_c.as_view_mut(),
    )
    .expect("chunked prefill");
    let rows: Vec<layers::QueryRow> = positions
        .iter()
        .enumerate()
        .map(|(t, &p)| layers::QueryRow {
            position: p as usize,
            seq: if t < 37 { 1 } else { 2 },
        })
        .collect();
    assert_close(
        "chunked prefill attention",
        &down(gpu, &out_c),
        &layers::attention(&qc32, &rows, &views, shape),
    );
}

#[test]
fn paged_attention_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("paged_attention") else {
        return;
    };
    for hd in [64, 128] {
        attention_body::<f32>(&gpu, hd);
        attention_body::<bf16>(&gpu, hd);
    }
}

fn dequant_body<T: TestDtype>(gpu: &GpuContext) {
    let mut rng = Rng(7);
    let values = rng.vec(8 * 512, 3.0);
    let t = Tensor::from_vec(values, (8, 512), &Device::Cpu).expect("tensor");
    for (ggml, qtype) in [
        (GgmlDType::Q4K, QuantType::Q4K),
        (GgmlDType::Q5_0, QuantType::Q5_0),
        (GgmlDType::Q6K, QuantType::Q6K),
        (GgmlDType::Q8_0, QuantType::Q8_0),
    ] {
        let q = QTensor::quantize(&t, ggml).expect("quantize");
        let raw = q.data().expect("raw blocks").to_vec();
        let expected: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .and_then(|d| d.flatten_all())
            .and_then(|d| d.to_vec1())
            .expect("cpu dequantize");
        check_dequant::<T>(gpu, qtype, &raw, &expected);
    }
    let w =
        novainfer_model::int4::GroupedInt4::quantize(8, 512, &rng.vec(8 * 512, 3.0)).expect("int4");
    check_dequant::<T>(gpu, QuantType::Int4, w.blocks(), &w.dequantize());
    // FP8: rows with a few large values put most codes among the subnormals, which the kernel
    // must keep (no flush-to-zero).
    let values: Vec<f32> = rng
        .vec(8 * 512, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i % 97 == 0 { v * 1e4 } else { v })
        .collect();
    let w =
        novainfer_model::fp8_blocks::Fp8Blocks::quantize_rows("fp8", 8, 512, &values).expect("fp8");
    check_dequant::<T>(gpu, QuantType::Fp8, w.blocks(), &w.dequantize());
}

/// The device's expansion of `raw` equals `expected` (the CPU's f32 values): the same
/// arithmetic, operation for operation, exact in f32, one rounding in bf16.
fn check_dequant<T: TestDtype>(gpu: &GpuContext, qtype: QuantType, raw: &[u8], expected: &[f32]) {
    let mut out = zeros::<T>(gpu, expected.len());
    dequantize(gpu, qtype, &up(gpu, raw).as_view(), &mut out.as_view_mut()).expect("launch");
    let got = down(gpu, &out);
    for (i, (g, c)) in got.iter().zip(expected).enumerate() {
        assert_eq!(
            g.to_f32().to_bits(),
            T::from_f32(*c).to_f32().to_bits(),
            "{qtype:?} element {i}"
        );
    }
}

#[test]
fn dequant_matches_candle() {
    let Some(gpu) = common::gpu_or_skip("dequant") else {
        return;
    };
    dequant_body::<f32>(&gpu);
    dequant_body::<bf16>(&gpu);
}

/// The GEMV against its twin, bit for bit: every format (packed and bf16), 1, 3 and 8
/// activation rows, f32 and bf16 outputs written into columns of a wider row (a part of a fused
/// matrix's output), columns outside left alone, k = 1536 and 2304 (192 and 288 chunks of 8: whole
/// rounds of the 32 lanes) and, for formats whose blocks divide it, 896 (the 0.5B's hidden size: 112
/// chunks, a lane loop with a ragged tail); and a row's result the same alone and in a batch. Fresh
/// random weights every run.
fn gemv_body<T: TestDtype>(gpu: &GpuContext, seed: u64) {
    use novainfer_cuda::gemv_plan::emulate;
    use novainfer_cuda::ops::gemv_quant::{gemv, OutColumns, WeightRun};
    let mut rng = Rng(seed);
    for weights in GemvWeights::ALL {
        for (rows, k) in [(37, 1536), (64, 2304), (37usize, 896usize)] {
            if !k.is_multiple_of(weights.block_values()) {
                continue;
            }
            let raw = gemv_matrix(weights, rows, k, &mut rng);
            let w = up(gpu, &raw);
            for n in [1, 3, 8] {
                let x: Vec<bf16> = rng
                    .vec(n * k, 2.0)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                let want = emulate(weights, &raw, rows, k, &x, n);
                let out = OutColumns {
                    ld: rows + 11,
                    col0: 5,
                };
                let sentinel = T::from_f32(-7.0);
                let mut y = up(gpu, &vec![sentinel; n * out.ld]);
                let xd = up(gpu, &x);
                let run = [WeightRun {
                    weights,
                    bytes: w.as_view(),
                    rows,
                }];
                let (xv, mut yv) = (xd.as_view(), y.as_view_mut());
                gemv(gpu, &run, k, &xv, n, &mut yv, out).expect("launch");
                let got = down(gpu, &y);
                for r in 0..n {
                    for c in 0..out.ld {
                        let g = got[r * out.ld + c].to_f32();
                        let expected = if (out.col0..out.col0 + rows).contains(&c) {
                            T::from_f32(want[r * rows + c - out.col0]).to_f32()
                        } else {
                            sentinel.to_f32()
                        };
                        assert_eq!(
                            g.to_bits(),
                            expected.to_bits(),
                            "{weights:?} k={k} n={n} ({r}, {c})"
                        );
                    }
                }
            }
        }
    }
}

/// Token rows of a packed table equal those rows of the whole-table expansion bit for bit, in
/// f32 and bf16; an id past the vocabulary gives a zero row.
fn embed_quant_body<T: TestDtype>(gpu: &GpuContext) {
    use novainfer_cuda::ops::embedding::embedding_quant;
    let (vocab, hidden) = (40, 512);
    let mut rng = Rng(23);
    let values = rng.vec(vocab * hidden, 2.0);
    let t = Tensor::from_vec(values.clone(), (vocab, hidden), &Device::Cpu).expect("t");
    let mut tables: Vec<(QuantType, Vec<u8>)> = [
        (GgmlDType::Q4K, QuantType::Q4K),
        (GgmlDType::Q5_0, QuantType::Q5_0),
        (GgmlDType::Q6K, QuantType::Q6K),
        (GgmlDType::Q8_0, QuantType::Q8_0),
    ]
    .into_iter()
    .map(|(g, q)| {
        (
            q,
            QTensor::quantize(&t, g)
                .expect("q")
                .data()
                .expect("raw")
                .to_vec(),
        )
    })
    .collect();
    let int4 = novainfer_model::int4::GroupedInt4::quantize(vocab, hidden, &values).expect("int4");
    tables.push((QuantType::Int4, int4.blocks().to_vec()));
    let fp8 = novainfer_model::fp8_blocks::Fp8Blocks::quantize_rows("fp8", vocab, hidden, &values)
        .expect("fp8");
    tables.push((QuantType::Fp8, fp8.blocks().to_vec()));
    let ids: Vec<u32> = vec![3, 0, 39, 3, 17, 40, 1_000_000];
    for (qtype, raw) in tables {
        let blocks = up(gpu, &raw);
        let mut whole = zeros::<f32>(gpu, vocab * hidden);
        dequantize(gpu, qtype, &blocks.as_view(), &mut whole.as_view_mut()).expect("expand");
        let whole = down(gpu, &whole);
        let mut out = zeros::<T>(gpu, ids.len() * hidden);
        let shape = EmbeddingShape {
            vocab_size: vocab,
            hidden,
        };
        let id_dev = up(gpu, &ids);
        embedding_quant(
            gpu,
            qtype,
            &id_dev.as_view(),
            &blocks.as_view(),
            shape,
            &mut out.as_view_mut(),
        )
        .expect("launch");
        let got = down(gpu, &out);
        for (t, &id) in ids.iter().enumerate() {
            for i in 0..hidden {
                let want = if (id as usize) < vocab {
                    whole[id as usize * hidden + i]
                } else {
                    0.0
                };
                let g = got[t * hidden + i].to_f32();
                assert_eq!(
                    g.to_bits(),
                    T::from_f32(want).to_f32().to_bits(),
                    "{qtype:?} token {t} value {i}"
                );
            }
        }
    }
}

#[test]
fn embed_quant_matches_the_expanded_table() {
    let Some(gpu) = common::gpu_or_skip("embed_quant") else {
        return;
    };
    embed_quant_body::<f32>(&gpu);
    embed_quant_body::<bf16>(&gpu);
}

#[test]
fn gemv_matches_the_twin_bit_for_bit() {
    let Some(gpu) = common::gpu_or_skip("gemv") else {
        return;
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    println!("gemv: seed {seed}");
    gemv_body::<f32>(&gpu, seed);
    gemv_body::<bf16>(&gpu, seed ^ 0x9E37);
}

/// The tiled GEMM over packed weights against its twin (`gemm_tile::emulate`, which follows the
/// kernel lane by lane): every packed format alone and a matrix of three formats' runs, 9, 64 and
/// 100 activation rows (partial tiles), k whole and split into 3 and 16 ranges (the reduction),
/// f32 and bf16 outputs in columns of a wider row, columns
/// outside left alone. The tensor cores sum a tile in their own order, so within f32 rounding
/// of the products' magnitude (then the output's own rounding). Fresh random weights every run.
fn gemm_packed_body<T: TestDtype>(gpu: &GpuContext, seed: u64) {
    use novainfer_cuda::gemm_tile::emulate;
    use novainfer_cuda::gemv_plan::HostRun;
    use novainfer_cuda::ops::gemv_quant::{gemm_packed, OutColumns, WeightRun};
    let mut rng = Rng(seed);
    let k = 512;
    let mut matrices: Vec<Vec<(QuantType, usize)>> =
        QuantType::ALL.iter().map(|&q| vec![(q, 70)]).collect();
    matrices.push(vec![
        (QuantType::Q4K, 37),
        (QuantType::Q6K, 30),
        (QuantType::Fp8, 9),
    ]);
    for formats in matrices {
        let raws: Vec<Vec<u8>> = formats
            .iter()
            .map(|&(q, rows)| gemv_matrix(q.into(), rows, k, &mut rng))
            .collect();
        let devs: Vec<_> = raws.iter().map(|r| up(gpu, r)).collect();
        let rows: usize = formats.iter().map(|f| f.1).sum();
        let host: Vec<HostRun<'_>> = formats
            .iter()
            .zip(&raws)
            .map(|(&(q, rows), raw)| HostRun {
                weights: q.into(),
                bytes: raw,
                rows,
            })
            .collect();
        let runs: Vec<WeightRun<'_>> = formats
            .iter()
            .zip(&devs)
            .map(|(&(q, rows), d)| WeightRun {
                weights: q.into(),
                bytes: d.as_view(),
                rows,
            })
            .collect();
        for (m, splits) in [(9, 1), (64, 1), (100, 1), (9, 3), (64, 16)] {
            let x: Vec<bf16> = rng
                .vec(m * k, 2.0)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let out = OutColumns {
                ld: rows + 11,
                col0: 5,
            };
            let mut want = vec![0f32; m * out.ld];
            emulate(&host, k, &x, m, &mut want, out.ld, out.col0, splits);
            let sentinel = T::from_f32(-7.0);
            let mut y = up(gpu, &vec![sentinel; m * out.ld]);
            let xd = up(gpu, &x);
            let mut partial = zeros::<f32>(gpu, splits * m * rows);
            let (xv, mut yv, mut pv) = (xd.as_view(), y.as_view_mut(), partial.as_view_mut());
            gemm_packed(gpu, &runs, k, &xv, m, &mut yv, out, splits, &mut pv).expect("launch");
            let got = down(gpu, &y);
            for r in 0..m {
                // The magnitude of row r's products (the weights are within ±1): Σ |x|.
                let scale = x[r * k..(r + 1) * k]
                    .iter()
                    .map(|v| v.to_f32().abs())
                    .sum::<f32>();
                for c in 0..out.ld {
                    let g = got[r * out.ld + c].to_f32();
                    if !(out.col0..out.col0 + rows).contains(&c) {
                        assert_eq!(
                            g.to_bits(),
                            sentinel.to_f32().to_bits(),
                            "{formats:?} m={m} splits={splits} ({r}, {c})"
                        );
                        continue;
                    }
                    let w = T::from_f32(want[r * out.ld + c]).to_f32();
                    // The summation order (f32), then one output rounding either side of a boundary.
                    let tol = 1e-5 * scale + T::TOL * w.abs();
                    assert!(
                        (g - w).abs() <= tol,
                        "{formats:?} m={m} splits={splits} ({r}, {c}): gpu {g} vs twin {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn gemm_packed_follows_its_twin() {
    let Some(gpu) = common::gpu_or_skip("gemm_packed") else {
        return;
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    println!("gemm_packed: seed {seed}");
    gemm_packed_body::<f32>(&gpu, seed);
    gemm_packed_body::<bf16>(&gpu, seed ^ 0x51ED);
}

/// First index of the maximum with NaN as −inf: the CPU sampler's greedy rule.
fn cpu_argmax(row: &[f32]) -> u32 {
    let clean = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if clean(v) > clean(row[best]) {
            best = i;
        }
    }
    best as u32
}

#[test]
fn argmax_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("argmax") else {
        return;
    };
    let vocab = 151_936;
    let mut rng = Rng(8);
    let mut logits = rng.vec(4 * vocab, 10.0);
    logits[7] = 50.0; // row 0: a clear winner
    logits[vocab + 10] = 40.0; // row 1: a tie, lowest id wins
    logits[vocab + 9000] = 40.0;
    logits[2 * vocab + 3] = f32::NAN; // row 2: NaN never wins
    logits[3 * vocab..].fill(-1.0); // row 3: all equal → id 0
    let expected: Vec<u32> = logits.chunks(vocab).map(cpu_argmax).collect();
    let mut out = zeros::<u32>(&gpu, 4);
    argmax(
        &gpu,
        &up(&gpu, &logits).as_view(),
        vocab,
        &mut out.as_view_mut(),
    )
    .expect("launch");
    assert_eq!(down(&gpu, &out), expected);
    let b: Vec<bf16> = logits.iter().map(|&v| bf16::from_f32(v)).collect();
    let b32: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
    argmax(&gpu, &up(&gpu, &b).as_view(), vocab, &mut out.as_view_mut()).expect("launch");
    assert_eq!(
        down(&gpu, &out),
        b32.chunks(vocab).map(cpu_argmax).collect::<Vec<_>>()
    );
}

#[test]
fn sampling_matches_the_reference_and_is_batch_invariant() {
    let Some(gpu) = common::gpu_or_skip("sampling") else {
        return;
    };
    let (rows, vocab) = (64, 4096);
    let mut rng = Rng(9);
    let logits = rng.vec(rows * vocab, 8.0);
    let params: Vec<SampleParams> = (0..rows)
        .map(|r| {
            let top_k = [None, Some(1), Some(20), Some(vocab)][r % 4];
            let top_p = [1.0, 0.9, 0.5][r % 3];
            let min_p = [0.0, 0.05][r % 2];
            SampleParams::new(1000 + r as u64, r as u64 * 7, 0.7, top_k, top_p, min_p)
                .expect("valid")
        })
        .collect();
    let mut scratch = zeros::<f32>(&gpu, rows * vocab);
    let mut out = zeros::<u32>(&gpu, rows);
    sample(
        &gpu,
        &up(&gpu, &logits).as_view(),
        &up(&gpu, &params).as_view(),
        vocab,
        &mut scratch.as_view_mut(),
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let got = down(&gpu, &out);
    let mut agree = 0;
    for (r, (&tok, row)) in got.iter().zip(logits.chunks(vocab)).enumerate() {
        let want = reference::sample(row, &params[r]);
        assert!(
            want.survivors.contains(&tok),
            "row {r}: token {tok} is outside the reference's survivors"
        );
        agree += usize::from(tok == want.token);
    }
    // f32 sums on the GPU vs f64 here may move a draw across a boundary only rarely.
    assert!(
        agree >= rows - 2,
        "only {agree} of {rows} rows drew the reference token"
    );
    // A row alone draws what it drew in the batch.
    let mut one = zeros::<u32>(&gpu, 1);
    let mut scratch1 = zeros::<f32>(&gpu, vocab);
    sample(
        &gpu,
        &up(&gpu, &logits[5 * vocab..6 * vocab]).as_view(),
        &up(&gpu, &params[5..6]).as_view(),
        vocab,
        &mut scratch1.as_view_mut(),
        &mut one.as_view_mut(),
    )
    .expect("launch");
    assert_eq!(down(&gpu, &one)[0], got[5]);
}

/// `adjust_rows` then `draw`: greedy rows give the reference argmax, random rows a reference
/// survivor (the reference token on all but a rare boundary row), skipped rows are untouched,
/// rows with edits (penalties, bias, mask) are drawn from the reference's adjusted row, every
/// drawn row's logprob is the raw row's reference within f32 rounding of the sum, and a row
/// alone gives its batched result.
#[test]
fn draw_matches_the_reference_and_is_batch_invariant() {
    let Some(gpu) = common::gpu_or_skip("draw") else {
        return;
    };
    let (rows, vocab) = (48, 151_936);
    let mut rng = Rng(31);
    let mut logits = rng.vec(rows * vocab, 12.0);
    logits[7 * vocab + 11] = f32::NAN; // sanitized as −inf, never drawn
    let modes: Vec<DrawMode> = (0..rows)
        .map(|r| [DrawMode::Greedy, DrawMode::Random, DrawMode::Skip][r % 3])
        .collect();
    let params: Vec<SampleParams> = (0..rows)
        .map(|r| match modes[r] {
            DrawMode::Random => SampleParams::new(
                77 + r as u64,
                r as u64,
                [0.6, 1.0, 1.3][r % 3],
                [None, Some(40)][r % 2],
                [1.0, 0.95][r % 2],
                0.0,
            )
            .expect("valid"),
            _ => SampleParams::UNUSED,
        })
        .collect();
    // Every fourth row has edits: the row's current best penalised, masked or biased away,
    // and a few other tokens touched.
    let penalties: Vec<RowPenalties> = (0..rows)
        .map(|r| RowPenalties {
            repetition: 1.0 + 0.1 * (r % 5) as f32,
            frequency: 0.3,
            presence: 0.2,
            _pad: 0.0,
        })
        .collect();
    let row_edits: Vec<Vec<RowEdit>> = (0..rows)
        .map(|r| {
            if r % 4 != 0 {
                return Vec::new();
            }
            let row = &logits[r * vocab..(r + 1) * vocab];
            let best = reference::argmax(row);
            let flags = [RowEdit::PENALIZE | RowEdit::IN_PROMPT, RowEdit::MASK, 0][r / 4 % 3];
            let mut edits = vec![RowEdit {
                token_id: best,
                output_count: 3,
                flags,
                bias: if flags == 0 { -30.0 } else { 0.0 },
            }];
            for k in 1..20u32 {
                let id = (best + k * 7919) % vocab as u32;
                edits.push(RowEdit {
                    token_id: id,
                    output_count: k % 3,
                    flags: RowEdit::PENALIZE,
                    bias: 0.5,
                });
            }
            edits.sort_by_key(|e| e.token_id);
            edits.dedup_by_key(|e| e.token_id);
            edits
        })
        .collect();
    // Rows ask for none, the chosen token's rank only, or 5 or 20 top logprobs.
    let asked: Vec<i32> = (0..rows).map(|r| [-1, 0, 5, 20][r % 4]).collect();
    let run = |logits: &[f32],
               params: &[SampleParams],
               modes: &[DrawMode],
               penalties: &[RowPenalties],
               row_edits: &[Vec<RowEdit>],
               asked: &[i32]| {
        let n = modes.len();
        let mut offsets = vec![0i32];
        let mut flat = Vec::new();
        for e in row_edits {
            flat.extend_from_slice(e);
            offsets.push(flat.len() as i32);
        }
        if flat.is_empty() {
            flat.push(RowEdit {
                token_id: 0,
                output_count: 0,
                flags: 0,
                bias: 0.0,
            });
        }
        let raw = up(&gpu, logits);
        let (offsets, flat, penalties) = (up(&gpu, &offsets), up(&gpu, &flat), up(&gpu, penalties));
        let mut adjusted = zeros::<f32>(&gpu, n * vocab);
        adjust_rows(
            &gpu,
            &raw.as_view(),
            &RowEdits {
                offsets: offsets.as_view(),
                edits: flat.as_view(),
                penalties: penalties.as_view(),
            },
            vocab,
            &mut adjusted.as_view_mut(),
        )
        .expect("adjust");
        let mut scratch = zeros::<f32>(&gpu, n * vocab);
        let mut ids = up(&gpu, &vec![u32::MAX; n]);
        let mut lps = up(&gpu, &vec![f32::NAN; n]);
        let tops = up(&gpu, asked);
        let mut top_ids = zeros::<u32>(&gpu, n * MAX_TOP_LOGPROBS);
        let mut top_lps = zeros::<f32>(&gpu, n * MAX_TOP_LOGPROBS);
        let mut ranks = zeros::<u32>(&gpu, n);
        draw(
            &gpu,
            &raw.as_view(),
            &adjusted.as_view(),
            &offsets.as_view(),
            &up(&gpu, params).as_view(),
            &up(&gpu, modes).as_view(),
            vocab,
            &mut scratch.as_view_mut(),
            &mut ids.as_view_mut(),
            &mut lps.as_view_mut(),
            TopLogprobs {
                tops: &tops.as_view(),
                ids: &mut top_ids.as_view_mut(),
                logprobs: &mut top_lps.as_view_mut(),
                ranks: &mut ranks.as_view_mut(),
            },
        )
        .expect("launch");
        let (top_ids, top_lps) = (down(&gpu, &top_ids), down(&gpu, &top_lps));
        let tops: Vec<Vec<(u32, f32)>> = (0..n)
            .map(|r| {
                let k = asked[r].max(0) as usize;
                (0..k)
                    .map(|j| {
                        (
                            top_ids[r * MAX_TOP_LOGPROBS + j],
                            top_lps[r * MAX_TOP_LOGPROBS + j],
                        )
                    })
                    .collect()
            })
            .collect();
        (down(&gpu, &ids), down(&gpu, &lps), tops, down(&gpu, &ranks))
    };
    let (ids, lps, tops, ranks) = run(&logits, &params, &modes, &penalties, &row_edits, &asked);
    let mut agree = 0;
    let mut random = 0;
    for r in 0..rows {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let source = if row_edits[r].is_empty() {
            row.to_vec()
        } else {
            reference::adjust(row, &penalties[r], &row_edits[r])
        };
        match modes[r] {
            DrawMode::Skip => {
                assert_eq!(ids[r], u32::MAX, "row {r}: a skipped row is left alone");
                assert!(lps[r].is_nan(), "row {r}: its logprob too");
                continue;
            }
            DrawMode::Greedy => assert_eq!(ids[r], reference::argmax(&source), "row {r}"),
            DrawMode::Random => {
                let want = reference::sample(&source, &params[r]);
                assert!(
                    want.survivors.contains(&ids[r]),
                    "row {r}: {} not a survivor",
                    ids[r]
                );
                agree += usize::from(ids[r] == want.token);
                random += 1;
            }
        }
        let want = reference::token_logprob(row, ids[r]);
        assert!(
            (lps[r] - want).abs() <= 1e-4 * want.abs().max(1.0),
            "row {r}: logprob {} vs reference {want}",
            lps[r]
        );
        if asked[r] >= 0 {
            let (rank, top) = reference::top_logprobs(row, ids[r], asked[r] as usize);
            assert_eq!(ranks[r], rank, "row {r}: rank");
            assert_eq!(
                tops[r].iter().map(|t| t.0).collect::<Vec<_>>(),
                top.iter().map(|t| t.0).collect::<Vec<_>>(),
                "row {r}: top ids"
            );
            for (got, want) in tops[r].iter().zip(&top) {
                assert!(
                    (got.1 - want.1).abs() <= 1e-4 * want.1.abs().max(1.0),
                    "row {r}"
                );
            }
        }
    }
    assert!(
        agree + 1 >= random,
        "only {agree} of {random} random rows drew the reference token"
    );
    for r in [1, 3, 4, 8] {
        let one = |v: &[f32]| v[r * vocab..(r + 1) * vocab].to_vec();
        let (id, lp, top, rank) = run(
            &one(&logits),
            &params[r..=r],
            &modes[r..=r],
            &penalties[r..=r],
            &row_edits[r..=r],
            &asked[r..=r],
        );
        assert_eq!(
            (id[0], lp[0].to_bits()),
            (ids[r], lps[r].to_bits()),
            "row {r} alone"
        );
        assert_eq!(
            (&top[0], rank[0]),
            (&tops[r], ranks[r]),
            "row {r} alone: logprobs"
        );
    }
}

/// `mask_rows`: masked rows equal the reference's mask (−inf where a bit is clear or past the
/// words), unmasked rows are untouched, in place.
#[test]
fn mask_rows_matches_the_reference() {
    let Some(gpu) = common::gpu_or_skip("mask_rows") else {
        return;
    };
    let (rows, vocab) = (6usize, 1000usize);
    let words = vocab.div_ceil(32);
    let mut rng = Rng(5);
    let logits = rng.vec(rows * vocab, 4.0);
    let masks_at: Vec<i32> = vec![-1, 0, -1, 1, 2, -1];
    // Three masks: every other id; ids below 100 only; one word short (ids past it masked).
    let mut masks = vec![0x5555_5555u32; words];
    masks.extend((0..words).map(|w| match w {
        0..=2 => u32::MAX,
        3 => (1u32 << 4) - 1,
        _ => 0,
    }));
    masks.extend((0..words).map(|w| if w + 1 < words { 0xF0F0_F0F0 } else { 0 }));
    let mut device = up(&gpu, &logits);
    mask_rows::<f32>(
        &gpu,
        &mut device.as_view_mut(),
        &up(&gpu, &masks_at).as_view(),
        &up(&gpu, &masks).as_view(),
        words,
        vocab,
    )
    .expect("launch");
    let got = down(&gpu, &device);
    for r in 0..rows {
        let mut want = logits[r * vocab..(r + 1) * vocab].to_vec();
        if let Ok(at) = usize::try_from(masks_at[r]) {
            reference::mask_row(&mut want, &masks[at * words..(at + 1) * words]);
        }
        assert_eq!(got[r * vocab..(r + 1) * vocab], want[..], "row {r}");
    }
}

// ---- LoRA ---------------------------------------------------------------------------------

/// Each row's LoRA update against the CPU twin of the kernels (`lora_plan`), for the 0.5B's q
/// (into a fused q|k|v row) and gate/up (into the up half of a fused row) shapes, rows on four
/// adapters (one without this projection), the base model and an out-of-range slot; then
/// every row alone gives the bits it had in the batch.
fn lora_body<T: TestDtype>(gpu: &GpuContext) {
    use novainfer_cuda::cudarc::driver::DevicePtr;
    use novainfer_cuda::lora_plan::{emulate_expand, emulate_shrink, HostPair};
    use novainfer_cuda::ops::lora::{lora_expand, lora_shrink, Columns, LoraPair, LoraRows};
    let mut rng = Rng(9);
    let stream = gpu.stream();
    for (in_f, out, stride, offset) in [(896, 896, 1152, 0), (896, 4864, 9728, 4864)] {
        let ranks = [Some(16), None, Some(8), Some(64)];
        let max_rank = 64;
        let host: Vec<HostPair> = ranks
            .iter()
            .enumerate()
            .map(|(i, r)| match *r {
                Some(rank) => HostPair {
                    a: Some(rng.vec(rank * in_f, 0.1)),
                    bt: rng.vec(rank * out, 0.1),
                    rank,
                    scale: 0.5 + i as f32,
                },
                None => HostPair {
                    a: None,
                    bt: Vec::new(),
                    rank: 0,
                    scale: 0.0,
                },
            })
            .collect();
        let device: Vec<_> = host
            .iter()
            .map(|p| p.a.as_ref().map(|a| (up(gpu, a), up(gpu, &p.bt))))
            .collect();
        let pairs: Vec<LoraPair> = host
            .iter()
            .zip(&device)
            .map(|(p, d)| match d {
                Some((a, bt)) => LoraPair {
                    a: a.device_ptr(stream).0,
                    bt: bt.device_ptr(stream).0,
                    rank: p.rank as i32,
                    scale: p.scale,
                },
                None => LoraPair::default(),
            })
            .collect();
        let pairs_dev = up(gpu, &pairs);
        let run = |row_slot: &[i32], x: &[T], y: &[T]| -> Vec<T> {
            let rows = row_slot.len();
            let slots = up(gpu, row_slot);
            let lora = LoraRows {
                row_slot: slots.as_view(),
                pairs: pairs_dev.as_view(),
                max_rank,
            };
            let mut t = zeros::<f32>(gpu, rows * max_rank);
            lora_shrink(
                gpu,
                &up(gpu, x).as_view(),
                in_f,
                &lora,
                &mut t.as_view_mut(),
            )
            .expect("shrink");
            let mut y_dev = up(gpu, y);
            let cols = Columns {
                out_features: out,
                stride,
                offset,
            };
            lora_expand(gpu, &t.as_view(), &lora, &mut y_dev.as_view_mut(), cols).expect("expand");
            down(gpu, &y_dev)
        };
        let row_slot = [0, -1, 2, 3, 0, 1, 3, 7];
        let rows = row_slot.len();
        let (x, x32) = cast::<T>(&rng.vec(rows * in_f, 1.0));
        let (y, y32) = cast::<T>(&rng.vec(rows * stride, 1.0));
        let got = run(&row_slot, &x, &y);
        let t = emulate_shrink(&x32, in_f, &row_slot, &host, max_rank);
        let mut expected = y32.clone();
        emulate_expand(
            &t,
            &row_slot,
            &host,
            max_rank,
            &mut expected,
            out,
            stride,
            offset,
        );
        assert_close(&format!("lora {in_f}->{out}"), &got, &expected);
        for r in 0..rows {
            let alone = run(
                &row_slot[r..r + 1],
                &x[r * in_f..(r + 1) * in_f],
                &y[r * stride..(r + 1) * stride],
            );
            let same = alone
                .iter()
                .zip(&got[r * stride..(r + 1) * stride])
                .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
            assert!(
                same,
                "lora {in_f}->{out}: row {r} alone differs from the batch"
            );
        }
    }
}

#[test]
fn lora_matches_the_twin_and_is_batch_invariant() {
    let Some(gpu) = common::gpu_or_skip("lora") else {
        return;
    };
    lora_body::<f32>(&gpu);
    lora_body::<bf16>(&gpu);
}
