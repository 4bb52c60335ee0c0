//! `POST /v1/completions`: one or more prompts (text or token ids), `n` completions each,
//! streamed as `text_completion` chunks or returned whole.

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use novainfer_core::SamplingParams;
use novainfer_engine::tokenizer::Tokenizer;
use novainfer_engine::{Delta, Prompt, TokenLogprob};
use serde_json::Value;

use super::driver::{each_choice, Flow, Renderer};
use super::generate::{Api, Context, GenerationRequest, Input, Tokenized};
use super::run::Running;
use crate::accounting::{completion_logprobs, extend_completion_logprobs, stop_reason_json};
use crate::error::ApiError;
use crate::params::EndpointParams;
use crate::protocol::inputs;
use crate::protocol::request::{parse_generation, CompletionRequest};
use crate::protocol::response::CompletionLogprobs;
use crate::protocol::response::{unix_now, Completion, CompletionChoice, SYSTEM_FINGERPRINT};
use crate::sse;

pub struct Completions(CompletionRequest);

/// What the renderer needs of the request.
pub struct CompletionsPlan {
    id: String,
    model: String,
    /// The prompts as given, when they are echoed.
    echo: Option<Vec<Prompt>>,
    stream: bool,
    include_usage: bool,
}

impl Api for Completions {
    const ENDPOINT: &'static str = "completions";
    type Plan = CompletionsPlan;
    type Renderer = Shape;

    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse_generation(body).map(Completions)
    }

    fn model(&self) -> Option<&str> {
        self.0.shared.model.as_deref()
    }

    fn ignored_fields(&self) -> Vec<&'static str> {
        self.0.ignored.clone()
    }

    fn request(self, cx: &Context) -> Result<(GenerationRequest, CompletionsPlan), ApiError> {
        let Completions(req) = self;
        let prompts = inputs::prompts(&req.own.prompt, "prompt")?;
        let echo = req.own.echo.unwrap_or(false);
        let suffix = req.own.suffix;
        if suffix.is_some() {
            fim_checks(&prompts, echo)?;
        }
        let logprobs = req.own.logprobs;
        let response_id = format!("cmpl-{}", cx.request_id.0);
        let stream = req.shared.stream.unwrap_or(false);
        let plan = CompletionsPlan {
            id: response_id.clone(),
            model: cx.model.name.clone(),
            echo: echo.then(|| prompts.clone()),
            stream,
            include_usage: req.shared.include_usage(),
        };
        let request = GenerationRequest {
            input: Input::Prompts { prompts, suffix },
            output: EndpointParams {
                max_tokens: req.shared.max_tokens,
                default_max_tokens: Some(16),
                logprobs,
                extra_stop_token_ids: Vec::new(),
                constraint: None,
            },
            sampling: req.shared,
            response_id,
            stream,
            prompt_logprobs: echo,
        };
        Ok((request, plan))
    }

    fn renderer(
        plan: CompletionsPlan,
        cx: &Context,
        params: &SamplingParams,
        prompt: Tokenized,
    ) -> Shape {
        let tokenizer = cx.model.frontend.tokenizer();
        let mut scores = prompt.prompt_logprobs.into_iter();
        let echoes = plan
            .echo
            .unwrap_or_default()
            .into_iter()
            .zip(prompt.prompt_ids)
            .map(|(p, token_ids)| Echo {
                text: match p {
                    Prompt::Text(t) => t,
                    Prompt::TokenIds(ids) => tokenizer.decode(&ids, false).unwrap_or_default(),
                },
                token_ids,
                logprobs: scores.next(),
            })
            .collect();
        Shape {
            id: plan.id,
            model: plan.model,
            created: unix_now(),
            echoes,
            n: params.n(),
            offsets: Vec::new(),
            stream: plan.stream,
            include_usage: plan.include_usage,
        }
    }
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

/// A prompt to prepend to its choices (`echo`), with its tokens' logprobs if asked for.
pub struct Echo {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Option<Vec<Option<TokenLogprob>>>,
}

/// Renders `text_completion` objects and chunks.
pub struct Shape {
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
