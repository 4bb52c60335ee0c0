//! The arithmetic of the attention kernel, once portable ([`Scalar`]) and once vectorized
//! ([`vectorized`]), a body generic over [`simd::Simd`] that AVX2/FMA/F16C ([`Avx2`], 8
//! lanes) and AVX-512F ([`Avx512`], 16 lanes) instantiate.
//!
//! All implementations perform the same IEEE operations in the same order on every
//! number, so they agree bit for bit (tested); only the speed differs:
//! * a score `q·k` is one chain of fused multiply-adds from zero over the dimensions in
//!   order (keys are stored transposed, 8 positions side by side (16 for AVX-512), so the
//!   scores of a query row fill one vector and no horizontal sums are needed);
//! * a tile's maximum is exact whatever the order; `exp` is one polynomial (Cephes' `expf`:
//!   range reduction by `ln 2`, degree-5 polynomial, scaling by `2ⁿ` through the exponent
//!   bits), written once per lane; a tile's sum of exponentials is lane-wise over its
//!   [`VECS`] vectors of 8 (lane `l` of vector `c` is position `8c + l`) as a pairwise tree
//!   ([`tree`]: `((e0+e1)+(e2+e3))+((e4+e5)+(e6+e7))` for 8), then `((h0+h2)+(h1+h3))`
//!   with `h[i] = l[i]+l[i+4]`;
//! * value accumulation is per dimension: `acc·α`, then `acc = fma(e_j, v_j, acc)` in
//!   position order. Positions past a row's own limit carry `e_j = 0`, so a row may run a
//!   few extra (exact no-op) steps when it shares a tile with later rows.
//! * K and V are read where they lie in the pool ([`Rows`], [`Keys`]) and decoded to f32
//!   (exact for f16/bf16, one exact conversion and one multiplication for q8_0) as they are
//!   loaded: whether a row is decoded into a scratch copy first or in registers changes no
//!   bit, nor does the pool's key layout (rows, or tiles of positions side by side).

use crate::kv_dtype::{q8_block, KvStorage};
use crate::paged_kv::{TiledDtype, KEY_TILE};

/// Positions per softmax tile (and rows of the K/V scratch): the per-row work of a tile
/// (maximum, rescaling, sums, reloading the running values) is paid once per `TILE` positions.
pub(super) const TILE: usize = 32;
/// Positions side by side in the transposed key scratch (one vector).
pub(super) const GROUP: usize = 8;
/// Vectors of scores per tile.
const VECS: usize = TILE / GROUP;
const _: () = assert!(
    TILE.is_multiple_of(GROUP) && VECS.is_power_of_two(),
    "the softmax sum is a pairwise tree over the tile's vectors"
);
/// Key tiles ([`crate::paged_kv::KeyLayout::Tiled`]) per softmax tile.
pub(super) const TILES: usize = TILE / KEY_TILE;
const _: () = assert!(
    TILE.is_multiple_of(KEY_TILE) && KEY_TILE.is_multiple_of(16),
    "a softmax tile is whole key tiles, each whole vectors of 8 or 16 lanes"
);

/// One tile's K or V rows, in the pool or in a decoded copy: row `j` of the tile at `at[j]`,
/// `dtype`-encoded ([`KvStorage::row_bytes`] of the head size each), valid for every row an
/// op reads (`groups·8` keys, `n` values). Key rows past the tile's last position repeat a
/// valid row: their numbers are read, never weighed.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub(super) at: &'a [*const u8; TILE],
    pub(super) dtype: KvStorage,
}

/// A tile's keys as [`AttnOps::scores`] reads them.
#[derive(Clone, Copy)]
pub(super) enum Keys<'a> {
    /// Decoded by [`AttnOps::transpose`], in its ISA's layout.
    Transposed(&'a [f32]),
    /// [`KEY_TILE`] positions side by side ([`crate::paged_kv::KeyLayout::Tiled`]), in the
    /// pool or decoded to f32: positions `KEY_TILE·i..` at `at[i]`, number `d` of position
    /// `KEY_TILE·i + l` at index `KEY_TILE·d + l`. Every tile a score reads is a whole one
    /// of the pool's: positions past the tile's last hold numbers that are read, never
    /// weighed.
    Tiled {
        at: &'a [*const u8; TILES],
        dtype: TiledDtype,
    },
}

