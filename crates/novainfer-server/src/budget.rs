//! Tokens (prompt + completion) each user may spend per fixed window (`--user-token-budget`).
//!
//! Users are keyed by (tenant, `user` field): with API keys on, two keys' holders who both
//! say `"user": "alice"` are two users. The map is bounded: `user` is at most
//! [`MAX_USER_LEN`] bytes (checked when a request is parsed) and at most `max_users` entries
//! are kept; past that the least recently charged tenth is dropped at once (one O(n) pass
//! per n/10 new users, not per request). A dropped user starts a fresh window, so the cap
//! bounds memory, not spending: keep it well above the number of active users.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::ApiError;
use crate::keys::Tenant;

/// Longest accepted `user` field, in bytes.
pub const MAX_USER_LEN: usize = 256;

/// The user charged for a request without a `user` field.
pub const ANONYMOUS: &str = "anonymous";

struct Spent {
    window_start: Instant,
    tokens: u64,
    last_used: Instant,
}

type Key = (Tenant, String);

pub struct TokenBudget {
    limit: u64,
    window: Duration,
    max_users: usize,
    used: Mutex<HashMap<Key, Spent>>,
}

/// Checks a request's `user` field: 400 naming `user` past [`MAX_USER_LEN`].
pub fn check_user(user: Option<&str>) -> Result<(), ApiError> {
    match user {
        Some(u) if u.len() > MAX_USER_LEN => Err(ApiError::invalid_param(
            "user",
            format!("user must be at most {MAX_USER_LEN} bytes, got {}", u.len()),
        )),
        _ => Ok(()),
    }
}

impl TokenBudget {
    pub fn new(limit: u64, window: Duration, max_users: usize) -> Self {
        Self {
            limit,
            window,
            max_users: max_users.max(1),
            used: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Spent>> {
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses a user who has spent the budget of the current window.
    pub fn check(&self, tenant: Tenant, user: &str, now: Instant) -> Result<(), ApiError> {
        let mut used = self.lock();
        let key = (tenant, user.to_owned());
        if let Some(spent) = used.get(&key) {
            let elapsed = now.saturating_duration_since(spent.window_start);
            if elapsed >= self.window {
                used.remove(&key);
            } else if spent.tokens >= self.limit {
                let retry = (self.window - elapsed).as_secs().max(1);
                return Err(ApiError::too_many_requests(
                    format!(
                        "user {user:?} has used {} of its {} tokens for this {} s window",
                        spent.tokens,
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
    pub fn charge(&self, tenant: Tenant, user: &str, tokens: u64, now: Instant) {
        let mut used = self.lock();
        let entry = used.entry((tenant, user.to_owned())).or_insert(Spent {
            window_start: now,
            tokens: 0,
            last_used: now,
        });
        if now.saturating_duration_since(entry.window_start) >= self.window {
            entry.window_start = now;
            entry.tokens = 0;
        }
        entry.tokens = entry.tokens.saturating_add(tokens);
        entry.last_used = now;
        if used.len() > self.max_users {
            evict_least_recent(&mut used, self.max_users);
        }
    }

    pub fn num_users(&self) -> usize {
        self.lock().len()
    }
}

/// Drops the least recently charged users so that a tenth of the cap is free again.
fn evict_least_recent(used: &mut HashMap<Key, Spent>, max_users: usize) {
    let keep = max_users - max_users / 10;
    let mut by_age: Vec<(Instant, Key)> =
        used.iter().map(|(k, s)| (s.last_used, k.clone())).collect();
    let drop = by_age.len().saturating_sub(keep);
    if drop == 0 {
        return;
    }
    by_age.select_nth_unstable_by_key(drop - 1, |(t, _)| *t);
    for (_, key) in by_age.into_iter().take(drop) {
        used.remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Tenant = Tenant(None);

    #[test]
    fn budget_refuses_until_the_window_ends() {
        let b = TokenBudget::new(100, Duration::from_secs(60), 10);
        let t0 = Instant::now();
        b.check(T0, "u", t0).expect("fresh user");
        b.charge(T0, "u", 120, t0);
        let e = b
            .check(T0, "u", t0 + Duration::from_secs(10))
            .expect_err("spent");
        assert_eq!(e.status, 429);
        assert_eq!(e.retry_after, Some(50));
        b.check(T0, "other", t0).expect("budgets are per user");
        b.check(T0, "u", t0 + Duration::from_secs(61))
            .expect("new window");
    }

    #[test]
    fn the_same_user_under_another_key_is_another_user() {
        let b = TokenBudget::new(10, Duration::from_secs(60), 10);
        let t0 = Instant::now();
        b.charge(Tenant(Some(0)), "alice", 50, t0);
        assert!(b.check(Tenant(Some(0)), "alice", t0).is_err());
        b.check(Tenant(Some(1)), "alice", t0)
            .expect("key 1's alice has spent nothing");
    }

    #[test]
    fn the_map_is_capped_dropping_the_least_recently_charged() {
        let b = TokenBudget::new(1, Duration::from_secs(600), 10);
        let t0 = Instant::now();
        for i in 0..10u64 {
            b.charge(T0, &format!("u{i}"), 5, t0 + Duration::from_secs(i));
        }
        assert_eq!(b.num_users(), 10);
        // u0 is charged again: now the most recent.
        b.charge(T0, "u0", 5, t0 + Duration::from_secs(20));
        b.charge(T0, "new", 5, t0 + Duration::from_secs(21));
        // 11 > 10: down to 9, dropping u1 and u2 (the oldest), keeping u0.
        assert_eq!(b.num_users(), 9);
        let later = t0 + Duration::from_secs(22);
        assert!(b.check(T0, "u0", later).is_err(), "u0 was kept");
        assert!(b.check(T0, "u3", later).is_err(), "u3 was kept");
        b.check(T0, "u1", later).expect("u1 was dropped");
        b.check(T0, "u2", later).expect("u2 was dropped");
    }

    #[test]
    fn long_user_names_are_refused() {
        check_user(Some(&"x".repeat(MAX_USER_LEN))).expect("at the limit");
        let e = check_user(Some(&"x".repeat(MAX_USER_LEN + 1))).expect_err("too long");
        assert_eq!(e.param.as_deref(), Some("user"));
        check_user(None).expect("absent");
    }
}
