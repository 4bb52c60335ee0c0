//! What every handler shares: the served models, limits, sessions, cancel registry and
//! metrics, connection timings and the server's lifecycle. Built once at start-up; all
//! mutable parts synchronise themselves.

use std::sync::Arc;
use std::time::Duration;

use crate::args::ServeArgs;
use crate::budget::TokenBudget;
use crate::endpoint_metrics::EndpointMetrics;
use crate::fair_admission::FairAdmission;
use crate::generation::CancelRegistry;
use crate::keys::{ApiKeys, TenantWeights};
use crate::limits::WorkLimits;
use crate::metrics::ServerMetrics;
use crate::models::Models;
use crate::response_store::ResponseStore;
use crate::sessions::SessionStore;

pub struct AppState {
    pub models: Models,
    pub admission: FairAdmission,
    /// Each API key's share weight (`--tenant-weights`).
    pub tenant_weights: TenantWeights,
    pub work: WorkLimits,
    pub budget: Option<TokenBudget>,
    pub api_keys: Option<ApiKeys>,
    pub sessions: SessionStore,
    pub cancels: Arc<CancelRegistry>,
    pub metrics: ServerMetrics,
    /// Finished generation requests by endpoint.
    pub endpoint_metrics: EndpointMetrics,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: ResponseStore,
    /// Server-wide request timeout.
    pub timeout: Option<Duration>,
    pub keep_alive: Duration,
    pub max_body_bytes: usize,
    pub durations: Durations,
    /// `--allowed-hosts`, lower-cased; `None`: any Host.
    pub allowed_hosts: Option<Vec<String>>,
    pub lifecycle: crate::lifecycle::Lifecycle,
    /// `--allow-runtime-lora`: the load/unload adapter endpoints answer.
    pub allow_runtime_lora: bool,
}

/// Connection and shutdown timings (`--header-read-timeout` and friends).
#[derive(Debug, Clone, Copy)]
pub struct Durations {
    pub header_read: Duration,
    pub body_read: Duration,
    pub idle: Duration,
    pub shutdown_grace: Duration,
}

impl Durations {
    /// The server-wide durations of `args` (range-checked by `ServeArgs::check`).
    pub fn of(args: &ServeArgs) -> Self {
        let secs = Duration::from_secs_f64;
        Self {
            header_read: secs(args.header_read_timeout),
            body_read: secs(args.body_read_timeout),
            idle: secs(args.idle_timeout),
            shutdown_grace: secs(args.shutdown_grace),
        }
    }
}

/// The id of the HTTP request being served (from `X-Request-Id`, or generated).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);
