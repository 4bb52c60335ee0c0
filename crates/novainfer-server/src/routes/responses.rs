//! `POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A request becomes a chat conversation (`crate::protocol::responses`), optionally continuing
//! a stored response (`previous_response_id`), and runs through the same driver as chat
//! completions: the chat transforms split the output into reasoning, text and tool calls, and
//! [`Output`] turns those pieces into output items and, streamed, into the typed event
//! sequence (`response.created` ... `response.completed`, each with its `sequence_number`).
//! The non-streamed answer is built by the same builder from the whole output, so both say
//! the same. A finished response is stored (unless `store: false`) for follow-ups and `GET`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use novainfer_core::SamplingParams;
use novainfer_engine::{ChatMessage, Delta};
use serde_json::{json, Value};

use super::driver::{Flow, Renderer};
use super::generate::{Api, ChatInput, Context, GenerationRequest, Tokenized};
use super::output_items::{ItemBuilder, ItemLayout, PieceKind};
use super::run::Running;
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::protocol::agent_tools::chat_tools;
use crate::protocol::request::SharedFields;
use crate::protocol::response::unix_now;
use crate::protocol::responses::{
    chat_tool_choice, input_messages, new_id, response_format, IncompleteDetails,
    InputTokensDetails, OutputItem, OutputText, OutputTokensDetails, ReasoningText, ResponseError,
    ResponseObject, ResponseUsage, ResponsesRequest, TOOLS,
};
use crate::reasoning::ReasoningSplitter;
use crate::response_store::StoredResponse;
use crate::sse;
use crate::state::AppState;
use crate::tools::Tools;
use crate::transform::ChatTransform;

/// Chat's field names as this API names them.
const RENAMES: &[(&str, &str)] = &[
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text"),
    ("structured_outputs", "text"),
];

fn previous_not_found(id: &str) -> ApiError {
    ApiError::invalid_param(
        "previous_response_id",
        format!("Previous response with id {id:?} not found (it was not stored, has expired, or belongs to another API key)."),
    )
    .with_code("previous_response_not_found")
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "No response with id {id:?} (it was not stored, has expired, or belongs to another API key)."
    ))
}

