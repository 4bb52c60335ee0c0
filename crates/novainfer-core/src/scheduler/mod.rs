//! Continuous batching on the one-counter model (vLLM v1).
//!
//! Each step fills a token budget. Running requests go first: those decoding (one token
//! to compute) before those still computing their prompt, so a long prefill never takes a
//! decode's budget; each gets `min(uncomputed tokens, budget left,
//! long_prefill_token_threshold)` new tokens, so decodes and unfinished prefill chunks share
//! one path. If a decoding request cannot get blocks, the last running request (the newest,
//! or under the priority policy the worst-ranked) is preempted (recompute: blocks freed,
//! counter back to 0, output kept, back to the waiting queue) until it fits; if it is itself
//! the last, it waits. A prefill chunk preempts only requests after it that are not yet
//! scheduled this step, and only when they free enough blocks; the first running request
//! may also take from requests scheduled this step (they are taken out of the step), so it
//! always progresses. Then waiting requests are admitted in the policy's order (see
//! [`policy`]) after a prefix lookup, while budget, seq slots and blocks last; the first one
//! that does not fit stops admission, so nobody is overtaken (no starvation), with one
//! exception: with `max_long_partial_prefills` reached, a long prompt lets shorter ones
//! behind it in (it goes first once a long slot frees).
//!
//! Speculative decoding: a decoding request may carry draft tokens ([`Scheduler::set_draft`]);
//! once every running request has had its turn, its decode is extended with the drafts into one
//! chunk ([`ChunkOutput::Verify`]), as far as the budget left, free blocks (a draft never
//! preempts anyone), `max_tokens` and `max_model_len` allow. `update` takes the confirmed
//! drafts and one sampled token and rolls the counter back over the rest, so the KV of
//! rejected drafts is never published (their slots are overwritten by the next step).
//!
//! Prefill-only requests ([`RequestKind::Embed`], [`RequestKind::ScorePrompt`]) are requests
//! like the others (chunked, inside the KV budget, preemptible) that finish once their
//! prompt is computed. A scored prompt needs a logits row per token, so the tokens being
//! scored in one step are capped (`max_scored_tokens_per_step`), and it never takes a prefix
//! hit (a cached position would have no row).
//!
//! Progress: `SchedulerConfig` guarantees one `max_model_len` request fits the pool
//! alone, so the first running request can always grow.
//!
//! KV layouts: the scheduler talks to its KV through [`KvManager`]; the config's
//! `kv_layout` picks BLOCK ([`KvCacheManager`], prefix caching) or SLOT
//! ([`SlotKvManager`](crate::slot_kv_manager::SlotKvManager), one cell per token).
//! Everything above is layout-blind.
//!
//! Protocol: call [`Scheduler::schedule`], run the model, then [`Scheduler::update`]
//! with that output before the next `schedule`: counters advance in `update`. The step after
//! may also be scheduled before that update ([`Scheduler::schedule_ahead`], see
//! `scheduler/ahead.rs`), so the host schedules while the device runs.

mod ahead;
mod config;
mod fork;
mod output;
pub mod policy;

use std::collections::{HashMap, VecDeque};

pub use ahead::{ScheduledAhead, PENDING_TOKEN};
pub use config::{SchedulerConfig, SchedulerConfigBuilder};
pub use fork::Fork;
pub use output::{ChunkOutput, FinishedRequest, RequestUpdate, ScheduledRequest, SchedulerOutput};
pub use policy::SchedulingPolicy;

use crate::finish::FinishReason;
use crate::ids::{AdapterId, RequestId};
use crate::kv_cache_manager::{BlockCopy, KvCacheManager, KvCacheStats, PrefixHit};
use crate::kv_manager::{AnyKv, KvLayout};
use crate::request::{Request, RequestKind, RequestStatus};
use crate::slot_kv_manager::SlotKvManager;
use policy::{priority_key, RunningAdapters, Seats};

