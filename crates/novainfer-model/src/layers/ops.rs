//! Element-wise and row-wise ops on `[rows, features]` f32 slices.

use novainfer_cuda::rope_scaling::{rotation, RopeScaling};

use crate::sampler::row_math::exp_nonpos;

/// `x · rsqrt(mean(x²) + eps) · w` per row, accumulated in f64 so the result does
/// not depend on how the row is split for SIMD.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    rms_norm_into(x, weight, eps, &mut out);
    out
}

/// [`rms_norm`] into `out` (its capacity reused).
pub fn rms_norm_into(x: &[f32], weight: &[f32], eps: f64, out: &mut Vec<f32>) {
    let dim = weight.len();
    out.clear();
    for row in x.chunks_exact(dim) {
        let mean_sq = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / dim as f64;
        let scale = (1.0 / (mean_sq + eps).sqrt()) as f32;
        out.extend(row.iter().zip(weight).map(|(&v, &w)| v * scale * w));
    }
}

/// `silu(gate) · up`, the SwiGLU activation.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(gate.len());
    silu_mul_into(gate, up, &mut out);
    out
}

/// [`silu_mul`] into `out` (its capacity reused). The logistic comes from
/// `sampler::row_math::exp_nonpos` (about 2 ulp), which LLVM vectorises: libm's `exp` does
/// not, and with it a decode step's SwiGLU was ~2% of the 0.5B model's step on two threads,
/// all of it on one (issue 30).
pub fn silu_mul_into(gate: &[f32], up: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.resize(gate.len().min(up.len()), 0.0);
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// `g · σ(g)`, with `σ(g) = 1 / (1 + e^−g)` for `g ≥ 0` and `e^g / (1 + e^g)` below: one
/// `e = exp(−|g|) ≤ 1` serves both and never overflows. The choice is made on the bits (a
/// mask from the sign), not by a branch, which would stop the loop from vectorising.
#[inline(always)]
fn silu(g: f32) -> f32 {
    let e = exp_nonpos(-g.abs());
    let negative = 0u32.wrapping_sub(g.to_bits() >> 31);
    let numerator = f32::from_bits((e.to_bits() & negative) | (1f32.to_bits() & !negative));
    g * numerator / (1.0 + e)
}

/// Scales `v` to unit L2 norm, summing in f64 (an embedding's last step, on every device).
pub fn normalize_l2(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// Rotary position embedding, "neox" style as Qwen2 uses it: dimension `i` is
/// rotated together with `i + head_dim/2` (not with its neighbour).
///
/// The frequencies (and YaRN's attention factor, which multiplies cos and sin, so attention
/// itself needs no change) come from [`novainfer_cuda::rope_scaling`], the function the GPU's
/// table is built with; unscaled, they are `θ^(−2i/head_dim)` exactly as always.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    attention_factor: f64,
}

impl Rope {
    /// Plain RoPE.
    pub fn new(head_dim: usize, theta: f64) -> Self {
        Self::scaled(head_dim, theta, &RopeScaling::None)
    }

    /// RoPE with a checkpoint's `rope_scaling` (linear, dynamic NTK, YaRN).
    pub fn scaled(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        Self {
            inv_freq: scaling.inv_freq(head_dim, theta),
            attention_factor: scaling.attention_factor(),
        }
    }

    /// Rotates every head of every row in place; row `r` sits at `positions[r]`.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], head_dim: usize) {
        self.angles(positions).apply(x, head_dim);
    }

    /// The cos and sin of every rotation of `positions`, computed once for a whole step:
    /// every layer rotates its q and k by the same angles.
    pub fn angles(&self, positions: &[usize]) -> RopeAngles {
        let mut angles = RopeAngles::default();
        self.angles_into(positions, &mut angles);
        angles
    }

    /// [`Self::angles`] into `angles` (its capacity reused).
    pub fn angles_into(&self, positions: &[usize], angles: &mut RopeAngles) {
        let half = self.inv_freq.len();
        angles.half = half;
        angles.cos.clear();
        angles.sin.clear();
        for &pos in positions {
            for &f in &self.inv_freq {
                let (cos, sin) = rotation(pos, f, self.attention_factor);
                angles.cos.push(cos);
                angles.sin.push(sin);
            }
        }
    }
}

