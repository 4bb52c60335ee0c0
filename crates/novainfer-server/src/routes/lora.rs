//! Loading and unloading LoRA adapters while serving, in vLLM's shapes:
//! `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
//! `POST /v1/unload_lora_adapter {"lora_name"}`. Off unless `--allow-runtime-lora`; behind the
//! API key like every `/v1` route. A request already running on an unloaded adapter finishes
//! on it; later ones naming it get 404.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use novainfer_engine::EngineError;
use serde::Deserialize;

use super::JsonBody;
use crate::error::ApiError;
use crate::models::ServedModel;
use crate::protocol::request::parse;
use crate::state::AppState;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadRequest {
    lora_name: String,
    lora_path: PathBuf,
    /// Replace an adapter of the same name (vLLM's `load_inplace`).
    #[serde(default)]
    load_inplace: bool,
    /// Which served model the adapter belongs to, when several are served (default: the first).
    base_model_name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadRequest {
    lora_name: String,
    /// vLLM's clients may send the adapter's integer id too; the name decides.
    #[allow(dead_code)]
    lora_int_id: Option<u64>,
}

/// vLLM answers these endpoints with a plain-text line.
fn success(message: String) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message,
    )
        .into_response()
}

fn allowed(app: &AppState) -> Result<(), ApiError> {
    if app.allow_runtime_lora {
        Ok(())
    } else {
        Err(ApiError::not_found(
            "loading and unloading LoRA adapters at run time is off: start the server with \
             --allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
        ))
    }
}

pub async fn load(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    allowed(&app)?;
    let req: LoadRequest = parse(&body)?;
    let served: Arc<ServedModel> = match &req.base_model_name {
        Some(name) => app
            .models
            .served(name)
            .cloned()
            .ok_or_else(|| ApiError::model_not_found(name, &app.models.names()))
            .map_err(|e| e.with_param("base_model_name"))?,
        None => app.models.0[0].clone(),
    };
    // One namespace for models and adapters: `model` in a request must name one thing.
    let taken = app.models.served(&req.lora_name).is_some()
        || app
            .models
            .0
            .iter()
            .any(|m| !Arc::ptr_eq(m, &served) && m.frontend.loras().contains(&req.lora_name));
    if taken {
        return Err(ApiError::invalid_param(
            "lora_name",
            format!(
                "`{}` already names a model or adapter on this server",
                req.lora_name
            ),
        ));
    }
    let name = req.lora_name.clone();
    let loras = served.frontend.loras().clone();
    // Reading and checking the weights is file work: off the async threads.
    let info = tokio::task::spawn_blocking(move || {
        loras.load_as(&req.lora_name, &req.lora_path, req.load_inplace)
    })
    .await
    .map_err(|e| ApiError::internal(format!("loading the adapter panicked: {e}")))?
    .map_err(|e| match e {
        // The file is the client's to fix (missing, corrupt, made for another model): a 400.
        EngineError::Model(_) => ApiError::invalid(e.to_string()).with_param("lora_path"),
        other => other.into(),
    })?;
    tracing::info!(lora = %name, path = %info.path.display(), rank = info.rank, model = %served.name, "LoRA adapter loaded");
    Ok(success(format!(
        "Success: LoRA adapter '{name}' added successfully."
    )))
}

pub async fn unload(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    allowed(&app)?;
    let req: UnloadRequest = parse(&body)?;
    let owner = app
        .models
        .0
        .iter()
        .find(|m| m.frontend.loras().contains(&req.lora_name));
    match owner {
        Some(m) => {
            m.frontend.loras().unload(&req.lora_name)?;
            tracing::info!(lora = %req.lora_name, model = %m.name, "LoRA adapter unloaded");
            Ok(success(format!(
                "Success: LoRA adapter '{}' removed successfully.",
                req.lora_name
            )))
        }
        None => Err(ApiError::not_found(format!(
            "the LoRA adapter `{}` is not loaded",
            req.lora_name
        ))
        .with_param("lora_name")),
    }
}
