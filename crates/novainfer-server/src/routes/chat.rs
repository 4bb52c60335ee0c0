//! `POST /v1/chat/completions`: a conversation (and its tools) rendered with the model's chat
//! template, optionally continued from a server-kept session, streamed as
//! `chat.completion.chunk`s (the first delta of each choice carries the role) or returned
//! whole. The output goes through the chat transforms (`crate::transform`): reasoning models
//! get `reasoning_content` split from `content`, and requests with tools get `tool_calls`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{extract::State, Extension};
use novainfer_engine::{ChatMessage, Delta, Prompt, StopReason, ToolCallMessage};
use serde_json::{Map, Value};

use super::driver::{each_choice, respond, Flow, Renderer};
use super::run::{prepare, Launch, Running};
use super::JsonBody;
use crate::accounting::{chat_logprobs, stop_reason_json};
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::params::{request_timeout, sampling_params, EndpointParams};
use crate::protocol::inputs;
use crate::protocol::request::{parse_generation, ChatRequest};
use crate::protocol::response::{
    unix_now, ChatChoice, ChatCompletion, ChatLogprobs, ChatMessageOut, ToolCallOut, Usage,
    SYSTEM_FINGERPRINT,
};
use crate::reasoning::{prompt_opens_thinking, ReasoningSplitter};
use crate::sessions::MAX_SESSION_ID_LEN;
use crate::sse;
use crate::state::{AppState, RequestId};
use crate::tools::Tools;
use crate::transform::{finish_reason, ChatPiece, ChatTransform};

/// Where to store the finished turn.
struct SessionTurn {
    tenant: Tenant,
    id: String,
    conversation: Vec<ChatMessage>,
}

fn session_id(body: Option<String>, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let header = headers.get("x-session-id").map(|v| {
        v.to_str().map(str::to_owned).map_err(|_| {
            ApiError::invalid_param("session_id", "X-Session-Id must be visible ASCII")
        })
    });
    let id = match (body, header) {
        (Some(id), _) => Some(id),
        (None, Some(h)) => Some(h?),
        (None, None) => None,
    };
    match id {
        Some(id) if id.is_empty() || id.len() > MAX_SESSION_ID_LEN => Err(ApiError::invalid_param(
            "session_id",
            format!(
                "session_id must have 1 to {MAX_SESSION_ID_LEN} characters, got {}",
                id.len()
            ),
        )),
        id => Ok(id),
    }
}

pub async fn chat_completions(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req: ChatRequest = parse_generation(&body)?;
    crate::ignored::log_once("chat", &req.ignored);
    let model = app.models.get(req.shared.model.as_deref())?;
    let add_generation_prompt = req.own.add_generation_prompt.unwrap_or(true);
    let continue_final = req.own.continue_final_message.unwrap_or(false);
    if continue_final && add_generation_prompt {
        // As in vLLM: the two ask for opposite prompt endings.
        return Err(ApiError::invalid_param(
            "continue_final_message",
            "continue_final_message needs add_generation_prompt: false",
        ));
    }
    let tools = Tools::parse(
        req.own.tools.as_ref(),
        req.own.tool_choice.as_ref(),
        req.own.parallel_tool_calls,
    )?;
    let template_vars = template_vars(tools.as_ref(), req.own.chat_template_kwargs.clone());
    let messages = inputs::messages(&req.own.messages)?;
    let session = session_id(req.own.session_id.clone(), &headers)?;
    let logprobs = match (req.own.logprobs.unwrap_or(false), req.own.top_logprobs) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (false, None) => None,
    };
    let tool_grammar = tools.as_ref().and_then(Tools::grammar);
    let constraint_field = match tool_grammar {
        Some(_) => "tools",
        None => crate::structured::constraint_field(req.shared.response_format.as_ref()),
    };
    let params = sampling_params(
        &req.shared,
        EndpointParams {
            max_tokens: req.own.max_completion_tokens.or(req.shared.max_tokens),
            default_max_tokens: None,
            logprobs,
            extra_stop_token_ids: Vec::new(),
            constraint: tool_grammar,
        },
    )?;
    let conversation = match &session {
        Some(id) => app
            .sessions
            .conversation(tenant, &model.name, id, messages, arrival),
        None => messages,
    };
    if conversation.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let response_id = format!("chatcmpl-{}", request_id.0);
    let stream = req.shared.stream.unwrap_or(false);
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
            endpoint: "chat",
            response_id: response_id.clone(),
            constraint_field,
        },
    )?;
    let frontend = model.frontend.clone();
    let rendered = conversation.clone();
    let prompt_text = pending
        .tokenize(move || {
            let text = frontend.render_chat(
                &rendered,
                add_generation_prompt,
                continue_final,
                template_vars,
            )?;
            // The template already placed every special token: add none (as transformers does).
            let ids = frontend.tokenizer().encode(&text, false)?;
            let ids = frontend.prompt_token_ids(&Prompt::TokenIds(ids))?;
            Ok((vec![ids], text))
        })
        .await?;
    let renderer = ChatRenderer {
        shape: Shape {
            id: response_id,
            model: model.name.clone(),
            created: unix_now(),
        },
        reasoning: model.reasoning.then(|| prompt_opens_thinking(&prompt_text)),
        tool_calls: tools.as_ref().is_some_and(Tools::parses_calls),
        transforms: Vec::new(),
        stream,
        include_usage: req.shared.include_usage(),
        app: app.clone(),
        first: ChatPiece::default(),
        turn: session.map(|id| SessionTurn {
            tenant,
            id,
            conversation,
        }),
    };
    respond(pending, renderer, stream, app.keep_alive).await
}

