//! From request fields to the engine's `SamplingParams`: OpenAI defaults filled in, every
//! value checked by `SamplingParams::builder().build()`, which names the parameter at fault.

use novainfer_core::{SamplingParams, StructuredOutput};

use crate::args::MAX_TIMEOUT_SECS;
use crate::error::ApiError;
use crate::protocol::inputs::stop_strings;
use crate::protocol::request::SharedFields;

/// What the endpoint adds to the shared fields.
pub struct EndpointParams {
    /// `max_tokens` (or chat's `max_completion_tokens`); `None` uses `default_max_tokens`.
    pub max_tokens: Option<i64>,
    /// `None`: until the context is full.
    pub default_max_tokens: Option<i64>,
    /// Top alternatives per token, when logprobs were asked for.
    pub logprobs: Option<i64>,
    /// Token ids that end this endpoint's outputs besides the request's own (`/infill`: the
    /// FIM and repo-level tokens, which end a middle as llama.cpp ends it on them).
    pub extra_stop_token_ids: Vec<u32>,
    /// The endpoint's own output constraint (chat's tool-call grammar); a request that also
    /// sets `response_format` or `structured_outputs` is refused.
    pub constraint: Option<StructuredOutput>,
}

pub fn sampling_params(
    shared: &SharedFields,
    endpoint: EndpointParams,
) -> Result<SamplingParams, ApiError> {
    let seed = match shared.seed {
        Some(s) if s < 0 => {
            return Err(ApiError::invalid_param(
                "seed",
                format!("seed must be >= 0, got {s}"),
            ))
        }
        s => s.map(|s| s as u64),
    };
    let max_tokens = endpoint.max_tokens.or(endpoint.default_max_tokens);
    let mut stop_token_ids = shared.stop_token_ids.clone().unwrap_or_default();
    stop_token_ids.extend_from_slice(&endpoint.extra_stop_token_ids);
    let params = SamplingParams::builder()
        .temperature(shared.temperature.unwrap_or(1.0))
        .top_p(shared.top_p.unwrap_or(1.0))
        .top_k(shared.top_k.unwrap_or(0))
        .min_p(shared.min_p.unwrap_or(0.0))
        .repetition_penalty(shared.repetition_penalty.unwrap_or(1.0))
        .presence_penalty(shared.presence_penalty.unwrap_or(0.0))
        .frequency_penalty(shared.frequency_penalty.unwrap_or(0.0))
        .seed(seed)
        .max_tokens(max_tokens)
        .stop(stop_strings(shared.stop.as_ref())?)
        .stop_token_ids(stop_token_ids)
        .ignore_eos(shared.ignore_eos.unwrap_or(false))
        .logprobs(endpoint.logprobs)
        .n(shared.n.unwrap_or(1))
        .logit_bias(logit_bias(shared)?)
        .min_tokens(shared.min_tokens.unwrap_or(0))
        .include_stop_str_in_output(shared.include_stop_str_in_output.unwrap_or(false))
        .skip_special_tokens(shared.skip_special_tokens.unwrap_or(true))
        .spaces_between_special_tokens(shared.spaces_between_special_tokens.unwrap_or(true))
        .structured_output(constraint(shared, endpoint.constraint)?)
        .build()?;
    Ok(params)
}

/// The request's output constraint: its own (`response_format`, `structured_outputs`) or the
/// endpoint's, never both (the two would have to hold at once).
fn constraint(
    shared: &SharedFields,
    endpoint: Option<StructuredOutput>,
) -> Result<Option<StructuredOutput>, ApiError> {
    let own = crate::structured::structured_output(
        shared.response_format.as_ref(),
        shared.structured_outputs.as_ref(),
    )?;
    match (own, endpoint) {
        (Some(_), Some(_)) => Err(ApiError::invalid_param(
            "tool_choice",
            "tool calls are constrained by their own grammar, so `response_format` and \
             `structured_outputs` cannot be combined with tool_choice \"auto\", \"required\" \
             or a named function (tool_choice \"none\" can)",
        )),
        (own, endpoint) => Ok(own.or(endpoint)),
    }
}

/// OpenAI's `logit_bias`: token ids as JSON object keys (strings). Ranges are checked by the
/// builder, ids against the vocabulary by the engine.
fn logit_bias(shared: &SharedFields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &shared.logit_bias else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(key, &bias)| {
            key.trim().parse::<u32>().map(|id| (id, bias)).map_err(|_| {
                ApiError::invalid_param(
                    "logit_bias",
                    format!("logit_bias keys must be token ids such as \"1234\", got {key:?}"),
                )
            })
        })
        .collect()
}

