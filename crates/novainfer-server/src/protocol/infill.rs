//! The body of llama.cpp's `POST /infill`, as editor plugins (llama.vim, llama.vscode) send it:
//! the FIM inputs, the sampling fields of llama.cpp's `/completion` that NovaInfer implements,
//! and the hints those plugins always send. Any other field is refused by name.

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InfillRequest {
    pub model: Option<String>,
    pub input_prefix: Option<String>,
    pub input_suffix: Option<String>,
    pub input_extra: Option<Vec<ExtraChunkIn>>,
    /// Text after the middle token: the start of the middle, already typed.
    pub prompt: Option<String>,
    /// Tokens to generate; -1 (the default): until the context is full.
    pub n_predict: Option<i64>,
    pub temperature: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// -1: a random seed.
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    /// Minimum indentation of lines after the first (see `crate::indent`).
    pub n_indent: Option<i64>,
    /// Stop once this many ms passed since the first token, if a newline has been generated.
    pub t_max_predict_ms: Option<i64>,
    /// Put the generated ids in `tokens` (streams always do).
    pub return_tokens: Option<bool>,
    /// Only these fields in the response; `a/b` takes field `b` of object `a`, named `a/b`.
    pub response_fields: Option<Vec<String>>,
    // Accepted, no effect here (logged once): the prefix cache is always on, sampling has
    // one fixed order, prompt processing has no time limit, and there are no slots.
    pub cache_prompt: Option<bool>,
    pub samplers: Option<Vec<String>>,
    pub t_max_prompt_ms: Option<i64>,
    pub id_slot: Option<i64>,
}

impl InfillRequest {
    pub fn ignored_fields(&self) -> Vec<&'static str> {
        [
            ("cache_prompt", self.cache_prompt.is_some()),
            ("samplers", self.samplers.is_some()),
            ("t_max_prompt_ms", self.t_max_prompt_ms.is_some()),
            ("id_slot", self.id_slot.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
        .collect()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtraChunkIn {
    /// llama.cpp's default: "tmp".
    pub filename: Option<String>,
    pub text: String,
}
