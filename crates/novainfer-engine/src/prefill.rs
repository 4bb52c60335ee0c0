//! Prefill-only work: embeddings and scored prompts. Each is a scheduler request that finishes
//! once its prompt is computed (chunked, inside the KV budget, preemptible and abortable like
//! any other), so a long input never runs as one forward that stalls every stream. Here: what
//! such a request collects from its chunks and where its result goes.

use novainfer_core::RequestKind;
use novainfer_model::layers::ops::normalize_l2;

use crate::error::{EngineError, Result};
use crate::prompt_scores::row_logprob;
use crate::request::TokenLogprob;

/// Where the engine thread sends a one-off answer: run there once, so it must not block (a
/// std or an async channel's send). Dropped unrun when the engine dies first.
pub type Reply<T> = Box<dyn FnOnce(Result<T>) + Send>;

/// What a prefill-only request computes, and who gets it.
pub enum PrefillTask {
    /// The input's unit-length embedding (its last token's final hidden state).
    Embed(Reply<Vec<f32>>),
    /// Each prompt token's logprob given the ones before it, with `top_k` alternatives;
    /// `None` for the first token.
    PromptLogprobs {
        top_k: usize,
        reply: Reply<Vec<Option<TokenLogprob>>>,
    },
    /// Next-token logits at every prompt position, `[prompt_len, vocab]` (a reference for
    /// checking the model; the caller chooses to hold them all).
    PromptLogits(Reply<Vec<f32>>),
}

impl PrefillTask {
    pub fn kind(&self) -> RequestKind {
        match self {
            PrefillTask::Embed(_) => RequestKind::Embed,
            PrefillTask::PromptLogprobs { .. } | PrefillTask::PromptLogits(_) => {
                RequestKind::ScorePrompt
            }
        }
    }
}

/// A prefill-only request in flight: its prompt and what its chunks have produced so far.
pub(crate) struct PrefillJob {
    prompt: Vec<u32>,
    vocab: usize,
    state: State,
}

enum State {
    Embed(Reply<Vec<f32>>),
    Logprobs {
        top_k: usize,
        rows: Vec<Option<TokenLogprob>>,
        reply: Reply<Vec<Option<TokenLogprob>>>,
    },
    Logits {
        rows: Vec<f32>,
        reply: Reply<Vec<f32>>,
    },
}

impl PrefillJob {
    pub(crate) fn new(prompt: Vec<u32>, task: PrefillTask, vocab: usize) -> Self {
        let n = prompt.len();
        let state = match task {
            PrefillTask::Embed(reply) => State::Embed(reply),
            PrefillTask::PromptLogprobs { top_k, reply } => State::Logprobs {
                top_k,
                rows: vec![None; n],
                reply,
            },
            PrefillTask::PromptLogits(reply) => State::Logits {
                rows: vec![0.0; n * vocab],
                reply,
            },
        };
        Self {
            prompt,
            vocab,
            state,
        }
    }

    /// Takes a scored chunk's logits rows (one per token from prompt position `start`).
    /// After a preemption the prompt is recomputed from its start, and the same rows arrive
    /// again: each lands at its position, so nothing is counted twice.
    pub(crate) fn take_rows(&mut self, start: usize, logits: &[f32]) {
        match &mut self.state {
            State::Embed(_) => {}
            State::Logprobs { top_k, rows, .. } => {
                for (i, row) in logits.chunks_exact(self.vocab).enumerate() {
                    let next = start + i + 1;
                    if let Some(&token) = self.prompt.get(next) {
                        rows[next] = Some(row_logprob(row, token, *top_k));
                    }
                }
            }
            State::Logits { rows, .. } => {
                let at = start * self.vocab;
                rows[at..at + logits.len()].copy_from_slice(logits);
            }
        }
    }

    pub(crate) fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Answers with what the job collected; `hidden` is the last token's final hidden state
    /// (for an embedding).
    pub(crate) fn finish(self, hidden: Option<&[f32]>) {
        match self.state {
            State::Embed(reply) => reply(match hidden {
                Some(h) => {
                    let mut v = h.to_vec();
                    normalize_l2(&mut v);
                    Ok(v)
                }
                None => Err(EngineError::StepFailed {
                    message: "the embedding's last chunk returned no hidden state".into(),
                }),
            }),
            State::Logprobs { rows, reply, .. } => reply(Ok(rows)),
            State::Logits { rows, reply, .. } => reply(Ok(rows)),
        }
    }

    pub(crate) fn fail(self, error: EngineError) {
        match self.state {
            State::Embed(reply) => reply(Err(error)),
            State::Logprobs { reply, .. } => reply(Err(error)),
            State::Logits { reply, .. } => reply(Err(error)),
        }
    }
}
