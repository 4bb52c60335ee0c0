//! `EngineCore`: continuous batching over one model. `step()` is
//! schedule → execute → update; requests join and leave between steps.
//!
//! Each request keeps its own sampler (own seeded RNG, own penalty state) for
//! the whole of its life, across preemptions, so what it produces never depends
//! on the other requests in the batch. Text (detokenization, stop strings) is the
//! output thread's job: the engine only sends it tokens ([`OutputEvent`]).
//!
//! `n > 1`: a request is one [`RequestGroup`] owning its completions; completion 0 runs
//! alone until its prompt is computed, then the others sample their first tokens from its
//! logits and fork its KV (see [`crate::request_group`]), so the prompt is computed once.
//!
//! Embeddings and scored prompts are prefill-only requests ([`crate::prefill`]) in the same
//! batches: their chunks return hidden states or every token's logits instead of a sample.
//!
//! Async scheduling (`async_scheduling`): a step is launched, then the step after it is
//! scheduled and launched behind it before the first one's output is read, its decodes chained
//! to the tokens the first one draws ([`Scheduler::schedule_ahead`], [`Chained`]); only then is
//! the first step's output read and applied. Each `step()` still applies exactly one step's
//! output, so streams see the same events in the same order. A request the first step ended
//! keeps its row in the step ahead: that token is computed and dropped.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use novainfer_core::{
    ChunkOutput, FinishReason, FinishedRequest, Fork, KvCacheStats, KvEventSink, Request,
    RequestId, ScheduledRequest, Scheduler, SchedulerOutput,
};
use novainfer_model::lora::AdapterId;
use novainfer_model::sampler::{SampledToken, Sampler};
use novainfer_model::AdapterRef;
use novainfer_model::{Draw, DrawnToken, ForwardOutput};

use crate::model_runner::DeviceDraws;
use novainfer_structured::Constraint;

use crate::checked::CheckedRequest;
use crate::draft_model::DraftModel;
use crate::engine::{Frontend, LoadedEngine};
use crate::error::{EngineError, Result};
use crate::host_draws::HostDraws;
use crate::model_runner::{Chained, LaunchId, ModelRunner, PendingForward};
use crate::output_processor::{DeltaSink, OutputEvent};
use crate::prefill::{PrefillJob, PrefillTask};
use crate::proposer::{share_room, Proposer};
use crate::request::{Scheduling, Speculation};
use crate::request_group::{Completion, PendingCompletion, RequestGroup};
use crate::sequence::SequenceOutput;
use crate::speculative::proposer;
use crate::verify::{
    advance_grammar, device_mask, sample_row_as_device, verify_draft, GrammarOutcomes,
};

/// What one step sampled, per request (one token, or with drafts the confirmed ones and the
/// next), and the completions it starts.
type Sampled = (Vec<(RequestId, Vec<SampledToken>)>, Vec<Fork>);

/// A step handed to the device: what was scheduled, the rows it draws itself, its output to
/// come (or why it could not start), and when it was launched.
struct Launched {
    id: LaunchId,
    out: SchedulerOutput,
    draws: DeviceDraws,
    output: Result<PendingForward>,
    at: Instant,
}

/// The step after a running one, scheduled while it runs: `inputs` are its pending chunks, each
/// with the index of the token the running step draws for it ([`Chained::inputs`]); `draws` the
/// rows the device draws.
struct Ahead {
    out: SchedulerOutput,
    inputs: Vec<(usize, usize)>,
    draws: DeviceDraws,
}

/// Counters a user can read (`llm.stats()`).
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Waiting requests per priority value, lowest value first.
    pub num_waiting_by_priority: Vec<(i32, usize)>,
    pub num_preemptions: u64,
    pub kv: KvCacheStats,
    /// Bytes of the KV pool, and of one of its blocks (cells in the SLOT layout); with a draft
    /// model both models' (a block holds the draft's KV too).
    pub kv_pool_bytes: usize,
    pub kv_bytes_per_block: usize,
    /// Weight bytes a decode step reads (`None` where the device does not say).
    pub weight_bytes_per_token: Option<usize>,
    /// Bytes the weights occupy on the device (`None` where the device does not say: the CPU).
    pub weight_bytes: Option<usize>,
    pub num_prompt_tokens_computed: u64,
    pub num_generated_tokens: u64,
    /// Speculative decoding: drafts verified (one per request per step), their tokens, and
    /// those confirmed.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub num_steps: u64,
    /// Steps launched ahead of the previous step's update (async scheduling).
    pub num_steps_ahead: u64,
    /// Time spent inside `step()`.
    pub busy_seconds: f64,
    /// Names of the LoRA adapters of the running and of the waiting requests.
    pub running_adapters: Vec<String>,
    pub waiting_adapters: Vec<String>,
}

