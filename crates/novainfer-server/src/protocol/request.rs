//! Request bodies as OpenAI clients send them, and the one function that parses them.
//!
//! Parse, don't validate: a body becomes a typed request or an [`ApiError`] naming the
//! field at fault. Unknown fields are rejected (a typo such as `max_token` would otherwise
//! be silently ignored); OpenAI features this server does not implement are rejected by
//! name. Fields whose JSON type varies (`prompt`, `stop`, `input`, message `content`) are
//! kept as raw JSON here and converted with precise messages in [`super::inputs`].

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Fields shared by `/v1/completions` and `/v1/chat/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedFields {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// Seconds this request may take (capped by the server's `--request-timeout`).
    pub timeout: Option<f64>,
    /// OpenAI: token id (as a string) → bias in [-100, 100].
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub min_tokens: Option<i64>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    /// True no-ops: accepted so clients that always send them work; logged once.
    pub store: Option<bool>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub service_tier: Option<String>,
    /// OpenAI's output constraint (see `crate::structured`).
    pub response_format: Option<Value>,
    /// vLLM's output constraint (see `crate::structured`).
    pub structured_outputs: Option<Value>,
    /// vLLM's scheduling priority: lower runs first under `--scheduling-policy priority`.
    pub priority: Option<i32>,
}

impl SharedFields {
    /// Whether a stream ends with a usage chunk (`stream_options.include_usage`).
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// The no-op fields this request carries (for the log-once note).
    pub fn ignored_fields(&self) -> Vec<&'static str> {
        [
            ("store", self.store.is_some()),
            ("metadata", self.metadata.is_some()),
            ("service_tier", self.service_tier.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
        .collect()
    }
}

/// Must list exactly the fields of [`SharedFields`] (checked by a unit test).
pub const SHARED_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "stream",
    "stream_options",
    "user",
    "timeout",
    "logit_bias",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "store",
    "metadata",
    "service_tier",
    "response_format",
    "structured_outputs",
    "priority",
];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// OpenAI and vLLM fields we know and deliberately do not implement: named in the error
/// (any other unknown field is refused too, as unknown). docs/api.md has the full table.
const UNSUPPORTED_FIELDS: &[&str] = &[
    // OpenAI
    "best_of",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "verbosity",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    // vLLM extras
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "request_id",
    "prompt_embeds",
    "documents",
    "chat_template",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "thinking_token_budget",
    // `include_reasoning` is accepted as true (what this server does): see `router_defaults`.
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionFields {
    pub prompt: Value,
    pub echo: Option<bool>,
    pub logprobs: Option<i64>,
    /// Fill-in-the-middle: the text after the completion (needs the model's FIM tokens).
    pub suffix: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatFields {
    pub messages: Value,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Server-kept conversation (also `X-Session-Id`).
    pub session_id: Option<String>,
    /// vLLM: end the prompt with the assistant's turn opened (default true).
    pub add_generation_prompt: Option<bool>,
    /// vLLM: the model continues the final (assistant) message instead of starting a new one.
    pub continue_final_message: Option<bool>,
    /// vLLM: extra variables for the chat template (e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Tool calling (see `crate::tools`).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Value,
    pub encoding_format: Option<String>,
    pub dimensions: Option<i64>,
    pub user: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Value>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    /// As on chat requests (and vLLM's `/tokenize`): the template describes them, so a
    /// client can count or inspect the prompt a tool-calling request would get.
    pub tools: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// A generation request: the endpoint's own fields plus the shared ones.
#[derive(Debug)]
pub struct GenerationBody<T> {
    pub own: T,
    pub shared: SharedFields,
    /// No-op fields the request carried (accepted, logged once).
    pub ignored: Vec<&'static str>,
}

pub type CompletionRequest = GenerationBody<CompletionFields>;
pub type ChatRequest = GenerationBody<ChatFields>;

pub(crate) fn object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            json_type(&other)
        ))),
    }
}

pub fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Deserializes `value` into `T`; a type error names the field it is in.
pub(crate) fn typed<T: DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path.is_empty() || path == "." {
            // `unknown field` and `missing field` errors carry the name in the message.
            ApiError::invalid(inner.clone()).with_param(field_in(&inner).unwrap_or_default())
        } else {
            let param = path.split(['.', '[']).next().unwrap_or(&path).to_owned();
            ApiError::invalid_param(param, format!("{path}: {inner}"))
        }
    })
}

/// The backquoted field name in a serde `unknown field`/`missing field` message.
fn field_in(message: &str) -> Option<String> {
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_owned())
}

fn reject_unsupported(map: &Map<String, Value>) -> Result<(), ApiError> {
    match map
        .keys()
        .find(|k| UNSUPPORTED_FIELDS.contains(&k.as_str()))
    {
        Some(k) => Err(ApiError::invalid_param(
            k.clone(),
            format!("`{k}` is not supported by this server"),
        )),
        None => Ok(()),
    }
}

/// Parses a completions or chat body: shared fields and the endpoint's own fields `T`.
pub fn parse_generation<T: DeserializeOwned>(bytes: &[u8]) -> Result<GenerationBody<T>, ApiError> {
    let mut map = object(bytes)?;
    let from_router = super::router_defaults::strip(&mut map)?;
    reject_unsupported(&map)?;
    let (shared, own): (Map<_, _>, Map<_, _>) = map
        .into_iter()
        .partition(|(k, _)| SHARED_FIELDS.contains(&k.as_str()));
    let shared: SharedFields = typed(Value::Object(shared))?;
    let mut ignored = shared.ignored_fields();
    ignored.extend(from_router);
    Ok(GenerationBody {
        own: typed(Value::Object(own)).map_err(|e| with_shared_fields(e, SHARED_FIELDS))?,
        ignored,
        shared,
    })
}

/// An unknown field met while parsing an endpoint's own fields: serde's message lists only
/// those (the shared fields were split off before), so a typo of a shared field such as
/// `max_token` was told neither `max_tokens` nor that it exists. The message is rebuilt over
/// every field the endpoint accepts, with the nearest one suggested.
fn with_shared_fields(e: ApiError, shared: &[&str]) -> ApiError {
    // `typed` puts the field's path first: "max_token: unknown field `max_token`, expected ...".
    let marker = "unknown field `";
    let Some(rest) = e
        .message
        .find(marker)
        .map(|i| &e.message[i + marker.len()..])
    else {
        return e;
    };
    let Some((unknown, expected)) = rest.split_once('`') else {
        return e;
    };
    if e.param.as_deref() != Some(unknown) {
        return e; // a nested object's field (`tools[0].function.x`): serde's list is the right one
    }
    // serde: "..., expected one of `a`, `b`", "..., expected `a`" or "..., there are no fields".
    let mut fields: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    fields.extend(shared);
    fields.sort_unstable();
    fields.dedup();
    let listed = fields
        .iter()
        .map(|f| format!("`{f}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let hint =
        nearest(unknown, &fields).map_or(".".to_owned(), |f| format!("; did you mean `{f}`?"));
    ApiError::invalid_param(
        unknown.to_owned(),
        format!("unknown field `{unknown}`{hint} The fields of this endpoint are {listed}"),
    )
}

/// The field within two edits of `name` (the closest, the first on a tie), if any.
fn nearest<'a>(name: &str, fields: &[&'a str]) -> Option<&'a str> {
    fields
        .iter()
        .map(|f| (edit_distance(name, f), *f))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, f)| f)
}

