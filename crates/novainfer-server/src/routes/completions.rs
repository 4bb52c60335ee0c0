//! `POST /v1/completions`: one or more prompts (text or token ids), `n` completions each,
//! streamed as `text_completion` chunks or returned whole.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use novainfer_engine::fim::FimTokens;
use novainfer_engine::tokenizer::Tokenizer;
use novainfer_engine::{Delta, Prompt, TokenLogprob};
use serde_json::Value;

use super::driver::{each_choice, respond, Flow, Renderer};
use super::run::{prepare, Launch, Running};
use super::JsonBody;
use crate::accounting::{completion_logprobs, extend_completion_logprobs, stop_reason_json};
use crate::engine_io;
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::models::ModelRef;
use crate::params::{request_timeout, sampling_params, EndpointParams};
use crate::protocol::inputs;
use crate::protocol::request::{parse_generation, CompletionRequest};
use crate::protocol::response::CompletionLogprobs;
use crate::protocol::response::{unix_now, Completion, CompletionChoice, SYSTEM_FINGERPRINT};
use crate::sse;
use crate::state::{AppState, RequestId};

pub async fn completions(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(tenant): Extension<Tenant>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req: CompletionRequest = parse_generation(&body)?;
    crate::ignored::log_once("completions", &req.ignored);
    let model = app.models.get(req.shared.model.as_deref())?;
    let prompts = inputs::prompts(&req.own.prompt, "prompt")?;
    let echo = req.own.echo.unwrap_or(false);
    let suffix = req.own.suffix.clone();
    if suffix.is_some() {
        fim_checks(&prompts, echo)?;
    }
    let params = sampling_params(
        &req.shared,
        EndpointParams {
            max_tokens: req.shared.max_tokens,
            default_max_tokens: Some(16),
            logprobs: req.own.logprobs,
            extra_stop_token_ids: Vec::new(),
            constraint: None,
        },
    )?;
    let echo_logprobs = params.logprobs().filter(|_| echo);
    let response_id = format!("cmpl-{}", request_id.0);
    let stream = req.shared.stream.unwrap_or(false);
    let include_usage = req.shared.include_usage();
    let n = params.n();
    let mut pending = prepare(
        &app,
        &request_id,
        arrival,
        Launch {
            model: model.clone(),
            params,
            timeout: request_timeout(&req.shared)?,
            user: req.shared.user.clone(),
            tenant,
            priority: req.shared.priority.unwrap_or(0),
            endpoint: "completions",
            response_id: response_id.clone(),
            constraint_field: crate::structured::constraint_field(
                req.shared.response_format.as_ref(),
            ),
        },
    )?;
    let frontend = model.frontend.clone();
    let mut echoes = pending
        .tokenize(move || {
            let mut ids = Vec::with_capacity(prompts.len());
            let mut echoes = Vec::with_capacity(prompts.len());
            let fim = match &suffix {
                Some(_) => Some(FimTokens::of(frontend.tokenizer()).ok_or_else(no_fim_tokens)?),
                None => None,
            };
            for p in &prompts {
                let p_ids = match (&fim, &suffix, p) {
                    (Some(fim), Some(suffix), Prompt::Text(prefix)) => frontend.prompt_token_ids(
                        &Prompt::TokenIds(fim.prompt(frontend.tokenizer(), prefix, suffix, "")?),
                    )?,
                    _ => frontend.prompt_token_ids(p)?,
                };
                let text = match p {
                    Prompt::Text(t) => t.clone(),
                    Prompt::TokenIds(t) => frontend.tokenizer().decode(t, false)?,
                };
                echoes.push(Echo {
                    text,
                    token_ids: p_ids.clone(),
                    logprobs: None,
                });
                ids.push(p_ids);
            }
            Ok((ids, echoes))
        })
        .await?;
    if let Some(k) = echo_logprobs {
        score_prompts(&app, &model, &mut echoes, k).await?;
    }
    let shape = Shape {
        id: response_id,
        model: model.name.clone(),
        created: unix_now(),
        echoes: if echo { echoes } else { Vec::new() },
        n,
        offsets: Vec::new(),
        stream,
        include_usage,
    };
    respond(pending, shape, stream, app.keep_alive).await
}

/// `suffix` (fill-in-the-middle) needs text prompts (the prefixes) and no `echo`.
fn fim_checks(prompts: &[Prompt], echo: bool) -> Result<(), ApiError> {
    if prompts.iter().any(|p| matches!(p, Prompt::TokenIds(_))) {
        return Err(ApiError::invalid_param(
            "suffix",
            "`suffix` needs a text `prompt` (the code before the gap), not token ids",
        ));
    }
    if echo {
        return Err(ApiError::invalid_param(
            "suffix",
            "`suffix` cannot be combined with `echo`",
        ));
    }
    Ok(())
}

fn no_fim_tokens() -> ApiError {
    ApiError::invalid_param(
        "suffix",
        "this model cannot fill in the middle: its vocabulary has no <|fim_prefix|>, \
         <|fim_suffix|> and <|fim_middle|> tokens, which `suffix` needs",
    )
}

/// A prompt to prepend to its choices (`echo`), with its tokens' logprobs if asked for.
struct Echo {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Option<Vec<Option<TokenLogprob>>>,
}

