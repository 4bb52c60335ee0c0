//! `EngineHandle`: the engine on its own thread, requests in through a channel,
//! each request's deltas out through its own stream.
//!
//! The handle is the only way other threads (Python, the server) reach the
//! engine: nothing is shared but channels and the immutable [`Frontend`]. The
//! engine thread blocks when idle and otherwise steps continuously, taking new
//! requests between steps. Dropping a [`RequestStream`] before it ends aborts
//! the request and frees its KV blocks at once.
//!
//! Two threads: the engine thread steps the model; the output thread
//! ([`crate::output_processor`]) turns sampled tokens into text deltas. A request
//! of `n` completions has ids `id .. id + n` and one stream carrying all of their
//! deltas (tagged with `index`); the stream ends when all `n` have finished.
//!
//! Liveness: a panic in the engine loop is caught on the engine thread and recorded
//! ([`EngineHandle::failure`]) *before* the engine state is dropped, so every stream that
//! then loses its sender reports [`EngineError::StepFailed`] with the panic message rather
//! than a bare "stopped"; a caller can poll `failure()` to report health.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use novainfer_core::{ParamError, RequestId, SamplingParams};

use novainfer_model::device::Resolved;
use novainfer_model::AdapterRef;

use crate::checked::CheckedRequest;
use crate::engine::{EngineConfig, Frontend, LoadedEngine};
use novainfer_core::FinishReason;

use crate::engine_core::{EngineCore, EngineStats};
use crate::error::{EngineError, Result};
use crate::output_processor::{self, DeltaSink};
use crate::prefill::{PrefillTask, Reply};
use crate::request::{Delta, Scheduling, TokenLogprob};

/// One generation request on its way to the engine thread.
struct Submission {
    /// The first of its `n` completions' ids (`id .. id + n`).
    id: RequestId,
    /// Checked by the submitting thread.
    request: CheckedRequest,
    scheduling: Scheduling,
    deltas: DeltaSink,
}

enum Command {
    /// Requests that enter the engine together, before the same step: a batch submitted at
    /// once is scheduled the same way however fast the submitting thread is (which requests
    /// share a step decides which kernels a row runs through, and so its last bits).
    Generate(Vec<Submission>),
    /// Every completion of a request (or a prefill-only request).
    Abort {
        id: RequestId,
    },
    /// From the output thread: a stop string ended this completion.
    Finish(RequestId, FinishReason),
    /// Ends the engine loop (streams still open then end with `EngineStopped`).
    Shutdown,
    /// An embedding or a scored prompt, scheduled like a generation.
    Prefill {
        id: RequestId,
        prompt_ids: Vec<u32>,
        task: PrefillTask,
        adapter: Option<AdapterRef>,
    },
    /// Logits token by token, apart from the pool (a reference for tests).
    StepwiseLogits {
        prompt_ids: Vec<u32>,
        reply: Reply<Vec<f32>>,
    },
    Stats(Reply<EngineStats>),
    ResetPrefixCache(mpsc::Sender<bool>),
}

/// A std channel's reply and its receiver, for the blocking calls.
fn blocking_reply<T: Send + 'static>() -> (Reply<T>, mpsc::Receiver<Result<T>>) {
    let (tx, rx) = mpsc::channel();
    (
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
        rx,
    )
}

pub struct EngineHandle {
    commands: Option<mpsc::Sender<Command>>,
    frontend: Frontend,
    device: Resolved,
    next_id: AtomicU64,
    workers: Vec<JoinHandle<()>>,
    liveness: Arc<Liveness>,
}

/// Set once, by the engine thread, if its loop panicked: the panic message.
#[derive(Default)]
struct Liveness {
    failure: OnceLock<String>,
}

impl Liveness {
    /// The error for a request whose engine went away.
    fn stopped(&self) -> EngineError {
        match self.failure.get() {
            Some(message) => EngineError::StepFailed {
                message: format!("the engine thread panicked: {message}"),
            },
            None => EngineError::EngineStopped,
        }
    }
}

