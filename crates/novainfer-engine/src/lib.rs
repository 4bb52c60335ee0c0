//! The NovaInfer engine: tokenizer and chat templates, the generation loop,
//! streaming text (incremental detokenization, stop strings), and the handle
//! through which other threads submit requests.

pub mod chat_template;
pub mod detokenizer;
pub mod engine;
pub mod error;
pub mod gguf_tokenizer;
pub mod handle;
pub mod request;
pub mod sequence;
pub mod stop;
pub mod tokenizer;

pub use chat_template::ChatMessage;
pub use engine::{Engine, EngineConfig, Frontend};
pub use error::{EngineError, Result};
pub use handle::{EngineHandle, RequestStream};
pub use request::{Delta, Prompt, RequestOutput, TokenLogprob};
