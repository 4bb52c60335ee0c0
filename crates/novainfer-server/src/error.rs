//! `ApiError`: every failure the HTTP API reports, mapped once to OpenAI's error shape
//! `{"error": {"message", "type", "param", "code"}}` with the matching status.
//!
//! Invariant: bad input (malformed JSON, wrong types, unknown fields, out-of-range values,
//! prompts that cannot fit) is always a 4xx; a 5xx means the engine itself failed.

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use novainfer_core::ParamError;
use novainfer_engine::EngineError;
use serde::Serialize;

/// Read by OpenAI's clients to decide whether to retry.
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429).
    pub retry_after: Option<u64>,
    /// `Some(false)` sends `x-should-retry: false`: OpenAI's clients retry 408s and 5xx by
    /// default, which for a generation that already ran to its timeout only repeats the cost.
    pub should_retry: Option<bool>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            should_retry: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400: the request is malformed or a value is out of range.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the parameter at fault.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    pub fn model_not_found(model: &str, served: &[String]) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "the model `{model}` does not exist; this server serves: {}",
                served.join(", ")
            ),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed for this endpoint",
        )
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or invalid API key: send `Authorization: Bearer <key>`",
        )
        .with_code("invalid_api_key")
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body exceeds the limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    /// 429 with `Retry-After`: the server is full or the caller spent its budget.
    pub fn too_many_requests(
        message: impl Into<String>,
        code: &'static str,
        retry_after: u64,
    ) -> Self {
        let mut e =
            Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).with_code(code);
        e.retry_after = Some(retry_after);
        e
    }

    pub fn timeout(seconds: f64) -> Self {
        let mut e = Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout_error",
            format!("the request did not finish within its timeout of {seconds} s"),
        )
        .with_code("timeout");
        e.should_retry = Some(false);
        e
    }

    /// 408: the client did not send its whole body within `--body-read-timeout`.
    pub fn body_timeout(seconds: f64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout_error",
            format!("the request body was not received within {seconds} s (--body-read-timeout)"),
        )
        .with_code("body_timeout")
    }

    /// 415: a JSON endpoint got a body of another media type.
    pub fn unsupported_media_type(found: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("send the body as JSON with `Content-Type: application/json`, got {found}"),
        )
        .with_code("unsupported_media_type")
    }

    /// 403: the Host header names a host not in `--allowed-hosts` (DNS rebinding guard).
    pub fn host_not_allowed(host: &str) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!("the host {host:?} is not in this server's --allowed-hosts"),
        )
        .with_code("host_not_allowed")
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body, also sent as an SSE `data:` event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        serde_json::json!({ "error": Inner {
            message: &self.message,
            kind: self.kind,
            param: self.param.as_deref(),
            code: self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl From<ParamError> for ApiError {
    fn from(e: ParamError) -> Self {
        ApiError::invalid_param(e.param, e.to_string())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        let param = e.param().map(str::to_owned);
        let mut api = match &e {
            EngineError::PromptTooLong { .. } | EngineError::InputTooLong { .. } => {
                ApiError::invalid(message).with_code("context_length_exceeded")
            }
            EngineError::InvalidParameter(_)
            | EngineError::EmptyPrompt
            | EngineError::PromptTokenOutOfRange { .. }
            | EngineError::Ignored { .. }
            | EngineError::NoChatTemplate
            | EngineError::ChatTemplate(_)
            | EngineError::Tokenizer(_) => ApiError::invalid(message),
            EngineError::EngineStopped | EngineError::Aborted => ApiError::unavailable(message),
            // A request naming an adapter that is not (or no longer) loaded, as vLLM answers.
            EngineError::AdapterNotFound { .. } => ApiError::not_found(message),
            EngineError::AdapterExists { .. } | EngineError::LoraDisabled => {
                ApiError::invalid(message)
            }
            // A valid request this device's executor cannot serve (yet): the client's to change.
            EngineError::Model(novainfer_model::ModelError::Unsupported { .. }) => {
                ApiError::invalid(message).with_code("unsupported_on_device")
            }
            EngineError::Model(_) | EngineError::StepFailed { .. } => ApiError::internal(message),
        };
        api.param = param;
        api
    }
}

impl From<novainfer_engine::tokenizer::TokenizerError> for ApiError {
    fn from(e: novainfer_engine::tokenizer::TokenizerError) -> Self {
        EngineError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(retry) = self.should_retry {
            response.headers_mut().insert(
                X_SHOULD_RETRY,
                HeaderValue::from_static(if retry { "true" } else { "false" }),
            );
        }
        response.extensions_mut().insert(self);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_too_long_is_a_400_naming_both_numbers() {
        let e: ApiError = EngineError::PromptTooLong {
            prompt_tokens: 100,
            max_tokens: 50,
            max_model_len: 128,
        }
        .into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("128") && e.message.contains("100") && e.message.contains("50"));
    }

    #[test]
    fn a_feature_the_device_lacks_is_a_400_not_a_500() {
        let e: ApiError = EngineError::Model(novainfer_model::ModelError::Unsupported {
            what: "embeddings".into(),
            device: "cuda:0".into(),
        })
        .into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["code"], "unsupported_on_device");
        assert!(e.message.contains("cuda:0"), "{}", e.message);
    }

    #[test]
    fn body_has_openai_shape() {
        let body = ApiError::invalid_param("top_p", "bad").body();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["message"], "bad");
        assert!(body["error"]["code"].is_null());
    }

    #[test]
    fn too_many_requests_sets_retry_after() {
        let r = ApiError::too_many_requests("full", "queue_full", 2).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn a_timeout_tells_clients_not_to_retry() {
        let r = ApiError::timeout(1.5).into_response();
        assert_eq!(r.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(r.headers()[X_SHOULD_RETRY], "false");
        let r = ApiError::invalid("x").into_response();
        assert!(r.headers().get(X_SHOULD_RETRY).is_none());
    }
}
