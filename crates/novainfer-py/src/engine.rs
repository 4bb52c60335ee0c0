//! `Engine` and `TokenStream` for Python: thin wrappers over `EngineHandle`.
//!
//! Every call that may wait on the engine releases the GIL (`Python::detach`),
//! so other Python threads run while tokens are generated. Waits for tokens wake every
//! [`SIGNAL_POLL`] to run Python's signal handlers, so Ctrl-C raises `KeyboardInterrupt`
//! promptly; the request streams are then dropped, which aborts them and frees their blocks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use novainfer_core::KvLayout;
use novainfer_engine::speculative::SpeculativeConfig;
use novainfer_engine::tokenizer::Tokenizer;
use novainfer_engine::{
    AbortHandle, ChatMessage, CheckedRequest, Delta, EngineConfig, EngineError, EngineHandle,
    KvBudget, LoraConfig, NextDelta, Prompt, RequestOutput, RequestStream, Scheduling, StopReason,
    TokenLogprob, DEFAULT_GPU_MEMORY_UTILIZATION,
};
use novainfer_model::device::DEVICE_SPELLINGS;
use novainfer_model::{
    AdapterRef, DeviceChoice, DtypeChoice, GpuWeightDtype, KvCacheDtype, LmHeadDtype,
    WeightQuantization,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{engine_error, invalid, param_error};
use crate::sampling_params::PySamplingParams;

/// Per generated token: the chosen token and the top alternatives, each id mapped to
/// `(logprob, rank, decoded token)`.
type PyLogprobs = Vec<HashMap<u32, (f32, u32, String)>>;
/// `(text, token_ids, finish_reason, logprobs, num_cached_tokens, index, stop_reason)`;
/// `finish_reason` is None until the completion's last delta; `index` is the completion (0 when
/// `n == 1`); `stop_reason` is the stop string (str) or stop token id (int) that ended it.
type PyDelta = (
    String,
    Vec<u32>,
    Option<&'static str>,
    Option<PyLogprobs>,
    usize,
    usize,
    Option<Py<PyAny>>,
);
/// `(text, token_ids, finish_reason, logprobs, stop_reason)` of one finished completion.
type PyCompletion = (
    String,
    Vec<u32>,
    &'static str,
    Option<PyLogprobs>,
    Option<Py<PyAny>>,
);
/// The `n` completions of a request and its number of cached prompt tokens.
type PyOutput = (Vec<PyCompletion>, usize);

/// How long a wait for a delta lasts before Python's signal handlers get a chance to run: the
/// bound on how late a Ctrl-C is noticed (a step of the model may add to it).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The next delta of `stream`, waited for with the GIL released; a signal handler that raises
/// (Ctrl-C → `KeyboardInterrupt`) ends the wait with its exception.
fn next_delta(py: Python<'_>, stream: &mut RequestStream) -> PyResult<Option<Delta>> {
    loop {
        let next = py.detach(|| stream.next_timeout(SIGNAL_POLL));
        // Checked after every wait, not only after a timeout: while deltas keep arriving (a
        // big batch read stream by stream) no wait ever times out, and a Ctrl-C would wait
        // for the whole batch. The check only reads a flag the signal handler set.
        py.check_signals()?;
        match next {
            NextDelta::Delta(d) => return d.map(Some).map_err(engine_error),
            NextDelta::Ended => return Ok(None),
            NextDelta::Pending => {}
        }
    }
}

/// Ranks as vLLM gives them: the alternatives 1, 2, ... in order, the chosen token its rank in
/// the whole distribution.
fn logprobs_to_py(tokenizer: &Tokenizer, logprobs: Vec<TokenLogprob>) -> PyLogprobs {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    logprobs
        .into_iter()
        .map(|lp| {
            let mut entry: HashMap<u32, (f32, u32, String)> = lp
                .top
                .into_iter()
                .enumerate()
                .map(|(i, (id, l))| (id, (l, i as u32 + 1, text(id))))
                .collect();
            entry.insert(lp.token_id, (lp.logprob, lp.rank, text(lp.token_id)));
            entry
        })
        .collect()
}

fn stop_reason_to_py(py: Python<'_>, reason: Option<StopReason>) -> PyResult<Option<Py<PyAny>>> {
    Ok(match reason {
        None => None,
        Some(StopReason::TokenId(id)) => Some(id.into_pyobject(py)?.into_any().unbind()),
        Some(StopReason::Text(s)) => Some(s.into_pyobject(py)?.into_any().unbind()),
    })
}

// The signature below spells the default out so Python's introspection (and the stub) shows it.
const _: () = assert!(DEFAULT_GPU_MEMORY_UTILIZATION == 0.9);

/// A loaded model running on its own engine thread.
#[pyclass(name = "Engine", module = "novainfer._native", frozen)]
pub struct PyEngine {
    handle: EngineHandle,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (model, *, device="auto", dtype="auto", max_model_len=None, seed=0,
        requantize_q5_0=false, lm_head_dtype="auto", gpu_weight_dtype="auto", quantization=None, enforce_eager=false, async_scheduling=false, block_size=16, kv_cache_bytes=None, kv_cache_fraction=None,
        gpu_memory_utilization=0.9, max_num_seqs=None,
        max_num_batched_tokens=None, enable_prefix_caching=true, kv_layout="block",
        kv_cache_dtype="auto", scheduling_policy="fcfs", priority_aging_steps=256,
        long_prefill_token_threshold=None, max_num_partial_prefills=None,
        max_long_partial_prefills=None, speculative_config=None, enable_lora=false,
        max_loras=1, max_lora_rank=16))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        device: &str,
        dtype: &str,
        max_model_len: Option<usize>,
        seed: u64,
        requantize_q5_0: bool,
        lm_head_dtype: &str,
        gpu_weight_dtype: &str,
        quantization: Option<&str>,
        enforce_eager: bool,
        async_scheduling: bool,
        block_size: usize,
        kv_cache_bytes: Option<usize>,
        kv_cache_fraction: Option<f64>,
        gpu_memory_utilization: f64,
        max_num_seqs: Option<usize>,
        max_num_batched_tokens: Option<usize>,
        enable_prefix_caching: bool,
        kv_layout: &str,
        kv_cache_dtype: &str,
        scheduling_policy: &str,
        priority_aging_steps: usize,
        long_prefill_token_threshold: Option<usize>,
        max_num_partial_prefills: Option<usize>,
        max_long_partial_prefills: Option<usize>,
        speculative_config: Option<&str>,
        enable_lora: bool,
        max_loras: usize,
        max_lora_rank: usize,
    ) -> PyResult<Self> {
        let speculative = speculative_config
            .map(|json| {
                let value: serde_json::Value = serde_json::from_str(json).map_err(|e| {
                    invalid("speculative_config", format!("speculative_config: {e}"))
                })?;
                SpeculativeConfig::from_json(&value).map_err(param_error)
            })
            .transpose()?;
        let scheduling_policy = scheduling_policy.parse().map_err(param_error)?;
        let kv_layout: KvLayout = kv_layout.parse().map_err(param_error)?;
        let kv_cache_dtype = KvCacheDtype::parse(kv_cache_dtype).map_err(|_| {
            invalid(
                "kv_cache_dtype",
                format!(
                    "kv_cache_dtype must be one of auto, f32, f16, bf16, q8_0; got \
                     {kv_cache_dtype:?}"
                ),
            )
        })?;
        let lm_head_dtype = LmHeadDtype::parse(lm_head_dtype).map_err(|_| {
            invalid(
                "lm_head_dtype",
                format!("lm_head_dtype must be auto or q8_0; got {lm_head_dtype:?}"),
            )
        })?;
        let gpu_weight_dtype = GpuWeightDtype::parse(gpu_weight_dtype).map_err(|_| {
            invalid(
                "gpu_weight_dtype",
                format!("gpu_weight_dtype must be auto, bf16 or native; got {gpu_weight_dtype:?}"),
            )
        })?;
        let quantization = match quantization {
            None => WeightQuantization::None,
            Some(q) => WeightQuantization::parse(q).map_err(|_| {
                invalid(
                    "quantization",
                    format!("quantization must be \"fp8\" or None; got {q:?}"),
                )
            })?,
        };
        let dtype = DtypeChoice::parse(dtype).map_err(|_| {
            invalid(
                "dtype",
                format!("dtype must be one of auto, f32, bf16, f16; got {dtype:?}"),
            )
        })?;
        let device: DeviceChoice = device.parse().map_err(|_| {
            invalid(
                "device",
                format!("device must be one of {DEVICE_SPELLINGS}; got {device:?}"),
            )
        })?;
        let cfg = EngineConfig {
            model,
            device,
            gpu_memory_utilization,
            dtype,
            max_model_len,
            seed,
            requantize_q5_0,
            lm_head_dtype,
            gpu_weight_dtype,
            quantization,
            enforce_eager,
            async_scheduling,
            block_size,
            kv_layout,
            kv_cache_dtype,
            kv_cache: match (kv_cache_bytes, kv_cache_fraction) {
                (Some(_), Some(_)) => {
                    return Err(invalid(
                        "kv_cache_fraction",
                        "give kv_cache_bytes or kv_cache_fraction, not both".into(),
                    ))
                }
                (Some(bytes), None) => KvBudget::Bytes(bytes),
                (None, Some(fraction)) => KvBudget::FractionOfAvailable(fraction),
                (None, None) => KvBudget::Auto,
            },
            max_num_seqs,
            max_num_batched_tokens,
            // The `LLM` class: offline generation (the GPU's larger step budget).
            usage: novainfer_engine::Usage::Offline,
            enable_prefix_caching,
            scheduling_policy,
            priority_aging_steps,
            long_prefill_token_threshold,
            max_num_partial_prefills,
            max_long_partial_prefills,
            speculative,
            kv_events: None,
            tensor_parallel: novainfer_model::TensorParallel::single(),
            lora: enable_lora.then(|| LoraConfig {
                max_loras,
                max_lora_rank,
                modules: Vec::new(),
            }),
        };
        let handle = py
            .detach(|| EngineHandle::spawn(&cfg))
            .map_err(engine_error)?;
        Ok(Self { handle })
    }

    /// Loads the LoRA adapter at `path` (a PEFT directory or a GGUF adapter) as `name`;
    /// `replace` swaps out an adapter already loaded under that name.
    #[pyo3(signature = (name, path, replace=false))]
    fn load_lora(
        &self,
        py: Python<'_>,
        name: &str,
        path: PathBuf,
        replace: bool,
    ) -> PyResult<usize> {
        let loras = self.handle.frontend().loras().clone();
        let info = py
            .detach(|| loras.load_as(name, &path, replace))
            .map_err(engine_error)?;
        Ok(info.rank)
    }

    /// The model's shape: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    /// num_key_value_heads, head_dim, vocab_size.
    #[getter]
    fn model_config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.handle.frontend().model_config();
        let d = PyDict::new(py);
        for (key, value) in [
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim()),
            ("vocab_size", c.vocab_size),
        ] {
            d.set_item(key, value)?;
        }
        Ok(d)
    }

    /// Forgets adapter `name`; requests running on it finish with it.
    fn unload_lora(&self, name: &str) -> PyResult<()> {
        self.handle
            .frontend()
            .loras()
            .unload(name)
            .map_err(engine_error)
    }

    /// The loaded adapters as `(name, path, rank)`, by name.
    fn list_loras(&self) -> Vec<(String, PathBuf, usize)> {
        self.handle
            .frontend()
            .loras()
            .list()
            .into_iter()
            .map(|a| (a.name, a.path, a.rank))
            .collect()
    }

    /// Engine counters: requests, preemptions, KV blocks, prefix-cache hits, tokens. Counts
    /// are ints; the two speculative ratios and `busy_seconds` floats.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.handle.stats()).map_err(engine_error)?;
        let kv = &s.kv;
        let counts = [
            ("num_running", s.num_running as u64),
            ("num_waiting", s.num_waiting as u64),
            ("num_preemptions", s.num_preemptions),
            ("kv_num_blocks", kv.num_blocks as u64),
            ("kv_used_blocks", kv.num_used_blocks as u64),
            ("kv_free_blocks", kv.num_free_blocks as u64),
            ("kv_watermark_blocks", kv.watermark_blocks as u64),
            ("kv_cached_blocks", kv.num_cached_blocks as u64),
            ("kv_pool_bytes", s.kv_pool_bytes as u64),
            ("kv_bytes_per_block", s.kv_bytes_per_block as u64),
            ("prefix_cache_queries", kv.num_queries),
            ("prefix_cache_query_tokens", kv.num_query_tokens),
            ("prefix_cache_hit_tokens", kv.num_hit_tokens),
            ("prefix_cache_evictions", kv.num_evictions),
            ("num_prompt_tokens_computed", s.num_prompt_tokens_computed),
            ("num_generated_tokens", s.num_generated_tokens),
            ("num_steps", s.num_steps),
            ("num_steps_ahead", s.num_steps_ahead),
            ("num_drafts", s.num_drafts),
            ("num_draft_tokens", s.num_draft_tokens),
            ("num_accepted_tokens", s.num_accepted_tokens),
        ];
        let stats = PyDict::new(py);
        for (name, count) in counts {
            stats.set_item(name, count)?;
        }
        if let Some(bytes) = s.weight_bytes_per_token {
            stats.set_item("weight_bytes_per_token", bytes as u64)?;
        }
        if let Some(bytes) = s.weight_bytes {
            stats.set_item("weight_bytes", bytes as u64)?;
        }
        stats.set_item(
            "spec_acceptance_rate",
            ratio(s.num_accepted_tokens, s.num_draft_tokens),
        )?;
        stats.set_item(
            "spec_mean_acceptance_length",
            1.0 + ratio(s.num_accepted_tokens, s.num_drafts),
        )?;
        stats.set_item("busy_seconds", s.busy_seconds)?;
        Ok(stats)
    }

    /// Drops every cached prefix block; False (and nothing changes) while requests run.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.handle.reset_prefix_cache())
            .map_err(engine_error)
    }

    /// The device the model runs on (`"cpu"`, `"cuda:0"`, ...).
    #[getter]
    fn device(&self) -> String {
        self.handle.device().device.to_string()
    }

    /// Why that device was chosen (for the log line at start-up).
    #[getter]
    fn device_reason(&self) -> String {
        self.handle.device().reason.clone()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.handle.frontend().tokenizer().vocab_size()
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.handle.frontend().max_model_len()
    }

    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.handle.frontend().tokenizer().eos_token_ids().to_vec()
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let tokenizer = self.handle.frontend().tokenizer();
        py.detach(|| tokenizer.encode(text, add_special_tokens))
            .map_err(|e| engine_error(e.into()))
    }

    #[pyo3(signature = (token_ids, skip_special_tokens=true))]
    fn decode(
        &self,
        py: Python<'_>,
        token_ids: Vec<u32>,
        skip_special_tokens: bool,
    ) -> PyResult<String> {
        let tokenizer = self.handle.frontend().tokenizer();
        py.detach(|| tokenizer.decode(&token_ids, skip_special_tokens))
            .map_err(|e| engine_error(e.into()))
    }

    /// `messages` as a JSON list of `{role, content, name?, tool_calls?, tool_call_id?}` (a
    /// tool call: `{id?, name, arguments}`, the arguments a JSON value); `chat_template_kwargs`
    /// as a JSON object string.
    #[pyo3(signature = (messages, add_generation_prompt=true, continue_final_message=false, chat_template_kwargs=None))]
    fn apply_chat_template(
        &self,
        messages: &str,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: Option<&str>,
    ) -> PyResult<String> {
        let messages: Vec<ChatMessage> = serde_json::from_str(messages)
            .map_err(|e| invalid("messages", format!("not a list of messages: {e}")))?;
        let extra = chat_template_kwargs
            .map(serde_json::from_str::<serde_json::Value>)
            .transpose()
            .map_err(|e| invalid("chat_template_kwargs", format!("not valid JSON: {e}")))?;
        self.handle
            .frontend()
            .render_chat(
                &messages,
                add_generation_prompt,
                continue_final_message,
                extra,
            )
            .map_err(engine_error)
    }

    /// Runs every prompt to completion; returns per prompt its completions and cached-token count.
    /// `priority` (one per prompt) orders them under the priority policy.
    /// `adapters`: per prompt, the name of a loaded LoRA adapter (`None`: the base model).
    #[pyo3(signature = (prompts, params, priority=None, adapters=None))]
    fn generate(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        params: Vec<PyRef<'_, PySamplingParams>>,
        priority: Option<Vec<i32>>,
        adapters: Option<Vec<Option<String>>>,
    ) -> PyResult<Vec<PyOutput>> {
        let adapters = adapters.unwrap_or_else(|| vec![None; prompts.len()]);
        if adapters.len() != prompts.len() {
            return Err(invalid(
                "lora_request",
                format!(
                    "got {} prompts but {} LoRA requests",
                    prompts.len(),
                    adapters.len()
                ),
            ));
        }
        let adapters = self.adapters(&adapters)?;
        let priority = priority.unwrap_or_else(|| vec![0; prompts.len()]);
        if priority.len() != prompts.len() {
            return Err(invalid(
                "priority",
                format!(
                    "got {} prompts but {} priorities",
                    prompts.len(),
                    priority.len()
                ),
            ));
        }
        if prompts.len() != params.len() {
            return Err(invalid(
                "sampling_params",
                format!(
                    "got {} prompts but {} sampling params",
                    prompts.len(),
                    params.len()
                ),
            ));
        }
        let params: Vec<_> = params.iter().map(|p| p.inner.clone()).collect();
        let frontend = self.handle.frontend();
        let (prompts, streams) = py
            .detach(|| {
                // Check every request before starting any, so a bad one costs no work.
                let checked: Vec<CheckedRequest> = prompts
                    .into_iter()
                    .zip(&params)
                    .map(|(p, params)| frontend.check_request(p, params.clone()))
                    .collect::<Result<_, _>>()?;
                let prompts: Vec<Vec<u32>> =
                    checked.iter().map(|r| r.prompt_ids().to_vec()).collect();
                let requests = checked
                    .into_iter()
                    .zip(&priority)
                    .zip(adapters)
                    .map(|((request, &priority), adapter)| {
                        let scheduling = Scheduling {
                            priority,
                            adapter,
                            ..Scheduling::default()
                        };
                        (request, scheduling)
                    })
                    .collect();
                // All at once: the engine's first step sees the whole batch, so the same call
                // is scheduled, and computed, the same way on every run.
                let streams: Vec<RequestStream> = self.handle.submit_checked_batch(requests)?;
                Ok::<_, EngineError>((prompts, streams))
            })
            .map_err(engine_error)?;
        // Returning early (an error, Ctrl-C) drops the streams not yet read: all are aborted.
        let mut outputs = Vec::with_capacity(streams.len());
        for ((mut stream, prompt), p) in streams.into_iter().zip(prompts).zip(&params) {
            let mut deltas = Vec::new();
            while let Some(d) = next_delta(py, &mut stream)? {
                deltas.push(d);
            }
            let outs =
                RequestOutput::per_completion(&prompt, p.logprobs().is_some(), p.n(), deltas);
            let cached = outs.first().map_or(0, |o| o.num_cached_tokens);
            let tokenizer = frontend.tokenizer();
            let completions = outs
                .into_iter()
                .map(|o| {
                    Ok((
                        o.text,
                        o.token_ids,
                        o.finish_reason.as_str(),
                        o.logprobs.map(|lp| logprobs_to_py(tokenizer, lp)),
                        stop_reason_to_py(py, o.stop_reason)?,
                    ))
                })
                .collect::<PyResult<_>>()?;
            outputs.push((completions, cached));
        }
        Ok(outputs)
    }

    /// Starts one request and returns an iterator over its deltas.
    #[pyo3(signature = (prompt, params, priority=0, adapter=None))]
    fn stream(
        &self,
        py: Python<'_>,
        prompt: Vec<u32>,
        params: PyRef<'_, PySamplingParams>,
        priority: i32,
        adapter: Option<String>,
    ) -> PyResult<PyTokenStream> {
        let params = params.inner.clone();
        let frontend = self.handle.frontend();
        let scheduling = Scheduling {
            priority,
            adapter: self.adapters(&[adapter])?.pop().flatten(),
            ..Scheduling::default()
        };
        let stream = py
            .detach(|| {
                let prompt = frontend.prompt_token_ids(&Prompt::TokenIds(prompt))?;
                self.handle.submit_scheduled(prompt, params, scheduling)
            })
            .map_err(engine_error)?;
        Ok(PyTokenStream {
            tokenizer: frontend.tokenizer().clone(),
            abort: stream.abort_handle(),
            stream: Mutex::new(Some(stream)),
            closed: AtomicBool::new(false),
        })
    }

    /// Logits for every prompt position as little-endian f32 bytes, with `(rows, vocab)`;
    /// `step_by_step` feeds the prompt one token at a time through the KV cache.
    #[pyo3(signature = (prompt, step_by_step=false, adapter=None))]
    fn prompt_logits(
        &self,
        py: Python<'_>,
        prompt: Vec<u32>,
        step_by_step: bool,
        adapter: Option<String>,
    ) -> PyResult<(Py<PyBytes>, usize, usize)> {
        let frontend = self.handle.frontend();
        let rows = prompt.len();
        let adapter = self.adapters(&[adapter])?.pop().flatten();
        let logits = py
            .detach(|| {
                let prompt = frontend.prompt_token_ids(&Prompt::TokenIds(prompt))?;
                self.handle.prompt_logits(prompt, step_by_step, adapter)
            })
            .map_err(engine_error)?;
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok((
            PyBytes::new(py, &bytes).unbind(),
            rows,
            logits.len() / rows.max(1),
        ))
    }
}

