//! Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the wire:
//! the request body, its system prompt and content blocks turned into the chat messages the
//! template renders, its tools and `tool_choice` turned into chat's (so tool calls go through
//! the same grammar and Hermes parser as chat), the `message` object with its content blocks,
//! and Anthropic's error shape.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use novainfer_engine::{ChatMessage, ToolCallMessage};

use super::agent_tools::{tool_result, ToolDialect};
use super::request::{json_type, object, typed};
use crate::error::ApiError;

/// The body of `POST /v1/messages`. Unknown fields are refused by name (as Anthropic does).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub messages: Value,
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub metadata: Option<Metadata>,
    pub output_config: Option<OutputConfig>,
    /// True no-ops: a reasoning model always thinks (and its thinking is returned as
    /// `thinking` blocks), other models never do; prompt caching is automatic.
    pub thinking: Option<Value>,
    pub service_tier: Option<String>,
    pub cache_control: Option<Value>,
}

/// The body of `POST /v1/messages/count_tokens`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountTokensRequest {
    pub model: Option<String>,
    pub messages: Value,
    pub system: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub output_config: Option<OutputConfig>,
    pub thinking: Option<Value>,
    pub cache_control: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    pub user_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// A no-op, like `thinking`.
    pub effort: Option<String>,
    pub format: Option<Value>,
}

/// Anthropic fields this server knows and does not implement: a 400 naming them.
const UNSUPPORTED: &[&str] = &[
    "container",
    "mcp_servers",
    "context_management",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
];

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let map = object(bytes)?;
    if let Some(k) = map.keys().find(|k| UNSUPPORTED.contains(&k.as_str())) {
        return Err(ApiError::invalid_param(
            k.clone(),
            format!("`{k}` is not supported by this server"),
        ));
    }
    typed(Value::Object(map))
}

impl MessagesRequest {
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let req: Self = parse(bytes)?;
        if req.max_tokens.is_none() {
            return Err(ApiError::invalid_param(
                "max_tokens",
                "max_tokens: Field required",
            ));
        }
        Ok(req)
    }

    /// The no-op fields present, for the log-once note.
    pub fn ignored(&self) -> Vec<&'static str> {
        [
            ("thinking", self.thinking.is_some()),
            ("service_tier", self.service_tier.is_some()),
            ("cache_control", self.cache_control.is_some()),
            (
                "output_config.effort",
                self.output_config
                    .as_ref()
                    .is_some_and(|o| o.effort.is_some()),
            ),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
        .collect()
    }
}

impl CountTokensRequest {
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        parse(bytes)
    }
}

/// `output_config.format` (`{type: "json_schema", schema}`) as chat's `response_format`.
pub fn response_format(config: Option<&OutputConfig>) -> Result<Option<Value>, ApiError> {
    let Some(format) = config
        .and_then(|c| c.format.as_ref())
        .filter(|f| !f.is_null())
    else {
        return Ok(None);
    };
    let err = |why: &str| ApiError::invalid_param("output_config", why.to_owned());
    let Value::Object(format) = format else {
        return Err(err("`output_config.format` must be an object"));
    };
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        return Err(err("`output_config.format.type` must be \"json_schema\""));
    }
    if let Some(k) = format
        .keys()
        .find(|k| !["type", "schema"].contains(&k.as_str()))
    {
        return Err(err(&format!("unknown field `output_config.format.{k}`")));
    }
    let schema = format
        .get("schema")
        .ok_or_else(|| err("`output_config.format.schema` is required"))?;
    Ok(Some(
        json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
    ))
}

fn messages_error(message: String) -> ApiError {
    ApiError::invalid_param("messages", message)
}

/// Text blocks' fields besides `type` and `text` that change nothing here.
const TEXT_EXTRAS: &[&str] = &["cache_control", "citations"];

