//! Activation rows quantized to int8 the way ggml (and candle) do it, so our
//! kernels see the same integers as candle's `QMatMul` and differ from it only
//! in the order of the f32 sums.
//!
//! * Q8_0 style (for Q5_0/Q8_0 weights): 32-value blocks, `d = f16(amax/127)`,
//!   `q = round(x/d)` with the unrounded `d`; we keep `Σq` per block for the
//!   kernels' offset corrections.
//! * Q8_K style (for Q4_K/Q6_K weights): 256-value blocks, `d = max/-127` of the
//!   signed extreme, `q = clamp(round(x/d))`; we keep the 16-value sums and the
//!   32-value sums packed as i16 pairs for `madd_epi16`.
//!
//! Rows are quantized independently: a row's integers never depend on the others.

use half::f16;

pub(super) const QK8_0: usize = 32;
pub(super) const QK_K: usize = 256;
/// Per Q8_K block: 16 sums of 16 values, then 4 i32 holding (sum32[2t], sum32[2t+1]) as i16.
pub(super) const K_SUMS: usize = 16 + 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ActKind {
    Q8_0,
    Q8K,
}

/// `m` rows of `k` quantized activations.
pub(super) struct QuantizedActs {
    pub k: usize,
    /// Blocks per row (`k / 32` or `k / 256`).
    pub nb: usize,
    /// `[m, k]`.
    pub qs: Vec<i8>,
    /// `[m, nb]` block scales.
    pub d: Vec<f32>,
    /// `[m, nb]` (Q8_0: Σq) or `[m, nb, K_SUMS]` (Q8_K).
    pub sums: Vec<i32>,
}

impl QuantizedActs {
    pub fn new(kind: ActKind, x: &[f32], m: usize, k: usize) -> Self {
        match kind {
            ActKind::Q8_0 => Self::q8_0(x, m, k),
            ActKind::Q8K => Self::q8k(x, m, k),
        }
    }

    fn q8_0(x: &[f32], m: usize, k: usize) -> Self {
        let nb = k / QK8_0;
        let mut qs = vec![0i8; m * k];
        let mut d = Vec::with_capacity(m * nb);
        let mut sums = Vec::with_capacity(m * nb);
        for (xb, qb) in x.chunks_exact(QK8_0).zip(qs.chunks_exact_mut(QK8_0)) {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * inv).round() as i8;
                sum += i32::from(*q);
            }
            d.push(f16::from_f32(scale).to_f32());
            sums.push(sum);
        }
        Self { k, nb, qs, d, sums }
    }

    fn q8k(x: &[f32], m: usize, k: usize) -> Self {
        let nb = k / QK_K;
        let mut qs = vec![0i8; m * k];
        let mut d = Vec::with_capacity(m * nb);
        let mut sums = Vec::with_capacity(m * nb * K_SUMS);
        for (xb, qb) in x.chunks_exact(QK_K).zip(qs.chunks_exact_mut(QK_K)) {
            // The signed value of largest magnitude (first one on ties), as ggml picks it.
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in xb {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            if amax == 0.0 {
                d.push(0.0);
                sums.extend([0; K_SUMS]);
                continue;
            }
            let iscale = -127f32 / max;
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (iscale * v).round().clamp(-128.0, 127.0) as i8;
            }
            d.push(1.0 / iscale);
            let s16: Vec<i32> = qb
                .chunks_exact(16)
                .map(|c| c.iter().map(|&q| i32::from(q)).sum())
                .collect();
            sums.extend_from_slice(&s16);
            for t in 0..4 {
                let lo = (s16[4 * t] + s16[4 * t + 1]) as i16;
                let hi = (s16[4 * t + 2] + s16[4 * t + 3]) as i16;
                sums.push(i32::from(lo as u16) | (i32::from(hi) << 16));
            }
        }
        Self { k, nb, qs, d, sums }
    }
}
