//! Launching a generation and driving it, shared by completions and chat: user budget,
//! admission (concurrency and queue limits), deadline, cancel registration, the event loop
//! (deltas, keep-alives, timeout) and the accounting done exactly once when the request
//! ends however it ends (finished, failed, timed out, cancelled, client gone).

use std::sync::Arc;
use std::time::{Duration, Instant};

use novainfer_core::SamplingParams;
use novainfer_engine::{Delta, EngineError};
use tokio::sync::OwnedSemaphorePermit;

use crate::accounting::RunState;
use crate::error::ApiError;
use crate::generation::{Generation, Registration};
use crate::models::ServedModel;
use crate::state::{AppState, RequestId};

pub struct Launch {
    pub model: Arc<ServedModel>,
    pub prompts: Vec<Vec<u32>>,
    pub params: SamplingParams,
    /// The request's own timeout in seconds.
    pub timeout: Option<f64>,
    pub user: Option<String>,
    pub endpoint: &'static str,
    /// The response object's id; also a cancel key.
    pub response_id: String,
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
    pub model: Arc<ServedModel>,
    deadline: Option<Instant>,
    timeout_secs: f64,
    /// How the request ended, for the log line and metrics (`None`: the client went away).
    pub outcome: Option<&'static str>,
    app: Arc<AppState>,
    request_id: String,
    endpoint: &'static str,
    user: String,
    _registration: Registration,
    _permit: OwnedSemaphorePermit,
}

/// Who is charged for the tokens: the `user` field, else one shared "anonymous" user.
fn user_of(launch_user: Option<String>) -> String {
    launch_user.unwrap_or_else(|| "anonymous".to_owned())
}

pub async fn launch(app: &Arc<AppState>, request_id: &RequestId, arrival: Instant, l: Launch) -> Result<Running, ApiError> {
    let user = user_of(l.user);
    if let Some(budget) = &app.budget {
        budget.check(&user, arrival).inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    }
    let timeout_secs = match (app.timeout.map(|d| d.as_secs_f64()), l.timeout) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let deadline = timeout_secs.map(|s| arrival + Duration::from_secs_f64(s));
    let admitted = match deadline {
        Some(d) => tokio::time::timeout_at(d.into(), app.admission.admit())
            .await
            .map_err(|_| ApiError::timeout(timeout_secs.unwrap_or_default()))?,
        None => app.admission.admit().await,
    };
    let permit = admitted.inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    let prompt_lens = l.prompts.iter().map(Vec::len).collect();
    let gen = Generation::start(&l.model.handle, l.prompts, &l.params)?;
    let registration = app
        .cancels
        .register(vec![l.response_id, request_id.0.clone()], gen.abort_handles());
    Ok(Running {
        gen,
        run: RunState::new(arrival, prompt_lens, l.params.n()),
        model: l.model,
        deadline,
        timeout_secs: timeout_secs.unwrap_or_default(),
        outcome: None,
        app: app.clone(),
        request_id: request_id.0.clone(),
        endpoint: l.endpoint,
        user,
        _registration: registration,
        _permit: permit,
    })
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
        self.run.record(prompt, delta, &self.model.metrics, Instant::now())
    }

    pub fn timeout_error(&self) -> ApiError {
        ApiError::timeout(self.timeout_secs)
    }

    /// Runs to the end without streaming: every delta recorded, or the error that stopped it.
    pub async fn collect(&mut self) -> Result<(), ApiError> {
        loop {
            match self.next_event(None).await {
                Event::Delta(prompt, delta) => {
                    self.record(prompt, &delta);
                }
                Event::Failed(e) => return Err(e.into()),
                Event::TimedOut => return Err(self.timeout_error()),
                Event::KeepAlive => {}
                Event::Ended => return Ok(()),
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or("abort");
        let usage = self.run.usage();
        let metrics = &self.model.metrics;
        use std::sync::atomic::Ordering::Relaxed;
        metrics.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Relaxed);
        metrics.generation_tokens.fetch_add(usage.completion_tokens as u64, Relaxed);
        metrics.cached_tokens.fetch_add(usage.prompt_tokens_details.cached_tokens as u64, Relaxed);
        let latency = self.run.arrival.elapsed();
        metrics.e2e.observe(latency.as_secs_f64());
        metrics.finished(outcome);
        if let Some(budget) = &self.app.budget {
            budget.charge(&self.user, usage.total_tokens as u64, Instant::now());
        }
        tracing::info!(
            target: "novainfer::request",
            request_id = %self.request_id,
            endpoint = self.endpoint,
            model = %self.model.name,
            status = 200,
            latency_ms = latency.as_secs_f64() * 1e3,
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            cached_tokens = usage.prompt_tokens_details.cached_tokens,
            finish_reason = outcome,
            "request"
        );
    }
}
