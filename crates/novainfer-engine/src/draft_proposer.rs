//! Drafts from a draft model ([`DraftModel`]), sized by [`DraftPolicy`]: what the model's
//! passes, rows and catch-up (the tokens of a request it has yet to read) were measured to
//! cost, against each request's acceptance.

use std::time::Instant;

use novainfer_core::RequestId;
use novainfer_model::Qwen2Config;

use crate::draft_model::DraftModel;
use crate::draft_policy::{Decoding, DraftPolicy};
use crate::proposer::{held, Proposer, Running};

pub struct DraftModelProposer {
    model: DraftModel,
    policy: DraftPolicy,
}

impl DraftModelProposer {
    /// `policy` must know the draft model's cost share ([`draft_cost_share`]).
    pub fn new(model: DraftModel, policy: DraftPolicy) -> Self {
        Self { model, policy }
    }
}

impl Proposer for DraftModelProposer {
    fn propose(
        &mut self,
        running: &mut dyn Running,
        ids: &[RequestId],
        room: usize,
    ) -> Vec<Vec<u32>> {
        let requests = held(running, ids);
        let decoding: Vec<Decoding> = requests
            .iter()
            .map(|(_, r)| Decoding::new(r, self.model.catch_up(r)))
            .collect();
        let lengths = self.policy.plan(&decoding, room);
        let mut drafts = vec![Vec::new(); ids.len()];
        if lengths.iter().all(|&k| k == 0) {
            return drafts;
        }
        let wants: Vec<(RequestId, usize)> =
            requests.iter().map(|&(_, r)| r.id).zip(lengths).collect();
        let places: Vec<usize> = requests.iter().map(|&(i, _)| i).collect();
        let started = Instant::now();
        match self.model.propose(running, &wants) {
            Ok((proposed, work)) => {
                self.policy
                    .observe_draft(work, started.elapsed().as_secs_f64());
                for (i, draft) in places.into_iter().zip(proposed) {
                    drafts[i] = draft;
                }
            }
            Err(e) => tracing::warn!(error = %e, "the draft model failed; no drafts this step"),
        }
        drafts
    }

    fn record(&mut self, id: RequestId, drafted: usize, accepted: usize) {
        self.policy.record(id, drafted, accepted);
    }

    fn observe_step(&mut self, rows: usize, seconds: f64) {
        self.policy.observe_step(rows, seconds);
    }

    fn retain(&mut self, alive: &mut dyn FnMut(RequestId) -> bool) {
        self.policy.retain(&mut *alive);
        self.model.retain(alive);
    }

    fn preempted(&mut self, id: RequestId) {
        self.model.forget(id);
    }
}

/// Weights a token's forward pass reads (its matrix multiplications: attention, MLP, logits),
/// which on a CPU or a GPU alike set most of what a decode row or a prefill token costs.
fn weights_per_token(c: &Qwen2Config) -> f64 {
    let (h, kv) = (
        c.hidden_size as f64,
        (c.head_dim() * c.num_key_value_heads) as f64,
    );
    let layer = h * (h + 2.0 * kv) + h * h + 3.0 * h * c.intermediate_size as f64;
    c.num_hidden_layers as f64 * layer + c.vocab_size as f64 * h
}

/// What the draft model is assumed to cost relative to the target until measured.
pub fn draft_cost_share(draft: &Qwen2Config, target: &Qwen2Config) -> f64 {
    (weights_per_token(draft) / weights_per_token(target).max(1.0)).clamp(0.01, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(hidden_size: usize, num_hidden_layers: usize) -> Qwen2Config {
        Qwen2Config {
            vocab_size: 1000,
            hidden_size,
            intermediate_size: 4 * hidden_size,
            num_hidden_layers,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 64,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    #[test]
    fn a_draft_model_is_assumed_to_cost_its_share_of_the_weights_read() {
        let target = model(256, 8);
        assert_eq!(draft_cost_share(&target, &target), 1.0);
        // Half the layers and half the width: about an eighth of the layer weights.
        let share = draft_cost_share(&model(128, 4), &target);
        assert!((0.1..0.2).contains(&share), "{share}");
        // Never free, never dearer than the target.
        assert_eq!(draft_cost_share(&model(4, 1), &target), 0.01);
        assert_eq!(draft_cost_share(&model(512, 16), &target), 1.0);
    }
}
