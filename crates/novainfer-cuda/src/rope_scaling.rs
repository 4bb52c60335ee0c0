//! RoPE frequencies, plain or scaled for long contexts: the one host-side definition that the
//! CPU model (`novainfer-model`'s `Rope`) and the GPU's cos/sin table
//! (`ops::rope::RopeTable`, feature `cuda`) both use, so the two rotate by the same angles.
//!
//! The scalings are transformers' (`modeling_rope_utils.py`), formula for formula:
//!
//! * none: `inv_freq[i] = θ^(−2i/d)` (`d` = head_dim), computed exactly as before scaling
//!   existed, so unscaled models keep their bits;
//! * `linear`: `inv_freq[i] / factor` (positions divided by the factor);
//! * `dynamic` (NTK): θ becomes `θ · (factor·L/M − (factor − 1))^(d/(d−2))`. transformers takes
//!   `L` = the current sequence length (at least `M` = max_position_embeddings), which makes a
//!   cached key depend on how long the sequence was when it was computed; like vLLM's
//!   `DynamicNTKScalingRotaryEmbedding` we fix `L = M · factor`, the longest sequence the
//!   scaled model serves, so every position has one rotation whatever the batch or the time;
//! * `yarn`: `_compute_yarn_parameters`: frequencies whose wavelength is short against the
//!   original context keep θ's value (extrapolation), long ones are divided by the factor
//!   (interpolation), with a linear ramp between the correction dimensions of `beta_fast` and
//!   `beta_slow` (floored and ceiled unless `truncate` is false); cos and sin are multiplied by
//!   the attention factor (default `0.1·ln(factor) + 1`, or the `mscale`/`mscale_all_dim` ratio).
//!
//! Everything is computed in f64 and rounded to f32 once, when a cos or sin is stored.

use std::f64::consts::PI;

/// How a checkpoint scales its rotary embedding (`rope_scaling` in `config.json`,
/// `rope.scaling.*` in GGUF), with every default already resolved.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RopeScaling {
    /// Plain RoPE (also `"default"` and a null `rope_scaling`).
    #[default]
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// NTK-aware θ, fixed for the scaled context `max_position_embeddings · factor` (vLLM's
    /// choice, see the module's docs).
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    Yarn(Yarn),
}

/// YaRN's parameters, defaults resolved as transformers resolves them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    /// The context the model was pretrained for (`original_max_position_embeddings`, else
    /// `max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// Rotations at which a dimension starts to be interpolated (default 32)...
    pub beta_fast: f64,
    /// ...and is fully interpolated (default 1).
    pub beta_slow: f64,
    /// Multiplies cos and sin (so both q·k and nothing else see it squared).
    pub attention_factor: f64,
    /// Floor/ceil the correction range (transformers' `truncate`, default true).
    pub truncate: bool,
}

impl Yarn {
    pub const DEFAULT_BETA_FAST: f64 = 32.0;
    pub const DEFAULT_BETA_SLOW: f64 = 1.0;

    /// transformers' default attention factor when the config gives none:
    /// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` when both are given
    /// and non-zero, else `get_mscale(factor)`, with `get_mscale(s, m) = 0.1·m·ln(s) + 1`
    /// (1 for `s ≤ 1`).
    pub fn default_attention_factor(
        factor: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
    ) -> f64 {
        match (mscale, mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(factor, m) / get_mscale(factor, all)
            }
            _ => get_mscale(factor, 1.0),
        }
    }

    /// The ramp's ends `(low, high)`: the dimensions (in 0..head_dim) whose frequency turns
    /// `beta_fast` and `beta_slow` times over the original context.
    pub fn correction_range(&self, head_dim: usize, theta: f64) -> (f64, f64) {
        let d = head_dim as f64;
        let orig = self.original_max_position_embeddings as f64;
        let dim_of = |rotations: f64| d * (orig / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
        let (mut low, mut high) = (dim_of(self.beta_fast), dim_of(self.beta_slow));
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        (low.max(0.0), high.min(d - 1.0))
    }
}

fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The longest sequence the scaled model serves, vLLM's `_get_and_verify_max_len`:
    /// `max_position_embeddings` unscaled; times the factor for linear and dynamic;
    /// `original_max_position_embeddings · factor` for YaRN (Qwen2.5's 32768 · 4 = 131072),
    /// rounded down.
    pub fn max_positions(&self, max_position_embeddings: usize) -> usize {
        let scaled = |n: usize, factor: f64| (n as f64 * factor) as usize;
        match *self {
            Self::None => max_position_embeddings,
            Self::Linear { factor } | Self::Dynamic { factor, .. } => {
                scaled(max_position_embeddings, factor)
            }
            Self::Yarn(y) => scaled(y.original_max_position_embeddings, y.factor),
        }
    }

    /// What cos and sin are multiplied by (1 but for YaRN).
    pub fn attention_factor(&self) -> f64 {
        match self {
            Self::Yarn(y) => y.attention_factor,
            _ => 1.0,
        }
    }

    /// The `head_dim / 2` inverse frequencies: pair `(i, i + head_dim/2)` turns by
    /// `pos · inv_freq[i]` at position `pos`.
    pub fn inv_freq(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        let half = head_dim / 2;
        let d = head_dim as f64;
        let plain =
            |base: f64| -> Vec<f64> { (0..half).map(|i| base.powf(-2.0 * i as f64 / d)).collect() };
        match *self {
            Self::None => plain(theta),
            Self::Linear { factor } => plain(theta).into_iter().map(|f| f / factor).collect(),
            Self::Dynamic {
                factor,
                max_position_embeddings,
            } => {
                let m = max_position_embeddings as f64;
                let seq_len = m * factor;
                let base = theta * (factor * seq_len / m - (factor - 1.0)).powf(d / (d - 2.0));
                plain(base)
            }
            Self::Yarn(y) => {
                let (low, mut high) = y.correction_range(head_dim, theta);
                if low == high {
                    high += 0.001; // transformers' guard against a zero-width ramp
                }
                (0..half)
                    .map(|i| {
                        let pos_freq = theta.powf(2.0 * i as f64 / d);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (y.factor * pos_freq);
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp; // transformers' inv_freq_extrapolation_factor
                        interpolation * (1.0 - keep) + extrapolation * keep
                    })
                    .collect()
            }
        }
    }
}

/// `(cos, sin)` of position `pos` for one inverse frequency, scaled by `attention_factor`, in
/// f64 and rounded once. With a factor of 1 this is bit for bit the unscaled rotation.
#[inline]
pub fn rotation(pos: usize, inv_freq: f64, attention_factor: f64) -> (f32, f32) {
    let angle = pos as f64 * inv_freq;
    (
        (angle.cos() * attention_factor) as f32,
        (angle.sin() * attention_factor) as f32,
    )
}

