//! Per-request sampling parameters, valid by construction.
//!
//! A [`SamplingParams`] can only be obtained from [`SamplingParamsBuilder::build`],
//! which rejects out-of-range values with a [`ParamError`] naming the parameter
//! and its limit. Everything downstream (sampler, engine, server) may therefore
//! trust the values without re-checking them.

use thiserror::Error;

use crate::builder::setter;
use crate::structured::StructuredOutput;

/// A rejected parameter: which one, and why.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("invalid {param}: {reason}")]
pub struct ParamError {
    /// The parameter's name as the user spelled it (`top_p`, `max_tokens`, ...).
    pub param: &'static str,
    /// What was wrong and what the limit is.
    pub reason: String,
}

impl ParamError {
    pub fn new(param: &'static str, reason: impl Into<String>) -> Self {
        Self {
            param,
            reason: reason.into(),
        }
    }
}

/// What ends a sequence besides the length limit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StopCondition {
    /// Strings that end generation; they never appear in the returned text.
    pub stop: Vec<String>,
    /// Token ids that end generation (in addition to the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (for benchmarks).
    pub ignore_eos: bool,
    /// Keep the stop string (or the stop token's text) at the end of the output (vLLM's
    /// `include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
}

/// How generated token ids become text (vLLM's detokenization switches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextOptions {
    /// Leave special tokens (`<|im_end|>`, ...) out of the text.
    pub skip_special_tokens: bool,
    /// With special tokens kept, separate each from its neighbours with a space (as the
    /// "slow" Hugging Face tokenizers do).
    pub spaces_between_special_tokens: bool,
}

impl Default for TextOptions {
    fn default() -> Self {
        Self {
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
        }
    }
}

/// The bias any one token may get: OpenAI's limit, where -100/100 amount to ban/force.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Validated sampling parameters for one request.
///
/// `temperature == 0` means greedy decoding; then the truncation parameters
/// (`top_k`, `top_p`, `min_p`) have no effect.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    temperature: f32,
    top_k: Option<usize>,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    seed: Option<u64>,
    max_tokens: Option<usize>,
    stop: StopCondition,
    logprobs: Option<usize>,
    n: usize,
    /// `(token id, bias)` added to the logits before sampling; sorted by id, ids unique.
    logit_bias: Vec<(u32, f32)>,
    min_tokens: usize,
    text: TextOptions,
    structured: Option<StructuredOutput>,
}

/// The most completions one request may ask for: each is a sequence in the batch.
pub const MAX_N: usize = 128;

/// The most top-n logprobs a request may ask for; it bounds per-token work.
pub const MAX_LOGPROBS: usize = 20;

impl SamplingParams {
    pub fn builder() -> SamplingParamsBuilder {
        SamplingParamsBuilder::default()
    }
    /// Greedy decoding with default limits.
    pub fn greedy() -> Self {
        Self::builder()
            .temperature(0.0)
            .build()
            .expect("greedy defaults are valid: this is a bug")
    }
    pub fn temperature(&self) -> f32 {
        self.temperature
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }
    pub fn top_k(&self) -> Option<usize> {
        self.top_k
    }
    pub fn top_p(&self) -> f32 {
        self.top_p
    }
    pub fn min_p(&self) -> f32 {
        self.min_p
    }
    pub fn repetition_penalty(&self) -> f32 {
        self.repetition_penalty
    }
    pub fn presence_penalty(&self) -> f32 {
        self.presence_penalty
    }
    pub fn frequency_penalty(&self) -> f32 {
        self.frequency_penalty
    }
    /// True when any penalty would change the logits.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
    pub fn seed(&self) -> Option<u64> {
        self.seed
    }
    /// `None`: generate until a stop condition or the context length.
    pub fn max_tokens(&self) -> Option<usize> {
        self.max_tokens
    }
    pub fn stop(&self) -> &StopCondition {
        &self.stop
    }
    /// Number of top alternatives to report per generated token, if any.
    pub fn logprobs(&self) -> Option<usize> {
        self.logprobs
    }
    /// Completions to generate from the one prompt (they share its KV blocks).
    pub fn n(&self) -> usize {
        self.n
    }
    /// `(token id, bias)` pairs added to the logits before sampling, by id.
    pub fn logit_bias(&self) -> &[(u32, f32)] {
        &self.logit_bias
    }
    /// Tokens generated before EOS or a stop token may be sampled or a stop string may end
    /// the output.
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }
    pub fn text_options(&self) -> TextOptions {
        self.text
    }
    /// The constraint the output must match, if any (`structured_outputs`).
    pub fn structured_output(&self) -> Option<&StructuredOutput> {
        self.structured.as_ref()
    }
    /// The parameters of completion `index` of `n`: a given seed becomes
    /// `seed + index`, so completions differ from each other yet each is
    /// reproducible, and completion 0 is what `n == 1` would give.
    pub fn for_completion(&self, index: usize) -> Self {
        Self {
            seed: self.seed.map(|s| s.wrapping_add(index as u64)),
            ..self.clone()
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParamsBuilder::default()
            .build()
            .expect("defaults are valid: this is a bug")
    }
}

