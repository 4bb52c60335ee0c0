//! Loading an engine: the model, its tokenizer and chat template (the
//! [`Frontend`]), and the sizing of the KV cache and scheduler.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use novainfer_core::{KvLayout, ParamError, SamplingParams, SchedulerConfig, SchedulingPolicy};
use novainfer_model::device::{self, Resolved};
use novainfer_model::{
    load_weights, Capabilities, Checkpoint, CudaGraphs, DecodeLinear, DeviceChoice, DeviceWeights,
    DtypeChoice, Executor, GemmLibrary, GpuWeightDtype, KvCacheDtype, LmHeadDtype, LoadOptions,
    ModelError, OpenedCheckpoint, PackedGemm, Qwen2Config, StepLimits, WeightQuantization,
    DECODE_LINEAR_ENV, GEMM_ENV, PACKED_GEMM_ENV,
};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::cpu_defaults::CpuDefaults;
use crate::draft_model::DraftModel;
use crate::error::{EngineError, Result};
use crate::gpu_defaults::{GpuDefaults, Usage};
use crate::lora::LoraRegistry;
use crate::request::Prompt;
use crate::speculative::SpeculativeMethod;
use crate::tokenizer::Tokenizer;
use novainfer_structured::{CompiledGrammar, GrammarCompiler};

/// How to load and run a model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model: PathBuf,
    /// Where the forward pass runs; `auto` is the first usable GPU, else the CPU.
    pub device: DeviceChoice,
    pub dtype: DtypeChoice,
    /// Longest prompt + output. Defaults to the model's context length (on the CPU at most
    /// [`crate::cpu_defaults::CPU_MAX_MODEL_LEN`]), lowered to what the KV cache can hold
    /// when that is less.
    pub max_model_len: Option<usize>,
    /// Seeds requests that bring no seed of their own (request `i` gets `seed + i`).
    pub seed: u64,
    pub requantize_q5_0: bool,
    /// How the lm_head is stored: the checkpoint's (`auto`), or Q8_0 (lossy, opt-in; the CPU
    /// only). See [`LmHeadDtype`].
    pub lm_head_dtype: LmHeadDtype,
    /// How a GPU holds quantized matrices (GGUF, AWQ/GPTQ int4, FP8): FP8 as FP8 and the rest
    /// expanded to bf16 (`auto`, the default), all expanded (`bf16`), or all as the file's blocks
    /// (`native`; see [`GpuWeightDtype`]). Ignored on the CPU.
    pub gpu_weight_dtype: GpuWeightDtype,
    /// Weights quantized at load (vLLM's `quantization`): none, or `fp8` decoder layers of a
    /// dense checkpoint ([`WeightQuantization`]).
    pub quantization: WeightQuantization,
    /// Never replay CUDA graphs (vLLM's `enforce_eager`). Graphs are also off unless
    /// `NOVAINFER_CUDA_GRAPHS=1` opts in, until a GPU run has verified them; the CPU has
    /// none and ignores this.
    pub enforce_eager: bool,
    /// Schedule each step while the one before it runs (vLLM's `async_scheduling`): the next
    /// step's decodes take the tokens the running one draws, so the host's scheduling and
    /// output handling overlap the device's work. A backend that samples nothing itself (the
    /// CPU) has its rows drawn on its device thread ([`crate::host_draws`]): greedy tokens are the
    /// same, seeded random ones a different stream. A request that stops may compute one extra
    /// token, which is dropped. A step whose sampled rows need the host (penalties, grammars,
    /// `n > 1`'s shared first row) is followed in order, and the option does not combine with
    /// speculative decoding.
    pub async_scheduling: bool,
    /// Tokens per KV block (BLOCK layout; the SLOT layout always uses 1).
    pub block_size: usize,
    /// BLOCK (paged blocks, prefix caching) or SLOT (one cell per token, no
    /// prefix caching; CPU only). Same outputs either way.
    pub kv_layout: KvLayout,
    /// How the KV cache stores keys and values (vLLM's `kv_cache_dtype`): `auto` is f16 on
    /// the CPU and bf16 on a GPU (which supports no other); f32, bf16 and q8_0 on the CPU.
    pub kv_cache_dtype: KvCacheDtype,
    /// Memory for the KV cache.
    pub kv_cache: KvBudget,
    /// On a GPU, the fraction of its total memory the engine may use (weights, activations
    /// and KV pool together), as in vLLM; the KV pool gets what is left of it once the
    /// weights are loaded. Used when `kv_cache` is [`KvBudget::Auto`]; ignored on the CPU.
    pub gpu_memory_utilization: f64,
    /// Most sequences in one step. Unset: the [`GpuDefaults`] rule on a GPU (256), the
    /// [`CpuDefaults`] rule on the CPU (64).
    pub max_num_seqs: Option<usize>,
    /// Token budget of one step (decodes + prefill chunks). Unset: the [`GpuDefaults`] rule on a
    /// GPU (by `usage`), the [`CpuDefaults`] rule on the CPU.
    pub max_num_batched_tokens: Option<usize>,
    /// What the engine is for (vLLM's usage context): it picks a GPU's default step budget.
    pub usage: Usage,
    pub enable_prefix_caching: bool,
    /// FCFS or priority order (vLLM's `scheduling_policy`).
    pub scheduling_policy: SchedulingPolicy,
    /// Under the priority policy, steps a waiting request needs to gain one priority level.
    pub priority_aging_steps: usize,
    /// Most tokens of one prompt computed in a step (vLLM's name). Unset: none on a GPU, the
    /// [`CpuDefaults`] rule on the CPU.
    pub long_prefill_token_threshold: Option<usize>,
    /// Most prompts being prefilled at once (vLLM's name); unset: no limit.
    pub max_num_partial_prefills: Option<usize>,
    /// Most prompts longer than the threshold being prefilled at once (vLLM's name); unset:
    /// none on a GPU, 1 on the CPU.
    pub max_long_partial_prefills: Option<usize>,
    /// Speculative decoding (vLLM's `speculative_config`); `None`: off.
    pub speculative: Option<crate::speculative::SpeculativeConfig>,
    /// Where each step's KV-cache events go (`--kv-events-config`); `None`: none are recorded.
    pub kv_events: Option<std::sync::Arc<dyn novainfer_core::KvEventSink>>,
    /// This process's rank in a tensor-parallel group: reserved (docs/scaling.md); only
    /// the single rank loads today.
    pub tensor_parallel: novainfer_model::TensorParallel,
    /// LoRA adapters per request (vLLM's `--enable-lora`); `None`: off.
    pub lora: Option<crate::lora::LoraConfig>,
}

