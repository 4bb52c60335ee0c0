//! `POST /v1/messages` (Anthropic's Messages API) and `POST /v1/messages/count_tokens`.
//!
//! A request becomes a chat conversation (`crate::protocol::messages`) and runs through the
//! same driver as chat completions; the chat transforms split the output into reasoning, text
//! and tool calls, and [`BlockBuilder`] turns those pieces into content blocks (`thinking`,
//! `text`, `tool_use`) and, streamed, into Anthropic's events (`message_start`,
//! `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`). Errors on
//! these routes take Anthropic's shape ([`anthropic_errors`]).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use novainfer_engine::{Delta, StopReason};
use serde_json::{json, Value};

use super::conversation::{prepare_conversation, template_vars, Conversation};
use super::driver::{respond, Flow, Renderer};
use super::run::{run_tokenize, Running};
use super::{JsonBody, X_REQUEST_ID};
use crate::accounting::ChoiceState;
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::protocol::messages::{
    chat_tool_choice, chat_tools, conversation, error_body, response_format, ContentBlock,
    CountTokensRequest, MessageObject, MessageUsage, MessagesRequest,
};
use crate::protocol::request::SharedFields;
use crate::protocol::responses::new_id;
use crate::sse;
use crate::state::{AppState, RequestId};
use crate::tools::Tools;
use crate::transform::{ChatPiece, ChatTransform};

/// Chat's field names as this API names them.
const RENAMES: &[(&str, &str)] = &[
    ("stop", "stop_sequences"),
    ("response_format", "output_config"),
    ("structured_outputs", "output_config"),
];

/// Every error answered on these routes, in Anthropic's shape (same status and headers);
/// the request log still reads the original error.
pub async fn anthropic_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let Some(error) = response.extensions().get::<ApiError>().cloned() else {
        return response;
    };
    let mut body = error_body(&error);
    if let Some(id) = response
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
    {
        body["request_id"] = Value::from(id);
    }
    let mut out = (error.status, Json(body)).into_response();
    for (name, value) in response.headers() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out.extensions_mut().insert(error);
    out
}

