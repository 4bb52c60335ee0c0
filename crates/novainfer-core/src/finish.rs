//! Why a sequence stopped generating.

use std::fmt;

/// The outcome of a finished sequence, with OpenAI's wire names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An EOS token, a stop token id or a stop string ended the sequence.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// The caller aborted the request.
    Abort,
    /// The prompt can never fit (`max_model_len` or the KV pool); nothing was generated.
    Ignored,
}

impl FinishReason {
    /// The name used by the OpenAI API and by `RequestOutput.finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Ignored => "ignored",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
