//! Admission control and per-user accounting.
//!
//! - [`Admission`]: at most `max_concurrent` requests hold a permit (are in the engine);
//!   at most `max_queued` more wait for one; anything past that is refused at once with 429,
//!   so overload never turns into an unbounded queue or a hang.
//! - [`TokenBudget`]: tokens (prompt + completion) each user may spend per fixed window.
//! - [`ApiKeys`]: constant-time comparison against the configured keys.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use subtle::ConstantTimeEq;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

pub struct Admission {
    permits: Arc<Semaphore>,
    max_concurrent: usize,
    max_queued: usize,
    queued: Arc<AtomicUsize>,
}

/// A place in the queue; leaving it (permit granted, timeout, client gone) frees it.
pub struct QueueSlot(Arc<AtomicUsize>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The right to run now, or a place in the bounded queue.
pub enum Ticket {
    Ready(OwnedSemaphorePermit),
    Queued {
        permits: Arc<Semaphore>,
        slot: QueueSlot,
    },
}

impl Ticket {
    /// Waits (in the queue, if queued) for a permit.
    pub async fn wait(self) -> Result<OwnedSemaphorePermit, ApiError> {
        match self {
            Ticket::Ready(permit) => Ok(permit),
            Ticket::Queued { permits, slot } => {
                let permit = permits
                    .acquire_owned()
                    .await
                    .map_err(|_| ApiError::unavailable("the server is shutting down"));
                drop(slot);
                permit
            }
        }
    }
}

impl Admission {
    pub fn new(max_concurrent: usize, max_queued: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            max_queued,
            queued: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A permit or a queue place at once; 429 when the queue is full. Deciding this before
    /// answering lets a stream wait for its permit while already sending keep-alives.
    pub fn reserve(&self) -> Result<Ticket, ApiError> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Ok(Ticket::Ready(permit));
        }
        let queued = self.queued.fetch_add(1, Ordering::SeqCst);
        let slot = QueueSlot(self.queued.clone());
        if queued >= self.max_queued {
            return Err(ApiError::too_many_requests(
                format!(
                    "the server is at capacity (--max-concurrent-requests {}, \
                     --max-queued-requests {}); retry later",
                    self.max_concurrent, self.max_queued
                ),
                "server_overloaded",
                1,
            ));
        }
        Ok(Ticket::Queued {
            permits: self.permits.clone(),
            slot,
        })
    }

    /// A permit now, or after waiting in the bounded queue; 429 when the queue is full.
    pub async fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.reserve()?.wait().await
    }

    pub fn num_running(&self) -> usize {
        self.max_concurrent - self.permits.available_permits()
    }

    pub fn num_queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst).min(self.max_queued)
    }
}

/// Tokens per user per window; a user at or past the budget is refused until the window ends.
pub struct TokenBudget {
    limit: u64,
    window: Duration,
    used: Mutex<HashMap<String, (Instant, u64)>>,
}

impl TokenBudget {
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window,
            used: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, u64)>> {
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses a user who has spent the budget of the current window.
    pub fn check(&self, user: &str, now: Instant) -> Result<(), ApiError> {
        let mut used = self.lock();
        if let Some((start, spent)) = used.get(user).copied() {
            let elapsed = now.duration_since(start);
            if elapsed >= self.window {
                used.remove(user);
            } else if spent >= self.limit {
                let retry = (self.window - elapsed).as_secs().max(1);
                return Err(ApiError::too_many_requests(
                    format!(
                        "user {user:?} has used {spent} of its {} tokens for this {} s window",
                        self.limit,
                        self.window.as_secs()
                    ),
                    "token_budget_exceeded",
                    retry,
                ));
            }
        }
        Ok(())
    }

    /// Adds a finished request's tokens to the user's window.
    pub fn charge(&self, user: &str, tokens: u64, now: Instant) {
        let mut used = self.lock();
        let entry = used.entry(user.to_owned()).or_insert((now, 0));
        if now.duration_since(entry.0) >= self.window {
            *entry = (now, 0);
        }
        entry.1 += tokens;
    }
}

pub struct ApiKeys(Vec<Vec<u8>>);

impl ApiKeys {
    pub fn new(keys: &[String]) -> Option<Self> {
        (!keys.is_empty()).then(|| Self(keys.iter().map(|k| k.as_bytes().to_vec()).collect()))
    }

    /// True when `presented` equals a configured key; each comparison takes the same time
    /// whatever the position of the first differing byte.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        self.0
            .iter()
            .fold(subtle::Choice::from(0), |any, key| {
                any | key.as_slice().ct_eq(presented)
            })
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_overflow_is_refused_not_queued() {
        let a = Arc::new(Admission::new(1, 1));
        let held = a.admit().await.expect("first runs");
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(a.num_queued(), 1);
        let e = a.admit().await.expect_err("queue full");
        assert_eq!(e.status, 429);
        assert_eq!(e.retry_after, Some(1));
        drop(held);
        waiter.await.expect("joins").expect("the queued one runs");
        assert_eq!(a.num_queued(), 0);
        assert_eq!(a.num_running(), 0);
    }

    #[test]
    fn budget_refuses_until_the_window_ends() {
        let b = TokenBudget::new(100, Duration::from_secs(60));
        let t0 = Instant::now();
        b.check("u", t0).expect("fresh user");
        b.charge("u", 120, t0);
        let e = b
            .check("u", t0 + Duration::from_secs(10))
            .expect_err("spent");
        assert_eq!(e.status, 429);
        assert_eq!(e.retry_after, Some(50));
        b.check("other", t0).expect("budgets are per user");
        b.check("u", t0 + Duration::from_secs(61))
            .expect("new window");
    }

    #[test]
    fn api_keys() {
        let keys = ApiKeys::new(&["secret".into(), "other".into()]).expect("some keys");
        assert!(keys.accepts(b"secret") && keys.accepts(b"other"));
        assert!(!keys.accepts(b"secre") && !keys.accepts(b"") && !keys.accepts(b"secretx"));
        assert!(ApiKeys::new(&[]).is_none());
    }
}
