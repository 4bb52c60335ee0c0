//! Converting the loosely typed JSON fields (`prompt`, `input`, `stop`, `messages`) into
//! engine types, with errors that say which shape was expected.

use novainfer_engine::{ChatMessage, Prompt, ToolCallMessage};
use serde_json::Value;

use super::request::json_type;
use crate::error::ApiError;

/// Most prompts or embedding inputs one request may carry.
pub const MAX_BATCH: usize = 256;
/// Most stop strings one request may carry.
pub const MAX_STOP: usize = 16;

fn token_ids(items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        param,
                        format!("token ids must be integers in [0, 2^32), got {v}"),
                    )
                })
        })
        .collect()
}

/// `prompt` or `input`: a string, a list of strings, a list of token ids, or a list of lists
/// of token ids. Returns one prompt per element.
pub fn prompts(value: &Value, param: &str) -> Result<Vec<Prompt>, ApiError> {
    let shape = || {
        format!("`{param}` must be a string, a list of strings, a list of token ids or a list of lists of token ids")
    };
    let list = match value {
        Value::String(s) => return Ok(vec![Prompt::Text(s.clone())]),
        Value::Array(items) => items,
        other => {
            return Err(ApiError::invalid_param(
                param,
                format!("{}, got {}", shape(), json_type(other)),
            ))
        }
    };
    if list.is_empty() {
        return Err(ApiError::invalid_param(
            param,
            format!("`{param}` must not be empty"),
        ));
    }
    let batch = |list: &[Value]| {
        if list.len() > MAX_BATCH {
            return Err(ApiError::invalid_param(
                param,
                format!(
                    "`{param}` has {} prompts, more than the limit of {MAX_BATCH}",
                    list.len()
                ),
            ));
        }
        Ok(())
    };
    match &list[0] {
        // One prompt of token ids: its length is the model's to judge, not a batch limit.
        Value::Number(_) => Ok(vec![Prompt::TokenIds(token_ids(list, param)?)]),
        Value::String(_) | Value::Array(_) => batch(list).and_then(|()| {
            list.iter()
                .map(|item| match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(ids) => Ok(Prompt::TokenIds(token_ids(ids, param)?)),
                    other => Err(ApiError::invalid_param(
                        param,
                        format!("{}, got an element that is {}", shape(), json_type(other)),
                    )),
                })
                .collect()
        }),
        other => Err(ApiError::invalid_param(
            param,
            format!("{}, got a list of {}", shape(), json_type(other)),
        )),
    }
}

/// `stop`: a string or a list of strings.
pub fn stop_strings(value: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let err = |what: &str| {
        ApiError::invalid_param(
            "stop",
            format!("`stop` must be a string or a list of strings, got {what}"),
        )
    };
    let stops = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| err(&format!("a list containing {}", json_type(v))))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(err(json_type(other))),
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid_param(
            "stop",
            format!("at most {MAX_STOP} stop strings, got {}", stops.len()),
        ));
    }
    Ok(stops)
}

