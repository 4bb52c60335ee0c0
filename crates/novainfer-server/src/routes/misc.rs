//! The small endpoints: models, health, version, metrics, tokenize/detokenize, cancel.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use novainfer_engine::{AdapterInfo, Prompt};
use serde_json::{json, Value};

use super::generate::template_vars;
use super::run::run_tokenize;
use super::JsonBody;
use crate::engine_io;
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::lifecycle::{engine_failure, not_live};
use crate::metrics::{render, ModelSnapshot};
use crate::models::ServedModel;
use crate::protocol::inputs;
use crate::protocol::request::{parse, DetokenizeRequest, TokenizeRequest};
use crate::state::AppState;
use crate::tools::Tools;

fn model_card(m: &ServedModel) -> Value {
    json!({
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "novainfer",
        "root": m.path.display().to_string(),
        "max_model_len": m.frontend.max_model_len(),
    })
}

/// A LoRA adapter's card, as vLLM lists it: its base model as `parent`, its source as `root`.
fn adapter_card(m: &ServedModel, a: &AdapterInfo) -> Value {
    json!({
        "id": a.name,
        "object": "model",
        "created": m.created,
        "owned_by": "novainfer",
        "root": a.path.display().to_string(),
        "parent": m.name,
        "max_model_len": m.frontend.max_model_len(),
    })
}

/// Every served model, each followed by its LoRA adapters.
pub async fn list_models(State(app): State<Arc<AppState>>) -> Response {
    let mut data: Vec<Value> = Vec::new();
    for m in &app.models.0 {
        data.push(model_card(m));
        data.extend(m.frontend.loras().list().iter().map(|a| adapter_card(m, a)));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn get_model(
    State(app): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Response, ApiError> {
    let m = app.models.get(Some(&model))?;
    let card = match &m.adapter {
        None => model_card(&m),
        Some(a) => {
            let info = AdapterInfo {
                name: a.name().to_owned(),
                id: a.id(),
                path: a.source().to_owned(),
                rank: a.rank(),
            };
            adapter_card(&m, &info)
        }
    };
    Ok(axum::Json(card).into_response())
}

/// Liveness: 200 while every engine thread runs; 503 (for good) once one has died.
pub async fn health(State(app): State<Arc<AppState>>) -> Result<Response, ApiError> {
    if let Some(failure) = engine_failure(&app.models) {
        return Err(not_live(&failure));
    }
    Ok(axum::Json(json!({"status": "ok"})).into_response())
}

/// Readiness: live, warmed up and not draining (a load balancer should send no new requests
/// otherwise).
pub async fn ready(State(app): State<Arc<AppState>>) -> Result<Response, ApiError> {
    if let Some(failure) = engine_failure(&app.models) {
        return Err(not_live(&failure));
    }
    app.lifecycle.warmed_up()?;
    app.lifecycle.admit()?;
    Ok(axum::Json(json!({"status": "ready"})).into_response())
}

pub async fn version() -> Response {
    axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    // Engine stats wait for the engine thread (at most one step), answered into a oneshot.
    let mut stats = Vec::with_capacity(app.models.0.len());
    for m in &app.models.0 {
        stats.push(engine_io::stats(&m.handle).await.ok());
    }
    let snapshots: Vec<ModelSnapshot<'_>> = app
        .models
        .0
        .iter()
        .zip(stats.into_iter().chain(std::iter::repeat(None)))
        .map(|(m, engine)| ModelSnapshot {
            name: &m.name,
            metrics: &m.metrics,
            engine,
            kv_config: &m.kv_config,
            max_loras: m.frontend.loras().max_loras(),
        })
        .collect();
    let mut text = render(
        &app.metrics,
        app.admission.num_queued(),
        app.admission.num_running(),
        &snapshots,
    );
    crate::vllm_metrics::render(&mut text, &snapshots);
    app.endpoint_metrics.render(&mut text);
    for m in &app.models.0 {
        if let Some(publisher) = &m.kv_events {
            publisher.render_metrics(&mut text, &m.name);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse(&body)?;
    let model = app.models.get(req.model.as_deref())?;
    let template_only = [
        ("tools", req.tools.is_some()),
        ("chat_template_kwargs", req.chat_template_kwargs.is_some()),
    ];
    if let Some((field, _)) = template_only
        .iter()
        .find(|(_, given)| *given && req.messages.is_none())
    {
        return Err(ApiError::invalid_param(
            *field,
            format!("`{field}` is for the chat template: it needs `messages`"),
        ));
    }
    let tools = Tools::parse(req.tools.as_ref(), None, None)?;
    let vars = template_vars(tools.as_ref(), req.chat_template_kwargs);
    let frontend = model.frontend.clone();
    let ids = run_tokenize(&app, move || match (req.prompt, req.messages) {
        (Some(prompt), None) => Ok(frontend
            .tokenizer()
            .encode(&prompt, req.add_special_tokens.unwrap_or(true))?),
        (None, Some(messages)) => {
            let messages = inputs::messages(&messages)?;
            // Rendered as a chat request renders it, tools included.
            let text = frontend.render_chat(
                &messages,
                req.add_generation_prompt.unwrap_or(true),
                false,
                vars,
            )?;
            Ok(frontend
                .tokenizer()
                .encode(&text, req.add_special_tokens.unwrap_or(false))?)
        }
        _ => Err(ApiError::invalid(
            "give exactly one of `prompt` and `messages`",
        )),
    })
    .await?;
    Ok(axum::Json(json!({
        "count": ids.len(),
        "max_model_len": model.frontend.max_model_len(),
        "tokens": ids,
    }))
    .into_response())
}

pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = parse(&body)?;
    let model = app.models.get(req.model.as_deref())?;
    let frontend = model.frontend.clone();
    let text = run_tokenize(&app, move || {
        if req.tokens.is_empty() {
            return Ok(String::new());
        }
        // Range-checks every id against the vocabulary.
        let ids = frontend
            .prompt_token_ids(&Prompt::TokenIds(req.tokens))
            .map_err(|e| ApiError::from(e).with_param("tokens"))?;
        Ok::<_, ApiError>(frontend.tokenizer().decode(&ids, false)?)
    })
    .await?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}

/// Aborts a request in flight by its response id (`chatcmpl-…`, `cmpl-…`) or X-Request-Id.
pub async fn cancel(
    State(app): State<Arc<AppState>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if app.cancels.cancel(tenant, &id) {
        Ok(
            axum::Json(json!({"id": id, "object": "request.cancel", "cancelled": true}))
                .into_response(),
        )
    } else {
        Err(ApiError::not_found(format!("no request {id:?} is in flight")).with_param("id"))
    }
}
