//! Launching a generation and driving it, shared by completions and chat: user budget,
//! admission (concurrency and queue limits; a stream waits for its permit already sending
//! keep-alives), decided *before* the prompt is rendered and tokenized (see
//! [`Pending::tokenize`]), so an overloaded server refuses a request before spending any
//! work on it; deadline, cancel registration, the event loop
//! (deltas, keep-alives, timeout) and the accounting done exactly once when the request
//! ends however it ends (finished, failed, timed out, cancelled, client gone).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures_util::{Stream, StreamExt};
use novainfer_core::SamplingParams;
use novainfer_engine::{CheckedRequest, Delta, EngineError, Scheduling};

use super::log_ms;
use crate::accounting::RunState;
use crate::budget::{check_user, ANONYMOUS};
use crate::error::ApiError;
use crate::fair_admission::{Permit, Ticket};
use crate::generation::{Generation, Registration};
use crate::keys::Tenant;
use crate::lifecycle::{not_live, EngineFailure};
use crate::models::ModelRef;
use crate::state::{AppState, RequestId};

pub struct Launch {
    pub model: ModelRef,
    pub params: SamplingParams,
    /// The request's own timeout in seconds.
    pub timeout: Option<f64>,
    pub user: Option<String>,
    /// The API key the request came with: owns its cancel entry and budget.
    pub tenant: Tenant,
    /// vLLM's `priority` (lower first under the priority policy).
    pub priority: i32,
    pub endpoint: &'static str,
    /// The response object's id; also a cancel key.
    pub response_id: String,
    /// The request field that set its output constraint (`response_format`,
    /// `structured_outputs`, `tools`): a constraint that cannot compile is a 400 naming it.
    pub constraint_field: &'static str,
}

pub enum Event {
    Delta(usize, Delta),
    Failed(EngineError),
    KeepAlive,
    TimedOut,
    Ended,
}

/// A generation in flight with everything it holds; dropping it ends the request.
pub struct Running {
    pub gen: Generation,
    pub run: RunState,
    pub model: ModelRef,
    deadline: Option<Instant>,
    timeout_secs: f64,
    /// How the request ended, for the log line and metrics (`None`: the client went away).
    pub outcome: Option<&'static str>,
    app: Arc<AppState>,
    request_id: String,
    endpoint: &'static str,
    user: String,
    tenant: Tenant,
    priority: i32,
    _registration: Registration,
    /// `None` when cancelled before it got one.
    _permit: Option<Permit>,
}

/// Who is charged for the tokens: the `user` field, else one shared "anonymous" user.
fn user_of(launch_user: Option<String>) -> String {
    launch_user.unwrap_or_else(|| ANONYMOUS.to_owned())
}

/// A request checked and holding its place (permit or queue slot), not yet in the engine.
pub struct Pending {
    app: Arc<AppState>,
    request_id: String,
    arrival: Instant,
    launch: Launch,
    /// Set by [`Pending::tokenize`].
    requests: Vec<CheckedRequest>,
    ticket: Ticket,
    registration: Registration,
    deadline: Option<Instant>,
    timeout_secs: f64,
    user: String,
    scheduling: Scheduling,
}

/// Everything that can refuse a request before any work is spent on it: shutdown, a dead
/// engine (503 `engine_dead` before a stream starts, rather than an error event after a 200),
/// the user's budget, a full queue. The context length is checked once the prompt is tokenized.
pub fn prepare(
    app: &Arc<AppState>,
    request_id: &RequestId,
    arrival: Instant,
    l: Launch,
) -> Result<Pending, ApiError> {
    app.lifecycle.admit()?;
    if let Some(message) = l.model.handle.failure() {
        return Err(not_live(&EngineFailure {
            model: l.model.name.clone(),
            message,
        }));
    }
    check_user(l.user.as_deref())?;
    let user = user_of(l.user.clone());
    if let Some(budget) = &app.budget {
        budget
            .check(l.tenant, &user, arrival)
            .inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    }
    let timeout_secs = match (app.timeout.map(|d| d.as_secs_f64()), l.timeout) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let scheduling = Scheduling {
        priority: l.priority,
        tenant: app.tenant_weights.share(l.tenant, &user),
        adapter: l.model.adapter.clone(),
    };
    let ticket = app
        .admission
        .reserve(scheduling.tenant, scheduling.priority)
        .inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    let registration = app
        .cancels
        .register(l.tenant, vec![l.response_id.clone(), request_id.0.clone()]);
    Ok(Pending {
        app: app.clone(),
        request_id: request_id.0.clone(),
        arrival,
        launch: l,
        requests: Vec::new(),
        ticket,
        registration,
        // Both timeouts are range-checked, so this cannot overflow; if it did, no deadline.
        deadline: timeout_secs
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .and_then(|d| arrival.checked_add(d)),
        timeout_secs: timeout_secs.unwrap_or_default(),
        user,
        scheduling,
    })
}