/// Number `i` of the `dtype` array at `p`, decoded as [`KvStorage::decode`] decodes it.
///
/// # Safety
/// `p` is valid for `i + 1` numbers.
#[inline(always)]
unsafe fn tiled_at(dtype: TiledDtype, p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's contract; f32, f16 and bf16 numbers decode alone.
    unsafe { decode_at(dtype.storage(), p, i + 1, i) }
}

/// Number `d` of the `hd`-long row at `row`, encoded in `dtype`, decoded exactly as
/// [`KvStorage::decode`] decodes it.
///
/// # Safety
/// `row` is valid for `dtype.row_bytes(hd)` bytes and `d < hd`.
#[inline(always)]
unsafe fn decode_at(dtype: KvStorage, row: *const u8, hd: usize, d: usize) -> f32 {
    let half = |p: *const u8| {
        // SAFETY: the caller's contract (p lies in the row).
        u16::from_le_bytes(unsafe { [*p, *p.add(1)] })
    };
    // SAFETY (every read): inside the row, by the caller's contract and the layout.
    unsafe {
        match dtype {
            KvStorage::F32 => f32::from_le_bytes(*row.add(4 * d).cast::<[u8; 4]>()),
            KvStorage::F16 => half::f16::from_bits(half(row.add(2 * d))).to_f32(),
            KvStorage::Bf16 => f32::from_bits(u32::from(half(row.add(2 * d))) << 16),
            KvStorage::Q8_0 => {
                let qk = q8_block(hd);
                let block = row.add(d / qk * (2 + qk));
                let scale = half::f16::from_bits(half(block)).to_f32();
                f32::from(*block.add(2 + d % qk) as i8) * scale
            }
        }
    }
}

/// `rows` as the fewest blocks `(first row, rows)` of at most `max`, as even as
/// possible: a block of 1-2 rows has too few accumulators to hide the FMA latency.
fn row_blocks(rows: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let blocks = rows.div_ceil(max);
    (0..blocks).map(move |b| {
        let r0 = rows * b / blocks;
        (r0, rows * (b + 1) / blocks - r0)
    })
}

/// `x` summed as a pairwise tree, `((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7))` for 8 (`N` a
/// power of two); level by level rather than recursive, so that it inlines.
#[inline(always)]
fn tree<T: Copy, const N: usize>(mut x: [T; N], add: impl Fn(T, T) -> T) -> T {
    let mut n = N;
    while n > 1 {
        for i in 0..n / 2 {
            x[i] = add(x[2 * i], x[2 * i + 1]);
        }
        n /= 2;
    }
    x[0]
}

/// Asks the CPU to bring the line at `p` into its second-level cache; a prefetch never
/// faults, whatever the address.
#[inline(always)]
pub(super) fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it reads nothing and cannot fault; SSE is baseline.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The cache lines of some rows (the tile ahead's keys or values), asked for one at a time
/// from inside [`AttnOps::scores`]' and [`AttnOps::accumulate`]'s loops (a line per step of
/// the dimensions or of the value rows) rather than all at once: a burst of requests past the
/// core's fill buffers stalls the loads behind it (the driver's `Ahead` says how much that
/// cost). What the loops leave, [`Trickle::rest`] asks for at once.
pub(super) struct Trickle<'a> {
    rows: &'a [*const u8],
    /// Bytes of each row.
    bytes: usize,
    /// The next line: row `row`, `at` bytes in.
    row: usize,
    at: usize,
}

impl<'a> Trickle<'a> {
    pub(super) fn new(rows: &'a [*const u8], bytes: usize) -> Self {
        Self {
            rows,
            bytes,
            row: 0,
            at: 0,
        }
    }

    /// Asks for nothing.
    pub(super) fn none() -> Self {
        Self::new(&[], 0)
    }

    /// Asks for the next line, if any is left.
    #[inline(always)]
    pub(super) fn step(&mut self) {
        if let Some(line) = self.next_line() {
            prefetch_line(line);
        }
    }

