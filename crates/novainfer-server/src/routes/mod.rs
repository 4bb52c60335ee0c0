//! The HTTP surface: routes, the middleware every request passes (request id, API key,
//! CORS, the per-request log line), body reading with its size limit, and JSON fallbacks
//! for unknown paths and methods so even those answer in OpenAI's error shape.

mod chat;
mod completions;
mod driver;
mod embeddings;
mod generate;
mod infill;
mod info;
mod lora;
mod messages;
mod misc;
mod output_items;
mod responses;
mod run;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ApiError;
use crate::keys::Tenant;
use crate::state::{AppState, RequestId};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Anthropic's API key header, accepted on every route as well as `Authorization: Bearer`.
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// Marks a response whose log line the handler writes itself (generation requests, which
/// know their tokens and finish reason only when they end).
#[derive(Clone, Copy)]
pub struct LoggedByHandler;

/// Every route and the middleware each group passes.
// Long: the route table, which reads best whole.
pub fn router(state: Arc<AppState>, cors_origins: &[String]) -> Router {
    let state_for_hosts = state.clone();
    let api = Router::new()
        .route("/v1/models", get(misc::list_models))
        .route("/v1/models/{model}", get(misc::get_model))
        .route(
            "/v1/completions",
            post(generate::generate::<completions::Completions>),
        )
        .route(
            "/v1/chat/completions",
            post(generate::generate::<chat::Chat>),
        )
        .route(
            "/v1/responses",
            post(generate::generate::<responses::Responses>),
        )
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/infill", post(generate::generate::<infill::Infill>))
        .route("/v1/requests/{id}/cancel", post(misc::cancel))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/server_info", get(info::server_info))
        .route("/v1/load_lora_adapter", post(lora::load))
        .route("/v1/unload_lora_adapter", post(lora::unload))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    // Anthropic's clients read errors in Anthropic's shape: every error of these routes
    // (the API key check included) is rewritten on its way out.
    let anthropic = Router::new()
        .route(
            "/v1/messages",
            post(generate::generate::<messages::Messages>),
        )
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .route_layer(middleware::from_fn(messages::anthropic_errors));
    let open = Router::new()
        .route("/health", get(misc::health))
        .route("/ready", get(misc::ready))
        .route("/version", get(misc::version))
        .route("/metrics", get(misc::metrics))
        .route("/", get(crate::ui::index));
    let mut app = api
        .merge(anthropic)
        .merge(open)
        // Any other GET may be a Web UI file; everything else is an unknown endpoint.
        .fallback(crate::ui::asset)
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(state);
    if !cors_origins.is_empty() {
        let origins = if cors_origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                cors_origins
                    .iter()
                    .filter_map(|o| HeaderValue::from_str(o).ok()),
            )
        };
        app = app.layer(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST, Method::DELETE])
                .allow_headers([
                    header::AUTHORIZATION,
                    X_API_KEY,
                    HeaderName::from_static("anthropic-version"),
                    header::CONTENT_TYPE,
                    X_REQUEST_ID,
                    HeaderName::from_static("x-session-id"),
                ])
                .expose_headers([X_REQUEST_ID]),
        );
    }
    app.layer(middleware::from_fn_with_state(
        state_for_hosts,
        allowed_host,
    ))
    .layer(middleware::from_fn(request_id_and_log))
}

/// `--allowed-hosts`: a page on an attacker's domain that rebinds its DNS name to this
/// server's address still sends the attacker's name as Host; refusing unknown hosts keeps
/// such pages away from the API and the UI. Probes (`/health`, `/ready`) usually address the
/// server by IP, and reveal nothing, so they are exempt.
async fn allowed_host(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(allowed) = &state.allowed_hosts {
        let path = request.uri().path();
        if path != "/health" && path != "/ready" {
            let host = request_host(&request);
            if !allowed.contains(&host) {
                return ApiError::host_not_allowed(&host).into_response();
            }
        }
    }
    next.run(request).await
}

/// The request's host name, lower-cased, without port (from the URI in absolute form, else
/// the Host header); empty when there is none.
fn request_host(request: &Request) -> String {
    let raw = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            request
                .headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        })
        .unwrap_or_default();
    let raw = raw.rsplit('@').next().unwrap_or_default();
    let host = if let Some(rest) = raw.strip_prefix('[') {
        // [v6]:port
        rest.split(']').next().unwrap_or_default()
    } else {
        raw.split(':').next().unwrap_or_default()
    };
    host.to_ascii_lowercase()
}

