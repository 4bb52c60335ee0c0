//! Admission control: at most `max_concurrent` requests hold a permit (are in the engine);
//! at most `max_queued` more wait for one; anything past that is refused at once with 429,
//! so overload never turns into an unbounded queue or a hang. Per-user budgets are in
//! [`crate::budget`], API keys in [`crate::keys`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
}
