//! `novainfer-server`: NovaInfer's OpenAI-compatible HTTP server (axum + SSE) with the
//! embedded Web UI. [`serve`] loads every `--model`, binds, prints the URL and serves until
//! SIGINT/SIGTERM (then drains); the `novainfer-server` binary and Python's `novainfer serve` both call it.

pub mod accounting;
pub mod args;
pub mod budget;
pub mod endpoint_metrics;
pub mod engine_io;
pub mod error;
pub mod fair_admission;
pub mod generation;
pub mod ignored;
pub mod indent;
pub mod keys;
pub mod kv_config;
pub mod kv_events;
pub mod lifecycle;
pub mod limits;
pub mod listener;
pub mod metrics;
pub mod models;
pub mod params;
pub mod protocol;
pub mod reasoning;
pub mod response_store;
mod routes;
pub mod sessions;
pub mod shutdown;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tools;
pub mod transform;
mod ui;
pub mod vllm_metrics;
pub mod warmup;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use args::ServeArgs;
use novainfer_engine::{EngineError, EngineHandle};

use crate::budget::TokenBudget;
use crate::fair_admission::FairAdmission;
use crate::generation::CancelRegistry;
use crate::keys::{ApiKeys, TenantWeights};
use crate::kv_events::KvEventPublisher;
use crate::lifecycle::{DrainCause, Lifecycle};
use crate::limits::WorkLimits;
use crate::listener::{ConnLimits, Connections};
use crate::metrics::ServerMetrics;
use crate::models::{Models, ServedModel};
use crate::response_store::ResponseStore;
use crate::sessions::SessionStore;
use crate::shutdown::Signals;
use crate::state::AppState;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Args(#[from] args::ArgsError),
    #[error(transparent)]
    Resolve(#[from] models::ResolveError),
    #[error("loading model {model}: {source}")]
    Load { model: String, source: EngineError },
    #[error("two models are served as {0:?}; give each a distinct --served-model-name")]
    DuplicateName(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    KvEvents(#[from] kv_events::publisher::PublisherError),
    #[error("the engine of model {model} died ({message}); exiting after draining (--no-exit-on-engine-failure keeps serving)")]
    EngineFailed { model: String, message: String },
}

/// Logs to stderr; `RUST_LOG` overrides the default `info`. A second call is a no-op.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// `publisher`: where the (only) model's engine sends its KV-cache events, when on.
fn load_models(
    args: &ServeArgs,
    publisher: Option<Arc<KvEventPublisher>>,
) -> Result<Models, ServeError> {
    let created = protocol::response::unix_now();
    let mut models: Vec<Arc<ServedModel>> = Vec::new();
    for (i, spec) in args.model.iter().enumerate() {
        let (path, default_name) = models::resolve(spec)?;
        let name = args
            .served_model_name
            .get(i)
            .cloned()
            .unwrap_or(default_name);
        if models.iter().any(|m| m.name == name) {
            return Err(ServeError::DuplicateName(name));
        }
        tracing::info!(model = %name, path = %path.display(), "loading model");
        let mut config = args.engine_config(path.clone())?;
        config.lora = args.lora_config(&name, i == 0)?;
        config.kv_events = publisher
            .clone()
            .map(|p| p as Arc<dyn novainfer_core::KvEventSink>);
        let handle = EngineHandle::spawn(&config).map_err(|source| ServeError::Load {
            model: spec.clone(),
            source,
        })?;
        let kv_config = models::KvConfig::new(&config, handle.device().device);
        let mut served = ServedModel::new(
            name,
            path,
            handle,
            args.reasoning_parser,
            created,
            kv_config,
        );
        served.speculative = config.speculative.is_some();
        served.kv_events = publisher.clone();
        tracing::info!(model = %served.name, max_model_len = served.frontend.max_model_len(), reasoning = served.reasoning, "model ready");
        models.push(Arc::new(served));
    }
    let models = Models(models);
    check_lora_names(args, &models)?;
    Ok(models)
}

/// Every `--lora-modules` entry names a served model as its base, and no adapter shares a name
/// with a model or with another model's adapter (`model` in a request must name one thing).
fn check_lora_names(args: &ServeArgs, models: &Models) -> Result<(), ServeError> {
    let modules = args.lora_modules()?;
    if let Some(m) = modules.iter().find(|m| {
        m.base_model_name
            .as_ref()
            .is_some_and(|b| models.served(b).is_none())
    }) {
        return Err(args::ArgsError::from(novainfer_core::ParamError::new(
            "lora_modules",
            format!(
                "adapter `{}` names base_model_name {:?}, which is not a served model ({})",
                m.name,
                m.base_model_name.as_deref().unwrap_or_default(),
                models
                    .0
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
        .into());
    }
    let names = models.names();
    if let Some(dup) = names
        .iter()
        .enumerate()
        .find(|(i, n)| names[..*i].contains(n))
        .map(|(_, n)| n)
    {
        return Err(ServeError::DuplicateName(dup.clone()));
    }
    Ok(())
}

fn app_state(args: &ServeArgs, models: Models) -> AppState {
    AppState {
        models,
        admission: FairAdmission::new(
            args.max_concurrent_requests,
            args.max_queued_requests,
            args.max_queued_requests_per_tenant,
        ),
        tenant_weights: TenantWeights::new(&args.tenant_weights),
        work: WorkLimits::new(
            args.max_concurrent_tokenize,
            args.max_concurrent_scoring,
            args.max_concurrent_embeddings,
            args.max_queued_requests,
        ),
        budget: args.user_token_budget.map(|limit| {
            TokenBudget::new(
                limit,
                Duration::from_secs(args.user_budget_window),
                args.max_budget_users,
            )
        }),
        api_keys: ApiKeys::new(&args.api_key),
        sessions: SessionStore::new(Duration::from_secs(args.session_ttl), args.max_sessions),
        cancels: Arc::new(CancelRegistry::default()),
        metrics: ServerMetrics::default(),
        endpoint_metrics: Default::default(),
        responses: ResponseStore::new(
            Duration::from_secs(args.stored_response_ttl),
            args.max_stored_responses,
            args.max_stored_response_bytes,
        ),
        timeout: args.timeout(),
        keep_alive: Duration::from_secs_f64(args.keep_alive),
        max_body_bytes: args.max_body_bytes,
        durations: state::Durations::of(args),
        allowed_hosts: (!args.allowed_hosts.is_empty()).then(|| {
            args.allowed_hosts
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .collect()
        }),
        lifecycle: Lifecycle::default(),
        allow_runtime_lora: args.allow_runtime_lora,
    }
}

/// Runs the server until SIGINT or SIGTERM (then drains, see [`shutdown`]), or until an
/// engine dies (then drains and returns [`ServeError::EngineFailed`] unless
/// `--no-exit-on-engine-failure`). Blocks the calling thread.
pub fn serve(args: ServeArgs) -> Result<(), ServeError> {
    init_tracing();
    args.check()?;
    if let Some(threads) = args.threads {
        // candle's thread pool reads this once, when it starts: before any model loads.
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("novainfer-http")
        .build()?;
    let signals = runtime.block_on(async { Signals::register() })?;
    // The sockets open before the model loads, so a taken port fails fast.
    let publisher = match args.kv_events()? {
        Some(config) => {
            Some(runtime.block_on(KvEventPublisher::start(&config, args.kv_events_encoding))?)
        }
        None => None,
    };
    let models = load_models(&args, publisher)?;
    let names = models.names();
    let state = Arc::new(app_state(&args, models));
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| ServeError::Bind {
                addr: addr.clone(),
                source,
            })?;
        let local = listener.local_addr()?;
        let host = if local.is_ipv6() {
            format!("[{}]", local.ip())
        } else {
            local.ip().to_string()
        };
        let url = format!("http://{host}:{}", local.port());
        // The one line on stdout: scripts and tests read the URL from it.
        println!(
            "NovaInfer is serving {} at {url} (Web UI: {url}/, OpenAI API: {url}/v1)",
            names.join(", ")
        );
        let _ = std::io::stdout().flush();
        spawn_session_expiry(state.clone());
        tokio::spawn(warmup::warm_up(state.clone()));
        shutdown::watch_engines(state.clone(), !args.no_exit_on_engine_failure);
        let app = routes::router(state.clone(), &args.cors_allow_origin);
        let limits = ConnLimits {
            header_read: state.durations.header_read,
            idle: state.durations.idle,
            max_connections: args.max_connections,
        };
        let conns = Connections::new(args.max_connections);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(listener::accept_loop(
            listener,
            app,
            limits,
            conns.clone(),
            stopped,
        ));
        shutdown::drain(
            &state,
            signals,
            stop,
            &conns,
            state.durations.shutdown_grace,
        )
        .await;
        match state.lifecycle.cause() {
            Some(DrainCause::EngineFailed(f)) => Err(ServeError::EngineFailed {
                model: f.model,
                message: f.message,
            }),
            _ => Ok(()),
        }
    })
}

fn spawn_session_expiry(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        loop {
            tick.tick().await;
            state.sessions.expire(Instant::now());
            state.responses.expire(Instant::now());
        }
    });
}

/// Parses `argv` (without the program name) the way the binary does. `Err` carries clap's
/// message, including `--help` and `--version` output (check `use_stderr` to tell them apart).
pub fn parse_args<I: IntoIterator<Item = String>>(argv: I) -> Result<ServeArgs, clap::Error> {
    use clap::Parser;
    ServeArgs::try_parse_from(std::iter::once("novainfer-server".to_owned()).chain(argv))
}
