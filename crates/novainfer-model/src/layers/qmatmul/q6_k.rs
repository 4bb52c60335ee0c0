//! Q6_K weights × Q8_K activations.
//!
//! A ggml Q6_K block covers 256 values in 16 sub-blocks of 16, each with an i8
//! scale: `w = d·sc·(q - 32)`, `q` in 0..=63 split into a low nibble and 2 high
//! bits. We decode `q` at load time and re-split it into planes that one shift and
//! mask turn into chunk `c` (k = 4c..4c+3) of all columns. Packed layout, per
//! 16-column group and block (3392 bytes; column j at bytes 4j..4j+4 of each plane row):
//! ```text
//! [ d: f32 × 16 ][ sc: [16 sub][16 col] i8 ][ lo: 32 × 64 B ][ hi: 16 × 64 B ]
//!   lo[i], byte t: low nibble = q(4i+t) & 15, high nibble = q(128+4i+t) & 15
//!   hi[i], byte t: bits 2T..2T+1 = q(4(i+16T)+t) >> 4, T = 0..3
//! ```
//! Per (row, column): `isum = Σ_g sc_g·(Σ q·a - 32·Σa_g)` exact in i32, then
//! `acc = fma(f32(isum), dw·da, acc)` per block in order, independent of the tile
//! height and vector width.

use super::activation::{ActKind, QuantizedActs, K_SUMS, QK_K};
use super::simd::Simd;
use super::{Kernel, GROUP};

pub(super) struct Q6K;

const SC: usize = 4 * GROUP;
const LO: usize = SC + 16 * GROUP;
const HI: usize = LO + 32 * 4 * GROUP;

/// The 256 unsigned 6-bit values of one ggml Q6_K block, in k order.
fn decode(raw: &[u8]) -> [u8; QK_K] {
    let (ql, qh) = (&raw[0..128], &raw[128..192]);
    let mut q = [0u8; QK_K];
    for half in 0..2 {
        let (ql, qh, y) = (&ql[64 * half..], &qh[32 * half..], 128 * half);
        for l in 0..32 {
            q[y + l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[y + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[y + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[y + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

impl Kernel for Q6K {
    const ACT: ActKind = ActKind::Q8K;
    const BLOCK_K: usize = QK_K;
    const RAW_BLOCK_BYTES: usize = 210;
    const GROUP_BLOCK_BYTES: usize = HI + 16 * 4 * GROUP;
    const WIDE_TILE: usize = 4;

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[208], raw[209]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            for g in 0..16 {
                out[SC + GROUP * g + j] = raw[192 + g];
            }
            let q = decode(raw);
            for i in 0..32 {
                for t in 0..4 {
                    out[LO + 4 * GROUP * i + 4 * j + t] =
                        (q[4 * i + t] & 0xF) | ((q[128 + 4 * i + t] & 0xF) << 4);
                }
            }
            for i in 0..16 {
                for t in 0..4 {
                    out[HI + 4 * GROUP * i + 4 * j + t] = (0..4).fold(0u8, |acc, hi| {
                        acc | ((q[4 * (i + 16 * hi) + t] >> 4) << (2 * hi))
                    });
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<S: Simd, const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
    ) -> [S::F; R] {
        // SAFETY: `group` points at `acts.nb` packed blocks of this layout, columns
        // `col_off..col_off+LANES` lie in the group and rows `row0..row0+R` exist in
        // `acts` (the driver's contract); the CPU supports `S`.
        unsafe {
            let low4 = S::splat8(0x0F);
            let bits45 = S::splat8(0x30);
            let mut facc = [S::zerof(); R];
            for b in 0..acts.nb {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
                let planes = blk.add(4 * col_off);
                let mut isum = [S::zero(); R];
                for g in 0..16 {
                    let mut acc = [S::zero(); R];
                    for c in 4 * g..4 * g + 4 {
                        let v = S::load(planes.add(LO + 4 * GROUP * (c % 32)));
                        let nib = if c < 32 { v } else { S::shr16::<4>(v) };
                        let h = S::load(planes.add(HI + 4 * GROUP * (c % 16)));
                        let u = S::or(S::and(nib, low4), S::and(high_bits::<S>(h, c / 16), bits45));
                        for (r, a) in acc.iter_mut().enumerate() {
                            let at = (row0 + r) * acts.k + b * QK_K + 4 * c;
                            *a = S::dot_u6(*a, u, S::bcast4(acts.qs.as_ptr().add(at)));
                        }
                    }
                    let sc = S::i8_i32(blk.add(SC + GROUP * g + col_off));
                    for (r, (t, a)) in isum.iter_mut().zip(acc).enumerate() {
                        let sum16 = acts.sums[((row0 + r) * acts.nb + b) * K_SUMS + g];
                        let a = S::sub32(a, S::splat32(32 * sum16));
                        *t = S::add32(*t, S::mullo32(a, sc));
                    }
                }
                let dw = S::loadf(planes);
                for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                    let da = S::splatf(acts.d[(row0 + r) * acts.nb + b]);
                    *f = S::fma(S::cvt(t), S::mul(dw, da), *f);
                }
            }
            facc
        }
    }
}

/// Moves bits 2T..2T+1 of every byte to bits 4..5 (the caller masks the rest);
/// 16-bit shifts by at most 4 never carry a neighbour byte's bits into 4..5.
#[inline(always)]
unsafe fn high_bits<S: Simd>(h: S::I, t: usize) -> S::I {
    // SAFETY: register shifts; the caller's ISA contract holds.
    unsafe {
        match t {
            0 => S::shl16::<4>(h),
            1 => S::shl16::<2>(h),
            2 => h,
            _ => S::shr16::<2>(h),
        }
    }
}
