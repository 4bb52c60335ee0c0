//! Chat templates rendered the way transformers' `apply_chat_template` renders them, byte for
//! byte: jinja2 with `trim_blocks`/`lstrip_blocks`, the trailing newline of the template dropped,
//! Python string methods (`.strip()`, `.split()`, ...) through minijinja's pycompat, the globals
//! `raise_exception(msg)` and `strftime_now(fmt)`, and a `tojson` filter that is Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//!
//! Printed values follow Python's `str()`: `None`, `True`/`False`, `1e-07`, `['a', 1]`.
//! Undefined variables are lenient as in jinja2 (falsy, print as nothing). Like transformers,
//! `tools` and `documents` are defined and `None` unless the caller passes them.
//! Known gap: `~` concatenation still spells none/bools the minijinja way (`none`, `true`).
//! `strftime_now` reads the UTC clock (transformers uses local time; servers usually run in UTC).

mod python;
mod strftime;

use std::collections::BTreeMap;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation. Besides `role` and `content`, the fields OpenAI's tool
/// calling adds: an assistant's `tool_calls`, a tool result's `tool_call_id`, and the
/// optional `name` of the author; templates read them as transformers passes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Calls an assistant message made (shown to the template as
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallMessage>,
    /// For a `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A function call made in an earlier assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub name: String,
    /// The arguments as a JSON value (an object, normally): templates print them with
    /// `tojson`, so an OpenAI client's arguments *string* must be parsed first, or the
    /// model would see it quoted (vLLM parses it too).
    pub arguments: serde_json::Value,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`: it rejects these messages.
    #[error("{0}")]
    Raised(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    #[error("chat template variables must be a JSON object, got {0}")]
    ExtraNotAnObject(String),
    #[error(
        "continue_final_message is set but the final message does not appear in the rendered chat"
    )]
    FinalMessageNotRendered,
}

/// The message a template passed to `raise_exception`, carried as the minijinja error's source.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedException(String);

/// A chat template compiled once, with the tokenizer's special tokens it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            out.write_str(&python::py_str(value)).map_err(Error::from)
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", python::tojson);
        env.add_template_owned(TEMPLATE_NAME, source.into())
            .map_err(|e| ChatTemplateError::Syntax(format!("{e:#}")))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages`. `extra` (a JSON object) adds or overrides variables: `tools`,
    /// `documents`, or template-specific switches such as `enable_thinking`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: Option<serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        let messages: Vec<Value> = messages.iter().map(message_value).collect();
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        match extra {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(vars)) => {
                for (name, value) in vars {
                    ctx.insert(name, json_value(value));
                }
            }
            Some(other) => return Err(ChatTemplateError::ExtraNotAnObject(other.to_string())),
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        template.render(ctx).map_err(render_error)
    }
}

/// Cuts a conversation rendered without a generation prompt right after the final message's
/// content, so the model continues that message (transformers' `continue_final_message`):
/// the template's end-of-turn tokens after it are dropped. A template that trimmed the
/// message's trailing whitespace is cut after the trimmed content.
pub fn continue_final_message(
    rendered: &str,
    final_content: &str,
) -> Result<String, ChatTemplateError> {
    let trimmed = final_content.trim();
    let at = rendered
        .rfind(trimmed)
        .ok_or(ChatTemplateError::FinalMessageNotRendered)?;
    let lstripped = final_content.trim_start();
    let end = if rendered[at..].starts_with(lstripped) {
        at + lstripped.len()
    } else {
        at + trimmed.len()
    };
    Ok(rendered[..end].to_owned())
}

/// A message as templates see it: fields a message lacks are undefined (not `None`), as
/// in the dicts transformers passes, so `message.tool_calls is defined` works.
fn message_value(message: &ChatMessage) -> Value {
    let mut fields: Vec<(&str, Value)> = vec![
        ("role", Value::from(message.role.as_str())),
        ("content", Value::from(message.content.as_str())),
    ];
    if let Some(name) = &message.name {
        fields.push(("name", Value::from(name.as_str())));
    }
    if !message.tool_calls.is_empty() {
        let calls: Vec<Value> = message
            .tool_calls
            .iter()
            .map(|call| {
                let mut call_fields: Vec<(&str, Value)> = Vec::with_capacity(3);
                if let Some(id) = &call.id {
                    call_fields.push(("id", Value::from(id.as_str())));
                }
                call_fields.push(("type", Value::from("function")));
                call_fields.push((
                    "function",
                    Value::from_pairs([
                        ("name", Value::from(call.name.as_str())),
                        ("arguments", json_value(call.arguments.clone())),
                    ]),
                ));
                Value::from_pairs(call_fields)
            })
            .collect();
        fields.push(("tool_calls", Value::from(calls)));
    }
    if let Some(id) = &message.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    Value::from_pairs(fields)
}