/// Text of a message `content`: a string, or a list of `{"type": "text", "text": ...}` parts
/// joined with newlines (as vLLM joins them).
fn content_text(value: Option<&Value>, i: usize) -> Result<String, ApiError> {
    let err =
        |why: String| ApiError::invalid_param("messages", format!("messages[{i}].content {why}"));
    match value {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts: Vec<&str> = Vec::with_capacity(parts.len());
            for part in parts {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some(kind), _) if kind != "text" => {
                        return Err(err(format!(
                            "has a part of type {kind:?}; only text parts are supported"
                        )))
                    }
                    _ => {
                        return Err(err(
                            "parts must be objects {\"type\": \"text\", \"text\": string}".into(),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(err(format!(
            "must be a string or a list of text parts, got {}",
            json_type(other)
        ))),
    }
}

/// `messages`: a list of `{role, content}` with roles system (or developer), user, assistant
/// and tool, plus tool calling's fields: `name`, an assistant's `tool_calls`, a tool result's
/// `tool_call_id`.
pub fn messages(value: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let Value::Array(items) = value else {
        return Err(ApiError::invalid_param(
            "messages",
            format!("`messages` must be a list, got {}", json_type(value)),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect()
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let err = |why: String| ApiError::invalid_param("messages", format!("messages[{i}]{why}"));
    let Value::Object(fields) = m else {
        return Err(err(format!(" must be an object, got {}", json_type(m))));
    };
    const FIELDS: [&str; 6] = [
        "role",
        "content",
        "name",
        "reasoning_content",
        "tool_calls",
        "tool_call_id",
    ];
    if let Some(k) = fields.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(err(format!(" has an unsupported field `{k}`")));
    }
    let role = match fields.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        Some(r) => {
            return Err(err(format!(
                ".role {r:?} is not supported; use system, developer, user, assistant or tool"
            )))
        }
        None => return Err(err(" needs a string `role`".into())),
    };
    let mut message = ChatMessage::new(role, content_text(fields.get("content"), i)?);
    let string = |key: &str| match fields.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(err(format!(
            ".{key} must be a string, got {}",
            json_type(other)
        ))),
    };
    message.name = string("name")?;
    message.tool_call_id = string("tool_call_id")?;
    match fields.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) if role == "assistant" => {
            message.tool_calls = calls
                .iter()
                .enumerate()
                .map(|(j, call)| {
                    tool_call(call).map_err(|why| err(format!(".tool_calls[{j}]{why}")))
                })
                .collect::<Result<_, _>>()?;
        }
        Some(_) if role != "assistant" => {
            return Err(err(
                " has `tool_calls`, which only assistant messages may have".into(),
            ))
        }
        Some(other) => {
            return Err(err(format!(
                ".tool_calls must be a list, got {}",
                json_type(other)
            )))
        }
    }
    Ok(message)
}

/// One call of an assistant message, `{"id", "type": "function", "function": {"name",
/// "arguments"}}`. OpenAI sends the arguments as a JSON string: parsed here, since the chat
/// template prints them as JSON (a string would reach the model quoted).
fn tool_call(call: &Value) -> Result<ToolCallMessage, String> {
    let Value::Object(call) = call else {
        return Err(format!(" must be an object, got {}", json_type(call)));
    };
    if let Some(k) = call
        .keys()
        .find(|k| !["id", "type", "function"].contains(&k.as_str()))
    {
        return Err(format!(" has an unsupported field `{k}`"));
    }
    if !matches!(call.get("type"), None | Some(Value::Null))
        && call.get("type").and_then(Value::as_str) != Some("function")
    {
        return Err(".type must be \"function\"".into());
    }
    let id = match call.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(other) => return Err(format!(".id must be a string, got {}", json_type(other))),
    };
    let Some(Value::Object(function)) = call.get("function") else {
        return Err(" needs a `function` object".into());
    };
    let Some(name) = function.get("name").and_then(Value::as_str) else {
        return Err(".function needs a string `name`".into());
    };
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(text)) => serde_json::from_str(text)
            .map_err(|e| format!(".function.arguments is not valid JSON ({e}): {text:?}"))?,
        Some(value) => value.clone(),
    };
    Ok(ToolCallMessage {
        id,
        name: name.to_owned(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        assert_eq!(
            prompts(&json!("hi"), "prompt").expect("valid test input"),
            vec![Prompt::Text("hi".into())]
        );
        assert_eq!(
            prompts(&json!([1, 2]), "prompt").expect("valid test input"),
            vec![Prompt::TokenIds(vec![1, 2])]
        );
        assert_eq!(
            prompts(&json!(["a", [3]]), "prompt").expect("valid test input"),
            vec![Prompt::Text("a".into()), Prompt::TokenIds(vec![3])]
        );
        for bad in [
            json!([]),
            json!(3),
            json!([-1]),
            json!([1.5]),
            json!([{}]),
            json!(null),
            json!([[1, "x"]]),
        ] {
            let e = prompts(&bad, "prompt").expect_err(&bad.to_string());
            assert_eq!(e.param.as_deref(), Some("prompt"));
        }
    }

    #[test]
    fn stop_shapes() {
        assert_eq!(
            stop_strings(Some(&json!("x"))).expect("valid test input"),
            vec!["x"]
        );
        assert_eq!(
            stop_strings(Some(&json!(["x", "y"]))).expect("valid test input"),
            vec!["x", "y"]
        );
        assert!(stop_strings(None).expect("valid test input").is_empty());
        assert!(stop_strings(Some(&json!([1]))).is_err());
        assert!(stop_strings(Some(&json!(vec!["a"; 17]))).is_err());
    }

    #[test]
    fn message_shapes() {
        let m = messages(&json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
        ]))
        .expect("valid test input");
        assert_eq!(m[0], ChatMessage::new("system", "be brief"));
        assert_eq!(m[1], ChatMessage::new("user", "a\nb"));
        assert_eq!(m[2], ChatMessage::new("assistant", ""));
        for bad in [
            json!({}),
            json!([1]),
            json!([{"role": "function", "content": "x"}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
            json!([{"role": "assistant", "tool_calls": {}}]),
            json!([{"role": "tool", "content": "x", "tool_call_id": 3}]),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": 3}]),
            json!([{"role": "user", "content": [{"type": "image_url"}]}]),
            json!([{"role": "user", "content": "x", "tool_calls": []}]),
        ] {
            assert!(messages(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tool_calls_and_results() {
        let m = messages(&json!([
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": [1]}"}},
                {"function": {"name": "g", "arguments": {"b": 2}}}]},
            {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"},
        ]))
        .expect("valid test input");
        assert_eq!(m[0].content, "");
        assert_eq!(
            m[0].tool_calls,
            vec![
                ToolCallMessage {
                    id: Some("call_1".into()),
                    name: "f".into(),
                    arguments: json!({"a": [1]})
                },
                ToolCallMessage {
                    id: None,
                    name: "g".into(),
                    arguments: json!({"b": 2})
                },
            ]
        );
        assert_eq!((m[1].role.as_str(), m[1].content.as_str()), ("tool", "42"));
        assert_eq!(m[1].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(m[1].name.as_deref(), Some("f"));
    }
}
