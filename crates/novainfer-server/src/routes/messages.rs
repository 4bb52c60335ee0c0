//! `POST /v1/messages` (Anthropic's Messages API) and `POST /v1/messages/count_tokens`.
//!
//! A request becomes a chat conversation (`crate::protocol::messages`) and runs through the
//! same driver as chat completions; the chat transforms split the output into reasoning, text
//! and tool calls, and [`Blocks`] turns those pieces into content blocks (`thinking`,
//! `text`, `tool_use`) and, streamed, into Anthropic's events (`message_start`,
//! `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`). Errors on
//! these routes take Anthropic's shape ([`anthropic_errors`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use novainfer_core::SamplingParams;
use novainfer_engine::{Delta, StopReason};
use serde_json::{json, Value};

use super::driver::{Flow, Renderer};
use super::generate::{Api, ChatInput, Context, GenerationRequest, Tokenized};
use super::output_items::{ItemBuilder, ItemLayout, PieceKind};
use super::run::{run_tokenize, Running};
use super::{JsonBody, X_REQUEST_ID};
use crate::accounting::ChoiceState;
use crate::error::ApiError;
use crate::protocol::agent_tools::chat_tools;
use crate::protocol::messages::{
    chat_tool_choice, conversation, error_body, response_format, ContentBlock, CountTokensRequest,
    MessageObject, MessageUsage, MessagesRequest, TOOLS,
};
use crate::protocol::request::SharedFields;
use crate::protocol::responses::new_id;
use crate::sse;
use crate::state::AppState;
use crate::tools::Tools;
use crate::transform::ChatTransform;

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
) -> Result<ChatInput, ApiError> {
    let messages = conversation(system, messages)?;
    let (choice, parallel) = chat_tool_choice(tool_choice)?;
    let tools = Tools::parse(
        chat_tools(&TOOLS, tools)?.as_ref(),
        choice.as_ref(),
        parallel,
    )?;
    Ok(ChatInput::new(messages, tools))
}

/// Anthropic's Messages API as an [`Api`].
pub struct Messages(MessagesRequest);

/// What the renderer needs of the request.
pub struct MessagesPlan {
    id: String,
    model: String,
    stream: bool,
}

impl Api for Messages {
    const ENDPOINT: &'static str = "messages";
    const RENAMES: &'static [(&'static str, &'static str)] = RENAMES;
    type Plan = MessagesPlan;
    type Renderer = MessagesRenderer;

    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        MessagesRequest::parse(body).map(Messages)
    }

    fn model(&self) -> Option<&str> {
        self.0.model.as_deref()
    }

    fn ignored_fields(&self) -> Vec<&'static str> {
        self.0.ignored()
    }

    fn request(self, cx: &Context) -> Result<(GenerationRequest, MessagesPlan), ApiError> {
        let Messages(req) = self;
        let chat = conversation_and_tools(
            req.system.as_ref(),
            &req.messages,
            req.tools.as_ref(),
            req.tool_choice.as_ref(),
        )?;
        let stream = req.stream.unwrap_or(false);
        let sampling = SharedFields {
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
        let plan = MessagesPlan {
            id: id.clone(),
            model: cx.model.name.clone(),
            stream,
        };
        let request = GenerationRequest::conversation(chat, sampling, id, stream);
        Ok((request, plan))
    }

    fn renderer(
        plan: MessagesPlan,
        _cx: &Context,
        _params: &SamplingParams,
        prompt: Tokenized,
    ) -> MessagesRenderer {
        MessagesRenderer {
            id: plan.id,
            model: plan.model,
            builder: BlockBuilder::default(),
            transform: ChatTransform::new(prompt.reasoning, prompt.tool_calls),
            reasoning: prompt.reasoning,
            tool_calls: prompt.tool_calls,
            stream: plan.stream,
        }
    }
}

