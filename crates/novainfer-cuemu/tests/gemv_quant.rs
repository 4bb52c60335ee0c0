//! kernels/gemv_quant.cu run by the emulator, launched as `ops::gemv_quant` launches it (grid,
//! block, the `GemvParts` runs passed by value), on random packed blocks (random quants and
//! scale bits) and random bf16 rows:
//! - `gemv_*` (both families, f32 and bf16 stores): bit for bit against its twin
//!   (`gemv_plan::emulate_runs`), and within f32 rounding of a float64 product of the dequantized
//!   weights; every format, runs of mixed formats, 1 to 8 activation rows, one block of k (fewer
//!   chunks than lanes), Qwen2 0.5B and 1.5B sizes, outputs in columns of a wider row;
//! - `gemv_silu_*`: bit for bit against the twin's products rounded as the GEMV's store, then
//!   silu_mul.cu's arithmetic (the fusion's promise);
//! - `gemv_qkv_*`: bit for bit against `gemv_plan::emulate_qkv` at Qwen2 0.5B and 1.5B head
//!   geometries, with and without bias, padding slots, a slot past the pool, positions outside
//!   the RoPE table;
//! - `gemm_packed_*` and `gemm_packed_reduce_*` (mma.sync emulated): against the twin
//!   (`gemm_tile::emulate`) within the GPU test's tolerance and against a float64 product of the
//!   staged bf16 weights, partial tiles, k whole and split; the workspace untouched when not split.

mod common;

use common::{Aligned, Dtype, Rng};
use half::{bf16, f16};
use novainfer_cuda::gemm_tile;
use novainfer_cuda::gemv_plan::{
    self, chunk, GemvFamily, GemvWeights, HostRun, QkvHeads, QkvOut, QkvTokens, CHUNK, MAX_ROWS,
    WARPS,
};
use novainfer_cuda::quant_type::QuantType;
use novainfer_cuda::rope_scaling::{cos_sin_table, RopeScaling};
use novainfer_cuemu::kernels::gemv_quant::*;
use novainfer_cuemu::{launch, Dim3};

type PlainFn<T> =
    unsafe extern "C-unwind" fn(GemvParts, *const u16, *mut T, i32, i32, i32, i32, i32);
type SiluFn<T> = unsafe extern "C-unwind" fn(GemvParts, *const u16, *mut T, i32, i32, i32);
type QkvFn<T> = unsafe extern "C-unwind" fn(
    GemvParts,
    *const u16,
    *const f32,
    *const i32,
    *const i64,
    *const f32,
    *mut T,
    *mut T,
    *mut T,
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    i64,
);
type GemmFn<T> = unsafe extern "C-unwind" fn(
    GemvParts,
    *const u16,
    *mut T,
    *mut f32,
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
);
type ReduceFn<T> = unsafe extern "C-unwind" fn(*const f32, *mut T, i32, i32, i32, i32, i32);

/// An output dtype: its entry points (family by family), and what a store of an f32 holds.
trait Out: Dtype {
    /// The store's relative rounding error, bounded: none in f32, half a bf16 ulp (2^-9) with
    /// a margin.
    const ROUNDING: f64;
    fn plain(family: GemvFamily) -> PlainFn<Self>;
    fn silu(family: GemvFamily) -> SiluFn<Self>;
    fn qkv(family: GemvFamily) -> QkvFn<Self>;
    fn gemm() -> GemmFn<Self>;
    fn reduce() -> ReduceFn<Self>;
    /// `v` stored and loaded back (the unfused path's intermediate, `round_as`).
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
}

impl Out for f32 {
    const ROUNDING: f64 = 0.0;
    fn plain(family: GemvFamily) -> PlainFn<Self> {
        match family {
            GemvFamily::Packed => gemv_packed_f32,
            GemvFamily::Bf16 => gemv_bf16w_f32,
        }
    }
    fn silu(family: GemvFamily) -> SiluFn<Self> {
        match family {
            GemvFamily::Packed => gemv_silu_packed_f32,
            GemvFamily::Bf16 => gemv_silu_bf16w_f32,
        }
    }
    fn qkv(family: GemvFamily) -> QkvFn<Self> {
        match family {
            GemvFamily::Packed => gemv_qkv_packed_f32,
            GemvFamily::Bf16 => gemv_qkv_bf16w_f32,
        }
    }
    fn gemm() -> GemmFn<Self> {
        gemm_packed_f32
    }
    fn reduce() -> ReduceFn<Self> {
        gemm_packed_reduce_f32
    }
}

