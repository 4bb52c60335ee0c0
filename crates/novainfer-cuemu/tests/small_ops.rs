//! The small kernels run by the emulator, launched as their `ops::*` launchers launch them,
//! f32 and bf16, at Qwen2 0.5B and 1.5B widths and ragged ones:
//! - gather.cu: `gather_rows_*` and `gather_columns_*` copy exactly (bits), a row or column
//!   index outside the source gives zeros; `chain_tokens` writes the drawn ids and skips pairs
//!   outside either buffer;
//! - rms_norm.cu: `rms_norm_*` and `add_rms_norm_*` against a float64 RMSNorm (the CPU's,
//!   novainfer-model's `ops::rms_norm`) within the GPU test's tolerance; the fused residual is
//!   one rounded addition, fused and unfused give the same bits, a row alone the batch's bits;
//! - silu_mul.cu: both layouts (separate gate/up, one fused gate|up row) against float64;
//! - embedding.cu: `embedding_gather_*` copies the bf16 table's rows exactly; an id outside the
//!   vocabulary (the kernel's promise) gives a zero row.

mod common;

use common::{addr, Rng};
use half::bf16;
use novainfer_cuemu::kernels::embedding::{embedding_gather_bf16, embedding_gather_f32};
use novainfer_cuemu::kernels::gather::{
    chain_tokens, gather_columns_bf16, gather_columns_f32, gather_rows_bf16, gather_rows_f32,
};
use novainfer_cuemu::kernels::rms_norm::{
    add_rms_norm_bf16, add_rms_norm_f32, rms_norm_bf16, rms_norm_f32,
};
use novainfer_cuemu::kernels::silu_mul::{silu_mul_bf16, silu_mul_f32};
use novainfer_cuemu::{launch, Dim3};

/// Threads per block of the per-row launches (`ops::per_row(rows, 256)`, `RMS_THREADS`) and of
/// `ops::elementwise`.
const THREADS: u32 = 256;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dtype {
    F32,
    Bf16,
}

const DTYPES: [Dtype; 2] = [Dtype::F32, Dtype::Bf16];

impl Dtype {
    /// `v` as a tensor of this dtype holds it.
    fn round(self, v: f32) -> f32 {
        match self {
            Dtype::F32 => v,
            Dtype::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }
    fn values(self, rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.round(rng.f32(scale))).collect()
    }
    /// The GPU tests' relative tolerance (`TestDtype::TOL`, novainfer-cuda tests/common/host.rs).
    fn tol(self) -> f32 {
        match self {
            Dtype::F32 => 2e-5,
            Dtype::Bf16 => 1.6e-2,
        }
    }
}

/// A tensor in either dtype on the host (the kernels' "device" memory).
enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Buf {
    fn new(dtype: Dtype, v: &[f32]) -> Self {
        match dtype {
            Dtype::F32 => Buf::F32(v.to_vec()),
            Dtype::Bf16 => Buf::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }
    /// `n` values of a pattern no kernel writes, so a skipped element shows.
    fn poisoned(dtype: Dtype, n: usize) -> Self {
        Buf::new(dtype, &vec![-12345.0; n])
    }
    fn addr(&mut self) -> usize {
        match self {
            Buf::F32(v) => addr(v.as_mut_ptr()),
            Buf::Bf16(v) => addr(v.as_mut_ptr()),
        }
    }
    fn to_f32(&self) -> Vec<f32> {
        match self {
            Buf::F32(v) => v.clone(),
            Buf::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: kernel {g} vs {w}"
        );
    }
}

/// The GPU tests' `assert_close`: relative to the value, floored at 5% of the largest.
fn assert_close(what: &str, dtype: Dtype, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= dtype.tol() * w.abs().max(scale * 0.05),
            "{what}: element {i}: kernel {g} vs {w}"
        );
    }
}

/// `ops::elementwise(n)`: 256 threads, enough blocks for one element each, at most 65,536.
fn elementwise_grid(n: usize) -> Dim3 {
    Dim3::x(n.div_ceil(THREADS as usize).clamp(1, 65_536) as u32)
}

// ---- gather.cu -------------------------------------------------------------------------