/// Levenshtein distance over bytes (field names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// Parses the body of a non-generating endpoint.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let map = object(bytes)?;
    reject_unsupported(&map)?;
    typed(Value::Object(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        parse_generation(body.as_bytes())
    }

    #[test]
    fn splits_shared_and_own_fields() {
        let r =
            chat(r#"{"model":"m","messages":[],"max_tokens":5,"session_id":"s","temperature":0}"#)
                .expect("valid body");
        assert_eq!(r.shared.model.as_deref(), Some("m"));
        assert_eq!(r.shared.max_tokens, Some(5));
        assert_eq!(r.shared.temperature, Some(0.0));
        assert_eq!(r.own.session_id.as_deref(), Some("s"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = chat(r#"{"messages":[],"max_tokens":"five"}"#).expect_err("wrong type");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.status, 400);
        let e = chat(r#"{"messages":[],"max_token":5}"#).expect_err("unknown field");
        assert_eq!(e.param.as_deref(), Some("max_token"));
        // The shared field it was meant to be is suggested and listed among the endpoint's own.
        assert!(
            e.message.contains("did you mean `max_tokens`?"),
            "{}",
            e.message
        );
        assert!(e.message.contains("`messages`") && e.message.contains("`temperature`"));
        // A nested object's unknown field keeps serde's own list.
        let nested = ApiError::invalid_param(
            "tools",
            "tools[0].function: unknown field `nam`, expected `name`",
        );
        let e = with_shared_fields(nested, SHARED_FIELDS);
        assert_eq!(e.param.as_deref(), Some("tools"));
        assert!(!e.message.contains("of this endpoint"), "{}", e.message);
        let e = chat(r#"{"messages":[],"zzzzzzzz":5}"#).expect_err("unknown field");
        assert!(!e.message.contains("did you mean"), "{}", e.message);
        assert!(e.message.contains("`max_tokens`"), "{}", e.message);
        let e = chat(r#"{"max_tokens":5}"#).expect_err("missing field");
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = chat(r#"{"messages":[],"functions":[]}"#).expect_err("unsupported");
        assert!(e.message.contains("not supported"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("functions"));
        let e = chat(r#"{"messages":[],"parallel_tool_calls":1}"#).expect_err("typed");
        assert_eq!(e.param.as_deref(), Some("parallel_tool_calls"));
        let e = parse_generation::<CompletionFields>(br#"{"prompt":"x","tools":[]}"#)
            .expect_err("chat only");
        assert_eq!(e.param.as_deref(), Some("tools"));
        let e = chat(r#"{"messages":[],"use_beam_search":true}"#).expect_err("vLLM extra");
        assert_eq!(e.param.as_deref(), Some("use_beam_search"));
        let e =
            chat(r#"{"messages":[],"stream_options":{"include_usage":3}}"#).expect_err("nested");
        assert_eq!(e.param.as_deref(), Some("stream_options"));
    }

    #[test]
    fn true_no_ops_are_accepted_and_named() {
        let r = chat(
            r#"{"messages":[],"tools":[],"tool_choice":"none","store":false,
                "metadata":{"k":"v"},"service_tier":"auto","min_tokens":2}"#,
        )
        .expect("no-ops accepted");
        assert_eq!(r.ignored, vec!["store", "metadata", "service_tier"]);
        assert_eq!(r.own.tool_choice, Some(Value::from("none")));
        assert_eq!(r.shared.min_tokens, Some(2));
        let e = chat(r#"{"messages":[],"metadata":{"k":1}}"#).expect_err("typed");
        assert_eq!(e.param.as_deref(), Some("metadata"));
    }

    #[test]
    fn bad_json_and_non_objects_are_400() {
        for body in ["{", "[]", "3", "", "null", "\"x\""] {
            let e = chat(body).expect_err(body);
            assert_eq!(e.status, 400, "{body}");
        }
    }

    #[test]
    fn shared_field_list_matches_the_struct() {
        // Every listed field is accepted by the struct (deny_unknown_fields would refuse one
        // that is not), so a field can neither be listed and missing nor present and unlisted
        // without one of these two checks failing.
        let all: Map<String, Value> = SHARED_FIELDS
            .iter()
            .map(|f| (f.to_string(), Value::Null))
            .collect();
        typed::<SharedFields>(Value::Object(all)).expect("every listed field exists");
        let e = typed::<SharedFields>(serde_json::json!({"nope": 1})).expect_err("unknown");
        let listed = e.message;
        for f in SHARED_FIELDS {
            assert!(
                listed.contains(&format!("`{f}`")),
                "{f} missing from {listed}"
            );
        }
        assert_eq!(
            listed.matches('`').count() / 2 - 1,
            SHARED_FIELDS.len(),
            "{listed}"
        );
    }
}
