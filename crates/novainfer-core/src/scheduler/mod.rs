//! Continuous batching on the one-counter model (vLLM v1).
//!
//! Each step fills a token budget. Running requests go first: those decoding (one token
//! to compute) before those still computing their prompt, so a long prefill never takes a
//! decode's budget; each gets `min(uncomputed tokens, budget left,
//! long_prefill_token_threshold)` new tokens, so decodes and unfinished prefill chunks share
//! one path. If a decoding request cannot get blocks, the newest running request is
//! preempted (recompute: blocks freed, counter back to 0, output kept, front of the waiting
//! queue) until it fits; if it is itself the newest, it waits. A prefill chunk only preempts
//! requests not yet scheduled this step, and otherwise waits for a later step. Then waiting
//! requests are admitted FCFS after a prefix lookup, while budget, seq slots and blocks last;
//! the first one that does not fit stops admission, so nobody is overtaken (no starvation),
//! with one exception: with `max_long_partial_prefills` reached, a long prompt at the head of
//! the queue lets shorter ones behind it in (it goes first once a long slot frees).
//!
//! Prefill-only requests ([`RequestKind::Embed`], [`RequestKind::ScorePrompt`]) are requests
//! like the others (chunked, inside the KV budget, preemptible) that finish once their
//! prompt is computed. A scored prompt needs a logits row per token, so the tokens being
//! scored in one step are capped (`max_scored_tokens_per_step`), and it never takes a prefix
//! hit (a cached position would have no row).
//!
//! Progress: `SchedulerConfig` guarantees one `max_model_len` request fits the pool
//! alone, so the oldest running request can always grow.
//!
//! KV layouts: the scheduler talks to its KV through [`KvManager`]; the config's
//! `kv_layout` picks BLOCK ([`KvCacheManager`], prefix caching) or SLOT
//! ([`SlotKvManager`](crate::slot_kv_manager::SlotKvManager), one cell per token).
//! Everything above is layout-blind.
//!
//! Protocol: call [`Scheduler::schedule`], run the model, then [`Scheduler::update`]
//! with that output before the next `schedule`: counters advance in `update`.

mod config;
mod fork;
mod output;

use std::collections::{HashMap, VecDeque};

pub use config::{SchedulerConfig, SchedulerConfigBuilder};
pub use fork::Fork;
pub use output::{ChunkOutput, FinishedRequest, RequestUpdate, ScheduledRequest, SchedulerOutput};

use crate::finish::FinishReason;
use crate::ids::RequestId;
use crate::kv_cache_manager::{BlockCopy, KvCacheManager, KvCacheStats, PrefixHit};
use crate::kv_manager::{AnyKv, KvLayout};
use crate::request::{Request, RequestKind, RequestStatus};
use crate::slot_kv_manager::SlotKvManager;