impl EngineHandle {
    /// Loads the model on the calling thread (so load errors return here), then
    /// starts the engine thread.
    pub fn spawn(cfg: &EngineConfig) -> Result<Self> {
        let (events, event_rx) = mpsc::channel();
        let loaded = LoadedEngine::load(cfg)?;
        let device = loaded.device.clone();
        tracing::info!(
            device = %device.device,
            reason = %device.reason,
            async_scheduling = loaded.async_scheduling,
            "model loaded"
        );
        let mut core = EngineCore::new(loaded, events);
        if let Some(sink) = &cfg.kv_events {
            core.set_kv_event_sink(sink.clone());
        }
        let frontend = core.frontend().clone();
        let (commands, inbox) = mpsc::channel();
        let feedback = commands.clone();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|_| EngineError::EngineStopped)
        };
        let outputs = spawn(
            "novainfer-output",
            Box::new(move || {
                output_processor::run(event_rx, |id, reason| {
                    let _ = feedback.send(Command::Finish(id, reason));
                })
            }),
        )?;
        let liveness = Arc::new(Liveness::default());
        let engine = spawn(
            "novainfer-engine",
            Box::new({
                let liveness = liveness.clone();
                move || run(core, inbox, &liveness)
            }),
        )?;
        Ok(Self {
            commands: Some(commands),
            frontend,
            device,
            next_id: AtomicU64::new(0),
            // The engine first: its exit closes the output thread's channel.
            workers: vec![engine, outputs],
            liveness,
        })
    }

    /// Why the engine thread died (its panic message), or `None` while it runs (or after a
    /// normal shutdown).
    pub fn failure(&self) -> Option<String> {
        self.liveness.failure.get().cloned()
    }

    pub fn frontend(&self) -> &Frontend {
        &self.frontend
    }

    /// The device the model runs on, and why it was chosen.
    pub fn device(&self) -> &Resolved {
        &self.device
    }

    fn sender(&self) -> Result<&mpsc::Sender<Command>> {
        self.commands.as_ref().ok_or(EngineError::EngineStopped)
    }

    fn send(&self, command: Command) -> Result<()> {
        self.sender()?
            .send(command)
            // A new request to a dead engine is a 503 (EngineStopped), not the 500 of the
            // requests that were running when it died.
            .map_err(|_| EngineError::EngineStopped)
    }

    /// The error for a request whose engine went away: the panic, or a plain shutdown.
    pub fn stopped_error(&self) -> EngineError {
        self.liveness.stopped()
    }

    /// Queues a request after checking it fits; the deltas of its `n` completions
    /// arrive on the returned stream.
    pub fn submit(&self, prompt_ids: Vec<u32>, params: SamplingParams) -> Result<RequestStream> {
        self.submit_scheduled(prompt_ids, params, Scheduling::default())
    }

    /// [`Self::submit`] with a priority and tenant.
    pub fn submit_scheduled(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        scheduling: Scheduling,
    ) -> Result<RequestStream> {
        let request = self.frontend.check_request(prompt_ids, params)?;
        self.submit_checked(request, scheduling)
    }

    /// [`Self::submit_scheduled`] of a request already checked by
    /// [`Frontend::check_request`] (to check a batch before starting any of it).
    pub fn submit_checked(
        &self,
        request: CheckedRequest,
        scheduling: Scheduling,
    ) -> Result<RequestStream> {
        let mut streams = self.submit_checked_batch(vec![(request, scheduling)])?;
        Ok(streams.remove(0))
    }

    /// Queues checked requests together: the engine adds all of them before its next step,
    /// so an offline batch is scheduled (and computed) the same way on every run. One stream
    /// per request, in order.
    pub fn submit_checked_batch(
        &self,
        requests: Vec<(CheckedRequest, Scheduling)>,
    ) -> Result<Vec<RequestStream>> {
        let mut receivers = Vec::with_capacity(requests.len());
        let requests = requests
            .into_iter()
            .map(|(request, scheduling)| {
                let (deltas, rx) = mpsc::channel();
                receivers.push((request.params().n(), rx));
                (request, scheduling, deltas.into())
            })
            .collect();
        let aborts = self.submit_checked_batch_to(requests)?;
        Ok(aborts
            .into_iter()
            .zip(receivers)
            .map(|(abort, (n, rx))| RequestStream {
                id: abort.id,
                unfinished: n,
                rx,
                commands: abort.commands,
                liveness: self.liveness.clone(),
            })
            .collect())
    }

    /// [`Self::submit_checked_batch`] with each request's deltas going to its own sink, as in
    /// [`Self::submit_to`]: one command, so either all of the requests are queued (and enter
    /// the same step) or, with the engine gone, none is.
    pub fn submit_checked_batch_to(
        &self,
        requests: Vec<(CheckedRequest, Scheduling, DeltaSink)>,
    ) -> Result<Vec<AbortHandle>> {
        let commands = self.sender()?;
        let mut aborts = Vec::with_capacity(requests.len());
        let mut submissions = Vec::with_capacity(requests.len());
        for (request, scheduling, deltas) in requests {
            let id = self.reserve_ids(request.params().n());
            aborts.push(AbortHandle {
                id,
                commands: commands.clone(),
            });
            submissions.push(Submission {
                id,
                request,
                scheduling,
                deltas,
            });
        }
        self.send(Command::Generate(submissions))?;
        Ok(aborts)
    }

    /// Ids for a request's `n` completions: `id .. id + n`.
    fn reserve_ids(&self, n: usize) -> RequestId {
        RequestId(self.next_id.fetch_add(n as u64, Ordering::Relaxed))
    }

    /// Like [`Self::submit`], with the deltas going to `sink` (e.g. an async channel). The
    /// caller must abort through the returned handle if it stops listening before the last
    /// delta (a sink that reports the caller gone is aborted by the engine too). If the engine
    /// dies, the sink is dropped with completions unfinished: see [`Self::stopped_error`].
    pub fn submit_to(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        sink: DeltaSink,
    ) -> Result<AbortHandle> {
        self.submit_scheduled_to(prompt_ids, params, Scheduling::default(), sink)
    }

    /// [`Self::submit_to`] with a priority and tenant.
    pub fn submit_scheduled_to(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        scheduling: Scheduling,
        sink: DeltaSink,
    ) -> Result<AbortHandle> {
        let request = self.frontend.check_request(prompt_ids, params)?;
        self.submit_checked_to(request, scheduling, sink)
    }

    /// Queues a request checked by [`Frontend::check_request`] (a server checks on its own
    /// threads, before it waits for a permit); the deltas go to `sink` as in
    /// [`Self::submit_to`].
    pub fn submit_checked_to(
        &self,
        request: CheckedRequest,
        scheduling: Scheduling,
        sink: DeltaSink,
    ) -> Result<AbortHandle> {
        let mut aborts = self.submit_checked_batch_to(vec![(request, scheduling, sink)])?;
        Ok(aborts.remove(0))
    }

    /// Next-token logits at every prompt position, `[prompt_len, vocab]`: scheduled as a
    /// scored prompt (in chunks, beside other requests), or with `step_by_step` computed token
    /// by token apart from the pool (a reference for incremental decoding; base model only).
    /// `adapter`: the LoRA adapter to run with.
    pub fn prompt_logits(
        &self,
        prompt_ids: Vec<u32>,
        step_by_step: bool,
        adapter: Option<AdapterRef>,
    ) -> Result<Vec<f32>> {
        let (reply, rx) = blocking_reply();
        if step_by_step {
            if adapter.is_some() {
                return Err(ParamError::new(
                    "step_by_step",
                    "computes the base model's logits apart from the engine: not with an adapter",
                )
                .into());
            }
            self.frontend.check_input(&prompt_ids)?;
            self.send(Command::StepwiseLogits { prompt_ids, reply })?;
        } else {
            self.prefill(prompt_ids, PrefillTask::PromptLogits(reply), adapter)?;
        }
        rx.recv().map_err(|_| self.liveness.stopped())?
    }

    /// The logprob of each prompt token given the ones before it, with its `top_k` most likely
    /// alternatives (`None` for the first token), answered through `reply`. Scheduled as a
    /// prefill-only request; abort it through the returned handle if the caller goes away.
    pub fn score_prompt_with(
        &self,
        prompt_ids: Vec<u32>,
        top_k: usize,
        adapter: Option<AdapterRef>,
        reply: impl FnOnce(Result<Vec<Option<TokenLogprob>>>) + Send + 'static,
    ) -> Result<AbortHandle> {
        let reply = Box::new(reply);
        self.prefill(
            prompt_ids,
            PrefillTask::PromptLogprobs { top_k, reply },
            adapter,
        )
    }

    /// The input's unit-length embedding (its last token's final hidden state).
    pub fn embed(&self, prompt_ids: Vec<u32>) -> Result<Vec<f32>> {
        let (reply, rx) = blocking_reply();
        self.embed_with(prompt_ids, None, reply)?;
        rx.recv().map_err(|_| self.liveness.stopped())?
    }

    /// [`Self::embed`] answered through `reply` (run on the engine thread). Scheduled as a
    /// prefill-only request; abort it through the returned handle if the caller goes away.
    pub fn embed_with(
        &self,
        prompt_ids: Vec<u32>,
        adapter: Option<AdapterRef>,
        reply: impl FnOnce(Result<Vec<f32>>) + Send + 'static,
    ) -> Result<AbortHandle> {
        self.prefill(prompt_ids, PrefillTask::Embed(Box::new(reply)), adapter)
    }

    /// Checks and queues a prefill-only request.
    fn prefill(
        &self,
        prompt_ids: Vec<u32>,
        task: PrefillTask,
        adapter: Option<AdapterRef>,
    ) -> Result<AbortHandle> {
        self.frontend.check_input(&prompt_ids)?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        self.send(Command::Prefill {
            id,
            prompt_ids,
            task,
            adapter,
        })?;
        Ok(AbortHandle {
            id,
            commands: self.sender()?.clone(),
        })
    }

    pub fn stats(&self) -> Result<EngineStats> {
        let (reply, rx) = blocking_reply();
        self.stats_with(reply)?;
        rx.recv().map_err(|_| self.liveness.stopped())?
    }

    /// [`Self::stats`] answered through `reply` (run on the engine thread).
    pub fn stats_with(
        &self,
        reply: impl FnOnce(Result<EngineStats>) + Send + 'static,
    ) -> Result<()> {
        self.send(Command::Stats(Box::new(reply)))
    }

    /// Drops every cached prefix block; false (and nothing changes) while requests run.
    pub fn reset_prefix_cache(&self) -> Result<bool> {
        let (reply, rx) = mpsc::channel();
        self.send(Command::ResetPrefixCache(reply))?;
        rx.recv().map_err(|_| self.liveness.stopped())
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        if let Some(commands) = self.commands.take() {
            let _ = commands.send(Command::Shutdown);
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// The engine thread: the step loop, with a panic caught and recorded while `core` is still
/// alive; dropping `core` afterwards closes every request's channel.
fn run(mut core: EngineCore, inbox: mpsc::Receiver<Command>, liveness: &Liveness) {
    // The core is never used again after a panic, so a broken invariant inside it cannot leak.
    let result = catch_unwind(AssertUnwindSafe(|| step_loop(&mut core, inbox)));
    if let Err(payload) = result {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        tracing::error!(%message, "the engine thread panicked; failing every request in flight");
        let _ = liveness.failure.set(message);
    }
}

fn step_loop(core: &mut EngineCore, inbox: mpsc::Receiver<Command>) {
    let mut failpoint = failpoint::StepPanic::from_env();
    while let Some(commands) = between_steps(&inbox, core.has_work()) {
        for command in commands {
            handle(core, command);
        }
        failpoint.before_step();
        core.step();
    }
}

/// The commands to handle before the next step: all that arrived; `busy`: the engine has
/// requests to step, so do not wait for one. `None`: shut down (asked to, or every sender
/// is gone).
fn between_steps(rx: &mpsc::Receiver<Command>, busy: bool) -> Option<Vec<Command>> {
    let mut commands = Vec::new();
    if !busy {
        // Idle: sleep until something arrives.
        match rx.recv() {
            Ok(Command::Shutdown) | Err(_) => return None,
            Ok(command) => commands.push(command),
        }
    }
    loop {
        match rx.try_recv() {
            Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => return None,
            Ok(command) => commands.push(command),
            Err(TryRecvError::Empty) => return Some(commands),
        }
    }
}

fn handle(core: &mut EngineCore, command: Command) {
    match command {
        Command::Generate(submissions) => {
            for s in submissions {
                core.add_request(s.id, s.request, s.scheduling, s.deltas);
            }
        }
        Command::Abort { id } => core.abort(id),
        Command::Finish(id, reason) => core.finish(id, reason),
        Command::Shutdown => {}
        Command::Prefill {
            id,
            prompt_ids,
            task,
            adapter,
        } => core.add_prefill(id, prompt_ids, task, adapter),
        Command::StepwiseLogits { prompt_ids, reply } => {
            reply(core.stepwise_prompt_logits(&prompt_ids))
        }
        Command::Stats(reply) => reply(Ok(core.stats())),
        Command::ResetPrefixCache(reply) => {
            let _ = reply.send(core.reset_prefix_cache());
        }
    }
}

/// The deltas of one request's `n` completions, ending after the last of them
/// finishes (or after an error).
pub struct RequestStream {
    id: RequestId,
    unfinished: usize,
    rx: mpsc::Receiver<Result<Delta>>,
    commands: mpsc::Sender<Command>,
    liveness: Arc<Liveness>,
}

impl RequestStream {
    /// The request's id (its completion 0's).
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// A handle that aborts this request from another thread, e.g. while this
    /// stream's owner is blocked waiting for a delta of a request still queued.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            id: self.id,
            commands: self.commands.clone(),
        }
    }
}