/// The response object as it starts: the request's settings echoed, no output yet. `store`:
/// whether it will be stored (with `--max-stored-responses 0` nothing is, whatever was asked).
fn base_object(req: &ResponsesRequest, id: String, model: String, store: bool) -> ResponseObject {
    ResponseObject {
        id,
        object: "response",
        created_at: unix_now(),
        status: "in_progress",
        completed_at: None,
        error: None,
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model,
        output: Vec::new(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        previous_response_id: req.previous_response_id.clone(),
        reasoning: json!({"effort": null, "summary": null}),
        store,
        temperature: req.temperature.unwrap_or(1.0),
        text: json!({"format": req
            .text
            .as_ref()
            .and_then(|t| t.get("format"))
            .filter(|f| !f.is_null())
            .cloned()
            .unwrap_or_else(|| json!({"type": "text"}))}),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        tools: match &req.tools {
            Some(Value::Array(tools)) => tools.clone(),
            _ => Vec::new(),
        },
        top_p: req.top_p.unwrap_or(1.0),
        truncation: "disabled",
        usage: None,
        user: req.user.clone(),
        metadata: req.metadata.clone().unwrap_or_default(),
    }
}

/// The Responses API as an [`Api`].
pub struct Responses(ResponsesRequest);

/// What the renderer needs of the request.
pub struct ResponsesPlan {
    base: ResponseObject,
    stream: bool,
    keep: Option<Keep>,
}

impl Api for Responses {
    const ENDPOINT: &'static str = "responses";
    const RENAMES: &'static [(&'static str, &'static str)] = RENAMES;
    type Plan = ResponsesPlan;
    type Renderer = ResponsesRenderer;

    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        ResponsesRequest::parse(body).map(Responses)
    }

    fn model(&self) -> Option<&str> {
        self.0.model.as_deref()
    }

    fn ignored_fields(&self) -> Vec<&'static str> {
        self.0.ignored()
    }

    fn request(self, cx: &Context) -> Result<(GenerationRequest, ResponsesPlan), ApiError> {
        let Responses(req) = self;
        let (app, tenant) = (&cx.app, cx.tenant);
        let previous = match &req.previous_response_id {
            Some(id) => Some(
                app.responses
                    .get(tenant, id, cx.arrival)
                    .ok_or_else(|| previous_not_found(id))?,
            ),
            None => None,
        };
        let input = req
            .input
            .as_ref()
            .ok_or_else(|| ApiError::invalid_param("input", "`input` is required"))?;
        // The stored turns, then the new items; instructions are the request's own (a
        // follow-up does not inherit them), placed first as the system message.
        let mut conversation = previous.map(|p| p.conversation.clone()).unwrap_or_default();
        conversation.extend(input_messages(input)?);
        let messages: Vec<ChatMessage> = req
            .instructions
            .iter()
            .map(|i| ChatMessage::new("system", i.clone()))
            .chain(conversation.iter().cloned())
            .collect();
        let tools = Tools::parse(
            chat_tools(&TOOLS, req.tools.as_ref())?.as_ref(),
            chat_tool_choice(req.tool_choice.as_ref())?.as_ref(),
            req.parallel_tool_calls,
        )?;
        let stream = req.stream.unwrap_or(false);
        let id = new_id("resp");
        let sampling = SharedFields {
            model: req.model.clone(),
            max_tokens: req.max_output_tokens,
            temperature: req.temperature,
            top_p: req.top_p,
            stream: Some(stream),
            user: req.user.clone(),
            timeout: req.timeout,
            priority: req.priority,
            response_format: response_format(req.text.as_ref())?,
            ..SharedFields::default()
        };
        let store = req.store.unwrap_or(true) && app.responses.enabled();
        let base = base_object(&req, id.clone(), cx.model.name.clone(), store);
        let keep = base.store.then_some(Keep {
            tenant,
            conversation,
        });
        let chat = ChatInput::new(messages, tools);
        let request = GenerationRequest::conversation(chat, sampling, id, stream);
        Ok((request, ResponsesPlan { base, stream, keep }))
    }

    fn renderer(
        plan: ResponsesPlan,
        cx: &Context,
        _params: &SamplingParams,
        prompt: Tokenized,
    ) -> ResponsesRenderer {
        ResponsesRenderer {
            base: plan.base,
            builder: OutputBuilder::default(),
            transform: ChatTransform::new(prompt.reasoning, prompt.tool_calls),
            reasoning: prompt.reasoning,
            tool_calls: prompt.tool_calls,
            stream: plan.stream,
            app: cx.app.clone(),
            keep: plan.keep,
        }
    }
}

pub async fn retrieve(
    State(app): State<Arc<AppState>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let stored = app
        .responses
        .get(tenant, &id, Instant::now())
        .ok_or_else(|| not_found(&id))?;
    Ok(Json(stored.object.clone()).into_response())
}

pub async fn delete(
    State(app): State<Arc<AppState>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !app.responses.delete(tenant, &id) {
        return Err(not_found(&id));
    }
    Ok(Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response())
}

/// Where to store the finished response: its owner and the conversation it answered.
pub struct Keep {
    tenant: Tenant,
    conversation: Vec<ChatMessage>,
}

/// A response's output items (`reasoning`, `message`, `function_call`) and the typed stream
/// events for them, each numbered (`sequence_number`, shared with the lifecycle events).
#[derive(Debug, Default)]
pub struct Output {
    seq: u64,
}

/// A response's output items as its pieces arrive.
pub type OutputBuilder = ItemBuilder<Output>;

impl Output {
    /// An event of type `kind` with `fields`, numbered.
    pub fn event(&mut self, kind: &str, mut fields: Value) -> Bytes {
        if let Value::Object(map) = &mut fields {
            map.insert("type".into(), Value::from(kind));
            map.insert("sequence_number".into(), Value::from(self.seq));
        }
        self.seq += 1;
        sse::named(kind, &fields)
    }
}

impl ItemLayout for Output {
    type Item = OutputItem;

    fn kind(item: &OutputItem) -> PieceKind {
        match item {
            OutputItem::Reasoning { .. } => PieceKind::Reasoning,
            OutputItem::Message { .. } => PieceKind::Text,
            OutputItem::FunctionCall { .. } => PieceKind::Call,
        }
    }

