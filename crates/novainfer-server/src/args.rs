//! Command-line arguments of `novainfer-server` (and `novainfer serve`, which passes its
//! arguments through unchanged). Engine options mirror the Python `LLM(...)` keywords.

use std::time::Duration;

use clap::Parser;
use novainfer_core::{KvLayout, ParamError};
use novainfer_engine::{EngineConfig, KvBudget};
use novainfer_model::{
    DeviceChoice, DtypeChoice, GpuWeightDtype, KvCacheDtype, LmHeadDtype, WeightQuantization,
};

pub use crate::reasoning::ReasoningParser;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "novainfer-server",
    version,
    about = "OpenAI-compatible HTTP server (with a Web UI at /) for Qwen2-family models"
)]
pub struct ServeArgs {
    /// HF model directory, .gguf file, or demo-model name (cached by `novainfer fetch`).
    /// Repeat to serve several models; requests pick one by `model`.
    #[arg(long, short = 'm', default_value = "qwen2.5-coder-0.5b")]
    pub model: Vec<String>,
    /// Name clients use in `model`, one per --model in order (default: the demo name, or the
    /// file/directory name).
    #[arg(long)]
    pub served_model_name: Vec<String>,
    /// Address to listen on; 0.0.0.0 serves every interface (set --api-key then).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port; 0 picks a free one (the printed URL shows which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    // Engine options, as in `LLM(...)`.
    /// Where the model runs: auto (the first usable CUDA GPU, else the CPU), cpu, cuda or
    /// cuda:N. An explicit cuda fails with the reason when no GPU can be used.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// On a GPU: the fraction of its memory the engine may use (weights, buffers and KV
    /// cache); the KV cache gets what the weights leave. Ignored on the CPU.
    #[arg(long, default_value_t = novainfer_engine::DEFAULT_GPU_MEMORY_UTILIZATION)]
    pub gpu_memory_utilization: f64,
    /// Weight dtype for safetensors models: auto (each tensor as stored), f32, bf16, f16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Longest prompt + output in tokens (default: the model's context length, on the CPU at
    /// most 8192 so that one prompt cannot hold the engine for minutes; lowered to what the KV
    /// cache can hold).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Base seed: a request without its own seed samples with base + its request number, so
    /// repeated requests differ, and a fresh server replays the same request sequence exactly.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Re-encode a GGUF's Q5_0 tensors as Q8_0 on load (exact; more memory, same speed with
    /// our kernels). Off by default.
    #[arg(long)]
    pub requantize_q5_0: bool,
    /// How the lm_head is stored: auto (as the checkpoint has it, exactly) or q8_0 (a dense
    /// head quantized to 8-bit blocks at load: lossy, and much less to read per token, e.g.
    /// for AWQ/GPTQ checkpoints, which keep it in f16; CPU only).
    #[arg(long, default_value = "auto")]
    pub lm_head_dtype: String,
    /// How a GPU holds quantized matrices (GGUF, AWQ/GPTQ int4, FP8): auto (FP8 kept as FP8, the
    /// rest expanded to bf16), bf16 (all expanded at load) or native (all as the file's blocks,
    /// multiplied in place by decode steps: less memory, fewer bytes a token; unverified on a GPU
    /// so far). Ignored on the CPU.
    #[arg(long, default_value = "auto")]
    pub gpu_weight_dtype: String,
    /// Quantize a dense checkpoint's weights at load (vLLM's flag): fp8 (each decoder linear
    /// layer to e4m3 with a scale per output channel; kept as FP8 on a GPU, run as its dense
    /// values on the CPU). An already quantized checkpoint is refused.
    #[arg(long)]
    pub quantization: Option<String>,
    /// Never replay CUDA graphs for decode steps (vLLM's flag). Graphs are off anyway unless
    /// NOVAINFER_CUDA_GRAPHS=1 opts in, until a GPU run has verified them. Ignored on the CPU.
    #[arg(long)]
    pub enforce_eager: bool,
    /// Schedule each step while the one before it runs, its decodes fed the tokens that one
    /// draws (vLLM's flag): the host's work overlaps the GPU's. A request that stops may compute
    /// one extra token, which is dropped. On the CPU rows are then drawn on the device thread
    /// (greedy tokens the same, seeded random ones another stream). Not with speculative decoding.
    #[arg(long)]
    pub async_scheduling: bool,
    /// Tokens per KV-cache block (the unit of paging and prefix caching).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size in bytes (default: 2 GiB on the CPU, --gpu-memory-utilization on a GPU).
    #[arg(long, conflicts_with = "kv_cache_fraction")]
    pub kv_cache_bytes: Option<usize>,
    /// KV cache as a fraction of the memory available after loading the model.
    #[arg(long)]
    pub kv_cache_fraction: Option<f64>,
    /// Most sequences decoded in one engine step (the batch; default: 256 on a GPU, 64 on the
    /// CPU, see docs/scheduling.md).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one engine step, decodes and prompt chunks together (default: 2048 on a
    /// GPU; on the CPU 256 x threads within 512..2048, see docs/scheduling.md).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Turn prefix caching off (on by default: prompts sharing a prefix reuse its KV blocks).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// block (paged, prefix caching) or slot (llama.cpp-style cells).
    #[arg(long, default_value = "block")]
    pub kv_layout: String,
    /// How the KV cache stores keys and values: auto (f16 on the CPU, bf16 on a GPU), f32,
    /// f16, bf16 or q8_0 (8-bit blocks with an f16 scale, as llama.cpp; CPU only).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// fcfs, or priority (a request's `priority`: lower runs first, with aging).
    #[arg(long, default_value = "fcfs")]
    pub scheduling_policy: String,
    /// Under --scheduling-policy priority, engine steps a waiting request needs to gain one
    /// priority level (so that nothing waits forever).
    #[arg(long, default_value_t = 256)]
    pub priority_aging_steps: usize,
    /// Most tokens of one prompt computed per step (default: none on a GPU; on the CPU
    /// 128 x threads within 256..2048, see docs/scheduling.md).
    #[arg(long)]
    pub long_prefill_token_threshold: Option<usize>,
    /// Most prompts being prefilled at once (default: no limit).
    #[arg(long)]
    pub max_num_partial_prefills: Option<usize>,
    /// Speculative decoding, as vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4,
    /// "prompt_lookup_min": 2, "prompt_lookup_max": 5}'. Outputs stay the same token for token.
    #[arg(long)]
    pub speculative_config: Option<String>,
    /// KV-cache events for prefix-aware routers, as vLLM's JSON: '{"enable_kv_cache_events":
    /// true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
    /// "topic": "kv", "buffer_steps": 10000}'. One --model only.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// How KV-cache events are laid out: map (vLLM's current encoding, `type`-tagged maps) or
    /// array (vLLM's older one, tag-first arrays).
    #[arg(long, value_enum, default_value = "map")]
    pub kv_events_encoding: crate::kv_events::encode::Encoding,
    /// Most prompts longer than --long-prefill-token-threshold prefilled at once; shorter ones
    /// overtake the rest (default: none on a GPU, 1 on the CPU).
    #[arg(long)]
    pub max_long_partial_prefills: Option<usize>,
    /// Serve LoRA adapters, chosen per request by naming one as `model` (vLLM's option;
    /// implied by --lora-modules and --allow-runtime-lora).
    #[arg(long)]
    pub enable_lora: bool,
    /// LoRA adapters to load at start-up: `name=path` (a PEFT directory or a GGUF adapter
    /// file), or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}' to attach
    /// one to a --model other than the first.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// Most distinct adapters among the running requests; requests on another adapter wait.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Largest LoRA rank an adapter may have.
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key).
    #[arg(long, env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING")]
    pub allow_runtime_lora: bool,

    // Serving options.
    /// Requests in the engine at once; more wait in the queue.
    #[arg(long, default_value_t = 256)]
    pub max_concurrent_requests: usize,
    /// Requests waiting for a slot; past this, 429 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Requests rendering a chat template or tokenizing at once (each on a blocking thread);
    /// more wait, up to --max-queued-requests, then 429.
    #[arg(long, default_value_t = 4)]
    pub max_concurrent_tokenize: usize,
    /// Requests scoring their prompt (`echo` with `logprobs`: a forward over the prompt with a
    /// vocabulary row per token) at once; more wait, up to --max-queued-requests, then 429.
    #[arg(long, default_value_t = 1)]
    pub max_concurrent_scoring: usize,
    /// Embedding requests at once (each runs one engine forward per input, between decode
    /// steps); more wait, up to --max-queued-requests, then 429.
    #[arg(long, default_value_t = 1)]
    pub max_concurrent_embeddings: usize,
    /// Largest request body in bytes (413 past it).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Require `Authorization: Bearer <key>` on the API (repeatable; also NOVAINFER_API_KEY).
    #[arg(long, env = "NOVAINFER_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// Share weights of the API keys, in --api-key order (default 1 each): under load each
    /// key gets permits and engine seats in proportion to its weight.
    #[arg(long, value_delimiter = ',')]
    pub tenant_weights: Vec<u32>,
    /// Requests one tenant (an API key; the `user` field when keys are off) may have queued;
    /// past it, 429 `tenant_queue_full` (default: only --max-queued-requests applies).
    #[arg(long)]
    pub max_queued_requests_per_tenant: Option<usize>,
    /// Tokens (prompt + completion) each user may spend per --user-budget-window.
    #[arg(long)]
    pub user_token_budget: Option<u64>,
    /// Seconds over which --user-token-budget is counted.
    #[arg(long, default_value_t = 3600)]
    pub user_budget_window: u64,
    /// Users whose spending is remembered; past this the least recently charged are
    /// forgotten (and start a fresh window).
    #[arg(long, default_value_t = 100_000)]
    pub max_budget_users: usize,
    /// Allow cross-origin requests from these origins (`*` for any). Off by default.
    #[arg(long)]
    pub cors_allow_origin: Vec<String>,
    /// Longest a request may take in seconds, queueing included (0: no limit). A request's
    /// own `timeout` field can only lower it.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Sessions idle this many seconds are forgotten.
    #[arg(long, default_value_t = 1800)]
    pub session_ttl: u64,
    /// Most sessions remembered; past it the least recently used is forgotten.
    #[arg(long, default_value_t = 10_000)]
    pub max_sessions: usize,
    /// Stored Responses (`/v1/responses`, for `previous_response_id` and `GET`) older than this
    /// many seconds are forgotten.
    #[arg(long, default_value_t = 3600)]
    pub stored_response_ttl: u64,
    /// Most stored Responses kept; past it the oldest is dropped (0 stores none).
    #[arg(long, default_value_t = 1000)]
    pub max_stored_responses: usize,
    /// Most bytes of text the stored Responses may hold together (each keeps its whole
    /// conversation); past it the oldest is dropped.
    #[arg(long, default_value_t = 256 << 20)]
    pub max_stored_response_bytes: usize,
    /// Seconds between SSE keep-alive comments.
    #[arg(long, default_value_t = 15.0)]
    pub keep_alive: f64,
    /// How `<think>` reasoning is split from the answer into `reasoning_content`.
    #[arg(long, value_enum, default_value_t = ReasoningParser::Auto)]
    pub reasoning_parser: ReasoningParser,

    // Connection hardening.
    /// Seconds a client may take to send a request's headers; slower connections are closed.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout: f64,
    /// Seconds a client may take to send a request's body (408 past it).
    #[arg(long, default_value_t = 60.0)]
    pub body_read_timeout: f64,
    /// Seconds a kept-alive connection may sit idle between requests before it is closed.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// Open connections at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 2048)]
    pub max_connections: usize,
    /// Accept only requests whose Host header names one of these hosts (guards against DNS
    /// rebinding; comma-separated or repeated). Off by default.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,

    // Liveness and shutdown.
    /// Keep serving (health 503) when a model's engine thread dies, instead of draining and
    /// exiting non-zero so a supervisor restarts the server.
    #[arg(long)]
    pub no_exit_on_engine_failure: bool,
    /// Seconds running requests get to finish after SIGTERM/SIGINT before they are aborted.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace: f64,
}