/// A client-chosen request id is kept if it is short and plain; otherwise we make one.
fn request_id(headers: &axum::http::HeaderMap) -> String {
    headers
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        })
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()))
}

async fn request_id_and_log(mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = request_id(request.headers());
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(X_REQUEST_ID, value);
    }
    if response.extensions().get::<LoggedByHandler>().is_none() {
        let error = response
            .extensions()
            .get::<ApiError>()
            .map(|e| e.message.clone());
        tracing::info!(
            target: "novainfer::request",
            request_id = %id,
            %method,
            path = %path,
            status = response.status().as_u16(),
            latency_ms = log_ms(started.elapsed()),
            error = error.as_deref().unwrap_or(""),
            "request"
        );
    }
    response
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let tenant = match &state.api_keys {
        None => Tenant::default(),
        Some(keys) => {
            let headers = request.headers();
            let presented = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
                .or_else(|| headers.get(&X_API_KEY).map(|v| v.as_bytes()))
                .unwrap_or_default();
            match keys.tenant(presented) {
                Some(tenant) => tenant,
                None => return ApiError::unauthorized().into_response(),
            }
        }
    };
    // Handlers scope sessions, cancels and budgets by it.
    request.extensions_mut().insert(tenant);
    next.run(request).await
}

/// The raw body of a JSON request: `Content-Type: application/json` (415 otherwise, so a
/// form post from a browser page cannot reach the API without a CORS preflight), read up to
/// `--max-body-bytes` (413 past it) within `--body-read-timeout` (408 past it, so a client
/// trickling its body cannot hold a connection and a task forever).
pub struct JsonBody(pub Bytes);

/// Whether a Content-Type header is JSON (`application/json`, any parameters, any case).
fn is_json(content_type: Option<&HeaderValue>) -> Result<(), ApiError> {
    let value = content_type.and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = value.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else if value.is_empty() {
        Err(ApiError::unsupported_media_type("no Content-Type"))
    } else {
        Err(ApiError::unsupported_media_type(&format!("{value:?}")))
    }
}

impl FromRequest<Arc<AppState>> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        is_json(request.headers().get(header::CONTENT_TYPE))?;
        let limit = state.max_body_bytes;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            return Err(ApiError::payload_too_large(limit));
        }
        let body: Body = request.into_body();
        let deadline = state.durations.body_read;
        match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
            Ok(Ok(bytes)) => Ok(JsonBody(bytes)),
            Ok(Err(_)) => Err(ApiError::payload_too_large(limit)),
            Err(_) => Err(ApiError::body_timeout(deadline.as_secs_f64())),
        }
    }
}

/// A duration for a log field, in milliseconds to 0.1 ms: `12.3`, not `12.345678901`.
pub(crate) fn log_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

#[cfg(test)]
mod tests {
    #[test]
    fn log_ms_keeps_a_tenth_of_a_millisecond() {
        use std::time::Duration;
        assert_eq!(super::log_ms(Duration::from_nanos(12_345_678)), 12.3);
        assert_eq!(
            super::log_ms(Duration::from_micros(999_960)).to_string(),
            "1000"
        );
    }

    use super::*;

    #[test]
    fn only_json_content_types_pass() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
        ] {
            is_json(Some(&HeaderValue::from_static(ok))).expect(ok);
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/jsonx",
        ] {
            let e = is_json(Some(&HeaderValue::from_static(bad))).expect_err(bad);
            assert_eq!(e.status, 415);
        }
        assert_eq!(is_json(None).expect_err("missing").status, 415);
    }

    #[test]
    fn host_names_drop_the_port_and_case() {
        let host = |h: &'static str| {
            let r = Request::builder()
                .uri("/")
                .header(header::HOST, h)
                .body(Body::empty())
                .expect("valid request");
            request_host(&r)
        };
        assert_eq!(host("LocalHost:8000"), "localhost");
        assert_eq!(host("[::1]:80"), "::1");
        assert_eq!(host("example.com"), "example.com");
        let absolute = Request::builder()
            .uri("http://evil.test:1/v1/models")
            .header(header::HOST, "localhost")
            .body(Body::empty())
            .expect("valid request");
        assert_eq!(request_host(&absolute), "evil.test");
    }
}