/// 2 GiB holds 174k tokens of the 0.5B demo model (f16 K/V, the CPU's default) or 74k of a
/// 1.5B one.
pub const DEFAULT_KV_CACHE_BYTES: usize = 2 << 30;

/// vLLM's default share of a GPU's memory.
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// How much memory the KV cache may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// The device's default: [`DEFAULT_KV_CACHE_BYTES`] on the CPU, what
    /// `gpu_memory_utilization` leaves after the weights on a GPU.
    Auto,
    Bytes(usize),
    /// A fraction in (0, 1] of the memory available once the model is loaded
    /// (`MemAvailable` in /proc/meminfo).
    FractionOfAvailable(f64),
}

impl KvBudget {
    /// The user-facing parameter that set this budget, for error messages.
    fn param(self, on_gpu: bool) -> &'static str {
        match self {
            KvBudget::Auto if on_gpu => "gpu_memory_utilization",
            KvBudget::Auto | KvBudget::Bytes(_) => "kv_cache_bytes",
            KvBudget::FractionOfAvailable(_) => "kv_cache_fraction",
        }
    }

    /// Bytes for the KV pool of a model loaded as `weights`.
    fn bytes(self, weights: &dyn DeviceWeights, gpu_memory_utilization: f64) -> Result<usize> {
        let gpu = weights.device_memory()?;
        match (self, gpu) {
            (KvBudget::Bytes(n), Some(mem)) => gpu_fixed_kv_bytes(mem, n),
            (KvBudget::Bytes(n), None) => Ok(n),
            (KvBudget::Auto, None) => Ok(DEFAULT_KV_CACHE_BYTES),
            (KvBudget::Auto, Some(mem)) => gpu_kv_bytes(mem, gpu_memory_utilization),
            (KvBudget::FractionOfAvailable(_), Some(_)) => Err(ParamError::new(
                "kv_cache_fraction",
                "sizes the KV cache from host memory; on a GPU use gpu_memory_utilization \
                 (or kv_cache_bytes)",
            )
            .into()),
            (KvBudget::FractionOfAvailable(f), None) => Self::host_fraction(f),
        }
    }

    fn host_fraction(f: f64) -> Result<usize> {
        match f {
            f if f > 0.0 && f <= 1.0 => Ok((available_memory()? as f64 * f) as usize),
            f => Err(
                ParamError::new("kv_cache_fraction", format!("must be in (0, 1], got {f}")).into(),
            ),
        }
    }
}

/// `kv_cache_bytes` on a GPU: refused when it exceeds what is free after the weights and
/// buffers (the pool's allocation would fail with a driver error that names no parameter).
fn gpu_fixed_kv_bytes(mem: novainfer_model::DeviceMemory, bytes: usize) -> Result<usize> {
    if bytes <= mem.free {
        return Ok(bytes);
    }
    Err(ParamError::new(
        "kv_cache_bytes",
        format!(
            "{} MiB asked for the KV cache, but the GPU has {} MiB free after the weights and \
             buffers",
            bytes >> 20,
            mem.free >> 20
        ),
    )
    .into())
}

/// vLLM's rule: the engine may use `utilization` of the GPU's total memory; what is in use
/// now (the weights and preallocated buffers, and anything else on the GPU) is already
/// spent, and the KV pool gets the rest.
fn gpu_kv_bytes(mem: novainfer_model::DeviceMemory, utilization: f64) -> Result<usize> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(ParamError::new(
            "gpu_memory_utilization",
            format!("must be in (0, 1], got {utilization}"),
        )
        .into());
    }
    let allowed = (mem.total as f64 * utilization) as usize;
    let used = mem.total.saturating_sub(mem.free);
    match allowed.checked_sub(used) {
        Some(rest) if rest > 0 => Ok(rest),
        _ => Err(ParamError::new(
            "gpu_memory_utilization",
            format!(
                "{utilization} of the GPU's {} MiB is {} MiB, but {} MiB are already in use \
                 (the weights and buffers, and other processes); raise it, or set kv_cache_bytes",
                mem.total >> 20,
                allowed >> 20,
                used >> 20
            ),
        )
        .into()),
    }
}

/// Bytes the OS could give us now without swapping.
fn available_memory() -> Result<usize> {
    let unreadable = |why: String| {
        ParamError::new(
            "kv_cache_fraction",
            format!("cannot read available memory: {why}"),
        )
    };
    let meminfo =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| unreadable(e.to_string()))?;
    let kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .ok_or_else(|| unreadable("no MemAvailable line in /proc/meminfo".into()))?;
    Ok(kib * 1024)
}

impl EngineConfig {
    /// Tokens per pool entry: `block_size`, or 1 for the SLOT layout, whose
    /// cells are one-token blocks (a table is then the sequence's cells).
    pub fn effective_block_size(&self) -> usize {
        match self.kv_layout {
            KvLayout::Block => self.block_size,
            KvLayout::Slot => 1,
        }
    }

    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            device: DeviceChoice::Auto,
            dtype: DtypeChoice::Auto,
            max_model_len: None,
            seed: 0,
            requantize_q5_0: false,
            lm_head_dtype: LmHeadDtype::Auto,
            gpu_weight_dtype: GpuWeightDtype::Auto,
            quantization: WeightQuantization::None,
            enforce_eager: false,
            async_scheduling: false,
            block_size: 16,
            kv_layout: KvLayout::Block,
            kv_cache_dtype: KvCacheDtype::Auto,
            kv_cache: KvBudget::Auto,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            usage: Usage::Offline,
            enable_prefix_caching: true,
            scheduling_policy: SchedulingPolicy::Fcfs,
            priority_aging_steps: 256,
            long_prefill_token_threshold: None,
            max_num_partial_prefills: None,
            max_long_partial_prefills: None,
            speculative: None,
            kv_events: None,
            tensor_parallel: novainfer_model::TensorParallel::single(),
            lora: None,
        }
    }
}

/// End-of-generation tokens that GGUF metadata lists only as control tokens: the
/// HF checkpoints name them in `generation_config.json`, GGUF files do not.
const END_OF_GENERATION_TOKENS: &[&str] = &["<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>"];

/// Everything `EngineCore` runs on, loaded and sized.
pub struct LoadedEngine {
    /// The model and its KV pool on the chosen device.
    pub executor: Box<dyn Executor>,
    /// The device, and why it was chosen (for the log line at start-up).
    pub device: Resolved,
    pub frontend: Frontend,
    pub scheduler: SchedulerConfig,
    pub seed: u64,
    pub speculative: Option<crate::speculative::SpeculativeConfig>,
    /// The draft model, when `speculative` asks for one.
    pub draft: Option<DraftModel>,
    /// See [`EngineConfig::async_scheduling`].
    pub async_scheduling: bool,
}

