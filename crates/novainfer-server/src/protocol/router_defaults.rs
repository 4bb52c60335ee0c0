//! Fields that routers add to every request they forward, at values that ask for what this
//! server does anyway.
//!
//! `vllm-router` (an SGLang-router descendant) re-serializes each body with its own request
//! type, so a plain `{"prompt": ..}` arrives with `no_stop_trim: false`,
//! `return_hidden_states: false`, `separate_reasoning: true` and more (and fields this server
//! implements, such as `continue_final_message`, which are not handled here). Each is accepted only
//! at that value, where it is a true no-op, and logged once; any other value is a 400 naming
//! the field (this server cannot keep stop strings, return hidden states, …).

use serde_json::{Map, Value};

use crate::error::ApiError;

/// (field, the value at which it changes nothing here).
const NO_OP_AT: &[(&str, bool)] = &[
    // SGLang: keep the stop string in the text (we never do unless include_stop_str_in_output).
    ("no_stop_trim", false),
    ("return_hidden_states", false),
    // Reasoning models: the reasoning goes to `reasoning_content`, streamed, and is included.
    ("separate_reasoning", true),
    ("stream_reasoning", true),
    ("include_reasoning", true),
];

/// Removes the router fields `map` carries at their no-op value and returns their names;
/// a 400 naming the field for any other value.
pub fn strip(map: &mut Map<String, Value>) -> Result<Vec<&'static str>, ApiError> {
    let mut stripped = Vec::new();
    for &(field, no_op) in NO_OP_AT {
        let Some(value) = map.get(field) else {
            continue;
        };
        if value.as_bool() != Some(no_op) {
            return Err(ApiError::invalid_param(
                field,
                format!("`{field}` is only accepted as {no_op} (what this server always does)"),
            ));
        }
        map.remove(field);
        stripped.push(field);
    }
    Ok(stripped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_defaults_are_dropped_and_other_values_refused() {
        let body = r#"{"prompt":"x","no_stop_trim":false,"return_hidden_states":false,
                       "separate_reasoning":true}"#;
        let mut map: Map<String, Value> = serde_json::from_str(body).expect("json");
        let stripped = strip(&mut map).expect("no-op values");
        assert_eq!(
            stripped,
            vec!["no_stop_trim", "return_hidden_states", "separate_reasoning"]
        );
        assert_eq!(map.keys().collect::<Vec<_>>(), vec!["prompt"]);
        let mut map: Map<String, Value> =
            serde_json::from_str(r#"{"no_stop_trim":true}"#).expect("json");
        let e = strip(&mut map).expect_err("a real request for untrimmed stops");
        assert_eq!(e.param.as_deref(), Some("no_stop_trim"));
        let mut map: Map<String, Value> =
            serde_json::from_str(r#"{"include_reasoning":"yes"}"#).expect("json");
        assert_eq!(
            strip(&mut map).expect_err("not a bool").param.as_deref(),
            Some("include_reasoning")
        );
    }
}
