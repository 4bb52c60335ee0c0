//! One request's token history and lifecycle, as the scheduler sees it.
//!
//! One counter, no phases (vLLM v1): `num_computed_tokens` catches up to
//! `num_tokens()`. Prefill, chunked prefill, decode, a prefix hit and a resume
//! after preemption are all just "compute the tokens from `num_computed_tokens` on".
//!
//! Lifecycle (any other transition is a bug and panics):
//! ```text
//!   Waiting ──start_running──► Running ──preempt──► Preempted ──start_running──► Running
//!      │                          │                     │
//!      └──────────── finish ──────┴──────── finish ─────┴──► Finished(reason)
//! ```

use std::num::NonZeroU32;

use crate::finish::FinishReason;
use crate::ids::{AdapterId, RequestId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Blocks freed; back in the waiting queue to be recomputed from token 0.
    Preempted,
    Finished(FinishReason),
}

/// What a request asks of the model: tokens to generate, or only its prompt computed.
///
/// A prefill-only request is scheduled like any other (chunked, inside the KV budget,
/// preemptible, abortable) and finishes once its prompt is computed; it never samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestKind {
    #[default]
    Generate,
    /// The last prompt token's final hidden state (an embedding).
    Embed,
    /// Next-token logits at every prompt position (scoring a text). Never served from
    /// the prefix cache: a cached position would have no logits.
    ScorePrompt,
}

impl RequestKind {
    pub fn is_prefill_only(self) -> bool {
        self != RequestKind::Generate
    }
}

/// Whose share of the engine a request uses: requests of different tenants share seats in
/// proportion to their weights (see the scheduler's fair share).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tenant {
    pub id: u64,
    pub weight: NonZeroU32,
}

