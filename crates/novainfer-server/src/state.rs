//! What every handler shares: the served models, limits, sessions, cancel registry and
//! metrics. Built once at start-up; all mutable parts synchronise themselves.

use std::sync::Arc;
use std::time::Duration;

use crate::generation::CancelRegistry;
use crate::limits::{Admission, ApiKeys, TokenBudget};
use crate::metrics::ServerMetrics;
use crate::models::Models;
use crate::sessions::SessionStore;

pub struct AppState {
    pub models: Models,
    pub admission: Admission,
    pub budget: Option<TokenBudget>,
    pub api_keys: Option<ApiKeys>,
    pub sessions: SessionStore,
    pub cancels: Arc<CancelRegistry>,
    pub metrics: ServerMetrics,
    /// Server-wide request timeout.
    pub timeout: Option<Duration>,
    pub keep_alive: Duration,
    pub max_body_bytes: usize,
}

/// The id of the HTTP request being served (from `X-Request-Id`, or generated).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);
