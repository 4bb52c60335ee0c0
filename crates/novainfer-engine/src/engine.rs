//! Loading an engine: the model, its tokenizer and chat template (the
//! [`Frontend`]), and the sizing of the KV cache and scheduler.

use std::path::PathBuf;
use std::sync::Arc;

use novainfer_core::{KvLayout, ParamError, SamplingParams, SchedulerConfig};
use novainfer_model::{DtypeChoice, LoadOptions, PagedKvCache, Qwen2Config, Qwen2Model};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{EngineError, Result};
use crate::request::Prompt;
use crate::tokenizer::Tokenizer;

/// How to load and run a model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model: PathBuf,
    pub dtype: DtypeChoice,
    /// Longest prompt + output. Defaults to the model's context length, lowered
    /// to what the KV cache can hold when that is less.
    pub max_model_len: Option<usize>,
    /// Seeds requests that bring no seed of their own (request `i` gets `seed + i`).
    pub seed: u64,
    pub requantize_q5_0: bool,
    /// Tokens per KV block (BLOCK layout; the SLOT layout always uses 1).
    pub block_size: usize,
    /// BLOCK (paged blocks, prefix caching) or SLOT (one cell per token, no
    /// prefix caching; CPU only). Same outputs either way.
    pub kv_layout: KvLayout,
    /// Memory for the KV cache.
    pub kv_cache: KvBudget,
    pub max_num_seqs: usize,
    /// Token budget of one step (decodes + prefill chunks).
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
}

/// 2 GiB holds 87k tokens of the 0.5B demo model (f32 K/V) or 37k of a 1.5B one.
pub const DEFAULT_KV_CACHE_BYTES: usize = 2 << 30;

/// How much memory the KV cache may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    Bytes(usize),
    /// A fraction in (0, 1] of the memory available once the model is loaded
    /// (`MemAvailable` in /proc/meminfo).
    FractionOfAvailable(f64),
}

impl KvBudget {
    /// The user-facing parameter that set this budget, for error messages.
    fn param(self) -> &'static str {
        match self {
            KvBudget::Bytes(_) => "kv_cache_bytes",
            KvBudget::FractionOfAvailable(_) => "kv_cache_fraction",
        }
    }

    fn bytes(self) -> Result<usize> {
        match self {
            KvBudget::Bytes(n) => Ok(n),
            KvBudget::FractionOfAvailable(f) if f > 0.0 && f <= 1.0 => {
                Ok((available_memory()? as f64 * f) as usize)
            }
            KvBudget::FractionOfAvailable(f) => Err(ParamError::new(
                "kv_cache_fraction",
                format!("must be in (0, 1], got {f}"),
            )
            .into()),
        }
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
            dtype: DtypeChoice::Auto,
            max_model_len: None,
            seed: 0,
            requantize_q5_0: false,
            block_size: 16,
            kv_layout: KvLayout::Block,
            kv_cache: KvBudget::Bytes(DEFAULT_KV_CACHE_BYTES),
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            enable_prefix_caching: true,
        }
    }
}

/// End-of-generation tokens that GGUF metadata lists only as control tokens: the
/// HF checkpoints name them in `generation_config.json`, GGUF files do not.
const END_OF_GENERATION_TOKENS: &[&str] = &["<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>"];

/// Everything `EngineCore` runs on, loaded and sized.
pub struct LoadedEngine {
    pub model: Qwen2Model,
    pub frontend: Frontend,
    pub kv: PagedKvCache,
    pub scheduler: SchedulerConfig,
    pub seed: u64,
}

/// The text side of the engine: tokenizer, chat template and prompt checks.
/// Cheap to clone, so callers tokenize on their own threads, off the step loop.
#[derive(Clone)]
pub struct Frontend {
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    vocab_size: usize,
    max_model_len: usize,
}

impl Frontend {
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
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

