//! kernels/lora.cu run by the emulator, launched as `ops::lora` launches it, against the
//! kernels' CPU twin (`lora_plan::emulate_shrink` / `emulate_expand`, bit for bit: the emulator
//! contracts nothing, so the kernels' order of operations is the twin's) and a float64
//! reference: Qwen2 0.5B and 1.5B projection shapes and ragged ones, f32 and bf16 outputs, rows
//! on several adapters of several ranks, the base model (slot −1), an adapter without the
//! projection and a slot past the table, q/k/v updates into their columns of a fused output,
//! and each row alone giving the bits it had in the batch.

mod common;

use common::{addr, Rng};
use half::bf16;
use novainfer_cuda::lora_plan::{
    emulate_expand, emulate_shrink, expand_grid, shrink_grid, HostPair, EXPAND_THREADS,
    SHRINK_WARPS,
};
use novainfer_cuemu::kernels::lora::{
    lora_expand_bf16, lora_expand_f32, lora_shrink_bf16, lora_shrink_f32, LoraPair,
};
use novainfer_cuemu::{launch, Dim3};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    /// `v` as a tensor of this dtype holds it.
    fn round(self, v: f32) -> f32 {
        match self {
            Dtype::F32 => v,
            Dtype::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }
}

/// An activation tensor in either dtype, on the host (the kernels' "device" memory).
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

/// One projection's adapters: the host matrices (for the twin and the reference) and the
/// `LoraPair` table pointing at them (what the kernels read).
struct Table {
    host: Vec<HostPair>,
    pairs: Vec<LoraPair>,
}

impl Table {
    /// A slot per entry of `ranks`: `Some(rank)` an adapter of that rank, `None` an adapter
    /// that leaves this projection alone (a null `a`).
    fn new(rng: &mut Rng, in_f: usize, out: usize, ranks: &[Option<usize>]) -> Self {
        let host: Vec<HostPair> = ranks
            .iter()
            .enumerate()
            .map(|(i, r)| match *r {
                Some(rank) => HostPair {
                    a: Some(rng.f32s(rank * in_f, 0.1)),
                    bt: rng.f32s(rank * out, 0.1),
                    rank,
                    scale: 0.5 + i as f32 * 0.75,
                },
                None => HostPair {
                    a: None,
                    bt: Vec::new(),
                    rank: 0,
                    scale: 0.0,
                },
            })
            .collect();
        // The matrices live in `host`, which the table keeps alive with the pairs.
        let pairs = host
            .iter()
            .map(|p| match &p.a {
                Some(a) => LoraPair {
                    a: a.as_ptr() as u64,
                    bt: p.bt.as_ptr() as u64,
                    rank: p.rank as i32,
                    scale: p.scale,
                },
                None => LoraPair::default(),
            })
            .collect();
        Table { host, pairs }
    }

    /// A table whose slots claim `rank` (as a larger resident adapter's would) but hold the
    /// same matrices: only the first `rank` rows of each are real.
    fn with_rank(&self, rank: usize) -> Vec<LoraPair> {
        self.pairs
            .iter()
            .zip(&self.host)
            .map(|(p, h)| LoraPair {
                rank: if h.a.is_some() { rank as i32 } else { p.rank },
                ..*p
            })
            .collect()
    }
}

/// Where an expand writes: columns `offset..offset + out` of rows of `stride`.
#[derive(Clone, Copy, Debug)]
struct Columns {
    out: usize,
    stride: usize,
    offset: usize,
}

/// `ops::lora::lora_shrink`: `t` (`[rows, max_rank]`, filled with NaN first so a cell the
/// kernel skips shows) from `x` (`[rows, in_f]`, values of `dtype`).
fn shrink(
    dtype: Dtype,
    x: &[f32],
    in_f: usize,
    row_slot: &[i32],
    pairs: &[LoraPair],
    max_rank: usize,
) -> Vec<f32> {
    let rows = row_slot.len();
    assert_eq!(x.len(), rows * in_f, "x is [rows, in_features]");
    let mut t = vec![f32::NAN; rows * max_rank];
    if rows == 0 || max_rank == 0 {
        return t;
    }
    let mut xb = Buf::new(dtype, x);
    let p = (
        xb.addr(),
        addr(row_slot.as_ptr()),
        addr(pairs.as_ptr()),
        addr(t.as_mut_ptr()),
    );
    let (gx, gy) = shrink_grid(rows, max_rank);
    let args = (in_f as i32, pairs.len() as i32, max_rank as i32);
    launch(
        Dim3::xy(gx as u32, gy as u32),
        Dim3::x((SHRINK_WARPS * 32) as u32),
        || unsafe {
            match dtype {
                Dtype::F32 => lora_shrink_f32(
                    p.0 as _, p.1 as _, p.2 as _, p.3 as _, args.0, args.1, args.2,
                ),
                Dtype::Bf16 => lora_shrink_bf16(
                    p.0 as _, p.1 as _, p.2 as _, p.3 as _, args.0, args.1, args.2,
                ),
            }
        },
    )
    .expect("the lora shrink launch");
    t
}