/// Longest timeout accepted anywhere (a week): far beyond any sane value, far below what
/// would overflow `Instant` arithmetic.
pub const MAX_TIMEOUT_SECS: f64 = 7.0 * 24.0 * 3600.0;

/// The env var that also sets `--api-key`.
pub const API_KEY_ENV: &str = "NOVAINFER_API_KEY";

/// One `--lora-modules` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraModule {
    pub name: String,
    pub path: std::path::PathBuf,
    /// The served model it belongs to (`None`: the first).
    pub base_model_name: Option<String>,
}

impl LoraModule {
    /// `name=path`, or vLLM's JSON object with `name`, `path` and optional `base_model_name`.
    pub fn parse(spec: &str) -> Result<Self, ArgsError> {
        let bad = |why: String| ArgsError::from(ParamError::new("lora_modules", why));
        if spec.trim_start().starts_with('{') {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Json {
                name: String,
                path: std::path::PathBuf,
                base_model_name: Option<String>,
            }
            let j: Json = serde_json::from_str(spec).map_err(|e| bad(format!("{spec}: {e}")))?;
            return Ok(Self {
                name: j.name,
                path: j.path,
                base_model_name: j.base_model_name,
            });
        }
        match spec.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(Self {
                name: name.to_owned(),
                path: path.into(),
                base_model_name: None,
            }),
            _ => Err(bad(format!(
                "{spec:?} is neither name=path nor a JSON object with name and path"
            ))),
        }
    }
}

