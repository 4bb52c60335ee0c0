//! OpenAI's Responses API (`POST /v1/responses`) on the wire: the request body, its input
//! items turned into the chat messages the template renders, its function tools and
//! `text.format` turned into chat's `tools` and `response_format` (so both go through the
//! same tool-call grammar and structured-output path as chat), and the `response` object
//! with its output items.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use novainfer_engine::{ChatMessage, ToolCallMessage};

use super::agent_tools::{tool_result, ToolDialect};
use super::request::{json_type, object, typed};
use crate::error::ApiError;

/// The request body. Unknown fields are refused by name; see docs/api.md for each field.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<Value>,
    pub stream: Option<bool>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    pub metadata: Option<Map<String, Value>>,
    pub user: Option<String>,
    pub truncation: Option<String>,
    pub background: Option<bool>,
    /// True no-ops (accepted so agents that always send them work; logged once).
    pub reasoning: Option<Value>,
    pub include: Option<Vec<String>>,
    pub stream_options: Option<Value>,
    pub prompt_cache_key: Option<String>,
    pub safety_identifier: Option<String>,
    pub service_tier: Option<String>,
    /// NovaInfer's, as on chat: seconds this request may take, and its scheduling priority.
    pub timeout: Option<f64>,
    pub priority: Option<i32>,
}

/// Responses fields this server knows and does not implement: a 400 naming them.
const UNSUPPORTED: &[&str] = &[
    "conversation",
    "prompt",
    "top_logprobs",
    "max_tool_calls",
    "context_management",
    "moderation",
    "prompt_cache_options",
    "prompt_cache_retention",
    "background_options",
    "access_programs",
    "image",
];

impl ResponsesRequest {
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let map = object(bytes)?;
        if let Some(k) = map.keys().find(|k| UNSUPPORTED.contains(&k.as_str())) {
            return Err(ApiError::invalid_param(
                k.clone(),
                format!("`{k}` is not supported by this server"),
            ));
        }
        let req: Self = typed(Value::Object(map))?;
        if req.background == Some(true) {
            return Err(ApiError::invalid_param(
                "background",
                "background responses are not supported by this server",
            ));
        }
        match req.truncation.as_deref() {
            None | Some("disabled") => {}
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "truncation",
                    format!(
                        "truncation {other:?} is not supported: a conversation longer than the \
                         context is refused (\"disabled\")"
                    ),
                ))
            }
        }
        if let Some(metadata) = &req.metadata {
            if let Some((k, _)) = metadata.iter().find(|(_, v)| !v.is_string()) {
                return Err(ApiError::invalid_param(
                    "metadata",
                    format!("metadata values must be strings; `{k}` is not"),
                ));
            }
        }
        Ok(req)
    }

    /// The no-op fields present, for the log-once note.
    pub fn ignored(&self) -> Vec<&'static str> {
        [
            ("reasoning", self.reasoning.is_some()),
            ("include", self.include.is_some()),
            ("stream_options", self.stream_options.is_some()),
            ("prompt_cache_key", self.prompt_cache_key.is_some()),
            ("safety_identifier", self.safety_identifier.is_some()),
            ("service_tier", self.service_tier.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
        .collect()
    }
}

fn input_error(message: String) -> ApiError {
    ApiError::invalid_param("input", message)
}

/// Text of an input message's `content`: a string, or a list of text parts (`input_text`,
/// `output_text`, `refusal`) joined with newlines, as chat joins its parts.
fn content_text(value: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts: Vec<&str> = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                let field = if kind == Some("refusal") {
                    "refusal"
                } else {
                    "text"
                };
                match (kind, part.get(field).and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "refusal"), Some(t)) => texts.push(t),
                    (Some(kind @ ("input_text" | "output_text" | "refusal")), None) => {
                        return Err(input_error(format!(
                            "{at}.content[{j}] of type {kind:?} needs a string `{field}`"
                        )))
                    }
                    (Some(kind), _) => {
                        return Err(input_error(format!(
                            "{at}.content[{j}] has type {kind:?}; only text parts (input_text, \
                             output_text) are supported"
                        )))
                    }
                    (None, _) => {
                        return Err(input_error(format!(
                            "{at}.content[{j}] must be an object with a `type`"
                        )))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(input_error(format!(
            "{at}.content must be a string or a list of parts, got {}",
            json_type(other)
        ))),
    }
}

