//! The kernel's arithmetic once for every SIMD width ([`Simd`]): per number the same IEEE
//! operations in the same order as [`super::Scalar`], `S::LANES` lanes at a time.
//!
//! Where the width could have changed the order, and why it does not:
//! * scores: [`AttnOps::transpose`] lays the keys out `LANES` positions side by side
//!   (`LANES / 8` groups of 8 interleaved), so a vector holds `LANES` scores of one query
//!   row, each still its own FMA chain from zero over `d` in order; groups left over when
//!   their number is not a multiple of `LANES / 8` keep the 8-wide layout and run the
//!   8-lane ([`Avx2`]) block;
//! * the softmax sum: the documented order works on the tile's [`VECS`] vectors of 8 (lane
//!   `l` of vector `c` is position `8c + l`). A wider vector `k` holds vectors
//!   `k·LANES/8 ..` of 8 in its 8-lane parts, so the exponentials are split back into
//!   those parts, in order, and summed by the 8-lane [`tile_sum`]. (Adding a tile's two
//!   16-lane vectors first would pair vector 0 with 2 and 1 with 3, which is *not* the
//!   documented `(e0+e1)+(e2+e3)`.) The maximum is exact in any order, but it is folded
//!   in the 8-lane order too, so that even a signed zero comes out the same;
//! * `exp` is one body of lane-wise operations;
//! * decoding ([`super::format`]: f16 → f32 and bf16 → f32 are exact, q8_0 is one exact
//!   conversion and one multiplication), the value pass (`acc·α`, then FMAs in position
//!   order), merging and finishing work per number: the width changes nothing.
//!
//! No closure here holds a [`Simd`] operation (register arrays are filled by loops, not
//! `std::array::from_fn`): a closure is compiled without its caller's target features, so
//! an AVX-512 intrinsic inside one is not inlined but called, its vectors passed through
//! memory (a first AVX-512 version ran 20x slower than AVX2 that way).
//! `layers::inlining_tests` checks the compiled test binary for such calls.
//!
//! Arrays of a tile's vectors are [`VECS`] long (the 8-lane count) whatever the width, as
//! their length cannot depend on `S::LANES`; a wider ISA uses the first `TILE / LANES`.

use std::arch::x86_64::*;

use super::format::{by_format, by_tiled, Format, F32};
use super::simd::Simd;
use super::ymm::{hmax, tile_sum, transpose_8_rows};
use super::{
    row_blocks, AttnOps, Avx2, Keys, Rows, Trickle, EXP_LO, EXP_P, GROUP, LN2_HI, LN2_LO, LOG2E,
    TILE, VECS,
};
use crate::kv_dtype::KvStorage;
use crate::paged_kv::KEY_TILE;

/// `$f::<$s, R, $c, $t…>($args)` for `R = $rows`, `1 ≤ $rows ≤ 8` (a `ROW_BLOCK`).
macro_rules! by_rows {
    ($rows:expr, $f:ident::<$s:ty, $c:tt $(, $t:ty)*>($($arg:expr),*)) => {
        match $rows {
            1 => $f::<$s, 1, $c $(, $t)*>($($arg),*),
            2 => $f::<$s, 2, $c $(, $t)*>($($arg),*),
            3 => $f::<$s, 3, $c $(, $t)*>($($arg),*),
            4 => $f::<$s, 4, $c $(, $t)*>($($arg),*),
            5 => $f::<$s, 5, $c $(, $t)*>($($arg),*),
            6 => $f::<$s, 6, $c $(, $t)*>($($arg),*),
            7 => $f::<$s, 7, $c $(, $t)*>($($arg),*),
            _ => $f::<$s, 8, $c $(, $t)*>($($arg),*),
        }
    };
}

