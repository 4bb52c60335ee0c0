//! The NovaInfer engine: tokenizer and chat templates, continuous batching,
//! streaming text (incremental detokenization, stop strings), and the handle
//! through which other threads submit requests.

pub mod chat_template;
pub mod checked;
pub mod cpu_defaults;
pub mod detokenizer;
pub mod device_thread;
pub mod draft_model;
pub mod draft_policy;
pub mod draft_proposer;
pub mod engine;
pub mod engine_core;
pub mod error;
pub mod fim;
pub mod gguf_tokenizer;
pub mod gpu_defaults;
pub mod handle;
pub mod host_draws;
pub mod lora;
pub mod model_runner;
pub mod ngram_proposer;
pub mod output_processor;
pub mod prefill;
pub mod prompt_scores;
pub mod proposer;
pub mod request;
pub mod request_group;
pub mod sequence;
pub mod spec_config;
pub mod speculative;
pub mod stop;
pub mod tokenizer;
pub mod tokenizer_error;
pub mod verify;

#[cfg(test)]
mod async_scheduling_tests;
#[cfg(test)]
mod device_draw_tests;
#[cfg(test)]
mod draft_engine_tests;
#[cfg(test)]
mod test_support;

pub use chat_template::{ChatMessage, ToolCallMessage};
pub use checked::CheckedRequest;
pub use engine::{
    EngineConfig, Frontend, KvBudget, LoadedEngine, DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
};
pub use engine_core::{EngineCore, EngineStats};
pub use error::{EngineError, Result};
pub use gpu_defaults::Usage;
pub use handle::{AbortHandle, EngineHandle, NextDelta, RequestStream};
pub use lora::{AdapterInfo, LoraConfig, LoraRegistry};
/// Constrained decoding (llguidance): servers build tool-call grammars with
/// `structured::tool_grammar` and pass them as `SamplingParams::structured_output`.
pub use novainfer_structured as structured;
pub use output_processor::DeltaSink;
pub use prefill::{PrefillTask, Reply};
pub use request::{
    Delta, Prompt, RequestOutput, Scheduling, Speculation, StopReason, TokenLogprob,
};
