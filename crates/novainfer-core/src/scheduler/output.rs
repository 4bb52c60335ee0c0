//! What one scheduling step hands to the model runner, and what `update` hands back.

use crate::finish::FinishReason;
use crate::ids::{AdapterId, BlockId, RequestId};
use crate::kv_cache_manager::BlockCopy;

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledRequest {
    pub request_id: RequestId,
    /// Exactly the tokens to compute: prompt ++ output at `start_position..`.
    pub token_ids: Vec<u32>,
    /// The request's `num_computed_tokens` before this step: position of `token_ids[0]`.
    pub start_position: usize,
    /// The request's whole table after this step's allocation; covers every position
    /// up to `start_position + token_ids.len()` (see [`slot_mapping`](crate::slot_mapping::slot_mapping)).
    pub block_table: Vec<BlockId>,
    /// What the model returns for this chunk.
    pub output: ChunkOutput,
    /// The request was preempted and is recomputed from token 0 (drop its model-side state).
    pub is_resumed_from_preemption: bool,
    /// The LoRA adapter the chunk runs with (`None`: the base model).
    pub adapter: Option<AdapterId>,
}

impl ScheduledRequest {
    /// True iff `update` expects sampled tokens for this request.
    pub fn sample(&self) -> bool {
        matches!(self.output, ChunkOutput::Sample | ChunkOutput::Verify)
    }

    /// The draft tokens being verified: every token after the first of a `Verify` chunk.
    pub fn draft_token_ids(&self) -> &[u32] {
        match self.output {
            ChunkOutput::Verify => &self.token_ids[1..],
            _ => &[],
        }
    }
}

/// What the model must return for one scheduled chunk, by the request's kind and
/// whether the chunk reaches its last known token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkOutput {
    /// Nothing: a chunk before the end of a prompt. The step's work is its K/V.
    Nothing,
    /// The last token's logits, to sample the next token.
    Sample,
    /// The last token's final hidden state: the chunk ends an embedding's input.
    Hidden,
    /// Every token's logits: a chunk of a prompt being scored.
    PromptLogits,
    /// Every token's logits for a decode with draft tokens (speculative decoding): the first
    /// token is the request's next one, the rest its draft. `update` then takes the drafts
    /// that the model confirmed followed by one token it sampled (1 to `len` tokens).
    Verify,
}

/// A request that left the scheduler since the previous step.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedRequest {
    pub request_id: RequestId,
    pub reason: FinishReason,
    /// Why, for `Ignored` (the prompt can never fit).
    pub detail: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    /// Running requests first (in running order), then newly admitted ones (FCFS).
    pub scheduled: Vec<ScheduledRequest>,
    /// Sum of `token_ids.len()`; at most `max_num_batched_tokens`.
    pub num_batched_tokens: usize,
    /// Requests preempted this step, newest first; they are back in the waiting queue.
    pub preempted: Vec<RequestId>,
    /// Every request finished since the last step (by `update`, abort, stop string
    /// or `Ignored` at admission), so the runner can drop its per-request state.
    pub finished: Vec<FinishedRequest>,
    /// KV copies (for forks) the model must run before this step's forward pass.
    pub block_copies: Vec<BlockCopy>,
}

/// What one step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestUpdate {
    pub request_id: RequestId,
    /// Sampled tokens appended this step (up to and including a stop token).
    pub new_token_ids: Vec<u32>,
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens served by the prefix cache (for usage reports).
    pub num_cached_tokens: usize,
}