/// `ops::lora::lora_expand`: `y` (`[rows, stride]`, values of `dtype`) plus each row's update
/// in its columns.
fn expand(
    dtype: Dtype,
    t: &[f32],
    row_slot: &[i32],
    pairs: &[LoraPair],
    max_rank: usize,
    y: &[f32],
    cols: Columns,
) -> Vec<f32> {
    let rows = row_slot.len();
    assert_eq!(t.len(), rows * max_rank, "t is [rows, max_rank]");
    assert_eq!(y.len(), rows * cols.stride, "y is [rows, stride]");
    assert!(
        cols.offset + cols.out <= cols.stride,
        "the launcher's check"
    );
    let mut yb = Buf::new(dtype, y);
    if rows == 0 || cols.out == 0 {
        return yb.to_f32();
    }
    let p = (
        addr(t.as_ptr()),
        addr(row_slot.as_ptr()),
        addr(pairs.as_ptr()),
        yb.addr(),
    );
    let (gx, gy) = expand_grid(cols.out, rows);
    let args = (
        cols.out as i32,
        cols.stride as i32,
        cols.offset as i32,
        pairs.len() as i32,
        max_rank as i32,
    );
    launch(
        Dim3::xy(gx as u32, gy as u32),
        Dim3::x(EXPAND_THREADS as u32),
        || unsafe {
            match dtype {
                Dtype::F32 => lora_expand_f32(
                    p.0 as _, p.1 as _, p.2 as _, p.3 as _, args.0, args.1, args.2, args.3, args.4,
                ),
                Dtype::Bf16 => lora_expand_bf16(
                    p.0 as _, p.1 as _, p.2 as _, p.3 as _, args.0, args.1, args.2, args.3, args.4,
                ),
            }
        },
    )
    .expect("the lora expand launch");
    yb.to_f32()
}

/// The pair a row runs with, if it has an update for this projection.
fn pair_of(host: &[HostPair], slot: i32) -> Option<(&HostPair, &[f32])> {
    let p = usize::try_from(slot).ok().and_then(|s| host.get(s))?;
    p.a.as_deref().map(|a| (p, a))
}

/// `y[r, offset + c] + s · Σ_j (Σ_k x[r, k] · A[j, k]) · Bᵀ[j, c]` in float64, for the rows
/// with an update; every other value as it was.
fn reference(
    x: &[f32],
    in_f: usize,
    row_slot: &[i32],
    host: &[HostPair],
    y: &[f32],
    cols: Columns,
) -> Vec<f64> {
    let mut want: Vec<f64> = y.iter().map(|&v| f64::from(v)).collect();
    for (r, &slot) in row_slot.iter().enumerate() {
        let Some((p, a)) = pair_of(host, slot) else {
            continue;
        };
        let xr = &x[r * in_f..(r + 1) * in_f];
        let t: Vec<f64> = (0..p.rank)
            .map(|j| {
                let dot: f64 = xr
                    .iter()
                    .zip(&a[j * in_f..(j + 1) * in_f])
                    .map(|(&x, &a)| f64::from(x) * f64::from(a))
                    .sum();
                f64::from(p.scale) * dot
            })
            .collect();
        for c in 0..cols.out {
            let update: f64 = (0..p.rank)
                .map(|j| t[j] * f64::from(p.bt[j * cols.out + c]))
                .sum();
            want[r * cols.stride + cols.offset + c] += update;
        }
    }
    want
}