/// JSON into template values, keeping object key order (Python dicts keep it too).
fn json_value(value: serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match value {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(b),
        Json::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Value::from(i),
            (None, Some(u), _) => Value::from(u),
            (None, None, f) => Value::from(f.unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s),
        Json::Array(items) => Value::from(items.into_iter().map(json_value).collect::<Vec<_>>()),
        Json::Object(map) => Value::from_pairs(map.into_iter().map(|(k, v)| (k, json_value(v)))),
    }
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        if let Some(raised) = cause.downcast_ref::<RaisedException>() {
            return ChatTemplateError::Raised(raised.0.clone());
        }
        source = cause.source();
    }
    ChatTemplateError::Render(format!("{err:#}"))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    strftime::strftime_utc(&format, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen2.5-Instruct's template (default system prompt, tool calls), as shipped.
    const QWEN25_TEMPLATE: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"##;

    /// DeepSeek-R1-Distill-Qwen's template: namespace(), split('</think>')[-1], `+` concatenation.
    const R1_DISTILL_TEMPLATE: &str = r##"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}"##;

    #[test]
    fn continue_final_message_cuts_after_the_last_content() {
        let rendered = qwen()
            .render(
                &msgs(&[("user", "hi"), ("assistant", "Sure, here is ")]),
                false,
                None,
            )
            .expect("render");
        assert!(
            rendered.ends_with("Sure, here is <|im_end|>\n"),
            "{rendered:?}"
        );
        let cut = continue_final_message(&rendered, "Sure, here is ").expect("cut");
        assert!(
            cut.ends_with("<|im_start|>assistant\nSure, here is "),
            "{cut:?}"
        );
        // A template that trims the message: cut after the trimmed text.
        let trimmed = rendered.replace("here is <|im_end|>", "here is<|im_end|>");
        let cut = continue_final_message(&trimmed, "Sure, here is ").expect("cut");
        assert!(cut.ends_with("assistant\nSure, here is"), "{cut:?}");
        assert!(matches!(
            continue_final_message(&rendered, "never said"),
            Err(ChatTemplateError::FinalMessageNotRendered)
        ));
    }

    fn qwen() -> ChatTemplate {
        ChatTemplate::new(QWEN25_TEMPLATE, None, Some("<|im_end|>".to_owned())).expect("compiles")
    }

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, content)| ChatMessage::new(*role, *content))
            .collect()
    }

    fn render_with(template: &str, extra: serde_json::Value) -> String {
        let template = ChatTemplate::new(template, None, None).expect("compiles");
        template.render(&[], false, Some(extra)).expect("renders")
    }

    // Every expected string below was produced by jinja2 3.1 configured as transformers does
    // (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, json.dumps tojson).

    #[test]
    fn qwen_single_user_message_gets_default_system_prompt() {
        let text = qwen()
            .render(&msgs(&[("user", "Hello!")]), true, None)
            .expect("renders");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn qwen_multi_turn_with_system_prompt() {
        let messages = msgs(&[
            ("system", "You are terse."),
            ("user", "2+2?"),
            ("assistant", "4"),
            ("user", "And 3+3?"),
        ]);
        let text = qwen().render(&messages, true, None).expect("renders");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
        );
        let without_prompt = qwen().render(&messages, false, None).expect("renders");
        assert_eq!(
            without_prompt,
            text.trim_end_matches("<|im_start|>assistant\n")
        );
    }

    #[test]
    fn qwen_tools_are_serialized_like_json_dumps() {
        let tools = json!([{"type": "function", "function": {
            "name": "get_weather", "description": "Get the weather — «now»",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer", "default": 1.5e-7}},
                "required": ["city"]}}}]);
        let text = qwen()
            .render(
                &msgs(&[("user", "Weather in Paris?")]),
                true,
                Some(json!({"tools": tools})),
            )
            .expect("renders");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the weather — «now»\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\", \"default\": 1.5e-07}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn qwen_renders_tool_calls_and_tool_results() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let call = |id: &str, city: &str| ToolCallMessage {
            id: Some(id.into()),
            name: "get_weather".into(),
            arguments: json!({"city": city}),
        };
        let mut assistant = ChatMessage::new("assistant", "");
        assistant.tool_calls = vec![call("call_1", "Paris"), call("call_2", "Rome")];
        let mut first = ChatMessage::new("tool", "22C");
        first.tool_call_id = Some("call_1".into());
        first.name = Some("get_weather".into());
        let mut second = ChatMessage::new("tool", "25C");
        second.tool_call_id = Some("call_2".into());
        let messages = vec![
            ChatMessage::new("user", "Weather in Paris and Rome?"),
            assistant,
            first,
            second,
        ];
        let text = qwen()
            .render(&messages, true, Some(json!({"tools": tools})))
            .expect("renders");
        // jinja2 configured as transformers, on the same messages as OpenAI-style dicts.
        assert_eq!(
            text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22C\n</tool_response>\n<tool_response>\n25C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        let name_and_id = ChatTemplate::new(
            "{% for m in messages %}{{ m.name is defined }}/{{ m.tool_call_id }}/{{ m.tool_calls is defined }};{% endfor %}",
            None,
            None,
        )
        .expect("compiles")
        .render(&messages, false, None)
        .expect("renders");
        assert_eq!(
            name_and_id,
            "False//False;False//True;True/call_1/False;False/call_2/False;"
        );
    }

    #[test]
    fn r1_distill_drops_thinking_from_history() {
        let template = ChatTemplate::new(
            R1_DISTILL_TEMPLATE,
            Some("<｜begin▁of▁sentence｜>".to_owned()),
            Some("<｜end▁of▁sentence｜>".to_owned()),
        )
        .expect("compiles");
        let messages = msgs(&[
            ("system", "SYS"),
            ("user", "1+1?"),
            ("assistant", "<think>\nadd\n</think>\n\n2"),
            ("user", "2+2?"),
        ]);
        assert_eq!(
            template.render(&messages, true, None).expect("renders"),
            "<｜begin▁of▁sentence｜>SYS<｜User｜>1+1?<｜Assistant｜>\n\n2<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>\n"
        );
    }

    #[test]
    fn raise_exception_surfaces_the_templates_message() {
        let template = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user message') }}{% endif %}ok",
            None,
            None,
        )
        .expect("compiles");
        match template.render(&msgs(&[("assistant", "hi")]), false, None) {
            Err(ChatTemplateError::Raised(message)) => {
                assert_eq!(message, "Conversation must start with a user message")
            }
            other => panic!("expected Raised, got {other:?}"),
        }
        assert_eq!(
            template
                .render(&msgs(&[("user", "hi")]), false, None)
                .expect("renders"),
            "ok"
        );
    }

    #[test]
    fn syntax_errors_and_bad_extra_are_reported() {
        assert!(matches!(
            ChatTemplate::new("{% if %}", None, None),
            Err(ChatTemplateError::Syntax(_))
        ));
        let template = ChatTemplate::new("x", None, None).expect("compiles");
        let err = template
            .render(&[], false, Some(json!([1])))
            .expect_err("not an object");
        assert!(
            matches!(err, ChatTemplateError::ExtraNotAnObject(_)),
            "{err:?}"
        );
    }

    #[test]
    fn values_print_like_python_str() {
        let text = render_with(
            "{{ none }}|{{ true }}|{{ [1, 'a', none, false, 1.5e-7, 100.0, 1e16] }}|{{ {'k': \"it's\", 'n': 2} }}|{{ undefined_var }}|{{ 0.1 + 0.2 }}|{{ tools }}",
            json!({}),
        );
        assert_eq!(text, "None|True|[1, 'a', None, False, 1.5e-07, 100.0, 1e+16]|{'k': \"it's\", 'n': 2}||0.30000000000000004|None");
    }

    fn nested() -> serde_json::Value {
        json!({"x": {"z": [], "a": {}, "m": {"q": [1, 2.5, null, true, "é😀\n\t\"\\<>&'"], "b": {"c": -0.0}}}})
    }

    #[test]
    fn tojson_indent_matches_json_dumps() {
        assert_eq!(
            render_with("{{ x | tojson(indent=2) }}", nested()),
            "{\n  \"z\": [],\n  \"a\": {},\n  \"m\": {\n    \"q\": [\n      1,\n      2.5,\n      null,\n      true,\n      \"é😀\\n\\t\\\"\\\\<>&'\"\n    ],\n    \"b\": {\n      \"c\": -0.0\n    }\n  }\n}"
        );
    }

    #[test]
    fn tojson_options_match_json_dumps() {
        assert_eq!(
            render_with("{{ x | tojson(sort_keys=true, separators=(',', ':')) }}|{{ x | tojson(ensure_ascii=true) }}", nested()),
            "{\"a\":{},\"m\":{\"b\":{\"c\":-0.0},\"q\":[1,2.5,null,true,\"é😀\\n\\t\\\"\\\\<>&'\"]},\"z\":[]}|{\"z\": [], \"a\": {}, \"m\": {\"q\": [1, 2.5, null, true, \"\\u00e9\\ud83d\\ude00\\n\\t\\\"\\\\<>&'\"], \"b\": {\"c\": -0.0}}}"
        );
    }

    #[test]
    fn python_string_methods_and_loop_controls() {
        let text = render_with(
            "{{ ' a,b '.strip().split(',') | join('+') }}|{{ 'Hello'.startswith('He') }}|{{ s.split('</think>')[-1].lstrip('\\n') }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
            json!({"s": "<think>\nhmm\n</think>\n\nanswer", "d": {"b": 1, "a": 2}}),
        );
        assert_eq!(text, "a+b|True|answer|b=1;a=2;");
        let text = render_with(
            "{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}{{ m.role ~ ':' ~ m.content }}{% if not loop.last %},{% endif %}{% endfor %}",
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}),
        );
        assert_eq!(text, "user:a,assistant:b,");
    }

    #[test]
    fn whitespace_control_matches_transformers_jinja2() {
        assert_eq!(render_with("hi\n\n", json!({})), "hi\n");
        assert_eq!(render_with("{{ \"a\" }}\n", json!({})), "a");
        assert_eq!(
            render_with("  {% if true %}\nx\n  {% endif %}\ny", json!({})),
            "x\ny"
        );
    }

    #[test]
    fn strftime_now_reads_the_clock() {
        let year = render_with("{{ strftime_now('%Y') }}", json!({}));
        assert!(year.parse::<i32>().is_ok_and(|y| y >= 2025), "{year}");
    }
}