impl Pending {
    /// Runs `work` (rendering and tokenizing the prompts, returning their ids and whatever else
    /// the endpoint needs) on a blocking thread once the tokenizing pool admits it (429 when its
    /// queue is full). The same thread checks each prompt with the request's parameters
    /// (`Frontend::check_request`: the context length, and the output constraint compiled,
    /// cached per distinct one), so a prompt too long or a schema that cannot compile is a 400
    /// before the request waits for a permit, and nothing checks it again.
    pub async fn tokenize<T: Send + 'static>(
        &mut self,
        work: impl FnOnce() -> Result<(Vec<Vec<u32>>, T), ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let frontend = self.launch.model.frontend.clone();
        let params = self.launch.params.clone();
        let field = self.launch.constraint_field;
        let (requests, extra) = run_tokenize(&self.app, move || {
            let (prompts, extra) = work()?;
            let requests = prompts
                .into_iter()
                .map(|ids| {
                    frontend.check_request(ids, params.clone()).map_err(|e| {
                        let e = ApiError::from(e);
                        // The engine names vLLM's field; the request may have used another.
                        if e.param.as_deref() == Some("structured_outputs") {
                            e.with_param(field)
                        } else {
                            e
                        }
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((requests, extra))
        })
        .await?;
        self.requests = requests;
        Ok(extra)
    }

    /// Waits for a permit (until the deadline) and submits the prompts to the engine. A request
    /// cancelled while queued starts nothing and ends at once, every choice with `abort`.
    pub async fn start(self) -> Result<Running, ApiError> {
        let wait = async {
            match self.deadline {
                Some(d) => tokio::time::timeout_at(d.into(), self.ticket.wait())
                    .await
                    .map_err(|_| ApiError::timeout(self.timeout_secs))?,
                None => self.ticket.wait().await,
            }
        };
        let permit = tokio::select! {
            permit = wait => Some(permit?),
            _ = self.registration.slot().cancelled() => None,
        };
        let l = self.launch;
        let prompt_lens = self.requests.iter().map(|r| r.prompt_ids().len()).collect();
        let gen = match permit {
            Some(_) => Generation::start(&l.model.handle, self.requests, self.scheduling)?,
            None => Generation::empty(),
        };
        self.registration.slot().arm(gen.abort_handles());
        Ok(Running {
            gen,
            run: RunState::new(self.arrival, prompt_lens, l.params.n()),
            model: l.model,
            deadline: self.deadline,
            timeout_secs: self.timeout_secs,
            outcome: None,
            app: self.app,
            request_id: self.request_id,
            endpoint: l.endpoint,
            user: self.user,
            tenant: l.tenant,
            priority: l.priority,
            _registration: self.registration,
            _permit: permit,
        })
    }
}

/// `work` on a blocking thread under the tokenizing pool (admitted first: 429 when its queue
/// is full); shared by the generation endpoints and `/tokenize`.
pub async fn run_tokenize<T: Send + 'static>(
    app: &AppState,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let _permit = app
        .work
        .tokenize
        .admit()
        .await
        .inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

async fn sleep_for(period: Option<Duration>) {
    match period {
        Some(p) => tokio::time::sleep(p).await,
        None => std::future::pending().await,
    }
}

impl Running {
    /// The next thing to report; `keep_alive` is the silence after which to send a comment.
    /// A delta is recorded in `run` before it is returned.
    pub async fn next_event(&mut self, keep_alive: Option<Duration>) -> Event {
        let event = tokio::select! {
            item = self.gen.next() => match item {
                Some((prompt, Ok(delta))) => Event::Delta(prompt, delta),
                Some((_, Err(e))) => Event::Failed(e),
                None => Event::Ended,
            },
            _ = sleep_until(self.deadline) => Event::TimedOut,
            _ = sleep_for(keep_alive) => Event::KeepAlive,
        };
        match &event {
            Event::TimedOut => {
                self.gen.abort();
                self.outcome = Some("timeout");
            }
            Event::Failed(_) => self.outcome = Some("error"),
            Event::Ended => self.outcome = Some(self.run.finish_reason()),
            Event::Delta(..) | Event::KeepAlive => {}
        }
        event
    }

    /// Records a delta; returns its choice index.
    pub fn record(&mut self, prompt: usize, delta: &Delta) -> usize {
        self.run
            .record(prompt, delta, &self.model.metrics, Instant::now())
    }

    pub fn timeout_error(&self) -> ApiError {
        ApiError::timeout(self.timeout_secs)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or("abort");
        let usage = self.run.usage();
        let metrics = &self.model.metrics;
        use std::sync::atomic::Ordering::Relaxed;
        metrics
            .prompt_tokens
            .fetch_add(usage.prompt_tokens as u64, Relaxed);
        metrics
            .generation_tokens
            .fetch_add(usage.completion_tokens as u64, Relaxed);
        metrics
            .cached_tokens
            .fetch_add(usage.prompt_tokens_details.cached_tokens as u64, Relaxed);
        let latency = self.run.arrival.elapsed();
        metrics.e2e.observe(latency.as_secs_f64());
        metrics.finished(outcome);
        self.app.endpoint_metrics.finished(self.endpoint, outcome);
        if let Some(budget) = &self.app.budget {
            budget.charge(
                self.tenant,
                &self.user,
                usage.total_tokens as u64,
                Instant::now(),
            );
        }
        tracing::info!(
            target: "novainfer::request",
            request_id = %self.request_id,
            endpoint = self.endpoint,
            model = %self.model.name,
            status = 200,
            latency_ms = log_ms(latency),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            cached_tokens = usage.prompt_tokens_details.cached_tokens,
            finish_reason = outcome,
            priority = self.priority,
            queue_ms = self.run.queue_time().map(log_ms),
            prefill_ms = self.run.prefill_time().map(log_ms),
            "request"
        );
    }
}

/// A stream that waits for `pending`'s permit, sending an SSE keep-alive comment for every
/// `period` it waits, then yields what `body` makes of the running request; if it cannot
/// start (timeout), what `refused` makes of the error.
pub fn stream_after_start<F, S>(
    pending: Pending,
    period: Duration,
    body: F,
    refused: fn(&ApiError) -> Vec<Bytes>,
) -> impl Stream<Item = Bytes>
where
    F: FnOnce(Running) -> S,
    S: Stream<Item = Bytes>,
{
    let model = pending.launch.model.clone();
    let app = pending.app.clone();
    let (request_id, endpoint, arrival) = (
        pending.request_id.clone(),
        pending.launch.endpoint,
        pending.arrival,
    );
    async_stream::stream! {
        let start = pending.start();
        tokio::pin!(start);
        let started = loop {
            tokio::select! {
                r = &mut start => break r,
                _ = tokio::time::sleep(period) => yield crate::sse::keep_alive(),
            }
        };
        match started {
            Ok(running) => {
                let events = body(running);
                tokio::pin!(events);
                while let Some(event) = events.next().await {
                    yield event;
                }
            }
            Err(e) => {
                // No `Running` ever existed to account for this request: do it here.
                let outcome = if e.status == 408 { "timeout" } else { "error" };
                model.metrics.finished(outcome);
                app.endpoint_metrics.finished(endpoint, outcome);
                tracing::info!(
                    target: "novainfer::request",
                    request_id = %request_id,
                    endpoint,
                    model = %model.name,
                    status = e.status.as_u16(),
                    latency_ms = log_ms(arrival.elapsed()),
                    error = %e.message,
                    "request"
                );
                for event in refused(&e) {
                    yield event;
                }
            }
        }
    }
}