/// Against float64: the f32 sums' rounding (lora_plan's own test bound), plus the output's
/// rounding to bf16 (half an ulp, 2⁻⁹ relative) for bf16.
fn assert_near(what: &str, dtype: Dtype, got: &[f32], want: &[f64], in_f: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let mut tol = 1e-4 * (1.0 + w.abs()) * (in_f as f64).sqrt();
        if dtype == Dtype::Bf16 {
            tol += w.abs() / 256.0;
        }
        assert!(
            (f64::from(g) - w).abs() <= tol,
            "{what}: element {i}: kernel {g} vs {w}"
        );
    }
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: kernel {g} vs twin {w}"
        );
    }
}

/// Slots: ranks 16, none (an adapter without this projection), 8, 64 (the largest), 1, and 7
/// (ranks not a multiple of the shrink's four warps).
const RANKS: [Option<usize>; 6] = [Some(16), None, Some(8), Some(64), Some(1), Some(7)];
const MAX_RANK: usize = 64;
/// Rows on every slot, the base model (−1), a slot past the table (9) and a negative one
/// other than −1, in no order.
const ROW_SLOT: [i32; 11] = [0, -1, 2, 3, 0, 1, 3, 9, 4, 5, -7];

/// One projection: shrink and expand on fresh inputs, against the twin and float64; the
/// columns outside the projection and the rows without an update keep their bits.
fn check_projection(dtype: Dtype, in_f: usize, cols: Columns, seed: u64) {
    let what = format!("{dtype:?} {in_f}->{} ({cols:?})", cols.out);
    let mut rng = Rng(seed);
    let table = Table::new(&mut rng, in_f, cols.out, &RANKS);
    let rows = ROW_SLOT.len();
    let x: Vec<f32> = rng
        .f32s(rows * in_f, 1.0)
        .into_iter()
        .map(|v| dtype.round(v))
        .collect();
    let y0: Vec<f32> = rng
        .f32s(rows * cols.stride, 1.0)
        .into_iter()
        .map(|v| dtype.round(v))
        .collect();

    let t = shrink(dtype, &x, in_f, &ROW_SLOT, &table.pairs, MAX_RANK);
    let twin_t = emulate_shrink(&x, in_f, &ROW_SLOT, &table.host, MAX_RANK);
    assert_bits(&format!("{what}: t"), &t, &twin_t);

    let got = expand(dtype, &t, &ROW_SLOT, &table.pairs, MAX_RANK, &y0, cols);
    let mut twin_y = y0.clone();
    emulate_expand(
        &twin_t,
        &ROW_SLOT,
        &table.host,
        MAX_RANK,
        &mut twin_y,
        cols.out,
        cols.stride,
        cols.offset,
    );
    // The kernel rounds its f32 sum to the output dtype once, where the twin keeps f32.
    let twin_y: Vec<f32> = twin_y.iter().map(|&v| dtype.round(v)).collect();
    assert_bits(&format!("{what}: y"), &got, &twin_y);

    let want = reference(&x, in_f, &ROW_SLOT, &table.host, &y0, cols);
    assert_near(&format!("{what}: y vs float64"), dtype, &got, &want, in_f);

    for (r, &slot) in ROW_SLOT.iter().enumerate() {
        let updated = pair_of(&table.host, slot).is_some();
        for c in 0..cols.stride {
            let inside = (cols.offset..cols.offset + cols.out).contains(&c);
            let i = r * cols.stride + c;
            if !(updated && inside) {
                assert_eq!(
                    got[i].to_bits(),
                    y0[i].to_bits(),
                    "{what}: row {r} (slot {slot}) column {c} must stay"
                );
            }
        }
    }
    // Sanity: the updates are not lost in y's own values.
    let moved = got.iter().zip(&y0).filter(|(a, b)| a != b).count();
    assert!(moved > cols.out, "{what}: only {moved} values changed");
}

#[test]
fn each_row_gets_its_own_adapters_update_at_qwen2_shapes() {
    // (in, out, stride, offset): q, k and v into a fused q|k|v row, up into the second half of
    // a fused gate|up row, and down; the 0.5B then the 1.5B.
    let shapes = [
        (896, 896, 1152, 0),
        (896, 128, 1152, 896),
        (896, 128, 1152, 1024),
        (896, 4864, 9728, 4864),
        (4864, 896, 896, 0),
        (1536, 1536, 2048, 0),
        (1536, 256, 2048, 1792),
        (1536, 8960, 17920, 0),
        (8960, 1536, 1536, 0),
    ];
    for (i, &(in_f, out, stride, offset)) in shapes.iter().enumerate() {
        let dtype = if i % 2 == 0 { Dtype::Bf16 } else { Dtype::F32 };
        let cols = Columns {
            out,
            stride,
            offset,
        };
        check_projection(dtype, in_f, cols, 100 + i as u64);
    }
}