pub struct EngineCore {
    runner: ModelRunner,
    scheduler: Scheduler,
    frontend: Frontend,
    /// Generation requests by id, each owning its completions.
    groups: HashMap<RequestId, RequestGroup>,
    /// Started completions by id.
    active: HashMap<RequestId, Completion>,
    /// To the output thread, which turns tokens into deltas: one message per step.
    outputs: mpsc::Sender<Vec<OutputEvent>>,
    /// Events of the current step, sent together so the output thread wakes once
    /// per step rather than per token (each wake-up on a 2-core machine preempts a
    /// compute thread mid-step).
    pending: Vec<OutputEvent>,
    seed: u64,
    stats: EngineStats,
    /// Embeddings and scored prompts in flight.
    prefills: HashMap<RequestId, PrefillJob>,
    grammar_outcomes: GrammarOutcomes,
    /// What this step's verifications confirmed, per request (for its usage).
    verified: Vec<(RequestId, Speculation)>,
    /// Drafts for speculative decoding, when on.
    proposer: Option<Box<dyn Proposer>>,
    /// Receives each step's KV-cache events, when someone asked for them.
    kv_events: Option<Arc<dyn KvEventSink>>,
    /// The LoRA adapters of the requests in the scheduler: held here so that a request runs
    /// to its end on the adapter it started with, even once the adapter's name is unloaded.
    adapters: HashMap<AdapterId, AdapterRef>,
    /// Schedule steps ahead ([`crate::EngineConfig::async_scheduling`]).
    async_scheduling: bool,
    /// A step launched ahead of the last one's update: the next `step()` applies it.
    ahead: Option<Launched>,
}

impl EngineCore {
    /// `outputs` goes to the output thread ([`crate::output_processor::run`]).
    pub fn new(loaded: LoadedEngine, outputs: mpsc::Sender<Vec<OutputEvent>>) -> Self {
        // A step ahead takes the tokens of the step before it on the device thread: a backend
        // that draws nothing itself gets its rows drawn there.
        let executor = if loaded.async_scheduling && !loaded.executor.capabilities().sampling.draws
        {
            Box::new(HostDraws::new(loaded.executor))
        } else {
            loaded.executor
        };
        let mut runner = ModelRunner::new(executor);
        runner.launch_steps_ahead(loaded.async_scheduling);
        let backend = runner.capabilities();
        let target = runner.config().clone();
        let draft = loaded.draft.as_ref();
        let stats = EngineStats {
            kv_pool_bytes: runner.kv_pool_bytes() + draft.map_or(0, DraftModel::kv_pool_bytes),
            kv_bytes_per_block: runner.kv_bytes_per_block()
                + draft.map_or(0, DraftModel::kv_bytes_per_block),
            weight_bytes_per_token: runner.weight_bytes_per_token(),
            weight_bytes: runner.weight_bytes(),
            ..EngineStats::default()
        };
        Self {
            prefills: HashMap::new(),
            runner,
            scheduler: Scheduler::new(loaded.scheduler),
            frontend: loaded.frontend,
            groups: HashMap::new(),
            active: HashMap::new(),
            outputs,
            pending: Vec::new(),
            seed: loaded.seed,
            stats,
            grammar_outcomes: GrammarOutcomes::default(),
            verified: Vec::new(),
            proposer: loaded
                .speculative
                .as_ref()
                .map(|config| proposer(config, loaded.draft, &backend, &target)),
            kv_events: None,
            adapters: HashMap::new(),
            async_scheduling: loaded.async_scheduling,
            ahead: None,
        }
    }

    /// Records KV-cache events from now on and hands each step's batch to `sink`.
    pub fn set_kv_event_sink(&mut self, sink: Arc<dyn KvEventSink>) {
        self.scheduler.enable_kv_events();
        self.kv_events = Some(sink);
    }

    /// Hands the events recorded since the last call to the sink, if any.
    fn publish_kv_events(&mut self) {
        if let Some(sink) = &self.kv_events {
            let events = self.scheduler.take_kv_events();
            if !events.is_empty() {
                sink.publish(events);
            }
        }
    }

    pub fn frontend(&self) -> &Frontend {
        &self.frontend
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
            || !self.active.is_empty()
            || !self.prefills.is_empty()
            || self.ahead.is_some()
    }

    fn emit(&mut self, event: OutputEvent) {
        self.pending.push(event);
    }

    /// Hands this step's events to the output thread.
    fn flush(&mut self) {
        if !self.pending.is_empty() {
            // The output thread outlives the engine loop; a failed send means shutdown.
            let _ = self.outputs.send(std::mem::take(&mut self.pending));
        }
    }