/// The template's variables besides the messages: the tools, overridden by the request's
/// own `chat_template_kwargs`.
pub(super) fn template_vars(
    tools: Option<&Tools>,
    kwargs: Option<Map<String, Value>>,
) -> Option<Value> {
    let mut vars = tools.map(Tools::template_vars).unwrap_or_default();
    vars.extend(kwargs.unwrap_or_default());
    (!vars.is_empty()).then_some(Value::Object(vars))
}

/// The response's identity, shared by its objects and chunks.
struct Shape {
    id: String,
    model: String,
    created: u64,
}

impl Shape {
    fn object(
        &self,
        object: &'static str,
        choices: Vec<ChatChoice>,
        usage: Option<Usage>,
    ) -> ChatCompletion {
        ChatCompletion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        }
    }

    fn chunk(
        &self,
        index: usize,
        delta: ChatMessageOut,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&'static str>,
        stop_reason: Option<&StopReason>,
    ) -> Bytes {
        let choice = ChatChoice {
            index,
            message: None,
            delta: Some(delta),
            logprobs,
            finish_reason: finish,
            stop_reason: stop_reason_json(stop_reason),
        };
        sse::data(&self.object("chat.completion.chunk", vec![choice], None))
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// Renders `chat.completion` objects and chunks.
struct ChatRenderer {
    shape: Shape,
    /// Split reasoning off (`Some(true)`: the prompt opened `<think>`).
    reasoning: Option<bool>,
    /// Read the content for tool calls.
    tool_calls: bool,
    /// Stream: each choice's transforms.
    transforms: Vec<ChatTransform>,
    stream: bool,
    include_usage: bool,
    app: Arc<AppState>,
    turn: Option<SessionTurn>,
    /// Choice 0's content and tool calls as the client got them (call ids included), for the
    /// session: a client resends the reply in that shape.
    first: ChatPiece,
}

impl ChatRenderer {
    fn transform(&self) -> ChatTransform {
        ChatTransform::new(self.reasoning, self.tool_calls)
    }

    /// Records what choice 0's `piece` sent the client.
    fn record_first(&mut self, piece: &ChatPiece) {
        self.first.content.push_str(&piece.content);
        for call in &piece.calls {
            match self.first.calls.iter_mut().rfind(|c| c.index == call.index) {
                Some(known) if call.id.is_none() => known
                    .function
                    .arguments
                    .get_or_insert_with(String::new)
                    .push_str(call.function.arguments.as_deref().unwrap_or_default()),
                _ => self.first.calls.push(call.clone()),
            }
        }
    }

    /// Stores the turn when the first choice finished normally, less its reasoning: the reply
    /// as the model wrote it, or with tool calls as the client got them (content and
    /// `tool_calls`), which is how a client sends it back.
    fn remember(&mut self, running: &Running) {
        let Some(turn) = self.turn.take() else { return };
        let Some(first) = running.run.choices.first() else {
            return;
        };
        if matches!(first.finish_reason, Some("stop" | "length")) {
            let reply = if self.first.calls.is_empty() {
                ChatMessage::new(
                    "assistant",
                    match self.reasoning {
                        Some(opened) => ReasoningSplitter::split_all(opened, &first.text).content,
                        None => first.text.clone(),
                    },
                )
            } else {
                ChatMessage {
                    tool_calls: self.first.calls.iter().map(called).collect(),
                    ..ChatMessage::new("assistant", self.first.content.clone())
                }
            };
            self.app.sessions.store(
                turn.tenant,
                &running.model.name,
                &turn.id,
                turn.conversation,
                reply,
                Instant::now(),
            );
        }
    }

    /// The chunks of one piece of choice `index`: its text (with the delta's logprobs), then
    /// its tool calls.
    fn piece_chunks(
        &self,
        index: usize,
        piece: ChatPiece,
        logprobs: Option<ChatLogprobs>,
    ) -> Vec<Bytes> {
        let mut chunks = Vec::new();
        let has_text = !piece.content.is_empty() || !piece.reasoning.is_empty();
        if has_text || logprobs.is_some() {
            let out = ChatMessageOut {
                content: non_empty(piece.content),
                reasoning_content: non_empty(piece.reasoning),
                ..ChatMessageOut::default()
            };
            chunks.push(self.shape.chunk(index, out, logprobs, None, None));
        }
        if !piece.calls.is_empty() {
            let out = ChatMessageOut {
                tool_calls: Some(piece.calls),
                ..ChatMessageOut::default()
            };
            chunks.push(self.shape.chunk(index, out, None, None, None));
        }
        chunks
    }
}

impl Renderer for ChatRenderer {
    fn opening(&mut self, running: &Running) -> Vec<Bytes> {
        if !self.stream {
            return Vec::new();
        }
        let num_choices = running.run.choices.len();
        self.transforms = (0..num_choices).map(|_| self.transform()).collect();
        (0..num_choices)
            .map(|index| {
                let role = ChatMessageOut {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..ChatMessageOut::default()
                };
                self.shape.chunk(index, role, None, None, None)
            })
            .collect()
    }

    fn delta(&mut self, running: &Running, index: usize, delta: &Delta) -> (Vec<Bytes>, Flow) {
        if !self.stream {
            return (Vec::new(), Flow::Continue);
        }
        let transform = &mut self.transforms[index];
        let piece = transform.push_delta(delta);
        let called = transform.called();
        if index == 0 {
            self.record_first(&piece);
        }
        let tokenizer = running.model.frontend.tokenizer();
        let logprobs =
            (!delta.logprobs.is_empty()).then(|| chat_logprobs(tokenizer, &delta.logprobs));
        let mut chunks = self.piece_chunks(index, piece, logprobs);
        if let Some(reason) = delta.finish_reason {
            chunks.push(self.shape.chunk(
                index,
                ChatMessageOut::default(),
                None,
                Some(finish_reason(reason.as_str(), called)),
                delta.stop_reason.as_ref(),
            ));
        }
        (chunks, Flow::Continue)
    }

    fn closing(&mut self, running: &Running) -> Vec<Bytes> {
        // Choices that never got their final delta (cancelled while queued) end here.
        let mut chunks: Vec<Bytes> = running
            .run
            .unfinished()
            .map(|index| {
                self.shape
                    .chunk(index, ChatMessageOut::default(), None, Some("abort"), None)
            })
            .collect();
        self.remember(running);
        if self.include_usage {
            let usage = self.shape.object(
                "chat.completion.chunk",
                Vec::new(),
                Some(running.run.usage()),
            );
            chunks.push(sse::data(&usage));
        }
        chunks
    }

    fn whole(mut self, running: &Running) -> Response {
        let mut first = ChatPiece::default();
        let choices = each_choice(running, |tokenizer, index, c| {
            let (piece, called) = self.transform().all(&c.text);
            if index == 0 {
                first = piece.clone();
            }
            let calls: Vec<_> = piece
                .calls
                .into_iter()
                .map(|call| ToolCallOut {
                    index: None,
                    ..call
                })
                .collect();
            ChatChoice {
                index,
                message: Some(ChatMessageOut {
                    role: Some("assistant"),
                    // With calls and no text, content is absent (OpenAI's null).
                    content: if calls.is_empty() {
                        Some(piece.content)
                    } else {
                        non_empty(piece.content)
                    },
                    reasoning_content: self.reasoning.and_then(|_| non_empty(piece.reasoning)),
                    tool_calls: (!calls.is_empty()).then_some(calls),
                }),
                delta: None,
                logprobs: (!c.logprobs.is_empty()).then(|| chat_logprobs(tokenizer, &c.logprobs)),
                finish_reason: Some(finish_reason(c.finish_reason.unwrap_or("abort"), called)),
                stop_reason: stop_reason_json(c.stop_reason.as_ref()),
            }
        });
        self.record_first(&first);
        self.remember(running);
        let usage = running.run.usage();
        axum::Json(self.shape.object("chat.completion", choices, Some(usage))).into_response()
    }
}

/// A call as a chat message carries it; arguments that are not JSON stay a string.
fn called(call: &ToolCallOut) -> ToolCallMessage {
    let arguments = call.function.arguments.clone().unwrap_or_default();
    ToolCallMessage {
        id: call.id.clone(),
        name: call.function.name.clone().unwrap_or_default(),
        arguments: serde_json::from_str(&arguments).unwrap_or(Value::String(arguments)),
    }
}
