//! The one generation handler. Every generation API (chat completions, completions,
//! `/infill`, Responses, Anthropic Messages) is an [`Api`]: a parser from its body to the
//! common [`GenerationRequest`], and a renderer of the result. [`generate`] does everything
//! else, once and in this order, for all of them:
//!
//! 1. parse the body (the API's [`Api::parse`]; no server state is read, so a bad body costs
//!    nothing) and log its no-op fields once;
//! 2. look the model (or LoRA adapter) up;
//! 3. turn the API's request into the common one ([`Api::request`]: sessions and stored
//!    responses are read here, scoped by the caller's API key);
//! 4. validate the sampling fields into `SamplingParams` (every range, in chat's field names
//!    renamed to the API's);
//! 5. admission: shutdown, a dead engine, the user's budget, the queue ([`prepare`]);
//! 6. tokenize on the tokenizing pool, where each prompt is checked against the context
//!    length and the output constraint is compiled ([`Pending::tokenize`]);
//! 7. score the prompts when their logprobs were asked for;
//! 8. run to the end through [`respond`] with the API's renderer.
//!
//! Adding an API is an `Api` implementation and a route.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use novainfer_core::SamplingParams;
use novainfer_engine::fim::{ExtraChunk, FimTokens};
use novainfer_engine::{ChatMessage, Frontend, Prompt, TokenLogprob};
use serde_json::{Map, Value};

use super::driver::{respond, Renderer};
use super::run::{prepare, Launch, Pending};
use super::JsonBody;
use crate::engine_io;
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::models::ModelRef;
use crate::params::{request_timeout, sampling_params, EndpointParams};
use crate::protocol::request::SharedFields;
use crate::reasoning::prompt_opens_thinking;
use crate::state::{AppState, RequestId};
use crate::tools::Tools;

/// What every generation request is, whichever API it came through.
pub struct GenerationRequest {
    pub input: Input,
    /// The sampling fields, in chat's names (see [`Api::RENAMES`]).
    pub sampling: SharedFields,
    /// What the API itself fixes of the output: its `max_tokens` field and default, logprobs,
    /// extra stop tokens, its own constraint.
    pub output: EndpointParams,
    /// The response object's id; also a cancel key.
    pub response_id: String,
    pub stream: bool,
    /// Score the prompt too: its tokens' logprobs, with as many alternatives as the output's
    /// (completions' `echo` with `logprobs`; nothing when no logprobs were asked for).
    pub prompt_logprobs: bool,
}

impl GenerationRequest {
    /// A conversation answered as chat answers it (no logprobs, `max_tokens` or until the
    /// context is full, the tools' call grammar as the constraint): the agent APIs.
    pub fn conversation(
        chat: ChatInput,
        sampling: SharedFields,
        response_id: String,
        stream: bool,
    ) -> Self {
        let output = EndpointParams {
            max_tokens: sampling.max_tokens,
            default_max_tokens: None,
            logprobs: None,
            extra_stop_token_ids: Vec::new(),
            constraint: chat.tools.as_ref().and_then(Tools::grammar),
        };
        Self {
            input: Input::Chat(chat),
            sampling,
            output,
            response_id,
            stream,
            prompt_logprobs: false,
        }
    }
}

/// What the model is asked to continue.
pub enum Input {
    /// A conversation, rendered with the model's chat template.
    Chat(ChatInput),
    /// Prompts as given, `n` completions each. With a `suffix`, each text prompt is the code
    /// before a gap and the model fills it in (fill-in-the-middle).
    Prompts {
        prompts: Vec<Prompt>,
        suffix: Option<String>,
    },
    /// llama.cpp's repo-level infill: files for context, the code around the gap, and what
    /// the middle starts with; the context files are cut to leave `reserve` tokens of room.
    Infill {
        fim: FimTokens,
        extra: Vec<ExtraChunk>,
        prefix: String,
        suffix: String,
        middle: String,
        reserve: usize,
    },
}

/// A conversation and how to end its prompt.
pub struct ChatInput {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Tools>,
    /// The template's variables besides the messages and tools.
    pub template_kwargs: Option<Map<String, Value>>,
    pub add_generation_prompt: bool,
    /// Continue the last (assistant) message instead of starting a new one.
    pub continue_final: bool,
}

impl ChatInput {
    /// A conversation answered with a new assistant turn.
    pub fn new(messages: Vec<ChatMessage>, tools: Option<Tools>) -> Self {
        Self {
            messages,
            tools,
            template_kwargs: None,
            add_generation_prompt: true,
            continue_final: false,
        }
    }

    /// The template's variables besides the messages.
    pub fn template_vars(&self) -> Option<Value> {
        template_vars(self.tools.as_ref(), self.template_kwargs.clone())
    }

    /// The prompt: rendered by the template, then its ids (the template placed every special
    /// token, so the tokenizer adds none, as transformers does).
    pub fn render(&self, frontend: &Frontend) -> Result<(Vec<u32>, String), ApiError> {
        let text = frontend.render_chat(
            &self.messages,
            self.add_generation_prompt,
            self.continue_final,
            self.template_vars(),
        )?;
        let ids = frontend.tokenizer().encode(&text, false)?;
        Ok((ids, text))
    }
}

