//! Finished Responses (`/v1/responses`) kept by the server, so a follow-up request can name one
//! by `previous_response_id` instead of resending the conversation, and `GET`/`DELETE
//! /v1/responses/{id}` can find it.
//!
//! Bounded three ways: an entry older than the TTL is gone (checked on every access, and swept
//! with the sessions), and past `max` entries or `max_bytes` of text the oldest is dropped (a
//! conversation is kept whole with each response, so count alone would not bound memory). Entries belong to the API
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
    /// [`StoredResponse::size`], counted against `max_bytes`.
    size: usize,
    response: Arc<StoredResponse>,
}

impl StoredResponse {
    /// Roughly the bytes it holds: its texts and the object's JSON.
    pub fn size(&self) -> usize {
        let object = serde_json::to_string(&self.object).map_or(0, |s| s.len());
        let conversation: usize = self
            .conversation
            .iter()
            .map(|m| {
                m.content.len()
                    + m.tool_calls
                        .iter()
                        .map(|c| c.name.len() + c.arguments.to_string().len())
                        .sum::<usize>()
            })
            .sum();
        object + conversation
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    /// The sizes of `entries`, summed.
    bytes: usize,
    /// Keys in the order they were stored (deleted ones linger until they reach the front).
    order: VecDeque<(Key, Instant)>,
}

pub struct ResponseStore {
    ttl: Duration,
    max: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(ttl: Duration, max: usize, max_bytes: usize) -> Self {
        Self {
            ttl,
            max,
            max_bytes,
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

    /// Stores `response` as `id` of `tenant`; one larger than `max_bytes` alone is not kept.
    pub fn insert(&self, tenant: Tenant, id: &str, response: StoredResponse, now: Instant) {
        let size = response.size();
        if self.max == 0 || size > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        let key = (tenant, id.to_owned());
        let old = inner.entries.insert(
            key.clone(),
            Entry {
                created: now,
                size,
                response: Arc::new(response),
            },
        );
        inner.bytes = inner.bytes + size - old.map_or(0, |e| e.size);
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
        let mut inner = self.lock();
        match inner.entries.remove(&(tenant, id.to_owned())) {
            Some(e) => {
                inner.bytes -= e.size;
                true
            }
            None => false,
        }
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
            if live && !expired && inner.entries.len() <= self.max && inner.bytes <= self.max_bytes
            {
                break;
            }
            inner.order.pop_front();
            if live {
                if let Some(e) = inner.entries.remove(&key) {
                    inner.bytes -= e.size;
                }
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
        let store = ResponseStore::new(Duration::from_secs(10), 100, 1 << 20);
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
        let store = ResponseStore::new(Duration::from_secs(100), 2, 1 << 20);
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
        let store = ResponseStore::new(Duration::from_secs(100), 10, 1 << 20);
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
        let none = ResponseStore::new(Duration::from_secs(100), 0, 1 << 20);
        none.insert(T0, "a", stored("a"), t0);
        assert!(none.is_empty() && !none.enabled());
    }

    #[test]
    fn the_oldest_goes_past_the_byte_cap_and_an_oversized_one_is_not_kept() {
        let one = stored(&"x".repeat(100)).size();
        let store = ResponseStore::new(Duration::from_secs(100), 100, 2 * one + one / 2);
        let t0 = Instant::now();
        for id in ["a", "b", "c"] {
            store.insert(T0, id, stored(&"x".repeat(100)), t0);
        }
        assert_eq!(store.len(), 2);
        assert!(store.get(T0, "a", t0).is_none());
        store.insert(T0, "big", stored(&"x".repeat(10 * one)), t0);
        assert!(store.get(T0, "big", t0).is_none());
        assert_eq!(store.len(), 2);
        assert!(store.delete(T0, "b") && store.delete(T0, "c"));
        store.insert(T0, "d", stored(&"x".repeat(100)), t0);
        store.insert(T0, "e", stored(&"x".repeat(100)), t0);
        assert_eq!(store.len(), 2, "deleting gave the bytes back");
    }
}
