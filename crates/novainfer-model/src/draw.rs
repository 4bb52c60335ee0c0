//! Sampling on the device: what the engine asks a backend to draw for a row
//! ([`SpanOutput::Draw`](crate::SpanOutput::Draw)) and what comes back.
//!
//! A [`Draw`] maps onto the `draw` kernel's mode and parameters (`kernels/sampling.cu`,
//! launched by `novainfer_cuda::ops::sampling::draw`); [`Draw::on_host`] is the kernel's CPU
//! twin (`novainfer_cuda::reference::draw`), for tests and for a backend that honours draws
//! without the kernel.

use std::sync::Arc;

use novainfer_cuda::reference;
use novainfer_cuda::sample_params::{DrawMode, SampleParams};
pub use novainfer_cuda::sample_params::{RowEdit, RowPenalties, MAX_TOP_LOGPROBS};

use crate::error::{ModelError, Result};

/// Most [`RowEdit`]s one drawn row may carry (its device buffers are sized for this many per
/// row); a sampler with more (a long prompt under a repetition penalty) samples on the host.
pub const MAX_DEVICE_EDITS: usize = 2048;

/// What a drawn row changes before it is sampled: the engine sampler's penalties, logit bias
/// and `min_tokens` mask, one [`RowEdit`] per token they touch (at most
/// [`MAX_DEVICE_EDITS`]). The token's logprob stays that of the raw row.
#[derive(Debug, Clone, PartialEq)]
pub struct Adjust {
    pub penalties: RowPenalties,
    pub edits: Vec<RowEdit>,
}

/// How a device picks one sequence's next token ([`SpanOutput::Draw`]): the semantics of
/// `kernels/sampling.cu` (which follow the engine's sampler on a raw row: temperature, then
/// top-k, top-p, min-p, then one draw), with a counter-based generator keyed per sequence, so
/// a token depends on its own logits, seed and offset only, never on the rest of the batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    /// Generator key: the request's seed, or the engine's fallback for it.
    pub seed: u64,
    /// Generator counter: how many tokens this sequence sampled before.
    pub offset: u64,
    pub rule: DrawRule,
    /// Changes to the row before the draw, if any (shared: the engine builds it once a step).
    pub adjust: Option<Arc<Adjust>>,
    /// `Some(n)`: the token's rank in the raw row and the `n` (at most
    /// [`MAX_TOP_LOGPROBS`]) most likely tokens with their raw logprobs come back too.
    pub logprobs: Option<usize>,
    /// A grammar's mask of the next token: `⌈vocab / 32⌉` words, bit `i % 32` of word `i / 32`
    /// set when id `i` is allowed. The row is masked before anything else reads it, so the
    /// logprobs are the masked row's, as on the host.
    pub allowed: Option<Arc<[u32]>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DrawRule {
    /// The first id of the row's maximum (NaN counts as −inf); the generator is not used.
    Greedy,
    /// `temperature` at least the sampler's greedy threshold (1e-5); `top_k` `None` or ≥ 1;
    /// `top_p` in (0, 1]; `min_p` in [0, 1].
    Random {
        temperature: f32,
        top_k: Option<usize>,
        top_p: f32,
        min_p: f32,
    },
}

/// A token a device drew ([`SpanOutput::Draw`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DrawnToken {
    pub token_id: u32,
    /// `log_softmax(raw logits row)[token_id]`, as the engine's sampler reports it.
    pub logprob: f32,
    /// When the draw asked for logprobs: the token's rank in the raw row (how many ids have a
    /// logit at least its own); else 0.
    pub rank: u32,
    /// When the draw asked for `n`: the `n` most likely ids of the raw row with their
    /// logprobs, by logprob descending then id ascending.
    pub top_logprobs: Vec<(u32, f32)>,
}