#[test]
fn ragged_shapes_in_both_dtypes() {
    // Inputs shorter than a warp, not a multiple of it, outputs short of or just past one
    // expand block, an offset off every alignment.
    let shapes = [
        (5, 3, 3, 0),
        (37, 300, 301, 1),
        (33, 257, 300, 43),
        (100, 255, 256, 1),
    ];
    for (i, &(in_f, out, stride, offset)) in shapes.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let cols = Columns {
                out,
                stride,
                offset,
            };
            check_projection(dtype, in_f, cols, 200 + i as u64);
        }
    }
}

/// The model's use: q, k and v (each its own adapter table, sharing the input) added in turn
/// to their columns of one fused row; every column gets exactly its projection's update.
#[test]
fn q_k_and_v_updates_land_in_their_columns_of_the_fused_output() {
    for (dtype, seed) in [(Dtype::Bf16, 300), (Dtype::F32, 301)] {
        let (in_f, stride) = (896, 1152);
        let parts = [(0, 896), (896, 128), (1024, 128)];
        let mut rng = Rng(seed);
        let tables: Vec<Table> = parts
            .iter()
            .map(|&(_, out)| Table::new(&mut rng, in_f, out, &RANKS))
            .collect();
        let rows = ROW_SLOT.len();
        let x: Vec<f32> = rng
            .f32s(rows * in_f, 1.0)
            .into_iter()
            .map(|v| dtype.round(v))
            .collect();
        let y0: Vec<f32> = rng
            .f32s(rows * stride, 1.0)
            .into_iter()
            .map(|v| dtype.round(v))
            .collect();
        let mut y = y0.clone();
        let mut twin = y0.clone();
        let mut want: Vec<f64> = y0.iter().map(|&v| f64::from(v)).collect();
        for (&(offset, out), table) in parts.iter().zip(&tables) {
            let cols = Columns {
                out,
                stride,
                offset,
            };
            let t = shrink(dtype, &x, in_f, &ROW_SLOT, &table.pairs, MAX_RANK);
            y = expand(dtype, &t, &ROW_SLOT, &table.pairs, MAX_RANK, &y, cols);
            let twin_t = emulate_shrink(&x, in_f, &ROW_SLOT, &table.host, MAX_RANK);
            emulate_expand(
                &twin_t,
                &ROW_SLOT,
                &table.host,
                MAX_RANK,
                &mut twin,
                out,
                stride,
                offset,
            );
            twin = twin.iter().map(|&v| dtype.round(v)).collect();
            // Each part's float64 update added to the columns only it touches.
            let part = reference(&x, in_f, &ROW_SLOT, &table.host, &y0, cols);
            for r in 0..rows {
                for c in offset..offset + out {
                    want[r * stride + c] = part[r * stride + c];
                }
            }
        }
        assert_bits(&format!("{dtype:?} fused qkv vs twin"), &y, &twin);
        assert_near(
            &format!("{dtype:?} fused qkv vs float64"),
            dtype,
            &y,
            &want,
            in_f,
        );
    }
}