/// The prompts' own logprobs (`echo` with `logprobs`), under the scoring pool (admitted first:
/// 429 when its queue is full). Each prompt is a prefill-only engine request, scored in chunks
/// beside the running streams (any length the model takes), and aborted if the client leaves.
async fn score_prompts(
    app: &AppState,
    model: &ModelRef,
    echoes: &mut [Echo],
    k: usize,
) -> Result<(), ApiError> {
    let _permit = app
        .work
        .scoring
        .admit()
        .await
        .inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    for echo in echoes {
        let ids = echo.token_ids.clone();
        let adapter = model.adapter.clone();
        echo.logprobs = Some(engine_io::score_prompt(&model.handle, ids, k, adapter).await?);
    }
    Ok(())
}

/// Renders `text_completion` objects and chunks.
struct Shape {
    id: String,
    model: String,
    created: u64,
    /// One per prompt (empty unless `echo`).
    echoes: Vec<Echo>,
    n: usize,
    /// Stream: per choice, the length of its text so far (logprobs' `text_offset`).
    offsets: Vec<usize>,
    stream: bool,
    include_usage: bool,
}

impl Shape {
    fn completion(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<crate::protocol::response::Usage>,
    ) -> Completion {
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

    fn echo(&self, index: usize) -> Option<&Echo> {
        self.echoes.get(index / self.n)
    }

    fn echo_text(&self, index: usize) -> &str {
        self.echo(index).map_or("", |e| e.text.as_str())
    }

    /// Logprobs of the echoed prompt, when asked for.
    fn echo_logprobs(&self, tokenizer: &Tokenizer, index: usize) -> Option<CompletionLogprobs> {
        let echo = self.echo(index)?;
        let logprobs = echo.logprobs.as_ref()?;
        let mut out = CompletionLogprobs::default();
        extend_completion_logprobs(
            &mut out,
            tokenizer,
            echo.token_ids
                .iter()
                .copied()
                .zip(logprobs.iter().map(Option::as_ref)),
            0,
        );
        Some(out)
    }
}

impl Renderer for Shape {
    fn opening(&mut self, running: &Running) -> Vec<Bytes> {
        let tokenizer = running.model.frontend.tokenizer();
        self.offsets = vec![0; running.run.choices.len()];
        if self.echoes.is_empty() || !self.stream {
            return Vec::new();
        }
        (0..self.offsets.len())
            .map(|index| {
                let echo = self.echo_text(index).to_owned();
                self.offsets[index] = echo.len();
                let logprobs = self.echo_logprobs(tokenizer, index);
                let choice = CompletionChoice {
                    index,
                    text: echo,
                    logprobs,
                    finish_reason: None,
                    stop_reason: Value::Null,
                };
                sse::data(&self.completion(vec![choice], None))
            })
            .collect()
    }

    fn delta(&mut self, running: &Running, index: usize, delta: &Delta) -> (Vec<Bytes>, Flow) {
        if !self.stream {
            return (Vec::new(), Flow::Continue);
        }
        let tokenizer = running.model.frontend.tokenizer();
        let logprobs = (!delta.logprobs.is_empty())
            .then(|| completion_logprobs(tokenizer, &delta.logprobs, self.offsets[index]));
        self.offsets[index] += delta.text.len();
        let choice = CompletionChoice {
            index,
            text: delta.text.clone(),
            logprobs,
            finish_reason: delta.finish_reason.map(|r| r.as_str()),
            stop_reason: stop_reason_json(delta.stop_reason.as_ref()),
        };
        (
            vec![sse::data(&self.completion(vec![choice], None))],
            Flow::Continue,
        )
    }

    fn closing(&mut self, running: &Running) -> Vec<Bytes> {
        // Choices that never got their final delta (cancelled while queued) end here.
        let mut events: Vec<Bytes> = running
            .run
            .unfinished()
            .map(|index| {
                let choice = CompletionChoice {
                    index,
                    text: String::new(),
                    logprobs: None,
                    finish_reason: Some("abort"),
                    stop_reason: Value::Null,
                };
                sse::data(&self.completion(vec![choice], None))
            })
            .collect();
        if self.include_usage {
            events.push(sse::data(
                &self.completion(Vec::new(), Some(running.run.usage())),
            ));
        }
        events
    }

    fn whole(self, running: &Running) -> Response {
        let choices = each_choice(running, |tokenizer, index, c| {
            let echo = self.echo_text(index);
            let logprobs = match self.echo_logprobs(tokenizer, index) {
                Some(mut lp) => {
                    let generated = c.logprobs.iter().map(|lp| (lp.token_id, Some(lp)));
                    extend_completion_logprobs(&mut lp, tokenizer, generated, echo.len());
                    Some(lp)
                }
                None => (!c.logprobs.is_empty())
                    .then(|| completion_logprobs(tokenizer, &c.logprobs, echo.len())),
            };
            CompletionChoice {
                index,
                text: format!("{echo}{}", c.text),
                logprobs,
                finish_reason: Some(c.finish_reason.unwrap_or("abort")),
                stop_reason: stop_reason_json(c.stop_reason.as_ref()),
            }
        });
        axum::Json(self.completion(choices, Some(running.run.usage()))).into_response()
    }
}