/// Aborts one request (all its completions); cheap to clone and send between threads.
#[derive(Clone)]
pub struct AbortHandle {
    id: RequestId,
    commands: mpsc::Sender<Command>,
}

impl AbortHandle {
    /// Finishes the request with `abort` and frees its KV blocks at the next step;
    /// a no-op once it has finished.
    pub fn abort(&self) {
        let _ = self.commands.send(Command::Abort { id: self.id });
    }
}

/// What [`RequestStream::next_timeout`] found.
#[derive(Debug)]
pub enum NextDelta {
    Delta(Result<Delta>),
    /// Nothing arrived within the timeout; the request is still running.
    Pending,
    /// Every completion has finished (or an error ended the stream).
    Ended,
}

impl RequestStream {
    /// Waits at most `timeout` for the next delta, so a caller can check for something else
    /// between waits (Python's signal handlers, a close from another thread).
    pub fn next_timeout(&mut self, timeout: Duration) -> NextDelta {
        if self.unfinished == 0 {
            return NextDelta::Ended;
        }
        let item = match self.rx.recv_timeout(timeout) {
            Ok(item) => item,
            Err(RecvTimeoutError::Timeout) => return NextDelta::Pending,
            Err(RecvTimeoutError::Disconnected) => Err(self.liveness.stopped()),
        };
        NextDelta::Delta(self.account(item))
    }

