//! A generation request as one object that owns its `n` completions.
//!
//! Completion 0 runs alone until its prompt is computed; the others wait here, then each
//! samples its first token from a copy of completion 0's last prompt logits and forks its KV
//! (`novainfer_core::Fork`), so the prompt is computed once. The group knows every completion's
//! id, so aborting or failing the request reaches all of them, started or not, and it is gone
//! once the last one has ended.

use std::time::Instant;

use novainfer_core::{Request, RequestId};
use novainfer_model::sampler::Sampler;
use novainfer_structured::Constraint;

/// A completion whose request the scheduler does not have yet.
pub struct PendingCompletion {
    pub request: Request,
    pub sampler: Sampler,
    pub constraint: Option<Constraint>,
}

/// A completion the scheduler runs: its own sampler (own seeded RNG and penalty state) and
/// grammar, for its whole life, across preemptions.
pub struct Completion {
    /// The request it belongs to (completion 0's id).
    pub group: RequestId,
    pub sampler: Sampler,
    /// The grammar state, when its output is constrained.
    pub constraint: Option<Constraint>,
    /// When the scheduler first gave the request a chunk (queue time ends, prefill starts).
    pub scheduled_at: Option<Instant>,
}

impl PendingCompletion {
    /// The completion started, in request `group`.
    pub fn start(self, group: RequestId, scheduled_at: Option<Instant>) -> (Request, Completion) {
        let completion = Completion {
            group,
            sampler: self.sampler,
            constraint: self.constraint,
            scheduled_at,
        };
        (self.request, completion)
    }
}

pub struct RequestGroup {
    /// Every completion's id, in `index` order (completion 0 first).
    ids: Vec<RequestId>,
    /// Completions 1.. until completion 0's prompt is computed.
    pending: Vec<PendingCompletion>,
    /// Completions not ended yet (pending ones included).
    live: usize,
}

impl RequestGroup {
    /// Completion 0 (running) and the rest (`pending`).
    pub fn new(first: RequestId, pending: Vec<PendingCompletion>) -> Self {
        let ids: Vec<RequestId> = std::iter::once(first)
            .chain(pending.iter().map(|p| p.request.id))
            .collect();
        Self {
            live: ids.len(),
            ids,
            pending,
        }
    }

    /// The request's id (completion 0's).
    pub fn id(&self) -> RequestId {
        self.ids[0]
    }

    pub fn completion_ids(&self) -> &[RequestId] {
        &self.ids
    }

    /// The completions still waiting for completion 0's prompt, to start now.
    /// Whether completions still wait for completion 0's first row.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn take_pending(&mut self) -> Vec<PendingCompletion> {
        std::mem::take(&mut self.pending)
    }

    /// Ends the completions still waiting (their request ended before they started); their ids.
    pub fn end_pending(&mut self) -> Vec<RequestId> {
        let ids: Vec<RequestId> = self.pending.drain(..).map(|p| p.request.id).collect();
        self.live -= ids.len();
        ids
    }

    /// One started completion ended; true when none is left.
    pub fn completion_ended(&mut self) -> bool {
        self.live = self.live.saturating_sub(1);
        self.live == 0
    }

    pub fn is_done(&self) -> bool {
        self.live == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use novainfer_core::SamplingParams;

    fn pending(id: u64) -> PendingCompletion {
        let params = SamplingParams::builder().build().expect("valid");
        PendingCompletion {
            request: Request::new(RequestId(id), vec![1, 2], 4),
            sampler: Sampler::new(&params, &[1, 2], id),
            constraint: None,
        }
    }

    #[test]
    fn a_group_lives_until_every_completion_has_ended() {
        let mut g = RequestGroup::new(RequestId(7), vec![pending(8), pending(9)]);
        assert_eq!(g.id(), RequestId(7));
        assert_eq!(
            g.completion_ids(),
            &[RequestId(7), RequestId(8), RequestId(9)]
        );
        let started = g.take_pending();
        assert_eq!(started.len(), 2);
        assert!(g.end_pending().is_empty());
        assert!(!g.completion_ended());
        assert!(!g.completion_ended());
        assert!(g.completion_ended());
        assert!(g.is_done());
    }

    #[test]
    fn ending_the_request_early_ends_the_waiting_completions() {
        let mut g = RequestGroup::new(RequestId(1), vec![pending(2), pending(3)]);
        assert_eq!(g.end_pending(), vec![RequestId(2), RequestId(3)]);
        assert!(g.completion_ended(), "completion 0 was the last one left");
    }
}