/// The prompt tokens a `/v1/messages` body with these fields would have.
pub async fn count_tokens(
    State(app): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let req = CountTokensRequest::parse(&body)?;
    let model = app.models.get(req.model.as_deref())?;
    let chat = conversation_and_tools(
        req.system.as_ref(),
        &req.messages,
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
    )?;
    response_format(req.output_config.as_ref())?;
    let frontend = model.frontend.clone();
    let count = run_tokenize(&app, move || Ok(chat.render(&frontend)?.0.len())).await?;
    Ok(Json(json!({"input_tokens": count})).into_response())
}

/// A message's content blocks (`thinking`, `text`, `tool_use`) and Anthropic's stream events
/// for them (`content_block_start` / `_delta` / `_stop`).
#[derive(Debug, Default)]
pub struct Blocks {
    /// Each block's `tool_use` input as JSON text, as the model wrote it (parsed on close).
    inputs: Vec<String>,
}

/// The content blocks of a message as its pieces arrive.
pub type BlockBuilder = ItemBuilder<Blocks>;

/// An event of type `kind` with `fields`.
fn event(kind: &str, mut fields: Value) -> Bytes {
    if let Value::Object(map) = &mut fields {
        map.insert("type".into(), Value::from(kind));
    }
    sse::named(kind, &fields)
}

impl ItemLayout for Blocks {
    type Item = ContentBlock;

    fn kind(block: &ContentBlock) -> PieceKind {
        match block {
            ContentBlock::Thinking { .. } => PieceKind::Reasoning,
            ContentBlock::Text { .. } => PieceKind::Text,
            ContentBlock::ToolUse { .. } => PieceKind::Call,
        }
    }

    fn new_item(&mut self, kind: PieceKind) -> ContentBlock {
        match kind {
            PieceKind::Reasoning => ContentBlock::Thinking {
                thinking: String::new(),
                signature: String::new(),
            },
            _ => ContentBlock::Text {
                text: String::new(),
            },
        }
    }

    fn new_call(&mut self, call_id: String, name: String) -> ContentBlock {
        ContentBlock::ToolUse {
            id: format!("toolu_{}", call_id.trim_start_matches("call_")),
            name,
            input: json!({}),
        }
    }

    fn opened(&mut self, index: usize, block: &mut ContentBlock) -> Vec<Bytes> {
        self.inputs.resize(index + 1, String::new());
        vec![event(
            "content_block_start",
            json!({"index": index, "content_block": &block}),
        )]
    }

    fn append(&mut self, index: usize, block: &mut ContentBlock, delta: &str) -> Vec<Bytes> {
        let delta = match block {
            ContentBlock::Thinking { thinking, .. } => {
                thinking.push_str(delta);
                json!({"type": "thinking_delta", "thinking": delta})
            }
            ContentBlock::Text { text } => {
                text.push_str(delta);
                json!({"type": "text_delta", "text": delta})
            }
            ContentBlock::ToolUse { .. } => {
                self.inputs[index].push_str(delta);
                json!({"type": "input_json_delta", "partial_json": delta})
            }
        };
        vec![event(
            "content_block_delta",
            json!({"index": index, "delta": delta}),
        )]
    }

    /// A `tool_use` block gets its input parsed (`{}` if the output ended inside it).
    fn closed(&mut self, index: usize, block: &mut ContentBlock, _: &'static str) -> Vec<Bytes> {
        if let ContentBlock::ToolUse { input, .. } = block {
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

pub struct MessagesRenderer {
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
        let mut events = self.builder.close("completed");
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
        self.builder.close("completed");
        let (stop_reason, stop_sequence) = stop_reason(&choice, called);
        Json(MessageObject {
            id: self.id,
            kind: "message",
            role: "assistant",
            model: self.model,
            content: self.builder.items().to_vec(),
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
    use crate::transform::ChatPiece;

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
        events.extend(b.close("completed"));
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
            b.items()[2],
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