/// [`Rope::angles`]: `[rows, head_dim/2]` cosines and sines.
#[derive(Debug, Clone, Default)]
pub struct RopeAngles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeAngles {
    /// Rotates every head of every row of `x` (one row per position the angles were made for).
    pub fn apply(&self, x: &mut [f32], head_dim: usize) {
        let half = self.half;
        let rows = self.cos.len() / half.max(1);
        let row_len = x.len() / rows.max(1);
        for ((row, cos), sin) in x
            .chunks_exact_mut(row_len)
            .zip(self.cos.chunks_exact(half))
            .zip(self.sin.chunks_exact(half))
        {
            for head in row.chunks_exact_mut(head_dim) {
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * cos[i] - b * sin[i];
                    hi[i] = b * cos[i] + a * sin[i];
                }
            }
        }
    }
}

/// Dot product over four 8-lane accumulators reduced in a fixed order, so the result never
/// depends on batch composition. With AVX2/FMA (the wheel's x86-64-v3 baseline) it is
/// written with intrinsics: the portable 32-lane form this replaced compiled to two-lane
/// SSE operations with spills, a quarter of the machine's width. Not inlined, so every
/// caller (the dense matmul, LoRA, the reference attention) runs the same code.
#[inline(never)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(a, b)
}

/// A stored weight a [`dot_with`] reads: f32, bf16 (bits or `half::bf16`, widened exactly by a
/// shift) or f16 (widened exactly by F16C). Each widens to the f32 it equals, so a dot over
/// 16-bit weights has the bits of the same dot over the weights stored as f32.
pub trait DotElem: Copy {
    fn to_f32(self) -> f32;
    /// Eight consecutive values from `p` as f32 lanes.
    ///
    /// # Safety
    /// `p..p + 8` must be readable.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl DotElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller guarantees eight readable values.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl DotElem for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees eight readable values (16 bytes).
        unsafe {
            let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
        }
    }
}

impl DotElem for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.to_bits().to_f32()
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: `half::bf16` is `repr(transparent)` over its u16 bits; the caller
        // guarantees eight readable values.
        unsafe { u16::load8(p.cast::<u16>()) }
    }
}

impl DotElem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // Exact: every f16 is an f32.
        half::f16::to_f32(self)
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees eight readable values (16 bytes); F16C comes with
        // the crate's x86-64-v3 baseline (every AVX2 CPU has it), and the conversion is exact.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }
}

/// [`dot`] of f32 activations with weights of any [`DotElem`] type.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
pub fn dot_with<W: DotElem>(a: &[f32], w: &[W]) -> f32 {
    use std::arch::x86_64::*;
    const STEP: usize = 32;
    let w = &w[..a.len()];
    let split = a.len() / STEP * STEP;
    // SAFETY: AVX2 and FMA are enabled at compile time (cfg above); every load reads
    // `i..i + 8` with `i + 32 <= split <= a.len() == w.len()`.
    let main = unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let (pa, pw) = (a.as_ptr(), w.as_ptr());
        let mut i = 0;
        while i < split {
            for (k, acc) in acc.iter_mut().enumerate() {
                let at = i + 8 * k;
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(at)), W::load8(pw.add(at)), *acc);
            }
            i += STEP;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut l = [0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), sum);
        ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
    };
    let tail: f32 = a[split..]
        .iter()
        .zip(&w[split..])
        .map(|(x, y)| x * y.to_f32())
        .sum();
    main + tail
}