/// bf16 as the kernels take it: its bit pattern.
impl Out for u16 {
    const ROUNDING: f64 = 1.0 / 256.0;
    fn plain(family: GemvFamily) -> PlainFn<Self> {
        match family {
            GemvFamily::Packed => gemv_packed_bf16,
            GemvFamily::Bf16 => gemv_bf16w_bf16,
        }
    }
    fn silu(family: GemvFamily) -> SiluFn<Self> {
        match family {
            GemvFamily::Packed => gemv_silu_packed_bf16,
            GemvFamily::Bf16 => gemv_silu_bf16w_bf16,
        }
    }
    fn qkv(family: GemvFamily) -> QkvFn<Self> {
        match family {
            GemvFamily::Packed => gemv_qkv_packed_bf16,
            GemvFamily::Bf16 => gemv_qkv_bf16w_bf16,
        }
    }
    fn gemm() -> GemmFn<Self> {
        gemm_packed_bf16
    }
    fn reduce() -> ReduceFn<Self> {
        gemm_packed_reduce_bf16
    }
}

const SENTINEL: f32 = -7.0;

fn packed(q: QuantType) -> GemvWeights {
    GemvWeights::Packed(q)
}

/// A random f16 block scale: mostly GGUF-sized values of either sign, sometimes a subnormal.
fn f16_scale(rng: &mut Rng) -> [u8; 2] {
    let v = if rng.below(8) == 0 {
        f16::from_bits(rng.below(0x400) as u16 | (0x8000 * rng.below(2) as u16))
    } else {
        f16::from_f32(rng.f32(0.02))
    };
    v.to_le_bytes()
}

/// `rows` random rows of `k` in `weights`' format: random quants and scale bits with sane
/// scales (FP8 without its NaN codes, which the loaders refuse), or random bf16 values.
fn random_rows(weights: GemvWeights, rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let q = match weights {
        GemvWeights::Bf16 => {
            return rng
                .bf16s(rows * k, 1.0)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        }
        GemvWeights::Packed(q) => q,
    };
    let bb = q.block_bytes();
    let mut raw: Vec<u8> = (0..rows * weights.row_bytes(k))
        .map(|_| rng.next() as u8)
        .collect();
    for b in raw.chunks_exact_mut(bb) {
        match q {
            QuantType::Q8_0 | QuantType::Q5_0 => b[..2].copy_from_slice(&f16_scale(rng)),
            QuantType::Q4K => {
                b[..2].copy_from_slice(&f16_scale(rng));
                b[2..4].copy_from_slice(&f16_scale(rng));
            }
            QuantType::Q6K => b[208..210].copy_from_slice(&f16_scale(rng)),
            QuantType::Int4 => {
                b[..4].copy_from_slice(&rng.f32(0.02).to_le_bytes());
                b[4] &= 0x0F;
            }
            QuantType::Fp8 => {
                b[..4].copy_from_slice(&rng.f32(0.01).to_le_bytes());
                for c in &mut b[4..] {
                    if *c & 0x7F == 0x7F {
                        *c = 0x7E;
                    }
                }
            }
        }
    }
    raw
}

/// A weight matrix as the launcher takes it: runs of rows in one format each, on 16-byte
/// boundaries (device allocations are; bf16 rows are read 16 bytes at a time).
struct Matrix {
    k: usize,
    layout: Vec<(GemvWeights, usize)>,
    raw: Vec<Vec<u8>>,
    dev: Vec<Aligned<u8>>,
}

impl Matrix {
    fn new(layout: &[(GemvWeights, usize)], k: usize, rng: &mut Rng) -> Self {
        assert!(!layout.is_empty() && layout.len() <= MAX_PARTS);
        let raw: Vec<Vec<u8>> = layout
            .iter()
            .map(|&(w, rows)| random_rows(w, rows, k, rng))
            .collect();
        let dev = raw.iter().map(|r| Aligned::new(r)).collect();
        Matrix {
            k,
            layout: layout.to_vec(),
            raw,
            dev,
        }
    }