    /// Token ids of a prompt; text prompts are encoded with the tokenizer's special-token rules.
    pub fn prompt_token_ids(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let ids = match prompt {
            Prompt::Text(text) => self.tokenizer.encode(text, true)?,
            Prompt::TokenIds(ids) => ids.clone(),
        };
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab_size = self.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(EngineError::PromptTokenOutOfRange { id, vocab_size });
        }
        Ok(ids)
    }

    /// How many tokens a request may generate, or why it cannot run at all.
    pub fn max_new_tokens(&self, prompt_len: usize, params: &SamplingParams) -> Result<usize> {
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
    pub fn load(cfg: &EngineConfig) -> Result<Self> {
        let opts = LoadOptions {
            dtype: cfg.dtype,
            requantize_q5_0: cfg.requantize_q5_0,
        };
        let loaded = Qwen2Model::load(&cfg.model, &opts)?;
        let mut tokenizer = match &loaded.gguf_metadata {
            Some(metadata) => {
                let mut t = Tokenizer::from_gguf(metadata)?;
                let extra: Vec<u32> = END_OF_GENERATION_TOKENS
                    .iter()
                    .filter_map(|s| t.token_to_id(s))
                    .collect();
                t.extend_eos_token_ids(&extra)?;
                t
            }
            None => Tokenizer::from_hf_dir(&cfg.model)?,
        };
        tokenizer.extend_eos_token_ids(&loaded.model.config().eos_token_ids)?;
        let chat_template = match tokenizer.chat_template() {
            Some(source) => Some(Arc::new(ChatTemplate::new(
                source,
                tokenizer.bos_token(),
                tokenizer.eos_token(),
            )?)),
            None => None,
        };
        let model_cfg = loaded.model.config();
        let (num_blocks, max_model_len) = size_kv_cache(cfg, model_cfg)?;
        let block_size = cfg.effective_block_size();
        let scheduler = SchedulerConfig::builder()
            .kv_layout(cfg.kv_layout)
            .max_num_batched_tokens(cfg.max_num_batched_tokens)
            .max_num_seqs(cfg.max_num_seqs)
            .max_model_len(max_model_len)
            .block_size(block_size)
            .num_blocks(num_blocks)
            .enable_prefix_caching(cfg.enable_prefix_caching)
            .build()?;
        let kv = PagedKvCache::new(model_cfg, num_blocks, block_size);
        let frontend = Frontend {
            tokenizer: Arc::new(tokenizer),
            chat_template,
            vocab_size: model_cfg.vocab_size,
            max_model_len,
        };
        Ok(Self {
            model: loaded.model,
            frontend,
            kv,
            scheduler,
            seed: cfg.seed,
        })
    }
}

/// Blocks that fit in the KV budget, and the `max_model_len` they allow: an
/// explicit `max_model_len` that cannot fit is an error naming both numbers; the
/// default (the model's context length) is lowered to what fits.
fn size_kv_cache(cfg: &EngineConfig, model: &Qwen2Config) -> Result<(usize, usize)> {
    if cfg.block_size == 0 {
        return Err(ParamError::new("block_size", "must be >= 1, got 0").into());
    }
    let block_size = cfg.effective_block_size();
    let per_block = PagedKvCache::bytes_per_block(model, block_size);
    let budget = cfg.kv_cache.bytes()?;
    let num_blocks = budget / per_block;
    let capacity = num_blocks * block_size;
    let model_max = model.max_position_embeddings;
    let max_model_len = match cfg.max_model_len {
        Some(n) if n < 2 => {
            return Err(ParamError::new("max_model_len", format!("must be >= 2, got {n}")).into())
        }
        Some(n) if n > model_max => {
            return Err(ParamError::new(
                "max_model_len",
                format!("{n} exceeds the model's max_position_embeddings of {model_max}"),
            )
            .into())
        }
        Some(n) if n > capacity => {
            return Err(ParamError::new(
                cfg.kv_cache.param(),
                format!(
                    "a KV cache of {} bytes holds {capacity} tokens ({num_blocks} blocks of {}), \
                     less than max_model_len {n}; raise the budget or lower max_model_len",
                    budget, block_size
                ),
            )
            .into())
        }
        Some(n) => n,
        None => model_max.min(capacity),
    };
    if max_model_len < 2 {
        return Err(ParamError::new(
            cfg.kv_cache.param(),
            format!(
                "{} bytes hold no full KV block of {per_block} bytes",
                budget
            ),
        )
        .into());
    }
    Ok((num_blocks, max_model_len))
}