impl PyEngine {
    /// The adapters `names` name (`None`: the base model), each looked up once.
    fn adapters(&self, names: &[Option<String>]) -> PyResult<Vec<Option<AdapterRef>>> {
        let loras = self.handle.frontend().loras();
        names
            .iter()
            .map(|n| n.as_deref().map(|n| loras.get(n)).transpose())
            .collect::<Result<_, _>>()
            .map_err(engine_error)
    }
}

/// The deltas of one streaming request; closing or dropping it aborts the request.
///
/// `close` never waits: another thread may be blocked in `__next__` holding the stream (an
/// `AsyncLLM` pump thread), so it aborts through its own handle and raises `closed`, which
/// that wait notices within [`SIGNAL_POLL`].
#[pyclass(name = "TokenStream", module = "novainfer._native")]
pub struct PyTokenStream {
    tokenizer: Arc<Tokenizer>,
    stream: Mutex<Option<RequestStream>>,
    abort: AbortHandle,
    closed: AtomicBool,
}

impl PyTokenStream {
    /// Drops the stream if no other thread holds it (that thread drops it when it sees `closed`).
    fn release(&self) {
        match self.stream.try_lock() {
            Ok(mut guard) => drop(guard.take()),
            Err(TryLockError::Poisoned(poisoned)) => drop(poisoned.into_inner().take()),
            Err(TryLockError::WouldBlock) => {}
        }
    }
}

#[pymethods]
impl PyTokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyDelta>> {
        let next = loop {
            if self.closed.load(Ordering::SeqCst) {
                self.release();
                return Ok(None);
            }
            let polled = py.detach(|| {
                let mut guard = self
                    .stream
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                match guard.as_mut() {
                    Some(stream) => stream.next_timeout(SIGNAL_POLL),
                    None => NextDelta::Ended,
                }
            });
            match polled {
                NextDelta::Delta(d) => break d,
                NextDelta::Ended => return Ok(None),
                NextDelta::Pending => py.check_signals()?,
            }
        };
        let d = next.map_err(engine_error)?;
        Ok(Some((
            d.text,
            d.token_ids,
            d.finish_reason.map(|r| r.as_str()),
            (!d.logprobs.is_empty()).then(|| logprobs_to_py(&self.tokenizer, d.logprobs)),
            d.num_cached_tokens,
            d.index,
            stop_reason_to_py(py, d.stop_reason)?,
        )))
    }

    /// Aborts the request now (its KV blocks are freed before the engine's next step) without
    /// waiting; the iterator then ends.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.abort.abort();
        self.release();
    }
}

/// `num / den`, 0 before anything was counted.
fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}
