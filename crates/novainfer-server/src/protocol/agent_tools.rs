//! What the agent APIs (Responses, Anthropic Messages) share in turning their tools and tool
//! results into chat's: both list client-side function tools in a flat shape of their own,
//! and both answer a call with a result that names only the call's id. One conversion serves
//! both; each API supplies its [`ToolDialect`].

use serde_json::{json, Map, Value};

use novainfer_engine::ChatMessage;

use super::request::json_type;
use crate::error::ApiError;

/// How one API writes a tool.
pub struct ToolDialect {
    /// Whether a tool's `type` (absent: `None`) is one this server runs.
    pub accepts_type: fn(Option<&Value>) -> bool,
    /// Why a tool of another type is refused (after "has type ...; ").
    pub supported_types: &'static str,
    /// The fields a tool may have, each with its name in chat's `function` object (`None`:
    /// not copied, e.g. `type`).
    pub fields: &'static [(&'static str, Option<&'static str>)],
    /// Fields accepted and ignored (they steer the vendor's own service only).
    pub ignored: &'static [&'static str],
    /// A field every tool must have.
    pub required: Option<&'static str>,
}

/// The API's `tools` in chat's shape (`[{type: "function", function: {...}}]`), for
/// [`crate::tools::Tools::parse`].
pub fn chat_tools(dialect: &ToolDialect, tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let items = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "tools",
                format!("`tools` must be a list, got {}", json_type(other)),
            ))
        }
    };
    let converted = items
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let err = |why: String| ApiError::invalid_param("tools", format!("tools[{i}] {why}"));
            let Value::Object(tool) = tool else {
                return Err(err(format!("must be an object, got {}", json_type(tool))));
            };
            let kind = tool.get("type").filter(|t| !t.is_null());
            if !(dialect.accepts_type)(kind) {
                let shown = kind.map_or_else(|| "none".to_owned(), Value::to_string);
                return Err(err(format!(
                    "has type {shown}; {}",
                    dialect.supported_types
                )));
            }
            if let Some(k) = tool.keys().find(|k| {
                !dialect.fields.iter().any(|(f, _)| f == k)
                    && !dialect.ignored.contains(&k.as_str())
            }) {
                return Err(err(format!("has an unsupported field `{k}`")));
            }
            let function: Map<String, Value> = dialect
                .fields
                .iter()
                .filter_map(|(from, to)| {
                    let value = tool.get(*from).filter(|v| !v.is_null())?;
                    Some(((*to)?.to_owned(), value.clone()))
                })
                .collect();
            let missing = |f: &&str| tool.get(*f).is_none_or(Value::is_null);
            if let Some(field) = dialect.required.filter(missing) {
                return Err(err(format!("needs an `{field}`")));
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Value::Array(converted)))
}

/// A tool result as chat's `tool` message, named after the call it answers when an earlier
/// message of the conversation (`so_far`) made that call (templates show the name).
pub fn tool_result(so_far: &[ChatMessage], call_id: &str, text: String) -> ChatMessage {
    let mut message = ChatMessage::new("tool", text);
    message.name = so_far
        .iter()
        .flat_map(|m| &m.tool_calls)
        .find(|c| c.id.as_deref() == Some(call_id))
        .map(|c| c.name.clone());
    message.tool_call_id = Some(call_id.to_owned());
    message
}