/// The text side of the engine: tokenizer, chat template and prompt checks.
/// Cheap to clone, so callers tokenize on their own threads, off the step loop.
#[derive(Clone)]
pub struct Frontend {
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    vocab_size: usize,
    max_model_len: usize,
    /// Compiles `structured_outputs` constraints, once per distinct one.
    grammars: Arc<GrammarCompiler>,
    /// The LoRA adapters requests may name (empty, and refusing loads, when LoRA is off).
    loras: Arc<LoraRegistry>,
    /// The model's shape (what adapters are checked against).
    model_config: Arc<Qwen2Config>,
}

impl Frontend {
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The LoRA adapters of this engine.
    pub fn loras(&self) -> &Arc<LoraRegistry> {
        &self.loras
    }

    /// The model's hyper-parameters.
    pub fn model_config(&self) -> &Qwen2Config {
        &self.model_config
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Renders a conversation with the model's chat template, ending with the assistant's turn.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(EngineError::NoChatTemplate)?;
        Ok(template.render(messages, add_generation_prompt, None)?)
    }

    /// Renders a conversation with the options of vLLM's chat requests: `add_generation_prompt`,
    /// `continue_final_message` (the rendered text ends inside the final message, which the
    /// model then continues) and `extra` variables for the template (`chat_template_kwargs`).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        continue_final: bool,
        extra: Option<serde_json::Value>,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(EngineError::NoChatTemplate)?;
        let rendered = template.render(messages, add_generation_prompt, extra)?;
        match messages.last() {
            Some(last) if continue_final => Ok(crate::chat_template::continue_final_message(
                &rendered,
                &last.content,
            )?),
            _ => Ok(rendered),
        }
    }

    /// Token ids of a prompt; text prompts are encoded with the tokenizer's special-token rules.
    pub fn prompt_token_ids(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let ids = match prompt {
            Prompt::Text(text) => self.tokenizer.encode(text, true)?,
            Prompt::TokenIds(ids) => ids.clone(),
        };
        self.check_tokens(&ids)?;
        Ok(ids)
    }

    pub(crate) fn check_tokens(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab_size = self.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(EngineError::PromptTokenOutOfRange { id, vocab_size });
        }
        Ok(())
    }

    /// Checks the input of a prefill-only request (an embedding, a scored prompt): not
    /// empty, every id in the vocabulary, and at most `max_model_len` tokens.
    pub fn check_input(&self, ids: &[u32]) -> Result<()> {
        self.check_tokens(ids)?;
        if ids.len() > self.max_model_len {
            return Err(EngineError::InputTooLong {
                input_tokens: ids.len(),
                max_model_len: self.max_model_len,
            });
        }
        Ok(())
    }

    /// The compiled grammar of the request's constraint, if it has one; a constraint that
    /// cannot compile is an `InvalidParameter` on `structured_outputs` naming the problem.
    /// Compiling can take a while for a large schema the first time: callers run it on their
    /// own thread (the engine thread only clones the result).
    pub(crate) fn compile_structured(
        &self,
        params: &SamplingParams,
    ) -> Result<Option<Arc<CompiledGrammar>>> {
        let Some(spec) = params.structured_output() else {
            return Ok(None);
        };
        self.grammars.compile(spec).map(Some).map_err(|e| {
            EngineError::InvalidParameter(ParamError::new("structured_outputs", e.to_string()))
        })
    }

    /// The grammar compiler (e.g. to check a tool-call grammar a server builds).
    pub fn grammar_compiler(&self) -> &Arc<GrammarCompiler> {
        &self.grammars
    }

    /// How many tokens a request may generate, or why it cannot run at all (through
    /// [`Frontend::check_request`], the one place a generation request is checked).
    pub(crate) fn max_new_tokens(
        &self,
        prompt_len: usize,
        params: &SamplingParams,
    ) -> Result<usize> {
        if let Some(&(id, _)) = params
            .logit_bias()
            .iter()
            .find(|&&(id, _)| id as usize >= self.vocab_size)
        {
            return Err(EngineError::InvalidParameter(ParamError::new(
                "logit_bias",
                format!(
                    "token id {id} is out of range for the vocabulary of {}",
                    self.vocab_size
                ),
            )));
        }
        let room = self.max_model_len.saturating_sub(prompt_len);
        match params.max_tokens() {
            Some(n) if n <= room => Ok(n),
            None if room > 0 => Ok(room),
            requested => Err(EngineError::PromptTooLong {
                prompt_tokens: prompt_len,
                max_tokens: requested.unwrap_or(1),
                max_model_len: self.max_model_len,
            }),
        }
    }
}

