//! `POST /v1/embeddings`: one unit-length vector per input, the final hidden state of the
//! input's last token (see docs/api.md), as floats or base64 little-endian f32.
//!
//! Admitted by the embeddings pool (`--max-concurrent-embeddings`, 429 past its queue) before
//! any input is tokenized. Each input is a prefill-only engine request, scheduled like a
//! prompt: in chunks inside the step's token budget and the KV pool, beside the running
//! streams, so a large batch or a long input never stalls them for its whole length. A
//! client that disconnects aborts the inputs still running.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{json, Value};

use super::log_ms;
use super::JsonBody;
use crate::engine_io;
use crate::error::ApiError;
use crate::lifecycle::{not_live, EngineFailure};
use crate::protocol::inputs;
use crate::protocol::request::{parse, EmbeddingRequest};
use crate::state::AppState;

pub async fn embeddings(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: EmbeddingRequest = parse(&body)?;
    let model = app.models.get(req.model.as_deref())?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "encoding_format",
                format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    if let Some(d) = req.dimensions {
        return Err(ApiError::invalid_param(
            "dimensions",
            format!(
                "dimensions is not supported (embeddings have the model's hidden size); got {d}"
            ),
        ));
    }
    crate::budget::check_user(req.user.as_deref())?;
    let prompts = inputs::prompts(&req.input, "input")?;
    app.lifecycle.admit()?;
    if let Some(message) = model.handle.failure() {
        return Err(not_live(&EngineFailure {
            model: model.name.clone(),
            message,
        }));
    }
    let _permit = app
        .work
        .embeddings
        .admit()
        .await
        .inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    let frontend = model.frontend.clone();
    let prompt_ids = tokio::task::spawn_blocking(move || {
        prompts
            .iter()
            .map(|p| frontend.prompt_token_ids(p))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??;
    let prompt_tokens = prompt_ids.iter().map(Vec::len).sum::<usize>();
    let vectors = engine_io::embed_all(&model.handle, prompt_ids, model.adapter.clone()).await?;
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                Value::from(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    tracing::debug!(model = %model.name, inputs = data.len(), elapsed_ms = log_ms(started.elapsed()), "embeddings");
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": model.name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}