/// A text block's text.
fn text_block<'a>(block: &'a Map<String, Value>, at: &str) -> Result<&'a str, ApiError> {
    if let Some(k) = block
        .keys()
        .find(|k| !["type", "text"].contains(&k.as_str()) && !TEXT_EXTRAS.contains(&k.as_str()))
    {
        return Err(messages_error(format!(
            "{at} has an unsupported field `{k}`"
        )));
    }
    block
        .get("text")
        .and_then(Value::as_str)
        .ok_or_else(|| messages_error(format!("{at} needs a string `text`")))
}

/// `system`: a string, or text blocks joined with newlines.
pub fn system_text(system: Option<&Value>) -> Result<Option<String>, ApiError> {
    let err = |why: String| ApiError::invalid_param("system", why);
    match system {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, block) in blocks.iter().enumerate() {
                let at = format!("system[{i}]");
                match block {
                    Value::Object(b) if b.get("type").and_then(Value::as_str) == Some("text") => {
                        texts.push(text_block(b, &at).map_err(|e| err(e.message))?.to_owned());
                    }
                    _ => return Err(err(format!("{at} must be a text block"))),
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(other) => Err(err(format!(
            "`system` must be a string or a list of text blocks, got {}",
            json_type(other)
        ))),
    }
}

/// A `tool_result`'s content: a string or text blocks.
fn tool_result_text(content: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let at = format!("{at}.content[{j}]");
                match b {
                    Value::Object(b) if b.get("type").and_then(Value::as_str) == Some("text") => {
                        text_block(b, &at).map(str::to_owned)
                    }
                    _ => Err(messages_error(format!(
                        "{at} must be a text block (only text tool results are supported)"
                    ))),
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|texts| texts.join("\n")),
        Some(other) => Err(messages_error(format!(
            "{at}.content must be a string or a list of text blocks, got {}",
            json_type(other)
        ))),
    }
}

/// `system` and `messages` as a chat conversation. A user turn's `tool_result` blocks become
/// `tool` messages (before its text, as Anthropic orders them); an assistant turn's
/// `tool_use` blocks become its tool calls; `thinking` blocks are dropped (templates do not
/// show past reasoning).
// Long: one arm per content-block type and role with that block's checks, as Anthropic's
// documentation lists them; the shared pieces are functions of their own.
pub fn conversation(
    system: Option<&Value>,
    messages: &Value,
) -> Result<Vec<ChatMessage>, ApiError> {
    let Value::Array(items) = messages else {
        return Err(messages_error(format!(
            "`messages` must be a list, got {}",
            json_type(messages)
        )));
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(items.len() + 1);
    if let Some(system) = system_text(system)? {
        out.push(ChatMessage::new("system", system));
    }
    for (i, m) in items.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(messages_error(format!(
                "{at} must be an object, got {}",
                json_type(m)
            )));
        };
        if let Some(k) = m
            .keys()
            .find(|k| !["role", "content"].contains(&k.as_str()))
        {
            return Err(messages_error(format!(
                "{at} has an unsupported field `{k}`"
            )));
        }
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant" | "system")) => r,
            other => {
                return Err(messages_error(format!(
                    "{at}.role must be \"user\" or \"assistant\", got {other:?}"
                )))
            }
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                out.push(ChatMessage::new(role, s.clone()));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            other => {
                return Err(messages_error(format!(
                    "{at}.content must be a string or a list of content blocks, got {}",
                    other.map_or("nothing", json_type)
                )))
            }
        };
        let mut texts: Vec<&str> = Vec::new();
        let mut calls: Vec<ToolCallMessage> = Vec::new();
        for (j, block) in blocks.iter().enumerate() {
            let at = format!("{at}.content[{j}]");
            let Value::Object(block) = block else {
                return Err(messages_error(format!(
                    "{at} must be a content block object"
                )));
            };
            let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
            match (kind, role) {
                ("text", _) => texts.push(text_block(block, &at)?),
                ("thinking" | "redacted_thinking", "assistant") => {}
                ("tool_use", "assistant") => {
                    let string = |k: &str| {
                        block
                            .get(k)
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                            .ok_or_else(|| messages_error(format!("{at} needs a string `{k}`")))
                    };
                    let input = match block.get("input") {
                        Some(v @ Value::Object(_)) => v.clone(),
                        _ => return Err(messages_error(format!("{at}.input must be an object"))),
                    };
                    calls.push(ToolCallMessage {
                        id: Some(string("id")?),
                        name: string("name")?,
                        arguments: input,
                    });
                }
                ("tool_result", "user") => {
                    let id = block
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| messages_error(format!("{at} needs a string `tool_use_id`")))?;
                    let mut text = tool_result_text(block.get("content"), &at)?;
                    if block.get("is_error").and_then(Value::as_bool) == Some(true) {
                        text = format!("Error: {text}");
                    }
                    out.push(tool_result(&out, id, text));
                }
                (kind, role) => {
                    return Err(messages_error(format!(
                        "{at} has type {kind:?}, which a {role} message cannot carry here \
                         (supported: text; tool_use and thinking from the assistant; tool_result from the user)"
                    )))
                }
            }
        }
        if !texts.is_empty() || !calls.is_empty() {
            let mut message = ChatMessage::new(role, texts.join("\n"));
            message.tool_calls = calls;
            out.push(message);
        }
    }
    Ok(out)
}