    /// Counts finished completions; an error ends the whole stream.
    fn account(&mut self, item: Result<Delta>) -> Result<Delta> {
        match &item {
            Ok(d) if d.finish_reason.is_none() => {}
            Ok(_) => self.unfinished -= 1,
            Err(_) => {
                // An error ends the stream; the request's other completions end with it.
                self.abort_handle().abort();
                self.unfinished = 0;
            }
        }
        item
    }
}

impl Iterator for RequestStream {
    type Item = Result<Delta>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.unfinished == 0 {
            return None;
        }
        let item = self
            .rx
            .recv()
            .unwrap_or_else(|_| Err(self.liveness.stopped()));
        Some(self.account(item))
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.unfinished > 0 {
            self.abort_handle().abort();
        }
    }
}

/// Fault injection for tests of the server's liveness handling, compiled only with the
/// `failpoints` feature (never in a release wheel): `NOVAINFER_FAILPOINT_ENGINE_PANIC_AFTER=N`
/// makes the engine loop panic before its (N+1)-th step.
#[cfg(feature = "failpoints")]
mod failpoint {
    pub struct StepPanic {
        steps_left: Option<u64>,
    }

    impl StepPanic {
        pub fn from_env() -> Self {
            let steps_left = std::env::var("NOVAINFER_FAILPOINT_ENGINE_PANIC_AFTER")
                .ok()
                .and_then(|v| v.parse().ok());
            Self { steps_left }
        }

        pub fn before_step(&mut self) {
            match &mut self.steps_left {
                Some(0) => panic!("failpoint: NOVAINFER_FAILPOINT_ENGINE_PANIC_AFTER reached"),
                Some(n) => *n -= 1,
                None => {}
            }
        }
    }
}

#[cfg(not(feature = "failpoints"))]
mod failpoint {
    pub struct StepPanic;

    impl StepPanic {
        pub fn from_env() -> Self {
            Self
        }

        #[inline(always)]
        pub fn before_step(&mut self) {}
    }
}