    fn new_item(&mut self, kind: PieceKind) -> OutputItem {
        match kind {
            PieceKind::Reasoning => OutputItem::Reasoning {
                id: new_id("rs"),
                summary: Vec::new(),
                content: Vec::new(),
                status: "in_progress",
            },
            _ => OutputItem::Message {
                id: new_id("msg"),
                status: "in_progress",
                role: "assistant",
                content: Vec::new(),
            },
        }
    }

    fn new_call(&mut self, call_id: String, name: String) -> OutputItem {
        OutputItem::FunctionCall {
            id: new_id("fc"),
            call_id,
            name,
            arguments: String::new(),
            status: "in_progress",
        }
    }

    /// `output_item.added`, and the empty content part a message or reasoning item writes
    /// into.
    fn opened(&mut self, index: usize, item: &mut OutputItem) -> Vec<Bytes> {
        let mut events = vec![self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": &item}),
        )];
        let part = match item {
            OutputItem::Message { content, .. } => {
                content.push(OutputText::new(String::new()));
                json!(content[0])
            }
            OutputItem::Reasoning { content, .. } => {
                content.push(ReasoningText::new(String::new()));
                json!(content[0])
            }
            OutputItem::FunctionCall { .. } => return events,
        };
        events.push(self.event(
            "response.content_part.added",
            json!({"item_id": item.id(), "output_index": index, "content_index": 0, "part": part}),
        ));
        events
    }

    fn append(&mut self, index: usize, item: &mut OutputItem, delta: &str) -> Vec<Bytes> {
        let (kind, fields) = match item {
            OutputItem::Message { id, content, .. } => {
                content[0].text.push_str(delta);
                (
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []}),
                )
            }
            OutputItem::Reasoning { id, content, .. } => {
                content[0].text.push_str(delta);
                (
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
                )
            }
            OutputItem::FunctionCall { id, arguments, .. } => {
                arguments.push_str(delta);
                (
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": delta}),
                )
            }
        };
        vec![self.event(kind, fields)]
    }

    /// The item's `...done` events, then `output_item.done`.
    fn closed(&mut self, index: usize, item: &mut OutputItem, status: &'static str) -> Vec<Bytes> {
        item.set_status(status);
        let mut events = Vec::new();
        match &*item {
            OutputItem::Message { id, content, .. } => {
                let part = &content[0];
                events.push(self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": part.text, "logprobs": []}),
                ));
                events.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
            }
            OutputItem::Reasoning { id, content, .. } => {
                let part = &content[0];
                events.push(self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": part.text}),
                ));
                events.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
            }
            OutputItem::FunctionCall {
                id,
                name,
                arguments,
                ..
            } => {
                events.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}),
                ));
            }
        }
        events.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": &item}),
        ));
        events
    }
}

/// How a finished generation ends its response: status, the lifecycle event announcing it,
/// why it is incomplete, and the status of its last item.
fn ending(finish: Option<&str>) -> (&'static str, &'static str, Option<&'static str>) {
    match finish {
        Some("stop") => ("completed", "response.completed", None),
        Some("length") => (
            "incomplete",
            "response.incomplete",
            Some("max_output_tokens"),
        ),
        // Cancelled (`/v1/requests/{id}/cancel`) before it finished.
        _ => ("cancelled", "response.failed", None),
    }
}

pub struct ResponsesRenderer {
    base: ResponseObject,
    builder: OutputBuilder,
    transform: ChatTransform,
    reasoning: Option<bool>,
    tool_calls: bool,
    stream: bool,
    app: Arc<AppState>,
    keep: Option<Keep>,
}

impl ResponsesRenderer {
    /// The response as it stands, with `status`.
    fn object(&self, running: &Running, status: &'static str) -> ResponseObject {
        let usage = running.run.usage();
        let reasoning: String = self
            .builder
            .items()
            .iter()
            .filter_map(|item| match item {
                OutputItem::Reasoning { content, .. } => Some(content[0].text.as_str()),
                _ => None,
            })
            .collect();
        let reasoning_tokens = if reasoning.is_empty() {
            0
        } else {
            let tokenizer = running.model.frontend.tokenizer();
            tokenizer
                .encode(&reasoning, false)
                .map_or(0, |ids| ids.len())
        };
        let finished = status != "in_progress";
        ResponseObject {
            status,
            completed_at: (status == "completed").then(unix_now),
            output: self.builder.items().to_vec(),
            usage: finished.then_some(ResponseUsage {
                input_tokens: usage.prompt_tokens,
                input_tokens_details: InputTokensDetails {
                    cached_tokens: usage.prompt_tokens_details.cached_tokens,
                    cache_write_tokens: 0,
                },
                output_tokens: usage.completion_tokens,
                output_tokens_details: OutputTokensDetails { reasoning_tokens },
                total_tokens: usage.total_tokens,
            }),
            ..self.base.clone()
        }
    }