/// Anthropic's tools: client tools (`{name, description?, input_schema}`, no type or
/// `custom`); the fields that only steer Anthropic's own service are accepted and ignored.
pub const TOOLS: ToolDialect = ToolDialect {
    accepts_type: |t| t.is_none_or(|t| t == "custom"),
    supported_types: "only client tools (no type, or \"custom\") are supported",
    fields: &[
        ("type", None),
        ("name", Some("name")),
        ("description", Some("description")),
        ("input_schema", Some("parameters")),
    ],
    ignored: &[
        "cache_control",
        "strict",
        "input_examples",
        "eager_input_streaming",
        "defer_loading",
        "allowed_callers",
    ],
    required: Some("input_schema"),
};

/// Anthropic's `tool_choice` as chat's, and whether parallel calls are allowed.
pub fn chat_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "tool_choice",
            "tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
        )
    };
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    let Value::Object(o) = choice else {
        return Err(bad());
    };
    if let Some(k) = o
        .keys()
        .find(|k| !["type", "name", "disable_parallel_tool_use"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid_param(
            "tool_choice",
            format!("tool_choice has an unsupported field `{k}`"),
        ));
    }
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(disable)) => Some(!disable),
        Some(_) => return Err(bad()),
    };
    let chat = match o.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(bad)?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => return Err(bad()),
    };
    Ok((Some(chat), parallel))
}

/// A content block of the `message` object.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Thinking {
        thinking: String,
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct MessageUsage {
    /// Prompt tokens not read from the cache (Anthropic's meaning).
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub cache_creation_input_tokens: usize,
    pub cache_read_input_tokens: usize,
}