/// The request's own timeout in seconds, if it set one.
pub fn request_timeout(shared: &SharedFields) -> Result<Option<f64>, ApiError> {
    match shared.timeout {
        // The cap keeps `arrival + timeout` far from overflowing `Instant` (1e300 would panic).
        Some(t) if !(t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_SECS) => {
            Err(ApiError::invalid_param(
                "timeout",
                format!("timeout must be a number of seconds in (0, {MAX_TIMEOUT_SECS}], got {t}"),
            ))
        }
        t => Ok(t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(shared: SharedFields) -> Result<SamplingParams, ApiError> {
        sampling_params(
            &shared,
            EndpointParams {
                max_tokens: None,
                default_max_tokens: Some(16),
                logprobs: None,
                extra_stop_token_ids: Vec::new(),
                constraint: None,
            },
        )
    }

    #[test]
    fn openai_defaults() {
        let p = params(SharedFields::default()).expect("valid test input");
        assert_eq!(p.temperature(), 1.0);
        assert_eq!(p.max_tokens(), Some(16));
        assert_eq!(p.n(), 1);
    }

    #[test]
    fn out_of_range_values_name_their_parameter() {
        let cases: Vec<(SharedFields, &str)> = vec![
            (
                SharedFields {
                    temperature: Some(-1.0),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SharedFields {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SharedFields {
                    n: Some(0),
                    ..Default::default()
                },
                "n",
            ),
            (
                SharedFields {
                    seed: Some(-2),
                    ..Default::default()
                },
                "seed",
            ),
            (
                SharedFields {
                    stop: Some(json!([""])),
                    ..Default::default()
                },
                "stop",
            ),
            (
                SharedFields {
                    presence_penalty: Some(9.0),
                    ..Default::default()
                },
                "presence_penalty",
            ),
        ];
        for (shared, param) in cases {
            let e = params(shared).expect_err(param);
            assert_eq!(e.param.as_deref(), Some(param));
            assert_eq!(e.status, 400);
        }
        let e = sampling_params(
            &SharedFields::default(),
            EndpointParams {
                max_tokens: Some(0),
                default_max_tokens: None,
                logprobs: Some(99),
                extra_stop_token_ids: Vec::new(),
                constraint: None,
            },
        )
        .expect_err("max_tokens 0");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn vllm_extras_reach_the_sampling_params() {
        let p = params(SharedFields {
            logit_bias: Some([("7".to_owned(), 5.0), (" 3".to_owned(), -100.0)].into()),
            min_tokens: Some(2),
            include_stop_str_in_output: Some(true),
            skip_special_tokens: Some(false),
            spaces_between_special_tokens: Some(false),
            ..Default::default()
        })
        .expect("valid");
        assert_eq!(p.logit_bias(), &[(3, -100.0), (7, 5.0)]);
        assert_eq!(p.min_tokens(), 2);
        assert!(p.stop().include_stop_str_in_output);
        assert!(!p.text_options().skip_special_tokens);
        assert!(!p.text_options().spaces_between_special_tokens);
        for (bias, why) in [(("x", 1.0), "not an id"), (("5", 101.0), "out of range")] {
            let e = params(SharedFields {
                logit_bias: Some([(bias.0.to_owned(), bias.1)].into()),
                ..Default::default()
            })
            .expect_err(why);
            assert_eq!(e.param.as_deref(), Some("logit_bias"), "{why}");
        }
        let e = params(SharedFields {
            min_tokens: Some(17),
            ..Default::default()
        })
        .expect_err("min_tokens > max_tokens");
        assert_eq!(e.param.as_deref(), Some("min_tokens"));
    }

    #[test]
    fn an_endpoint_constraint_excludes_the_requests_own() {
        let endpoint = |shared: &SharedFields| {
            sampling_params(
                shared,
                EndpointParams {
                    max_tokens: None,
                    default_max_tokens: None,
                    logprobs: None,
                    extra_stop_token_ids: Vec::new(),
                    constraint: Some(StructuredOutput::Regex("a".into())),
                },
            )
        };
        let p = endpoint(&SharedFields::default()).expect("alone");
        assert_eq!(
            p.structured_output(),
            Some(&StructuredOutput::Regex("a".into()))
        );
        let p = endpoint(&SharedFields {
            response_format: Some(json!({"type": "text"})),
            ..Default::default()
        })
        .expect("text is no constraint");
        assert!(p.structured_output().is_some());
        let e = endpoint(&SharedFields {
            response_format: Some(json!({"type": "json_object"})),
            ..Default::default()
        })
        .expect_err("two constraints");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn timeout_must_be_positive() {
        let t = |v| {
            request_timeout(&SharedFields {
                timeout: Some(v),
                ..Default::default()
            })
        };
        assert_eq!(t(2.5).expect("valid test input"), Some(2.5));
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            1e300,
            MAX_TIMEOUT_SECS * 2.0,
        ] {
            let e = t(bad).expect_err("out of range");
            assert_eq!(e.param.as_deref(), Some("timeout"));
        }
        assert!(t(MAX_TIMEOUT_SECS).is_ok());
    }
}