    fn rows(&self) -> usize {
        self.layout.iter().map(|&(_, r)| r).sum()
    }

    fn family(&self) -> GemvFamily {
        GemvFamily::of(self.layout.iter().map(|&(w, _)| w)).expect("one family")
    }

    fn host(&self) -> Vec<HostRun<'_>> {
        self.layout
            .iter()
            .zip(&self.raw)
            .map(|(&(weights, rows), raw)| HostRun {
                weights,
                bytes: raw,
                rows,
            })
            .collect()
    }

    /// The launcher's `parts_arg`: each run's pointer, format code and end row.
    fn parts(&self) -> GemvParts {
        let unused = GemvPart {
            w: std::ptr::null(),
            format: 0,
            end: 0,
        };
        let mut parts = GemvParts {
            part: [unused; MAX_PARTS],
            count: self.layout.len() as i32,
        };
        let mut end = 0;
        for ((slot, &(weights, rows)), dev) in
            parts.part.iter_mut().zip(&self.layout).zip(&self.dev)
        {
            end += rows;
            *slot = GemvPart {
                w: dev.ptr(),
                format: weights.index() as i32,
                end: end as i32,
            };
        }
        parts
    }

    /// Row `o`'s chunks as the twin decodes them: `(a, q, b)` with w = a·q − b.
    fn chunks(&self, o: usize) -> Vec<gemv_plan::Chunk> {
        let (mut p, mut row0) = (0, 0);
        while o >= row0 + self.layout[p].1 {
            row0 += self.layout[p].1;
            p += 1;
        }
        let w = self.layout[p].0;
        let rb = w.row_bytes(self.k);
        let row = &self.raw[p][(o - row0) * rb..][..rb];
        let per_block = w.block_values() / CHUNK;
        (0..self.k / CHUNK)
            .map(|c| chunk(w, &row[c / per_block * w.block_bytes()..], c % per_block))
            .collect()
    }
}

fn activations(rng: &mut Rng, n: usize, k: usize) -> Aligned<bf16> {
    Aligned::new(&rng.bf16s(n * k, 2.0))
}

/// `gemv_*` as `ops::gemv_quant::gemv` launches it: a warp per weight row, `WARPS` a block.
fn run_gemv<T: Out>(m: &Matrix, x: &Aligned<bf16>, n: usize, ld: usize, col0: usize) -> Vec<T> {
    let rows = m.rows();
    let mut y = Aligned::new(&vec![T::from_f32(SENTINEL); n * ld]);
    let (parts, f) = (m.parts(), T::plain(m.family()));
    let (xp, yp) = (x.ptr() as usize, y.mut_ptr() as usize);
    let grid = gemv_plan::grid(rows) as u32;
    launch(Dim3::x(grid), Dim3::x((WARPS * 32) as u32), || unsafe {
        f(
            parts,
            xp as *const u16,
            yp as *mut T,
            rows as i32,
            m.k as i32,
            n as i32,
            ld as i32,
            col0 as i32,
        )
    })
    .expect("the gemv launch");
    y.to_vec()
}