    /// The next line's address (each row's from its start, 64 bytes apart, while inside it).
    #[inline(always)]
    fn next_line(&mut self) -> Option<*const u8> {
        let row = *self.rows.get(self.row)?;
        let line = row.wrapping_add(self.at);
        self.at += 64;
        if self.at >= self.bytes {
            (self.row, self.at) = (self.row + 1, 0);
        }
        Some(line)
    }

    /// Asks for every line not asked for yet.
    pub(super) fn rest(&mut self) {
        while self.row < self.rows.len() {
            self.step();
        }
    }
}

/// What the kernel driver needs from an instruction set.
///
/// # Safety
/// Every method may use instructions of its ISA: call it only where they were detected.
pub(super) trait AttnOps: Copy {
    /// Decodes one row of `dst.len()` numbers from `src` (in `dtype`).
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]);
    /// Decodes the keys of groups `g < groups` (rows `8g..8g + 8` of `k`) into `kt`
    /// (`groups·8·hd` floats), laid out the way this ISA's [`AttnOps::scores`] reads them; the
    /// portable layout is `kt[g·8·hd + d·8 + j] = k_{8g + j}[d]`.
    unsafe fn transpose(self, k: Rows, hd: usize, groups: usize, kt: &mut [f32]);
    /// For query rows `r < rows` (`q`: rows of `hd`) and key groups `g < groups`:
    /// `s[r·TILE + 8g + l] = Σ_d q[r][d]·k_{8g+l}[d]` (and possibly more of the row's `TILE`
    /// with numbers never weighed). Asks for `ahead`'s lines as it goes (some or none of
    /// them: the caller asks for the rest).
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        keys: Keys,
        groups: usize,
        s: &mut [f32],
        ahead: &mut Trickle,
    );
    /// Scores → exponentials in place: with `m' = max(m, s[..n])`, `s[j] = exp(s[j] − m')`
    /// for `j < n` and 0 after; returns `(m', Σ s)`. `n ≥ 1`.
    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32);
    /// For rows `r` of `acc` (rows of `hd`):
    /// `acc_r = acc_r·alpha[r] + Σ_{j<n} e[r·TILE + j]·v_j`. Asks for `ahead`'s lines as
    /// [`AttnOps::scores`] does.
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate(
        self,
        acc: &mut [f32],
        hd: usize,
        alpha: &[f32],
        e: &[f32],
        v: Rows,
        n: usize,
        ahead: &mut Trickle,
    );
    /// Whether, for `rows` query rows, [`AttnOps::transpose`] and [`AttnOps::accumulate`]
    /// should read K and V where they lie rather than from a decoded f32 copy of the tile:
    /// a value vector is decoded once per register block of rows, so with many blocks one
    /// decoded copy is cheaper.
    fn in_place(self, rows: usize) -> bool;
    /// `acc = acc·ca + b·cb` (one fused multiply-add per number).
    unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32);
    /// `out = acc / l`.
    unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]);
}

const EXP_LO: f32 = -87.336_54;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
];

