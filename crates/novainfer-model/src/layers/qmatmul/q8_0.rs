//! Q8_0 weights × Q8_0 activations.
//!
//! Packed layout, per 16-column group and 32-value block (576 bytes):
//! `[ d: f32 × 16 ][ qs: 8 × 64 B ]` where `qs[c]`, column j (bytes 4j..4j+4) =
//! the column's `qs[4c..4c+4]` (chunk c). The ISA's `dot_s8` may add a fixed
//! offset to the weights (VNNI needs unsigned ones); `S8_OFFSET·Σa` is subtracted
//! per block, so the int sums are exact and ISA-independent. The f32
//! accumulation order is the same as Q5_0's (see there).

use std::ops::Range;

use super::activation::{ActKind, QuantizedActs, QK8_0};
use super::simd::Simd;
use super::{Kernel, GROUP};

pub(super) struct Q8_0;

const QS: usize = 4 * GROUP;

impl Kernel for Q8_0 {
    const ACT: ActKind = ActKind::Q8_0;
    const BLOCK_K: usize = QK8_0;
    const RAW_BLOCK_BYTES: usize = 2 + 32;
    const GROUP_BLOCK_BYTES: usize = QS + 8 * 4 * GROUP;
    const WIDE_TILE: usize = 6;

    amx_rows_by!(flat_rows);

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            for c in 0..8 {
                let dst = QS + 4 * GROUP * c + 4 * j;
                out[dst..dst + 4].copy_from_slice(&raw[2 + 4 * c..6 + 4 * c]);
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
            for b in blocks {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES + 4 * col_off);
                let mut acc = [S::zero(); R];
                for c in 0..8 {
                    let w = S::load(blk.add(QS + 4 * GROUP * c));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let at = (row0 + r) * acts.k + b * QK8_0 + 4 * c;
                        *a = S::dot_s8(*a, w, S::bcast4(acts.qs.as_ptr().add(at)));
                    }
                }
                let dw = S::loadf(blk);
                for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                    let i = (row0 + r) * acts.nb + b;
                    let sumi = S::sub32(a, S::splat32(S::S8_OFFSET * acts.sums[i]));
                    let scale = S::mul(dw, S::splatf(acts.d[i]));
                    *f = S::fma(S::cvt(sumi), scale, *f);
                }
            }
            facc
        }
    }
}

impl super::amx::FlatBlocks for Q8_0 {
    const SIGNED: bool = true;
    const WEIGHTS: Option<usize> = Some(QS);

    #[inline(always)]
    unsafe fn exact(
        c: std::arch::x86_64::__m512i,
        _acts: &QuantizedActs,
        _i: usize,
    ) -> std::arch::x86_64::__m512i {
        // Signed weights times signed activations: `Σ w·a` with no offset.
        c
    }
}