/// One GEMV launch against the twin (bits) and, for an f32 store, against float64 (within f32
/// rounding of the terms' magnitude).
fn check_gemv<T: Out>(m: &Matrix, n: usize, rng: &mut Rng) {
    let (k, rows) = (m.k, m.rows());
    let x = activations(rng, n, k);
    let xs = x.to_vec();
    let (ld, col0) = (rows + 11, 5);
    let got = run_gemv::<T>(m, &x, n, ld, col0);
    let want = gemv_plan::emulate_runs(&m.host(), k, &xs, n);
    let what = format!("{:?} k={k} n={n} {}", m.layout, T::NAME);
    for r in 0..n {
        for c in 0..ld {
            let g = got[r * ld + c].to_f32();
            let expected = if (col0..col0 + rows).contains(&c) {
                T::round(want[r * rows + c - col0])
            } else {
                SENTINEL
            };
            assert_eq!(
                g.to_bits(),
                expected.to_bits(),
                "{what} ({r}, {c}): {g} vs twin {expected}"
            );
        }
    }
    if T::NAME != "f32" {
        return;
    }
    for o in 0..rows {
        let chunks = m.chunks(o);
        for r in 0..n {
            let (mut exact, mut scale) = (0f64, 0f64);
            for (c, ch) in chunks.iter().enumerate() {
                for e in 0..CHUNK {
                    let xv = f64::from(xs[r * k + c * CHUNK + e].to_f32());
                    let (aq, b) = (f64::from(ch.a) * f64::from(ch.q[e]), f64::from(ch.b));
                    exact += (aq - b) * xv;
                    scale += (aq.abs() + b.abs()) * xv.abs();
                }
            }
            let g = f64::from(got[r * ld + col0 + o].to_f32());
            assert!(
                (g - exact).abs() <= 1e-5 * scale.max(1e-30),
                "{what} ({r}, {o}): {g} vs float64 {exact}"
            );
        }
    }
}

#[test]
fn the_gemv_is_its_twin_for_every_format_and_the_product_within_f32_rounding() {
    let mut rng = Rng(0x6E3F_0001);
    for weights in GemvWeights::ALL {
        // One block (Q8_0's 32: 4 chunks for 32 lanes), the 0.5B's hidden size where the blocks
        // divide it (112 chunks: a ragged lane loop), the 1.5B's (192: whole rounds of lanes).
        for k in [weights.block_values(), 896, 1536] {
            if !k.is_multiple_of(weights.block_values()) {
                continue;
            }
            // 37 rows: the last block has one live warp.
            let m = Matrix::new(&[(weights, 37)], k, &mut rng);
            check_gemv::<f32>(&m, 1, &mut rng);
            check_gemv::<u16>(&m, 3, &mut rng);
            check_gemv::<f32>(&m, MAX_ROWS, &mut rng);
            check_gemv::<u16>(&m, MAX_ROWS, &mut rng);
        }
    }
    // bf16 rows of 3 chunks (fewer than the unroll), and a single row.
    let m = Matrix::new(&[(GemvWeights::Bf16, 5)], 24, &mut rng);
    check_gemv::<f32>(&m, 2, &mut rng);
    let m = Matrix::new(&[(packed(QuantType::Q6K), 1)], 512, &mut rng);
    check_gemv::<u16>(&m, 4, &mut rng);
}

#[test]
fn one_launch_multiplies_runs_of_every_format_each_in_its_own() {
    let mut rng = Rng(0x6E3F_0002);
    // Every packed format across two launches, run boundaries off the blocks of four warps; and
    // four bf16 runs (the dense family).
    let layouts = [
        vec![
            (packed(QuantType::Q4K), 9),
            (packed(QuantType::Q6K), 3),
            (packed(QuantType::Int4), 5),
            (packed(QuantType::Fp8), 6),
        ],
        vec![(packed(QuantType::Q5_0), 7), (packed(QuantType::Q8_0), 5)],
        vec![
            (GemvWeights::Bf16, 5),
            (GemvWeights::Bf16, 3),
            (GemvWeights::Bf16, 9),
            (GemvWeights::Bf16, 2),
        ],
    ];
    for layout in &layouts {
        let m = Matrix::new(layout, 1536, &mut rng);
        for n in [1, 3, MAX_ROWS] {
            check_gemv::<f32>(&m, n, &mut rng);
            check_gemv::<u16>(&m, n, &mut rng);
        }
    }
}

#[test]
fn qwen2_sized_gemvs_are_their_twin() {
    let mut rng = Rng(0x6E3F_0003);
    // 0.5B: o_proj (896 × 896) in Q8_0 and bf16, down_proj (896 × 4864) in Q6_K; 1.5B: o_proj
    // (1536 × 1536) in Q4_K and down_proj (1536 × 8960) in Q4_K.
    let cases = [
        (packed(QuantType::Q8_0), 896, 896, MAX_ROWS),
        (GemvWeights::Bf16, 896, 896, 1),
        (packed(QuantType::Q6K), 896, 4864, 1),
        (packed(QuantType::Q4K), 1536, 1536, 2),
        (packed(QuantType::Q4K), 1536, 8960, 1),
    ];
    for (weights, rows, k, n) in cases {
        let m = Matrix::new(&[(weights, rows)], k, &mut rng);
        check_gemv::<f32>(&m, n, &mut rng);
    }
}

