//! Admission control for work other than generation (generation's own, fair between tenants,
//! is [`crate::fair_admission`]): at most `max_concurrent` hold a permit; at most `max_queued`
//! more wait for one; anything past that is refused at once with 429, so overload never turns
//! into an unbounded queue or a hang. Per-user budgets are in [`crate::budget`], API keys in
//! [`crate::keys`].
//!
//! Work that costs CPU or an engine forward before (or instead of) generating has pools of its
//! own ([`WorkLimits`]), admitted *before* the work runs: rendering and
//! tokenizing prompts, scoring prompts (`echo` with `logprobs`), embeddings. A flood of any of
//! them is then refused with 429 rather than piling up blocking threads or engine commands.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

pub struct Admission {
    /// What the permits are for and the flag that sizes them, for the 429 message.
    what: &'static str,
    flag: &'static str,
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
    /// A pool for `what`, sized by `--{flag}`.
    pub fn named(
        what: &'static str,
        flag: &'static str,
        max_concurrent: usize,
        max_queued: usize,
    ) -> Self {
        Self {
            what,
            flag,
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
                    "the server is at capacity for {} (--{} {}, \
                     --max-queued-requests {}); retry later",
                    self.what, self.flag, self.max_concurrent, self.max_queued
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

/// The pools of work other than generation; each queues at most `--max-queued-requests`.
pub struct WorkLimits {
    /// Chat-template rendering and tokenizing (`--max-concurrent-tokenize`), on blocking threads.
    pub tokenize: Admission,
    /// Prompt scoring, `echo` with `logprobs` (`--max-concurrent-scoring`): an engine forward
    /// over the whole prompt with a vocabulary row per token.
    pub scoring: Admission,
    /// Embedding requests (`--max-concurrent-embeddings`): one engine forward per input.
    pub embeddings: Admission,
}

impl WorkLimits {
    pub fn new(tokenize: usize, scoring: usize, embeddings: usize, max_queued: usize) -> Self {
        Self {
            tokenize: Admission::named(
                "tokenizing",
                "max-concurrent-tokenize",
                tokenize,
                max_queued,
            ),
            scoring: Admission::named(
                "prompt scoring",
                "max-concurrent-scoring",
                scoring,
                max_queued,
            ),
            embeddings: Admission::named(
                "embeddings",
                "max-concurrent-embeddings",
                embeddings,
                max_queued,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn queue_overflow_is_refused_not_queued() {
        let a = Arc::new(Admission::named(
            "requests",
            "max-concurrent-requests",
            1,
            1,
        ));
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

    #[tokio::test]
    async fn a_work_pool_names_its_flag() {
        let limits = WorkLimits::new(1, 1, 1, 0);
        let _held = limits.embeddings.admit().await.expect("first runs");
        let e = limits.embeddings.admit().await.expect_err("no queue");
        assert_eq!(e.status, 429);
        assert!(
            e.message.contains("--max-concurrent-embeddings 1"),
            "{}",
            e.message
        );
        // The other pools are independent.
        let _scoring = limits.scoring.admit().await.expect("own pool");
    }
}
