//! Response objects in OpenAI's schema (`text_completion`, `chat.completion`, their stream
//! chunks, `list` of embeddings or models), plus `usage` with cached prompt tokens.

use serde::Serialize;

/// Identifies this build in `system_fingerprint`.
pub const SYSTEM_FINGERPRINT: &str = concat!("novainfer-", env!("CARGO_PKG_VERSION"));

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// What speculative decoding did for a request, in vLLM's metric names; only in replies
/// that had drafts verified.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct SpeculativeUsage {
    pub num_draft_tokens: usize,
    pub num_accepted_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative_decoding: Option<SpeculativeUsage>,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
            speculative_decoding: None,
        }
    }

    /// Adds the draft counts when any draft was verified.
    pub fn with_speculation(mut self, num_draft_tokens: usize, num_accepted_tokens: usize) -> Self {
        self.speculative_decoding = (num_draft_tokens > 0).then_some(SpeculativeUsage {
            num_draft_tokens,
            num_accepted_tokens,
        });
        self
    }
}

/// Completions-style logprobs: parallel lists, one entry per token.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// `None` only for the first token of an echoed prompt.
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's: the stop string or stop token id that ended the choice, else null.
    pub stop_reason: serde_json::Value,
}

#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatMessageOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// A tool call in a message, or a piece of one in a stream chunk: the first piece of a call
/// has its `index`, `id`, `type` and `function.name`; later ones its `index` and more
/// `function.arguments` (a JSON text, split anywhere).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ToolCallOut {
    /// Stream chunks only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct FunctionCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    /// `message` in a response, `delta` in a stream chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessageOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatMessageOut>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's: the stop string or stop token id that ended the choice, else null.
    pub stop_reason: serde_json::Value,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
