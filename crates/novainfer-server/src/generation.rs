//! Running engine requests from async handlers, and cancelling them.
//!
//! [`Generation`] submits one engine request per prompt and forwards each blocking
//! `RequestStream` into one tokio channel from a blocking-pool thread. Dropping a
//! `Generation` before its streams end (client gone, timeout, handler error) aborts every
//! engine request through its `AbortHandle` at once, even one still queued that has produced
//! no delta yet, so its KV blocks are free at the next engine step.
//!
//! [`CancelRegistry`] maps request ids to the abort handles of requests in flight, for
//! `POST /v1/requests/{id}/cancel`; a [`Registration`] removes its entry when dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use novainfer_core::SamplingParams;
use novainfer_engine::{AbortHandle, Delta, EngineError, EngineHandle};
use tokio::sync::mpsc;

use crate::error::ApiError;

/// A delta of prompt `prompt` (index into the request's prompts).
pub type Item = (usize, Result<Delta, EngineError>);

pub struct Generation {
    rx: mpsc::UnboundedReceiver<Item>,
    aborts: Vec<AbortHandle>,
    ended: bool,
}

impl Generation {
    /// Submits every prompt with the same parameters; nothing runs unless all are accepted.
    pub fn start(
        handle: &Arc<EngineHandle>,
        prompts: Vec<Vec<u32>>,
        params: &SamplingParams,
    ) -> Result<Self, ApiError> {
        for ids in &prompts {
            handle.frontend().max_new_tokens(ids.len(), params)?;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut streams = Vec::with_capacity(prompts.len());
        for ids in prompts {
            // On error the streams already submitted are dropped, which aborts them.
            streams.push(handle.submit(ids, params.clone())?);
        }
        let aborts = streams.iter().map(|s| s.abort_handle()).collect();
        for (i, stream) in streams.into_iter().enumerate() {
            let tx = tx.clone();
            tokio::task::spawn_blocking(move || {
                for item in stream {
                    if tx.send((i, item)).is_err() {
                        // The receiver is gone; dropping the stream aborts the request.
                        break;
                    }
                }
            });
        }
        Ok(Self {
            rx,
            aborts,
            ended: false,
        })
    }

    /// The next delta of any prompt; `None` once every engine request has ended.
    pub async fn next(&mut self) -> Option<Item> {
        let item = self.rx.recv().await;
        self.ended = item.is_none();
        item
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

type Entries = HashMap<String, Vec<(u64, Vec<AbortHandle>)>>;

/// Request ids of requests in flight → how to abort them.
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
}

impl CancelRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the request cancellable under each of `keys` (its response id, its X-Request-Id).
    pub fn register(self: &Arc<Self>, keys: Vec<String>, aborts: Vec<AbortHandle>) -> Registration {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.lock();
        for key in &keys {
            entries
                .entry(key.clone())
                .or_default()
                .push((token, aborts.clone()));
        }
        Registration {
            registry: self.clone(),
            keys,
            token,
        }
    }

    /// Aborts every request in flight under `key`; false if there is none.
    pub fn cancel(&self, key: &str) -> bool {
        let entries = self.lock();
        match entries.get(key) {
            Some(requests) if !requests.is_empty() => {
                for (_, aborts) in requests {
                    for a in aborts {
                        a.abort();
                    }
                }
                true
            }
            _ => false,
        }
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
                requests.retain(|(t, _)| *t != self.token);
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

    #[test]
    fn registration_lives_as_long_as_its_guard() {
        let registry = Arc::new(CancelRegistry::default());
        let a = registry.register(vec!["cmpl-1".into(), "1".into()], vec![]);
        let b = registry.register(vec!["1".into()], vec![]);
        assert!(registry.cancel("cmpl-1") && registry.cancel("1"));
        assert!(!registry.cancel("2"));
        drop(a);
        assert!(!registry.cancel("cmpl-1"));
        assert!(registry.cancel("1"));
        drop(b);
        assert!(registry.is_empty());
    }
}