/// The `[max_positions, head_dim]` table the GPU reads: row `pos` holds the `head_dim/2`
/// cosines, then the sines. `head_dim` must be even (the caller checks).
pub fn cos_sin_table(
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    max_positions: usize,
) -> Vec<f32> {
    let inv_freq = scaling.inv_freq(head_dim, theta);
    let a = scaling.attention_factor();
    let mut table = Vec::with_capacity(max_positions * head_dim);
    for pos in 0..max_positions {
        table.extend(inv_freq.iter().map(|&f| rotation(pos, f, a).0));
        table.extend(inv_freq.iter().map(|&f| rotation(pos, f, a).1));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    fn yarn(factor: f64, orig: usize) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast: Yarn::DEFAULT_BETA_FAST,
            beta_slow: Yarn::DEFAULT_BETA_SLOW,
            attention_factor: Yarn::default_attention_factor(factor, None, None),
            truncate: true,
        }
    }

    #[test]
    fn unscaled_frequencies_are_the_plain_formula_bit_for_bit() {
        let f = RopeScaling::None.inv_freq(8, 10_000.0);
        let plain: Vec<f64> = (0..4)
            .map(|i| 10_000f64.powf(-2.0 * i as f64 / 8.0))
            .collect();
        assert_eq!(f, plain);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[2], 0.01);
        assert_eq!(RopeScaling::None.attention_factor(), 1.0);
        // A factor of one changes no bit of the rotation.
        let angle = 7.0 * f[1];
        assert_eq!(
            rotation(7, f[1], 1.0),
            (angle.cos() as f32, angle.sin() as f32)
        );
    }

    #[test]
    fn linear_divides_every_frequency() {
        let f = RopeScaling::Linear { factor: 4.0 }.inv_freq(8, 10_000.0);
        // 1/4, 0.1/4, 0.01/4, 0.001/4
        for (got, want) in f.iter().zip([0.25, 0.025, 0.0025, 0.00025]) {
            assert!(close(*got, want), "{f:?}");
        }
    }

    #[test]
    fn dynamic_ntk_uses_the_base_of_the_full_scaled_context() {
        // factor 2, M = 16: L = 32, base = 100 · (2·32/16 − 1)^(4/2) = 100 · 9 = 900.
        let s = RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 16,
        };
        let f = s.inv_freq(4, 100.0);
        assert!(close(f[0], 1.0) && close(f[1], 1.0 / 30.0), "{f:?}");
        assert_eq!(s.max_positions(16), 32);
    }

    #[test]
    fn yarn_ramp_and_attention_factor_by_hand() {
        // head_dim 8, θ = 10000, original 16, factor 4, betas 32/1:
        // dim(r) = 8·ln(16/(2πr)) / (2·ln 10000): dim(32) = −1.0992 → floor −2 → 0,
        // dim(1) = 0.4059 → ceil 1. Ramp (i − 0)/(1 − 0) clamped: 0, 1, 1, 1.
        let y = yarn(4.0, 16);
        let (low, high) = y.correction_range(8, 10_000.0);
        assert_eq!((low, high), (0.0, 1.0));
        let f = RopeScaling::Yarn(y).inv_freq(8, 10_000.0);
        // i = 0 keeps θ's frequency, the rest are divided by 4.
        for (got, want) in f.iter().zip([1.0, 0.1 / 4.0, 0.01 / 4.0, 0.001 / 4.0]) {
            assert!(close(*got, want), "{f:?}");
        }
        assert!(close(y.attention_factor, 0.1 * 4f64.ln() + 1.0));
        assert_eq!(RopeScaling::Yarn(y).max_positions(512), 64);
    }

    #[test]
    fn yarn_without_truncation_ramps_between_fractional_dimensions() {
        // head_dim 8, θ = 100, original 64, betas 2 and 0.5, factor 2:
        // dim(r) = 8·ln(64/(2πr)) / (2·ln 100) = 0.868589·ln(10.18592/r):
        // dim(2) = 1.41394, dim(0.5) = 2.61806.
        let mut y = yarn(2.0, 64);
        y.beta_fast = 2.0;
        y.beta_slow = 0.5;
        y.truncate = false;
        let (low, high) = y.correction_range(8, 100.0);
        let k = 8.0 / (2.0 * 100f64.ln());
        assert!(close(low, k * (64.0 / (4.0 * PI)).ln()), "{low}");
        assert!(close(high, k * (64.0 / PI).ln()), "{high}");
        assert!((low - 1.41394).abs() < 1e-5 && (high - 2.61806).abs() < 1e-5);
        let f = RopeScaling::Yarn(y).inv_freq(8, 100.0);
        // θ^(−2i/8) = 100^(−i/4): 1, 0.316, 0.1, 0.0316.
        let plain = [1.0, 100f64.powf(-0.25), 0.1, 100f64.powf(-0.75)];
        // i = 0, 1: below low, pure extrapolation; i = 3: above high, pure interpolation;
        // i = 2: ramp (2 − low)/(high − low) of the way to interpolation.
        let ramp = (2.0 - low) / (high - low);
        let want = [
            plain[0],
            plain[1],
            plain[2] / 2.0 * ramp + plain[2] * (1.0 - ramp),
            plain[3] / 2.0,
        ];
        for (got, want) in f.iter().zip(want) {
            assert!(close(*got, want), "{f:?} vs {want}");
        }
    }

    #[test]
    fn yarn_attention_factor_follows_mscale_and_factor_at_most_one() {
        let f = 40.0f64;
        let (m, all) = (0.707, 0.5);
        let want = (0.1 * m * f.ln() + 1.0) / (0.1 * all * f.ln() + 1.0);
        assert!(close(
            Yarn::default_attention_factor(f, Some(m), Some(all)),
            want
        ));
        // Either one zero or missing: the plain formula.
        assert!(close(
            Yarn::default_attention_factor(f, Some(m), Some(0.0)),
            0.1 * f.ln() + 1.0
        ));
        assert!(close(
            Yarn::default_attention_factor(f, None, Some(all)),
            0.1 * f.ln() + 1.0
        ));
        // A factor ≤ 1 has no magnitude correction.
        assert_eq!(Yarn::default_attention_factor(1.0, None, None), 1.0);
        assert_eq!(
            Yarn::default_attention_factor(0.5, Some(2.0), Some(1.0)),
            1.0
        );
    }

    #[test]
    fn table_rows_are_cosines_then_sines_times_the_attention_factor() {
        let y = yarn(4.0, 16);
        let s = RopeScaling::Yarn(y);
        let table = cos_sin_table(8, 10_000.0, &s, 3);
        assert_eq!(table.len(), 3 * 8);
        let f = s.inv_freq(8, 10_000.0);
        let a = y.attention_factor;
        for (i, &fi) in f.iter().enumerate() {
            assert_eq!(table[2 * 8 + i], ((2.0 * fi).cos() * a) as f32);
            assert_eq!(table[2 * 8 + 4 + i], ((2.0 * fi).sin() * a) as f32);
        }
        // Position 0: cos is the attention factor itself, sin zero.
        assert_eq!(&table[..4], &[a as f32; 4]);
        assert_eq!(&table[4..8], &[0.0; 4]);
    }

    #[test]
    fn scaled_context_lengths_follow_vllm() {
        assert_eq!(RopeScaling::None.max_positions(32768), 32768);
        assert_eq!(
            RopeScaling::Linear { factor: 2.5 }.max_positions(4096),
            10240
        );
        assert_eq!(
            RopeScaling::Yarn(yarn(4.0, 32768)).max_positions(32768),
            131072
        );
        // YaRN counts from the original context, not max_position_embeddings.
        assert_eq!(RopeScaling::Yarn(yarn(4.0, 16)).max_positions(32768), 64);
    }
}
