//! The engine's error type: everything a request or a model load can fail with.

use novainfer_core::ParamError;
use novainfer_model::ModelError;
use thiserror::Error;

use crate::chat_template::ChatTemplateError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("chat template: {0}")]
    ChatTemplate(#[from] ChatTemplateError),
    #[error(transparent)]
    InvalidParameter(#[from] ParamError),
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but the request needs \
         {prompt_tokens} prompt tokens + {max_tokens} max_tokens = {} tokens",
        prompt_tokens + max_tokens
    )]
    PromptTooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    #[error("input of {input_tokens} tokens exceeds max_model_len ({max_model_len})")]
    InputTooLong {
        input_tokens: usize,
        max_model_len: usize,
    },
    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,
    #[error(
        "the model has no chat template; pass a template or use generate() with a plain prompt"
    )]
    NoChatTemplate,
    #[error("token id {id} in the prompt is out of range for the vocabulary of {vocab_size}")]
    PromptTokenOutOfRange { id: u32, vocab_size: usize },
    #[error("the engine thread has stopped")]
    EngineStopped,
    #[error("the request was aborted")]
    Aborted,
    #[error("request ignored: {detail}")]
    Ignored { detail: String },
    #[error("the engine step running this request failed: {message}")]
    StepFailed { message: String },
    #[error("the LoRA adapter `{name}` does not exist")]
    AdapterNotFound { name: String },
    #[error("a LoRA adapter named `{name}` is already loaded")]
    AdapterExists { name: String },
    #[error(
        "LoRA is not enabled for this model (start it with --enable-lora or enable_lora=True)"
    )]
    LoraDisabled,
}

impl EngineError {
    /// The user-facing parameter at fault, for errors caused by one.
    pub fn param(&self) -> Option<&str> {
        match self {
            EngineError::InvalidParameter(e) => Some(e.param),
            EngineError::PromptTooLong { .. } => Some("max_tokens"),
            EngineError::EmptyPrompt
            | EngineError::InputTooLong { .. }
            | EngineError::PromptTokenOutOfRange { .. }
            | EngineError::Ignored { .. } => Some("prompt"),
            EngineError::Model(ModelError::InvalidDtype(_)) => Some("dtype"),
            EngineError::AdapterNotFound { .. } => Some("model"),
            EngineError::AdapterExists { .. } => Some("lora_name"),
            EngineError::Model(ModelError::Adapter { .. }) => Some("lora_path"),
            EngineError::Model(
                ModelError::InvalidDevice(_) | ModelError::DeviceUnavailable { .. },
            ) => Some("device"),
            _ => None,
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