    /// Closes the output and returns the final object and its lifecycle event; stores it.
    fn finish(&mut self, running: &Running) -> (ResponseObject, &'static str, Vec<Bytes>) {
        let choice = running.run.choices.first();
        let (status, event, incomplete) = ending(choice.and_then(|c| c.finish_reason));
        let events = self.builder.close(if status == "completed" {
            "completed"
        } else {
            "incomplete"
        });
        let mut object = self.object(running, status);
        object.incomplete_details = incomplete.map(|reason| IncompleteDetails { reason });
        if status == "cancelled" {
            object.error = Some(ResponseError {
                code: "cancelled",
                message: "the response was cancelled before it finished".into(),
            });
        }
        if let (Some(keep), Some(choice), "completed" | "incomplete") =
            (self.keep.take(), choice, status)
        {
            // The reply as the model wrote it (tool calls included), less its reasoning, so a
            // follow-up renders exactly the tokens this turn computed.
            let reply = match self.reasoning {
                Some(opened) => ReasoningSplitter::split_all(opened, &choice.text).content,
                None => choice.text.clone(),
            };
            let mut conversation = keep.conversation;
            conversation.push(ChatMessage::new("assistant", reply));
            self.app.responses.insert(
                keep.tenant,
                &object.id,
                StoredResponse {
                    model: running.model.name.clone(),
                    object: serde_json::to_value(&object).unwrap_or(Value::Null),
                    conversation,
                },
                Instant::now(),
            );
        }
        (object, event, events)
    }
}

impl Renderer for ResponsesRenderer {
    const DONE: bool = false;

    fn opening(&mut self, running: &Running) -> Vec<Bytes> {
        if !self.stream {
            return Vec::new();
        }
        let object = self.object(running, "in_progress");
        vec![
            self.builder
                .layout
                .event("response.created", json!({"response": &object})),
            self.builder
                .layout
                .event("response.in_progress", json!({"response": &object})),
        ]
    }

    fn delta(&mut self, _running: &Running, _index: usize, delta: &Delta) -> (Vec<Bytes>, Flow) {
        if !self.stream {
            return (Vec::new(), Flow::Continue);
        }
        let piece = self.transform.push_delta(delta);
        (self.builder.push(piece), Flow::Continue)
    }

    fn closing(&mut self, running: &Running) -> Vec<Bytes> {
        let (object, event, mut events) = self.finish(running);
        events.push(
            self.builder
                .layout
                .event(event, json!({"response": object})),
        );
        events
    }

    fn whole(mut self, running: &Running) -> Response {
        let text = running
            .run
            .choices
            .first()
            .map(|c| c.text.as_str())
            .unwrap_or_default();
        let (piece, _) = ChatTransform::new(self.reasoning, self.tool_calls).all(text);
        self.builder.push(piece);
        let (object, _, _) = self.finish(running);
        Json(object).into_response()
    }

    fn failed(&mut self, running: &Running, error: &ApiError) -> Vec<Bytes> {
        let mut events = vec![self.builder.layout.event(
            "error",
            json!({"code": error.code, "message": error.message, "param": error.param}),
        )];
        events.extend(self.builder.close("incomplete"));
        let mut object = self.object(running, "failed");
        object.error = Some(ResponseError {
            code: "server_error",
            message: error.message.clone(),
        });
        events.push(
            self.builder
                .layout
                .event("response.failed", json!({"response": object})),
        );
        events
    }

