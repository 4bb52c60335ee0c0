//! kernels/rope.cu, kernels/reshape_and_cache.cu and kernels/qkv.cu run by the emulator, each
//! launched as its `ops::*` launcher launches it (a block of 128 threads per token), f32 and
//! bf16, at Qwen2 0.5B (14/2 heads, head_dim 64) and 1.5B (12/2, 128) widths and ragged ones:
//! - `rope_neox_*` against the CPU's `Rope::apply` (its frequencies and `rotation`, from
//!   `novainfer_cuda::rope_scaling`, rotated in f32 without contraction): the same bits in
//!   f32 and, rounded once, in bf16; within the GPU tests' tolerance of a float64 rotation;
//!   plain and scaled (linear, YaRN) tables; a position outside the table leaves its row as is;
//! - `reshape_and_cache_*` copies rows bit for bit (NaN payloads too) and writes nothing for a
//!   negative slot (graph padding) or one past the pool;
//! - `qkv_bias_rope_cache_*` equals, bit for bit, the bias add then `rope_neox_*` then
//!   `reshape_and_cache_*` (in bf16: the f32 bias add and rotation rounded once, as its header
//!   says; the bf16 chain that stores the biased value first is within a bf16 rounding), and
//!   the CPU path, with and without bias, padding and out-of-pool slots, positions outside
//!   the table.

mod common;

use common::{addr, Dtype, Rng};
use novainfer_cuda::rope_scaling::{rotation, RopeScaling, Yarn};
use novainfer_cuemu::kernels::qkv::{qkv_bias_rope_cache_bf16, qkv_bias_rope_cache_f32};
use novainfer_cuemu::kernels::reshape_and_cache::{reshape_and_cache_bf16, reshape_and_cache_f32};
use novainfer_cuemu::kernels::rope::{rope_neox_bf16, rope_neox_f32};
use novainfer_cuemu::{launch, Dim3};

/// Threads per block: `ops::per_row(num_tokens, 128)` in all three launchers.
const THREADS: u32 = 128;
/// Qwen2's rope_theta.
const THETA: f64 = 1_000_000.0;

type RopeFn<E> =
    unsafe extern "C-unwind" fn(*mut E, *mut E, *const i32, *const f32, i32, i32, i32, i32);
type ReshapeFn<E> =
    unsafe extern "C-unwind" fn(*const E, *const E, *mut E, *mut E, *const i64, i32, i64);
type QkvFn<E> = unsafe extern "C-unwind" fn(
    *const E,
    *const f32,
    *const i32,
    *const i64,
    *const f32,
    *mut E,
    *mut E,
    *mut E,
    i32,
    i32,
    i32,
    i32,
    i64,
);

/// An activation element as the kernels take it: f32, or bf16 as its bits.
trait Elem: Dtype {
    const ROPE: RopeFn<Self>;
    const RESHAPE: ReshapeFn<Self>;
    const QKV: QkvFn<Self>;
    /// A random bit pattern (any value, NaNs and infinities included).
    fn random_bits(rng: &mut Rng) -> Self;
    fn bits(self) -> u32;
}

impl Elem for f32 {
    const ROPE: RopeFn<Self> = rope_neox_f32;
    const RESHAPE: ReshapeFn<Self> = reshape_and_cache_f32;
    const QKV: QkvFn<Self> = qkv_bias_rope_cache_f32;
    fn random_bits(rng: &mut Rng) -> Self {
        f32::from_bits(rng.next() as u32)
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Elem for u16 {
    const ROPE: RopeFn<Self> = rope_neox_bf16;
    const RESHAPE: ReshapeFn<Self> = reshape_and_cache_bf16;
    const QKV: QkvFn<Self> = qkv_bias_rope_cache_bf16;
    fn random_bits(rng: &mut Rng) -> Self {
        rng.next() as u16
    }
    fn bits(self) -> u32 {
        u32::from(self)
    }
}

fn values<E: Elem>(rng: &mut Rng, n: usize, scale: f32) -> Vec<E> {
    (0..n).map(|_| E::from_f32(rng.f32(scale))).collect()
}

fn widen<E: Elem>(v: &[E]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn narrow<E: Elem>(v: &[f32]) -> Vec<E> {
    v.iter().map(|&x| E::from_f32(x)).collect()
}

/// A value no kernel writes here, so a skipped or stray write shows.
fn poison<E: Elem>(n: usize) -> Vec<E> {
    vec![E::from_f32(-12345.0); n]
}

fn assert_bits<E: Elem>(what: &str, got: &[E], want: &[E]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.bits(),
            w.bits(),
            "{what} [{}]: element {i}: kernel {} vs {}",
            E::NAME,
            g.to_f32(),
            w.to_f32()
        );
    }
}

/// novainfer-cuda's `assert_close`: relative to the value, with a floor of 5% of the largest.
fn assert_close<E: Elem>(what: &str, got: &[E], want: &[f64], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        assert!(
            (g - w).abs() <= f64::from(tol) * w.abs().max(scale * 0.05),
            "{what} [{}]: element {i}: kernel {g} vs {w}",
            E::NAME
        );
    }
}