/// Argument values clap cannot check on its own.
#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    #[error("{0}")]
    Param(#[from] ParamError),
    #[error("--served-model-name given {names} times for {models} --model values")]
    NameCount { names: usize, models: usize },
    #[error(transparent)]
    Key(#[from] crate::keys::KeyError),
    #[error(
        "{API_KEY_ENV} is set but empty: unset it to serve without keys, or give --api-key KEY"
    )]
    EmptyKeyEnv,
    #[error(transparent)]
    KvEvents(#[from] crate::kv_events::KvEventsConfigError),
    #[error("--kv-events-config publishes one engine's events: serve one --model with it")]
    KvEventsModels,
    #[error("--{flag} must be {what}, got {value}")]
    Range {
        flag: &'static str,
        what: &'static str,
        value: String,
    },
}

impl ServeArgs {
    /// Every check of the options that clap's types cannot express.
    // Long: a flat list of independent checks, each a few lines, kept together so all of
    // `serve`'s cross-option rules are read in one place.
    pub fn check(&self) -> Result<(), ArgsError> {
        if !self.served_model_name.is_empty() && self.served_model_name.len() != self.model.len() {
            return Err(ArgsError::NameCount {
                names: self.served_model_name.len(),
                models: self.model.len(),
            });
        }
        let positive = |flag, ok: bool, value: String| {
            if ok {
                Ok(())
            } else {
                Err(ArgsError::Range {
                    flag,
                    what: "positive",
                    value,
                })
            }
        };
        positive(
            "max-concurrent-requests",
            self.max_concurrent_requests > 0,
            self.max_concurrent_requests.to_string(),
        )?;
        for (flag, value) in [
            ("max-concurrent-tokenize", self.max_concurrent_tokenize),
            ("max-concurrent-scoring", self.max_concurrent_scoring),
            ("max-concurrent-embeddings", self.max_concurrent_embeddings),
        ] {
            positive(flag, value > 0, value.to_string())?;
        }
        positive(
            "max-body-bytes",
            self.max_body_bytes > 0,
            self.max_body_bytes.to_string(),
        )?;
        positive(
            "user-budget-window",
            self.user_budget_window > 0,
            self.user_budget_window.to_string(),
        )?;
        if !(self.request_timeout.is_finite()
            && (0.0..=MAX_TIMEOUT_SECS).contains(&self.request_timeout))
        {
            return Err(ArgsError::Range {
                flag: "request-timeout",
                what: "a number of seconds in [0, 604800]",
                value: self.request_timeout.to_string(),
            });
        }
        for (flag, value) in [
            ("keep-alive", self.keep_alive),
            ("header-read-timeout", self.header_read_timeout),
            ("body-read-timeout", self.body_read_timeout),
            ("idle-timeout", self.idle_timeout),
        ] {
            seconds(flag, value, false)?;
        }
        seconds("shutdown-grace", self.shutdown_grace, true)?;
        positive(
            "max-connections",
            self.max_connections > 0,
            self.max_connections.to_string(),
        )?;
        positive(
            "max-budget-users",
            self.max_budget_users > 0,
            self.max_budget_users.to_string(),
        )?;
        if self.kv_events()?.is_some() && self.model.len() > 1 {
            return Err(ArgsError::KvEventsModels);
        }
        if let Some(host) = self.allowed_hosts.iter().find(|h| h.trim().is_empty()) {
            return Err(ArgsError::Range {
                flag: "allowed-hosts",
                what: "a list of non-empty host names",
                value: format!("{host:?}"),
            });
        }
        if !self.tenant_weights.is_empty() && self.tenant_weights.len() != self.api_key.len() {
            return Err(ArgsError::Range {
                flag: "tenant-weights",
                what: "one weight per --api-key, in the same order",
                value: format!(
                    "{} weights for {} keys",
                    self.tenant_weights.len(),
                    self.api_key.len()
                ),
            });
        }
        if let Some(w) = self.tenant_weights.iter().find(|&&w| w == 0) {
            return Err(ArgsError::Range {
                flag: "tenant-weights",
                what: "a list of positive integers",
                value: w.to_string(),
            });
        }
        if let Some(n) = self.max_queued_requests_per_tenant {
            positive("max-queued-requests-per-tenant", n > 0, n.to_string())?;
        }
        self.check_api_keys(std::env::var_os(API_KEY_ENV).as_deref())
    }