fn string_field<'a>(
    item: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| input_error(format!("{at} needs a string `{key}`")))
}

fn check_fields(item: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), ApiError> {
    match item.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(input_error(format!("{at} has an unsupported field `{k}`"))),
        None => Ok(()),
    }
}

/// `input`: a string (one user message) or a list of items, as chat messages. Assistant
/// messages and the function calls after them form one assistant turn; a function call's
/// output becomes a `tool` message; reasoning items are dropped (templates do not show past
/// reasoning).
// Long: one arm per item type with that type's field checks, in the order the API documents
// them; the shared pieces (tool results, content text) are already functions of their own.
pub fn input_messages(input: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![ChatMessage::new("user", s.clone())]),
        Value::Array(items) => items,
        other => {
            return Err(input_error(format!(
                "`input` must be a string or a list of items, got {}",
                json_type(other)
            )))
        }
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Value::Object(item) = item else {
            return Err(input_error(format!(
                "{at} must be an object, got {}",
                json_type(item)
            )));
        };
        let kind = match item.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(input_error(format!(
                    "{at}.type must be a string, got {}",
                    json_type(other)
                )))
            }
        };
        match kind {
            "message" => {
                check_fields(
                    item,
                    &["type", "role", "content", "id", "status", "phase"],
                    &at,
                )?;
                let role = match string_field(item, "role", &at)? {
                    "developer" | "system" => "system",
                    r @ ("user" | "assistant") => r,
                    r => {
                        return Err(input_error(format!(
                            "{at}.role {r:?} is not supported; use user, assistant, system or developer"
                        )))
                    }
                };
                out.push(ChatMessage::new(
                    role,
                    content_text(item.get("content"), &at)?,
                ));
            }
            "function_call" => {
                check_fields(
                    item,
                    &[
                        "type",
                        "call_id",
                        "name",
                        "arguments",
                        "id",
                        "status",
                        "namespace",
                        "caller",
                    ],
                    &at,
                )?;
                let text = string_field(item, "arguments", &at)?;
                let arguments: Value = serde_json::from_str(text).map_err(|e| {
                    input_error(format!("{at}.arguments is not valid JSON ({e}): {text:?}"))
                })?;
                let call = ToolCallMessage {
                    id: Some(string_field(item, "call_id", &at)?.to_owned()),
                    name: string_field(item, "name", &at)?.to_owned(),
                    arguments,
                };
                match out.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                    _ => {
                        let mut turn = ChatMessage::new("assistant", "");
                        turn.tool_calls.push(call);
                        out.push(turn);
                    }
                }
            }
            "function_call_output" => {
                check_fields(
                    item,
                    &[
                        "type",
                        "call_id",
                        "output",
                        "id",
                        "status",
                        "name",
                        "namespace",
                        "caller",
                    ],
                    &at,
                )?;
                let call_id = string_field(item, "call_id", &at)?.to_owned();
                let text = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(parts @ Value::Array(_)) => {
                        content_text(Some(parts), &format!("{at}.output"))?
                    }
                    _ => {
                        return Err(input_error(format!(
                            "{at}.output must be a string or a list of input_text parts"
                        )))
                    }
                };
                out.push(tool_result(&out, &call_id, text));
            }
            "reasoning" => {}
            other => {
                return Err(input_error(format!(
                    "{at} has type {other:?}; this server supports message, function_call, \
                     function_call_output and reasoning items"
                )))
            }
        }
    }
    Ok(out)
}

/// The Responses API's tools: function tools, flat (`{type: "function", name,
/// description?, parameters?, strict?}`).
pub const TOOLS: ToolDialect = ToolDialect {
    accepts_type: |t| t.is_some_and(|t| t == "function"),
    supported_types: "only function tools are supported",
    fields: &[
        ("type", None),
        ("name", Some("name")),
        ("description", Some("description")),
        ("parameters", Some("parameters")),
        ("strict", Some("strict")),
    ],
    ignored: &[],
    required: None,
};