    fn refused(error: &ApiError) -> Vec<Bytes> {
        vec![Output::default().event(
            "error",
            json!({"code": error.code, "message": error.message, "param": error.param}),
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::response::{FunctionCallOut, ToolCallOut};
    use crate::sse::parse_named as parse;
    use crate::transform::ChatPiece;

    fn piece(reasoning: &str, content: &str, calls: Vec<ToolCallOut>) -> ChatPiece {
        ChatPiece {
            reasoning: reasoning.into(),
            content: content.into(),
            calls,
        }
    }

    fn call_start(name: &str) -> ToolCallOut {
        ToolCallOut {
            index: Some(0),
            id: Some("call_1".into()),
            kind: Some("function"),
            function: FunctionCallOut {
                name: Some(name.into()),
                arguments: Some(String::new()),
            },
        }
    }

    fn call_more(text: &str) -> ToolCallOut {
        ToolCallOut {
            index: Some(0),
            function: FunctionCallOut {
                name: None,
                arguments: Some(text.into()),
            },
            ..ToolCallOut::default()
        }
    }

    #[test]
    fn reasoning_text_and_a_call_stream_as_typed_events_in_order() {
        let mut b = OutputBuilder::default();
        let mut events = vec![b.layout.event("response.created", json!({"response": {}}))];
        events.extend(b.push(piece("hm", "", vec![])));
        events.extend(b.push(piece("m", "Let", vec![])));
        events.extend(b.push(piece("", " me.", vec![call_start("w")])));
        events.extend(b.push(piece("", "", vec![call_more("{\"a\":"), call_more(" 1}")])));
        events.extend(b.close("completed"));
        let parsed = parse(&events);
        let kinds: Vec<&str> = parsed.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds,
            vec![
                "response.created",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        let numbers: Vec<u64> = parsed
            .iter()
            .map(|(_, d)| d["sequence_number"].as_u64().expect("numbered"))
            .collect();
        assert_eq!(numbers, (0..numbers.len() as u64).collect::<Vec<_>>());
        // Output indexes follow the items; the done events carry the whole item.
        assert_eq!(parsed[1].1["output_index"], 0);
        assert_eq!(parsed[12].1["text"], "Let me.");
        assert_eq!(parsed[14].1["item"]["status"], "completed");
        assert_eq!(parsed[15].1["output_index"], 2);
        assert_eq!(parsed[15].1["item"]["call_id"], "call_1");
        assert_eq!(parsed[15].1["item"]["arguments"], "");
        assert_eq!(parsed[18].1["arguments"], "{\"a\": 1}");
        let items = b.items();
        assert_eq!(items.len(), 3);
        assert!(
            matches!(&items[0], OutputItem::Reasoning { content, .. } if content[0].text == "hmm")
        );
        assert!(
            matches!(&items[1], OutputItem::Message { content, .. } if content[0].text == "Let me.")
        );
        assert!(
            matches!(&items[2], OutputItem::FunctionCall { name, arguments, status, .. }
                if name == "w" && arguments == "{\"a\": 1}" && *status == "completed")
        );
    }

    #[test]
    fn whole_and_streamed_outputs_build_the_same_items() {
        let output = "<think>\nhm</think>\n\nLet me.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let mut whole = OutputBuilder::default();
        let (all, _) = ChatTransform::new(Some(false), true).all(output);
        whole.push(all);
        whole.close("completed");
        let mut streamed = OutputBuilder::default();
        let mut t = ChatTransform::new(Some(false), true);
        for (i, c) in output.char_indices() {
            streamed.push(t.push(&output[i..i + c.len_utf8()]));
        }
        streamed.push(t.finish());
        streamed.close("completed");
        // Ids are random: compare everything else.
        let strip = |items: &[OutputItem]| -> Vec<Value> {
            items
                .iter()
                .map(|i| {
                    let mut v = serde_json::to_value(i).expect("serializes");
                    v["id"] = Value::Null;
                    v["call_id"] = Value::Null;
                    v
                })
                .collect()
        };
        assert_eq!(strip(whole.items()), strip(streamed.items()));
        assert_eq!(whole.items().len(), 3);
    }

    #[test]
    fn endings_map_finish_reasons() {
        assert_eq!(
            ending(Some("stop")),
            ("completed", "response.completed", None)
        );
        assert_eq!(
            ending(Some("length")),
            (
                "incomplete",
                "response.incomplete",
                Some("max_output_tokens")
            )
        );
        assert_eq!(ending(None).0, "cancelled");
    }
}