    /// clap treats an empty env var as unset, which would silently turn keys off: an empty
    /// `NOVAINFER_API_KEY` (an unset shell variable expanded, say) is an error instead, as is
    /// an empty key in the list (`--api-key ''`, a trailing comma).
    fn check_api_keys(&self, env: Option<&std::ffi::OsStr>) -> Result<(), ArgsError> {
        if self.api_key.is_empty() && env.is_some_and(|v| v.to_string_lossy().trim().is_empty()) {
            return Err(ArgsError::EmptyKeyEnv);
        }
        Ok(crate::keys::check_keys(&self.api_key)?)
    }
}

/// A flag in seconds: finite, at most a week, and positive (or, with `zero_ok`, >= 0).
fn seconds(flag: &'static str, value: f64, zero_ok: bool) -> Result<(), ArgsError> {
    let low_ok = if zero_ok { value >= 0.0 } else { value > 0.0 };
    if value.is_finite() && low_ok && value <= MAX_TIMEOUT_SECS {
        Ok(())
    } else {
        Err(ArgsError::Range {
            flag,
            what: if zero_ok {
                "a number of seconds in [0, 604800]"
            } else {
                "a number of seconds in (0, 604800]"
            },
            value: value.to_string(),
        })
    }
}

impl ServeArgs {
    /// `--kv-events-config`, parsed; `None` when absent or off.
    pub fn kv_events(&self) -> Result<Option<crate::kv_events::KvEventsConfig>, ArgsError> {
        match &self.kv_events_config {
            Some(json) => Ok(crate::kv_events::KvEventsConfig::parse(json)?),
            None => Ok(None),
        }
    }