    /// Queues a request with ids `id .. id + n` (unique, reserved by the caller),
    /// one per completion; all their deltas go to `sink`. Its limits were checked when it
    /// was made ([`crate::Frontend::check_request`]): nothing here can refuse it.
    pub fn add_request(
        &mut self,
        id: RequestId,
        request: CheckedRequest,
        scheduling: Scheduling,
        sink: DeltaSink,
    ) {
        let (prompt_ids, params, max_tokens, grammar) = request.into_parts();
        let stop = params.stop();
        let eos = self.frontend.tokenizer().eos_token_ids().to_vec();
        let adapter = self.hold_adapter(scheduling.adapter.as_ref());
        let mut completions = (0..params.n()).map(|index| {
            let cid = RequestId(id.0 + index as u64);
            let completion = params.for_completion(index);
            self.emit(OutputEvent::Register {
                id: cid,
                index,
                output: Box::new(SequenceOutput::new(
                    self.frontend.tokenizer().clone(),
                    &completion,
                )),
                sink: sink.clone(),
            });
            let request = Request::new(cid, prompt_ids.clone(), max_tokens)
                .with_eos_token_ids(eos.clone())
                .with_stop_token_ids(stop.stop_token_ids.clone())
                .with_ignore_eos(stop.ignore_eos)
                .with_priority(scheduling.priority)
                .with_tenant(scheduling.tenant)
                .with_adapter(adapter);
            let sampler = Sampler::new(&completion, &prompt_ids, self.seed.wrapping_add(cid.0))
                .with_eos_token_ids(&eos, stop.ignore_eos);
            let constraint = grammar.as_ref().map(|g| Constraint::new(g.matcher()));
            PendingCompletion {
                request,
                sampler,
                constraint,
            }
        });
        let first = completions.next().expect("n >= 1 by validation");
        let group = RequestGroup::new(id, completions.collect());
        let (request, completion) = first.start(id, None);
        self.groups.insert(id, group);
        self.active.insert(id, completion);
        self.scheduler.add_request(request);
    }

    /// Queues a prefill-only request (an embedding or a scored prompt) with id `id`
    /// (unique, reserved by the caller); its result goes to the task's reply. The input must
    /// already be checked ([`crate::Frontend::check_input`]).
    pub fn add_prefill(
        &mut self,
        id: RequestId,
        prompt_ids: Vec<u32>,
        task: PrefillTask,
        adapter: Option<AdapterRef>,
    ) {
        let kind = task.kind();
        let vocab = self.runner.config().vocab_size;
        let adapter = self.hold_adapter(adapter.as_ref());
        self.prefills
            .insert(id, PrefillJob::new(prompt_ids.clone(), task, vocab));
        self.scheduler
            .add_request(Request::prefill_only(id, prompt_ids, kind).with_adapter(adapter));
    }

    /// Finishes request `id` (every completion of a generation request, or a prefill-only
    /// request) now and frees its blocks; streams end with `abort`. Unknown or finished ids
    /// are skipped.
    pub fn abort(&mut self, id: RequestId) {
        match self.groups.get(&id) {
            // Waiting completions end when completion 0's abort is reported.
            Some(group) => {
                for &cid in group.completion_ids() {
                    self.scheduler.abort_request(cid);
                }
            }
            None => {
                self.scheduler.abort_request(id);
            }
        }
    }

    /// Completion `id` ended: it leaves its group, and the group goes with its last one.
    fn end_completion(&mut self, id: RequestId) -> Option<Completion> {
        let completion = self.active.remove(&id)?;
        if let Some(group) = self.groups.get_mut(&completion.group) {
            if group.completion_ended() {
                self.groups.remove(&completion.group);
            }
        }
        Some(completion)
    }

    /// Completion `id` ended before its request produced anything: it and the completions
    /// still waiting for it end; their ids.
    fn end_with_waiting(&mut self, id: RequestId) -> Vec<RequestId> {
        let Some(completion) = self.active.get(&id) else {
            return Vec::new();
        };
        let mut ids = vec![id];
        if let Some(group) = self.groups.get_mut(&completion.group) {
            ids.extend(group.end_pending());
        }
        self.end_completion(id);
        ids
    }