/// `|lo| + |hi|` of the rotation pair each element belongs to (dims i and i + head_dim/2).
fn pair_magnitudes(x: &[f32], head_dim: usize) -> Vec<f64> {
    let half = head_dim / 2;
    (0..x.len())
        .map(|i| {
            let partner = if i % head_dim < half {
                i + half
            } else {
                i - half
            };
            f64::from(x[i].abs()) + f64::from(x[partner].abs())
        })
        .collect()
}

/// |got − want| ≤ 2^-7 · `pair` per element (see `qkv_body`).
fn assert_within<E: Elem>(what: &str, got: &[E], want: &[E], pair: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), p)) in got.iter().zip(want).zip(pair).enumerate() {
        let (g, w) = (f64::from(g.to_f32()), f64::from(w.to_f32()));
        assert!(
            (g - w).abs() <= p / 128.0,
            "{what} [{}]: element {i}: fused {g} vs chain {w} (pair magnitude {p})",
            E::NAME
        );
    }
}

#[derive(Clone, Copy, Debug)]
struct Heads {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Heads {
    fn q_len(&self) -> usize {
        self.num_heads * self.head_dim
    }
    fn kv_len(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    fn qkv_len(&self) -> usize {
        self.q_len() + 2 * self.kv_len()
    }
}

const QWEN_05B: Heads = Heads {
    num_heads: 14,
    num_kv_heads: 2,
    head_dim: 64,
};
const QWEN_15B: Heads = Heads {
    num_heads: 12,
    num_kv_heads: 2,
    head_dim: 128,
};
/// Pairs per token not a multiple of the block (5·40 + 40 = 240 q and k pairs, a v row of 80).
const RAGGED: Heads = Heads {
    num_heads: 5,
    num_kv_heads: 1,
    head_dim: 80,
};

/// `RopeTable`: the `[max_positions, head_dim]` cos | sin table the launcher uploads.
struct Table {
    head_dim: usize,
    scaling: RopeScaling,
    max_positions: usize,
    cos_sin: Vec<f32>,
}

impl Table {
    fn new(head_dim: usize, scaling: RopeScaling, max_positions: usize) -> Self {
        Table {
            head_dim,
            scaling,
            max_positions,
            cos_sin: novainfer_cuda::rope_scaling::cos_sin_table(
                head_dim,
                THETA,
                &scaling,
                max_positions,
            ),
        }
    }

    fn inside(&self, pos: i32) -> bool {
        (0..self.max_positions as i64).contains(&i64::from(pos))
    }