impl MessageUsage {
    pub fn new(prompt: usize, cached: usize, output: usize) -> Self {
        Self {
            input_tokens: prompt.saturating_sub(cached),
            output_tokens: output,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: cached,
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MessageObject {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        408 | 504 => "timeout_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`. The
/// field at fault, which Anthropic's shape has no place for, leads the message.
pub fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) if !e.message.starts_with(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status.as_u16()), "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::agent_tools::chat_tools;

    #[test]
    fn system_and_blocks_become_a_conversation() {
        let m = conversation(
            Some(&json!([{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}])),
            &json!([
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "Thanks"}]},
            ]),
        )
        .expect("valid");
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], ChatMessage::new("system", "be brief"));
        assert_eq!(m[1], ChatMessage::new("user", "weather in Paris?"));
        assert_eq!(m[2].content, "Checking.");
        assert_eq!(m[2].tool_calls[0].name, "w");
        assert_eq!(m[2].tool_calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!(m[3].role, "tool");
        assert_eq!(m[3].content, "sunny");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].name.as_deref(), Some("w"));
        assert_eq!(m[4], ChatMessage::new("user", "Thanks"));
    }

    #[test]
    fn bad_blocks_name_messages() {
        for bad in [
            json!({}),
            json!([{"role": "tool", "content": "x"}]),
            json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
            json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]),
            json!([{"role": "user", "content": [{"type": "tool_result"}]}]),
            json!([{"role": "user", "content": 3}]),
        ] {
            let e = conversation(None, &bad).expect_err(&bad.to_string());
            assert_eq!(e.param.as_deref(), Some("messages"), "{bad}: {}", e.message);
        }
        let e = conversation(Some(&json!(3)), &json!([])).expect_err("system");
        assert_eq!(e.param.as_deref(), Some("system"));
    }

    #[test]
    fn tools_and_choices_take_chats_shape() {
        let tools = chat_tools(&TOOLS, Some(&json!([
            {"name": "w", "description": "d", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
        ])))
        .expect("valid")
        .expect("some");
        assert_eq!(
            tools,
            json!([{"type": "function", "function": {"name": "w", "description": "d", "parameters": {"type": "object"}}}])
        );
        let e = chat_tools(
            &TOOLS,
            Some(&json!([{"type": "web_search_20250305", "name": "web_search"}])),
        )
        .expect_err("server tool");
        assert_eq!(e.param.as_deref(), Some("tools"));
        assert_eq!(
            chat_tool_choice(Some(
                &json!({"type": "any", "disable_parallel_tool_use": true})
            ))
            .expect("valid"),
            (Some(json!("required")), Some(false))
        );
        assert_eq!(
            chat_tool_choice(Some(&json!({"type": "tool", "name": "w"})))
                .expect("valid")
                .0,
            Some(json!({"type": "function", "function": {"name": "w"}}))
        );
        assert!(chat_tool_choice(Some(&json!("auto"))).is_err());
    }

    #[test]
    fn max_tokens_is_required_and_unknown_fields_are_named() {
        let e = MessagesRequest::parse(br#"{"messages": []}"#).expect_err("no max_tokens");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = MessagesRequest::parse(br#"{"messages": [], "max_tokens": 1, "mcp_servers": []}"#)
            .expect_err("unsupported");
        assert_eq!(e.param.as_deref(), Some("mcp_servers"));
        let e = MessagesRequest::parse(br#"{"messages": [], "max_tokens": 1, "top_n": 1}"#)
            .expect_err("unknown");
        assert_eq!(e.param.as_deref(), Some("top_n"));
        let r = MessagesRequest::parse(
            br#"{"messages": [], "max_tokens": 1, "thinking": {"type": "enabled", "budget_tokens": 1024}}"#,
        )
        .expect("valid");
        assert_eq!(r.ignored(), vec!["thinking"]);
    }

    #[test]
    fn errors_take_anthropics_shape() {
        let body = error_body(&ApiError::invalid_param("max_tokens", "too big"));
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too big"}})
        );
        assert_eq!(error_type(401), "authentication_error");
        assert_eq!(error_type(404), "not_found_error");
        assert_eq!(error_type(429), "rate_limit_error");
        assert_eq!(error_type(503), "overloaded_error");
        assert_eq!(error_type(500), "api_error");
    }

    #[test]
    fn usage_counts_cached_tokens_apart() {
        let u = MessageUsage::new(100, 64, 7);
        assert_eq!(
            (u.input_tokens, u.cache_read_input_tokens, u.output_tokens),
            (36, 64, 7)
        );
    }

    #[test]
    fn output_format_becomes_a_json_schema() {
        let config = OutputConfig {
            effort: None,
            format: Some(json!({"type": "json_schema", "schema": {"type": "object"}})),
        };
        assert_eq!(
            response_format(Some(&config)).expect("valid"),
            Some(
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}})
            )
        );
        let bad = OutputConfig {
            effort: None,
            format: Some(json!({"type": "regex"})),
        };
        assert_eq!(
            response_format(Some(&bad))
                .expect_err("bad")
                .param
                .as_deref(),
            Some("output_config")
        );
    }
}
