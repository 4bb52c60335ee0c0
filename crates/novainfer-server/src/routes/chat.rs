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
use novainfer_core::SamplingParams;
use novainfer_engine::{ChatMessage, Delta, StopReason, ToolCallMessage};
use serde_json::Value;

use super::driver::{each_choice, Flow, Renderer};
use super::generate::{Api, ChatInput, Context, GenerationRequest, Input, Tokenized};
use super::run::Running;
use crate::accounting::{chat_logprobs, stop_reason_json};
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::params::EndpointParams;
use crate::protocol::inputs;
use crate::protocol::request::{parse_generation, ChatRequest};
use crate::protocol::response::{
    unix_now, ChatChoice, ChatCompletion, ChatLogprobs, ChatMessageOut, ToolCallOut, Usage,
    SYSTEM_FINGERPRINT,
};
use crate::reasoning::ReasoningSplitter;
use crate::sessions::MAX_SESSION_ID_LEN;
use crate::sse;
use crate::state::AppState;
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

/// Chat's `logprobs` and `top_logprobs` as the alternatives per token, when asked for.
fn logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<i64>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, Some(_)) => Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        )),
        (false, None) => Ok(None),
    }
}

/// Chat completions as an [`Api`].
pub struct Chat(ChatRequest);

/// What the renderer needs of the request.
pub struct ChatPlan {
    shape: Shape,
    stream: bool,
    include_usage: bool,
    turn: Option<SessionTurn>,
}

impl Api for Chat {
    const ENDPOINT: &'static str = "chat";
    type Plan = ChatPlan;
    type Renderer = ChatRenderer;

    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse_generation(body).map(Chat)
    }

    fn model(&self) -> Option<&str> {
        self.0.shared.model.as_deref()
    }

    fn ignored_fields(&self) -> Vec<&'static str> {
        self.0.ignored.clone()
    }

    fn request(self, cx: &Context) -> Result<(GenerationRequest, ChatPlan), ApiError> {
        let Chat(req) = self;
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
        let messages = inputs::messages(&req.own.messages)?;
        let session = session_id(req.own.session_id.clone(), &cx.headers)?;
        let logprobs = logprobs(req.own.logprobs, req.own.top_logprobs)?;
        let conversation = match &session {
            Some(id) => {
                cx.app
                    .sessions
                    .conversation(cx.tenant, &cx.model.name, id, messages, cx.arrival)
            }
            None => messages,
        };
        if conversation.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must not be empty",
            ));
        }
        let response_id = format!("chatcmpl-{}", cx.request_id.0);
        let stream = req.shared.stream.unwrap_or(false);
        let output = EndpointParams {
            max_tokens: req.own.max_completion_tokens.or(req.shared.max_tokens),
            default_max_tokens: None,
            logprobs,
            extra_stop_token_ids: Vec::new(),
            constraint: tools.as_ref().and_then(Tools::grammar),
        };
        let plan = ChatPlan {
            shape: Shape {
                id: response_id.clone(),
                model: cx.model.name.clone(),
                created: unix_now(),
            },
            stream,
            include_usage: req.shared.include_usage(),
            turn: session.map(|id| SessionTurn {
                tenant: cx.tenant,
                id,
                conversation: conversation.clone(),
            }),
        };
        let input = ChatInput {
            messages: conversation,
            tools,
            template_kwargs: req.own.chat_template_kwargs,
            add_generation_prompt,
            continue_final,
        };
        let request = GenerationRequest {
            input: Input::Chat(input),
            sampling: req.shared,
            output,
            response_id,
            stream,
            prompt_logprobs: false,
        };
        Ok((request, plan))
    }

    fn renderer(
        plan: ChatPlan,
        cx: &Context,
        _params: &SamplingParams,
        prompt: Tokenized,
    ) -> ChatRenderer {
        ChatRenderer {
            shape: plan.shape,
            reasoning: prompt.reasoning,
            tool_calls: prompt.tool_calls,
            transforms: Vec::new(),
            stream: plan.stream,
            include_usage: plan.include_usage,
            app: cx.app.clone(),
            first: ChatPiece::default(),
            turn: plan.turn,
        }
    }
}

/// The response's identity, shared by its objects and chunks.
pub struct Shape {
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
pub struct ChatRenderer {
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