    /// The CPU's `Rope::apply` (novainfer-model `layers::ops`) on rows of heads: its angles
    /// (`inv_freq`, `rotation`), `lo·cos − hi·sin` and `hi·cos + lo·sin` in f32, each product
    /// and sum rounded. A row outside the table is left as is, as the kernels leave it.
    fn rotate_f32(&self, x: &mut [f32], positions: &[i32]) {
        let (hd, half) = (self.head_dim, self.head_dim / 2);
        let inv_freq = self.scaling.inv_freq(hd, THETA);
        let factor = self.scaling.attention_factor();
        let row = x.len() / positions.len().max(1);
        for (r, &pos) in x.chunks_exact_mut(row).zip(positions) {
            if !self.inside(pos) {
                continue;
            }
            for head in r.chunks_exact_mut(hd) {
                for (i, &f) in inv_freq.iter().enumerate() {
                    let (c, s) = rotation(pos as usize, f, factor);
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        }
    }

    /// The rotation in float64 with the exact angles (rows outside the table unrotated).
    fn rotate_f64(&self, x: &[f32], positions: &[i32]) -> Vec<f64> {
        let (hd, half) = (self.head_dim, self.head_dim / 2);
        let inv_freq = self.scaling.inv_freq(hd, THETA);
        let factor = self.scaling.attention_factor();
        let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let row = x.len() / positions.len().max(1);
        for (r, &pos) in out.chunks_exact_mut(row).zip(positions) {
            if !self.inside(pos) {
                continue;
            }
            for head in r.chunks_exact_mut(hd) {
                for (i, &f) in inv_freq.iter().enumerate() {
                    let angle = f64::from(pos) * f;
                    let (c, s) = (angle.cos() * factor, angle.sin() * factor);
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        }
        out
    }
}

/// `ops::rope::rope_neox`: q and k rotated in place.
fn rope<E: Elem>(table: &Table, heads: Heads, q: &mut [E], k: &mut [E], positions: &[i32]) {
    let n = positions.len();
    assert_eq!(q.len(), n * heads.q_len());
    assert_eq!(k.len(), n * heads.kv_len());
    let p = (
        addr(q.as_mut_ptr()),
        addr(k.as_mut_ptr()),
        addr(positions.as_ptr()),
        addr(table.cos_sin.as_ptr()),
    );
    launch(Dim3::x(n as u32), Dim3::x(THREADS), || unsafe {
        E::ROPE(
            p.0 as _,
            p.1 as _,
            p.2 as _,
            p.3 as _,
            heads.num_heads as i32,
            heads.num_kv_heads as i32,
            table.head_dim as i32,
            table.max_positions as i32,
        )
    })
    .expect("the rope launch");
}

/// `ops::reshape_and_cache`: row t of k/v into slot `slots[t]` of the caches.
fn reshape<E: Elem>(k: &[E], v: &[E], k_cache: &mut [E], v_cache: &mut [E], slots: &[i64]) {
    let n = slots.len();
    let row = k.len() / n;
    assert_eq!(v.len(), n * row);
    assert_eq!(k_cache.len() % row, 0);
    let num_slots = (k_cache.len() / row) as i64;
    let p = (
        addr(k.as_ptr()),
        addr(v.as_ptr()),
        addr(k_cache.as_mut_ptr()),
        addr(v_cache.as_mut_ptr()),
        addr(slots.as_ptr()),
    );
    launch(Dim3::x(n as u32), Dim3::x(THREADS), || unsafe {
        E::RESHAPE(
            p.0 as _, p.1 as _, p.2 as _, p.3 as _, p.4 as _, row as i32, num_slots,
        )
    })
    .expect("the reshape_and_cache launch");
}

/// What `qkv_bias_rope_cache` writes: q, and the whole K and V caches.
struct QkvOut<E> {
    q: Vec<E>,
    k_cache: Vec<E>,
    v_cache: Vec<E>,
}

/// `ops::qkv::qkv_bias_rope_cache` over caches of `num_slots` slots (poisoned first).
fn qkv_fused<E: Elem>(
    table: &Table,
    heads: Heads,
    qkv: &[E],
    bias: Option<&[f32]>,
    positions: &[i32],
    slots: &[i64],
    num_slots: usize,
) -> QkvOut<E> {
    let n = positions.len();
    assert_eq!(qkv.len(), n * heads.qkv_len());
    let mut out = QkvOut {
        q: poison::<E>(n * heads.q_len()),
        k_cache: poison::<E>(num_slots * heads.kv_len()),
        v_cache: poison::<E>(num_slots * heads.kv_len()),
    };
    // The launcher passes a null pointer for a model without bias.
    let p = (
        addr(qkv.as_ptr()),
        bias.map_or(0, |b| addr(b.as_ptr())),
        addr(positions.as_ptr()),
        addr(slots.as_ptr()),
        addr(table.cos_sin.as_ptr()),
        addr(out.q.as_mut_ptr()),
        addr(out.k_cache.as_mut_ptr()),
        addr(out.v_cache.as_mut_ptr()),
    );
    launch(Dim3::x(n as u32), Dim3::x(THREADS), || unsafe {
        E::QKV(
            p.0 as _,
            p.1 as _,
            p.2 as _,
            p.3 as _,
            p.4 as _,
            p.5 as _,
            p.6 as _,
            p.7 as _,
            heads.num_heads as i32,
            heads.num_kv_heads as i32,
            heads.head_dim as i32,
            table.max_positions as i32,
            num_slots as i64,
        )
    })
    .expect("the qkv launch");
    out
}

/// Splits the fused rows into q, k and v rows (as f32), the bias added when given.
fn split_biased<E: Elem>(heads: Heads, qkv: &[E], bias: Option<&[f32]>) -> [Vec<f32>; 3] {
    let (q_len, kv_len) = (heads.q_len(), heads.kv_len());
    let mut parts = [Vec::new(), Vec::new(), Vec::new()];
    for row in qkv.chunks_exact(heads.qkv_len()) {
        let mut r = widen(row);
        if let Some(b) = bias {
            r.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        parts[0].extend_from_slice(&r[..q_len]);
        parts[1].extend_from_slice(&r[q_len..q_len + kv_len]);
        parts[2].extend_from_slice(&r[q_len + kv_len..]);
    }
    parts
}

/// The rotation the f32 rope kernel gives (`rope_neox_f32` on q and k).
fn rope_f32_kernel(
    table: &Table,
    heads: Heads,
    q: &[f32],
    k: &[f32],
    positions: &[i32],
) -> (Vec<f32>, Vec<f32>) {
    let (mut q, mut k) = (q.to_vec(), k.to_vec());
    rope::<f32>(table, heads, &mut q, &mut k, positions);
    (q, k)
}

// ---- rope.cu ---------------------------------------------------------------------------

fn rope_body<E: Elem>(heads: Heads, table: &Table, positions: &[i32], seed: u64) {
    let what = format!("{heads:?} {:?} {}", table.scaling, E::NAME);
    let mut rng = Rng(seed);
    let n = positions.len();
    let q0: Vec<E> = values(&mut rng, n * heads.q_len(), 2.0);
    let k0: Vec<E> = values(&mut rng, n * heads.kv_len(), 2.0);
    let (mut q, mut k) = (q0.clone(), k0.clone());
    rope(table, heads, &mut q, &mut k, positions);
    for (name, got, input) in [("q", &q, &q0), ("k", &k, &k0)] {
        // The CPU's rotation of the stored values, rounded once to E: the same bits.
        let mut cpu = widen(input);
        table.rotate_f32(&mut cpu, positions);
        assert_bits(
            &format!("{what}: {name} vs the CPU's Rope"),
            got,
            &narrow::<E>(&cpu),
        );
        let exact = table.rotate_f64(&widen(input), positions);
        assert_close(&format!("{what}: {name} vs float64"), got, &exact, E::TOL);
        // Rows outside the table are untouched (not even rounded: they are not rewritten).
        let row = got.len() / n;
        for (t, &pos) in positions.iter().enumerate() {
            if !table.inside(pos) {
                assert_bits(
                    &format!("{what}: {name} row {t} at position {pos} (outside the table)"),
                    &got[t * row..(t + 1) * row],
                    &input[t * row..(t + 1) * row],
                );
            }
        }
    }
}

#[test]
fn rope_matches_the_cpu_rotation_bit_for_bit_with_plain_and_scaled_tables() {
    let plain = |hd| Table::new(hd, RopeScaling::None, 4096);
    // Positions 0 (the identity), small, the last row, and three outside the table.
    let positions = [0, 1, 7, 31, 1000, 4095, 4096, -1, i32::MAX];
    for (i, heads) in [QWEN_05B, QWEN_15B, RAGGED].into_iter().enumerate() {
        let table = plain(heads.head_dim);
        rope_body::<f32>(heads, &table, &positions, 1 + i as u64);
        rope_body::<u16>(heads, &table, &positions, 11 + i as u64);
    }
    // Qwen2.5's YaRN (factor 4 over 32768; cos and sin scaled by the attention factor), a
    // linear factor and dynamic NTK, at positions past the original context.
    let yarn = RopeScaling::Yarn(Yarn {
        factor: 4.0,
        original_max_position_embeddings: 32768,
        beta_fast: Yarn::DEFAULT_BETA_FAST,
        beta_slow: Yarn::DEFAULT_BETA_SLOW,
        attention_factor: Yarn::default_attention_factor(4.0, None, None),
        truncate: true,
    });
    let linear = RopeScaling::Linear { factor: 2.0 };
    let dynamic = RopeScaling::Dynamic {
        factor: 2.0,
        max_position_embeddings: 16384,
    };
    let long = [0, 5, 32767, 32768, 40000, 40959, 40960];
    for (i, scaling) in [yarn, linear, dynamic].into_iter().enumerate() {
        let table = Table::new(64, scaling, 40960);
        rope_body::<f32>(QWEN_05B, &table, &long, 21 + i as u64);
        rope_body::<u16>(QWEN_05B, &table, &long, 31 + i as u64);
    }
    let table = Table::new(128, yarn, 40960);
    rope_body::<f32>(QWEN_15B, &table, &long, 41);
}

// ---- reshape_and_cache.cu --------------------------------------------------------------

fn reshape_body<E: Elem>(row: usize, seed: u64) {
    let what = format!("row {row} {}", E::NAME);
    let mut rng = Rng(seed);
    let num_slots = 24;
    // Token 1 is graph padding; token 4's slot lies past the pool; token 5 takes slot 0.
    let slots = [3i64, -1, 17, 23, 24, 0, i64::MAX, 9];
    let n = slots.len();
    // Any bit pattern (NaN payloads and infinities included) is copied as it is.
    let k: Vec<E> = (0..n * row).map(|_| E::random_bits(&mut rng)).collect();
    let v: Vec<E> = (0..n * row).map(|_| E::random_bits(&mut rng)).collect();
    let (mut kc, mut vc) = (poison::<E>(num_slots * row), poison::<E>(num_slots * row));
    reshape(&k, &v, &mut kc, &mut vc, &slots);
    let (mut want_k, mut want_v) = (poison::<E>(num_slots * row), poison::<E>(num_slots * row));
    for (t, &s) in slots.iter().enumerate() {
        if (0..num_slots as i64).contains(&s) {
            let s = s as usize;
            want_k[s * row..(s + 1) * row].copy_from_slice(&k[t * row..(t + 1) * row]);
            want_v[s * row..(s + 1) * row].copy_from_slice(&v[t * row..(t + 1) * row]);
        }
    }
    assert_bits(&format!("{what}: k cache"), &kc, &want_k);
    assert_bits(&format!("{what}: v cache"), &vc, &want_v);
}

#[test]
fn reshape_and_cache_copies_rows_exactly_and_skips_padding_and_slots_outside() {
    // Qwen2 0.5B's and 1.5B's KV rows, one over the block with a tail, one under it.
    for (i, row) in [128, 256, 200, 40].into_iter().enumerate() {
        reshape_body::<f32>(row, 51 + i as u64);
        reshape_body::<u16>(row, 61 + i as u64);
    }
}

// ---- qkv.cu ----------------------------------------------------------------------------

/// Token 1 is graph padding, token 4's slot lies past the pool, tokens 5 and 6 sit outside
/// the table (unrotated, still cached).
const POSITIONS: [i32; 7] = [0, 5, 4095, 31, 7, 4096, -3];
const SLOTS: [i64; 7] = [3, -1, 17, 0, 24, 9, 23];
const NUM_SLOTS: usize = 24;

fn qkv_body<E: Elem>(heads: Heads, with_bias: bool, seed: u64) {
    let what = format!("{heads:?} {} bias {with_bias}", E::NAME);
    let mut rng = Rng(seed);
    let table = Table::new(heads.head_dim, RopeScaling::None, 4096);
    let n = POSITIONS.len();
    let kv_len = heads.kv_len();
    let qkv: Vec<E> = values(&mut rng, n * heads.qkv_len(), 2.0);
    let bias_values = rng.f32s(heads.qkv_len(), 0.5);
    let bias = with_bias.then_some(&bias_values[..]);
    let fused = qkv_fused(&table, heads, &qkv, bias, &POSITIONS, &SLOTS, NUM_SLOTS);

    // The unfused kernels: bias add (f32, on the host), rope.cu in f32, rounded once to E,
    // reshape_and_cache.cu. This is the fused kernel's arithmetic step for step.
    let [q, k, v] = split_biased(heads, &qkv, bias);
    let (q_rot, k_rot) = rope_f32_kernel(&table, heads, &q, &k, &POSITIONS);
    let (mut kc, mut vc) = (
        poison::<E>(NUM_SLOTS * kv_len),
        poison::<E>(NUM_SLOTS * kv_len),
    );
    reshape(
        &narrow::<E>(&k_rot),
        &narrow::<E>(&v),
        &mut kc,
        &mut vc,
        &SLOTS,
    );
    assert_bits(
        &format!("{what}: fused q vs unfused"),
        &fused.q,
        &narrow::<E>(&q_rot),
    );
    assert_bits(
        &format!("{what}: fused k cache vs unfused"),
        &fused.k_cache,
        &kc,
    );
    assert_bits(
        &format!("{what}: fused v cache vs unfused"),
        &fused.v_cache,
        &vc,
    );

    // The CPU path (bias add, `Rope::apply`, the cache write): the same bits.
    let mut q_cpu = q.clone();
    let mut k_cpu = k.clone();
    table.rotate_f32(&mut q_cpu, &POSITIONS);
    table.rotate_f32(&mut k_cpu, &POSITIONS);
    assert_bits(
        &format!("{what}: fused q vs the CPU"),
        &fused.q,
        &narrow::<E>(&q_cpu),
    );
    let row_of = |t: usize| t * kv_len..(t + 1) * kv_len;
    for (t, &s) in SLOTS.iter().enumerate() {
        if (0..NUM_SLOTS as i64).contains(&s) {
            let at = s as usize * kv_len..(s as usize + 1) * kv_len;
            assert_bits(
                &format!("{what}: k of token {t} in slot {s} vs the CPU"),
                &fused.k_cache[at.clone()],
                &narrow::<E>(&k_cpu[row_of(t)]),
            );
            assert_bits(
                &format!("{what}: v of token {t} in slot {s} vs the CPU"),
                &fused.v_cache[at],
                &narrow::<E>(&v[row_of(t)]),
            );
        }
    }
    // And float64, for the values the rotation computes.
    assert_close(
        &format!("{what}: q vs float64"),
        &fused.q,
        &table.rotate_f64(&q, &POSITIONS),
        E::TOL,
    );

    // The chain in E: the biased value stored to E first, then rope.cu in E. Without bias it
    // is the fused kernel's arithmetic (the same bits). With bias it rounds the inputs of each
    // rotation too (qkv.cu's header: the unfused path rounds after the bias add), so in bf16
    // a value differs by at most that rounding of its pair, 2^-9·(|lo| + |hi|), plus both
    // outputs' (2^-9 of each, each at most |lo| + |hi|): 2^-7·(|lo| + |hi|) bounds it.
    let (mut q_e, mut k_e) = (narrow::<E>(&q), narrow::<E>(&k));
    rope(&table, heads, &mut q_e, &mut k_e, &POSITIONS);
    let (mut kc_e, mut vc_e) = (
        poison::<E>(NUM_SLOTS * kv_len),
        poison::<E>(NUM_SLOTS * kv_len),
    );
    reshape(&k_e, &narrow::<E>(&v), &mut kc_e, &mut vc_e, &SLOTS);
    if !with_bias {
        assert_bits(&format!("{what}: fused q vs the E chain"), &fused.q, &q_e);
        assert_bits(
            &format!("{what}: fused k cache vs the E chain"),
            &fused.k_cache,
            &kc_e,
        );
    } else {
        let pair_q = pair_magnitudes(&q, heads.head_dim);
        assert_within(
            &format!("{what}: fused q vs the E chain"),
            &fused.q,
            &q_e,
            &pair_q,
        );
        // The cache's bound: the pair magnitudes of the token each slot holds (0 elsewhere:
        // both caches keep their poison there).
        let pair_k = pair_magnitudes(&k, heads.head_dim);
        let mut bound = vec![0f64; NUM_SLOTS * kv_len];
        for (t, &s) in SLOTS.iter().enumerate() {
            if (0..NUM_SLOTS as i64).contains(&s) {
                bound[s as usize * kv_len..(s as usize + 1) * kv_len]
                    .copy_from_slice(&pair_k[row_of(t)]);
            }
        }
        assert_within(
            &format!("{what}: fused k cache vs the E chain"),
            &fused.k_cache,
            &kc_e,
            &bound,
        );
    }
    assert_bits(
        &format!("{what}: fused v cache vs the E chain"),
        &fused.v_cache,
        &vc_e,
    );
}

#[test]
fn qkv_bias_rope_cache_equals_bias_then_rope_then_reshape_and_the_cpu() {
    for (i, heads) in [QWEN_05B, QWEN_15B, RAGGED].into_iter().enumerate() {
        for with_bias in [true, false] {
            let seed = 71 + 2 * i as u64 + u64::from(with_bias);
            qkv_body::<f32>(heads, with_bias, seed);
            qkv_body::<u16>(heads, with_bias, seed + 10);
        }
    }
}
