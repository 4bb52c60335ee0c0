//! Grammars for tool calls in the Hermes format Qwen2.5 is trained on:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! A server constrains `tool_choice: "required"` or a named function with
//! [`tool_call_grammar`], and `tool_choice: "auto"` with [`auto_tool_call_grammar`], as a
//! [`StructuredOutput::Grammar`]: each call's JSON is valid against its tool's parameter schema,
//! with the spacing of the model's own chat template.

use novainfer_core::StructuredOutput;
use serde_json::{json, Value};

/// One callable function: its name and the JSON Schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    /// `None` (no `parameters`): any JSON object.
    pub parameters: Option<Value>,
}

/// The schema of one call's JSON: `{"name": <one of the tools>, "arguments": <its schema>}`.
pub fn call_schema(tools: &[ToolSpec]) -> Value {
    let one = |tool: &ToolSpec| {
        let mut arguments = tool
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object"}));
        if let Value::Object(map) = &mut arguments {
            // The tool's own options would apply inside `%json` only to its arguments.
            map.remove("x-guidance");
        }
        json!({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    let mut schema = match tools {
        [tool] => one(tool),
        _ => json!({"anyOf": tools.iter().map(one).collect::<Vec<_>>()}),
    };
    if let Value::Object(map) = &mut schema {
        // `json.dumps` spacing, as the chat template shows calls to the model.
        map.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

fn repeat(parallel: bool) -> &'static str {
    if parallel {
        "(\"\\n\" call)*"
    } else {
        ""
    }
}

/// A Lark grammar for one or more (`parallel`) `<tool_call>` blocks calling `tools`, and
/// nothing else. `tools` must not be empty.
pub fn tool_call_grammar(tools: &[ToolSpec], parallel: bool) -> StructuredOutput {
    let schema = call_schema(tools);
    let repeat = repeat(parallel);
    StructuredOutput::Grammar(format!(
        "start: call {repeat}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"
    ))
}

/// Text that starts a bare JSON object (after optional whitespace).
const OPENS_JSON: &str = r"[ \t\r\n]*\{(?s:.*)";

/// `tool_choice: "auto"`: free text, unconstrained until the model writes `<tool_call>`; from
/// there on the call (and, `parallel`, any further calls) must be valid, and nothing follows
/// the last call. Free text never contains `<tool_call>` (that would start a call).
///
/// Small models given tools often write the call's JSON without the tag (Qwen2.5-Coder-0.5B
/// does, greedily): an output that opens a JSON object is taken as bare calls, one per line,
/// constrained the same way. So free text never starts with `{`.
pub fn auto_tool_call_grammar(tools: &[ToolSpec], parallel: bool) -> StructuredOutput {
    let schema = call_schema(tools);
    let repeat = repeat(parallel);
    let bare_repeat = if parallel { "(\"\\n\" body)*" } else { "" };
    // `pre` is a lazy lexeme ending at the trigger, alive beside `TEXT`, so the trigger is
    // recognised wherever it starts; `TEXT` is all text free of it.
    StructuredOutput::Grammar(format!(
        "start: TEXT | pre \"\\n\" body \"\\n</tool_call>\" {repeat} | bare\n\
         bare: body {bare_repeat} | WS body {bare_repeat}\n\
         pre[suffix=\"<tool_call>\"]: /(?s:.*)/ & ~/{OPENS_JSON}/\n\
         TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/ & ~/{OPENS_JSON}/\n\
         WS: /[ \\t\\r\\n]+/\n\
         call: \"<tool_call>\\n\" body \"\\n</tool_call>\"\n\
         body: %json {schema}\n"
    ))
}
