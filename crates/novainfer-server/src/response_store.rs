//! Finished Responses (`/v1/responses`) kept by the server, so a follow-up request can name one
//! by `previous_response_id` instead of resending the conversation, and `GET`/`DELETE
//! /v1/responses/{id}` can find it.
//!
//! Bounded both ways: an entry older than the TTL is gone (checked on every access, and swept
//! with the sessions), and past `max` entries the oldest is dropped. Entries belong to the API
//! key (tenant) that created them: another key asking for the same id finds nothing. A
//! follow-up re-renders the stored conversation, so its prompt starts with the previous
//! turn's tokens and the engine's prefix cache serves them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use novainfer_engine::ChatMessage;
use serde_json::Value;

use crate::keys::Tenant;

/// What is kept of one response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// The served model that answered (a follow-up must use the same one).
    pub model: String,
    /// The `response` object as it was returned.
    pub object: Value,
    /// The conversation through this response's output, without its `instructions` (which a
    /// follow-up does not inherit): input items, then the reply as the model wrote it.
    pub conversation: Vec<ChatMessage>,
}

type Key = (Tenant, String);

struct Entry {
    created: Instant,
    response: Arc<StoredResponse>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    /// Keys in the order they were stored (deleted ones linger until they reach the front).
    order: VecDeque<(Key, Instant)>,
}

pub struct ResponseStore {
    ttl: Duration,
    max: usize,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            ttl,
            max,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // No update leaves the maps half-done on a panic: recover the lock.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the store keeps anything at all (`--max-stored-responses 0` keeps nothing).
    pub fn enabled(&self) -> bool {
        self.max > 0
    }

    pub fn insert(&self, tenant: Tenant, id: &str, response: StoredResponse, now: Instant) {
        if self.max == 0 {
            return;
        }
        let mut inner = self.lock();
        let key = (tenant, id.to_owned());
        inner.entries.insert(
            key.clone(),
            Entry {
                created: now,
                response: Arc::new(response),
            },
        );
        inner.order.push_back((key, now));
        self.sweep(&mut inner, now);
    }

    /// The stored response `id` of `tenant`, unless it expired.
    pub fn get(&self, tenant: Tenant, id: &str, now: Instant) -> Option<Arc<StoredResponse>> {
        let mut inner = self.lock();
        self.sweep(&mut inner, now);
        inner
            .entries
            .get(&(tenant, id.to_owned()))
            .map(|e| e.response.clone())
    }

    /// Forgets response `id` of `tenant`; whether there was one.
    pub fn delete(&self, tenant: Tenant, id: &str) -> bool {
        self.lock()
            .entries
            .remove(&(tenant, id.to_owned()))
            .is_some()
    }

    /// Drops what expired; returns how many remain.
    pub fn expire(&self, now: Instant) -> usize {
        let mut inner = self.lock();
        self.sweep(&mut inner, now);
        inner.entries.len()
    }

    /// Drops expired entries and, past the cap, the oldest ones. Entries are stored in time
    /// order, so both come off the front.
    fn sweep(&self, inner: &mut Inner, now: Instant) {
        while let Some((key, stored_at)) = inner.order.front().cloned() {
            let live = inner
                .entries
                .get(&key)
                .is_some_and(|e| e.created == stored_at);
            let expired = now.saturating_duration_since(stored_at) > self.ttl;
            if live && !expired && inner.entries.len() <= self.max {
                break;
            }
            inner.order.pop_front();
            if live {
                inner.entries.remove(&key);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(text: &str) -> StoredResponse {
        StoredResponse {
            model: "m".into(),
            object: Value::from(text),
            conversation: vec![ChatMessage::new("user", text)],
        }
    }

    const T0: Tenant = Tenant(None);

    #[test]
    fn found_by_its_owner_until_it_expires() {
        let store = ResponseStore::new(Duration::from_secs(10), 100);
        let t0 = Instant::now();
        store.insert(T0, "resp_a", stored("a"), t0);
        let got = store
            .get(T0, "resp_a", t0 + Duration::from_secs(9))
            .expect("alive");
        assert_eq!(got.object, Value::from("a"));
        assert!(store.get(Tenant(Some(1)), "resp_a", t0).is_none());
        assert!(store
            .get(T0, "resp_a", t0 + Duration::from_secs(11))
            .is_none());
        assert!(store.is_empty());
    }

    #[test]
    fn the_oldest_goes_past_the_cap() {
        let store = ResponseStore::new(Duration::from_secs(100), 2);
        let t0 = Instant::now();
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            store.insert(T0, id, stored(id), t0 + Duration::from_secs(i as u64));
        }
        assert_eq!(store.len(), 2);
        assert!(store.get(T0, "a", t0).is_none());
        assert!(store.get(T0, "c", t0).is_some());
    }

    #[test]
    fn deleted_is_gone_and_a_zero_cap_keeps_nothing() {
        let store = ResponseStore::new(Duration::from_secs(100), 10);
        let t0 = Instant::now();
        store.insert(T0, "a", stored("a"), t0);
        assert!(!store.delete(Tenant(Some(3)), "a"));
        assert!(store.delete(T0, "a"));
        assert!(!store.delete(T0, "a"));
        assert!(store.get(T0, "a", t0).is_none());
        // A re-stored id outlives its deleted predecessor's place in the order.
        store.insert(T0, "b", stored("b"), t0);
        store.insert(T0, "b", stored("b2"), t0 + Duration::from_secs(1));
        assert_eq!(
            store.get(T0, "b", t0).expect("stored").object,
            Value::from("b2")
        );
        let none = ResponseStore::new(Duration::from_secs(100), 0);
        none.insert(T0, "a", stored("a"), t0);
        assert!(none.is_empty() && !none.enabled());
    }
}
