//! Q5_0 weights × Q8_0 activations.
//!
//! Packed layout, per 16-column group and 32-value block (384 bytes); every
//! 64-byte row holds 4 bytes (or one f32) per column, column j at bytes 4j..4j+4:
//! ```text
//! [ d: f32 × 16 ][ qs: 4 × 64 B ][ qh: 64 B ]
//!   qs[i], column j = ggml qs[4i..4i+4]: low nibbles are k = 4i..4i+3 (chunk i),
//!          high nibbles k = 16+4i.. (chunk i+4)
//!   qh,    column j, byte t, bit c = fifth bit of the value at k = 4c+t
//! ```
//! so chunk `c` (k = 4c..4c+3) of all columns is one shift/mask away. Values are
//! kept unsigned (`u = w + 16`, 0..=31) and `16·Σa` is subtracted once per block,
//! which keeps the int sums exact.
//!
//! Per (row, column) the f32 work is `acc = fma(f32(sumi_b), dw_b·da_b, acc)`
//! over blocks in order, whatever the tile height or vector width: this is what
//! makes a row's result independent of the batch.

use std::ops::Range;

use super::activation::{ActKind, QuantizedActs, QK8_0};
use super::simd::Simd;
use super::{Kernel, GROUP};

pub(super) struct Q5_0;

const QS: usize = 4 * GROUP;
const QH: usize = QS + 4 * 4 * GROUP;

impl Kernel for Q5_0 {
    const ACT: ActKind = ActKind::Q8_0;
    const BLOCK_K: usize = QK8_0;
    const RAW_BLOCK_BYTES: usize = 2 + 4 + 16;
    const GROUP_BLOCK_BYTES: usize = QH + 4 * GROUP;
    const WIDE_TILE: usize = 8;

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            let qh = u32::from_le_bytes([raw[2], raw[3], raw[4], raw[5]]);
            let qs = &raw[6..22];
            for i in 0..4 {
                let dst = QS + 4 * GROUP * i + 4 * j;
                out[dst..dst + 4].copy_from_slice(&qs[4 * i..4 * i + 4]);
            }
            for t in 0..4 {
                let byte =
                    (0..8).fold(0u8, |acc, c| acc | ((((qh >> (4 * c + t)) & 1) as u8) << c));
                out[QH + 4 * j + t] = byte;
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<S: Simd, const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        mut facc: [S::F; R],
    ) -> [S::F; R] {
        // SAFETY: `group` points at `acts.nb` packed blocks of this layout, columns
        // `col_off..col_off+LANES` lie in the group and rows `row0..row0+R` exist in
        // `acts` (the driver's contract); the CPU supports `S`.
        unsafe {
            let low4 = S::splat8(0x0F);
            let bit4 = S::splat8(0x10);
            for b in blocks {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES + 4 * col_off);
                let qh = S::load(blk.add(QH));
                let mut acc = [S::zero(); R];
                for c in 0..8 {
                    let v = S::load(blk.add(QS + 4 * GROUP * (c % 4)));
                    let nib = if c < 4 { v } else { S::shr16::<4>(v) };
                    let u = S::or(S::and(nib, low4), S::and(high_bit::<S>(qh, c), bit4));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let at = (row0 + r) * acts.k + b * QK8_0 + 4 * c;
                        *a = S::dot_u6(*a, u, S::bcast4(acts.qs.as_ptr().add(at)));
                    }
                }
                let dw = S::loadf(blk);
                for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                    let i = (row0 + r) * acts.nb + b;
                    let sumi = S::sub32(a, S::splat32(16 * acts.sums[i]));
                    let scale = S::mul(dw, S::splatf(acts.d[i]));
                    *f = S::fma(S::cvt(sumi), scale, *f);
                }
            }
            facc
        }
    }
}

/// Moves bit `c` of every qh byte to bit 4 (the caller masks the rest); 16-bit
/// shifts by at most 4 never carry a neighbour byte's bit into bit 4.
#[inline(always)]
unsafe fn high_bit<S: Simd>(qh: S::I, c: usize) -> S::I {
    // SAFETY: register shifts; the caller's ISA contract holds.
    unsafe {
        match c {
            0 => S::shl16::<4>(qh),
            1 => S::shl16::<3>(qh),
            2 => S::shl16::<2>(qh),
            3 => S::shl16::<1>(qh),
            4 => qh,
            5 => S::shr16::<1>(qh),
            6 => S::shr16::<2>(qh),
            _ => S::shr16::<3>(qh),
        }
    }
}
