//! Running engine requests from async handlers, and cancelling them.
//!
//! [`Generation`] submits one engine request per prompt (all in one submission, so they enter the
//! engine's same step), each delivering its deltas straight
//! into one tokio channel (a [`DeltaSink`] run on the engine's output thread), so a request
//! holds no thread while it waits for tokens. Dropping a
//! `Generation` before its streams end (client gone, timeout, handler error) aborts every
//! engine request through its `AbortHandle` at once, even one still queued that has produced
//! no delta yet, so its KV blocks are free at the next engine step. If the engine dies, its
//! sinks are dropped with completions unfinished: the next item is the engine's error.
//!
//! [`CancelRegistry`] maps request ids to the [`CancelSlot`] of each request in flight, for
//! `POST /v1/requests/{id}/cancel`: a request is cancellable from arrival, while still
//! queued for a permit (it then ends without running) as well as in the engine (its engine
//! requests are aborted). A [`Registration`] removes its entry when dropped. Entries carry
//! the [`Tenant`] that made them: a cancel from another API key finds nothing (a 404, as if
//! the id were unknown, so ids of other tenants' requests are not even confirmed).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use novainfer_engine::{
    AbortHandle, CheckedRequest, Delta, DeltaSink, EngineError, EngineHandle, Scheduling,
};
use tokio::sync::{mpsc, Notify};

use crate::error::ApiError;
use crate::keys::Tenant;

/// A delta of prompt `prompt` (index into the request's prompts).
pub type Item = (usize, Result<Delta, EngineError>);

pub struct Generation {
    rx: mpsc::UnboundedReceiver<Item>,
    aborts: Vec<AbortHandle>,
    /// Per prompt, completions without their last delta yet.
    unfinished: Vec<usize>,
    /// To ask why the engine stopped, when the channel closes early.
    handle: Option<Arc<EngineHandle>>,
    ended: bool,
}

impl Generation {
    /// Submits every request (one per prompt, all with the same parameters, checked by
    /// `Frontend::check_request`); nothing runs unless all are accepted.
    pub fn start(
        handle: &Arc<EngineHandle>,
        requests: Vec<CheckedRequest>,
        scheduling: Scheduling,
    ) -> Result<Self, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let unfinished = requests.iter().map(|r| r.params().n()).collect();
        let requests = requests
            .into_iter()
            .enumerate()
            .map(|(i, request)| {
                let tx = tx.clone();
                let sink = DeltaSink::new(move |item| tx.send((i, item)).is_ok());
                (request, scheduling.clone(), sink)
            })
            .collect();
        // One submission: the prompts enter the engine's same step, or none does.
        let aborts = handle.submit_checked_batch_to(requests)?;
        Ok(Self {
            rx,
            aborts,
            unfinished,
            handle: Some(handle.clone()),
            ended: false,
        })
    }

    /// A generation that never ran (cancelled while queued): it ends at once.
    pub fn empty() -> Self {
        let (_, rx) = mpsc::unbounded_channel();
        Self {
            rx,
            aborts: Vec::new(),
            unfinished: Vec::new(),
            handle: None,
            ended: false,
        }
    }

    /// The next delta of any prompt; `None` once every engine request has ended.
    pub async fn next(&mut self) -> Option<Item> {
        let Some((i, item)) = self.rx.recv().await else {
            self.ended = true;
            // Every sink is gone with a completion unfinished: the engine died.
            let i = self.unfinished.iter().position(|&u| u > 0)?;
            self.unfinished[i] = 0;
            let error = self
                .handle
                .as_ref()
                .map_or(EngineError::EngineStopped, |h| h.stopped_error());
            return Some((i, Err(error)));
        };
        match &item {
            Ok(d) if d.finish_reason.is_none() => {}
            Ok(_) => self.unfinished[i] = self.unfinished[i].saturating_sub(1),
            Err(_) => {
                // An error ends that prompt's request; its other completions end with it.
                self.aborts[i].abort();
                self.unfinished[i] = 0;
            }
        }
        Some((i, item))
    }

    pub fn abort_handles(&self) -> Vec<AbortHandle> {
        self.aborts.clone()
    }

    pub fn abort(&self) {
        for a in &self.aborts {
            a.abort();
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.ended {
            self.abort();
        }
    }
}

/// One request's cancellation state: cancellable from arrival, whether queued or running.
#[derive(Default)]
pub struct CancelSlot {
    aborts: Mutex<Vec<AbortHandle>>,
    cancelled: AtomicBool,
    notify: Notify,
}