#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: AnyKv,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    finished_since_last_step: Vec<FinishedRequest>,
    next_arrival_seq: u64,
    /// Steps scheduled so far: the clock of priority aging.
    num_steps: u64,
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
            num_steps: 0,
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
    /// Waiting requests per priority value, lowest value first.
    pub fn num_waiting_by_priority(&self) -> Vec<(i32, usize)> {
        let mut counts = std::collections::BTreeMap::new();
        for id in &self.waiting {
            *counts.entry(self.requests[id].priority).or_insert(0) += 1;
        }
        counts.into_iter().collect()
    }
    /// The waiting queue, front (next to admit) first.
    pub fn waiting_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().copied()
    }
    /// Running requests, oldest admission first (the newest is preempted first).
    pub fn running_ids(&self) -> &[RequestId] {
        &self.running
    }
    /// The distinct LoRA adapters of the running requests and of the waiting ones (an
    /// adapter in both is listed in both), each in no particular order.
    pub fn adapters_in_use(&self) -> (Vec<AdapterId>, Vec<AdapterId>) {
        let distinct = |ids: &mut dyn Iterator<Item = &RequestId>| {
            let mut out: Vec<AdapterId> = Vec::new();
            for a in ids.filter_map(|id| self.requests.get(id).and_then(|r| r.adapter)) {
                if !out.contains(&a) {
                    out.push(a);
                }
            }
            out
        };
        (
            distinct(&mut self.running.iter()),
            distinct(&mut self.waiting.iter()),
        )
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

    /// Starts recording KV-cache events (see [`crate::kv_events`]).
    pub fn enable_kv_events(&mut self) {
        self.kv.enable_kv_events();
    }

    /// The KV-cache events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        self.kv.take_kv_events()
    }

    /// Makes running request `id`'s table cover its first `num_positions` positions, with free
    /// blocks only (this never preempts), for a proposer that writes its own KV in the
    /// request's blocks ahead of the target's (a draft model's drafts, at the positions the
    /// next step verifies): the steps after find the blocks held and take them as they would
    /// have allocated them. False, with nothing changed, if `id` is not running, the
    /// positions pass `max_model_len`, or the pool is short.
    pub fn reserve_slots(&mut self, id: RequestId, num_positions: usize) -> bool {
        let Some(request) = self.requests.get(&id) else {
            return false;
        };
        if request.status() != RequestStatus::Running || num_positions > self.config.max_model_len()
        {
            return false;
        }
        let num_new = num_positions.saturating_sub(request.num_computed_tokens);
        self.kv
            .as_dyn_mut()
            .allocate_slots(request, num_new, &PrefixHit::none())
            .is_some()
    }

    /// Proposes `draft` to follow running request `id`'s next token in the next step (the
    /// next `schedule` consumes or drops it). False, and nothing kept, unless `id` is a
    /// generation decoding after its first output token.
    pub fn set_draft(&mut self, id: RequestId, draft: Vec<u32>) -> bool {
        let Some(request) = self.requests.get_mut(&id) else {
            return false;
        };
        // Not before the first output token: that one is sampled from the prompt alone (and
        // the `n > 1` completions fork from it).
        let decoding = request.status() == RequestStatus::Running
            && request.kind == RequestKind::Generate
            && !request.output_token_ids.is_empty()
            && request.num_uncomputed_tokens() == 1;
        if decoding {
            request.draft_token_ids = draft;
        }
        decoding
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
        request.arrival_step = self.num_steps;
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
        let complete = self.schedule_into(Room::MayPreempt, &mut out);
        debug_assert!(complete, "a step that may preempt always completes");
        out
    }

    /// The body of a step: running requests first, then admissions. With [`Room::FreeOnly`]
    /// nothing is preempted, and false (with `out` to be dropped) means a running request found
    /// no room without preempting: there is no step ahead.
    fn schedule_into(&mut self, room: Room, out: &mut SchedulerOutput) -> bool {
        let mut budget = StepBudget {
            tokens: self.config.max_num_batched_tokens(),
            scored_tokens: self.config.max_scored_tokens_per_step(),
        };
        if self.config.policy() == SchedulingPolicy::Priority {
            self.order_by_priority();
        }
        self.num_steps += 1;
        if !self.schedule_running(room, &mut budget, out) {
            return false;
        }
        // A preemption means the pool is tight: admitting now would only thrash.
        if out.preempted.is_empty() {
            self.schedule_waiting(&mut budget, out);
        }
        // Drafts are for this step only.
        for id in &self.running {
            if let Some(r) = self.requests.get_mut(id) {
                r.draft_token_ids.clear();
            }
        }
        true
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
            let start = request.num_computed_tokens;
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
                let drafts = s.draft_token_ids();
                assert!(
                    !tokens.is_empty()
                        && tokens.len() <= drafts.len() + 1
                        && tokens[..tokens.len() - 1] == drafts[..tokens.len() - 1],
                    "update: {} got {tokens:?} for draft {drafts:?}: this is a bug",
                    s.request_id
                );
                for &token in tokens.iter() {
                    request.output_token_ids.push(token);
                    update.new_token_ids.push(token);
                    update.finish_reason = request.stop_reason(max_model_len);
                    if update.finish_reason.is_some() {
                        break;
                    }
                }
                if s.output == ChunkOutput::Verify {
                    // Computed: the decoded token and the drafts confirmed before the last
                    // appended token; the rejected drafts' KV is left to be overwritten.
                    request.num_computed_tokens = start + update.new_token_ids.len();
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

    /// Sorts both queues by (aged priority, arrival): the running order is then the order in
    /// which requests get the budget and, from the back, are preempted.
    fn order_by_priority(&mut self) {
        let aging = self.config.priority_aging_steps() as u64;
        let requests = &self.requests;
        let key = |id: &RequestId| priority_key(&requests[id], aging);
        self.running.sort_by_key(key);
        self.waiting.make_contiguous().sort_by_key(key);
    }

    /// False: with [`Room::FreeOnly`], a running request found no room (see `schedule_into`).
    fn schedule_running(
        &mut self,
        room: Room,
        budget: &mut StepBudget,
        out: &mut SchedulerOutput,
    ) -> bool {
        if !self.schedule_running_pass(true, room, budget, out)
            || !self.schedule_running_pass(false, room, budget, out)
        {
            return false;
        }
        self.schedule_drafts(budget, out);
        true
    }

    /// Extends this step's decodes with their drafts, in running order, from the budget every
    /// running request has had its turn at, and only into free blocks (a draft never preempts
    /// anyone): speculation takes nothing from anyone.
    fn schedule_drafts(&mut self, budget: &mut StepBudget, out: &mut SchedulerOutput) {
        for i in 0..out.scheduled.len() {
            let s = &out.scheduled[i];
            let id = s.request_id;
            let Some(request) = self.requests.get_mut(&id) else {
                continue;
            };
            let mut draft = std::mem::take(&mut request.draft_token_ids);
            let is_decode = s.output == ChunkOutput::Sample && s.token_ids.len() == 1;
            if !is_decode || draft.is_empty() {
                continue;
            }
            draft.truncate(self.draft_room(&self.requests[&id], budget));
            if draft.is_empty() || !self.try_allocate(id, 1 + draft.len()) {
                continue;
            }
            budget.take(RequestKind::Generate, draft.len());
            out.num_batched_tokens += draft.len();
            let s = &mut out.scheduled[i];
            s.token_ids.extend_from_slice(&draft);
            s.output = ChunkOutput::Verify;
            s.block_table = self.kv.as_dyn().block_table(id).to_vec();
        }
    }

    /// One pass over the running requests, in admission order: the decoding ones, or the
    /// ones still computing their prompt. False: with [`Room::FreeOnly`], one found no room.
    fn schedule_running_pass(
        &mut self,
        decoding: bool,
        room: Room,
        budget: &mut StepBudget,
        out: &mut SchedulerOutput,
    ) -> bool {
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
            let fits = match room {
                Room::FreeOnly => self.try_allocate(id, num_new),
                Room::MayPreempt if decoding => self.allocate_or_preempt(id, num_new, out),
                Room::MayPreempt => self.allocate_or_preempt_later(id, num_new, budget, out),
            };
            if !fits {
                if room == Room::FreeOnly {
                    return false; // no step ahead: it would have to preempt
                }
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
        true
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
        // The common decode step: nothing to admit, so no seat count (a map) to build.
        if self.waiting.is_empty() {
            return;
        }
        let mut partial = self.partial_prefills();
        let mut seats = Seats::of(self.running.iter().map(|id| &self.requests[id]));
        let mut adapters = RunningAdapters::of(
            self.running.iter().map(|id| &self.requests[id]),
            self.config.max_loras(),
        );
        // Long prompts held back by `max_long_partial_prefills`: they keep their place in the
        // queue and let the ones behind them in.
        let mut held: Vec<RequestId> = Vec::new();
        while budget.tokens > 0 && self.running.len() < self.config.max_num_seqs() {
            let Some(at) = self.next_candidate(&seats, &held) else {
                break;
            };
            let id = self.waiting[at];
            let request = &self.requests[&id];
            if !adapters.admits(request.adapter) {
                held.push(id); // its adapter has no room; requests on running ones may go
                continue;
            }
            let hit = match request.kind {
                RequestKind::ScorePrompt => PrefixHit::none(),
                _ => self.kv.as_dyn().lookup_prefix(request),
            };
            let num_uncomputed = request.num_tokens() - hit.num_tokens;
            let num_new = self.chunk_len(request, num_uncomputed, budget);
            if num_new == 0 {
                break; // no scoring rows left this step; nobody overtakes it
            }
            let left = num_uncomputed - num_new;
            if !self.within_partial_limits(request, left, partial) {
                let long_held = self.is_long(request)
                    && self
                        .config
                        .max_num_partial_prefills()
                        .is_none_or(|max| partial.0 < max);
                if long_held {
                    held.push(id); // a short prompt behind it may go first
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
                break; // later requests do not overtake this one
            }
            if left > 0 {
                partial.0 += 1;
                partial.1 += usize::from(self.is_long(request));
            }
            seats.take(request.tenant);
            adapters.take(request.adapter);
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

    /// Index in `waiting` of the request to admit next: the first in queue order of the
    /// tenant with the fewest running seats per unit of weight (the queue order among equals);
    /// `held` ones are passed over.
    fn next_candidate(&self, seats: &Seats, held: &[RequestId]) -> Option<usize> {
        let mut best: Option<(usize, crate::request::Tenant)> = None;
        for (i, id) in self.waiting.iter().enumerate() {
            if held.contains(id) {
                continue;
            }
            let tenant = self.requests[id].tenant;
            match best {
                Some((_, b)) if !seats.fewer(tenant, b) => {}
                _ => best = Some((i, tenant)),
            }
        }
        best.map(|(i, _)| i)
    }

    /// Like [`Self::allocate_or_preempt`] for a prefill chunk, with victims only among the
    /// requests after `id` in the running order (the last first), never `id` itself, and
    /// only if they would free enough blocks (else nobody loses progress for nothing). The
    /// first running request may take requests already scheduled this step out of it; any
    /// other only takes requests not scheduled yet. False: no room this step.
    fn allocate_or_preempt_later(
        &mut self,
        id: RequestId,
        num_new: usize,
        budget: &mut StepBudget,
        out: &mut SchedulerOutput,
    ) -> bool {
        if self.try_allocate(id, num_new) {
            return true;
        }
        let Some(me) = self.running.iter().position(|r| *r == id) else {
            return false;
        };
        let scheduled = |r: &RequestId| out.scheduled.iter().any(|s| s.request_id == *r);
        let candidates: Vec<RequestId> = self.running[me + 1..]
            .iter()
            .rev()
            .filter(|r| me == 0 || !scheduled(r))
            .copied()
            .collect();
        let Some(victims) = self.victims_making_room(id, num_new, &candidates) else {
            return false;
        };
        for victim in victims {
            if let Some(i) = out.scheduled.iter().position(|s| s.request_id == victim) {
                let s = out.scheduled.remove(i);
                out.num_batched_tokens -= s.token_ids.len();
                budget.give_back(self.requests[&victim].kind, s.token_ids.len());
            }
            self.running.retain(|r| *r != victim);
            self.preempt(victim);
            out.preempted.push(victim);
        }
        self.try_allocate(id, num_new)
    }

    /// The shortest prefix of `candidates` whose preemption frees enough blocks for
    /// `num_new` more tokens of `id`, counting only blocks no one else holds; `None` if even
    /// all of them would not.
    fn victims_making_room(
        &self,
        id: RequestId,
        num_new: usize,
        candidates: &[RequestId],
    ) -> Option<Vec<RequestId>> {
        let kv = self.kv.as_dyn();
        let request = &self.requests[&id];
        let held = kv.block_table(id).len();
        let needed = (request.num_computed_tokens + num_new)
            .div_ceil(kv.block_size())
            .saturating_sub(held);
        let mut available = kv.stats().num_free_blocks;
        let mut holders: HashMap<crate::ids::BlockId, u32> = HashMap::new();
        let mut victims = Vec::new();
        for &victim in candidates {
            if available >= needed {
                break;
            }
            victims.push(victim);
            for &block in kv.block_table(victim) {
                let n = holders.entry(block).or_default();
                *n += 1;
                if *n == kv.ref_count(block) {
                    available += 1;
                }
            }
        }
        (available >= needed).then_some(victims)
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

    /// Draft tokens a decode of `request` may verify this step: what the budget leaves after
    /// its own token (and the chunk cap), and no more than could be kept (`max_tokens`,
    /// `max_model_len`: one sampled token always follows the confirmed drafts).
    fn draft_room(&self, request: &Request, budget: &StepBudget) -> usize {
        let cap = self
            .config
            .long_prefill_token_threshold()
            .unwrap_or(usize::MAX);
        let by_budget = budget.tokens.min(cap).saturating_sub(1);
        let by_tokens = request
            .max_tokens
            .saturating_sub(request.output_token_ids.len() + 1);
        let by_len = self
            .config
            .max_model_len()
            .saturating_sub(request.num_tokens() + 1);
        by_budget.min(by_tokens).min(by_len)
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
            adapter: request.adapter,
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

/// Where a running request's blocks may come from this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Room {
    /// Free blocks, else other running requests' (preempted).
    MayPreempt,
    /// Free blocks only: a step scheduled ahead, while the step before it runs, cannot take
    /// back blocks that step is writing.
    FreeOnly,
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

    /// Undoes a `take` for a request taken back out of the step.
    fn give_back(&mut self, kind: RequestKind, num_tokens: usize) {
        self.tokens += num_tokens;
        if kind == RequestKind::ScorePrompt {
            self.scored_tokens += num_tokens;
        }
    }
}

#[cfg(test)]
mod tests;
