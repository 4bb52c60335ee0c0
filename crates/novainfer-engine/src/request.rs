//! What goes into and comes out of a generation request.

use std::time::Instant;

use novainfer_core::{FinishReason, Tenant};
use novainfer_model::AdapterRef;

/// How a request runs beside the others: its priority (lower first, under the priority
/// policy; vLLM's `priority`), whose fair share it uses, and the LoRA adapter it runs with
/// (which the scheduler's `max_loras` counts, and which keys its prefix cache).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Scheduling {
    pub priority: i32,
    pub tenant: Tenant,
    /// `None`: the base model.
    pub adapter: Option<AdapterRef>,
}

/// A prompt as text (tokenized by the engine) or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
}

/// Log-probabilities of one generated token: the chosen one and the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// The `logprobs` most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
    /// The chosen token's rank in the raw distribution (1 = most likely); 0 when unknown.
    pub rank: u32,
}

/// What ended a completion with `finish_reason` `stop`, besides EOS (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// One of the request's `stop_token_ids`.
    TokenId(u32),
    /// One of the request's `stop` strings.
    Text(String),
}

/// What speculative decoding did for a request: draft tokens verified, and those confirmed
/// (vLLM's `num_draft_tokens` / `num_accepted_tokens`). Sums over the steps of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Speculation {
    pub num_draft_tokens: usize,
    pub num_accepted_tokens: usize,
}

impl std::ops::AddAssign for Speculation {
    fn add_assign(&mut self, other: Self) {
        self.num_draft_tokens += other.num_draft_tokens;
        self.num_accepted_tokens += other.num_accepted_tokens;
    }
}

/// What one step added to a request's output.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Delta {
    /// Which of the request's `n` completions this delta extends (0 when `n == 1`).
    pub index: usize,
    /// New text, safe to display: whole UTF-8 characters, no part of a stop string.
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the last delta of a request.
    pub finish_reason: Option<FinishReason>,
    /// With `finish_reason` `stop`: the stop string or stop token id that ended it (`None`: EOS).
    pub stop_reason: Option<StopReason>,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub num_cached_tokens: usize,
    /// When the engine first scheduled the request (the end of its queueing and the start of
    /// its prefill); set on deltas that carry tokens.
    pub scheduled_at: Option<Instant>,
    /// The verification that produced this delta's tokens (zero without a draft).
    pub speculation: Speculation,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub prompt_token_ids: Vec<u32>,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Present when the request asked for logprobs.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: FinishReason,
    /// The stop string or stop token id that ended it, if one did.
    pub stop_reason: Option<StopReason>,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: usize,
    /// Draft tokens verified for this completion, and those confirmed.
    pub speculation: Speculation,
}

impl RequestOutput {
    /// Folds the deltas of a request of `n` completions into one output per
    /// completion, in `index` order.
    pub fn per_completion(
        prompt_token_ids: &[u32],
        wants_logprobs: bool,
        n: usize,
        deltas: impl IntoIterator<Item = Delta>,
    ) -> Vec<Self> {
        let mut split: Vec<Vec<Delta>> = (0..n).map(|_| Vec::new()).collect();
        for d in deltas {
            if let Some(bucket) = split.get_mut(d.index) {
                bucket.push(d);
            }
        }
        split
            .into_iter()
            .map(|ds| Self::from_deltas(prompt_token_ids.to_vec(), wants_logprobs, ds))
            .collect()
    }

    /// Folds the deltas of one completion into its final output.
    pub fn from_deltas(
        prompt_token_ids: Vec<u32>,
        wants_logprobs: bool,
        deltas: impl IntoIterator<Item = Delta>,
    ) -> Self {
        let mut out = RequestOutput {
            prompt_token_ids,
            text: String::new(),
            token_ids: Vec::new(),
            logprobs: wants_logprobs.then(Vec::new),
            finish_reason: FinishReason::Abort,
            stop_reason: None,
            num_cached_tokens: 0,
            speculation: Speculation::default(),
        };
        for d in deltas {
            out.text.push_str(&d.text);
            out.token_ids.extend(d.token_ids);
            if let Some(lp) = out.logprobs.as_mut() {
                lp.extend(d.logprobs);
            }
            if let Some(reason) = d.finish_reason {
                out.finish_reason = reason;
                out.stop_reason = d.stop_reason;
            }
            out.num_cached_tokens = d.num_cached_tokens;
            out.speculation += d.speculation;
        }
        out
    }
}
