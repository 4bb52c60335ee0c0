//! `response_format` (OpenAI) and `structured_outputs` (vLLM) → the engine's
//! [`StructuredOutput`]. At most one constraint per request: two forms that both constrain are
//! a 400 naming them. Whether a schema/regex/grammar compiles is checked with the prompt on the
//! tokenizing thread (`Frontend::check_request`), still before anything runs.

use novainfer_core::StructuredOutput;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::protocol::request::json_type;

/// The request's constraint, if any.
pub fn structured_output(
    response_format: Option<&Value>,
    structured_outputs: Option<&Value>,
) -> Result<Option<StructuredOutput>, ApiError> {
    let from_format = response_format
        .map(parse_response_format)
        .transpose()?
        .flatten();
    let from_vllm = structured_outputs
        .map(parse_structured_outputs)
        .transpose()?
        .flatten();
    match (from_format, from_vllm) {
        (Some(_), Some(_)) => Err(ApiError::invalid_param(
            "structured_outputs",
            "`response_format` and `structured_outputs` both constrain the output; use one",
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// The field that set the request's constraint, which a constraint that cannot compile is
/// reported on: `response_format` unless it is absent or `text` (then `structured_outputs`;
/// a request with both constraining is refused before anything compiles).
pub fn constraint_field(response_format: Option<&Value>) -> &'static str {
    match response_format {
        Some(rf) if rf.get("type").and_then(Value::as_str) != Some("text") => "response_format",
        _ => "structured_outputs",
    }
}

fn object<'a>(param: &str, v: &'a Value) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| {
        ApiError::invalid_param(
            param,
            format!("`{param}` must be an object, got {}", json_type(v)),
        )
    })
}

/// A JSON Schema given as an object (or boolean), or as a string holding one (vLLM allows both).
fn schema_text(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.to_string()),
        Value::String(s) => Ok(s.clone()),
        other => Err(ApiError::invalid_param(
            param,
            format!(
                "`{param}` must be a JSON Schema object, got {}",
                json_type(other)
            ),
        )),
    }
}

fn parse_response_format(v: &Value) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "response_format";
    let map = object(P, v)?;
    let kind = map.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid_param(
            P,
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )
    })?;
    let allowed: &[&str] = match kind {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(ApiError::invalid_param(
                P,
                format!("`response_format.type` {other:?} is not supported (use \"text\", \"json_object\" or \"json_schema\")"),
            ))
        }
    };
    if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::invalid_param(
            P,
            format!("unknown field `response_format.{k}` for type {kind:?}"),
        ));
    }
    Ok(match kind {
        "text" => None,
        "json_object" => Some(StructuredOutput::JsonObject),
        _ => {
            let spec = map.get("json_schema").ok_or_else(|| {
                ApiError::invalid_param(
                    P,
                    "`response_format.json_schema` is required for type \"json_schema\"",
                )
            })?;
            let spec = object("response_format", spec)?;
            const KNOWN: &[&str] = &["name", "schema", "strict", "description"];
            if let Some(k) = spec.keys().find(|k| !KNOWN.contains(&k.as_str())) {
                return Err(ApiError::invalid_param(
                    P,
                    format!("unknown field `response_format.json_schema.{k}`"),
                ));
            }
            match spec.get("name") {
                Some(Value::String(_)) => {}
                _ => {
                    return Err(ApiError::invalid_param(
                        P,
                        "`response_format.json_schema.name` must be a string",
                    ))
                }
            }
            // Always strict: the output is masked to the schema either way.
            match spec.get("schema") {
                Some(schema) => Some(StructuredOutput::JsonSchema(schema_text(P, schema)?)),
                None => Some(StructuredOutput::JsonObject),
            }
        }
    })
}