/// Collects raw values; [`build`](Self::build) checks them all.
#[derive(Debug, Clone)]
pub struct SamplingParamsBuilder {
    temperature: f32,
    top_k: i64,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    seed: Option<u64>,
    max_tokens: Option<i64>,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    logprobs: Option<i64>,
    n: i64,
    logit_bias: Vec<(u32, f32)>,
    min_tokens: i64,
    include_stop_str_in_output: bool,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    structured_output: Option<StructuredOutput>,
}

impl Default for SamplingParamsBuilder {
    /// vLLM's defaults: temperature 1, no truncation, no penalties, 16 tokens.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: Some(16),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            n: 1,
            logit_bias: Vec::new(),
            min_tokens: 0,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            structured_output: None,
        }
    }
}

impl SamplingParamsBuilder {
    setter!(temperature: f32);
    setter!(
        /// `0` or `-1` disables top-k, as in vLLM.
        top_k: i64
    );
    setter!(top_p: f32);
    setter!(min_p: f32);
    setter!(repetition_penalty: f32);
    setter!(presence_penalty: f32);
    setter!(frequency_penalty: f32);
    setter!(seed: Option<u64>);
    setter!(
        /// `None` means "until the context is full".
        max_tokens: Option<i64>
    );
    setter!(stop: Vec<String>);
    setter!(stop_token_ids: Vec<u32>);
    setter!(ignore_eos: bool);
    setter!(logprobs: Option<i64>);
    setter!(n: i64);
    setter!(
        /// `(token id, bias)`, bias in [-100, 100]; a repeated id is an error.
        logit_bias: Vec<(u32, f32)>
    );
    setter!(
        /// `>= 0` and at most `max_tokens`.
        min_tokens: i64
    );
    setter!(include_stop_str_in_output: bool);
    setter!(skip_special_tokens: bool);
    setter!(spaces_between_special_tokens: bool);
    setter!(
        /// Constrains the output; checked fully (compiled) only by the engine.
        structured_output: Option<StructuredOutput>
    );

