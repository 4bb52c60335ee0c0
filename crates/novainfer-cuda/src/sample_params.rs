//! Per-row sampling parameters as the sampling kernel reads them (`SampleParams` in
//! `kernels/sampling.cu`, 32 bytes, same field order). Always compiled: the CPU reference
//! sampler takes the same struct.

use crate::error::{CudaError, Result};

/// The CPU sampler's greedy threshold (vLLM's `_SAMPLING_EPS`): a row whose temperature is
/// below it samples greedily, so the runner sends it to `argmax`. Among other things this
/// keeps `1 / temperature` finite: a subnormal temperature would make it +inf and every
/// scaled logit ±inf or NaN.
pub const MIN_SAMPLING_TEMPERATURE: f32 = 1e-5;

/// Most top logprobs the `draw` kernel returns a row (`MAX_TOP_LOGPROBS` in the kernel; vLLM's
/// and the engine's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What the `draw` kernel does with one row (`DRAW_*` in `kernels/sampling.cu`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrawMode {
    /// A row the engine samples from its logits: the kernel leaves it alone.
    Skip = 0,
    /// The first index of the row's maximum.
    Greedy = 1,
    /// One draw under the row's [`SampleParams`].
    Random = 2,
}

/// One token's change before a drawn row is sampled (`RowEdit` in `kernels/sampling.cu`,
/// 16 bytes): the engine sampler's penalties, logit bias and `min_tokens` mask, in its order:
/// penalise (when [`RowEdit::PENALIZE`]), add `bias`, then `-inf` (when [`RowEdit::MASK`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowEdit {
    pub token_id: u32,
    /// Times the token was generated so far (frequency and presence penalties).
    pub output_count: u32,
    /// [`RowEdit::PENALIZE`] | [`RowEdit::IN_PROMPT`] | [`RowEdit::MASK`].
    pub flags: u32,
    /// Added after the penalties (0 for none).
    pub bias: f32,
}
const _: () = assert!(std::mem::size_of::<RowEdit>() == 16);

impl RowEdit {
    /// Apply the row's penalties to this token (it was in the prompt or the output).
    pub const PENALIZE: u32 = 1;
    /// The token is in the prompt (the repetition penalty counts it).
    pub const IN_PROMPT: u32 = 2;
    /// Held back (`min_tokens`): `-inf` after everything else.
    pub const MASK: u32 = 4;
}

/// The penalty strengths of one drawn row (`RowPenalties` in the kernel, 16 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowPenalties {
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
    pub _pad: f32,
}
const _: () = assert!(std::mem::size_of::<RowPenalties>() == 16);

impl RowPenalties {
    /// No penalty (repetition 1, frequency and presence 0).
    pub const NEUTRAL: Self = Self {
        repetition: 1.0,
        frequency: 0.0,
        presence: 0.0,
        _pad: 0.0,
    };

    /// The penalised value of `logit`, the engine sampler's rule and roundings (vLLM's:
    /// repetition divides a positive logit and multiplies a negative one; then frequency ×
    /// count is subtracted, then presence).
    pub fn penalize(&self, logit: f32, in_prompt: bool, output_count: u32) -> f32 {
        let mut x = logit;
        if in_prompt || output_count > 0 {
            x = if x > 0.0 {
                x / self.repetition
            } else {
                x * self.repetition
            };
        }
        if output_count > 0 {
            x -= self.frequency * output_count as f32;
            x -= self.presence;
        }
        x
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// Philox key: the request's seed (or the engine's per-request fallback).
    pub seed: u64,
    /// Philox counter: how many tokens this sequence has sampled before, so a sequence's
    /// draws are one reproducible stream whatever else is in the batch.
    pub offset: u64,
    pub inv_temperature: f32,
    /// `(0, 1]`; 1 turns top-p off.
    pub top_p: f32,
    /// `[0, 1]`; 0 turns min-p off.
    pub min_p: f32,
    /// `≤ 0` or `≥ vocab` turns top-k off.
    pub top_k: i32,
}
const _: () = assert!(std::mem::size_of::<SampleParams>() == 32);

impl SampleParams {
    /// Parameters of a row that is not drawn at random (greedy or skipped): valid values the
    /// kernel never reads.
    pub const UNUSED: Self = Self {
        seed: 0,
        offset: 0,
        inv_temperature: 1.0,
        top_p: 1.0,
        min_p: 0.0,
        top_k: 0,
    };

    /// Checks the ranges the kernel relies on: a finite temperature of at least
    /// [`MIN_SAMPLING_TEMPERATURE`] (below it the CPU samples greedily: use argmax), p in
    /// range.
    pub fn new(
        seed: u64,
        offset: u64,
        temperature: f32,
        top_k: Option<usize>,
        top_p: f32,
        min_p: f32,
    ) -> Result<Self> {
        if !(temperature.is_finite() && temperature >= MIN_SAMPLING_TEMPERATURE) {
            return Err(CudaError::invalid(
                "temperature",
                format!(
                    "{temperature} must be finite and >= {MIN_SAMPLING_TEMPERATURE} \
                     (rows below it are greedy: use argmax)"
                ),
            ));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(CudaError::invalid(
                "top_p",
                format!("{top_p} must lie in (0, 1]"),
            ));
        }
        if !(0.0..=1.0).contains(&min_p) {
            return Err(CudaError::invalid(
                "min_p",
                format!("{min_p} must lie in [0, 1]"),
            ));
        }
        let top_k = top_k.map_or(0, |k| i32::try_from(k).unwrap_or(i32::MAX));
        Ok(Self {
            seed,
            offset,
            inv_temperature: 1.0 / temperature,
            top_p,
            min_p,
            top_k,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_names_the_bad_parameter() {
        let err = |r: Result<SampleParams>| match r {
            Err(CudaError::InvalidArgument { param, .. }) => param,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        assert_eq!(
            err(SampleParams::new(1, 0, 0.0, None, 1.0, 0.0)),
            "temperature"
        );
        // Subnormal and tiny temperatures: greedy on the CPU, refused here (1/t overflows).
        for t in [
            f32::MIN_POSITIVE / 2.0,
            1e-30,
            9e-6,
            f32::NAN,
            f32::INFINITY,
            -1.0,
        ] {
            assert_eq!(
                err(SampleParams::new(1, 0, t, None, 1.0, 0.0)),
                "temperature",
                "{t}"
            );
        }
        let edge = SampleParams::new(1, 0, MIN_SAMPLING_TEMPERATURE, None, 1.0, 0.0).expect("edge");
        assert!(edge.inv_temperature.is_finite());
        assert_eq!(err(SampleParams::new(1, 0, 1.0, None, 0.0, 0.0)), "top_p");
        assert_eq!(err(SampleParams::new(1, 0, 1.0, None, 1.0, 1.5)), "min_p");
        let ok = SampleParams::new(7, 3, 0.5, Some(40), 0.9, 0.05).expect("valid");
        assert_eq!((ok.inv_temperature, ok.top_k), (2.0, 40));
    }
}
