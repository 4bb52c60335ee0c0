//! `SamplingParams` for Python: keyword construction, validated by the core builder.

use std::collections::HashMap;

use novainfer_core::{SamplingParams, StructuredOutput};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

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

/// The one constraint of a `StructuredOutputsParams` (any object with its attributes).
fn structured_output(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<StructuredOutput>> {
    const P: &str = "structured_outputs";
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let field = |name: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        match obj.getattr(name) {
            Ok(v) if v.is_none() => Ok(None),
            Ok(v) => Ok(Some(v)),
            Err(_) => Ok(None),
        }
    };
    let bad = |what: &str| invalid(P, format!("structured_outputs.{what}"));
    let mut found: Vec<(&str, StructuredOutput)> = Vec::new();
    if let Some(v) = field("json")? {
        let text: String = if v.is_instance_of::<PyString>() {
            v.extract()?
        } else if v.is_instance_of::<PyDict>() {
            obj.py()
                .import("json")?
                .call_method1("dumps", (v,))?
                .extract()?
        } else {
            return Err(bad("json must be a dict or a JSON string"));
        };
        found.push(("json", StructuredOutput::JsonSchema(text)));
    }
    if let Some(v) = field("regex")? {
        let r = v.extract().map_err(|_| bad("regex must be a string"))?;
        found.push(("regex", StructuredOutput::Regex(r)));
    }
    if let Some(v) = field("choice")? {
        if v.is_instance_of::<PyString>() {
            return Err(bad("choice must be a list of strings"));
        }
        let c = v
            .extract()
            .map_err(|_| bad("choice must be a list of strings"))?;
        found.push(("choice", StructuredOutput::Choice(c)));
    }
    if let Some(v) = field("grammar")? {
        let g = v.extract().map_err(|_| bad("grammar must be a string"))?;
        found.push(("grammar", StructuredOutput::Grammar(g)));
    }
    if let Some(v) = field("json_object")? {
        if v.extract::<bool>()
            .map_err(|_| bad("json_object must be a bool"))?
        {
            found.push(("json_object", StructuredOutput::JsonObject));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(invalid(
            P,
            format!(
                "structured_outputs sets {}: give exactly one constraint",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop().map(|(_, s)| s))
}

#[pymethods]
impl PySamplingParams {
    #[new]
    #[pyo3(signature = (*, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
        presence_penalty=0.0, frequency_penalty=0.0, seed=None, max_tokens=Some(16), stop=None,
        stop_token_ids=None, ignore_eos=false, logprobs=None, n=1, min_tokens=0, logit_bias=None,
        include_stop_str_in_output=false, skip_special_tokens=true,
        spaces_between_special_tokens=true, structured_outputs=None),
        // `Some(16)` would render as `...` in the generated signature.
        text_signature = "(*, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, \
            presence_penalty=0.0, frequency_penalty=0.0, seed=None, max_tokens=16, stop=None, \
            stop_token_ids=None, ignore_eos=False, logprobs=None, n=1, min_tokens=0, logit_bias=None, \
            include_stop_str_in_output=False, skip_special_tokens=True, \
            spaces_between_special_tokens=True, structured_outputs=None)")]
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
        structured_outputs: Option<&Bound<'_, PyAny>>,
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
            .structured_output(structured_output(structured_outputs)?)
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
    /// The output constraint as a ``StructuredOutputsParams`` (``json`` as JSON text), or
    /// ``None``.
    #[getter]
    fn structured_outputs<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(spec) = self.inner.structured_output() else {
            return Ok(None);
        };
        let kwargs = PyDict::new(py);
        match spec {
            StructuredOutput::JsonSchema(s) => kwargs.set_item("json", s)?,
            StructuredOutput::JsonObject => kwargs.set_item("json_object", true)?,
            StructuredOutput::Regex(r) => kwargs.set_item("regex", r)?,
            StructuredOutput::Choice(c) => kwargs.set_item("choice", c.clone())?,
            StructuredOutput::Grammar(g) => kwargs.set_item("grammar", g)?,
        }
        let class = py
            .import("novainfer.structured_outputs")?
            .getattr("StructuredOutputsParams")?;
        class.call((), Some(&kwargs)).map(Some)
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
