//! `SamplingParams` for Python: keyword construction, validated by the core builder.

use std::collections::HashMap;

use novainfer_core::SamplingParams;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors::{invalid, param_error};

/// Parameters that control how tokens are picked and when generation stops.
///
/// Invalid values raise ``InvalidParameterError`` naming the parameter.
#[pyclass(name = "SamplingParams", module = "novainfer._native", frozen)]
#[derive(Clone)]
pub struct PySamplingParams {
    pub inner: SamplingParams,
}

/// `stop` may be one string or a list of them, as in the OpenAI API.
fn stop_strings(stop: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    match stop {
        None => Ok(Vec::new()),
        Some(s) if s.is_none() => Ok(Vec::new()),
        Some(s) if s.is_instance_of::<PyString>() => Ok(vec![s.extract()?]),
        Some(s) => s
            .extract()
            .map_err(|_| invalid("stop", "stop must be a string or a list of strings".into())),
    }
}

#[pymethods]
impl PySamplingParams {
    #[new]
    #[pyo3(signature = (*, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
        presence_penalty=0.0, frequency_penalty=0.0, seed=None, max_tokens=Some(16), stop=None,
        stop_token_ids=None, ignore_eos=false, logprobs=None, n=1, min_tokens=0, logit_bias=None,
        include_stop_str_in_output=false, skip_special_tokens=true,
        spaces_between_special_tokens=true),
        // `Some(16)` would render as `...` in the generated signature.
        text_signature = "(*, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, \
            presence_penalty=0.0, frequency_penalty=0.0, seed=None, max_tokens=16, stop=None, \
            stop_token_ids=None, ignore_eos=False, logprobs=None, n=1, min_tokens=0, logit_bias=None, \
            include_stop_str_in_output=False, skip_special_tokens=True, \
            spaces_between_special_tokens=True)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: f64,
        top_p: f64,
        top_k: i64,
        min_p: f64,
        repetition_penalty: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        seed: Option<u64>,
        max_tokens: Option<i64>,
        stop: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<Vec<u32>>,
        ignore_eos: bool,
        logprobs: Option<i64>,
        n: i64,
        min_tokens: i64,
        logit_bias: Option<HashMap<u32, f64>>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> PyResult<Self> {
        let inner = SamplingParams::builder()
            .temperature(temperature as f32)
            .top_p(top_p as f32)
            .top_k(top_k)
            .min_p(min_p as f32)
            .repetition_penalty(repetition_penalty as f32)
            .presence_penalty(presence_penalty as f32)
            .frequency_penalty(frequency_penalty as f32)
            .seed(seed)
            .max_tokens(max_tokens)
            .stop(stop_strings(stop)?)
            .stop_token_ids(stop_token_ids.unwrap_or_default())
            .ignore_eos(ignore_eos)
            .logprobs(logprobs)
            .n(n)
            .min_tokens(min_tokens)
            .logit_bias(
                logit_bias
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(id, b)| (id, b as f32))
                    .collect(),
            )
            .include_stop_str_in_output(include_stop_str_in_output)
            .skip_special_tokens(skip_special_tokens)
            .spaces_between_special_tokens(spaces_between_special_tokens)
            .build()
            .map_err(param_error)?;
        Ok(Self { inner })
    }

    #[getter]
    fn temperature(&self) -> f32 {
        self.inner.temperature()
    }
    #[getter]
    fn top_p(&self) -> f32 {
        self.inner.top_p()
    }
    /// ``0`` when top-k is disabled.
    #[getter]
    fn top_k(&self) -> usize {
        self.inner.top_k().unwrap_or(0)
    }
    #[getter]
    fn min_p(&self) -> f32 {
        self.inner.min_p()
    }
    #[getter]
    fn repetition_penalty(&self) -> f32 {
        self.inner.repetition_penalty()
    }
    #[getter]
    fn presence_penalty(&self) -> f32 {
        self.inner.presence_penalty()
    }
    #[getter]
    fn frequency_penalty(&self) -> f32 {
        self.inner.frequency_penalty()
    }
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.inner.seed()
    }
    #[getter]
    fn max_tokens(&self) -> Option<usize> {
        self.inner.max_tokens()
    }
    #[getter]
    fn stop(&self) -> Vec<String> {
        self.inner.stop().stop.clone()
    }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.inner.stop().stop_token_ids.clone()
    }
    #[getter]
    fn ignore_eos(&self) -> bool {
        self.inner.stop().ignore_eos
    }
    #[getter]
    fn logprobs(&self) -> Option<usize> {
        self.inner.logprobs()
    }
    /// Completions per prompt; they share the prompt's KV and use seeds ``seed + i``.
    #[getter]
    fn n(&self) -> usize {
        self.inner.n()
    }
    /// Tokens generated before EOS, a stop token or a stop string may end the output.
    #[getter]
    fn min_tokens(&self) -> usize {
        self.inner.min_tokens()
    }
    /// Token id → bias added to its logit before sampling (-100 bans, 100 all but forces).
    #[getter]
    fn logit_bias(&self) -> HashMap<u32, f32> {
        self.inner.logit_bias().iter().copied().collect()
    }
    /// Keep the stop string (or stop token's text) at the end of the output.
    #[getter]
    fn include_stop_str_in_output(&self) -> bool {
        self.inner.stop().include_stop_str_in_output
    }
    /// Leave special tokens out of the text.
    #[getter]
    fn skip_special_tokens(&self) -> bool {
        self.inner.text_options().skip_special_tokens
    }
    /// With special tokens kept, set each apart with spaces (Hugging Face's slow-tokenizer rule).
    #[getter]
    fn spaces_between_special_tokens(&self) -> bool {
        self.inner.text_options().spaces_between_special_tokens
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        let py_opt = |v: Option<String>| v.unwrap_or_else(|| "None".into());
        let py_bool = |b: bool| if b { "True" } else { "False" };
        let stop: Vec<String> = p.stop().stop.iter().map(|s| format!("{s:?}")).collect();
        format!(
            "SamplingParams(temperature={}, top_p={}, top_k={}, min_p={}, repetition_penalty={}, \
             presence_penalty={}, frequency_penalty={}, seed={}, max_tokens={}, stop=[{}], \
             stop_token_ids={:?}, ignore_eos={}, logprobs={}, n={}, min_tokens={}, logit_bias={{{}}}, \
             include_stop_str_in_output={}, skip_special_tokens={}, spaces_between_special_tokens={})",
            p.temperature(),
            p.top_p(),
            p.top_k().unwrap_or(0),
            p.min_p(),
            p.repetition_penalty(),
            p.presence_penalty(),
            p.frequency_penalty(),
            py_opt(p.seed().map(|s| s.to_string())),
            py_opt(p.max_tokens().map(|n| n.to_string())),
            stop.join(", "),
            p.stop().stop_token_ids,
            py_bool(p.stop().ignore_eos),
            py_opt(p.logprobs().map(|n| n.to_string())),
            p.n(),
            p.min_tokens(),
            p.logit_bias()
                .iter()
                .map(|(id, b)| format!("{id}: {b:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            py_bool(p.stop().include_stop_str_in_output),
            py_bool(p.text_options().skip_special_tokens),
            py_bool(p.text_options().spaces_between_special_tokens),
        )
    }
}
