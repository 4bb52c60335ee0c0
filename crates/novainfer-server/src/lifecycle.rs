//! Liveness, readiness and the shutdown phase.
//!
//! - Live (`/health`): every model's engine thread is running. An engine thread that died
//!   (a panic in a step) makes `/health` 503 for good; a supervisor should restart us.
//! - Ready (`/ready`): live, warmed up, and not draining. The port opens once every model is
//!   loaded; each engine then runs one short generation (so the first user request does not
//!   pay for first-touch page faults and buffer growth) before `/ready` turns 200. Draining
//!   starts at SIGTERM/SIGINT or when an engine dies (unless `--no-exit-on-engine-failure`):
//!   new generation requests get 503 while the running ones finish.
//!
//! The first engine failure is kept (model and message) so the process can exit non-zero
//! saying why, once it has drained.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tokio::sync::Notify;

use crate::error::ApiError;
use crate::models::Models;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFailure {
    pub model: String,
    pub message: String,
}

/// Why the server began to drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainCause {
    Signal,
    EngineFailed(EngineFailure),
}

#[derive(Default)]
pub struct Lifecycle {
    warm: AtomicBool,
    draining: AtomicBool,
    cause: Mutex<Option<DrainCause>>,
    drain_started: Notify,
}

impl Lifecycle {
    /// Every engine has served its warm-up request.
    pub fn set_warm(&self) {
        self.warm.store(true, Ordering::SeqCst);
    }

    /// 503 until [`Self::set_warm`].
    pub fn warmed_up(&self) -> Result<(), ApiError> {
        if self.warm.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(ApiError::unavailable("the model is warming up").with_code("warming_up"))
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Starts draining; the first cause is kept. Returns false if already draining.
    pub fn start_draining(&self, cause: DrainCause) -> bool {
        let mut kept = self.cause.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.is_none() {
            *kept = Some(cause);
        }
        let first = !self.draining.swap(true, Ordering::SeqCst);
        self.drain_started.notify_waiters();
        first
    }

    pub fn cause(&self) -> Option<DrainCause> {
        self.cause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Resolves once draining has started (at once if it has).
    pub async fn draining(&self) {
        let notified = self.drain_started.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !self.is_draining() {
            notified.await;
        }
    }

    /// 503 for a new generation request while draining.
    pub fn admit(&self) -> Result<(), ApiError> {
        if self.is_draining() {
            Err(
                ApiError::unavailable("the server is shutting down; retry on another instance")
                    .with_code("shutting_down"),
            )
        } else {
            Ok(())
        }
    }
}

/// The first model whose engine thread has died, if any.
pub fn engine_failure(models: &Models) -> Option<EngineFailure> {
    models.0.iter().find_map(|m| {
        m.handle.failure().map(|message| EngineFailure {
            model: m.name.clone(),
            message,
        })
    })
}

/// `/health`'s refusal when an engine is dead.
pub fn not_live(failure: &EngineFailure) -> ApiError {
    ApiError::unavailable(format!(
        "the engine of model {} has stopped: {}",
        failure.model, failure.message
    ))
    .with_code("engine_dead")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_cause_is_kept_and_waiters_wake() {
        let l = std::sync::Arc::new(Lifecycle::default());
        assert_eq!(l.warmed_up().expect_err("cold").status, 503);
        l.set_warm();
        assert!(l.warmed_up().is_ok());
        assert!(l.admit().is_ok());
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.draining().await })
        };
        tokio::task::yield_now().await;
        assert!(l.start_draining(DrainCause::Signal));
        let failure = EngineFailure {
            model: "m".into(),
            message: "boom".into(),
        };
        assert!(!l.start_draining(DrainCause::EngineFailed(failure)));
        assert_eq!(l.cause(), Some(DrainCause::Signal));
        tokio::time::timeout(std::time::Duration::from_secs(1), waiter)
            .await
            .expect("woken")
            .expect("joins");
        assert_eq!(l.admit().expect_err("draining").status, 503);
    }
}