/// The template's variables besides the messages: the tools, overridden by the request's
/// own `chat_template_kwargs`.
pub fn template_vars(tools: Option<&Tools>, kwargs: Option<Map<String, Value>>) -> Option<Value> {
    let mut vars = tools.map(Tools::template_vars).unwrap_or_default();
    vars.extend(kwargs.unwrap_or_default());
    (!vars.is_empty()).then_some(Value::Object(vars))
}

/// The prompts as the engine got them, for the renderer.
#[derive(Default)]
pub struct Tokenized {
    /// Per prompt, its token ids.
    pub prompt_ids: Vec<Vec<u32>>,
    /// Per prompt, its tokens' logprobs (when [`GenerationRequest::prompt_logprobs`]).
    pub prompt_logprobs: Vec<Vec<Option<TokenLogprob>>>,
    /// A conversation: split reasoning off the output (`Some(true)`: the prompt opened
    /// `<think>`); `None` when the model does not reason.
    pub reasoning: Option<bool>,
    /// A conversation with tools: read the output for tool calls.
    pub tool_calls: bool,
    /// Infill: context files were dropped to make the prompt fit.
    pub truncated: bool,
}

/// What an API's hooks may read of the request being served.
pub struct Context {
    pub app: Arc<AppState>,
    pub model: ModelRef,
    pub tenant: Tenant,
    pub request_id: RequestId,
    pub arrival: Instant,
    pub headers: HeaderMap,
}

/// One generation API: its parser and its renderer.
pub trait Api: Sized + Send + 'static {
    /// The endpoint's name in logs and metrics.
    const ENDPOINT: &'static str;
    /// (chat's field name, this API's) for the errors of the shared checks.
    const RENAMES: &'static [(&'static str, &'static str)] = &[];
    /// What the API keeps from its request for its renderer.
    type Plan: Send + 'static;
    type Renderer: Renderer;

    /// The body as this API's request (reads no server state).
    fn parse(body: &[u8]) -> Result<Self, ApiError>;

    /// The `model` field.
    fn model(&self) -> Option<&str>;

    /// Fields accepted as no-ops, logged once.
    fn ignored_fields(&self) -> Vec<&'static str> {
        Vec::new()
    }

    /// The common request, and what the renderer will need.
    fn request(self, cx: &Context) -> Result<(GenerationRequest, Self::Plan), ApiError>;

    /// The renderer, once the prompt is tokenized.
    fn renderer(
        plan: Self::Plan,
        cx: &Context,
        params: &SamplingParams,
        prompt: Tokenized,
    ) -> Self::Renderer;
}

/// Reports `e` under `renames`' field names: its `param`, and the field where its message
/// names it, so a client reads the name it sent.
pub fn renamed(renames: &[(&str, &str)], mut e: ApiError) -> ApiError {
    let Some(param) = &e.param else { return e };
    if let Some((from, to)) = renames.iter().find(|(from, _)| from == param) {
        e.message = replace_word(&e.message, from, to);
        e.param = Some((*to).to_owned());
    }
    e
}

/// `text` with each whole-word `from` (not inside a longer identifier) replaced by `to`.
fn replace_word(text: &str, from: &str, to: &str) -> String {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(from) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + from.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_ident) || after.is_some_and(is_ident) {
            out.push_str(from);
        } else {
            out.push_str(to);
        }
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