#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: AnyKv,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    finished_since_last_step: Vec<FinishedRequest>,
    next_arrival_seq: u64,
    num_preemptions: u64,
    /// Copies asked for by forks since the last step; the next output carries them.
    pending_copies: Vec<BlockCopy>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        let kv = match config.kv_layout() {
            KvLayout::Block => AnyKv::Block(KvCacheManager::new(
                config.num_blocks(),
                config.block_size(),
                config.enable_prefix_caching(),
            )),
            // At most `max_num_seqs` requests run, and only running ones hold KV.
            KvLayout::Slot => AnyKv::Slot(SlotKvManager::new(
                config.num_blocks(),
                config.max_num_seqs(),
            )),
        };
        Self {
            config,
            kv,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished_since_last_step: Vec::new(),
            next_arrival_seq: 0,
            num_preemptions: 0,
            pending_copies: Vec::new(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }
    /// The KV bookkeeping of the configured layout.
    pub fn kv(&self) -> &AnyKv {
        &self.kv
    }
    pub fn kv_stats(&self) -> KvCacheStats {
        self.kv.as_dyn().stats()
    }
    /// An unfinished request (finished ones are handed back and forgotten).
    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// The waiting queue, front (next to admit) first.
    pub fn waiting_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().copied()
    }
    /// Running requests, oldest admission first (the newest is preempted first).
    pub fn running_ids(&self) -> &[RequestId] {
        &self.running
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }
    /// True while any request is queued, running, or finished but not yet reported.
    pub fn has_work(&self) -> bool {
        !self.requests.is_empty() || !self.finished_since_last_step.is_empty()
    }
    /// Forgets every cached prefix; refused (false) while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.as_dyn_mut().reset_prefix_cache()
    }

    /// Queues a new request, or finishes it as `Ignored` (reported by the next
    /// `schedule`) if its prompt can never fit. Panics on a duplicate id (a bug).
    pub fn add_request(&mut self, mut request: Request) {
        assert!(
            !self.requests.contains_key(&request.id),
            "add_request: duplicate {}: this is a bug",
            request.id
        );
        request.arrival_seq = self.next_arrival_seq;
        self.next_arrival_seq += 1;
        if let Some(detail) = self.why_never_fits(&request) {
            request.finish(FinishReason::Ignored);
            self.finished_since_last_step.push(FinishedRequest {
                request_id: request.id,
                reason: FinishReason::Ignored,
                detail: Some(detail),
            });
            return;
        }
        self.waiting.push_back(request.id);
        self.requests.insert(request.id, request);
    }

    /// Finishes a queued or running request as `Abort`, freeing its blocks now.
    pub fn abort_request(&mut self, id: RequestId) -> bool {
        self.finish_request(id, FinishReason::Abort)
    }

    /// Finishes a request for a reason found outside the scheduler (a stop string).
    /// False if it is unknown or already finished.
    pub fn finish_request(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let Some(mut request) = self.requests.remove(&id) else {
            return false;
        };
        if let Some(i) = self.running.iter().position(|&r| r == id) {
            self.running.remove(i);
        } else if let Some(i) = self.waiting.iter().position(|&r| r == id) {
            self.waiting.remove(i);
        }
        self.kv.as_dyn_mut().free(id);
        request.finish(reason);
        self.finished_since_last_step.push(FinishedRequest {
            request_id: id,
            reason,
            detail: None,
        });
        true
    }

    /// Picks this step's requests and token counts and allocates their blocks.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput {
            finished: std::mem::take(&mut self.finished_since_last_step),
            block_copies: std::mem::take(&mut self.pending_copies),
            ..SchedulerOutput::default()
        };
        let mut budget = StepBudget {
            tokens: self.config.max_num_batched_tokens(),
            scored_tokens: self.config.max_scored_tokens_per_step(),
        };
        self.schedule_running(&mut budget, &mut out);
        // A preemption means the pool is tight: admitting now would only thrash.
        if out.preempted.is_empty() {
            self.schedule_waiting(&mut budget, &mut out);
        }
        out
    }

    /// Applies one executed step: advances counters, appends `sampled` tokens to
    /// requests that were sampled, finishes those that hit a stop token or a length
    /// limit, and publishes newly computed full blocks to the prefix cache.
    pub fn update(
        &mut self,
        output: &SchedulerOutput,
        sampled: &[(RequestId, Vec<u32>)],
    ) -> Vec<RequestUpdate> {
        self.update_with_forks(output, sampled, Vec::new())
    }

    /// [`update`](Self::update), then starts each fork right after its parent's
    /// update (before a finish of the parent frees the KV the fork shares). A
    /// child's update follows its parent's in the returned list.
    pub fn update_with_forks(
        &mut self,
        output: &SchedulerOutput,
        sampled: &[(RequestId, Vec<u32>)],
        mut forks: Vec<Fork>,
    ) -> Vec<RequestUpdate> {
        let mut queue_pos = 0;
        let sampled: HashMap<RequestId, &[u32]> =
            sampled.iter().map(|(id, t)| (*id, t.as_slice())).collect();
        let max_model_len = self.config.max_model_len();
        let mut updates = Vec::with_capacity(output.scheduled.len());
        for s in &output.scheduled {
            // Aborted or stopped by the engine since `schedule`: nothing to update.
            let Some(request) = self.requests.get_mut(&s.request_id) else {
                continue;
            };
            request.num_computed_tokens += s.token_ids.len();
            let prefill_only = request.kind.is_prefill_only();
            let mut update = RequestUpdate {
                request_id: s.request_id,
                new_token_ids: Vec::new(),
                finish_reason: None,
                num_cached_tokens: request.num_cached_tokens,
            };
            if s.sample() {
                let tokens = sampled.get(&s.request_id).unwrap_or_else(|| {
                    panic!(
                        "update: {} was to be sampled but got no token: this is a bug",
                        s.request_id
                    )
                });
                for &token in tokens.iter() {
                    request.output_token_ids.push(token);
                    update.new_token_ids.push(token);
                    update.finish_reason = request.stop_reason(max_model_len);
                    if update.finish_reason.is_some() {
                        break;
                    }
                }
            } else if prefill_only {
                update.finish_reason = request.stop_reason(max_model_len);
            }
            // Publish before a finish frees the blocks: the prefix stays reusable.
            self.kv.as_dyn_mut().cache_full_blocks(request);
            let finish = update.finish_reason;
            updates.push(update);
            if s.sample() && !forks.is_empty() {
                let (mine, rest): (Vec<Fork>, Vec<Fork>) =
                    forks.into_iter().partition(|f| f.parent == s.request_id);
                forks = rest;
                for fork in mine {
                    updates.push(self.start_fork(fork, &mut queue_pos));
                }
            }
            if let Some(reason) = finish {
                self.finish_request(s.request_id, reason);
            }
        }
        for fork in forks {
            self.drop_fork(fork);
        }
        updates
    }

    fn schedule_running(&mut self, budget: &mut StepBudget, out: &mut SchedulerOutput) {
        self.schedule_running_pass(true, budget, out);
        self.schedule_running_pass(false, budget, out);
    }

    /// One pass over the running requests, in admission order: the decoding ones, or the
    /// ones still computing their prompt.
    fn schedule_running_pass(
        &mut self,
        decoding: bool,
        budget: &mut StepBudget,
        out: &mut SchedulerOutput,
    ) {
        let mut i = 0;
        while i < self.running.len() && budget.tokens > 0 {
            let id = self.running[i];
            let request = &self.requests[&id];
            if self.is_decoding(request) != decoding {
                i += 1;
                continue;
            }
            let num_new = self.chunk_len(request, request.num_uncomputed_tokens(), budget);
            if num_new == 0 {
                i += 1;
                continue;
            }
            let fits = if decoding {
                self.allocate_or_preempt(id, num_new, out)
            } else {
                self.allocate_or_preempt_unscheduled(id, num_new, out)
            };
            if !fits {
                if decoding {
                    break; // it was the newest running request: nothing after it
                }
                i += 1; // this chunk waits; decodes will free blocks
                continue;
            }
            self.push_scheduled(id, num_new, false, out);
            budget.take(self.requests[&id].kind, num_new);
            i += 1;
        }
    }

    /// A running request with one token to compute: a decode (or a prompt's last token).
    fn is_decoding(&self, request: &Request) -> bool {
        request.num_uncomputed_tokens() <= 1
    }

    /// Whether `request`'s prompt counts as long for the partial-prefill limits.
    fn is_long(&self, request: &Request) -> bool {
        self.config
            .long_prefill_token_threshold()
            .is_some_and(|t| request.num_tokens() > t)
    }

    /// Running requests still computing their prompt: (all, long ones).
    fn partial_prefills(&self) -> (usize, usize) {
        let mut counts = (0, 0);
        for request in self.running.iter().map(|id| &self.requests[id]) {
            if !self.is_decoding(request) {
                counts.0 += 1;
                counts.1 += usize::from(self.is_long(request));
            }
        }
        counts
    }

    /// Whether admitting `request` (whose first chunk leaves `left` tokens to compute) stays
    /// within the partial-prefill limits, given `partial` (all, long) already running.
    fn within_partial_limits(
        &self,
        request: &Request,
        left: usize,
        partial: (usize, usize),
    ) -> bool {
        if left == 0 {
            return true; // its whole prompt runs this step: not a partial prefill
        }
        let all_ok = self
            .config
            .max_num_partial_prefills()
            .is_none_or(|max| partial.0 < max);
        let long_ok = !self.is_long(request)
            || self
                .config
                .max_long_partial_prefills()
                .is_none_or(|max| partial.1 < max);
        all_ok && long_ok
    }

    fn schedule_waiting(&mut self, budget: &mut StepBudget, out: &mut SchedulerOutput) {
        let mut partial = self.partial_prefills();
        // Index into `waiting` of the next candidate: past the long prompts held back by
        // `max_long_partial_prefills`, which keep their place at the front.
        let mut at = 0;
        while let Some(&id) = self.waiting.get(at) {
            if budget.tokens == 0 || self.running.len() >= self.config.max_num_seqs() {
                break;
            }
            let request = &self.requests[&id];
            let hit = match request.kind {
                RequestKind::ScorePrompt => PrefixHit::none(),
                _ => self.kv.as_dyn().lookup_prefix(request),
            };
            let num_uncomputed = request.num_tokens() - hit.num_tokens;
            let num_new = self.chunk_len(request, num_uncomputed, budget);
            if num_new == 0 {
                break; // no scoring rows left this step; FCFS: nobody overtakes it
            }
            let left = num_uncomputed - num_new;
            if !self.within_partial_limits(request, left, partial) {
                let long_held = self.is_long(request)
                    && self
                        .config
                        .max_num_partial_prefills()
                        .is_none_or(|max| partial.0 < max);
                if long_held {
                    at += 1; // a short prompt behind it may go first
                    continue;
                }
                break;
            }
            if self
                .kv
                .as_dyn_mut()
                .allocate_slots(request, num_new, &hit)
                .is_none()
            {
                break; // FCFS: later requests do not overtake this one
            }
            if left > 0 {
                partial.0 += 1;
                partial.1 += usize::from(self.is_long(request));
            }
            self.waiting.remove(at);
            let request = self
                .requests
                .get_mut(&id)
                .expect("waiting request without state: this is a bug");
            let resumed = request.status() == RequestStatus::Preempted;
            request.num_computed_tokens = hit.num_tokens;
            if !resumed {
                request.num_cached_tokens = hit.num_tokens;
            }
            request.start_running();
            self.running.push(id);
            self.push_scheduled(id, num_new, resumed, out);
            budget.take(self.requests[&id].kind, num_new);
        }
    }

    /// Like [`Self::allocate_or_preempt`] for a prefill chunk: only requests not scheduled in
    /// this step may be preempted (the newest such first), never `id` itself. False: no room
    /// this step.
    fn allocate_or_preempt_unscheduled(
        &mut self,
        id: RequestId,
        num_new: usize,
        out: &mut SchedulerOutput,
    ) -> bool {
        loop {
            if self.try_allocate(id, num_new) {
                return true;
            }
            let scheduled = |r: &RequestId| out.scheduled.iter().any(|s| s.request_id == *r);
            let Some(pos) = self.running.iter().rposition(|r| *r != id && !scheduled(r)) else {
                return false;
            };
            // Only newer requests: an older one keeps its blocks (progress for the oldest).
            let me = self.running.iter().position(|r| *r == id).unwrap_or(0);
            if pos < me {
                return false;
            }
            let victim = self.running.remove(pos);
            self.preempt(victim);
            out.preempted.push(victim);
        }
    }

    /// Room for `num_new` more tokens of running request `id`, if the pool has it now.
    fn try_allocate(&mut self, id: RequestId, num_new: usize) -> bool {
        self.kv
            .as_dyn_mut()
            .allocate_slots(&self.requests[&id], num_new, &PrefixHit::none())
            .is_some()
    }

    /// Allocates for running request `id`, preempting the newest running requests
    /// until it fits. False if `id` itself had to be preempted.
    fn allocate_or_preempt(
        &mut self,
        id: RequestId,
        num_new: usize,
        out: &mut SchedulerOutput,
    ) -> bool {
        loop {
            if self.try_allocate(id, num_new) {
                return true;
            }
            let victim = self
                .running
                .pop()
                .expect("a running request is missing from `running`: this is a bug");
            self.preempt(victim);
            out.preempted.push(victim);
            if victim == id {
                return false;
            }
        }
    }

    fn preempt(&mut self, id: RequestId) {
        self.kv.as_dyn_mut().free(id);
        self.requests
            .get_mut(&id)
            .expect("preempting an unknown request: this is a bug")
            .preempt();
        self.waiting.push_front(id);
        self.num_preemptions += 1;
    }

    fn chunk_len(&self, request: &Request, num_uncomputed: usize, budget: &StepBudget) -> usize {
        let cap = self
            .config
            .long_prefill_token_threshold()
            .unwrap_or(usize::MAX);
        let n = num_uncomputed.min(budget.tokens).min(cap);
        match request.kind {
            RequestKind::ScorePrompt => n.min(budget.scored_tokens),
            _ => n,
        }
    }

    fn push_scheduled(
        &self,
        id: RequestId,
        num_new: usize,
        resumed: bool,
        out: &mut SchedulerOutput,
    ) {
        let request = &self.requests[&id];
        let start = request.num_computed_tokens;
        let reaches_end = start + num_new == request.num_tokens();
        let output = match request.kind {
            RequestKind::Generate if reaches_end => ChunkOutput::Sample,
            RequestKind::Embed if reaches_end => ChunkOutput::Hidden,
            RequestKind::ScorePrompt => ChunkOutput::PromptLogits,
            RequestKind::Generate | RequestKind::Embed => ChunkOutput::Nothing,
        };
        out.scheduled.push(ScheduledRequest {
            request_id: id,
            token_ids: request.token_ids(start..start + num_new),
            start_position: start,
            block_table: self.kv.as_dyn().block_table(id).to_vec(),
            output,
            is_resumed_from_preemption: resumed,
        });
        out.num_batched_tokens += num_new;
    }

    /// Why `request` could never be scheduled, if so. The pool needs no check of
    /// its own: the config guarantees a `max_model_len` request fits it.
    fn why_never_fits(&self, request: &Request) -> Option<String> {
        let num_prompt = request.num_prompt_tokens();
        let max_model_len = self.config.max_model_len();
        if num_prompt == 0 {
            return Some("the prompt is empty".to_owned());
        }
        if request.kind.is_prefill_only() {
            return (num_prompt > max_model_len).then(|| {
                format!(
                    "the input has {num_prompt} tokens, more than max_model_len={max_model_len}"
                )
            });
        }
        if num_prompt + 1 > max_model_len {
            return Some(format!(
                "the prompt has {num_prompt} tokens; with one output token that exceeds \
                 max_model_len={max_model_len}"
            ));
        }
        None
    }
}

/// What is left of one step's budgets while it is being filled.
struct StepBudget {
    tokens: usize,
    scored_tokens: usize,
}

impl StepBudget {
    fn take(&mut self, kind: RequestKind, num_tokens: usize) {
        self.tokens -= num_tokens;
        if kind == RequestKind::ScorePrompt {
            self.scored_tokens -= num_tokens;
        }
    }
}

#[cfg(test)]
mod tests;
