//! Q4_K weights × Q8_K activations.
//!
//! A ggml Q4_K block covers 256 values in 8 sub-blocks of 32, each with a 6-bit
//! scale `sc` and min `m`: `w = d·sc·q - dmin·m`, `q` in 0..=15. Packed layout,
//! per 8-column group and block (1216 bytes):
//! ```text
//! [ d: f32 × 8 ][ dmin: f32 × 8 ][ sc: [8 sub][8 col] u8 ][ m: [4 t][8 col][2] u8 ][ qs: [4 p][8 i] × 32 B ]
//!   qs[p][i], lane j = column j's ggml qs[32p+4i..+4]: low nibbles are chunk i of
//!   sub-block 2p, high nibbles chunk i of sub-block 2p+1
//! ```
//! Per (row, column): `isum = Σ_s sc_s·Σ q·a` and `imin = Σ_s m_s·Σa_s` are exact
//! i32; then `acc = fma(f32(isum), dw·da, acc); acc = fnmadd(f32(imin), dmin·da, acc)`
//! per block in order, independent of the tile height.

use std::arch::x86_64::*;

use super::activation::{ActKind, QuantizedActs, K_SUMS, QK_K};
use super::isa::{bcast4, Isa};
use super::Kernel;

pub(super) struct Q4K;

const QS: usize = 192;

/// ggml's `get_scale_min_k4`: the 6-bit (scale, min) of sub-block `j`.
fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Kernel for Q4K {
    const ACT: ActKind = ActKind::Q8K;
    const BLOCK_K: usize = QK_K;
    const RAW_BLOCK_BYTES: usize = 144;
    const GROUP_BLOCK_BYTES: usize = 64 + 64 + 64 + 1024;

    fn pack_block(cols: &[Option<&[u8]>; 8], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            let dmin = half::f16::from_le_bytes([raw[2], raw[3]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            out[32 + 4 * j..36 + 4 * j].copy_from_slice(&dmin.to_le_bytes());
            let scales = &raw[4..16];
            for s in 0..8 {
                let (sc, m) = scale_min(s, scales);
                out[64 + 8 * s + j] = sc;
                out[128 + 16 * (s / 2) + 2 * j + s % 2] = m;
            }
            let qs = &raw[16..144];
            for p in 0..4 {
                for i in 0..8 {
                    let dst = QS + 32 * (8 * p + i) + 4 * j;
                    out[dst..dst + 4].copy_from_slice(&qs[32 * p + 4 * i..32 * p + 4 * i + 4]);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<I: Isa, const R: usize>(
        group: *const u8,
        acts: &QuantizedActs,
        row0: usize,
    ) -> [__m256; R] {
        // SAFETY: `group` points at `acts.nb` packed blocks of this layout and rows
        // `row0..row0+R` exist in `acts` (the driver's contract); all loads are unaligned.
        unsafe {
            let low4 = _mm256_set1_epi8(0x0F);
            let mut facc = [_mm256_setzero_ps(); R];
            for b in 0..acts.nb {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
                let mut isum = [_mm256_setzero_si256(); R];
                for s in 0..8 {
                    let mut acc = [_mm256_setzero_si256(); R];
                    for i in 0..8 {
                        let v = _mm256_loadu_si256(
                            blk.add(QS + 32 * (8 * (s / 2) + i)) as *const __m256i
                        );
                        let nib = if s % 2 == 0 {
                            v
                        } else {
                            _mm256_srli_epi16::<4>(v)
                        };
                        let u = _mm256_and_si256(nib, low4);
                        for (r, a) in acc.iter_mut().enumerate() {
                            let at = (row0 + r) * acts.k + b * QK_K + 32 * s + 4 * i;
                            *a = I::dot_u6(*a, u, bcast4(acts.qs.as_ptr().add(at)));
                        }
                    }
                    let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        blk.add(64 + 8 * s) as *const __m128i
                    ));
                    for (t, a) in isum.iter_mut().zip(acc) {
                        *t = _mm256_add_epi32(*t, _mm256_mullo_epi32(a, sc));
                    }
                }
                let dw = _mm256_loadu_ps(blk as *const f32);
                let dmin = _mm256_loadu_ps(blk.add(32) as *const f32);
                for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                    let i = (row0 + r) * acts.nb + b;
                    let sums = &acts.sums[i * K_SUMS + 16..i * K_SUMS + 20];
                    let mut imin = _mm256_setzero_si256();
                    for (p, &pair) in sums.iter().enumerate() {
                        let m = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            blk.add(128 + 16 * p) as *const __m128i
                        ));
                        imin =
                            _mm256_add_epi32(imin, _mm256_madd_epi16(m, _mm256_set1_epi32(pair)));
                    }
                    let da = _mm256_set1_ps(acts.d[i]);
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, da), *f);
                    *f = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, da), *f);
                }
            }
            facc
        }
    }
}