impl Default for Tenant {
    /// The one tenant of an engine that does not tell requests apart.
    fn default() -> Self {
        Self {
            id: 0,
            weight: NonZeroU32::MIN,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub output_token_ids: Vec<u32>,
    /// Tokens whose KV is in this request's blocks (computed or prefix hits).
    pub num_computed_tokens: usize,
    /// Prompt tokens served by the prefix cache at first admission (for usage).
    pub num_cached_tokens: usize,
    /// Resolved limit on generated tokens (≥ 1).
    pub max_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Admission order; set by the scheduler.
    pub arrival_seq: u64,
    /// The scheduler step the request arrived in (its age, for priority aging); set by the
    /// scheduler.
    pub arrival_step: u64,
    /// Under the priority policy, lower runs first (vLLM's `priority`); ignored under FCFS.
    pub priority: i32,
    pub tenant: Tenant,
    pub kind: RequestKind,
    /// The LoRA adapter the request runs with (`None`: the base model). Part of its blocks'
    /// prefix-cache keys, and counted against the scheduler's `max_loras`.
    pub adapter: Option<AdapterId>,
    /// Tokens proposed for the next step (speculative decoding): verified together with the
    /// next decode. Set through [`crate::Scheduler::set_draft`]; each `schedule` consumes them.
    pub draft_token_ids: Vec<u32>,
    status: RequestStatus,
}

impl Request {
    /// A waiting request with no EOS or stop tokens; add those with the `with_*` methods.
    pub fn new(id: RequestId, prompt_token_ids: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            id,
            prompt_token_ids,
            output_token_ids: Vec::new(),
            num_computed_tokens: 0,
            num_cached_tokens: 0,
            max_tokens: max_tokens.max(1),
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            arrival_seq: 0,
            arrival_step: 0,
            priority: 0,
            tenant: Tenant::default(),
            kind: RequestKind::Generate,
            adapter: None,
            draft_token_ids: Vec::new(),
            status: RequestStatus::Waiting,
        }
    }
    /// A request that only computes `prompt_token_ids` (see [`RequestKind`]).
    pub fn prefill_only(id: RequestId, prompt_token_ids: Vec<u32>, kind: RequestKind) -> Self {
        Self {
            kind,
            ..Self::new(id, prompt_token_ids, 1)
        }
    }
    pub fn with_eos_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.eos_token_ids = ids;
        self
    }
    pub fn with_stop_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_token_ids = ids;
        self
    }
    pub fn with_ignore_eos(mut self, ignore_eos: bool) -> Self {
        self.ignore_eos = ignore_eos;
        self
    }
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
    pub fn with_tenant(mut self, tenant: Tenant) -> Self {
        self.tenant = tenant;
        self
    }
    pub fn with_adapter(mut self, adapter: Option<AdapterId>) -> Self {
        self.adapter = adapter;
        self
    }

    /// The extra keys of this request's prefix-cache hashes: its adapter, if any, so that
    /// KV computed under one adapter is never served to another (or to the base model).
    pub fn cache_keys(&self) -> &[u64] {
        match &self.adapter {
            Some(AdapterId(id)) => std::slice::from_ref(id),
            None => &[],
        }
    }

    pub fn status(&self) -> RequestStatus {
        self.status
    }
    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }
    pub fn num_prompt_tokens(&self) -> usize {
        self.prompt_token_ids.len()
    }
    pub fn num_tokens(&self) -> usize {
        self.prompt_token_ids.len() + self.output_token_ids.len()
    }
    /// Tokens still to compute before the next sample.
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.num_tokens() - self.num_computed_tokens
    }

    /// Token `i` of prompt ++ output.
    pub fn token_id(&self, i: usize) -> u32 {
        let p = self.prompt_token_ids.len();
        if i < p {
            self.prompt_token_ids[i]
        } else {
            self.output_token_ids[i - p]
        }
    }

    /// Tokens `range` of prompt ++ output, copied.
    pub fn token_ids(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        let p = self.prompt_token_ids.len();
        let mut out = Vec::with_capacity(range.len());
        if range.start < p {
            out.extend_from_slice(&self.prompt_token_ids[range.start..range.end.min(p)]);
        }
        if range.end > p {
            out.extend_from_slice(&self.output_token_ids[range.start.max(p) - p..range.end - p]);
        }
        out
    }

    /// `Waiting | Preempted → Running`.
    pub fn start_running(&mut self) {
        match self.status {
            RequestStatus::Waiting | RequestStatus::Preempted => {
                self.status = RequestStatus::Running
            }
            s => panic!(
                "request {}: start_running from {s:?}: this is a bug",
                self.id
            ),
        }
    }

    /// `Running → Preempted`; everything computed is forgotten (recompute), the
    /// output so far is kept and becomes part of what is recomputed.
    pub fn preempt(&mut self) {
        assert_eq!(
            self.status,
            RequestStatus::Running,
            "request {}: preempt when not running: this is a bug",
            self.id
        );
        self.status = RequestStatus::Preempted;
        self.num_computed_tokens = 0;
        self.draft_token_ids.clear();
    }

    /// Any unfinished state → `Finished(reason)`.
    pub fn finish(&mut self, reason: FinishReason) {
        assert!(
            !self.is_finished(),
            "request {}: finished twice: this is a bug",
            self.id
        );
        self.status = RequestStatus::Finished(reason);
    }

    /// Why the newest output token ends the request, if it does; for a prefill-only
    /// request, `Stop` once its prompt is computed.
    pub fn stop_reason(&self, max_model_len: usize) -> Option<FinishReason> {
        if self.kind.is_prefill_only() {
            return (self.num_computed_tokens >= self.num_prompt_tokens())
                .then_some(FinishReason::Stop);
        }
        let last = *self.output_token_ids.last()?;
        if !self.ignore_eos && self.eos_token_ids.contains(&last) {
            return Some(FinishReason::Stop);
        }
        if self.stop_token_ids.contains(&last) {
            return Some(FinishReason::Stop);
        }
        if self.output_token_ids.len() >= self.max_tokens || self.num_tokens() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_span_prompt_and_output() {
        let mut r = Request::new(RequestId(1), vec![1, 2, 3], 8);
        r.output_token_ids = vec![4, 5];
        assert_eq!(r.token_ids(0..5), vec![1, 2, 3, 4, 5]);
        assert_eq!(r.token_ids(2..4), vec![3, 4]);
        assert_eq!(r.token_ids(4..5), vec![5]);
        assert_eq!(r.token_id(3), 4);
        assert_eq!(r.num_tokens(), 5);
    }

    #[test]
    fn stop_reasons_in_priority_order() {
        let mut r = Request::new(RequestId(1), vec![1], 3)
            .with_eos_token_ids(vec![0])
            .with_stop_token_ids(vec![9]);
        r.output_token_ids = vec![5];
        assert_eq!(r.stop_reason(100), None);
        r.output_token_ids = vec![0];
        assert_eq!(r.stop_reason(100), Some(FinishReason::Stop));
        r.ignore_eos = true;
        assert_eq!(r.stop_reason(100), None);
        r.output_token_ids = vec![9];
        assert_eq!(r.stop_reason(100), Some(FinishReason::Stop));
        r.output_token_ids = vec![5, 5, 5];
        assert_eq!(r.stop_reason(100), Some(FinishReason::Length));
        r.output_token_ids = vec![5];
        assert_eq!(
            r.stop_reason(2),
            Some(FinishReason::Length),
            "max_model_len"
        );
    }

    #[test]
    fn preempt_resets_the_counter_and_keeps_output() {
        let mut r = Request::new(RequestId(1), vec![1, 2], 8);
        r.start_running();
        r.num_computed_tokens = 2;
        r.output_token_ids.push(7);
        r.preempt();
        assert_eq!(r.status(), RequestStatus::Preempted);
        assert_eq!((r.num_computed_tokens, r.num_tokens()), (0, 3));
        r.start_running();
        r.finish(FinishReason::Abort);
        assert!(r.is_finished());
    }

    #[test]
    #[should_panic(expected = "this is a bug")]
    fn preempting_a_waiting_request_is_a_bug() {
        Request::new(RequestId(1), vec![1], 1).preempt();
    }
}
