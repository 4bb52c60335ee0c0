//! `logit_bias` and `min_tokens`, applied to the row after the penalties (as vLLM's logits
//! processors run after them) and undone afterwards, like the penalties, so logprobs stay raw.
//!
//! - `logit_bias`: `logit += bias` for each listed id (ids beyond the row are skipped: the
//!   engine refuses ids outside the tokenizer's vocabulary before a request runs);
//! - `min_tokens`: while fewer than `min_tokens` tokens have been sampled, the ids that would
//!   end the sequence (EOS unless `ignore_eos`, and `stop_token_ids`) are `-inf`. The mask is
//!   applied after the bias, so no bias can force an early EOS.

use novainfer_core::SamplingParams;

#[derive(Debug, Clone, Default)]
pub(crate) struct LogitAdjust {
    bias: Vec<(u32, f32)>,
    min_tokens: usize,
    /// Ids masked while `sampled < min_tokens`.
    stop_ids: Vec<u32>,
    sampled: usize,
    overwritten: Vec<(u32, f32)>,
}

impl LogitAdjust {
    pub fn new(params: &SamplingParams) -> Self {
        Self {
            bias: params.logit_bias().to_vec(),
            min_tokens: params.min_tokens(),
            stop_ids: params.stop().stop_token_ids.clone(),
            ..Self::default()
        }
    }

    /// Adds the model's EOS ids to what `min_tokens` holds back (unless EOS is ignored anyway).
    pub fn mask_eos(&mut self, eos_token_ids: &[u32], ignore_eos: bool) {
        if !ignore_eos {
            self.stop_ids.extend_from_slice(eos_token_ids);
        }
    }

    /// Changes `logits` in place; true when it touched any logit.
    pub fn apply(&mut self, logits: &mut [f32]) -> bool {
        self.overwritten.clear();
        for &(id, bias) in &self.bias {
            if let Some(x) = logits.get_mut(id as usize) {
                self.overwritten.push((id, *x));
                *x += bias;
            }
        }
        if self.sampled < self.min_tokens {
            for &id in &self.stop_ids {
                if let Some(x) = logits.get_mut(id as usize) {
                    self.overwritten.push((id, *x));
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        !self.overwritten.is_empty()
    }

    /// Puts back what the last [`apply`](Self::apply) changed (in reverse, so an id both
    /// biased and masked gets its value from before either) and counts the sampled token.
    /// Whether the row `ahead` tokens after the next would be changed: a bias, or stop ids
    /// still held back by `min_tokens` then.
    pub fn is_active_after(&self, ahead: usize) -> bool {
        !self.bias.is_empty()
            || (self.sampled + ahead < self.min_tokens && !self.stop_ids.is_empty())
    }

    /// The biases, and the ids the row `ahead` tokens after the next holds back (`min_tokens`
    /// not reached by then).
    pub fn pending_after(&self, ahead: usize) -> (&[(u32, f32)], &[u32]) {
        let masked = if self.sampled + ahead < self.min_tokens {
            &self.stop_ids[..]
        } else {
            &[]
        };
        (&self.bias, masked)
    }

    /// Counts a token sampled elsewhere (on the device) toward `min_tokens`.
    pub fn count_sampled(&mut self) {
        self.sampled += 1;
    }

    pub fn restore(&mut self, logits: &mut [f32]) {
        for &(id, x) in self.overwritten.iter().rev() {
            logits[id as usize] = x;
        }
        self.overwritten.clear();
        self.sampled += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(bias: Vec<(u32, f32)>, min_tokens: i64, stop_ids: Vec<u32>) -> SamplingParams {
        SamplingParams::builder()
            .logit_bias(bias)
            .min_tokens(min_tokens)
            .stop_token_ids(stop_ids)
            .build()
            .expect("valid")
    }

    #[test]
    fn bias_then_mask_until_min_tokens_then_restored() {
        let mut adjust =
            LogitAdjust::new(&params(vec![(1, 5.0), (3, 100.0), (99, 1.0)], 2, vec![2]));
        adjust.mask_eos(&[3], false);
        let raw = vec![0.5f32, 1.0, 2.0, 3.0];
        for step in 0..3 {
            let mut row = raw.clone();
            assert!(adjust.apply(&mut row));
            assert_eq!(row[0], 0.5);
            assert_eq!(row[1], 6.0);
            if step < 2 {
                assert_eq!(
                    row[2],
                    f32::NEG_INFINITY,
                    "stop token masked at step {step}"
                );
                assert_eq!(
                    row[3],
                    f32::NEG_INFINITY,
                    "a +100 bias does not beat the mask"
                );
            } else {
                assert_eq!((row[2], row[3]), (2.0, 103.0));
            }
            adjust.restore(&mut row);
            assert_eq!(row, raw);
        }
    }

    #[test]
    fn ignore_eos_leaves_eos_alone_and_nothing_set_touches_nothing() {
        let mut adjust = LogitAdjust::new(&params(vec![], 5, vec![]));
        adjust.mask_eos(&[0], true);
        let mut row = vec![1.0f32, 2.0];
        assert!(!adjust.apply(&mut row));
        assert_eq!(row, vec![1.0, 2.0]);
    }
}