fn parse_structured_outputs(v: &Value) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "structured_outputs";
    let map = object(P, v)?;
    let mut found: Vec<(&str, StructuredOutput)> = Vec::new();
    for (key, value) in map {
        if value.is_null() {
            continue;
        }
        let spec = match key.as_str() {
            "json" => StructuredOutput::JsonSchema(schema_text("structured_outputs.json", value)?),
            "regex" => StructuredOutput::Regex(string(key, value)?),
            "grammar" => StructuredOutput::Grammar(string(key, value)?),
            "choice" => StructuredOutput::Choice(
                value
                    .as_array()
                    .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_owned)).collect())
                    .ok_or_else(|| {
                        ApiError::invalid_param(P, "`structured_outputs.choice` must be an array of strings")
                    })?,
            ),
            "json_object" => match value {
                Value::Bool(true) => StructuredOutput::JsonObject,
                Value::Bool(false) => continue,
                _ => {
                    return Err(ApiError::invalid_param(
                        P,
                        "`structured_outputs.json_object` must be a boolean",
                    ))
                }
            },
            other => {
                return Err(ApiError::invalid_param(
                    P,
                    format!(
                        "`structured_outputs.{other}` is not supported (supported: json, regex, choice, grammar, json_object)"
                    ),
                ))
            }
        };
        found.push((key.as_str(), spec));
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|(_, s)| s)),
        _ => Err(ApiError::invalid_param(
            P,
            format!(
                "`structured_outputs` sets {}: give exactly one constraint",
                found
                    .iter()
                    .map(|(k, _)| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
        )),
    }
}

fn string(key: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str().map(str::to_owned).ok_or_else(|| {
        ApiError::invalid_param(
            "structured_outputs",
            format!(
                "`structured_outputs.{key}` must be a string, got {}",
                json_type(v)
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn so(rf: Option<Value>, s: Option<Value>) -> Result<Option<StructuredOutput>, ApiError> {
        structured_output(rf.as_ref(), s.as_ref())
    }

    #[test]
    fn response_format_forms() {
        assert_eq!(
            so(Some(json!({"type": "text"})), None).expect("valid"),
            None
        );
        assert_eq!(
            so(Some(json!({"type": "json_object"})), None).expect("valid"),
            Some(StructuredOutput::JsonObject)
        );
        let rf = json!({"type": "json_schema", "json_schema":
            {"name": "x", "strict": true, "schema": {"type": "integer"}}});
        assert_eq!(
            so(Some(rf), None).expect("valid"),
            Some(StructuredOutput::JsonSchema(r#"{"type":"integer"}"#.into()))
        );
    }

    #[test]
    fn compile_errors_name_the_field_that_set_the_constraint() {
        let schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}});
        assert_eq!(constraint_field(Some(&schema)), "response_format");
        assert_eq!(
            constraint_field(Some(&json!({"type": "text"}))),
            "structured_outputs"
        );
        assert_eq!(constraint_field(None), "structured_outputs");
    }

    #[test]
    fn structured_outputs_forms() {
        assert_eq!(
            so(None, Some(json!({"regex": "a+"}))).expect("valid"),
            Some(StructuredOutput::Regex("a+".into()))
        );
        assert_eq!(
            so(None, Some(json!({"choice": ["a", "b"], "regex": null}))).expect("valid"),
            Some(StructuredOutput::Choice(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            so(None, Some(json!({"json": "{\"type\":\"string\"}"}))).expect("valid"),
            Some(StructuredOutput::JsonSchema("{\"type\":\"string\"}".into()))
        );
        assert_eq!(
            so(None, Some(json!({"grammar": "start: \"x\""}))).expect("valid"),
            Some(StructuredOutput::Grammar("start: \"x\"".into()))
        );
        assert_eq!(
            so(None, Some(json!({"json_object": true}))).expect("valid"),
            Some(StructuredOutput::JsonObject)
        );
        // text is no constraint, so it does not conflict.
        assert_eq!(
            so(Some(json!({"type": "text"})), Some(json!({"regex": "a"}))).expect("valid"),
            Some(StructuredOutput::Regex("a".into()))
        );
    }

    #[test]
    fn conflicts_and_bad_shapes_are_400_with_param() {
        let cases = [
            (
                None,
                Some(json!({"regex": "a", "choice": ["a"]})),
                "structured_outputs",
            ),
            (
                Some(json!({"type": "json_object"})),
                Some(json!({"regex": "a"})),
                "structured_outputs",
            ),
            (Some(json!({"type": "xml"})), None, "response_format"),
            (
                Some(json!({"type": "json_schema"})),
                None,
                "response_format",
            ),
            (
                Some(json!({"type": "json_schema", "json_schema": {"schema": {}}})),
                None,
                "response_format",
            ),
            (Some(json!("json")), None, "response_format"),
            (None, Some(json!({"choice": [1]})), "structured_outputs"),
            (
                None,
                Some(json!({"structural_tag": "x"})),
                "structured_outputs",
            ),
            (None, Some(json!({"regex": 3})), "structured_outputs"),
        ];
        for (rf, s, param) in cases {
            let e = so(rf.clone(), s.clone()).expect_err(&format!("{rf:?} {s:?}"));
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }
}