/// `exp(x)` for `x ≤ 0` (smaller than −87.3 gives `exp(−87.3)`, a number that only ever
/// multiplies zeros or vanishes next to 1); bit-identical to one lane of the vectorized one.
#[inline(always)]
pub(super) fn exp_scalar(x: f32) -> f32 {
    let x = x.max(EXP_LO);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let z = r * r;
    let mut y = EXP_P[0];
    for p in &EXP_P[1..] {
        y = y.mul_add(r, *p);
    }
    let y = y.mul_add(z, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The portable implementation (any CPU, any head size).
#[derive(Clone, Copy)]
pub(super) struct Scalar;

impl AttnOps for Scalar {
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]) {
        dtype.decode(src, dst);
    }

    unsafe fn transpose(self, k: Rows, hd: usize, groups: usize, kt: &mut [f32]) {
        for g in 0..groups {
            let kt = &mut kt[g * GROUP * hd..];
            for j in 0..GROUP {
                for d in 0..hd {
                    // SAFETY: the rows' contract.
                    kt[d * GROUP + j] = unsafe { decode_at(k.dtype, k.at[g * GROUP + j], hd, d) };
                }
            }
        }
    }

    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        keys: Keys,
        groups: usize,
        s: &mut [f32],
        _ahead: &mut Trickle,
    ) {
        for r in 0..rows {
            let q = &q[r * hd..(r + 1) * hd];
            for j in 0..groups * GROUP {
                let mut acc = 0f32;
                match keys {
                    Keys::Transposed(kt) => {
                        let k = &kt[(j / GROUP) * GROUP * hd + j % GROUP..];
                        for (d, qd) in q.iter().enumerate() {
                            acc = qd.mul_add(k[d * GROUP], acc);
                        }
                    }
                    Keys::Tiled { at, dtype } => {
                        let (tile, lane) = (at[j / KEY_TILE], j % KEY_TILE);
                        for (d, qd) in q.iter().enumerate() {
                            // SAFETY: a tile holds KEY_TILE·hd numbers (`Keys`).
                            let k = unsafe { tiled_at(dtype, tile, KEY_TILE * d + lane) };
                            acc = qd.mul_add(k, acc);
                        }
                    }
                }
                s[r * TILE + j] = acc;
            }
        }
    }

    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
        let m = s[..n].iter().fold(m, |a, &b| a.max(b));
        for (j, x) in s[..TILE].iter_mut().enumerate() {
            *x = if j < n { exp_scalar(*x - m) } else { 0.0 };
        }
        let l: [f32; GROUP] = std::array::from_fn(|l| {
            let lane: [f32; VECS] = std::array::from_fn(|c| s[c * GROUP + l]);
            tree(lane, |a, b| a + b)
        });
        let h: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
        (m, (h[0] + h[2]) + (h[1] + h[3]))
    }

    unsafe fn accumulate(
        self,
        acc: &mut [f32],
        hd: usize,
        alpha: &[f32],
        e: &[f32],
        v: Rows,
        n: usize,
        _ahead: &mut Trickle,
    ) {
        for (r, row) in acc.chunks_exact_mut(hd).enumerate() {
            let e = &e[r * TILE..];
            for (d, a) in row.iter_mut().enumerate() {
                let mut x = *a * alpha[r];
                for (ej, vrow) in e[..n].iter().zip(v.at) {
                    // SAFETY: the rows' contract.
                    let vj = unsafe { decode_at(v.dtype, *vrow, hd, d) };
                    x = ej.mul_add(vj, x);
                }
                *a = x;
            }
        }
    }

    /// Always from a decoded copy: decoding a number costs the portable code more than
    /// reading it.
    fn in_place(self, _rows: usize) -> bool {
        false
    }

    unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32) {
        for (a, b) in acc.iter_mut().zip(b) {
            *a = b.mul_add(cb, *a * ca);
        }
    }

    unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]) {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = a / l;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
pub(super) use avx512::Avx512;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod format;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(target_arch = "x86_64")]
mod vectorized;
#[cfg(target_arch = "x86_64")]
mod ymm;

#[cfg(test)]
mod trickle_tests {
    use super::Trickle;

    #[test]
    fn a_trickle_names_every_line_of_every_row_once_in_order() {
        let buf = [0u8; 4096];
        let base = buf.as_ptr();
        let rows = [base, base.wrapping_add(1024), base.wrapping_add(3000)];
        // 130 bytes a row: lines at 0, 64 and 128 of each.
        let mut t = Trickle::new(&rows, 130);
        let got: Vec<usize> = std::iter::from_fn(|| t.next_line())
            .map(|p| p as usize - base as usize)
            .collect();
        assert_eq!(got, [0, 64, 128, 1024, 1088, 1152, 3000, 3064, 3128]);
        assert_eq!(t.next_line(), None);
        t.rest();
        assert_eq!(Trickle::none().next_line(), None);
        // What the steps leave, `rest` asks for, and then nothing is left.
        let mut t = Trickle::new(&rows, 64);
        t.step();
        t.rest();
        assert_eq!(t.next_line(), None);
    }
}