/// `tool_choice` in chat's shape: the same strings, and `{type: "function", name}` named.
pub fn chat_tool_choice(choice: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(s @ Value::String(_)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid_param("tool_choice", "tool_choice of type function needs a `name`")
            })?;
            Ok(Some(json!({"type": "function", "function": {"name": name}})))
        }
        Some(_) => Err(ApiError::invalid_param(
            "tool_choice",
            "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text` (`{format, verbosity?}`) as chat's `response_format`.
pub fn response_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let err = |why: String| ApiError::invalid_param("text", why);
    let Some(text) = text.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let Value::Object(text) = text else {
        return Err(err(format!(
            "`text` must be an object, got {}",
            json_type(text)
        )));
    };
    if let Some(k) = text
        .keys()
        .find(|k| !["format", "verbosity"].contains(&k.as_str()))
    {
        return Err(err(format!("unknown field `text.{k}`")));
    }
    if !matches!(text.get("verbosity"), None | Some(Value::Null)) {
        return Err(err(
            "`text.verbosity` is not supported by this server".into()
        ));
    }
    let Some(format) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let Value::Object(format) = format else {
        return Err(err("`text.format` must be an object".into()));
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") | Some("json_object") => {
            if let Some(k) = format.keys().find(|k| k.as_str() != "type") {
                return Err(err(format!("unknown field `text.format.{k}`")));
            }
            Ok(Some(Value::Object(format.clone())))
        }
        Some("json_schema") => {
            let mut spec = format.clone();
            spec.remove("type");
            Ok(Some(json!({"type": "json_schema", "json_schema": spec})))
        }
        other => Err(err(format!(
            "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"
        ))),
    }
}

/// A random id with OpenAI's prefix for its kind (`resp`, `msg`, `fc`, `rs`).
pub fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}_{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct OutputText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    pub annotations: Vec<Value>,
    pub logprobs: Vec<Value>,
}

impl OutputText {
    pub fn new(text: String) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReasoningText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
}

impl ReasoningText {
    pub fn new(text: String) -> Self {
        Self {
            kind: "reasoning_text",
            text,
        }
    }
}

/// An item of a response's `output`.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Reasoning {
        id: String,
        summary: Vec<Value>,
        content: Vec<ReasoningText>,
        status: &'static str,
    },
    Message {
        id: String,
        status: &'static str,
        role: &'static str,
        content: Vec<OutputText>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: &'static str,
    },
}

impl OutputItem {
    pub fn id(&self) -> &str {
        match self {
            OutputItem::Reasoning { id, .. }
            | OutputItem::Message { id, .. }
            | OutputItem::FunctionCall { id, .. } => id,
        }
    }