    /// Finishes a request for a reason found by the output thread (a stop string).
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) {
        self.scheduler.finish_request(id, reason);
    }

    pub fn stats(&self) -> EngineStats {
        let (running, waiting) = self.scheduler.adapters_in_use();
        EngineStats {
            num_running: self.scheduler.num_running(),
            num_waiting: self.scheduler.num_waiting(),
            num_waiting_by_priority: self.scheduler.num_waiting_by_priority(),
            num_preemptions: self.scheduler.num_preemptions(),
            kv: self.scheduler.kv_stats(),
            running_adapters: self.adapter_names(running),
            waiting_adapters: self.adapter_names(waiting),
            ..self.stats.clone()
        }
    }

    fn adapter_names(&self, ids: Vec<AdapterId>) -> Vec<String> {
        let mut names: Vec<String> = ids
            .iter()
            .filter_map(|id| self.adapters.get(id))
            .map(|a| a.name().to_owned())
            .collect();
        names.sort();
        names
    }

    /// Holds `adapter` for a request about to enter the scheduler; its id.
    fn hold_adapter(&mut self, adapter: Option<&AdapterRef>) -> Option<AdapterId> {
        let a = adapter?;
        self.adapters.entry(a.id()).or_insert_with(|| a.clone());
        Some(a.id())
    }

    /// Lets go of the adapters no request in the scheduler uses any more.
    fn release_adapters(&mut self) {
        if self.adapters.is_empty() {
            return;
        }
        let (running, waiting) = self.scheduler.adapters_in_use();
        self.adapters
            .retain(|id, _| running.contains(id) || waiting.contains(id));
    }

    /// Frees cached blocks no request uses; false while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let reset = self.scheduler.reset_prefix_cache();
        self.publish_kv_events();
        reset
    }

    /// One engine step. A model error fails every request of the step (their
    /// streams get the error) and leaves the engine usable for the next ones.
    ///
    /// With async scheduling, the step after this one is scheduled and launched while this one
    /// runs, its decodes chained to the tokens this one draws (`schedule_ahead` below); the
    /// next call applies that one.
    pub fn step(&mut self) {
        let started = Instant::now();
        let launched = match self.ahead.take() {
            Some(launched) => Some(launched),
            None => self.schedule_and_launch(),
        };
        if let Some(Launched {
            id,
            out,
            draws,
            output,
            at,
        }) = launched
        {
            if self.async_scheduling && output.is_ok() {
                if let Some(Ahead { out, inputs, draws }) = self.schedule_ahead(&out, &draws) {
                    self.stats.num_steps_ahead += 1;
                    let chained = Chained { after: id, inputs };
                    self.ahead = Some(self.launch(out, draws, Some(chained)));
                }
            }
            let output = output.and_then(PendingForward::wait);
            match output.map(|output| self.collect(&out, &draws, output, at)) {
                Ok((sampled, forks)) => self.update(&out, sampled, forks),
                Err(e) => self.fail(&out, e),
            }
            self.propose_drafts();
            self.stats.num_steps += 1;
        }
        self.release_adapters();
        self.flush();
        self.publish_kv_events();
        self.stats.busy_seconds += started.elapsed().as_secs_f64();
    }

    /// Drafts the next step's tokens for every decoding request (speculative decoding).
    fn propose_drafts(&mut self) {
        let Some(proposer) = self.proposer.as_mut() else {
            return;
        };
        let scheduler = &self.scheduler;
        proposer.retain(&mut |id| scheduler.request(id).is_some());
        let ids: Vec<RequestId> = scheduler
            .running_ids()
            .iter()
            .filter(|&&id| {
                // The requests `set_draft` takes drafts for: decoding, after their first token.
                // One still recomputing its tokens after a preemption would refuse a draft, and
                // a draft model catching up with it would reserve blocks ahead of its chunks.
                scheduler.request(id).is_some_and(|r| {
                    !r.kind.is_prefill_only()
                        && !r.output_token_ids.is_empty()
                        && r.num_uncomputed_tokens() == 1
                })
            })
            .copied()
            .collect();
        let room = self
            .runner
            .capabilities()
            .verify_rows
            .saturating_sub(ids.len());
        if room == 0 {
            return;
        }
        let mut drafts = proposer.propose(&mut self.scheduler, &ids, room);
        // A constrained request verifies only what its grammar allows.
        for (id, draft) in ids.iter().zip(drafts.iter_mut()) {
            if let Some(constraint) = self.active.get_mut(id).and_then(|c| c.constraint.as_mut()) {
                if !draft.is_empty() {
                    let valid = constraint.valid_prefix(draft);
                    draft.truncate(valid);
                }
            }
        }
        share_room(&mut drafts, room);
        for (id, draft) in ids.into_iter().zip(drafts) {
            if !draft.is_empty() {
                self.scheduler.set_draft(id, draft);
            }
        }
    }

    /// Ends the streams of requests the scheduler finished on its own (ignored,
    /// aborted), and of completions that were still waiting for them.
    fn report_finished(&mut self, finished: &[FinishedRequest]) {
        for f in finished {
            if let Some(job) = self.prefills.remove(&f.request_id) {
                job.fail(match &f.detail {
                    Some(detail) => EngineError::Ignored {
                        detail: detail.clone(),
                    },
                    None => EngineError::Aborted,
                });
                continue;
            }
            for id in self.end_with_waiting(f.request_id) {
                self.emit(match &f.detail {
                    Some(detail) if f.reason == FinishReason::Ignored => OutputEvent::Failed {
                        id,
                        error: EngineError::Ignored {
                            detail: detail.clone(),
                        },
                    },
                    _ => OutputEvent::Finished {
                        id,
                        reason: f.reason,
                    },
                });
            }
        }
    }

    /// Schedules a step and launches it; `None` when nothing is scheduled.
    fn schedule_and_launch(&mut self) -> Option<Launched> {
        let out = self.scheduler.schedule();
        if let Some(proposer) = self.proposer.as_mut() {
            for &id in &out.preempted {
                proposer.preempted(id);
            }
        }
        self.report_finished(&out.finished);
        if out.scheduled.is_empty() {
            return None;
        }
        let draws = self.device_draws(&out.scheduled);
        Some(self.launch(out, draws, None))
    }

    /// Runs the model over the scheduled chunks, the `draws` rows drawn by the device, the
    /// `chained` ones fed the tokens the step launched before draws.
    fn launch(
        &mut self,
        out: SchedulerOutput,
        draws: DeviceDraws,
        chained: Option<Chained>,
    ) -> Launched {
        let at = Instant::now();
        for s in &out.scheduled {
            if let Some(active) = self.active.get_mut(&s.request_id) {
                active.scheduled_at.get_or_insert(at);
            }
            if s.start_position < self.prompt_len(s.request_id) {
                self.stats.num_prompt_tokens_computed += s.token_ids.len() as u64;
            }
        }
        let (id, output) = self.runner.launch(&out, &self.adapters, &draws, chained);
        Launched {
            id,
            out,
            draws,
            output,
            at,
        }
    }

    /// Schedules the step after `out` while `out` runs ([`Scheduler::schedule_ahead`]): its
    /// decodes take the tokens `out` draws, so every row `out` samples must be drawn by the device
    /// and each such request's next draw known before its token is (no penalties, no grammar; a
    /// request with held-back completions is sampled on the host, so never). Prompt chunks and
    /// prefill-only rows of `out` are no obstacle. `None`: the next step is scheduled after `out`
    /// is applied, as without async scheduling.
    fn schedule_ahead(&mut self, out: &SchedulerOutput, draws: &DeviceDraws) -> Option<Ahead> {
        if self.proposer.is_some() {
            return None;
        }
        // Per sampled request: the index of its token among those `out` draws (every row `out`
        // samples is drawn, in order), and its draw after that token.
        let mut after_next = HashMap::new();
        for s in &out.scheduled {
            match s.output {
                ChunkOutput::Nothing | ChunkOutput::Hidden | ChunkOutput::PromptLogits => {}
                ChunkOutput::Verify => return None,
                ChunkOutput::Sample => {
                    if !draws.samples.contains_key(&s.request_id) {
                        return None;
                    }
                    let active = self.active.get(&s.request_id)?;
                    if active.constraint.is_some() {
                        return None;
                    }
                    let draw = active.sampler.device_draw_after_next()?;
                    after_next.insert(s.request_id, (after_next.len(), draw));
                }
            }
        }
        let (next, pending) = self.scheduler.schedule_ahead(out)?.into_parts();
        self.report_finished(&next.finished);
        // A chunk whose tokens are known draws as in any step; a pending one by the rule after
        // the token it waits for.
        let mut draws = self.device_draws(&next.scheduled);
        let mut inputs = Vec::with_capacity(pending.len());
        for i in pending {
            let id = next.scheduled[i].request_id;
            let (k, draw) = after_next
                .remove(&id)
                .expect("a pending request sampled in the step before: this is a bug");
            draws.samples.insert(id, draw);
            inputs.push((i, k));
        }
        Some(Ahead {
            out: next,
            inputs,
            draws,
        })
    }

    /// Reads a launched step's `output`: samples each request that needs it; a request whose
    /// prompt just completed also samples the first token of each of its held-back completions
    /// (from a copy of the same row). Prefill-only requests take their rows, and answer once
    /// their prompt is done. A drawn row whose request ended since the step was launched (it
    /// ran ahead of the update that ended it) is dropped.
    fn collect(
        &mut self,
        out: &SchedulerOutput,
        draws: &DeviceDraws,
        output: ForwardOutput,
        started: Instant,
    ) -> Sampled {
        let vocab = self.runner.config().vocab_size;
        let hidden_size = self.runner.config().hidden_size;
        let mut drawn = output.tokens.into_iter();
        let mut logits = output.logits;
        let mut hidden = output.hidden.chunks_exact(hidden_size);
        let mut at = 0; // the next unread logits row
        let mut sampled = Vec::new();
        let mut forks = Vec::new();
        for s in &out.scheduled {
            match s.output {
                ChunkOutput::Nothing => {}
                ChunkOutput::Sample if draws.samples.contains_key(&s.request_id) => {
                    let token = drawn
                        .next()
                        .expect("one drawn token per drawn request: this is a bug");
                    let Some(active) = self.active.get_mut(&s.request_id) else {
                        continue; // ended after this step was launched ahead
                    };
                    let token = active.sampler.accept_drawn(token);
                    if let Some(constraint) = active.constraint.as_mut() {
                        advance_grammar(
                            s.request_id,
                            constraint,
                            token.token_id,
                            &mut self.grammar_outcomes,
                        );
                    }
                    sampled.push((s.request_id, vec![token]));
                }
                ChunkOutput::Sample => {
                    let row = logits
                        .get_mut(at * vocab..(at + 1) * vocab)
                        .expect("one logits row per sampled request: this is a bug");
                    at += 1;
                    // Ended after this step was launched ahead (aborted): the row is dropped.
                    if self.active.contains_key(&s.request_id) {
                        self.sample(s.request_id, row, &mut sampled, &mut forks);
                    }
                }
                ChunkOutput::Verify if draws.verifies.contains_key(&s.request_id) => {
                    // The rows were drawn on the device: keep them up to the first that is
                    // not the draft's token, as `verify_draft` does with host samples.
                    let draft = s.draft_token_ids();
                    let active = self
                        .active
                        .get_mut(&s.request_id)
                        .expect("verified request is active: this is a bug");
                    let mut tokens = Vec::with_capacity(draft.len() + 1);
                    let mut confirmed = true;
                    for i in 0..=draft.len() {
                        let token = drawn
                            .next()
                            .expect("one drawn token per verified row: this is a bug");
                        // Rows after the first token that is not the draft's are not kept.
                        if confirmed {
                            let token = active.sampler.accept_drawn(token);
                            confirmed = draft.get(i) == Some(&token.token_id);
                            tokens.push(token);
                        }
                    }
                    self.record_verify(s.request_id, draft.len(), tokens, &mut sampled);
                }
                ChunkOutput::Verify => {
                    let n = s.token_ids.len();
                    let rows = logits
                        .get_mut(at * vocab..(at + n) * vocab)
                        .expect("one logits row per verified token: this is a bug");
                    at += n;
                    self.verify(s.request_id, s.draft_token_ids(), rows, &mut sampled);
                }
                ChunkOutput::PromptLogits => {
                    let n = s.token_ids.len();
                    let rows = logits
                        .get(at * vocab..(at + n) * vocab)
                        .expect("one logits row per scored token: this is a bug");
                    at += n;
                    if let Some(job) = self.prefills.get_mut(&s.request_id) {
                        job.take_rows(s.start_position, rows);
                        if s.start_position + n == job.prompt_len() {
                            self.finish_prefill(s.request_id, None);
                        }
                    }
                }
                ChunkOutput::Hidden => {
                    let row = hidden
                        .next()
                        .expect("one hidden row per embedding: this is a bug");
                    self.finish_prefill(s.request_id, Some(row));
                }
            }
        }
        self.observe_decode_step(out, started.elapsed().as_secs_f64());
        (sampled, forks)
    }

    /// The sampled requests of `out` the backend draws itself, when its capabilities say it
    /// can: those whose sampler needs nothing of the host ([`Sampler::device_draw`]), with no
    /// grammar to mask the row and no held-back completions to start from a copy of it. The
    /// others get their logits row back and are sampled here.
    fn device_draws(&mut self, scheduled: &[ScheduledRequest]) -> DeviceDraws {
        let mut draws = DeviceDraws::default();
        if !self.runner.capabilities().sampling.draws {
            return draws;
        }
        let vocab = self.runner.config().vocab_size;
        for s in scheduled {
            if matches!(s.output, ChunkOutput::Verify) {
                if let Some(each) = self.verify_draws(s.request_id, s.draft_token_ids()) {
                    draws.verifies.insert(s.request_id, each);
                }
                continue;
            }
            if !matches!(s.output, ChunkOutput::Sample)
                || self
                    .groups
                    .get(&s.request_id)
                    .is_some_and(|g| g.has_pending())
            {
                continue;
            }
            let Some(active) = self.active.get_mut(&s.request_id) else {
                continue;
            };
            let Some(mut draw) = active.sampler.device_draw() else {
                continue;
            };
            // A grammar's mask was started when its last token was accepted; waiting for it
            // here (rather than while the step runs) is the price of masking on the device.
            if let Some(constraint) = active.constraint.as_mut() {
                match device_mask(constraint, vocab) {
                    Some(words) => draw.allowed = Some(words),
                    None => continue,
                }
            }
            draws.samples.insert(s.request_id, draw);
        }
        draws
    }

    /// The rules of a verify's rows when the device can draw them all: row i's is the
    /// sampler's after accepting the draft's first i tokens (rows past the first rejection
    /// are dropped, so assuming acceptance is exact for every row kept). `None` (the rows
    /// come back as logits) for a grammar, whose matcher cannot be advanced on a copy.
    fn verify_draws(&self, id: RequestId, draft: &[u32]) -> Option<Vec<Draw>> {
        let active = self.active.get(&id)?;
        if active.constraint.is_some() {
            return None;
        }
        let mut sampler = active.sampler.clone();
        let mut each = Vec::with_capacity(draft.len() + 1);
        for i in 0..=draft.len() {
            each.push(sampler.device_draw()?);
            if let Some(&token) = draft.get(i) {
                sampler.accept_drawn(DrawnToken {
                    token_id: token,
                    ..DrawnToken::default()
                });
            }
        }
        Some(each)
    }

    /// Tells the proposer what a step of decodes and drafts cost (prompt chunks would say
    /// nothing about what a draft row costs), to size the next drafts.
    fn observe_decode_step(&mut self, out: &SchedulerOutput, seconds: f64) {
        let Some(proposer) = self.proposer.as_mut() else {
            return;
        };
        let decode_only = out.scheduled.iter().all(|s| match s.output {
            ChunkOutput::Sample => s.token_ids.len() == 1,
            ChunkOutput::Verify => true,
            _ => false,
        });
        if decode_only {
            let rows = out.scheduled.iter().map(|s| s.token_ids.len()).sum();
            proposer.observe_step(rows, seconds);
        }
    }

    fn finish_prefill(&mut self, id: RequestId, hidden: Option<&[f32]>) {
        if let Some(job) = self.prefills.remove(&id) {
            job.finish(hidden);
        }
    }

    /// Verifies request `id`'s draft ([`verify_draft`]) and counts what it confirmed.
    fn verify(
        &mut self,
        id: RequestId,
        draft: &[u32],
        rows: &mut [f32],
        sampled: &mut Vec<(RequestId, Vec<SampledToken>)>,
    ) {
        let active = self
            .active
            .get_mut(&id)
            .expect("verified request is active: this is a bug");
        let device_draws = self.runner.capabilities().sampling.draws;
        let tokens = verify_draft(
            device_draws,
            id,
            &mut active.sampler,
            active.constraint.as_mut(),
            draft,
            rows,
            &mut self.grammar_outcomes,
        );
        self.record_verify(id, draft.len(), tokens, sampled);
    }

    /// Counts what request `id`'s verification confirmed (`tokens`: the confirmed draft
    /// tokens and the one after them) and hands the tokens on.
    fn record_verify(
        &mut self,
        id: RequestId,
        drafted: usize,
        tokens: Vec<SampledToken>,
        sampled: &mut Vec<(RequestId, Vec<SampledToken>)>,
    ) {
        let draft_len = drafted;
        let accepted = tokens.len() - 1;
        self.stats.num_drafts += 1;
        self.stats.num_draft_tokens += draft_len as u64;
        self.stats.num_accepted_tokens += accepted as u64;
        self.verified.push((
            id,
            Speculation {
                num_draft_tokens: draft_len,
                num_accepted_tokens: accepted,
            },
        ));
        if let Some(proposer) = self.proposer.as_mut() {
            proposer.record(id, draft_len, accepted);
        }
        sampled.push((id, tokens));
    }

    /// Samples request `id`'s next token from `row`, and the first token of each of its
    /// held-back completions (each from a copy of the row).
    fn sample(
        &mut self,
        id: RequestId,
        row: &mut [f32],
        sampled: &mut Vec<(RequestId, Vec<SampledToken>)>,
        forks: &mut Vec<Fork>,
    ) {
        let active = self
            .active
            .get(&id)
            .expect("scheduled request is active: this is a bug");
        let scheduled_at = active.scheduled_at;
        // Completion 0's first sample starts the others (its id is the request's).
        let children = match self.groups.get_mut(&id) {
            Some(group) => group.take_pending(),
            None => Vec::new(),
        };
        let device_draws = self.runner.capabilities().sampling.draws;
        for mut child in children {
            let child_id = child.request.id;
            let first = sample_row_as_device(
                device_draws,
                child_id,
                &mut child.sampler,
                child.constraint.as_mut(),
                &mut row.to_vec(),
                &mut self.grammar_outcomes,
            );
            sampled.push((child_id, vec![first.clone()]));
            let (request, completion) = child.start(id, scheduled_at);
            forks.push(Fork {
                parent: id,
                child: request,
                first_token: first.token_id,
            });
            self.active.insert(child_id, completion);
        }
        let active = self
            .active
            .get_mut(&id)
            .expect("scheduled request is active: this is a bug");
        let token = sample_row_as_device(
            device_draws,
            id,
            &mut active.sampler,
            active.constraint.as_mut(),
            row,
            &mut self.grammar_outcomes,
        );
        sampled.push((id, vec![token]));
    }

    fn prompt_len(&self, id: RequestId) -> usize {
        self.scheduler
            .request(id)
            .map_or(0, |r| r.num_prompt_tokens())
    }

    fn update(
        &mut self,
        out: &SchedulerOutput,
        sampled: Vec<(RequestId, Vec<SampledToken>)>,
        forks: Vec<Fork>,
    ) {
        let forked: Vec<RequestId> = forks.iter().map(|f| f.child.id).collect();
        let tokens: Vec<(RequestId, Vec<u32>)> = sampled
            .iter()
            .filter(|(id, _)| !forked.contains(id))
            .map(|(id, t)| (*id, t.iter().map(|t| t.token_id).collect()))
            .collect();
        let updates = self.scheduler.update_with_forks(out, &tokens, forks);
        let mut sampled: HashMap<RequestId, Vec<SampledToken>> = sampled.into_iter().collect();
        let outcomes = std::mem::take(&mut self.grammar_outcomes);
        let verified = std::mem::take(&mut self.verified);
        for u in updates {
            let Some(mut tokens) = sampled.remove(&u.request_id) else {
                continue;
            };
            // The scheduler keeps tokens up to the first that ends the request.
            let cut = u.new_token_ids.len() < tokens.len();
            tokens.truncate(u.new_token_ids.len());
            let Some(last) = tokens.pop() else {
                continue;
            };
            if let Some((_, message)) = outcomes.failed.iter().find(|(id, _)| *id == u.request_id) {
                tracing::warn!(id = u.request_id.0, %message, "structured output failed");
                self.end_completion(u.request_id);
                self.scheduler.abort_request(u.request_id);
                self.emit(OutputEvent::Failed {
                    id: u.request_id,
                    error: EngineError::StepFailed {
                        message: format!("structured output: {message}"),
                    },
                });
                continue;
            }
            self.stats.num_generated_tokens += 1 + tokens.len() as u64;
            let mut finish = u.finish_reason;
            // A complete grammar ends the request as a stop would, even on its last allowed
            // token (the output is whole, not cut). An end token completing it stays a hidden
            // stop token.
            let completes_constraint = !cut
                && outcomes.finished.contains(&u.request_id)
                && finish != Some(FinishReason::Stop);
            if completes_constraint {
                if finish.is_none() {
                    self.scheduler
                        .finish_request(u.request_id, FinishReason::Stop);
                }
                finish = Some(FinishReason::Stop);
            }
            let scheduled_at = self.active.get(&u.request_id).and_then(|a| a.scheduled_at);
            if finish.is_some() {
                self.end_completion(u.request_id);
            }
            // Confirmed draft tokens first, each an ordinary token of the stream.
            for token in tokens {
                self.emit(OutputEvent::Token {
                    id: u.request_id,
                    token,
                    finish: None,
                    completes_constraint: false,
                    num_cached_tokens: u.num_cached_tokens,
                    scheduled_at,
                    speculation: Speculation::default(),
                });
            }
            let speculation = verified
                .iter()
                .find(|(id, _)| *id == u.request_id)
                .map_or_else(Speculation::default, |(_, s)| *s);
            self.emit(OutputEvent::Token {
                id: u.request_id,
                token: last,
                finish,
                completes_constraint,
                num_cached_tokens: u.num_cached_tokens,
                scheduled_at,
                speculation,
            });
        }
    }

    fn fail(&mut self, out: &SchedulerOutput, error: EngineError) {
        let message = error.to_string();
        self.verified.clear();
        for s in &out.scheduled {
            if let Some(job) = self.prefills.remove(&s.request_id) {
                job.fail(EngineError::StepFailed {
                    message: message.clone(),
                });
            }
            for id in self.end_with_waiting(s.request_id) {
                self.emit(OutputEvent::Failed {
                    id,
                    error: EngineError::StepFailed {
                        message: message.clone(),
                    },
                });
            }
            self.scheduler.abort_request(s.request_id);
        }
    }

    /// Next-token logits at every prompt position, computed token by token apart from the paged
    /// pool: a reference for checking incremental decoding (the engine's own scoring runs as
    /// [`PrefillTask`] requests).
    pub fn stepwise_prompt_logits(&mut self, prompt_ids: &[u32]) -> Result<Vec<f32>> {
        self.runner.stepwise_prompt_logits(prompt_ids)
    }

    /// The device the model runs on.
    pub fn device(&self) -> novainfer_model::Device {
        self.runner.device()
    }
}