/// `exp(x)` lane-wise, [`super::exp_scalar`] operation for operation.
///
/// # Safety
/// `S`'s ISA.
#[inline(always)]
unsafe fn exp<S: Simd>(x: S::V) -> S::V {
    // SAFETY (whole body): the caller's contract.
    unsafe {
        let x = S::max(x, S::splat(EXP_LO));
        let n = S::round(S::mul(x, S::splat(LOG2E)));
        let r = S::fma(n, S::splat(-LN2_HI), x);
        let r = S::fma(n, S::splat(-LN2_LO), r);
        let z = S::mul(r, r);
        let mut y = S::splat(EXP_P[0]);
        for p in &EXP_P[1..] {
            y = S::fma(y, r, S::splat(*p));
        }
        let y = S::add(S::fma(y, z, r), S::splat(1.0));
        S::mul(y, S::pow2(n))
    }
}

/// Scores of `R` query rows (`q`, rows of `hd`) against `P` vectors of `LANES` keys, `F`-encoded,
/// number `d` of vector `p`'s keys at index `d·line` of `k[p]` (the transposed scratch:
/// `line = LANES`; a key tile: `line = KEY_TILE`), into `s` (rows `TILE` apart): `R·P`
/// accumulators, each key vector loaded (and decoded) once for the `R` rows.
///
/// # Safety
/// `S`'s ISA; the rows and key vectors exist.
#[inline(always)]
unsafe fn score_block<S: Simd, const R: usize, const P: usize, F: Format>(
    q: *const f32,
    hd: usize,
    (k, line): ([*const u8; P], usize),
    s: *mut f32,
    ahead: &mut Trickle,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = [[S::zero(); P]; R];
        for d in 0..hd {
            ahead.step();
            let mut kv = [S::zero(); P];
            for (p, x) in kv.iter_mut().enumerate() {
                *x = F::load::<S>(k[p], d * line, hd);
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let qb = S::splat(*q.add(r * hd + d));
                for (x, kp) in row.iter_mut().zip(&kv) {
                    *x = S::fma(qb, *kp, *x);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (p, x) in row.iter().enumerate() {
                S::store(s.add(r * TILE + p * S::LANES), *x);
            }
        }
    }
}

/// [`score_block`] over query rows `0..rows` (`q`, rows of `hd`) and key vectors `0..vecs`
/// (vector `v` at `vector(v)`, numbers `line` apart), two vectors at a time, into `s`
/// (rows `TILE` apart, vector `v` at `v·LANES`).
///
/// # Safety
/// As [`score_block`], for every row and vector named.
#[inline(always)]
unsafe fn score_vectors<S: Simd, F: Format>(
    (q, hd, rows): (*const f32, usize, usize),
    vecs: usize,
    (vector, line): (impl Fn(usize) -> *const u8, usize),
    s: *mut f32,
    ahead: &mut Trickle,
) {
    for (r0, nr) in row_blocks(rows, S::ROW_BLOCK) {
        let (qr, sr) = (q.wrapping_add(r0 * hd), s.wrapping_add(r0 * TILE));
        let mut v0 = 0;
        while v0 < vecs {
            let so = sr.wrapping_add(v0 * S::LANES);
            // SAFETY: the caller's contract.
            unsafe {
                if vecs - v0 >= 2 {
                    let k = ([vector(v0), vector(v0 + 1)], line);
                    by_rows!(nr, score_block::<S, 2, F>(qr, hd, k, so, ahead));
                } else {
                    let k = ([vector(v0)], line);
                    by_rows!(nr, score_block::<S, 1, F>(qr, hd, k, so, ahead));
                }
            }
            v0 += if vecs - v0 >= 2 { 2 } else { 1 };
        }
    }
}

/// `R` rows × `C` `LANES`-dim chunks (from dimension `d0`) of the value accumulation: each
/// value vector loaded (and decoded) once for the `R` rows.
///
/// # Safety
/// `S`'s ISA; the rows and chunks of `acc` exist; `v`'s first `n` rows are `F`-encoded rows
/// of `hd` holding the chunks.
#[inline(always)]
unsafe fn acc_block<S: Simd, const R: usize, const C: usize, F: Format>(
    acc: *mut f32,
    hd: usize,
    alpha: *const f32,
    e: *const f32,
    (v, d0): (&[*const u8; TILE], usize),
    n: usize,
    ahead: &mut Trickle,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut a = [[S::zero(); C]; R];
        for (r, row) in a.iter_mut().enumerate() {
            let al = S::splat(*alpha.add(r));
            for (c, x) in row.iter_mut().enumerate() {
                *x = S::mul(S::load(acc.add(r * hd + S::LANES * c)), al);
            }
        }
        for (j, vrow) in v.iter().enumerate().take(n) {
            ahead.step();
            let mut vj = [S::zero(); C];
            for (c, x) in vj.iter_mut().enumerate() {
                *x = F::load::<S>(*vrow, d0 + S::LANES * c, hd);
            }
            for (r, row) in a.iter_mut().enumerate() {
                let w = S::splat(*e.add(r * TILE + j));
                for (x, vc) in row.iter_mut().zip(&vj) {
                    *x = S::fma(w, *vc, *x);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (c, x) in row.iter().enumerate() {
                S::store(acc.add(r * hd + S::LANES * c), *x);
            }
        }
    }
}

/// [`AttnOps::decode_row`] in format `F`.
///
/// # Safety
/// `S`'s ISA; `src` one `F`-encoded row of `dst.len()` numbers, a multiple of `S::LANES`.
#[inline(always)]
unsafe fn decode_row_as<S: Simd, F: Format>(src: *const u8, dst: &mut [f32]) {
    let (hd, lanes) = (dst.len(), S::LANES);
    // SAFETY: the caller's contract.
    unsafe {
        for c in 0..hd / lanes {
            S::store(
                dst.as_mut_ptr().add(lanes * c),
                F::load::<S>(src, lanes * c, hd),
            );
        }
    }
}

/// [`AttnOps::transpose`] of group `g`'s rows into `kt` at `at`, lines `stride` apart.
///
/// # Safety
/// As [`transpose_8_rows`] (every `Simd` ISA has AVX2/FMA/F16C).
#[inline(always)]
unsafe fn transpose_group<F: Format>(k: Rows, g: usize, hd: usize, dst: *mut f32, stride: usize) {
    let rows: &[*const u8; GROUP] = k.at[g * GROUP..][..GROUP]
        .try_into()
        .expect("a group is GROUP rows of the tile");
    // SAFETY: the caller's contract.
    unsafe { transpose_8_rows::<F>(rows, hd, dst, stride) }
}

impl<S: Simd> AttnOps for S {
    #[inline(always)]
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]) {
        debug_assert!(dst.len().is_multiple_of(S::LANES));
        debug_assert!(src.len() >= dtype.row_bytes(dst.len()));
        // SAFETY: `src` holds one encoded row of `dst.len()` numbers (checked above in debug
        // builds, guaranteed by the pool's geometry); the ISA was detected.
        unsafe { by_format!(dtype, |F| decode_row_as::<S, F>(src.as_ptr(), dst)) }
    }

    /// `LANES / 8` groups side by side: with `w = LANES / 8`, group `g < groups / w · w` at
    /// `kt[(g / w)·LANES·hd + d·LANES + (g % w)·8 + j] = k[(8g + j)·hd + d]`; the groups
    /// left over in the portable layout at `g·8·hd` (so 8 lanes is the portable layout).
    #[inline(always)]
    unsafe fn transpose(self, k: Rows, hd: usize, groups: usize, kt: &mut [f32]) {
        debug_assert!(hd.is_multiple_of(8) && groups <= TILE / GROUP);
        debug_assert!(kt.len() >= groups * GROUP * hd);
        let per = S::LANES / GROUP;
        let paired = groups / per * per;
        for g in 0..groups {
            let (at, stride) = if g < paired {
                ((g / per) * S::LANES * hd + (g % per) * GROUP, S::LANES)
            } else {
                (g * GROUP * hd, GROUP)
            };
            // SAFETY: group g's 8 rows as `Rows` promises; out, hd lines inside the first
            // groups·8·hd floats of kt (checked above); AVX2/FMA/F16C come with every `Simd`
            // ISA.
            unsafe {
                by_format!(k.dtype, |F| transpose_group::<F>(
                    k,
                    g,
                    hd,
                    kt.as_mut_ptr().add(at),
                    stride
                ))
            };
        }
    }

    #[inline(always)]
    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        keys: Keys,
        groups: usize,
        s: &mut [f32],
        ahead: &mut Trickle,
    ) {
        debug_assert!(q.len() >= rows * hd && s.len() >= rows * TILE && groups <= TILE / GROUP);
        let (q, s) = (q.as_ptr(), s.as_mut_ptr());
        match keys {
            Keys::Transposed(kt) => {
                debug_assert!(kt.len() >= groups * GROUP * hd);
                let kt = kt.as_ptr();
                let per = S::LANES / GROUP;
                let (vecs, paired) = (groups / per, groups / per * per);
                // Vector v of the ISA's layout, and group g of the portable one.
                let vector = |v: usize| kt.wrapping_add(v * S::LANES * hd).cast::<u8>();
                let group = |g: usize| kt.wrapping_add((paired + g) * GROUP * hd).cast::<u8>();
                // SAFETY: rows and key vectors lie inside the slices (checked above); every
                // `Simd` ISA has AVX2/FMA.
                unsafe {
                    let (all, portable) = ((q, hd, rows), (group, GROUP));
                    score_vectors::<S, F32>(all, vecs, (vector, S::LANES), s, ahead);
                    let s = s.wrapping_add(paired * GROUP);
                    score_vectors::<Avx2, F32>(all, groups - paired, portable, s, ahead);
                }
            }
            Keys::Tiled { at, dtype } => {
                // Vector v's lanes are positions LANES·v.., which lie in one key tile (LANES
                // divides KEY_TILE); a last vector past `groups` reads numbers never weighed.
                let vecs = (groups * GROUP).div_ceil(S::LANES);
                let size = dtype.size();
                let vector = |v: usize| {
                    let first = v * S::LANES;
                    at[first / KEY_TILE].wrapping_add(first % KEY_TILE * size)
                };
                // SAFETY: rows inside the slices (checked above), key vectors inside their
                // tiles (`Keys`); the ISA was detected.
                unsafe {
                    by_tiled!(dtype, |F| score_vectors::<S, F>(
                        (q, hd, rows),
                        vecs,
                        (vector, KEY_TILE),
                        s,
                        ahead
                    ))
                };
            }
        }
    }

    #[inline(always)]
    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
        debug_assert!(s.len() >= TILE && (1..=TILE).contains(&n));
        let (lanes, per) = (S::LANES, S::LANES / GROUP);
        let vecs = TILE / lanes;
        // SAFETY: s holds TILE = vecs·LANES floats; the ISA (and AVX) were detected.
        unsafe {
            let p = s.as_mut_ptr();
            let mut x = [S::zero(); VECS];
            let mut live = [S::first(0); VECS];
            for k in 0..vecs {
                x[k] = S::load(p.add(lanes * k));
                // Lane l of vector k is position LANES·k + l, live below n.
                live[k] = S::first(n.saturating_sub(lanes * k).min(lanes));
            }
            let ninf = S::splat(f32::NEG_INFINITY);
            let mut mx = _mm256_set1_ps(m);
            for k in 0..vecs {
                let xk = S::select(live[k], x[k], ninf);
                for h in 0..per {
                    mx = _mm256_max_ps(mx, S::ymm(xk, h));
                }
            }
            let m = hmax(mx);
            let mv = S::splat(m);
            let mut e8 = [_mm256_setzero_ps(); VECS];
            for k in 0..vecs {
                let ek = S::zero_unless(live[k], exp::<S>(S::sub(x[k], mv)));
                S::store(p.add(lanes * k), ek);
                // The documented vectors of 8, in order (see the module docs).
                for h in 0..per {
                    e8[per * k + h] = S::ymm(ek, h);
                }
            }
            (m, tile_sum(e8))
        }
    }

    #[inline(always)]
    unsafe fn accumulate(
        self,
        acc: &mut [f32],
        hd: usize,
        alpha: &[f32],
        e: &[f32],
        v: Rows,
        n: usize,
        ahead: &mut Trickle,
    ) {
        let (rows, lanes) = (acc.len() / hd, S::LANES);
        debug_assert!(hd.is_multiple_of(lanes) && alpha.len() >= rows);
        debug_assert!(e.len() >= rows * TILE && n <= TILE);
        let (acc, alpha, e) = (acc.as_mut_ptr(), alpha.as_ptr(), e.as_ptr());
        let chunks = hd / lanes;
        for (r0, nr) in row_blocks(rows, S::ROW_BLOCK) {
            let (a, al, er) = (
                acc.wrapping_add(r0 * hd),
                alpha.wrapping_add(r0),
                e.wrapping_add(r0 * TILE),
            );
            let mut c0 = 0;
            while c0 < chunks {
                let (ac, vc) = (a.wrapping_add(lanes * c0), (v.at, lanes * c0));
                // SAFETY: rows r0.., dims LANES·c0.. lie inside `acc` (checked above) and in
                // every row `v` promises; the ISA was detected.
                unsafe {
                    if chunks - c0 >= 2 {
                        by_format!(v.dtype, |F| by_rows!(
                            nr,
                            acc_block::<S, 2, F>(ac, hd, al, er, vc, n, ahead)
                        ));
                    } else {
                        by_format!(v.dtype, |F| by_rows!(
                            nr,
                            acc_block::<S, 1, F>(ac, hd, al, er, vc, n, ahead)
                        ));
                    }
                }
                c0 += if chunks - c0 >= 2 { 2 } else { 1 };
            }
        }
    }

    /// In place while the rows fit two register blocks (decode; measured on Zen 4, one thread,
    /// depth 4,096, f16: 18-23% faster than through a copy for 6 and 7 rows, the 0.5B's 7 in
    /// two blocks of AVX2's 6 included). Prefill's 32 tokens' rows read a copy: decoding
    /// the values per block, or the keys while transposing them, was 2-4% slower there.
    #[inline(always)]
    fn in_place(self, rows: usize) -> bool {
        rows <= 2 * S::ROW_BLOCK
    }

    #[inline(always)]
    unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32) {
        let lanes = S::LANES;
        debug_assert!(acc.len().is_multiple_of(lanes) && b.len() >= acc.len());
        // SAFETY: both hold hd floats, a multiple of LANES.
        unsafe {
            let (ca, cb) = (S::splat(ca), S::splat(cb));
            for c in 0..acc.len() / lanes {
                let a = acc.as_mut_ptr().add(lanes * c);
                let x = S::mul(S::load(a), ca);
                S::store(a, S::fma(S::load(b.as_ptr().add(lanes * c)), cb, x));
            }
        }
    }

    #[inline(always)]
    unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]) {
        let lanes = S::LANES;
        debug_assert!(acc.len().is_multiple_of(lanes) && out.len() >= acc.len());
        // SAFETY: both hold hd floats, a multiple of LANES.
        unsafe {
            let l = S::splat(l);
            for c in 0..acc.len() / lanes {
                let x = S::div(S::load(acc.as_ptr().add(lanes * c)), l);
                S::store(out.as_mut_ptr().add(lanes * c), x);
            }
        }
    }
}