    pub fn engine_config(&self, model: std::path::PathBuf) -> Result<EngineConfig, ArgsError> {
        let dtype = DtypeChoice::parse(&self.dtype).map_err(|_| {
            ParamError::new(
                "dtype",
                format!("must be one of auto, f32, bf16, f16; got {:?}", self.dtype),
            )
        })?;
        let kv_layout: KvLayout = self.kv_layout.parse()?;
        let kv_cache_dtype = KvCacheDtype::parse(&self.kv_cache_dtype).map_err(|_| {
            ParamError::new(
                "kv_cache_dtype",
                format!(
                    "must be one of auto, f32, f16, bf16, q8_0; got {:?}",
                    self.kv_cache_dtype
                ),
            )
        })?;
        let lm_head_dtype = LmHeadDtype::parse(&self.lm_head_dtype).map_err(|_| {
            ParamError::new(
                "lm_head_dtype",
                format!("must be auto or q8_0; got {:?}", self.lm_head_dtype),
            )
        })?;
        let gpu_weight_dtype = GpuWeightDtype::parse(&self.gpu_weight_dtype).map_err(|_| {
            ParamError::new(
                "gpu_weight_dtype",
                format!(
                    "must be auto, bf16 or native; got {:?}",
                    self.gpu_weight_dtype
                ),
            )
        })?;
        let quantization = match self.quantization.as_deref() {
            None => WeightQuantization::None,
            Some(q) => WeightQuantization::parse(q)
                .map_err(|_| ParamError::new("quantization", format!("must be fp8; got {q:?}")))?,
        };
        let kv_cache = match (self.kv_cache_bytes, self.kv_cache_fraction) {
            (_, Some(f)) => KvBudget::FractionOfAvailable(f),
            (Some(b), None) => KvBudget::Bytes(b),
            (None, None) => KvBudget::Auto,
        };
        let device: DeviceChoice = self.device.parse().map_err(|_| {
            ParamError::new(
                "device",
                format!(
                    "must be one of {}; got {:?}",
                    novainfer_model::device::DEVICE_SPELLINGS,
                    self.device
                ),
            )
        })?;
        let mut cfg = EngineConfig::new(model);
        cfg.device = device;
        cfg.gpu_memory_utilization = self.gpu_memory_utilization;
        cfg.dtype = dtype;
        cfg.max_model_len = self.max_model_len;
        cfg.seed = self.seed;
        cfg.requantize_q5_0 = self.requantize_q5_0;
        cfg.lm_head_dtype = lm_head_dtype;
        cfg.gpu_weight_dtype = gpu_weight_dtype;
        cfg.quantization = quantization;
        cfg.enforce_eager = self.enforce_eager;
        cfg.async_scheduling = self.async_scheduling;
        cfg.block_size = self.block_size;
        cfg.kv_layout = kv_layout;
        cfg.kv_cache_dtype = kv_cache_dtype;
        cfg.kv_cache = kv_cache;
        cfg.max_num_seqs = self.max_num_seqs;
        cfg.max_num_batched_tokens = self.max_num_batched_tokens;
        // A server's steps stay short: streams wait for each (the GPU's serving budget).
        cfg.usage = novainfer_engine::Usage::Serving;
        cfg.enable_prefix_caching = !self.no_enable_prefix_caching;
        cfg.scheduling_policy = self.scheduling_policy.parse()?;
        cfg.priority_aging_steps = self.priority_aging_steps;
        cfg.long_prefill_token_threshold = self.long_prefill_token_threshold;
        cfg.max_num_partial_prefills = self.max_num_partial_prefills;
        cfg.max_long_partial_prefills = self.max_long_partial_prefills;
        cfg.speculative = self
            .speculative_config
            .as_deref()
            .map(|json| {
                let value: serde_json::Value = serde_json::from_str(json)
                    .map_err(|e| ParamError::new("speculative_config", format!("not JSON: {e}")))?;
                novainfer_engine::speculative::SpeculativeConfig::from_json(&value)
            })
            .transpose()?;
        Ok(cfg)
    }

