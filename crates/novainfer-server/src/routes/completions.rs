//! `POST /v1/completions`: one or more prompts (text or token ids), `n` completions each,
//! streamed as `text_completion` chunks or returned whole.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures_util::StreamExt;
use novainfer_engine::Prompt;

use super::run::{launch, Event, Launch, Running};
use super::{JsonBody, LoggedByHandler};
use crate::accounting::completion_logprobs;
use crate::error::ApiError;
use crate::params::{request_timeout, sampling_params, EndpointParams};
use crate::protocol::inputs;
use crate::protocol::request::{parse_generation, CompletionRequest};
use crate::protocol::response::{unix_now, Completion, CompletionChoice, SYSTEM_FINGERPRINT};
use crate::sse;
use crate::state::{AppState, RequestId};

pub async fn completions(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req: CompletionRequest = parse_generation(&body)?;
    let model = app.models.get(req.shared.model.as_deref())?;
    let prompts = inputs::prompts(&req.own.prompt, "prompt")?;
    let echo = req.own.echo.unwrap_or(false);
    let params = sampling_params(
        &req.shared,
        EndpointParams {
            max_tokens: req.shared.max_tokens,
            default_max_tokens: Some(16),
            logprobs: req.own.logprobs,
        },
    )?;
    if echo && params.logprobs().is_some() {
        return Err(ApiError::invalid_param(
            "echo",
            "echo with logprobs would need prompt logprobs, which this server does not compute",
        ));
    }
    let frontend = model.frontend.clone();
    let (prompt_ids, echoes) = tokio::task::spawn_blocking(move || {
        let mut ids = Vec::with_capacity(prompts.len());
        let mut echoes = Vec::with_capacity(prompts.len());
        for p in &prompts {
            let p_ids = frontend.prompt_token_ids(p)?;
            echoes.push(match p {
                Prompt::Text(t) => t.clone(),
                Prompt::TokenIds(t) => frontend.tokenizer().decode(t, false)?,
            });
            ids.push(p_ids);
        }
        Ok::<_, ApiError>((ids, echoes))
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??;
    let response_id = format!("cmpl-{}", request_id.0);
    let stream = req.shared.stream.unwrap_or(false);
    let include_usage = req.shared.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    let n = params.n();
    let running = launch(
        &app,
        &request_id,
        arrival,
        Launch {
            model: model.clone(),
            prompts: prompt_ids,
            params,
            timeout: request_timeout(&req.shared)?,
            user: req.shared.user.clone(),
            endpoint: "completions",
            response_id: response_id.clone(),
        },
    )
    .await?;
    let shape = Shape {
        id: response_id,
        model: model.name.clone(),
        created: unix_now(),
        echoes: if echo { echoes } else { Vec::new() },
        n,
    };
    let mut response = if stream {
        streaming(app, running, shape, include_usage)
    } else {
        whole(running, shape).await?
    };
    response.extensions_mut().insert(LoggedByHandler);
    Ok(response)
}

struct Shape {
    id: String,
    model: String,
    created: u64,
    /// Prompt texts to prepend (empty unless `echo`).
    echoes: Vec<String>,
    n: usize,
}

impl Shape {
    fn completion(&self, choices: Vec<CompletionChoice>, usage: Option<crate::protocol::response::Usage>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        }
    }

    fn echo(&self, index: usize) -> &str {
        self.echoes.get(index / self.n).map_or("", String::as_str)
    }
}

async fn whole(mut running: Running, shape: Shape) -> Result<Response, ApiError> {
    running.collect().await?;
    let tokenizer = running.model.frontend.tokenizer().clone();
    let choices = running
        .run
        .choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let echo = shape.echo(index);
            CompletionChoice {
                index,
                text: format!("{echo}{}", c.text),
                logprobs: (!c.logprobs.is_empty()).then(|| completion_logprobs(&tokenizer, &c.logprobs, echo.len())),
                finish_reason: Some(c.finish_reason.unwrap_or("abort")),
            }
        })
        .collect();
    Ok(axum::Json(shape.completion(choices, Some(running.run.usage()))).into_response())
}

fn streaming(app: Arc<AppState>, mut running: Running, shape: Shape, include_usage: bool) -> Response {
    let keep_alive = Some(app.keep_alive);
    let tokenizer = running.model.frontend.tokenizer().clone();
    let body = async_stream::stream! {
        let mut offsets = vec![0usize; running.run.choices.len()];
        if !shape.echoes.is_empty() {
            for index in 0..offsets.len() {
                let echo = shape.echo(index).to_owned();
                offsets[index] = echo.len();
                let choice = CompletionChoice { index, text: echo, logprobs: None, finish_reason: None };
                yield sse::data(&shape.completion(vec![choice], None));
            }
        }
        loop {
            match running.next_event(keep_alive).await {
                Event::Delta(prompt, delta) => {
                    let index = running.record(prompt, &delta);
                    let logprobs = (!delta.logprobs.is_empty())
                        .then(|| completion_logprobs(&tokenizer, &delta.logprobs, offsets[index]));
                    offsets[index] += delta.text.len();
                    let choice = CompletionChoice {
                        index,
                        text: delta.text,
                        logprobs,
                        finish_reason: delta.finish_reason.map(|r| r.as_str()),
                    };
                    yield sse::data(&shape.completion(vec![choice], None));
                }
                Event::KeepAlive => yield sse::keep_alive(),
                Event::Failed(e) => {
                    yield sse::data(&ApiError::from(e).body());
                    break;
                }
                Event::TimedOut => {
                    yield sse::data(&running.timeout_error().body());
                    break;
                }
                Event::Ended => {
                    if include_usage {
                        yield sse::data(&shape.completion(Vec::new(), Some(running.run.usage())));
                    }
                    break;
                }
            }
        }
        yield sse::done();
    };
    sse_response(body)
}

pub fn sse_response(body: impl futures_util::Stream<Item = Bytes> + Send + 'static) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body.map(Ok::<_, Infallible>)),
    )
        .into_response()
}