    pub fn set_status(&mut self, new: &'static str) {
        match self {
            OutputItem::Reasoning { status, .. }
            | OutputItem::Message { status, .. }
            | OutputItem::FunctionCall { status, .. } => *status = new,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct InputTokensDetails {
    pub cached_tokens: usize,
    pub cache_write_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct OutputTokensDetails {
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IncompleteDetails {
    pub reason: &'static str,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseError {
    pub code: &'static str,
    pub message: String,
}

/// The `response` object, in every state it is shown in (streamed `in_progress`, finished).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    pub status: &'static str,
    pub completed_at: Option<u64>,
    pub error: Option<ResponseError>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub reasoning: Value,
    pub store: bool,
    pub temperature: f32,
    pub text: Value,
    pub tool_choice: Value,
    pub tools: Vec<Value>,
    pub top_p: f32,
    pub truncation: &'static str,
    pub usage: Option<ResponseUsage>,
    pub user: Option<String>,
    pub metadata: Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::agent_tools::chat_tools;

    #[test]
    fn a_string_is_one_user_message() {
        assert_eq!(
            input_messages(&json!("hi")).expect("valid"),
            vec![ChatMessage::new("user", "hi")]
        );
    }

    #[test]
    fn items_become_a_conversation_with_calls_and_results() {
        let m = input_messages(&json!([
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "t", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]))
        .expect("valid");
        assert_eq!(m.len(), 4, "{m:?}");
        assert_eq!(m[0], ChatMessage::new("system", "be brief"));
        assert_eq!(m[1], ChatMessage::new("user", "weather?"));
        assert_eq!(
            (m[2].role.as_str(), m[2].content.as_str()),
            ("assistant", "Checking.")
        );
        let calls: Vec<(&str, &Value)> = m[2]
            .tool_calls
            .iter()
            .map(|c| (c.name.as_str(), &c.arguments))
            .collect();
        assert_eq!(
            calls,
            vec![("w", &json!({"city": "Paris"})), ("t", &json!({}))]
        );
        assert_eq!(m[3].role, "tool");
        assert_eq!(m[3].content, "sunny");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(m[3].name.as_deref(), Some("w"));
    }

    #[test]
    fn a_call_without_a_message_opens_an_assistant_turn() {
        let m = input_messages(&json!([
            {"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]))
        .expect("valid");
        assert_eq!(m[1].role, "assistant");
        assert_eq!(m[1].tool_calls.len(), 1);
    }

    #[test]
    fn bad_items_name_input() {
        for bad in [
            json!(3),
            json!([1]),
            json!([{"role": "tool", "content": "x"}]),
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
            json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]),
            json!([{"type": "function_call", "name": "f", "arguments": "{}"}]),
            json!([{"type": "function_call_output", "call_id": "c"}]),
            json!([{"type": "item_reference", "id": "x"}]),
            json!([{"role": "user", "content": "x", "extra": 1}]),
        ] {
            let e = input_messages(&bad).expect_err(&bad.to_string());
            assert_eq!(e.param.as_deref(), Some("input"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn function_tools_and_choices_take_chats_shape() {
        let tools = chat_tools(&TOOLS, Some(&json!([
            {"type": "function", "name": "w", "description": "d", "parameters": {"type": "object"}, "strict": null}
        ])))
        .expect("valid")
        .expect("some");
        assert_eq!(
            tools,
            json!([{"type": "function", "function": {"name": "w", "description": "d", "parameters": {"type": "object"}}}])
        );
        assert_eq!(
            chat_tool_choice(Some(&json!({"type": "function", "name": "w"}))).expect("valid"),
            Some(json!({"type": "function", "function": {"name": "w"}}))
        );
        assert_eq!(
            chat_tool_choice(Some(&json!("required"))).expect("valid"),
            Some(json!("required"))
        );
        let e =
            chat_tools(&TOOLS, Some(&json!([{"type": "web_search"}]))).expect_err("not a function");
        assert_eq!(e.param.as_deref(), Some("tools"));
        let e = chat_tool_choice(Some(&json!({"type": "web_search"}))).expect_err("hosted");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn text_format_becomes_response_format() {
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": true}})))
                .expect("valid"),
            Some(json!({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": true}}))
        );
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "json_object"}}))).expect("valid"),
            Some(json!({"type": "json_object"}))
        );
        assert_eq!(response_format(None).expect("valid"), None);
        for bad in [
            json!({"format": {"type": "yaml"}}),
            json!({"verbosity": "low"}),
            json!({"format": {"type": "text", "x": 1}}),
        ] {
            let e = response_format(Some(&bad)).expect_err(&bad.to_string());
            assert_eq!(e.param.as_deref(), Some("text"));
        }
    }

    #[test]
    fn unsupported_and_unknown_fields_are_named() {
        for (body, param) in [
            (r#"{"input": "x", "conversation": "c"}"#, "conversation"),
            (
                r#"{"input": "x", "max_output_token": 3}"#,
                "max_output_token",
            ),
            (r#"{"input": "x", "background": true}"#, "background"),
            (r#"{"input": "x", "truncation": "auto"}"#, "truncation"),
            (r#"{"input": "x", "metadata": {"k": 1}}"#, "metadata"),
        ] {
            let e = ResponsesRequest::parse(body.as_bytes()).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let r = ResponsesRequest::parse(
            br#"{"input": "x", "reasoning": {"effort": "low"}, "store": false, "truncation": "disabled"}"#,
        )
        .expect("valid");
        assert_eq!(r.ignored(), vec!["reasoning"]);
    }

    #[test]
    fn output_items_serialize_with_their_type() {
        let item = OutputItem::FunctionCall {
            id: "fc_1".into(),
            call_id: "call_1".into(),
            name: "w".into(),
            arguments: "{}".into(),
            status: "completed",
        };
        assert_eq!(
            serde_json::to_value(&item).expect("serializes"),
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "w", "arguments": "{}", "status": "completed"})
        );
    }
}
