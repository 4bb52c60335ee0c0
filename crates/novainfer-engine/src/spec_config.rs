//! vLLM's `speculative_config`, checked: which proposer drafts (the method), how many tokens
//! it may draft a step, and NovaInfer's `draft_policy`. Plain data: the proposers read it, and
//! nothing here knows them.

use std::path::PathBuf;

use novainfer_core::{NgramRange, ParamError};
use serde_json::Value;

/// How drafts are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the
    /// sequence's longest suffix n-gram.
    Ngram(NgramRange),
    /// A smaller model with the same tokenizer, decoding greedily (a checkpoint directory or
    /// GGUF file, loaded on the target's device).
    DraftModel { model: PathBuf },
}

/// How many tokens a step drafts for each request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DraftPolicyKind {
    /// As many as measured costs and each request's acceptance say pay
    /// ([`crate::draft_policy::DraftPolicy`]):
    /// none when drafting would be slower than plain decoding.
    #[default]
    Adaptive,
    /// `num_speculative_tokens` every step (cut only by the step's room and the grammar):
    /// for tests, and for measuring what drafting costs.
    Always,
}

/// vLLM's `speculative_config`, checked, with NovaInfer's `draft_policy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// Most draft tokens per request per step.
    pub num_speculative_tokens: usize,
    pub policy: DraftPolicyKind,
}

const MAX_SPECULATIVE_TOKENS: usize = 16;