fn renamed_field(renames: &[(&'static str, &'static str)], field: &'static str) -> &'static str {
    renames
        .iter()
        .find(|(from, _)| *from == field)
        .map_or(field, |(_, to)| to)
}

/// The handler of every generation route: `A` parses and renders, this does the rest (see
/// the module's documentation).
pub async fn generate<A: Api>(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let parsed = A::parse(&body)?;
    crate::ignored::log_once(A::ENDPOINT, &parsed.ignored_fields());
    let model = app.models.get(parsed.model())?;
    let cx = Context {
        app,
        model,
        tenant,
        request_id,
        arrival,
        headers,
    };
    let (request, plan) = parsed.request(&cx)?;
    let rename = |e| renamed(A::RENAMES, e);
    let constraint_field = match (&request.output.constraint, &request.input) {
        (Some(_), Input::Chat(_)) => "tools",
        _ => crate::structured::constraint_field(request.sampling.response_format.as_ref()),
    };
    let timeout = request_timeout(&request.sampling).map_err(rename)?;
    let params = sampling_params(&request.sampling, request.output).map_err(rename)?;
    if let Input::Chat(chat) = &request.input {
        if chat.messages.is_empty() {
            return Err(ApiError::invalid(
                "the conversation is empty: send at least one message",
            ));
        }
    }
    let mut pending = prepare(
        &cx.app,
        &cx.request_id,
        arrival,
        Launch {
            model: cx.model.clone(),
            params: params.clone(),
            timeout,
            user: request.sampling.user.clone(),
            tenant,
            priority: request.sampling.priority.unwrap_or(0),
            endpoint: A::ENDPOINT,
            response_id: request.response_id,
            constraint_field: renamed_field(A::RENAMES, constraint_field),
        },
    )?;
    let mut prompt = tokenize(&mut pending, &cx.model, request.input)
        .await
        .map_err(rename)?;
    if let Some(k) = params.logprobs().filter(|_| request.prompt_logprobs) {
        prompt.prompt_logprobs = score_prompts(&cx, &prompt.prompt_ids, k).await?;
    }
    let stream = request.stream;
    let renderer = A::renderer(plan, &cx, &params, prompt);
    respond(pending, renderer, stream, cx.app.keep_alive).await
}

/// Renders and tokenizes `input` under `pending`'s admission (see [`Pending::tokenize`]).
async fn tokenize(
    pending: &mut Pending,
    model: &ModelRef,
    input: Input,
) -> Result<Tokenized, ApiError> {
    let frontend = model.frontend.clone();
    let reasoning = model.reasoning;
    pending
        .tokenize(move || {
            let mut out = Tokenized::default();
            let prompts = match input {
                Input::Chat(chat) => {
                    let (ids, text) = chat.render(&frontend)?;
                    out.reasoning = reasoning.then(|| prompt_opens_thinking(&text));
                    out.tool_calls = chat.tools.as_ref().is_some_and(Tools::parses_calls);
                    vec![ids]
                }
                Input::Prompts { prompts, suffix } => {
                    prompt_ids(&frontend, &prompts, suffix.as_deref())?
                }
                Input::Infill {
                    fim,
                    extra,
                    prefix,
                    suffix,
                    middle,
                    reserve,
                } => {
                    let max_prompt = frontend.max_model_len().saturating_sub(reserve);
                    let built = fim.infill(
                        frontend.tokenizer(),
                        &extra,
                        &prefix,
                        &suffix,
                        &middle,
                        max_prompt,
                    )?;
                    out.truncated = built.extra_tokens_dropped > 0;
                    vec![built.token_ids]
                }
            };
            out.prompt_ids = prompts.clone();
            Ok((prompts, out))
        })
        .await
}

/// The ids of completions' prompts; with a `suffix`, each (text) prompt is the prefix of a
/// fill-in-the-middle prompt.
fn prompt_ids(
    frontend: &Frontend,
    prompts: &[Prompt],
    suffix: Option<&str>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let fim = match suffix {
        Some(_) => Some(FimTokens::of(frontend.tokenizer()).ok_or_else(|| {
            ApiError::invalid_param("suffix", format!("{NO_FIM}, which `suffix` needs"))
        })?),
        None => None,
    };
    prompts
        .iter()
        .map(|p| match (&fim, suffix, p) {
            (Some(fim), Some(suffix), Prompt::Text(prefix)) => {
                Ok(fim.prompt(frontend.tokenizer(), prefix, suffix, "")?)
            }
            (_, _, Prompt::Text(text)) => Ok(frontend.tokenizer().encode(text, true)?),
            (_, _, Prompt::TokenIds(ids)) => Ok(ids.clone()),
        })
        .collect()
}

/// Why a model cannot serve fill-in-the-middle.
pub const NO_FIM: &str = "this model cannot fill in the middle: its vocabulary has no \
    <|fim_prefix|>, <|fim_suffix|> and <|fim_middle|> tokens";

/// The prompts' own logprobs, under the scoring pool (admitted first: 429 when its queue is
/// full). Each prompt is a prefill-only engine request, scored in chunks beside the running
/// streams (any length the model takes), and aborted if the client leaves.
async fn score_prompts(
    cx: &Context,
    prompts: &[Vec<u32>],
    k: usize,
) -> Result<Vec<Vec<Option<TokenLogprob>>>, ApiError> {
    let app = &cx.app;
    let _permit = app
        .work
        .scoring
        .admit()
        .await
        .inspect_err(|e| app.metrics.rejected(e.code.unwrap_or_default()))?;
    let mut out = Vec::with_capacity(prompts.len());
    for ids in prompts {
        let adapter = cx.model.adapter.clone();
        out.push(engine_io::score_prompt(&cx.model.handle, ids.clone(), k, adapter).await?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_this_apis_field_names() {
        let renames = &[
            ("max_tokens", "max_output_tokens"),
            ("response_format", "text"),
        ];
        let e = renamed(
            renames,
            ApiError::invalid_param("max_tokens", "2 max_tokens, max_tokens_x: too many"),
        );
        assert_eq!(e.param.as_deref(), Some("max_output_tokens"));
        assert_eq!(e.message, "2 max_output_tokens, max_tokens_x: too many");
        let e = renamed(renames, ApiError::invalid_param("top_p", "bad"));
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(renamed_field(renames, "response_format"), "text");
        assert_eq!(renamed_field(renames, "tools"), "tools");
    }
}