impl LoadedEngine {
    /// Loads the model and everything around it, in the order of the steps below: the cheap
    /// argument checks first (a bad argument must not cost a model load), then the device,
    /// tokenizer, weights (and a draft model's), the KV pool's size, the scheduler, and the
    /// executors.
    pub fn load(cfg: &EngineConfig) -> Result<Self> {
        check_arguments(cfg)?;
        let opts = LoadOptions {
            dtype: cfg.dtype,
            requantize_q5_0: cfg.requantize_q5_0,
            lm_head_dtype: cfg.lm_head_dtype,
            gpu_weight_dtype: cfg.gpu_weight_dtype,
            quantization: cfg.quantization,
            kv_cache_dtype: cfg.kv_cache_dtype,
            cuda_graphs: cuda_graphs(cfg)?,
            decode_linear: decode_linear()?,
            packed_gemm: PackedGemm::from_env()
                .map_err(|why| ParamError::new(PACKED_GEMM_ENV, why))?,
        };
        // The GPU context reads this itself; a misspelt value is refused here, before any load.
        GemmLibrary::from_env().map_err(|why| ParamError::new(GEMM_ENV, why))?;
        let opened = Checkpoint::open(&cfg.model)?;
        // max_position_embeddings scaled by the checkpoint's rope_scaling (vLLM's rule).
        let model_max_len = opened.max_model_len();
        let mut resolved = resolve_device(cfg)?;
        let tokenizer = open_tokenizer(&opened, &cfg.model)?;
        let chat_template = open_chat_template(&tokenizer)?;
        let limits = step_limits(cfg, model_max_len);
        let weights = load_target_weights(cfg, &mut resolved, opened, &opts, limits)?;
        let draft_weights = match cfg.speculative.as_ref().map(|s| &s.method) {
            Some(SpeculativeMethod::DraftModel { model }) => Some(load_draft_weights(
                model,
                resolved.device,
                &opts,
                limits,
                &tokenizer,
            )?),
            _ => None,
        };
        // A model in host memory shares the host's cores and memory with everything else:
        // its step and context defaults follow them.
        let cpu = weights
            .capabilities()
            .host_memory
            .then(CpuDefaults::for_this_machine);
        let (num_blocks, max_model_len) = size_kv_cache(
            cfg,
            weights.as_ref(),
            model_max_len,
            cpu.map(|d| d.max_model_len_cap),
            draft_weights.as_ref().map(|(d, _)| d.as_ref()),
        )?;
        let scheduler = scheduler_config(cfg, cpu, num_blocks, max_model_len)?;
        let vocab_size = weights.config().vocab_size;
        let draft = match draft_weights {
            Some((d, draft_max_len)) => Some(draft_model(
                d,
                draft_max_len.min(max_model_len),
                &scheduler,
                vocab_size,
            )?),
            None => None,
        };
        let executor = weights.into_executor(num_blocks, scheduler.block_size())?;
        let loras = lora_registry(cfg, executor.as_ref())?;
        let model_config = executor.config().clone();
        let frontend = Frontend::new(
            tokenizer,
            chat_template,
            vocab_size,
            max_model_len,
            loras,
            model_config,
        );
        Ok(Self {
            executor,
            device: resolved,
            frontend,
            scheduler,
            seed: cfg.seed,
            speculative: cfg.speculative.clone(),
            draft,
            async_scheduling: cfg.async_scheduling,
        })
    }
}

#[cfg(test)]
impl LoadedEngine {
    /// An engine over a test toy `executor` on the CPU, with `tokenizer`, no chat template
    /// and no adapters.
    pub(crate) fn for_tests(
        executor: Box<dyn Executor>,
        tokenizer: Tokenizer,
        scheduler: SchedulerConfig,
        speculative: Option<crate::speculative::SpeculativeConfig>,
        draft: Option<DraftModel>,
    ) -> Self {
        let config = executor.config().clone();
        let vocab = tokenizer.vocab_size();
        let max_model_len = scheduler.max_model_len();
        let loras = LoraRegistry::new(None, config.clone());
        Self {
            executor,
            device: Resolved {
                device: novainfer_model::Device::Cpu,
                reason: "test".into(),
            },
            frontend: Frontend::new(tokenizer, None, vocab, max_model_len, loras, config),
            scheduler,
            seed: 1234,
            speculative,
            draft,
            async_scheduling: false,
        }
    }
}

/// The LoRA registry with `cfg`'s start-up adapters loaded (each checked against the model).
fn lora_registry(cfg: &EngineConfig, executor: &dyn Executor) -> Result<LoraRegistry> {
    let registry = LoraRegistry::new(cfg.lora.as_ref(), executor.config().clone());
    let Some(lora) = &cfg.lora else {
        return Ok(registry);
    };
    check_lora_room(lora, executor.capabilities().adapters, executor.device())?;
    for (name, path) in &lora.modules {
        let info = registry.load(name, path)?;
        tracing::info!(name, path = %path.display(), rank = info.rank, "LoRA adapter loaded");
    }
    Ok(registry)
}

/// Whether a backend that holds `most` adapters per step (0: none) can serve `lora`.
fn check_lora_room(
    lora: &crate::lora::LoraConfig,
    most: usize,
    device: novainfer_model::Device,
) -> Result<()> {
    if most == 0 {
        return Err(ModelError::Unsupported {
            what: "serving LoRA adapters".into(),
            device: device.to_string(),
        }
        .into());
    }
    if lora.max_loras > most {
        return Err(ParamError::new(
            "max_loras",
            format!(
                "{device} holds at most {most} adapters at once, got {}",
                lora.max_loras
            ),
        )
        .into());
    }
    Ok(())
}

/// The checks that need no model: they fail before anything is loaded.
fn check_arguments(cfg: &EngineConfig) -> Result<()> {
    if cfg.block_size == 0 {
        return Err(ParamError::new("block_size", "must be >= 1, got 0").into());
    }
    if let Some(lora) = &cfg.lora {
        lora.check()?;
    }
    if cfg.async_scheduling && cfg.speculative.is_some() {
        return Err(ParamError::new(
            "async_scheduling",
            "does not combine with speculative decoding yet (a draft follows the newest token, \
             which a step scheduled ahead does not know)",
        )
        .into());
    }
    if cfg.tensor_parallel.world_size() > 1 {
        return Err(ParamError::new(
            "tensor_parallel",
            "tensor parallelism is designed (docs/scaling.md) but not implemented yet",
        )
        .into());
    }
    let u = cfg.gpu_memory_utilization;
    if !(u > 0.0 && u <= 1.0) {
        return Err(ParamError::new(
            "gpu_memory_utilization",
            format!("must be in (0, 1], got {u}"),
        )
        .into());
    }
    Ok(())
}

/// The device `cfg.device` names, moved to the CPU under `auto` when an option its backend
/// lacks (the SLOT layout, a KV dtype, LoRA adapters: see [`Capabilities`]) was asked for;
/// an explicit device without one is refused naming the option.
fn resolve_device(cfg: &EngineConfig) -> Result<Resolved> {
    let mut resolved = device::resolve(cfg.device)?;
    let lacks = |resolved: &Resolved| -> Option<(&'static str, String, String)> {
        let caps = Capabilities::of(resolved.device);
        let device = resolved.device;
        if cfg.kv_layout == KvLayout::Slot && !caps.slot_layout {
            return Some((
                "kv_layout",
                format!(
                    "the SLOT layout runs on the CPU only; use kv_layout=\"block\" on {device}, \
                     or device=\"cpu\""
                ),
                "kv_layout=\"slot\" runs on the CPU only".to_owned(),
            ));
        }
        if caps.kv_storage(cfg.kv_cache_dtype).is_none() {
            let dtype = cfg.kv_cache_dtype.as_str();
            let held: Vec<&str> = caps.kv_dtypes.iter().map(|d| d.as_str()).collect();
            let quoted: Vec<String> = held.iter().map(|d| format!("\"{d}\"")).collect();
            return Some((
                "kv_cache_dtype",
                format!(
                    "kv_cache_dtype=\"{dtype}\" runs on the CPU only ({device} stores {}); use \
                     \"auto\" or {} there, or device=\"cpu\"",
                    held.join(", "),
                    quoted.join(" or ")
                ),
                format!("kv_cache_dtype=\"{dtype}\" runs on the CPU only"),
            ));
        }
        if !caps.lm_head_dtypes.contains(&cfg.lm_head_dtype) {
            let dtype = cfg.lm_head_dtype.as_str();
            return Some((
                "lm_head_dtype",
                format!(
                    "lm_head_dtype=\"{dtype}\" runs on the CPU only ({device} holds the lm_head \
                     in bf16); use \"auto\" there, or device=\"cpu\""
                ),
                format!("lm_head_dtype=\"{dtype}\" runs on the CPU only"),
            ));
        }
        if cfg.lora.is_some() && caps.adapters == 0 {
            return Some((
                "enable_lora",
                format!(
                    "this backend runs no LoRA adapters; turn LoRA off on {device}, or use \
                     device=\"cpu\""
                ),
                format!("{device} runs no LoRA adapters"),
            ));
        }
        None
    };
    if let Some((param, message, why)) = lacks(&resolved) {
        if cfg.device != DeviceChoice::Auto {
            return Err(ParamError::new(param, message).into());
        }
        resolved = on_the_cpu(&why);
        // The CPU runs every option: nothing is left to refuse.
        debug_assert!(lacks(&resolved).is_none());
    }
    Ok(resolved)
}

