//! Repetition, presence and frequency penalties with vLLM's semantics, kept incrementally.
//!
//! - repetition (`r`): every token seen in the prompt OR the output so far, once:
//!   `logit > 0 → logit / r`, otherwise `logit · r`;
//! - presence (`p`): every token seen in the OUTPUT, once: `logit - p`;
//! - frequency (`f`): every token seen in the OUTPUT: `logit - f · count`.
//!
//! Invariant: `seen` holds exactly the distinct prompt and output ids, with the output count
//! of each, so one step costs O(distinct ids), never a rescan of the history.
//! [`PenaltyState::apply`] remembers the values it overwrote so that
//! [`PenaltyState::restore`] can give the caller its raw row back (raw logprobs need it).

use std::collections::HashMap;

use novainfer_core::SamplingParams;
use novainfer_cuda::sample_params::RowPenalties;

/// What the penalties need to know about one token id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Seen {
    in_prompt: bool,
    output_count: u32,
}

/// The three penalty strengths; all neutral means the state records nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Penalties {
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
}

impl Penalties {
    pub fn from_params(params: &SamplingParams) -> Self {
        Self {
            repetition: params.repetition_penalty(),
            presence: params.presence_penalty(),
            frequency: params.frequency_penalty(),
        }
    }

    fn is_neutral(&self) -> bool {
        self.repetition == 1.0 && self.presence == 0.0 && self.frequency == 0.0
    }

    /// The penalised value of one logit. The rule reads in one place, shared with the
    /// device's sampler and its twin ([`RowPenalties::penalize`]).
    pub fn penalize(&self, logit: f32, in_prompt: bool, output_count: u32) -> f32 {
        self.for_device().penalize(logit, in_prompt, output_count)
    }

    /// These strengths as the device's sampler takes them.
    pub fn for_device(&self) -> RowPenalties {
        RowPenalties {
            repetition: self.repetition,
            frequency: self.frequency,
            presence: self.presence,
            _pad: 0.0,
        }
    }
}

/// Per-sequence penalty history plus the scratch list of overwritten logits.
#[derive(Debug, Clone)]
pub(crate) struct PenaltyState {
    penalties: Penalties,
    seen: HashMap<u32, Seen>,
    overwritten: Vec<(u32, f32)>,
}

impl PenaltyState {
    pub fn new(penalties: Penalties, prompt_ids: &[u32]) -> Self {
        let mut seen = HashMap::new();
        // Only the repetition penalty looks at the prompt.
        if penalties.repetition != 1.0 {
            for &id in prompt_ids {
                seen.entry(id).or_insert(Seen::default()).in_prompt = true;
            }
        }
        Self {
            penalties,
            seen,
            overwritten: Vec::new(),
        }
    }

    /// Whether any penalty changes a row (a neutral state records and changes nothing).
    pub fn is_active(&self) -> bool {
        !self.penalties.is_neutral()
    }

    /// The strengths, and each token they touch: `(id, in the prompt, times generated)`.
    pub fn touched(&self) -> (Penalties, impl Iterator<Item = (u32, bool, u32)> + '_) {
        (
            self.penalties,
            self.seen
                .iter()
                .map(|(&id, s)| (id, s.in_prompt, s.output_count)),
        )
    }

    /// Notes a generated token for the penalties of later steps.
    pub fn record(&mut self, token_id: u32) {
        if !self.penalties.is_neutral() {
            self.seen.entry(token_id).or_default().output_count += 1;
        }
    }

    /// Penalises `logits` in place. Returns true when it touched some logit (the row maximum
    /// may then have moved). Ids beyond the row (a prompt token the model cannot emit) are
    /// skipped.
    pub fn apply(&mut self, logits: &mut [f32]) -> bool {
        self.overwritten.clear();
        if self.penalties.is_neutral() {
            return false;
        }
        for (&id, seen) in &self.seen {
            if let Some(x) = logits.get_mut(id as usize) {
                self.overwritten.push((id, *x));
                *x = self
                    .penalties
                    .penalize(*x, seen.in_prompt, seen.output_count);
            }
        }
        !self.overwritten.is_empty()
    }

    /// Puts back the values the last [`apply`](Self::apply) overwrote.
    pub fn restore(&mut self, logits: &mut [f32]) {
        for &(id, x) in &self.overwritten {
            logits[id as usize] = x;
        }
        self.overwritten.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(repetition: f32, presence: f32, frequency: f32, prompt: &[u32]) -> PenaltyState {
        PenaltyState::new(
            Penalties {
                repetition,
                presence,
                frequency,
            },
            prompt,
        )
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_over_prompt_and_output() {
        let mut s = state(2.0, 0.0, 0.0, &[0, 1, 1]);
        s.record(3);
        let mut logits = [4.0, -3.0, 5.0, 0.5, -1.0];
        assert!(s.apply(&mut logits));
        // 0: prompt, positive → /2; 1: prompt (twice, penalised once), negative → ×2;
        // 2: unseen; 3: output, positive → /2; 4: unseen.
        assert_eq!(logits, [2.0, -6.0, 5.0, 0.25, -1.0]);
        s.restore(&mut logits);
        assert_eq!(logits, [4.0, -3.0, 5.0, 0.5, -1.0]);
    }

    #[test]
    fn presence_and_frequency_count_output_only() {
        let mut s = state(1.0, 0.5, 0.25, &[0, 2]);
        for id in [2, 2, 2, 3] {
            s.record(id);
        }
        let mut logits = [1.0, 1.0, 1.0, 1.0];
        s.apply(&mut logits);
        // 0: prompt only → untouched; 2: 1 - 0.5 - 3·0.25; 3: 1 - 0.5 - 0.25.
        assert_eq!(logits, [1.0, 1.0, -0.25, 0.25]);
    }

    #[test]
    fn all_three_compose_in_vllm_order() {
        let mut s = state(1.5, 1.0, -0.5, &[1]);
        s.record(0);
        s.record(0);
        let mut logits = [3.0, -2.0, 7.0];
        s.apply(&mut logits);
        // 0: 3/1.5 = 2, - 1 (presence), - (-0.5·2) = 2; 1: -2·1.5 = -3 (prompt only).
        assert_eq!(logits, [2.0, -3.0, 7.0]);
    }

    #[test]
    fn neutral_penalties_record_nothing_and_out_of_range_ids_are_skipped() {
        let mut neutral = state(1.0, 0.0, 0.0, &[0, 1]);
        neutral.record(1);
        let mut logits = [1.0, 2.0];
        assert!(!neutral.apply(&mut logits));
        assert!(neutral.seen.is_empty());
        let mut s = state(2.0, 0.0, 0.0, &[1, 99]);
        assert!(s.apply(&mut logits));
        assert_eq!(logits, [1.0, 1.0]);
    }
}