impl SpeculativeConfig {
    /// From vLLM's JSON shape: `{"method": "ngram", "num_speculative_tokens": 4,
    /// "prompt_lookup_min": 2, "prompt_lookup_max": 5}` or `{"method": "draft_model", "model":
    /// "<path>", "num_speculative_tokens": 4}` (as in vLLM, `method` may be left out when `model`
    /// is given), plus NovaInfer's `"draft_policy"`: `"adaptive"` (default) or `"always"`.
    /// Errors name the field at fault.
    pub fn from_json(value: &Value) -> Result<Self, ParamError> {
        let err = |field: &str, why: String| {
            ParamError::new("speculative_config", format!("{field}: {why}"))
        };
        let obj = value
            .as_object()
            .ok_or_else(|| err("speculative_config", "must be a JSON object".into()))?;
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "method"
                    | "model"
                    | "num_speculative_tokens"
                    | "prompt_lookup_min"
                    | "prompt_lookup_max"
                    | "draft_policy"
            ) {
                return Err(err(
                    key,
                    "unknown field (known: method, model, num_speculative_tokens, \
                     prompt_lookup_min, prompt_lookup_max, draft_policy)"
                        .into(),
                ));
            }
        }
        let count = |field: &str, default: Option<usize>| -> Result<usize, ParamError> {
            match obj.get(field) {
                None => default.ok_or_else(|| err(field, "is required".into())),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| err(field, format!("must be a non-negative integer, got {v}"))),
            }
        };
        let model = match obj.get("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(m)) if !m.is_empty() => Some(PathBuf::from(m)),
            Some(v) => return Err(err("model", format!("must be a path, got {v}"))),
        };
        let method_name = match (obj.get("method"), &model) {
            (Some(Value::String(m)), _) => m.as_str(),
            (None | Some(Value::Null), Some(_)) => "draft_model",
            (None | Some(Value::Null), None) => {
                return Err(err(
                    "method",
                    "is required (\"ngram\", or \"draft_model\" with a model)".into(),
                ))
            }
            (Some(v), _) => return Err(err("method", format!("must be a string, got {v}"))),
        };
        let method = match method_name {
            "ngram" => {
                if model.is_some() {
                    return Err(err(
                        "model",
                        "is for method \"draft_model\", not \"ngram\"".into(),
                    ));
                }
                let min = count("prompt_lookup_min", Some(2))?;
                let max = count("prompt_lookup_max", Some(min.max(5)))?;
                let range = NgramRange::new(min, max).ok_or_else(|| {
                    err(
                        "prompt_lookup_min",
                        format!(
                            "need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min} and {max}"
                        ),
                    )
                })?;
                SpeculativeMethod::Ngram(range)
            }
            "draft_model" => {
                for field in ["prompt_lookup_min", "prompt_lookup_max"] {
                    if obj.contains_key(field) {
                        return Err(err(field, "is for method \"ngram\"".into()));
                    }
                }
                let model = model
                    .ok_or_else(|| err("model", "is required for method \"draft_model\"".into()))?;
                SpeculativeMethod::DraftModel { model }
            }
            other => {
                return Err(err(
                    "method",
                    format!(
                        "{other:?} is not supported here (supported: \"ngram\", \"draft_model\")"
                    ),
                ))
            }
        };
        let k = count("num_speculative_tokens", None)?;
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
            return Err(err(
                "num_speculative_tokens",
                format!("must be in 1..={MAX_SPECULATIVE_TOKENS}, got {k}"),
            ));
        }
        let policy = match obj.get("draft_policy") {
            None | Some(Value::Null) => DraftPolicyKind::Adaptive,
            Some(Value::String(p)) if p == "adaptive" => DraftPolicyKind::Adaptive,
            Some(Value::String(p)) if p == "always" => DraftPolicyKind::Always,
            Some(v) => {
                return Err(err(
                    "draft_policy",
                    format!("must be \"adaptive\" or \"always\", got {v}"),
                ))
            }
        };
        Ok(Self {
            method,
            num_speculative_tokens: k,
            policy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_config_reads_vllms_shape_and_names_bad_fields() {
        let c =
            SpeculativeConfig::from_json(&json!({"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_min": 2, "prompt_lookup_max": 5}))
            .expect("valid");
        assert_eq!(c.num_speculative_tokens, 4);
        assert_eq!(c.policy, DraftPolicyKind::Adaptive);
        let always = SpeculativeConfig::from_json(
            &json!({"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "always"}),
        )
        .expect("valid");
        assert_eq!(always.policy, DraftPolicyKind::Always);
        assert_eq!(
            c.method,
            SpeculativeMethod::Ngram(NgramRange::new(2, 5).expect("valid"))
        );
        for (bad, field) in [
            (
                json!({"method": "eagle", "num_speculative_tokens": 2}),
                "method",
            ),
            (json!({"num_speculative_tokens": 2}), "method"),
            (json!({"method": "ngram"}), "num_speculative_tokens"),
            (
                json!({"method": "ngram", "num_speculative_tokens": 0}),
                "num_speculative_tokens",
            ),
            (
                json!({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                "prompt_lookup_max": 3}),
                "prompt_lookup_min",
            ),
            (
                json!({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}),
                "typo",
            ),
            (json!([1]), "speculative_config"),
            (
                json!({"method": "draft_model", "num_speculative_tokens": 2}),
                "model",
            ),
            (
                json!({"method": "ngram", "model": "m", "num_speculative_tokens": 2}),
                "model",
            ),
            (
                json!({"model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": 2}),
                "prompt_lookup_min",
            ),
            (json!({"model": 3, "num_speculative_tokens": 2}), "model"),
            (
                json!({"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "never"}),
                "draft_policy",
            ),
        ] {
            let e = SpeculativeConfig::from_json(&bad).expect_err("refused");
            assert_eq!(e.param, "speculative_config");
            assert!(e.to_string().contains(field), "{e} should name {field}");
        }
    }

    #[test]
    fn a_draft_model_config_needs_a_model_and_may_leave_out_the_method() {
        for value in [
            json!({"method": "draft_model", "model": "/m/small.gguf", "num_speculative_tokens": 3}),
            json!({"model": "/m/small.gguf", "num_speculative_tokens": 3}),
        ] {
            let c = SpeculativeConfig::from_json(&value).expect("valid");
            assert_eq!(
                c.method,
                SpeculativeMethod::DraftModel {
                    model: PathBuf::from("/m/small.gguf")
                }
            );
            assert_eq!(c.num_speculative_tokens, 3);
        }
    }
}