/// A row's update does not depend on the rows launched with it: each row alone gives the
/// bits it had in the batch (rule 1 of common.cuh), in t and in y.
#[test]
fn a_rows_update_is_the_same_alone_and_in_the_batch() {
    let dtype = Dtype::Bf16;
    let (in_f, cols) = (
        896,
        Columns {
            out: 896,
            stride: 1152,
            offset: 0,
        },
    );
    let mut rng = Rng(400);
    let table = Table::new(&mut rng, in_f, cols.out, &RANKS);
    let rows = ROW_SLOT.len();
    let x: Vec<f32> = rng
        .f32s(rows * in_f, 1.0)
        .into_iter()
        .map(|v| dtype.round(v))
        .collect();
    let y0: Vec<f32> = rng
        .f32s(rows * cols.stride, 1.0)
        .into_iter()
        .map(|v| dtype.round(v))
        .collect();
    let t = shrink(dtype, &x, in_f, &ROW_SLOT, &table.pairs, MAX_RANK);
    let y = expand(dtype, &t, &ROW_SLOT, &table.pairs, MAX_RANK, &y0, cols);
    for r in 0..rows {
        let one = &ROW_SLOT[r..r + 1];
        let xr = &x[r * in_f..(r + 1) * in_f];
        let yr = &y0[r * cols.stride..(r + 1) * cols.stride];
        let t1 = shrink(dtype, xr, in_f, one, &table.pairs, MAX_RANK);
        assert_bits(
            &format!("row {r} alone: t"),
            &t1,
            &t[r * MAX_RANK..(r + 1) * MAX_RANK],
        );
        let y1 = expand(dtype, &t1, one, &table.pairs, MAX_RANK, yr, cols);
        assert_bits(
            &format!("row {r} alone: y"),
            &y1,
            &y[r * cols.stride..(r + 1) * cols.stride],
        );
    }
}

/// `t`'s row stride smaller than a slot's claimed rank (the launcher asks for at least every
/// rank; the kernels still bound their reads by max_rank): the shrink fills max_rank cells, the
/// expand sums only those, as the twin does, and nothing reads the next row's.
#[test]
fn a_rank_past_max_rank_is_cut_at_max_rank() {
    let (in_f, cols) = (
        64,
        Columns {
            out: 96,
            stride: 96,
            offset: 0,
        },
    );
    let mut rng = Rng(500);
    // Real matrices of rank 16; the table claims rank 16 and t holds 8 a row.
    let table = Table::new(&mut rng, in_f, cols.out, &[Some(16), Some(16)]);
    let row_slot = [1, 0, -1, 1];
    let max_rank = 8;
    let x = rng.f32s(row_slot.len() * in_f, 1.0);
    let y0 = rng.f32s(row_slot.len() * cols.stride, 1.0);
    let t = shrink(Dtype::F32, &x, in_f, &row_slot, &table.pairs, max_rank);
    let twin_t = emulate_shrink(&x, in_f, &row_slot, &table.host, max_rank);
    assert_bits("t cut at max_rank", &t, &twin_t);
    let y = expand(Dtype::F32, &t, &row_slot, &table.pairs, max_rank, &y0, cols);
    let mut twin_y = y0.clone();
    emulate_expand(
        &twin_t,
        &row_slot,
        &table.host,
        max_rank,
        &mut twin_y,
        cols.out,
        cols.stride,
        cols.offset,
    );
    assert_bits("y with ranks cut at max_rank", &y, &twin_y);
    // The same as adapters of rank max_rank made of the first max_rank rows.
    let cut = table.with_rank(max_rank);
    let t8 = shrink(Dtype::F32, &x, in_f, &row_slot, &cut, max_rank);
    assert_bits("t of rank-8 adapters", &t8, &t);
    let y8 = expand(Dtype::F32, &t8, &row_slot, &cut, max_rank, &y0, cols);
    assert_bits("y of rank-8 adapters", &y8, &y);
}

/// A step with no adapter rows at all, and one whose every row runs the base model: the
/// shrink writes zeros, the expand leaves y's bits.
#[test]
fn base_model_rows_are_left_alone() {
    let (in_f, cols) = (
        896,
        Columns {
            out: 128,
            stride: 1152,
            offset: 896,
        },
    );
    let mut rng = Rng(600);
    let table = Table::new(&mut rng, in_f, cols.out, &RANKS);
    let row_slot = [-1; 5];
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let x: Vec<f32> = rng
            .f32s(row_slot.len() * in_f, 1.0)
            .into_iter()
            .map(|v| dtype.round(v))
            .collect();
        let y0: Vec<f32> = rng
            .f32s(row_slot.len() * cols.stride, 1.0)
            .into_iter()
            .map(|v| dtype.round(v))
            .collect();
        let t = shrink(dtype, &x, in_f, &row_slot, &table.pairs, MAX_RANK);
        assert!(t.iter().all(|v| v.to_bits() == 0), "{dtype:?}: t is all +0");
        let y = expand(dtype, &t, &row_slot, &table.pairs, MAX_RANK, &y0, cols);
        assert_bits(&format!("{dtype:?}: y untouched"), &y, &y0);
    }
}
