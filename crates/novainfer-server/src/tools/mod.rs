//! Tool calling for models that call functions in the Hermes format (Qwen2.5): OpenAI's
//! `tools`, `tool_choice` and `parallel_tool_calls` on chat requests.
//!
//! - The tools go to the chat template as its `tools` variable, exactly as sent (the
//!   template describes them to the model).
//! - `tool_choice` decides the output's constraint ([`Tools::grammar`]): `required` and a
//!   named function force calls whose arguments are valid against the tool's schema; `auto`
//!   leaves text free until the model writes `<tool_call>`, then forces a valid call; `none`
//!   adds none and the output is not read for calls (the tools are still shown, as vLLM
//!   does). `parallel_tool_calls: false` allows one call; a named function is called once.
//! - The output is parsed into content and calls by [`hermes::ToolCallParser`].

pub mod hermes;
pub mod json_prefix;

use novainfer_core::StructuredOutput;
use novainfer_engine::structured::tool_grammar::{
    auto_tool_call_grammar, tool_call_grammar, ToolSpec,
};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::protocol::request::json_type;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools and how it may call them.
#[derive(Debug, Clone)]
pub struct Tools {
    /// As sent, for the chat template.
    definitions: Vec<Value>,
    specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// OpenAI's limit on function names: `^[a-zA-Z0-9_-]{1,64}$`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn tools_error(message: String) -> ApiError {
    ApiError::invalid_param("tools", message)
}

/// One entry of `tools`: `{"type": "function", "function": {name, description?, parameters?, strict?}}`.
fn tool_spec(i: usize, tool: &Value) -> Result<ToolSpec, ApiError> {
    let at = |why: String| tools_error(format!("tools[{i}] {why}"));
    let Value::Object(tool) = tool else {
        return Err(at(format!("must be an object, got {}", json_type(tool))));
    };
    if let Some(k) = tool
        .keys()
        .find(|k| !["type", "function"].contains(&k.as_str()))
    {
        return Err(at(format!("has an unsupported field `{k}`")));
    }
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        other => {
            return Err(at(format!(
                "must have type \"function\" (the only kind of tool supported), got {other:?}"
            )))
        }
    }
    let Some(Value::Object(function)) = tool.get("function") else {
        return Err(at("needs a `function` object".into()));
    };
    if let Some(k) = function
        .keys()
        .find(|k| !["name", "description", "parameters", "strict"].contains(&k.as_str()))
    {
        return Err(at(format!("function has an unsupported field `{k}`")));
    }
    let name = match function.get("name") {
        Some(Value::String(name)) if valid_name(name) => name.clone(),
        other => {
            return Err(at(format!(
                "function.name must be 1 to 64 letters, digits, `_` or `-`, got {}",
                other.map_or("nothing".to_owned(), Value::to_string)
            )))
        }
    };
    if !matches!(function.get("description"), None | Some(Value::String(_))) {
        return Err(at("function.description must be a string".into()));
    }
    if !matches!(function.get("strict"), None | Some(Value::Bool(_))) {
        return Err(at("function.strict must be a boolean".into()));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => None,
        Some(p @ Value::Object(_)) => Some(p.clone()),
        Some(other) => {
            return Err(at(format!(
                "function.parameters must be a JSON Schema object, got {}",
                json_type(other)
            )))
        }
    };
    Ok(ToolSpec { name, parameters })
}

fn tool_choice(value: Option<&Value>) -> Result<Option<ToolChoice>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "tool_choice",
            "tool_choice must be \"none\", \"auto\", \"required\" or \
             {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    Ok(Some(match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(bad()),
        },
        Some(Value::Object(o)) => {
            let name = (o.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| o.get("function").and_then(|f| f.get("name")))
                .flatten()
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            ToolChoice::Named(name.to_owned())
        }
        Some(_) => return Err(bad()),
    }))
}