/// silu_mul.cu's arithmetic (common.cuh's `silu_times`): g / (1 + exp(−g)) · u, no FMA.
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

fn check_silu<T: Out>(m: &Matrix, n: usize, rng: &mut Rng) {
    let (k, rows) = (m.k, m.rows());
    let f = rows / 2;
    let x = activations(rng, n, k);
    let mut out = Aligned::new(&vec![T::from_f32(SENTINEL); n * f]);
    let (parts, func) = (m.parts(), T::silu(m.family()));
    let (xp, op) = (x.ptr() as usize, out.mut_ptr() as usize);
    launch(
        Dim3::x(gemv_plan::silu_grid(f) as u32),
        Dim3::x((WARPS * 32) as u32),
        || unsafe {
            func(
                parts,
                xp as *const u16,
                op as *mut T,
                f as i32,
                k as i32,
                n as i32,
            )
        },
    )
    .expect("the gemv_silu launch");
    let got = out.to_vec();
    // The unfused path: the GEMV's [n, 2f] store, then silu_mul over gate | up.
    let products = gemv_plan::emulate_runs(&m.host(), k, &x.to_vec(), n);
    for r in 0..n {
        for o in 0..f {
            let (g, u) = (
                T::round(products[r * rows + o]),
                T::round(products[r * rows + f + o]),
            );
            let want = T::round(silu_times(g, u));
            let v = got[r * f + o].to_f32();
            assert_eq!(
                v.to_bits(),
                want.to_bits(),
                "{:?} k={k} n={n} {} ({r}, {o}): {v} vs {want}",
                m.layout,
                T::NAME
            );
        }
    }
}

#[test]
fn the_fused_gate_up_is_the_gemv_then_silu_mul() {
    let mut rng = Rng(0x6E3F_0004);
    // f = 42: not a multiple of the block's four warps.
    let f = 42;
    let mut layouts: Vec<Vec<(GemvWeights, usize)>> =
        GemvWeights::ALL.iter().map(|&w| vec![(w, 2 * f)]).collect();
    // Gate and up of different types; and runs that do not split at the halves.
    layouts.push(vec![
        (packed(QuantType::Q4K), f),
        (packed(QuantType::Q6K), f),
    ]);
    layouts.push(vec![
        (packed(QuantType::Q8_0), f - 2),
        (packed(QuantType::Q4K), 4),
        (packed(QuantType::Q5_0), f - 2),
    ]);
    for layout in &layouts {
        let m = Matrix::new(layout, 1536, &mut rng);
        check_silu::<f32>(&m, 1, &mut rng);
        check_silu::<u16>(&m, 3, &mut rng);
        check_silu::<f32>(&m, MAX_ROWS, &mut rng);
    }
    // The 0.5B's gate_up: 2 × 4864 rows of 896.
    let m = Matrix::new(&[(packed(QuantType::Q8_0), 2 * 4864)], 896, &mut rng);
    check_silu::<u16>(&m, 1, &mut rng);
}

const MAX_POSITIONS: usize = 512;
const NUM_SLOTS: usize = 48;