impl CancelSlot {
    fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
        for a in self.aborts.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            a.abort();
        }
    }

    /// Records the engine requests to abort; aborts them at once if cancelled meanwhile.
    pub fn arm(&self, aborts: Vec<AbortHandle>) {
        *self.aborts.lock().unwrap_or_else(|e| e.into_inner()) = aborts;
        if self.is_cancelled() {
            self.cancel();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Resolves once the request is cancelled.
    pub async fn cancelled(&self) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Registered as a waiter before the check, so a cancel in between is not missed.
        notified.as_mut().enable();
        if !self.is_cancelled() {
            notified.await;
        }
    }
}

type Entries = HashMap<String, Vec<(u64, Tenant, Arc<CancelSlot>)>>;

/// Request ids of requests in flight → how to cancel them.
#[derive(Default)]
pub struct CancelRegistry {
    entries: Mutex<Entries>,
    next_token: AtomicU64,
}

/// Keeps a request cancellable while alive.
pub struct Registration {
    registry: Arc<CancelRegistry>,
    keys: Vec<String>,
    token: u64,
    slot: Arc<CancelSlot>,
}

impl Registration {
    pub fn slot(&self) -> &CancelSlot {
        &self.slot
    }
}

impl CancelRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes a request cancellable under each of `keys` (its response id, its X-Request-Id).
    pub fn register(self: &Arc<Self>, tenant: Tenant, keys: Vec<String>) -> Registration {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(CancelSlot::default());
        let mut entries = self.lock();
        for key in &keys {
            entries
                .entry(key.clone())
                .or_default()
                .push((token, tenant, slot.clone()));
        }
        Registration {
            registry: self.clone(),
            keys,
            token,
            slot,
        }
    }

    /// Cancels every request of `tenant` in flight under `key`; false if there is none.
    pub fn cancel(&self, tenant: Tenant, key: &str) -> bool {
        let entries = self.lock();
        let mut found = false;
        for (_, owner, slot) in entries.get(key).into_iter().flatten() {
            if *owner == tenant {
                slot.cancel();
                found = true;
            }
        }
        found
    }

    /// Cancels every request in flight (the end of a shutdown's grace period).
    pub fn cancel_all(&self) -> usize {
        let entries = self.lock();
        let mut slots: Vec<&Arc<CancelSlot>> =
            entries.values().flatten().map(|(_, _, s)| s).collect();
        // A request is listed under each of its ids: cancel it once.
        slots.sort_by_key(|s| Arc::as_ptr(s));
        slots.dedup_by_key(|s| Arc::as_ptr(s));
        for slot in &slots {
            slot.cancel();
        }
        slots.len()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut entries = self.registry.lock();
        for key in &self.keys {
            if let Some(requests) = entries.get_mut(key) {
                requests.retain(|(t, _, _)| *t != self.token);
                if requests.is_empty() {
                    entries.remove(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const T0: Tenant = Tenant(None);

    #[test]
    fn only_the_owning_tenant_can_cancel() {
        let registry = Arc::new(CancelRegistry::default());
        let mine = registry.register(Tenant(Some(0)), vec!["r".into()]);
        assert!(!registry.cancel(Tenant(Some(1)), "r"));
        assert!(!mine.slot().is_cancelled());
        assert!(registry.cancel(Tenant(Some(0)), "r"));
        assert!(mine.slot().is_cancelled());
    }

    #[test]
    fn cancel_all_cancels_each_request_once() {
        let registry = Arc::new(CancelRegistry::default());
        let a = registry.register(T0, vec!["cmpl-1".into(), "1".into()]);
        let b = registry.register(Tenant(Some(3)), vec!["2".into()]);
        assert_eq!(registry.cancel_all(), 2);
        assert!(a.slot().is_cancelled() && b.slot().is_cancelled());
    }

    #[test]
    fn registration_lives_as_long_as_its_guard() {
        let registry = Arc::new(CancelRegistry::default());
        let a = registry.register(T0, vec!["cmpl-1".into(), "1".into()]);
        let b = registry.register(T0, vec!["1".into()]);
        assert!(registry.cancel(T0, "cmpl-1") && registry.cancel(T0, "1"));
        assert!(a.slot().is_cancelled() && b.slot().is_cancelled());
        assert!(!registry.cancel(T0, "2"));
        drop(a);
        assert!(!registry.cancel(T0, "cmpl-1"));
        assert!(registry.cancel(T0, "1"));
        drop(b);
        assert!(registry.is_empty());
    }

    #[tokio::test]
    async fn a_cancel_wakes_the_waiter_even_before_it_waits() {
        let registry = Arc::new(CancelRegistry::default());
        let r = registry.register(T0, vec!["x".into()]);
        registry.cancel(T0, "x");
        tokio::time::timeout(Duration::from_secs(1), r.slot().cancelled())
            .await
            .expect("already cancelled");
        let r2 = Arc::new(registry.register(T0, vec!["y".into()]));
        let waiter = {
            let r2 = r2.clone();
            tokio::spawn(async move { r2.slot().cancelled().await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        registry.cancel(T0, "y");
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken")
            .expect("joins");
    }
}