fn open_chat_template(tokenizer: &Tokenizer) -> Result<Option<Arc<ChatTemplate>>> {
    Ok(match tokenizer.chat_template() {
        Some(source) => Some(Arc::new(ChatTemplate::new(
            source,
            tokenizer.bos_token(),
            tokenizer.eos_token(),
        )?)),
        None => None,
    })
}

/// The executor's graph mode: `enforce_eager`, else the opt-in environment variable.
fn cuda_graphs(cfg: &EngineConfig) -> Result<CudaGraphs> {
    CudaGraphs::from_env(cfg.enforce_eager)
        .map_err(|why| ParamError::new("enforce_eager", why).into())
}

/// How the CUDA executor runs decode steps' linear layers: the opt-in environment variable.
fn decode_linear() -> Result<DecodeLinear> {
    DecodeLinear::from_env().map_err(|why| ParamError::new(DECODE_LINEAR_ENV, why).into())
}

/// The largest step a device must size its buffers for; `model_max_len` is the model's
/// context ([`OpenedCheckpoint::max_model_len`]: `max_position_embeddings`, scaled by its RoPE
/// scaling), the most positions a device's RoPE table needs.
fn step_limits(cfg: &EngineConfig, model_max_len: usize) -> StepLimits {
    // Sized before an `auto` device may move the model to the CPU, whose rule never gives more.
    let gpu = GpuDefaults::for_usage(cfg.usage);
    StepLimits {
        max_num_batched_tokens: cfg
            .max_num_batched_tokens
            .unwrap_or(gpu.max_num_batched_tokens),
        max_num_seqs: cfg.max_num_seqs.unwrap_or(gpu.max_num_seqs),
        // An over-long max_model_len is refused once the pool is sized; a device must not
        // size its buffers for it before that.
        max_seq_len: cfg
            .max_model_len
            .unwrap_or(usize::MAX)
            .clamp(1, model_max_len.max(1)),
    }
}

/// The model's weights on `resolved`'s device. `auto` means "the GPU when it can run this
/// model": one it cannot run (a head size without kernels, an f32 override) runs on the CPU,
/// `resolved` says so, and the log says why.
fn load_target_weights(
    cfg: &EngineConfig,
    resolved: &mut Resolved,
    opened: OpenedCheckpoint,
    opts: &LoadOptions,
    limits: StepLimits,
) -> Result<Box<dyn DeviceWeights>> {
    match load_weights(resolved.device, opened, opts, limits) {
        Ok(weights) => Ok(weights),
        Err(e) => match auto_fallback(cfg.device, resolved, &e) {
            Some(why) => {
                *resolved = on_the_cpu(&why);
                let opened = Checkpoint::open(&cfg.model)?;
                Ok(load_weights(resolved.device, opened, opts, limits)?)
            }
            None => Err(e.into()),
        },
    }
}

/// The scheduler's limits: what `cfg` sets, and on the CPU (`cpu`) its rule for the rest
/// (logged, since the operator did not choose them).
fn scheduler_config(
    cfg: &EngineConfig,
    cpu: Option<CpuDefaults>,
    num_blocks: usize,
    max_model_len: usize,
) -> Result<SchedulerConfig> {
    let long_prefill_token_threshold = cfg
        .long_prefill_token_threshold
        .or(cpu.map(|d| d.long_prefill_token_threshold));
    let gpu = GpuDefaults::for_usage(cfg.usage);
    let max_num_batched_tokens = cfg
        .max_num_batched_tokens
        .unwrap_or_else(|| cpu.map_or(gpu.max_num_batched_tokens, |d| d.max_num_batched_tokens));
    let max_num_seqs = cfg
        .max_num_seqs
        .unwrap_or_else(|| cpu.map_or(gpu.max_num_seqs, |d| d.max_num_seqs));
    // The CPU's default long-prefill limit needs the threshold that says what is long.
    let max_long_partial_prefills = cfg.max_long_partial_prefills.or(cpu
        .filter(|_| long_prefill_token_threshold.is_some())
        .map(|d| d.max_long_partial_prefills));
    match cpu {
        Some(d) => tracing::info!(
            max_model_len,
            explicit_max_model_len = cfg.max_model_len.is_some(),
            cpu_max_model_len_default = d.max_model_len_cap,
            long_prefill_token_threshold,
            max_long_partial_prefills,
            max_num_seqs,
            max_num_batched_tokens,
            "CPU scheduling: unset limits follow the CPU rule (see cpu_defaults.rs); \
             --max-model-len, --long-prefill-token-threshold, --max-num-seqs and \
             --max-num-batched-tokens override it"
        ),
        None => tracing::info!(
            usage = ?cfg.usage,
            max_num_seqs,
            max_num_batched_tokens,
            "GPU scheduling: unset limits follow the GPU rule (see gpu_defaults.rs); \
             --max-num-seqs and --max-num-batched-tokens override it"
        ),
    }
    Ok(SchedulerConfig::builder()
        .kv_layout(cfg.kv_layout)
        .max_num_batched_tokens(max_num_batched_tokens)
        .max_num_seqs(max_num_seqs)
        .max_model_len(max_model_len)
        .block_size(cfg.effective_block_size())
        .num_blocks(num_blocks)
        .enable_prefix_caching(cfg.enable_prefix_caching)
        .policy(cfg.scheduling_policy)
        .priority_aging_steps(cfg.priority_aging_steps)
        .long_prefill_token_threshold(long_prefill_token_threshold)
        .max_num_partial_prefills(cfg.max_num_partial_prefills)
        .max_loras(cfg.lora.as_ref().map(|l| l.max_loras))
        .max_long_partial_prefills(max_long_partial_prefills)
        .build()?)
}