    pub fn build(self) -> Result<SamplingParams, ParamError> {
        let finite = |param: &'static str, v: f32| {
            if v.is_finite() {
                Ok(v)
            } else {
                Err(ParamError::new(
                    param,
                    format!("must be a finite number, got {v}"),
                ))
            }
        };
        let temperature = finite("temperature", self.temperature)?;
        if temperature < 0.0 {
            return Err(ParamError::new(
                "temperature",
                format!("must be >= 0, got {temperature}"),
            ));
        }
        let top_k = match self.top_k {
            0 | -1 => None,
            k if k > 0 => Some(k as usize),
            k => {
                return Err(ParamError::new(
                    "top_k",
                    format!("must be -1, 0 (disabled) or >= 1, got {k}"),
                ))
            }
        };
        let top_p = finite("top_p", self.top_p)?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ParamError::new(
                "top_p",
                format!("must be in (0, 1], got {top_p}"),
            ));
        }
        let min_p = finite("min_p", self.min_p)?;
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ParamError::new(
                "min_p",
                format!("must be in [0, 1], got {min_p}"),
            ));
        }
        let repetition_penalty = finite("repetition_penalty", self.repetition_penalty)?;
        if repetition_penalty <= 0.0 {
            return Err(ParamError::new(
                "repetition_penalty",
                format!("must be > 0, got {repetition_penalty}"),
            ));
        }
        let presence_penalty = finite("presence_penalty", self.presence_penalty)?;
        if !(-2.0..=2.0).contains(&presence_penalty) {
            return Err(ParamError::new(
                "presence_penalty",
                format!("must be in [-2, 2], got {presence_penalty}"),
            ));
        }
        let frequency_penalty = finite("frequency_penalty", self.frequency_penalty)?;
        if !(-2.0..=2.0).contains(&frequency_penalty) {
            return Err(ParamError::new(
                "frequency_penalty",
                format!("must be in [-2, 2], got {frequency_penalty}"),
            ));
        }
        let max_tokens = match self.max_tokens {
            None => None,
            Some(n) if n >= 1 => Some(n as usize),
            Some(n) => {
                return Err(ParamError::new(
                    "max_tokens",
                    format!("must be >= 1, got {n}"),
                ))
            }
        };
        if let Some(s) = self.stop.iter().find(|s| s.is_empty()) {
            return Err(ParamError::new(
                "stop",
                format!("stop strings must not be empty, got {s:?}"),
            ));
        }
        let logprobs = match self.logprobs {
            None => None,
            Some(n) if (0..=MAX_LOGPROBS as i64).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ParamError::new(
                    "logprobs",
                    format!("must be in [0, {MAX_LOGPROBS}], got {n}"),
                ))
            }
        };
        let mut logit_bias = self.logit_bias;
        if let Some((id, b)) = logit_bias
            .iter()
            .find(|(_, b)| !(b.is_finite() && b.abs() <= MAX_LOGIT_BIAS))
        {
            return Err(ParamError::new(
                "logit_bias",
                format!("the bias of token {id} must be in [-100, 100], got {b}"),
            ));
        }
        logit_bias.sort_by_key(|&(id, _)| id);
        if let Some(w) = logit_bias.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ParamError::new(
                "logit_bias",
                format!("token {} is given twice", w[0].0),
            ));
        }
        let min_tokens = match (self.min_tokens, max_tokens) {
            (m, _) if m < 0 => {
                return Err(ParamError::new(
                    "min_tokens",
                    format!("must be >= 0, got {m}"),
                ))
            }
            (m, Some(max)) if m as u64 > max as u64 => {
                return Err(ParamError::new(
                    "min_tokens",
                    format!("must be at most max_tokens ({max}), got {m}"),
                ))
            }
            (m, _) => m as usize,
        };
        if !(1..=MAX_N as i64).contains(&self.n) {
            return Err(ParamError::new(
                "n",
                format!("must be in [1, {MAX_N}], got {}", self.n),
            ));
        }
        if let Some(s) = &self.structured_output {
            s.check()
                .map_err(|reason| ParamError::new("structured_outputs", reason))?;
        }
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            seed: self.seed,
            max_tokens,
            stop: StopCondition {
                stop: self.stop,
                stop_token_ids: self.stop_token_ids,
                ignore_eos: self.ignore_eos,
                include_stop_str_in_output: self.include_stop_str_in_output,
            },
            logprobs,
            n: self.n as usize,
            logit_bias,
            min_tokens,
            text: TextOptions {
                skip_special_tokens: self.skip_special_tokens,
                spaces_between_special_tokens: self.spaces_between_special_tokens,
            },
            structured: self.structured_output,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected(b: SamplingParamsBuilder) -> ParamError {
        b.build()
            .expect_err("the builder accepted an invalid value")
    }

    #[test]
    fn defaults_are_vllm_defaults() {
        let p = SamplingParams::default();
        assert_eq!(p.temperature(), 1.0);
        assert_eq!(p.max_tokens(), Some(16));
        assert!(!p.is_greedy());
        assert!(!p.has_penalties());
    }

    #[test]
    fn each_bad_value_names_its_parameter() {
        let b = SamplingParams::builder;
        assert_eq!(rejected(b().temperature(-0.5)).param, "temperature");
        assert_eq!(rejected(b().temperature(f32::NAN)).param, "temperature");
        assert_eq!(rejected(b().top_p(0.0)).param, "top_p");
        assert_eq!(rejected(b().top_p(1.5)).param, "top_p");
        assert_eq!(rejected(b().top_k(-3)).param, "top_k");
        assert_eq!(rejected(b().min_p(1.1)).param, "min_p");
        assert_eq!(
            rejected(b().repetition_penalty(0.0)).param,
            "repetition_penalty"
        );
        assert_eq!(
            rejected(b().presence_penalty(2.5)).param,
            "presence_penalty"
        );
        assert_eq!(
            rejected(b().frequency_penalty(-3.0)).param,
            "frequency_penalty"
        );
        assert_eq!(rejected(b().max_tokens(Some(0))).param, "max_tokens");
        assert_eq!(rejected(b().stop(vec![String::new()])).param, "stop");
        assert_eq!(rejected(b().logprobs(Some(21))).param, "logprobs");
        assert_eq!(rejected(b().n(0)).param, "n");
        assert_eq!(rejected(b().n(MAX_N as i64 + 1)).param, "n");
        assert_eq!(
            rejected(b().logit_bias(vec![(3, 100.5)])).param,
            "logit_bias"
        );
        assert_eq!(
            rejected(b().logit_bias(vec![(3, f32::NAN)])).param,
            "logit_bias"
        );
        assert_eq!(
            rejected(b().logit_bias(vec![(3, 1.0), (2, 0.0), (3, -1.0)])).param,
            "logit_bias"
        );
        assert_eq!(rejected(b().min_tokens(-1)).param, "min_tokens");
        assert_eq!(
            rejected(b().max_tokens(Some(4)).min_tokens(5)).param,
            "min_tokens"
        );
        for bad in [
            StructuredOutput::Choice(vec![]),
            StructuredOutput::Choice(vec!["a".into(), String::new()]),
            StructuredOutput::Regex(String::new()),
            StructuredOutput::Grammar(" ".into()),
            StructuredOutput::JsonSchema(String::new()),
        ] {
            assert_eq!(
                rejected(b().structured_output(Some(bad))).param,
                "structured_outputs"
            );
        }
        let msg = rejected(b().top_p(1.5)).to_string();
        assert!(
            msg.contains("top_p") && msg.contains("(0, 1]") && msg.contains("1.5"),
            "{msg}"
        );
    }

    #[test]
    fn logit_bias_is_sorted_and_min_tokens_may_reach_max_tokens() {
        let p = SamplingParams::builder()
            .logit_bias(vec![(9, -100.0), (2, 100.0)])
            .max_tokens(Some(4))
            .min_tokens(4)
            .build()
            .expect("valid");
        assert_eq!(p.logit_bias(), &[(2, 100.0), (9, -100.0)]);
        assert_eq!(p.min_tokens(), 4);
        assert_eq!(p.text_options(), TextOptions::default());
        let unbounded = SamplingParams::builder()
            .max_tokens(None)
            .min_tokens(1000)
            .build()
            .expect("no max_tokens: any min_tokens");
        assert_eq!(unbounded.min_tokens(), 1000);
    }

    #[test]
    fn top_k_one_and_zero_temperature_are_greedy() {
        assert!(SamplingParams::builder()
            .top_k(1)
            .build()
            .unwrap()
            .is_greedy());
        assert!(SamplingParams::greedy().is_greedy());
        assert_eq!(
            SamplingParams::builder().top_k(-1).build().unwrap().top_k(),
            None
        );
    }
}