impl Draw {
    /// The first id of the row's maximum, and nothing else asked (no edits, logprobs or mask).
    pub fn greedy() -> Self {
        Self {
            seed: 0,
            offset: 0,
            rule: DrawRule::Greedy,
            adjust: None,
            logprobs: None,
            allowed: None,
        }
    }

    /// The `draw` kernel's mode and parameters for this row; a value outside the kernel's
    /// ranges (an engine bug: the sampler validates requests) is an error naming it.
    pub fn kernel_args(&self) -> Result<(DrawMode, SampleParams)> {
        match self.rule {
            DrawRule::Greedy => Ok((DrawMode::Greedy, SampleParams::UNUSED)),
            DrawRule::Random {
                temperature,
                top_k,
                top_p,
                min_p,
            } => SampleParams::new(self.seed, self.offset, temperature, top_k, top_p, min_p)
                .map(|p| (DrawMode::Random, p))
                .map_err(|e| ModelError::config("draw", e.to_string())),
        }
    }

    /// This draw on one raw logits row, on the host, by the kernel's CPU twin.
    pub fn on_host(&self, row: &[f32]) -> Result<DrawnToken> {
        let (mode, params) = self.kernel_args()?;
        let masked;
        let row = match &self.allowed {
            Some(words) => {
                let mut copy = row.to_vec();
                reference::mask_row(&mut copy, words);
                masked = copy;
                &masked[..]
            }
            None => row,
        };
        let edits = self
            .adjust
            .as_deref()
            .map(|a| (&a.penalties, a.edits.as_slice()));
        let (token_id, logprob) = reference::draw(row, mode, &params, edits)
            .ok_or_else(|| ModelError::config("draw", "a drawn row was skipped"))?;
        let (rank, top_logprobs) = match self.logprobs {
            Some(n) => reference::top_logprobs(row, token_id, n),
            None => (0, Vec::new()),
        };
        Ok(DrawnToken {
            token_id,
            logprob,
            rank,
            top_logprobs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_random_draws_map_onto_the_kernel() {
        let row = [0.5, 2.0, -1.0, 2.0];
        let greedy = Draw {
            seed: 3,
            offset: 9,
            rule: DrawRule::Greedy,
            adjust: None,
            logprobs: None,
            allowed: None,
        };
        assert_eq!(greedy.kernel_args().expect("greedy").0, DrawMode::Greedy);
        assert_eq!(greedy.on_host(&row).expect("greedy").token_id, 1);
        let random = |offset| Draw {
            seed: 3,
            offset,
            rule: DrawRule::Random {
                temperature: 0.8,
                top_k: Some(2),
                top_p: 1.0,
                min_p: 0.0,
            },
            adjust: None,
            logprobs: None,
            allowed: None,
        };
        let (mode, params) = random(4).kernel_args().expect("random");
        assert_eq!(
            (mode, params.seed, params.offset, params.top_k),
            (DrawMode::Random, 3, 4, 2)
        );
        // Top-2 of the row keeps ids 1 and 3; the stream is the (seed, offset) one.
        let drawn: Vec<u32> = (0..64)
            .map(|o| random(o).on_host(&row).expect("draw").token_id)
            .collect();
        assert!(drawn.iter().all(|t| [1, 3].contains(t)));
        assert!(drawn.contains(&1) && drawn.contains(&3));
        assert_eq!(
            random(5).on_host(&row).expect("draw"),
            random(5).on_host(&row).expect("draw")
        );
    }

    #[test]
    fn an_out_of_range_rule_is_an_error_naming_the_draw() {
        let bad = Draw {
            seed: 0,
            offset: 0,
            rule: DrawRule::Random {
                temperature: 0.0,
                top_k: None,
                top_p: 1.0,
                min_p: 0.0,
            },
            adjust: None,
            logprobs: None,
            allowed: None,
        };
        let err = bad
            .kernel_args()
            .expect_err("temperature 0 is greedy, not a draw");
        assert!(err.to_string().contains("temperature"), "{err}");
    }
}