/// The draft model of speculative decoding over a pool of the scheduler's layout (as many
/// blocks, of the same size): its KV lives in the target's blocks
/// ([`crate::draft_model`]). It drafts for sequences shorter than `max_positions`.
fn draft_model(
    draft: Box<dyn DeviceWeights>,
    max_positions: usize,
    scheduler: &SchedulerConfig,
    vocab_size: usize,
) -> Result<DraftModel> {
    let num_blocks = scheduler.num_blocks();
    let executor = draft.into_executor(num_blocks, scheduler.block_size())?;
    tracing::info!(
        draft_kv_bytes = num_blocks * executor.kv_bytes_per_block(),
        "speculative decoding with a draft model: its KV shares the target's blocks"
    );
    Ok(
        DraftModel::new(executor, vocab_size, scheduler.max_num_batched_tokens())
            .with_max_positions(max_positions),
    )
}

impl Frontend {
    pub(crate) fn new(
        tokenizer: Tokenizer,
        chat_template: Option<Arc<ChatTemplate>>,
        vocab_size: usize,
        max_model_len: usize,
        loras: LoraRegistry,
        model_config: Qwen2Config,
    ) -> Self {
        let tokenizer = Arc::new(tokenizer);
        let grammars = {
            let tokenizer = tokenizer.clone();
            Arc::new(GrammarCompiler::new(move || {
                novainfer_structured::vocab::tok_env(tokenizer.inner(), tokenizer.eos_token_ids())
            }))
        };
        Self {
            tokenizer,
            grammars,
            chat_template,
            vocab_size,
            max_model_len,
            loras: Arc::new(loras),
            model_config: Arc::new(model_config),
        }
    }
}

/// The tokenizer a checkpoint ships (a GGUF file's metadata, or a directory's
/// `tokenizer.json`), with every end-of-generation token the checkpoint names.
fn open_tokenizer(opened: &OpenedCheckpoint, path: &Path) -> Result<Tokenizer> {
    let mut tokenizer = match &opened.gguf_metadata {
        Some(metadata) => {
            let mut t = Tokenizer::from_gguf(metadata)?;
            let extra: Vec<u32> = END_OF_GENERATION_TOKENS
                .iter()
                .filter_map(|s| t.token_to_id(s))
                .collect();
            t.extend_eos_token_ids(&extra)?;
            t
        }
        None => Tokenizer::from_hf_dir(path)?,
    };
    tokenizer.extend_eos_token_ids(&opened.config.eos_token_ids)?;
    Ok(tokenizer)
}

/// Loads a draft model on the target's device, after checking that it speaks the target's
/// tokenizer (the same token for every id; the models' vocabularies may differ by padding).
/// Also returns its context ([`OpenedCheckpoint::max_model_len`], RoPE scaling included).
fn load_draft_weights(
    path: &Path,
    device: novainfer_model::Device,
    opts: &LoadOptions,
    limits: StepLimits,
    target_tokenizer: &Tokenizer,
) -> Result<(Box<dyn DeviceWeights>, usize)> {
    let bad = |why: String| -> EngineError {
        ParamError::new(
            "speculative_config",
            format!("model: {}: {why}", path.display()),
        )
        .into()
    };
    let opened = Checkpoint::open(path).map_err(|e| bad(e.to_string()))?;
    let tokenizer = open_tokenizer(&opened, path).map_err(|e| bad(e.to_string()))?;
    if tokenizer.vocab_size() != target_tokenizer.vocab_size() {
        return Err(bad(format!(
            "its tokenizer has {} tokens, the target's {}; a draft model needs the target's \
             tokenizer",
            tokenizer.vocab_size(),
            target_tokenizer.vocab_size()
        )));
    }
    let differs = (0..tokenizer.vocab_size() as u32)
        .find(|&id| tokenizer.id_to_token(id) != target_tokenizer.id_to_token(id));
    if let Some(id) = differs {
        return Err(bad(format!(
            "its tokenizer differs from the target's at token {id} ({:?} vs {:?}); a draft \
             model needs the target's tokenizer",
            tokenizer.id_to_token(id),
            target_tokenizer.id_to_token(id)
        )));
    }
    let max_len = opened.max_model_len();
    let weights = load_weights(device, opened, opts, limits).map_err(|e| bad(e.to_string()))?;
    Ok((weights, max_len))
}

fn on_the_cpu(why: &str) -> Resolved {
    Resolved {
        device: novainfer_model::Device::Cpu,
        reason: format!("device=\"auto\" runs on the CPU: {why}"),
    }
}

/// Why a failed GPU load falls back to the CPU: only under `auto`, and only when the GPU
/// executor does not support the model (a missing kernel, a dtype), never for a broken file
/// or a failing device, which the user must see.
fn auto_fallback(choice: DeviceChoice, resolved: &Resolved, err: &ModelError) -> Option<String> {
    match err {
        ModelError::Unsupported { .. }
            if choice == DeviceChoice::Auto && resolved.device != novainfer_model::Device::Cpu =>
        {
            Some(err.to_string())
        }
        _ => None,
    }
}