/// `ops::gather::gather_rows`: one block of 256 per output row.
fn gather_rows(dtype: Dtype, x: &[f32], d: usize, rows: &[i32]) -> Vec<f32> {
    let mut xb = Buf::new(dtype, x);
    let mut out = Buf::poisoned(dtype, rows.len() * d);
    let p = (xb.addr(), addr(rows.as_ptr()), out.addr());
    let (d_i, src) = (d as i32, (x.len() / d) as i32);
    launch(Dim3::x(rows.len() as u32), Dim3::x(THREADS), || unsafe {
        match dtype {
            Dtype::F32 => gather_rows_f32(p.0 as _, p.1 as _, p.2 as _, d_i, src),
            Dtype::Bf16 => gather_rows_bf16(p.0 as _, p.1 as _, p.2 as _, d_i, src),
        }
    })
    .expect("the gather_rows launch");
    out.to_f32()
}

#[test]
fn gather_rows_copies_the_chosen_rows_and_zeros_for_rows_outside() {
    for (i, d) in [896usize, 1536, 200, 1, 257].into_iter().enumerate() {
        for dtype in DTYPES {
            let src_rows = 6;
            let mut rng = Rng(10 + i as u64);
            let x = dtype.values(&mut rng, src_rows * d, 4.0);
            // Repeats, out of order; one past x, −1 and i32::MIN outside it.
            let rows = [4, 0, 4, 5, 6, -1, 2, i32::MIN, 1, 3];
            let got = gather_rows(dtype, &x, d, &rows);
            let want: Vec<f32> = rows
                .iter()
                .flat_map(
                    |&r| match usize::try_from(r).ok().filter(|&r| r < src_rows) {
                        Some(r) => x[r * d..(r + 1) * d].to_vec(),
                        None => vec![0.0; d],
                    },
                )
                .collect();
            assert_bits(&format!("gather_rows {dtype:?} d {d}"), &got, &want);
        }
    }
}

/// `ops::gather::gather_columns`: one block of 256 per row, `d = order.len()`.
fn gather_columns(dtype: Dtype, x: &[f32], order: &[u32]) -> Vec<f32> {
    let d = order.len();
    let rows = x.len() / d;
    let mut xb = Buf::new(dtype, x);
    let mut out = Buf::poisoned(dtype, rows * d);
    let p = (xb.addr(), addr(order.as_ptr()), out.addr());
    launch(Dim3::x(rows as u32), Dim3::x(THREADS), || unsafe {
        match dtype {
            Dtype::F32 => gather_columns_f32(p.0 as _, p.1 as _, p.2 as _, d as i32),
            Dtype::Bf16 => gather_columns_bf16(p.0 as _, p.1 as _, p.2 as _, d as i32),
        }
    })
    .expect("the gather_columns launch");
    out.to_f32()
}

/// A fresh random permutation of `0..d` (Fisher-Yates).
fn permutation(rng: &mut Rng, d: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..d as u32).collect();
    for i in (1..d).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order
}