/// The portable [`dot_with`] (targets without AVX2/FMA), in one fixed order.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[inline(always)]
pub fn dot_with<W: DotElem>(a: &[f32], w: &[W]) -> f32 {
    a.iter()
        .zip(&w[..a.len()])
        .map(|(x, y)| x * y.to_f32())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 2.0, 0.5, -1.0];
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0f64;
        let s = 1.0 / (ms + 1e-6).sqrt();
        let out = rms_norm(&x, &w, 1e-6);
        for i in 0..4 {
            assert!((f64::from(out[i]) - f64::from(x[i]) * s * f64::from(w[i])).abs() < 1e-6);
        }
    }

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        let rope = Rope::new(4, 10_000.0);
        // One head of 4: pairs are (0, 2) with freq 1 and (1, 3) with freq 1/100.
        let mut x = vec![1.0f32, 0.0, 0.0, 1.0];
        rope.apply(&mut x, &[1], 4);
        let (c0, s0) = (1f64.cos() as f32, 1f64.sin() as f32);
        let (c1, s1) = (0.01f64.cos() as f32, 0.01f64.sin() as f32);
        let expected = [c0, -s1, s0, c1];
        for (a, e) in x.iter().zip(expected) {
            assert!((a - e).abs() < 1e-6, "{x:?} vs {expected:?}");
        }
        let mut at_zero = vec![0.3f32, -0.7, 1.1, 2.0];
        rope.apply(&mut at_zero, &[0], 4);
        assert_eq!(at_zero, vec![0.3, -0.7, 1.1, 2.0]);
    }

    #[test]
    fn scaled_rope_rotates_by_the_shared_frequencies_times_the_attention_factor() {
        use novainfer_cuda::rope_scaling::Yarn;
        // head_dim 4, θ = 100, YaRN factor 4 over an original context of 16: the ramp keeps
        // pair 0 at θ's frequency (1) and divides pair 1's (1/10) by 4; cos and sin carry the
        // attention factor 0.1·ln 4 + 1.
        let yarn = Yarn {
            factor: 4.0,
            original_max_position_embeddings: 16,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
            truncate: true,
        };
        let rope = Rope::scaled(4, 100.0, &RopeScaling::Yarn(yarn));
        let a = yarn.attention_factor;
        let mut x = vec![1.0f32, 0.0, 0.0, 1.0];
        rope.apply(&mut x, &[3], 4);
        let (c0, s0) = ((3f64.cos() * a) as f32, (3f64.sin() * a) as f32);
        let (c1, s1) = ((0.075f64.cos() * a) as f32, (0.075f64.sin() * a) as f32);
        let expected = [c0, -s1, s0, c1];
        for (got, want) in x.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{x:?} vs {expected:?}");
        }
        // Unscaled through `scaled` is `new`, bit for bit.
        let plain = Rope::new(16, 1e6).angles(&[0, 5, 4095]);
        let same = Rope::scaled(16, 1e6, &RopeScaling::None).angles(&[0, 5, 4095]);
        assert_eq!((plain.cos, plain.sin), (same.cos, same.sin));
    }

    #[test]
    fn dot_handles_tails() {
        for len in [19, 32, 75] {
            let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let b = vec![2.0f32; len];
            assert_eq!(dot(&a, &b), 2.0 * (0..len as i32).sum::<i32>() as f32);
        }
    }

    #[test]
    fn silu_mul_is_swiglu() {
        let out = silu_mul(&[0.0, 2.0], &[5.0, 3.0]);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 2.0 / (1.0 + (-2.0f32).exp()) * 3.0).abs() < 1e-6);
    }

    #[test]
    fn silu_follows_the_float64_formula_over_the_whole_range() {
        // Every 1/4096 from -100 to 100 (both tails: e^-g past f32 on the left, σ = 1 on the right).
        let gate: Vec<f32> = (-409_600..=409_600).map(|i| i as f32 / 4096.0).collect();
        let out = silu_mul(&gate, &vec![1.0; gate.len()]);
        let mut worst = 0f64;
        for (&g, &got) in gate.iter().zip(&out) {
            let want = f64::from(g) / (1.0 + (-f64::from(g)).exp());
            if want.abs() > 1e-30 {
                worst = worst.max((f64::from(got) - want).abs() / want.abs());
            }
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        let edges = silu_mul(&[0.0, -0.0, 1e4, -1e4, f32::MAX], &[1.0; 5]);
        assert_eq!(edges[..3], [0.0, 0.0, 1e4]);
        assert!(edges[3] == 0.0 && edges[4] == f32::MAX, "{edges:?}");
    }
}
