//! The HTTP surface: routes, the middleware every request passes (request id, API key,
//! CORS, the per-request log line), body reading with its size limit, and JSON fallbacks
//! for unknown paths and methods so even those answer in OpenAI's error shape.

mod chat;
mod completions;
mod embeddings;
mod misc;
mod run;

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ApiError;
use crate::state::{AppState, RequestId};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Marks a response whose log line the handler writes itself (generation requests, which
/// know their tokens and finish reason only when they end).
#[derive(Clone, Copy)]
pub struct LoggedByHandler;

pub fn router(state: Arc<AppState>, cors_origins: &[String]) -> Router {
    let api = Router::new()
        .route("/v1/models", get(misc::list_models))
        .route("/v1/models/{model}", get(misc::get_model))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/requests/{id}/cancel", post(misc::cancel))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let open = Router::new()
        .route("/health", get(misc::health))
        .route("/version", get(misc::version))
        .route("/metrics", get(misc::metrics))
        .route("/", get(crate::ui::index));
    let mut app = api
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
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    X_REQUEST_ID,
                    HeaderName::from_static("x-session-id"),
                ])
                .expose_headers([X_REQUEST_ID]),
        );
    }
    app.layer(middleware::from_fn(request_id_and_log))
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
            latency_ms = started.elapsed().as_secs_f64() * 1e3,
            error = error.as_deref().unwrap_or(""),
            "request"
        );
    }
    response
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(keys) = &state.api_keys {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        if !keys.accepts(presented) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// The raw request body, read up to `--max-body-bytes` (413 past it).
pub struct JsonBody(pub Bytes);

impl FromRequest<Arc<AppState>> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
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
        axum::body::to_bytes(body, limit)
            .await
            .map(JsonBody)
            .map_err(|_| ApiError::payload_too_large(limit))
    }
}
