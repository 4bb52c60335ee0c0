//! The engine: a model, its tokenizer and chat template, and the generation
//! loop for one sequence at a time (continuous batching replaces this loop in
//! the engine-core work; the request/delta types stay).

use std::path::PathBuf;
use std::sync::Arc;

use novainfer_core::SamplingParams;
use novainfer_model::sampler::Sampler;
use novainfer_model::{DtypeChoice, LoadOptions, LogitsFor, Qwen2Config, Qwen2Model};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{EngineError, Result};
use crate::request::{Delta, Prompt};
use crate::sequence::SequenceOutput;
use crate::tokenizer::Tokenizer;

/// How to load and run a model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model: PathBuf,
    pub dtype: DtypeChoice,
    /// Longest prompt + output; defaults to the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Seeds requests that bring no seed of their own (request `i` gets `seed + i`).
    pub seed: u64,
    pub requantize_q5_0: bool,
}

impl EngineConfig {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            dtype: DtypeChoice::Auto,
            max_model_len: None,
            seed: 0,
            requantize_q5_0: false,
        }
    }
}

/// End-of-generation tokens that GGUF metadata lists only as control tokens: the
/// HF checkpoints name them in `generation_config.json`, GGUF files do not.
const END_OF_GENERATION_TOKENS: &[&str] = &["<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>"];

pub struct Engine {
    model: Qwen2Model,
    frontend: Frontend,
    seed: u64,
    num_requests: u64,
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

impl Engine {
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
        let model_max = loaded.model.config().max_position_embeddings;
        let max_model_len = match cfg.max_model_len {
            Some(0) => {
                return Err(
                    novainfer_core::ParamError::new("max_model_len", "must be >= 1, got 0").into(),
                )
            }
            Some(n) if n > model_max => {
                return Err(novainfer_core::ParamError::new(
                    "max_model_len",
                    format!("{n} exceeds the model's max_position_embeddings of {model_max}"),
                )
                .into())
            }
            Some(n) => n,
            None => model_max,
        };
        let frontend = Frontend {
            tokenizer: Arc::new(tokenizer),
            chat_template,
            vocab_size: loaded.model.config().vocab_size,
            max_model_len,
        };
        Ok(Self {
            model: loaded.model,
            frontend,
            seed: cfg.seed,
            num_requests: 0,
        })
    }

    pub fn config(&self) -> &Qwen2Config {
        self.model.config()
    }

    pub fn frontend(&self) -> &Frontend {
        &self.frontend
    }

    /// Generates for one prompt, calling `on_delta` after every token. Returning
    /// `false` from `on_delta` aborts the request (its delta is already delivered).
    pub fn generate(
        &mut self,
        prompt_ids: &[u32],
        params: &SamplingParams,
        mut on_delta: impl FnMut(Delta) -> bool,
    ) -> Result<()> {
        let max_new = self.frontend.max_new_tokens(prompt_ids.len(), params)?;
        let fallback_seed = self.seed.wrapping_add(self.num_requests);
        self.num_requests += 1;
        let mut sampler = Sampler::new(params, prompt_ids, fallback_seed);
        let tokenizer = &self.frontend.tokenizer;
        let mut output = SequenceOutput::new(
            tokenizer.clone(),
            params,
            tokenizer.eos_token_ids(),
            max_new,
        );
        let mut cache = self.model.new_cache(prompt_ids.len() + max_new);
        let mut logits = self
            .model
            .forward(prompt_ids, &mut cache, LogitsFor::LastToken)?;
        loop {
            let sampled = sampler.sample(&mut logits);
            let token = sampled.token_id;
            let delta = output.push(sampled)?;
            let finished = delta.finish_reason.is_some();
            if !on_delta(delta) || finished {
                return Ok(());
            }
            logits = self
                .model
                .forward(&[token], &mut cache, LogitsFor::LastToken)?;
        }
    }

    /// Next-token logits at every prompt position (for checking the model against a
    /// reference): from one prefill, or `step_by_step` through the KV cache like decode.
    pub fn prompt_logits(&self, prompt_ids: &[u32], step_by_step: bool) -> Result<Vec<f32>> {
        let mut cache = self.model.new_cache(prompt_ids.len());
        if !step_by_step {
            return Ok(self
                .model
                .forward(prompt_ids, &mut cache, LogitsFor::AllTokens)?);
        }
        let mut logits = Vec::with_capacity(prompt_ids.len() * self.config().vocab_size);
        for &id in prompt_ids {
            logits.extend(
                self.model
                    .forward(&[id], &mut cache, LogitsFor::LastToken)?,
            );
        }
        Ok(logits)
    }
}