fn check_qkv<T: Out>(m: &Matrix, heads: QkvHeads, n: usize, with_bias: bool, rng: &mut Rng) {
    let (k, hd) = (m.k, heads.head_dim);
    let total = heads.total() * hd;
    assert_eq!(m.rows(), total);
    let cos_sin = cos_sin_table(hd, 1_000_000.0, &RopeScaling::None, MAX_POSITIONS);
    let x = activations(rng, n, k);
    let bias = rng.f32s(total, 0.5);
    // Distinct slots; with 3 rows or more a padding row (−1) and a position past the table
    // (q and k unrotated); with 6 or more a slot one past the pool and a negative position.
    let mut slots: Vec<i64> = (0..n as i64)
        .map(|i| (i * 7 + 3) % NUM_SLOTS as i64)
        .collect();
    let mut positions: Vec<i32> = (0..n).map(|_| rng.below(MAX_POSITIONS) as i32).collect();
    if n >= 3 {
        slots[1] = -1;
        positions[2] = MAX_POSITIONS as i32;
    }
    if n >= 6 {
        slots[5] = NUM_SLOTS as i64;
        positions[4] = -3;
    }
    let kv = NUM_SLOTS * heads.num_kv_heads * hd;
    let start = |len: usize| vec![T::from_f32(SENTINEL); len];
    let mut q_out = Aligned::new(&start(n * heads.num_heads * hd));
    let mut k_cache = Aligned::new(&start(kv));
    let mut v_cache = Aligned::new(&start(kv));
    let (parts, func) = (m.parts(), T::qkv(m.family()));
    let p = (
        x.ptr() as usize,
        if with_bias { bias.as_ptr() as usize } else { 0 },
        positions.as_ptr() as usize,
        slots.as_ptr() as usize,
        cos_sin.as_ptr() as usize,
        q_out.mut_ptr() as usize,
        k_cache.mut_ptr() as usize,
        v_cache.mut_ptr() as usize,
    );
    launch(
        Dim3::x(gemv_plan::qkv_grid(heads) as u32),
        Dim3::x((WARPS * 32) as u32),
        || unsafe {
            func(
                parts,
                p.0 as *const u16,
                p.1 as *const f32,
                p.2 as *const i32,
                p.3 as *const i64,
                p.4 as *const f32,
                p.5 as *mut T,
                p.6 as *mut T,
                p.7 as *mut T,
                heads.num_heads as i32,
                heads.num_kv_heads as i32,
                hd as i32,
                k as i32,
                n as i32,
                MAX_POSITIONS as i32,
                NUM_SLOTS as i64,
            )
        },
    )
    .expect("the gemv_qkv launch");
    let mut twin = QkvOut {
        q: vec![SENTINEL; n * heads.num_heads * hd],
        k_cache: vec![SENTINEL; kv],
        v_cache: vec![SENTINEL; kv],
    };
    let tokens = QkvTokens {
        bias: with_bias.then_some(&bias[..]),
        positions: &positions,
        slots: &slots,
        cos_sin: &cos_sin,
    };
    let round: fn(f32) -> f32 = T::round;
    gemv_plan::emulate_qkv(
        &m.host(),
        heads,
        k,
        &x.to_vec(),
        n,
        tokens,
        round,
        &mut twin,
    );
    let what = format!(
        "{:?} {heads:?} n={n} bias {with_bias} {}",
        m.layout,
        T::NAME
    );
    for (name, got, want) in [
        ("q", q_out.to_vec(), &twin.q),
        ("k cache", k_cache.to_vec(), &twin.k_cache),
        ("v cache", v_cache.to_vec(), &twin.v_cache),
    ] {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let g = g.to_f32();
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{name} [{i}]: {what}: {g} vs twin {w}"
            );
        }
    }
    // Only real tokens' slots were written: not the padding row's, not the one past the pool.
    let kv_row = heads.num_kv_heads * hd;
    for slot in 0..NUM_SLOTS {
        let written = twin.v_cache[slot * kv_row..][..kv_row]
            .iter()
            .any(|&v| v != SENTINEL);
        let real = slots.contains(&(slot as i64));
        assert_eq!(written, real, "slot {slot}: {what}");
    }
}