/// The conversation and tools of a body's `system`, `messages`, `tools`, `tool_choice`.
fn conversation_and_tools(
    system: Option<&Value>,
    messages: &Value,
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<(Vec<novainfer_engine::ChatMessage>, Option<Tools>), ApiError> {
    let messages = conversation(system, messages)?;
    let (choice, parallel) = chat_tool_choice(tool_choice)?;
    let tools = Tools::parse(chat_tools(tools)?.as_ref(), choice.as_ref(), parallel)?;
    Ok((messages, tools))
}

pub async fn create(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(tenant): Extension<Tenant>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req = MessagesRequest::parse(&body)?;
    crate::ignored::log_once("messages", &req.ignored());
    let model = app.models.get(req.model.as_deref())?;
    let (messages, tools) = conversation_and_tools(
        req.system.as_ref(),
        &req.messages,
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
    )?;
    let stream = req.stream.unwrap_or(false);
    let shared = SharedFields {
        model: req.model.clone(),
        max_tokens: req.max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.as_ref().map(|s| json!(s)),
        stream: Some(stream),
        user: req.metadata.as_ref().and_then(|m| m.user_id.clone()),
        response_format: response_format(req.output_config.as_ref())?,
        ..SharedFields::default()
    };
    let id = new_id("msg");
    let model_name = model.name.clone();
    let prepared = prepare_conversation(
        &app,
        &request_id,
        arrival,
        Conversation {
            model,
            messages,
            tools,
            shared,
            tenant,
            endpoint: "messages",
            response_id: id.clone(),
            renames: RENAMES,
        },
    )
    .await?;
    let renderer = MessagesRenderer {
        id,
        model: model_name,
        builder: BlockBuilder::default(),
        transform: ChatTransform::new(prepared.reasoning, prepared.tool_calls),
        reasoning: prepared.reasoning,
        tool_calls: prepared.tool_calls,
        stream,
    };
    respond(prepared.pending, renderer, stream, app.keep_alive).await
}

/// The prompt tokens a `/v1/messages` body with these fields would have.
pub async fn count_tokens(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let req = CountTokensRequest::parse(&body)?;
    let model = app.models.get(req.model.as_deref())?;
    let (messages, tools) = conversation_and_tools(
        req.system.as_ref(),
        &req.messages,
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
    )?;
    response_format(req.output_config.as_ref())?;
    let frontend = model.frontend.clone();
    let vars = template_vars(tools.as_ref());
    let count = run_tokenize(&app, move || {
        let text = frontend.render_chat(&messages, true, false, vars)?;
        Ok(frontend.tokenizer().encode(&text, false)?.len())
    })
    .await?;
    Ok(Json(json!({"input_tokens": count})).into_response())
}

/// The content blocks of a message as its pieces arrive, and the stream events that report
/// them. At most the last block is open; a piece of another kind closes it.
#[derive(Debug, Default)]
pub struct BlockBuilder {
    blocks: Vec<ContentBlock>,
    /// Each `tool_use` block's input as JSON text, as the model wrote it.
    inputs: Vec<String>,
    open: bool,
}

/// An event of type `kind` with `fields`.
fn event(kind: &str, mut fields: Value) -> Bytes {
    if let Value::Object(map) = &mut fields {
        map.insert("type".into(), Value::from(kind));
    }
    sse::named(kind, &fields)
}

fn delta_event(index: usize, delta: Value) -> Bytes {
    event(
        "content_block_delta",
        json!({"index": index, "delta": delta}),
    )
}

impl BlockBuilder {
    pub fn blocks(&self) -> &[ContentBlock] {
        &self.blocks
    }

    fn open_block(&self) -> Option<&ContentBlock> {
        self.blocks.last().filter(|_| self.open)
    }

    fn open(&mut self, block: ContentBlock) -> Vec<Bytes> {
        let mut events = self.close();
        let index = self.blocks.len();
        events.push(event(
            "content_block_start",
            json!({"index": index, "content_block": &block}),
        ));
        self.blocks.push(block);
        self.inputs.push(String::new());
        self.open = true;
        events
    }

    fn text(&mut self, delta: &str) -> Vec<Bytes> {
        let mut events = Vec::new();
        if !matches!(self.open_block(), Some(ContentBlock::Text { .. })) {
            events = self.open(ContentBlock::Text {
                text: String::new(),
            });
        }
        let index = self.blocks.len() - 1;
        if let Some(ContentBlock::Text { text }) = self.blocks.last_mut() {
            text.push_str(delta);
        }
        events.push(delta_event(
            index,
            json!({"type": "text_delta", "text": delta}),
        ));
        events
    }

    fn thinking(&mut self, delta: &str) -> Vec<Bytes> {
        let mut events = Vec::new();
        if !matches!(self.open_block(), Some(ContentBlock::Thinking { .. })) {
            events = self.open(ContentBlock::Thinking {
                thinking: String::new(),
                signature: String::new(),
            });
        }
        let index = self.blocks.len() - 1;
        if let Some(ContentBlock::Thinking { thinking, .. }) = self.blocks.last_mut() {
            thinking.push_str(delta);
        }
        events.push(delta_event(
            index,
            json!({"type": "thinking_delta", "thinking": delta}),
        ));
        events
    }

    fn input(&mut self, delta: &str) -> Vec<Bytes> {
        if !matches!(self.open_block(), Some(ContentBlock::ToolUse { .. })) {
            return Vec::new();
        }
        let index = self.blocks.len() - 1;
        self.inputs[index].push_str(delta);
        vec![delta_event(
            index,
            json!({"type": "input_json_delta", "partial_json": delta}),
        )]
    }

    /// The events of one piece of output: thinking, then text, then tool calls.
    pub fn push(&mut self, piece: ChatPiece) -> Vec<Bytes> {
        let mut events = Vec::new();
        if !piece.reasoning.is_empty() {
            events.extend(self.thinking(&piece.reasoning));
        }
        if !piece.content.is_empty() {
            events.extend(self.text(&piece.content));
        }
        for call in piece.calls {
            if let (Some(id), Some(name)) = (call.id, call.function.name) {
                events.extend(self.open(ContentBlock::ToolUse {
                    id: format!("toolu_{}", id.trim_start_matches("call_")),
                    name,
                    input: json!({}),
                }));
            }
            let arguments = call.function.arguments.unwrap_or_default();
            if !arguments.is_empty() {
                events.extend(self.input(&arguments));
            }
        }
        events
    }

    /// Ends the open block: a `tool_use` block gets its input parsed (`{}` if the output
    /// ended inside it).
    pub fn close(&mut self) -> Vec<Bytes> {
        if !self.open {
            return Vec::new();
        }
        self.open = false;
        let index = self.blocks.len() - 1;
        if let Some(ContentBlock::ToolUse { input, .. }) = self.blocks.last_mut() {
            *input = serde_json::from_str::<Value>(&self.inputs[index])
                .ok()
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
        }
        vec![event("content_block_stop", json!({"index": index}))]
    }
}

/// Anthropic's `stop_reason` and `stop_sequence` for a finished choice.
fn stop_reason(choice: &ChoiceState, called: bool) -> (Option<&'static str>, Option<String>) {
    match choice.finish_reason {
        Some("stop") if called => (Some("tool_use"), None),
        Some("stop") => match &choice.stop_reason {
            Some(StopReason::Text(s)) => (Some("stop_sequence"), Some(s.clone())),
            _ => (Some("end_turn"), None),
        },
        Some("length") => (Some("max_tokens"), None),
        // Cancelled before it finished: no reason Anthropic has fits.
        _ => (None, None),
    }
}

struct MessagesRenderer {
    id: String,
    model: String,
    builder: BlockBuilder,
    transform: ChatTransform,
    reasoning: Option<bool>,
    tool_calls: bool,
    stream: bool,
}

impl MessagesRenderer {
    fn usage(running: &Running) -> MessageUsage {
        let usage = running.run.usage();
        MessageUsage::new(
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens,
        )
    }

    fn error_event(error: &ApiError) -> Bytes {
        sse::named("error", &error_body(error))
    }
}

impl Renderer for MessagesRenderer {
    const DONE: bool = false;

    fn opening(&mut self, running: &Running) -> Vec<Bytes> {
        if !self.stream {
            return Vec::new();
        }
        let message = MessageObject {
            id: self.id.clone(),
            kind: "message",
            role: "assistant",
            model: self.model.clone(),
            content: Vec::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: MessageUsage::new(running.run.usage().prompt_tokens, 0, 0),
        };
        vec![event("message_start", json!({"message": message}))]
    }

    fn delta(&mut self, _running: &Running, _index: usize, delta: &Delta) -> (Vec<Bytes>, Flow) {
        if !self.stream {
            return (Vec::new(), Flow::Continue);
        }
        let piece = self.transform.push_delta(delta);
        (self.builder.push(piece), Flow::Continue)
    }

    fn closing(&mut self, running: &Running) -> Vec<Bytes> {
        let mut events = self.builder.close();
        let (reason, sequence) = running
            .run
            .choices
            .first()
            .map_or((None, None), |c| stop_reason(c, self.transform.called()));
        events.push(event(
            "message_delta",
            json!({"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": Self::usage(running)}),
        ));
        events.push(event("message_stop", json!({})));
        events
    }

    fn whole(mut self, running: &Running) -> Response {
        let choice = running.run.choices.first().cloned().unwrap_or_default();
        let (piece, called) = ChatTransform::new(self.reasoning, self.tool_calls).all(&choice.text);
        self.builder.push(piece);
        self.builder.close();
        let (stop_reason, stop_sequence) = stop_reason(&choice, called);
        Json(MessageObject {
            id: self.id,
            kind: "message",
            role: "assistant",
            model: self.model,
            content: self.builder.blocks().to_vec(),
            stop_reason,
            stop_sequence,
            usage: Self::usage(running),
        })
        .into_response()
    }

    fn failed(&mut self, _running: &Running, error: &ApiError) -> Vec<Bytes> {
        vec![Self::error_event(error)]
    }

    fn refused(error: &ApiError) -> Vec<Bytes> {
        vec![Self::error_event(error)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::response::{FunctionCallOut, ToolCallOut};
    use crate::sse::parse_named as parse;

    #[test]
    fn thinking_text_and_tool_use_stream_as_anthropic_events() {
        let mut b = BlockBuilder::default();
        let mut events = b.push(ChatPiece {
            reasoning: "hm".into(),
            content: "Let me.".into(),
            calls: vec![ToolCallOut {
                index: Some(0),
                id: Some("call_abc".into()),
                kind: Some("function"),
                function: FunctionCallOut {
                    name: Some("w".into()),
                    arguments: Some("{\"city\":".into()),
                },
            }],
        });
        events.extend(b.push(ChatPiece {
            calls: vec![ToolCallOut {
                index: Some(0),
                function: FunctionCallOut {
                    name: None,
                    arguments: Some(" \"Paris\"}".into()),
                },
                ..ToolCallOut::default()
            }],
            ..ChatPiece::default()
        }));
        events.extend(b.close());
        let parsed = parse(&events);
        let kinds: Vec<&str> = parsed.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds,
            vec![
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
            ]
        );
        assert_eq!(
            parsed[0].1["content_block"],
            json!({"type": "thinking", "thinking": "", "signature": ""})
        );
        assert_eq!(
            parsed[1].1["delta"],
            json!({"type": "thinking_delta", "thinking": "hm"})
        );
        assert_eq!(
            parsed[4].1["delta"],
            json!({"type": "text_delta", "text": "Let me."})
        );
        assert_eq!(
            parsed[6].1["content_block"],
            json!({"type": "tool_use", "id": "toolu_abc", "name": "w", "input": {}})
        );
        assert_eq!(parsed[7].1["delta"]["type"], "input_json_delta");
        assert_eq!(parsed[9].1["index"], 2);
        assert_eq!(
            b.blocks()[2],
            ContentBlock::ToolUse {
                id: "toolu_abc".into(),
                name: "w".into(),
                input: json!({"city": "Paris"})
            }
        );
    }

    #[test]
    fn stop_reasons_follow_anthropic() {
        let choice = |finish: &'static str, stop: Option<StopReason>| {
            let mut c = ChoiceState::default();
            c.finish_reason = Some(finish);
            c.stop_reason = stop;
            c
        };
        assert_eq!(
            stop_reason(&choice("stop", None), false),
            (Some("end_turn"), None)
        );
        assert_eq!(
            stop_reason(&choice("stop", None), true),
            (Some("tool_use"), None)
        );
        assert_eq!(
            stop_reason(&choice("stop", Some(StopReason::Text("END".into()))), false),
            (Some("stop_sequence"), Some("END".into()))
        );
        assert_eq!(
            stop_reason(&choice("stop", Some(StopReason::TokenId(7))), false),
            (Some("end_turn"), None)
        );
        assert_eq!(
            stop_reason(&choice("length", None), true),
            (Some("max_tokens"), None)
        );
        assert_eq!(stop_reason(&ChoiceState::default(), false), (None, None));
    }
}
