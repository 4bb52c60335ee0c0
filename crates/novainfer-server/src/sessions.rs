//! Server-kept conversations (`session_id`), so a follow-up turn re-renders the same prompt
//! prefix and the engine's prefix cache serves the previous turns' KV.
//!
//! Merging rule: if a request's messages start with the stored history, they are the whole
//! conversation (clients that resend history, like the Web UI); otherwise they are appended
//! to it. Only a finished reply is stored (an aborted or failed turn leaves the session as it
//! was). Sessions idle longer than the TTL expire; past `max_sessions` the least recently
//! used is dropped. Sessions belong to the tenant (API key) that created them: another key
//! asking for the same id finds nothing and starts its own.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use novainfer_engine::ChatMessage;

use crate::keys::Tenant;

/// Longest accepted session id.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// (owner, served model name, session id).
type Key = (Tenant, String, String);

struct Session {
    messages: Vec<ChatMessage>,
    last_used: Instant,
}

pub struct SessionStore {
    ttl: Duration,
    max_sessions: usize,
    sessions: Mutex<HashMap<Key, Session>>,
}

/// The conversation a request continues.
pub fn merge(stored: &[ChatMessage], request: Vec<ChatMessage>) -> Vec<ChatMessage> {
    if request.starts_with(stored) {
        request
    } else {
        let mut all = stored.to_vec();
        all.extend(request);
        all
    }
}

impl SessionStore {
    pub fn new(ttl: Duration, max_sessions: usize) -> Self {
        Self {
            ttl,
            max_sessions,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Session>> {
        // A panic while holding the lock cannot leave a map half-updated: recover it.
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The whole conversation for this turn: stored history merged with the request's messages.
    pub fn conversation(
        &self,
        tenant: Tenant,
        model: &str,
        id: &str,
        request: Vec<ChatMessage>,
        now: Instant,
    ) -> Vec<ChatMessage> {
        let mut sessions = self.lock();
        let key = (tenant, model.to_owned(), id.to_owned());
        match sessions.get_mut(&key) {
            Some(s) if now.duration_since(s.last_used) <= self.ttl => {
                s.last_used = now;
                merge(&s.messages, request)
            }
            Some(_) => {
                sessions.remove(&key);
                request
            }
            None => request,
        }
    }

    /// Records a finished turn: the conversation that was sent plus the assistant's reply.
    pub fn store(
        &self,
        tenant: Tenant,
        model: &str,
        id: &str,
        mut conversation: Vec<ChatMessage>,
        reply: ChatMessage,
        now: Instant,
    ) {
        conversation.push(reply);
        let mut sessions = self.lock();
        sessions.insert(
            (tenant, model.to_owned(), id.to_owned()),
            Session {
                messages: conversation,
                last_used: now,
            },
        );
        if sessions.len() > self.max_sessions {
            if let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| k.clone())
            {
                sessions.remove(&oldest);
            }
        }
    }

    /// Drops sessions idle for longer than the TTL; returns how many remain.
    pub fn expire(&self, now: Instant) -> usize {
        let mut sessions = self.lock();
        sessions.retain(|_, s| now.duration_since(s.last_used) <= self.ttl);
        sessions.len()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Tenant = Tenant(None);

    fn m(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    #[test]
    fn resent_history_is_the_whole_conversation() {
        let stored = vec![m("user", "hi"), m("assistant", "hello")];
        let resent = vec![m("user", "hi"), m("assistant", "hello"), m("user", "more")];
        assert_eq!(merge(&stored, resent.clone()), resent);
    }

    #[test]
    fn a_new_turn_is_appended() {
        let stored = vec![m("user", "hi"), m("assistant", "hello")];
        assert_eq!(
            merge(&stored, vec![m("user", "more")]),
            vec![m("user", "hi"), m("assistant", "hello"), m("user", "more")]
        );
    }

    #[test]
    fn store_then_continue_then_expire() {
        let store = SessionStore::new(Duration::from_secs(10), 100);
        let t0 = Instant::now();
        let first = store.conversation(T0, "m", "s", vec![m("user", "hi")], t0);
        store.store(T0, "m", "s", first, m("assistant", "hello"), t0);
        let second = store.conversation(
            T0,
            "m",
            "s",
            vec![m("user", "more")],
            t0 + Duration::from_secs(5),
        );
        assert_eq!(
            second,
            vec![m("user", "hi"), m("assistant", "hello"), m("user", "more")]
        );
        // Another model's session of the same id is separate.
        assert_eq!(
            store
                .conversation(T0, "other", "s", vec![m("user", "x")], t0)
                .len(),
            1
        );
        // Touched at t0+5: still alive at t0+14, gone at t0+16.
        assert_eq!(store.expire(t0 + Duration::from_secs(14)), 1);
        assert_eq!(store.expire(t0 + Duration::from_secs(16)), 0);
        assert_eq!(
            store
                .conversation(T0, "m", "s", vec![m("user", "x")], t0)
                .len(),
            1
        );
    }

    #[test]
    fn least_recently_used_is_dropped_past_the_cap() {
        let store = SessionStore::new(Duration::from_secs(100), 2);
        let t0 = Instant::now();
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            store.store(
                T0,
                "m",
                id,
                vec![],
                m("assistant", "r"),
                t0 + Duration::from_secs(i as u64),
            );
        }
        assert_eq!(store.len(), 2);
        assert_eq!(store.conversation(T0, "m", "a", vec![], t0).len(), 0);
        assert_eq!(store.conversation(T0, "m", "c", vec![], t0).len(), 1);
    }

    #[test]
    fn another_tenant_does_not_see_the_session() {
        let store = SessionStore::new(Duration::from_secs(100), 10);
        let t0 = Instant::now();
        let owner = Tenant(Some(0));
        store.store(
            owner,
            "m",
            "s",
            vec![m("user", "secret")],
            m("assistant", "r"),
            t0,
        );
        let other = store.conversation(Tenant(Some(1)), "m", "s", vec![m("user", "x")], t0);
        assert_eq!(other, vec![m("user", "x")]);
        assert_eq!(store.conversation(owner, "m", "s", vec![], t0).len(), 2);
    }
}