impl Tools {
    /// The request's tool fields; `None` when there are no tools to call (no `tools`, an
    /// empty list, or `tool_choice: "none"` without them).
    pub fn parse(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Tools>, ApiError> {
        let choice = tool_choice(choice)?;
        let definitions = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items.clone(),
            Some(other) => {
                return Err(tools_error(format!(
                    "`tools` must be a list, got {}",
                    json_type(other)
                )))
            }
        };
        let specs = definitions
            .iter()
            .enumerate()
            .map(|(i, t)| tool_spec(i, t))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, spec) in specs.iter().enumerate() {
            if specs[..i].iter().any(|s| s.name == spec.name) {
                return Err(tools_error(format!(
                    "two tools are named {:?}; names must differ",
                    spec.name
                )));
            }
        }
        if let Some(ToolChoice::Named(name)) = &choice {
            if !specs.iter().any(|s| &s.name == name) {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    format!("tool_choice names the function {name:?}, which is not in `tools`"),
                ));
            }
        }
        if specs.is_empty() {
            return match choice {
                // Nothing to call, and nothing asked for.
                None | Some(ToolChoice::None | ToolChoice::Auto) => Ok(None),
                Some(_) => Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice \"required\" needs `tools`",
                )),
            };
        }
        Ok(Some(Tools {
            definitions,
            specs,
            choice: choice.unwrap_or(ToolChoice::Auto),
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// The `tools` template variable.
    pub fn template_vars(&self) -> Map<String, Value> {
        Map::from_iter([("tools".to_owned(), Value::Array(self.definitions.clone()))])
    }

    /// Whether outputs are read for calls (every choice but `none`).
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The constraint `tool_choice` puts on the output.
    pub fn grammar(&self) -> Option<StructuredOutput> {
        match &self.choice {
            ToolChoice::None => None,
            ToolChoice::Auto => Some(auto_tool_call_grammar(&self.specs, self.parallel)),
            ToolChoice::Required => Some(tool_call_grammar(&self.specs, self.parallel)),
            ToolChoice::Named(name) => {
                let spec: Vec<ToolSpec> = self
                    .specs
                    .iter()
                    .filter(|s| &s.name == name)
                    .cloned()
                    .collect();
                Some(tool_call_grammar(&spec, false))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn parse(
        tools: Value,
        choice: Value,
        parallel: Option<bool>,
    ) -> Result<Option<Tools>, ApiError> {
        Tools::parse(Some(&tools), Some(&choice), parallel)
    }

    #[test]
    fn no_tools_is_no_op_unless_a_call_is_demanded() {
        for (tools, choice) in [
            (json!([]), json!("none")),
            (json!(null), json!(null)),
            (json!([]), json!("auto")),
        ] {
            assert!(parse(tools, choice, None).expect("valid").is_none());
        }
        let e = parse(json!([]), json!("required"), None).expect_err("required");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn choices_pick_their_grammar() {
        let t = parse(json!([weather()]), json!(null), None)
            .expect("valid")
            .expect("tools");
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel && t.parses_calls());
        let Some(StructuredOutput::Grammar(g)) = t.grammar() else {
            panic!("auto grammar")
        };
        assert!(
            g.contains("suffix=\"<tool_call>\"") && g.contains("get_weather"),
            "{g}"
        );
        let t = parse(json!([weather()]), json!("none"), Some(false))
            .expect("valid")
            .expect("tools");
        assert!(t.grammar().is_none() && !t.parses_calls());
        assert_eq!(t.template_vars()["tools"], json!([weather()]));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = parse(json!([weather()]), named, None)
            .expect("valid")
            .expect("tools");
        let Some(StructuredOutput::Grammar(g)) = t.grammar() else {
            panic!("named grammar")
        };
        assert!(
            !g.contains("call)*"),
            "a named function is called once: {g}"
        );
        let t = parse(json!([weather()]), json!("required"), None)
            .expect("valid")
            .expect("tools");
        let Some(StructuredOutput::Grammar(g)) = t.grammar() else {
            panic!("required grammar")
        };
        assert!(g.contains("call)*"), "{g}");
    }

    #[test]
    fn bad_tools_and_choices_name_their_field() {
        let function = |f: Value| json!([{"type": "function", "function": f}]);
        for (tools, choice, param) in [
            (json!({}), json!(null), "tools"),
            (json!([1]), json!(null), "tools"),
            (
                json!([{"type": "custom", "custom": {}}]),
                json!(null),
                "tools",
            ),
            (function(json!({"name": "a b"})), json!(null), "tools"),
            (
                function(json!({"name": "f", "parameters": "x"})),
                json!(null),
                "tools",
            ),
            (
                function(json!({"name": "f", "extra": 1})),
                json!(null),
                "tools",
            ),
            (json!([weather(), weather()]), json!(null), "tools"),
            (json!([weather()]), json!("sometimes"), "tool_choice"),
            (
                json!([weather()]),
                json!({"type": "function", "function": {"name": "nope"}}),
                "tool_choice",
            ),
            (
                json!([weather()]),
                json!({"type": "allowed_tools"}),
                "tool_choice",
            ),
        ] {
            let e =
                parse(tools.clone(), choice.clone(), None).expect_err(&format!("{tools} {choice}"));
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }
}