/// Blocks that fit in the KV budget, and the `max_model_len` they allow: an
/// explicit `max_model_len` that cannot fit is an error naming both numbers; the
/// default (the model's context length `model_max`, at most `default_cap`) is lowered to what
/// fits. `model_max` is [`OpenedCheckpoint::max_model_len`]: `max_position_embeddings`, or with a
/// `rope_scaling` what vLLM derives (times the factor; `original_max_position_embeddings` times
/// the factor for YaRN).
/// With a `draft` model, a block holds the draft's KV too: its bytes are both models'.
fn size_kv_cache(
    cfg: &EngineConfig,
    weights: &dyn DeviceWeights,
    model_max: usize,
    default_cap: Option<usize>,
    draft: Option<&dyn DeviceWeights>,
) -> Result<(usize, usize)> {
    let model: &Qwen2Config = weights.config();
    let block_size = cfg.effective_block_size();
    let per_block = weights.kv_bytes_per_block(block_size)
        + draft.map_or(0, |d| d.kv_bytes_per_block(block_size));
    let budget = cfg.kv_cache.bytes(weights, cfg.gpu_memory_utilization)?;
    let on_gpu = !weights.capabilities().host_memory;
    let num_blocks = budget / per_block;
    let capacity = num_blocks * block_size;
    let context = if model_max == model.max_position_embeddings {
        format!("max_position_embeddings of {model_max}")
    } else {
        format!(
            "context length of {model_max} (max_position_embeddings {}, scaled by its rope_scaling)",
            model.max_position_embeddings
        )
    };
    let max_model_len = match cfg.max_model_len {
        Some(n) if n < 2 => {
            return Err(ParamError::new("max_model_len", format!("must be >= 2, got {n}")).into())
        }
        Some(n) if n > model_max => {
            return Err(ParamError::new(
                "max_model_len",
                format!("{n} exceeds the model's {context}"),
            )
            .into())
        }
        Some(n) if n > capacity => {
            return Err(ParamError::new(
                cfg.kv_cache.param(on_gpu),
                format!(
                    "a KV cache of {} bytes holds {capacity} tokens ({num_blocks} blocks of {}), \
                     less than max_model_len {n}; raise the budget or lower max_model_len",
                    budget, block_size
                ),
            )
            .into())
        }
        Some(n) => n,
        None => model_max
            .min(capacity)
            .min(default_cap.unwrap_or(usize::MAX)),
    };
    if max_model_len < 2 {
        return Err(ParamError::new(
            cfg.kv_cache.param(on_gpu),
            format!(
                "{} bytes hold no full KV block of {per_block} bytes",
                budget
            ),
        )
        .into());
    }
    Ok((num_blocks, max_model_len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use novainfer_model::DeviceMemory;

    const GIB: usize = 1 << 30;

    #[test]
    fn a_tensor_parallel_group_is_refused_before_loading() {
        let mut cfg = EngineConfig::new("/no/such/model");
        cfg.tensor_parallel = novainfer_model::TensorParallel::new(0, 2).expect("valid rank");
        let Err(e) = LoadedEngine::load(&cfg) else {
            panic!("a group of two must not load");
        };
        assert_eq!(e.param(), Some("tensor_parallel"), "{e}");
    }

    #[test]
    fn auto_falls_back_to_the_cpu_only_for_what_the_gpu_cannot_run() {
        let gpu = Resolved {
            device: novainfer_model::Device::Cuda(0),
            reason: String::new(),
        };
        let unsupported = ModelError::Unsupported {
            what: "head_dim 16".into(),
            device: "cuda:0".into(),
        };
        let why = auto_fallback(DeviceChoice::Auto, &gpu, &unsupported).expect("falls back");
        assert!(why.contains("head_dim 16"), "{why}");
        let explicit = DeviceChoice::Exactly(novainfer_model::Device::Cuda(0));
        assert_eq!(
            auto_fallback(explicit, &gpu, &unsupported),
            None,
            "never for cuda"
        );
        let broken = ModelError::Cuda("cuMemAlloc failed".into());
        assert_eq!(
            auto_fallback(DeviceChoice::Auto, &gpu, &broken),
            None,
            "a failing GPU is shown"
        );
    }

    #[test]
    fn gpu_kv_pool_gets_what_the_utilization_leaves() {
        // 80 GiB GPU, 10 GiB in use after the weights: 0.9 allows 72 GiB, so 62 GiB remain.
        let mem = DeviceMemory {
            free: 70 * GIB,
            total: 80 * GIB,
        };
        let bytes = gpu_kv_bytes(mem, 0.9).expect("fits");
        assert_eq!(bytes, (80.0 * GIB as f64 * 0.9) as usize - 10 * GIB);
    }

    #[test]
    fn gpu_kv_pool_refuses_a_utilization_the_weights_already_exceed() {
        let mem = DeviceMemory {
            free: 10 * GIB,
            total: 80 * GIB,
        };
        let err = gpu_kv_bytes(mem, 0.5).expect_err("70 GiB in use > 40 GiB allowed");
        assert_eq!(err.param(), Some("gpu_memory_utilization"));
        assert!(err.to_string().contains("already in use"), "{err}");
        for bad in [0.0, -0.1, 1.5, f64::NAN] {
            let err = gpu_kv_bytes(mem, bad).expect_err("out of range");
            assert_eq!(err.param(), Some("gpu_memory_utilization"), "{bad}");
        }
    }

    #[test]
    fn a_fixed_gpu_kv_pool_must_fit_the_free_memory() {
        let mem = DeviceMemory {
            free: 10 * GIB,
            total: 80 * GIB,
        };
        assert_eq!(gpu_fixed_kv_bytes(mem, 4 * GIB).expect("fits"), 4 * GIB);
        let err = gpu_fixed_kv_bytes(mem, 16 * GIB).expect_err("16 GiB > 10 GiB free");
        assert_eq!(err.param(), Some("kv_cache_bytes"));
        assert!(err.to_string().contains("10240 MiB free"), "{err}");
    }

    #[test]
    fn max_loras_must_fit_the_backends_adapter_slots() {
        use crate::lora::LoraConfig;
        use novainfer_model::capabilities::{CPU, CUDA, CUDA_ADAPTER_SLOTS};
        let gpu = novainfer_model::Device::Cuda(0);
        let fits = LoraConfig {
            max_loras: CUDA_ADAPTER_SLOTS,
            ..LoraConfig::default()
        };
        assert!(check_lora_room(&fits, CUDA.adapters, gpu).is_ok());
        let over = LoraConfig {
            max_loras: CUDA_ADAPTER_SLOTS + 1,
            ..LoraConfig::default()
        };
        let err = check_lora_room(&over, CUDA.adapters, gpu).expect_err("too many");
        assert_eq!(err.param(), Some("max_loras"));
        assert!(check_lora_room(&over, CPU.adapters, novainfer_model::Device::Cpu).is_ok());
        assert!(check_lora_room(&fits, 0, gpu).is_err());
    }

    /// A stand-in device whose memory the test chooses.
    struct FakeGpu(Qwen2Config, DeviceMemory);

    impl DeviceWeights for FakeGpu {
        fn device(&self) -> novainfer_model::Device {
            novainfer_model::Device::Cuda(0)
        }
        fn capabilities(&self) -> Capabilities {
            novainfer_model::capabilities::CUDA
        }
        fn config(&self) -> &Qwen2Config {
            &self.0
        }
        fn kv_bytes_per_block(&self, block_size: usize) -> usize {
            // bf16 K and V.
            2 * 2
                * self.0.num_hidden_layers
                * block_size
                * self.0.num_key_value_heads
                * self.0.head_dim()
        }
        fn device_memory(&self) -> novainfer_model::Result<Option<DeviceMemory>> {
            Ok(Some(self.1))
        }
        fn into_executor(
            self: Box<Self>,
            _: usize,
            _: usize,
        ) -> novainfer_model::Result<Box<dyn Executor>> {
            unreachable!("sizing only")
        }
    }

    fn tiny_config() -> Qwen2Config {
        Qwen2Config {
            vocab_size: 100,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 4096,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    #[test]
    fn a_gpu_sizes_its_pool_from_device_memory_and_refuses_host_fractions() {
        let gpu = FakeGpu(
            tiny_config(),
            DeviceMemory {
                free: GIB,
                total: GIB,
            },
        );
        let mut cfg = EngineConfig::new("/m");
        cfg.gpu_memory_utilization = 0.5;
        let (blocks, max_len) = size_kv_cache(&cfg, &gpu, 4096, None, None).expect("sized");
        assert_eq!(blocks, (GIB / 2) / gpu.kv_bytes_per_block(16));
        assert_eq!(max_len, 4096, "the model's context fits");

        cfg.kv_cache = KvBudget::Bytes(gpu.kv_bytes_per_block(16) * 10);
        assert_eq!(
            size_kv_cache(&cfg, &gpu, 4096, None, None)
                .expect("sized")
                .0,
            10
        );
        // A draft model's KV lives in the same blocks: each costs both models' bytes (here a
        // draft as large as the target, so half the blocks).
        assert_eq!(
            size_kv_cache(&cfg, &gpu, 4096, None, Some(&gpu))
                .expect("sized")
                .0,
            5
        );

        cfg.kv_cache = KvBudget::FractionOfAvailable(0.5);
        let err = size_kv_cache(&cfg, &gpu, 4096, None, None).expect_err("host fraction on a GPU");
        assert_eq!(err.param(), Some("kv_cache_fraction"));
        assert!(err.to_string().contains("gpu_memory_utilization"), "{err}");
    }

    #[test]
    fn a_rope_scaled_context_sets_the_step_limits_and_the_default_max_model_len() {
        // YaRN factor 4 over the 4096 positions the config states: 16384 (what
        // OpenedCheckpoint::max_model_len derives, as vLLM does).
        let scaled = novainfer_model::RopeScaling::Yarn(novainfer_model::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0,
            truncate: true,
        })
        .max_positions(4096);
        assert_eq!(scaled, 16384);
        let mut cfg = EngineConfig::new("/m");
        // The device's RoPE table must cover the scaled context, not max_position_embeddings.
        assert_eq!(step_limits(&cfg, scaled).max_seq_len, 16384);
        cfg.max_model_len = Some(10_000);
        assert_eq!(step_limits(&cfg, scaled).max_seq_len, 10_000);
        cfg.max_model_len = Some(1 << 20);
        assert_eq!(
            step_limits(&cfg, scaled).max_seq_len,
            16384,
            "refused later, never sized for"
        );

        let gpu = FakeGpu(
            tiny_config(),
            DeviceMemory {
                free: 8 * GIB,
                total: 8 * GIB,
            },
        );
        let mut cfg = EngineConfig::new("/m");
        let (_, max_len) = size_kv_cache(&cfg, &gpu, scaled, None, None).expect("sized");
        assert_eq!(max_len, 16384, "the default is the scaled context");
        let (_, max_len) = size_kv_cache(&cfg, &gpu, scaled, Some(8192), None).expect("sized");
        assert_eq!(max_len, 8192, "a default cap still applies");
        cfg.max_model_len = Some(16384);
        assert_eq!(
            size_kv_cache(&cfg, &gpu, scaled, None, None)
                .expect("fits")
                .1,
            16384
        );
        cfg.max_model_len = Some(16385);
        let err =
            size_kv_cache(&cfg, &gpu, scaled, None, None).expect_err("past the scaled context");
        assert_eq!(err.param(), Some("max_model_len"));
        let text = err.to_string();
        assert!(
            text.contains("16384") && text.contains("rope_scaling"),
            "{text}"
        );
        // Unscaled, the message names max_position_embeddings as before.
        cfg.max_model_len = Some(4097);
        let err = size_kv_cache(&cfg, &gpu, 4096, None, None).expect_err("past the context");
        assert!(
            err.to_string().contains("max_position_embeddings of 4096"),
            "{err}"
        );
    }

    #[test]
    fn a_pool_too_small_names_gpu_memory_utilization_on_a_gpu() {
        let gpu = FakeGpu(
            tiny_config(),
            DeviceMemory {
                free: GIB,
                total: GIB,
            },
        );
        let mut cfg = EngineConfig::new("/m");
        cfg.max_model_len = Some(4096);
        cfg.gpu_memory_utilization = 1e-6;
        let err =
            size_kv_cache(&cfg, &gpu, 4096, None, None).expect_err("a kilobyte holds no context");
        assert_eq!(err.param(), Some("gpu_memory_utilization"));
    }

    #[test]
    fn unset_step_limits_follow_the_devices_rule_and_set_ones_win() {
        let limits = |cfg: &EngineConfig, cpu: Option<CpuDefaults>| {
            let s = scheduler_config(cfg, cpu, 1024, 4096).expect("valid");
            (s.max_num_seqs(), s.max_num_batched_tokens())
        };
        let mut cfg = EngineConfig::new("/m");
        // A GPU: vLLM's defaults for GPUs, by usage; the device's buffers hold them.
        assert_eq!(limits(&cfg, None), (256, 8192));
        let sized = step_limits(&cfg, 4096);
        assert_eq!(
            (sized.max_num_seqs, sized.max_num_batched_tokens),
            (256, 8192)
        );
        cfg.usage = Usage::Serving;
        assert_eq!(limits(&cfg, None), (256, 2048));
        // The CPU: its own rule (2 threads: a 512-token budget).
        let cpu = CpuDefaults::for_threads(2);
        assert_eq!(limits(&cfg, Some(cpu)), (64, 512));
        // What the operator sets wins everywhere.
        cfg.max_num_seqs = Some(5);
        cfg.max_num_batched_tokens = Some(300);
        assert_eq!(limits(&cfg, None), (5, 300));
        assert_eq!(limits(&cfg, Some(cpu)), (5, 300));
        let sized = step_limits(&cfg, 4096);
        assert_eq!((sized.max_num_seqs, sized.max_num_batched_tokens), (5, 300));
    }
}