#[test]
fn gather_columns_permutes_each_row_and_zeros_entries_outside() {
    // The act-order inputs: hidden (q/k/v/gate/up) and intermediate (down) of both models,
    // and ragged widths.
    for (i, d) in [896usize, 4864, 1536, 8960, 200, 1, 300]
        .into_iter()
        .enumerate()
    {
        for dtype in DTYPES {
            let rows = 3;
            let mut rng = Rng(30 + i as u64);
            let x = dtype.values(&mut rng, rows * d, 4.0);
            let mut order = permutation(&mut rng, d);
            // Entries past the row (the loader refuses them; the kernel promises zeros).
            if d > 7 {
                order[7] = d as u32;
                order[d - 1] = u32::MAX;
            }
            let got = gather_columns(dtype, &x, &order);
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let x = &x;
                    order.iter().map(move |&c| {
                        if (c as usize) < d {
                            x[r * d + c as usize]
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            assert_bits(&format!("gather_columns {dtype:?} d {d}"), &got, &want);
        }
    }
}

/// `ops::gather::chain_tokens` on `grid` (the launcher's `elementwise(count)`, or a smaller
/// one to walk the grid-stride loop it takes past 2²⁴ pairs).
fn chain(drawn: &[u32], pairs: &[i32], token_ids: &mut [u32], grid: Dim3) {
    let count = pairs.len() / 2;
    let p = (
        addr(drawn.as_ptr()),
        addr(pairs.as_ptr()),
        addr(token_ids.as_mut_ptr()),
    );
    let (n_drawn, n_tokens) = (drawn.len() as i32, token_ids.len() as i32);
    launch(grid, Dim3::x(THREADS), || unsafe {
        chain_tokens(
            p.0 as _,
            p.1 as _,
            p.2 as _,
            count as i32,
            n_drawn,
            n_tokens,
        )
    })
    .expect("the chain_tokens launch");
}

#[test]
fn chain_tokens_writes_the_drawn_ids_and_skips_pairs_outside() {
    // The GPU test's case.
    let drawn = [100u32, 101, 102];
    let mut ids = [7u32; 5];
    let pairs = [4, 2, 0, 0, 5, 1, 1, 3];
    chain(&drawn, &pairs, &mut ids, elementwise_grid(pairs.len() / 2));
    assert_eq!(ids, [100, 7, 7, 7, 102]);

    // A step of 700 tokens, 600 of them from 650 draws (distinct targets, as the host
    // builds them), plus pairs outside either buffer on both sides; more than two blocks.
    let mut rng = Rng(50);
    let (num_tokens, drawn_rows) = (700usize, 650usize);
    let drawn: Vec<u32> = (0..drawn_rows).map(|_| rng.next() as u32).collect();
    let targets = permutation(&mut rng, num_tokens);
    let mut pairs = Vec::new();
    for &to in &targets[..600] {
        pairs.extend([to as i32, rng.below(drawn_rows) as i32]);
    }
    for bad in [
        [-1, 0],
        [num_tokens as i32, 0],
        [i32::MIN, 1],
        [targets[600] as i32, -1],
        [targets[601] as i32, drawn_rows as i32],
        [targets[602] as i32, i32::MAX],
    ] {
        pairs.extend(bad);
    }
    let before: Vec<u32> = (0..num_tokens as u32).map(|i| 1_000_000 + i).collect();
    let mut want = before.clone();
    for pair in pairs.chunks_exact(2) {
        let (to, from) = (pair[0], pair[1]);
        if (0..num_tokens as i32).contains(&to) && (0..drawn_rows as i32).contains(&from) {
            want[to as usize] = drawn[from as usize];
        }
    }
    let count = pairs.len() / 2;
    for grid in [elementwise_grid(count), Dim3::x(1), Dim3::x(2)] {
        let mut ids = before.clone();
        chain(&drawn, &pairs, &mut ids, grid);
        assert_eq!(ids, want, "grid {grid:?}");
    }
}

// ---- rms_norm.cu -----------------------------------------------------------------------

/// `ops::rms_norm::rms_norm`: one block of RMS_THREADS per row.
fn rms_norm(dtype: Dtype, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    let rows = x.len() / dim;
    let mut xb = Buf::new(dtype, x);
    let mut out = Buf::poisoned(dtype, x.len());
    let p = (xb.addr(), addr(w.as_ptr()), out.addr());
    launch(Dim3::x(rows as u32), Dim3::x(THREADS), || unsafe {
        match dtype {
            Dtype::F32 => rms_norm_f32(p.0 as _, p.1 as _, p.2 as _, dim as i32, eps),
            Dtype::Bf16 => rms_norm_bf16(p.0 as _, p.1 as _, p.2 as _, dim as i32, eps),
        }
    })
    .expect("the rms_norm launch");
    out.to_f32()
}

/// `ops::rms_norm::add_rms_norm`: the updated residual and the output.
fn add_rms_norm(dtype: Dtype, x: &[f32], res: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let dim = w.len();
    let rows = x.len() / dim;
    let (mut xb, mut rb) = (Buf::new(dtype, x), Buf::new(dtype, res));
    let mut out = Buf::poisoned(dtype, x.len());
    let p = (xb.addr(), rb.addr(), addr(w.as_ptr()), out.addr());
    launch(Dim3::x(rows as u32), Dim3::x(THREADS), || unsafe {
        match dtype {
            Dtype::F32 => add_rms_norm_f32(p.0 as _, p.1 as _, p.2 as _, p.3 as _, dim as i32, eps),
            Dtype::Bf16 => {
                add_rms_norm_bf16(p.0 as _, p.1 as _, p.2 as _, p.3 as _, dim as i32, eps)
            }
        }
    })
    .expect("the add_rms_norm launch");
    (rb.to_f32(), out.to_f32())
}

/// novainfer-model's `layers::ops::rms_norm`: the mean square in float64, the scale rounded
/// to f32, then `v · scale · w` in f32.
fn cpu_rms_norm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let dim = w.len();
    x.chunks_exact(dim)
        .flat_map(|row| {
            let mean_sq = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / dim as f64;
            let scale = (1.0 / (mean_sq + eps).sqrt()) as f32;
            row.iter().zip(w).map(move |(&v, &w)| v * scale * w)
        })
        .collect()
}

#[test]
fn rms_norm_and_add_rms_norm_match_the_cpu_and_are_batch_invariant() {
    // Both models' hidden sizes; shorter than the block, just past it, not a multiple of a
    // warp, the 0.5B's intermediate size.
    for (i, dim) in [896usize, 1536, 1, 100, 257, 1000, 4864]
        .into_iter()
        .enumerate()
    {
        for dtype in DTYPES {
            let what = format!("{dtype:?} dim {dim}");
            let (rows, eps) = (5, 1e-6f32);
            let mut rng = Rng(60 + i as u64);
            let mut x = dtype.values(&mut rng, rows * dim, 3.0);
            // One row all zeros: scale rsqrt(eps), the output zeros.
            x[rows * dim - dim..].fill(0.0);
            let res = dtype.values(&mut rng, rows * dim, 3.0);
            let w = rng.f32s(dim, 1.5);

            let got = rms_norm(dtype, &x, &w, eps);
            let want = cpu_rms_norm(&x, &w, f64::from(eps));
            assert_close(&format!("rms_norm {what}"), dtype, &got, &want);
            assert!(
                got[rows * dim - dim..].iter().all(|&v| v == 0.0),
                "{what}: zero row"
            );

            let (residual, fused) = add_rms_norm(dtype, &x, &res, &w, eps);
            // The residual add is one IEEE f32 addition rounded to the dtype.
            let summed: Vec<f32> = x
                .iter()
                .zip(&res)
                .map(|(a, b)| dtype.round(a + b))
                .collect();
            assert_bits(&format!("add_rms_norm residual {what}"), &residual, &summed);
            let want = cpu_rms_norm(&summed, &w, f64::from(eps));
            assert_close(&format!("add_rms_norm {what}"), dtype, &fused, &want);
            // The fused kernel norms the residual as stored, in rms_norm's order.
            let unfused = rms_norm(dtype, &summed, &w, eps);
            assert_bits(
                &format!("add_rms_norm {what}: fused vs unfused"),
                &fused,
                &unfused,
            );

            // Row 2 alone: the batch's bits (one block a row, a reduction shaped by dim only).
            let row = 2 * dim..3 * dim;
            let alone = rms_norm(dtype, &x[row.clone()], &w, eps);
            assert_bits(
                &format!("rms_norm {what}: row alone"),
                &alone,
                &got[row.clone()],
            );
            let (res_alone, out_alone) =
                add_rms_norm(dtype, &x[row.clone()], &res[row.clone()], &w, eps);
            assert_bits(
                &format!("add_rms_norm {what}: residual alone"),
                &res_alone,
                &residual[row.clone()],
            );
            assert_bits(
                &format!("add_rms_norm {what}: output alone"),
                &out_alone,
                &fused[row],
            );
        }
    }
}

// ---- silu_mul.cu -----------------------------------------------------------------------

/// The kernel as `ops::silu_mul` (`up` its own tensor, stride d) or `silu_mul_fused` (`up`
/// d values into `gate`'s fused rows, stride 2d) launches it, on `grid` (elementwise's
/// unless a test walks the grid-stride loop).
fn silu_mul(dtype: Dtype, gate_up: &[f32], fused: bool, d: usize, grid: Option<Dim3>) -> Vec<f32> {
    let stride = if fused { 2 * d } else { d };
    // Either way half the buffer is gate values: [gate | up] or rows of [gate_r | up_r].
    let n = gate_up.len() / 2;
    let mut buf = Buf::new(dtype, gate_up);
    let mut out = Buf::poisoned(dtype, n);
    let elem = match dtype {
        Dtype::F32 => 4,
        Dtype::Bf16 => 2,
    };
    // Separate tensors: gate is the first half of the buffer, up the second.
    let gate = buf.addr();
    let up = if fused {
        gate + d * elem
    } else {
        gate + n * elem
    };
    let p = (gate, up, out.addr());
    let grid = grid.unwrap_or_else(|| elementwise_grid(n));
    let (d_i, s_i, n_i) = (d as i32, stride as i32, n as i64);
    launch(grid, Dim3::x(THREADS), || unsafe {
        match dtype {
            Dtype::F32 => silu_mul_f32(p.0 as _, p.1 as _, p.2 as _, d_i, s_i, n_i),
            Dtype::Bf16 => silu_mul_bf16(p.0 as _, p.1 as _, p.2 as _, d_i, s_i, n_i),
        }
    })
    .expect("the silu_mul launch");
    out.to_f32()
}

/// `silu(g) · u = g / (1 + e^−g) · u` in float64.
fn silu_mul_f64(g: f32, u: f32) -> f32 {
    let g = f64::from(g);
    (g / (1.0 + (-g).exp()) * f64::from(u)) as f32
}

#[test]
fn silu_mul_matches_the_cpu_in_both_layouts() {
    // The intermediate sizes of both models and ragged ones.
    for (i, d) in [4864usize, 8960, 1, 1003].into_iter().enumerate() {
        for dtype in DTYPES {
            let what = format!("{dtype:?} d {d}");
            let rows = 3;
            let mut rng = Rng(80 + i as u64);
            let mut gate = dtype.values(&mut rng, rows * d, 6.0);
            let up = dtype.values(&mut rng, rows * d, 2.0);
            // The logistic's far tails: e^−g overflows f32 (the result is −0 · u) or vanishes.
            if d > 4 {
                gate[..4].copy_from_slice(&[-100.0, -88.0, 100.0, 0.0]);
            }
            let want: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| silu_mul_f64(g, u))
                .collect();

            let separate: Vec<f32> = gate.iter().chain(&up).copied().collect();
            let got = silu_mul(dtype, &separate, false, d, None);
            assert_close(&format!("silu_mul {what}"), dtype, &got, &want);

            let mut fused = Vec::with_capacity(2 * rows * d);
            for r in 0..rows {
                fused.extend_from_slice(&gate[r * d..(r + 1) * d]);
                fused.extend_from_slice(&up[r * d..(r + 1) * d]);
            }
            let got_fused = silu_mul(dtype, &fused, true, d, None);
            // Same inputs, same formula: the layouts agree to the bit.
            assert_bits(&format!("silu_mul_fused {what}"), &got_fused, &got);

            // The grid-stride loop the launcher's 65,536-block cap leaves past 2²⁴ elements.
            let strided = silu_mul(dtype, &fused, true, d, Some(Dim3::x(3)));
            assert_bits(
                &format!("silu_mul_fused {what}: grid-stride"),
                &strided,
                &got,
            );
        }
    }
}

// ---- embedding.cu ----------------------------------------------------------------------

/// `ops::embedding::embedding`: one block of 256 per token.
fn embedding(dtype: Dtype, ids: &[u32], table: &[bf16], hidden: usize) -> Vec<f32> {
    let vocab = table.len() / hidden;
    let mut out = Buf::poisoned(dtype, ids.len() * hidden);
    let p = (addr(ids.as_ptr()), addr(table.as_ptr()), out.addr());
    let (h, v) = (hidden as i32, vocab as i32);
    launch(Dim3::x(ids.len() as u32), Dim3::x(THREADS), || unsafe {
        match dtype {
            Dtype::F32 => embedding_gather_f32(p.0 as _, p.1 as _, p.2 as _, h, v),
            Dtype::Bf16 => embedding_gather_bf16(p.0 as _, p.1 as _, p.2 as _, h, v),
        }
    })
    .expect("the embedding launch");
    out.to_f32()
}

#[test]
fn embedding_copies_table_rows_and_zeros_ids_outside_the_vocabulary() {
    for (i, hidden) in [896usize, 1536, 96, 1, 257].into_iter().enumerate() {
        for dtype in DTYPES {
            let vocab = 50;
            let mut rng = Rng(90 + i as u64);
            let table = rng.bf16s(vocab * hidden, 2.0);
            // Repeats, the last row; past it: the vocabulary size, u32::MAX (−1 as a signed
            // id), 2³¹ (negative as i32) and a Qwen2-sized id.
            let ids = [3u32, 0, 49, 3, 50, u32::MAX, 1 << 31, 151_935, 7];
            let got = embedding(dtype, &ids, &table, hidden);
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&id| {
                    let id = id as usize;
                    if id < vocab {
                        table[id * hidden..(id + 1) * hidden]
                            .iter()
                            .map(|v| v.to_f32())
                            .collect()
                    } else {
                        vec![0.0; hidden]
                    }
                })
                .collect();
            // bf16 → f32 and bf16 → bf16 are exact.
            assert_bits(&format!("embedding {dtype:?} hidden {hidden}"), &got, &want);
        }
    }
}
