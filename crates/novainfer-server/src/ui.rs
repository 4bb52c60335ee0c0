//! The Web UI: static files from `crates/novainfer-server/ui/`, embedded at compile time so
//! the binary needs nothing beside it. `/` serves `index.html`; other GET paths serve the
//! file of that name, or a 404 in OpenAI's error shape.

use axum::http::{header, Method, Uri};
use axum::response::{Html, IntoResponse, Response};
use include_dir::{include_dir, Dir};

use crate::error::ApiError;

static UI: Dir<'static> = include_dir!("$CARGO_MANIFEST_DIR/ui");

/// Shown at `/` when the build has no `ui/index.html`.
const PLACEHOLDER: &str = "<!doctype html><meta charset=utf-8><title>NovaInfer</title>\
<p>NovaInfer is running. The OpenAI-compatible API is at <code>/v1</code> \
(<a href=\"/v1/models\">/v1/models</a>, <a href=\"/metrics\">/metrics</a>).";

fn content_type(path: &str) -> &'static str {
    match path.rsplit('.').next().unwrap_or("") {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        "txt" => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// The same policy as `index.html`'s `<meta>` CSP (the UI loads only its own scripts, styles
/// and fetches; inline styles are set by the DOM builder; the favicon is a `data:` URL), plus
/// what a `<meta>` cannot say: `frame-ancestors 'none'` (no framing: clickjacking).
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
form-action 'self'; frame-ancestors 'none'";

/// Headers on every UI file: no MIME sniffing (a JSON or text reply never runs as script),
/// no framing, the CSP above.
const SECURITY_HEADERS: [(header::HeaderName, &str); 3] = [
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::X_FRAME_OPTIONS, "DENY"),
    (header::CONTENT_SECURITY_POLICY, CSP),
];

fn file(path: &str) -> Option<Response> {
    let f = UI.get_file(path)?;
    Some(with_security_headers(
        (
            [
                (header::CONTENT_TYPE, content_type(path)),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            f.contents(),
        )
            .into_response(),
    ))
}

fn with_security_headers(mut response: Response) -> Response {
    for (name, value) in SECURITY_HEADERS {
        response
            .headers_mut()
            .insert(name, header::HeaderValue::from_static(value));
    }
    response
}

pub async fn index() -> Response {
    file("index.html").unwrap_or_else(|| with_security_headers(Html(PLACEHOLDER).into_response()))
}

/// The fallback route: a GET for a UI file, or a 404 in OpenAI's error shape.
pub async fn asset(method: Method, uri: Uri) -> Response {
    let path = uri.path().trim_start_matches('/');
    // include_dir paths are relative and never contain `..`: a traversal finds nothing.
    let found = if method == Method::GET {
        file(path)
    } else {
        None
    };
    found.unwrap_or_else(|| {
        ApiError::not_found(format!("no such endpoint: {method} /{path}")).into_response()
    })
}
