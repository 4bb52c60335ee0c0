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

fn file(path: &str) -> Option<Response> {
    let f = UI.get_file(path)?;
    Some(
        (
            [
                (header::CONTENT_TYPE, content_type(path)),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            f.contents(),
        )
            .into_response(),
    )
}

pub async fn index() -> Response {
    file("index.html").unwrap_or_else(|| Html(PLACEHOLDER).into_response())
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
