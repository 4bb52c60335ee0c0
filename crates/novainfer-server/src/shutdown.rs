//! Signals and the drain that follows them.
//!
//! The first SIGTERM or SIGINT starts a drain: no new connections, no new generation
//! requests (503), running requests get `--shutdown-grace` seconds to finish, then every
//! request still in flight is aborted (its choices end with `finish_reason: "abort"`, a
//! stream still gets its last chunks and `[DONE]`). A second signal exits at once.
//!
//! Handlers are registered before the models load, so a signal that arrives meanwhile is
//! kept, not lost to the previous handler (Python's, inside `novainfer serve`, which cannot
//! act on it while Rust holds the thread).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::lifecycle::{engine_failure, DrainCause};
use crate::listener::Connections;
use crate::state::AppState;

/// Exit status of a forced exit (a second signal), as shells report a SIGINT death.
const FORCED_EXIT: i32 = 130;

/// How long aborted streams get to send their last chunks after the grace period.
const ABORT_FLUSH: Duration = Duration::from_secs(5);

pub struct Signals {
    #[cfg(unix)]
    signals: [tokio::signal::unix::Signal; 2],
}

impl Signals {
    /// Must run inside the runtime.
    pub fn register() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                signals: [
                    signal(SignalKind::interrupt())?,
                    signal(SignalKind::terminate())?,
                ],
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves at the first signal, and from then on exits the process at the next one.
    pub async fn first(self) {
        #[cfg(unix)]
        {
            let [mut int, mut term] = self.signals;
            tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
            tokio::spawn(async move {
                tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
                tracing::warn!("second signal: exiting now");
                std::process::exit(FORCED_EXIT);
            });
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            tokio::spawn(async {
                let _ = tokio::signal::ctrl_c().await;
                std::process::exit(FORCED_EXIT);
            });
        }
    }
}

/// Polls the engines; on the first death logs it and, if `exit_on_failure`, starts a drain
/// (the process then exits non-zero). `/health` reports the death either way.
pub fn watch_engines(state: Arc<AppState>, exit_on_failure: bool) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tick.tick().await;
            if let Some(failure) = engine_failure(&state.models) {
                tracing::error!(model = %failure.model, message = %failure.message, "an engine thread died; /health now answers 503");
                if exit_on_failure {
                    state
                        .lifecycle
                        .start_draining(DrainCause::EngineFailed(failure));
                }
                return;
            }
        }
    });
}

/// Waits for a drain cause, then drains: stop accepting, let connections finish within the
/// grace period, abort what is left and give it a moment to flush.
pub async fn drain(
    state: &AppState,
    signals: Signals,
    stop: watch::Sender<bool>,
    conns: &Connections,
    grace: Duration,
) {
    tokio::select! {
        _ = signals.first() => {
            state.lifecycle.start_draining(DrainCause::Signal);
        }
        _ = state.lifecycle.draining() => {}
    }
    tracing::info!(
        open_connections = conns.num_open(),
        grace_s = grace.as_secs_f64(),
        "shutting down: no new requests; running ones may finish"
    );
    let _ = stop.send(true);
    if conns.wait_idle(grace).await {
        return;
    }
    let aborted = state.cancels.cancel_all();
    tracing::warn!(
        aborted,
        "grace period over: aborting the requests still running"
    );
    if !conns.wait_idle(ABORT_FLUSH).await {
        tracing::warn!(
            open_connections = conns.num_open(),
            "connections still open after the abort; closing them"
        );
    }
}