    /// `--lora-modules`, parsed.
    pub fn lora_modules(&self) -> Result<Vec<LoraModule>, ArgsError> {
        self.lora_modules
            .iter()
            .map(|m| LoraModule::parse(m))
            .collect()
    }

    /// The LoRA options of served model `name` (`first`: the first --model, which takes the
    /// adapters that name no base); `None` when LoRA is off.
    pub fn lora_config(
        &self,
        name: &str,
        first: bool,
    ) -> Result<Option<novainfer_engine::LoraConfig>, ArgsError> {
        let modules = self.lora_modules()?;
        if !self.enable_lora && modules.is_empty() && !self.allow_runtime_lora {
            return Ok(None);
        }
        let modules = modules
            .into_iter()
            .filter(|m| match &m.base_model_name {
                Some(base) => base == name,
                None => first,
            })
            .map(|m| (m.name, m.path))
            .collect();
        Ok(Some(novainfer_engine::LoraConfig {
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            modules,
        }))
    }

    /// The server-wide timeout, if any.
    pub fn timeout(&self) -> Option<Duration> {
        (self.request_timeout > 0.0).then(|| Duration::from_secs_f64(self.request_timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> ServeArgs {
        ServeArgs::try_parse_from(std::iter::once("novainfer-server").chain(args.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn defaults_and_engine_config() {
        let a = parse(&[]);
        assert_eq!(a.model, vec!["qwen2.5-coder-0.5b"]);
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 8000));
        a.check().expect("defaults are valid");
        let cfg = a.engine_config("/m".into()).expect("valid");
        assert!(cfg.enable_prefix_caching);
        // The device's rule fills these in once it is known.
        assert_eq!((cfg.max_num_seqs, cfg.max_num_batched_tokens), (None, None));
        assert_eq!(cfg.usage, novainfer_engine::Usage::Serving);
        assert_eq!(cfg.device, DeviceChoice::Auto);
        assert_eq!(cfg.kv_cache, KvBudget::Auto);
        assert_eq!(cfg.gpu_memory_utilization, 0.9);
        assert!(!cfg.async_scheduling);
        let cfg = parse(&["--async-scheduling"])
            .engine_config("/m".into())
            .expect("valid");
        assert!(cfg.async_scheduling);
    }

    #[test]
    fn device_options_reach_the_engine_config() {
        let cfg = parse(&["--device", "cuda:1", "--gpu-memory-utilization", "0.5"])
            .engine_config("/m".into())
            .expect("valid");
        assert_eq!(
            cfg.device,
            DeviceChoice::Exactly(novainfer_model::Device::Cuda(1))
        );
        assert_eq!(cfg.gpu_memory_utilization, 0.5);
        let err = parse(&["--device", "tpu"])
            .engine_config("/m".into())
            .expect_err("unknown device");
        assert!(err.to_string().contains("device"), "{err}");
    }

    #[test]
    fn kv_cache_dtype_reaches_the_engine_config() {
        assert_eq!(
            parse(&[])
                .engine_config("/m".into())
                .expect("valid")
                .kv_cache_dtype,
            KvCacheDtype::Auto
        );
        let cfg = parse(&["--kv-cache-dtype", "q8_0"])
            .engine_config("/m".into())
            .expect("valid");
        assert_eq!(cfg.kv_cache_dtype.as_str(), "q8_0");
        let err = parse(&["--kv-cache-dtype", "fp8"])
            .engine_config("/m".into())
            .expect_err("unknown dtype");
        assert!(err.to_string().contains("kv_cache_dtype"), "{err}");
    }

    #[test]
    fn lm_head_dtype_reaches_the_engine_config() {
        let dtype = |args: &[&str]| {
            parse(args)
                .engine_config("/m".into())
                .map(|c| c.lm_head_dtype)
        };
        assert_eq!(dtype(&[]).expect("valid"), LmHeadDtype::Auto);
        let q8 = dtype(&["--lm-head-dtype", "q8_0"]).expect("valid");
        assert_eq!(q8, LmHeadDtype::Q8_0);
        let err = dtype(&["--lm-head-dtype", "f8"]).expect_err("unknown dtype");
        assert!(err.to_string().contains("lm_head_dtype"), "{err}");
        let gpu = |args: &[&str]| {
            parse(args)
                .engine_config("/m".into())
                .map(|c| c.gpu_weight_dtype)
        };
        assert_eq!(gpu(&[]).expect("valid"), GpuWeightDtype::Auto);
        let native = gpu(&["--gpu-weight-dtype", "native"]).expect("valid");
        assert_eq!(native, GpuWeightDtype::Native);
        let err = gpu(&["--gpu-weight-dtype", "q4"]).expect_err("unknown dtype");
        assert!(err.to_string().contains("gpu_weight_dtype"), "{err}");
    }

    #[test]
    fn quantization_reaches_the_engine_config() {
        let quant = |args: &[&str]| {
            parse(args)
                .engine_config("/m".into())
                .map(|c| c.quantization)
        };
        assert_eq!(quant(&[]).expect("valid"), WeightQuantization::None);
        let fp8 = quant(&["--quantization", "fp8"]).expect("valid");
        assert_eq!(fp8, WeightQuantization::Fp8);
        let err = quant(&["--quantization", "awq"]).expect_err("unknown");
        assert!(err.to_string().contains("quantization"), "{err}");
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(parse(&["--dtype", "f8"])
            .engine_config("/m".into())
            .is_err());
        assert!(parse(&["--kv-layout", "x"])
            .engine_config("/m".into())
            .is_err());
        assert!(
            parse(&["--model", "a", "--model", "b", "--served-model-name", "x"])
                .check()
                .is_err()
        );
        assert!(parse(&["--max-concurrent-requests", "0"]).check().is_err());
        assert!(ServeArgs::try_parse_from(["s", "--port", "70000"]).is_err());
        assert_eq!(
            parse(&["--reasoning-parser", "deepseek_r1"]).reasoning_parser,
            ReasoningParser::DeepseekR1
        );
    }

    #[test]
    fn empty_api_keys_are_a_start_up_error_naming_the_flag() {
        for argv in [
            &["--api-key", ""][..],
            &["--api-key", "a,"],
            &["--api-key", "a", "--api-key", " "],
        ] {
            let e = parse(argv).check_api_keys(None).expect_err("empty key");
            assert!(e.to_string().contains("--api-key"), "{e}");
        }
        let e = parse(&[])
            .check_api_keys(Some("".as_ref()))
            .expect_err("empty env");
        assert!(e.to_string().contains(API_KEY_ENV), "{e}");
        parse(&["--api-key", "k"])
            .check_api_keys(Some("".as_ref()))
            .expect("the flag wins");
        parse(&[]).check_api_keys(None).expect("no keys");
    }

    #[test]
    fn huge_or_odd_durations_are_refused() {
        for flag in [
            "--request-timeout",
            "--keep-alive",
            "--header-read-timeout",
            "--body-read-timeout",
            "--idle-timeout",
            "--shutdown-grace",
        ] {
            for v in ["1e300", "inf", "NaN", "-1"] {
                let arg = format!("{flag}={v}");
                let e = parse(&[&arg]).check().expect_err(v);
                assert!(e.to_string().contains(&flag[2..]), "{e}");
            }
        }
        parse(&["--shutdown-grace", "0", "--request-timeout", "0"])
            .check()
            .expect("zero allowed there");
        assert!(parse(&["--idle-timeout", "0"]).check().is_err());
        assert!(parse(&["--allowed-hosts", "a,"]).check().is_err());
    }
}
