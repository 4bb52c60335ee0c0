//! Why a tokenizer could not be loaded, built or used. Its own module so that both sources
//! (`tokenizer` for HF directories, `gguf_tokenizer` for GGUF metadata) report through it
//! without importing each other.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load tokenizer from {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{file}: field `{field}` {reason}")]
    Field {
        file: String,
        field: String,
        reason: String,
    },
    #[error("{source_name}: `{field}` names token {token:?}, which is not in the vocabulary")]
    UnknownToken {
        source_name: String,
        field: String,
        token: String,
    },
    #[error("GGUF metadata `{key}`: {reason}")]
    Gguf { key: String, reason: String },
    #[error("GGUF metadata `{key}` = {value:?} is not supported (supported: {supported})")]
    Unsupported {
        key: String,
        value: String,
        supported: String,
    },
    #[error("cannot build tokenizer: {0}")]
    Build(String),
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("cannot decode token ids: {0}")]
    Decode(String),
}
