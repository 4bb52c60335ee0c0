//! From request fields to the engine's `SamplingParams`: OpenAI defaults filled in, every
//! value checked by `SamplingParams::builder().build()`, which names the parameter at fault.

use novainfer_core::SamplingParams;

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
        .stop_token_ids(shared.stop_token_ids.clone().unwrap_or_default())
        .ignore_eos(shared.ignore_eos.unwrap_or(false))
        .logprobs(endpoint.logprobs)
        .n(shared.n.unwrap_or(1))
        .structured_output(crate::structured::structured_output(
            shared.response_format.as_ref(),
            shared.structured_outputs.as_ref(),
        )?)
        .build()?;
    Ok(params)
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
            },
        )
        .expect_err("max_tokens 0");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
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