#[test]
fn the_fused_qkv_is_its_twin_at_qwen2_geometries() {
    let mut rng = Rng(0x6E3F_0005);
    let small = QkvHeads {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let large = QkvHeads {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
    };
    // The q | k | v tensors of a checkpoint as runs: one bf16 matrix; packed tensors of mixed
    // types (Q4_K_M mixes Q4_K and Q6_K); the other formats. k: the model's hidden size.
    let cases = [
        (small, 896, vec![(GemvWeights::Bf16, 18 * 64)]),
        (
            small,
            896,
            vec![
                (packed(QuantType::Q8_0), 14 * 64),
                (packed(QuantType::Q5_0), 2 * 64),
                (packed(QuantType::Int4), 2 * 64),
            ],
        ),
        (
            large,
            1536,
            vec![
                (packed(QuantType::Q4K), 12 * 128),
                (packed(QuantType::Q4K), 2 * 128),
                (packed(QuantType::Q6K), 2 * 128),
            ],
        ),
        (
            large,
            1536,
            vec![
                (packed(QuantType::Fp8), 12 * 128),
                (packed(QuantType::Int4), 2 * 128),
                (packed(QuantType::Q8_0), 2 * 128),
            ],
        ),
    ];
    // Per layout, (rows, bias, f32 store) launches: every layout with and without bias and both
    // dtypes between them, 6 rows (every special slot and position) for each geometry. The
    // emulator spends its time in the warps' shuffles, so the launches are few.
    let launches = [
        [(3, true, true), (1, false, false)],
        [(6, true, false), (1, false, true)],
        [(2, false, true), (1, true, false)],
        [(6, true, true), (1, false, false)],
    ];
    for ((heads, k, layout), launches) in cases.iter().zip(launches) {
        let m = Matrix::new(layout, *k, &mut rng);
        for (n, with_bias, f32_store) in launches {
            if f32_store {
                check_qkv::<f32>(&m, *heads, n, with_bias, &mut rng);
            } else {
                check_qkv::<u16>(&m, *heads, n, with_bias, &mut rng);
            }
        }
    }
}

/// `gemm_packed_*` (and, split, `gemm_packed_reduce_*`) as `ops::gemv_quant::gemm_packed`
/// launches them; returns the output and the workspace.
fn run_gemm<T: Out>(
    m: &Matrix,
    x: &Aligned<bf16>,
    rows_m: usize,
    ld: usize,
    col0: usize,
    splits: usize,
) -> (Vec<T>, Vec<f32>) {
    let (k, rows) = (m.k, m.rows());
    let step = gemm_tile::k_split(k, splits);
    assert!((1..=gemm_tile::MAX_SPLITS).contains(&splits) && (splits - 1) * step < k);
    let mut y = Aligned::new(&vec![T::from_f32(SENTINEL); rows_m * ld]);
    // NaN: a value the kernel reads without writing it shows.
    let mut partial = Aligned::new(&vec![f32::NAN; splits * rows_m * rows]);
    let parts = m.parts();
    let (xp, yp, pp) = (
        x.ptr() as usize,
        y.mut_ptr() as usize,
        partial.mut_ptr() as usize,
    );
    let (gx, gy) = gemm_tile::grid(rows, rows_m);
    let grid = Dim3 {
        x: gx as u32,
        y: gy as u32,
        z: splits as u32,
    };
    let gemm = T::gemm();
    launch(grid, Dim3::x(gemm_tile::THREADS as u32), || unsafe {
        gemm(
            parts,
            xp as *const u16,
            yp as *mut T,
            pp as *mut f32,
            rows as i32,
            k as i32,
            rows_m as i32,
            ld as i32,
            col0 as i32,
            step as i32,
        )
    })
    .expect("the gemm_packed launch");
    if splits > 1 {
        // The launcher's `elementwise(m · rows)`: 256 threads, a grid-stride loop.
        let blocks = (rows_m * rows).div_ceil(256).clamp(1, 65_536) as u32;
        let reduce = T::reduce();
        launch(Dim3::x(blocks), Dim3::x(256), || unsafe {
            reduce(
                pp as *const f32,
                yp as *mut T,
                rows as i32,
                rows_m as i32,
                splits as i32,
                ld as i32,
                col0 as i32,
            )
        })
        .expect("the gemm_packed_reduce launch");
    }
    (y.to_vec(), partial.to_vec())
}

fn check_gemm<T: Out>(m: &Matrix, rows_m: usize, splits: usize, rng: &mut Rng) {
    let (k, rows) = (m.k, m.rows());
    let x = activations(rng, rows_m, k);
    let xs = x.to_vec();
    let (ld, col0) = (rows + 11, 5);
    let (got, partial) = run_gemm::<T>(m, &x, rows_m, ld, col0, splits);
    let mut want = vec![0f32; rows_m * ld];
    gemm_tile::emulate(&m.host(), k, &xs, rows_m, &mut want, ld, col0, splits);
    // The staged weights: each chunk's a·q − b rounded to bf16 once (the expansion's values).
    let staged: Vec<Vec<f64>> = (0..rows)
        .map(|o| {
            m.chunks(o)
                .iter()
                .flat_map(|ch| {
                    ch.q.map(|q| f64::from(bf16::from_f32(ch.a * q - ch.b).to_f32()))
                })
                .collect()
        })
        .collect();
    let what = format!("{:?} m={rows_m} splits={splits} {}", m.layout, T::NAME);
    for r in 0..rows_m {
        let xr: Vec<f64> = xs[r * k..(r + 1) * k]
            .iter()
            .map(|v| f64::from(v.to_f32()))
            .collect();
        let sum_x: f64 = xr.iter().map(|v| v.abs()).sum();
        for c in 0..ld {
            let g = got[r * ld + c].to_f32();
            if !(col0..col0 + rows).contains(&c) {
                assert_eq!(g.to_bits(), SENTINEL.to_bits(), "{what} ({r}, {c}) written");
                continue;
            }
            let o = c - col0;
            let exact: f64 = staged[o].iter().zip(&xr).map(|(w, x)| w * x).sum();
            let scale: f64 = staged[o].iter().zip(&xr).map(|(w, x)| (w * x).abs()).sum();
            let wmax = staged[o].iter().fold(0f64, |a, w| a.max(w.abs()));
            // The twin, with the GPU test's tolerance: the tensor cores' order (f32 rounding of
            // the products' magnitude), then one output rounding either side of a boundary.
            let w = T::round(want[r * ld + c]);
            let tol = 1e-5 * (sum_x * wmax) as f32 + T::TOL * w.abs();
            assert!((g - w).abs() <= tol, "{what} ({r}, {o}): {g} vs twin {w}");
            // And the float64 product, tighter: f32 rounding of the terms' magnitude, then the
            // store's own rounding.
            let tol = 1e-5 * scale.max(1e-30) + T::ROUNDING * exact.abs();
            assert!(
                (f64::from(g) - exact).abs() <= tol,
                "{what} ({r}, {o}): {g} vs float64 {exact}"
            );
        }
    }
    if splits == 1 {
        assert!(
            partial.iter().all(|v| v.is_nan()),
            "{what}: the workspace was written"
        );
    }
}

#[test]
fn the_tiled_gemm_is_the_product_of_the_staged_weights() {
    let mut rng = Rng(0x6E3F_0006);
    let k = 512;
    let mut layouts: Vec<Vec<(GemvWeights, usize)>> = QuantType::ALL
        .iter()
        .map(|&q| vec![(packed(q), 70)])
        .collect();
    layouts.push(vec![
        (packed(QuantType::Q4K), 37),
        (packed(QuantType::Q6K), 30),
        (packed(QuantType::Fp8), 9),
    ]);
    for (i, layout) in layouts.iter().enumerate() {
        let m = Matrix::new(layout, k, &mut rng);
        // Partial tiles of activation rows (9, 100), a whole one (64); k whole and split into 3
        // and 16 ranges (the reduction). Dtypes alternate over the formats to keep the run short.
        for (rows_m, splits) in [(9, 1), (100, 1), (9, 3), (64, 16)] {
            if i % 2 == 0 {
                check_gemm::<f32>(&m, rows_m, splits, &mut rng);
            } else {
                check_gemm::<u16>(&m, rows_m, splits, &mut rng);
            }
        }
    }
}

#[test]
fn a_qwen2_sized_prefill_product_is_split_and_reduced_as_on_an_h100() {
    let mut rng = Rng(0x6E3F_0007);
    // The 0.5B's o_proj at a 64-row prefill on 132 multiprocessors (7 ranges of k).
    let (rows, k, rows_m) = (896, 896, 64);
    let splits = gemm_tile::splits(rows, rows_m, k, 132, gemm_tile::PARTIALS);
    assert_eq!(splits, 7);
    let m = Matrix::new(&[(packed(QuantType::Q8_0), rows)], k, &mut rng);
    check_gemm::<u16>(&m, rows_m, splits, &mut rng);
}
