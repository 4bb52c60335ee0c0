//! One model step over many sequences, flattened (vLLM's layout).
//!
//! ```text
//!   token_ids:     [ a0 a1 a2 a3 | b7 | c0 c1 ]     seq a: prefill chunk, b: decode, c: chunk
//!   positions:     [  0  1  2  3 |  7 |  0  1 ]
//!   slot_mapping:  [ where each token's K/V is written in the paged pool ]
//!   seqs:          a {start 0, len 4}, b {start 4, len 1}, c {start 5, len 2}
//!   logits rows:   in `seqs` order, one for a `LastLogits` sequence (its last token),
//!                  one per token for an `AllLogits` one
//!   tokens:        one per `Draw` sequence: the next token, sampled on the device
//!   hidden rows:   one per `LastHidden` sequence (its last token's final hidden state)
//! ```
//! A sequence attends to its own history (through its block table) and never
//! sees another sequence's tokens.

pub use crate::draw::{Adjust, Draw, DrawRule, DrawnToken};
use crate::error::{ModelError, Result};
use crate::lora::AdapterRef;

/// What a forward pass returns for one sequence of the batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum SpanOutput {
    /// Nothing (a prefill chunk before the prompt's end): the work is its K/V.
    #[default]
    None,
    /// The last token's logits (to sample from).
    LastLogits,
    /// The next token, drawn by the device from the last token's logits by this rule; only
    /// the token and its logprob leave the device. For a backend whose
    /// [`Capabilities::sampling`](crate::Capabilities) has `draws`.
    Draw(Draw),
    /// Every token's next token, each drawn on the device by its own rule (a speculative
    /// verify: rule i is the sampler's after the draft's first i tokens; one per token).
    /// Only the tokens leave the device; the caller keeps the prefix that matches the draft.
    DrawEach(Vec<Draw>),
    /// Every token's logits (scoring a prompt).
    AllLogits,
    /// The last token's final hidden state, after the final norm (an embedding).
    LastHidden,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SeqSpan {
    /// Index of the sequence's first token in the flattened arrays.
    pub query_start: usize,
    pub query_len: usize,
    /// Block ids holding positions `0..` of this sequence.
    pub block_table: Vec<u32>,
    pub output: SpanOutput,
    /// The LoRA adapter its tokens run with (`None`: the base model alone).
    pub adapter: Option<AdapterRef>,
}

/// What one forward pass returns: f32 logits rows `[rows, vocab]`, drawn tokens and final
/// hidden rows `[rows, hidden]`, each in `batch.seqs` order (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardOutput {
    pub logits: Vec<f32>,
    pub tokens: Vec<DrawnToken>,
    pub hidden: Vec<f32>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<usize>,
    pub slot_mapping: Vec<usize>,
    pub seqs: Vec<SeqSpan>,
}

impl ForwardBatch {
    /// Appends one sequence's chunk: tokens at positions `start..`, K/V written to `slots`;
    /// `sample`: its last token's logits are returned.
    pub fn push(
        &mut self,
        token_ids: &[u32],
        start: usize,
        slots: Vec<usize>,
        block_table: Vec<u32>,
        sample: bool,
    ) {
        let output = if sample {
            SpanOutput::LastLogits
        } else {
            SpanOutput::None
        };
        self.push_span(token_ids, start, slots, block_table, output);
    }

    /// [`Self::push`] with any output.
    pub fn push_span(
        &mut self,
        token_ids: &[u32],
        start: usize,
        slots: Vec<usize>,
        block_table: Vec<u32>,
        output: SpanOutput,
    ) {
        self.push_adapted(token_ids, start, slots, block_table, output, None);
    }

    /// [`Self::push_span`] of a sequence that runs with `adapter`.
    pub fn push_adapted(
        &mut self,
        token_ids: &[u32],
        start: usize,
        slots: Vec<usize>,
        block_table: Vec<u32>,
        output: SpanOutput,
        adapter: Option<AdapterRef>,
    ) {
        let query_start = self.token_ids.len();
        self.token_ids.extend_from_slice(token_ids);
        self.positions.extend(start..start + token_ids.len());
        self.slot_mapping.extend(slots);
        self.seqs.push(SeqSpan {
            query_start,
            query_len: token_ids.len(),
            block_table,
            output,
            adapter,
        });
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Empties the batch, keeping its buffers' capacity.
    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.seqs.clear();
    }

    /// Rows (flattened token indices) whose logits are computed, in order: those returned,
    /// and a `Draw` span's, which the device samples in place.
    pub fn logits_indices(&self) -> Vec<usize> {
        let mut rows = Vec::new();
        self.logits_indices_into(&mut rows);
        rows
    }

    /// [`Self::logits_indices`] into `rows` (its capacity reused).
    pub fn logits_indices_into(&self, rows: &mut Vec<usize>) {
        rows.clear();
        for s in self.seqs.iter().filter(|s| s.query_len > 0) {
            let all = s.query_start..s.query_start + s.query_len;
            match &s.output {
                SpanOutput::LastLogits | SpanOutput::Draw(_) => rows.push(all.end - 1),
                SpanOutput::AllLogits | SpanOutput::DrawEach(_) => rows.extend(all),
                SpanOutput::None | SpanOutput::LastHidden => {}
            }
        }
    }

    /// Rows whose final hidden state is returned, in order.
    pub fn hidden_indices(&self) -> Vec<usize> {
        let mut rows = Vec::new();
        self.hidden_indices_into(&mut rows);
        rows
    }

    /// [`Self::hidden_indices`] into `rows` (its capacity reused).
    pub fn hidden_indices_into(&self, rows: &mut Vec<usize>) {
        rows.clear();
        rows.extend(
            self.seqs
                .iter()
                .filter(|s| s.output == SpanOutput::LastHidden && s.query_len > 0)
                .map(|s| s.query_start + s.query_len - 1),
        );
    }

    /// Whether every span asks for at most its last token's logits or token (a plain
    /// generation step).
    pub fn only_samples(&self) -> bool {
        self.seqs.iter().all(|s| {
            matches!(
                s.output,
                SpanOutput::None | SpanOutput::LastLogits | SpanOutput::Draw(_)
            )
        })
    }

    /// Whether any span asks the device to draw a token.
    pub fn has_draws(&self) -> bool {
        self.seqs
            .iter()
            .any(|s| matches!(s.output, SpanOutput::Draw(_) | SpanOutput::DrawEach(_)))
    }

    /// A batch of the spans `which` (indices into `seqs`, in order), each with its output.
    pub fn select(&self, which: &[usize]) -> ForwardBatch {
        let mut out = ForwardBatch::default();
        for &i in which {
            let s = &self.seqs[i];
            let r = s.query_start..s.query_start + s.query_len;
            out.push_adapted(
                &self.token_ids[r.clone()],
                self.positions.get(r.start).copied().unwrap_or(0),
                self.slot_mapping[r].to_vec(),
                s.block_table.clone(),
                s.output.clone(),
                s.adapter.clone(),
            );
        }
        out
    }

    /// Span `i`'s tokens `range` (relative to the span) as one-token spans over its block
    /// table, each returning its logits: the same attention as one chunk, with a logits row
    /// per token, for a device that returns only last-token rows.
    pub fn one_token_spans(&self, i: usize, range: std::ops::Range<usize>) -> ForwardBatch {
        let s = &self.seqs[i];
        let mut out = ForwardBatch::default();
        for t in range.map(|t| s.query_start + t) {
            out.push_adapted(
                &self.token_ids[t..=t],
                self.positions[t],
                vec![self.slot_mapping[t]],
                s.block_table.clone(),
                SpanOutput::LastLogits,
                s.adapter.clone(),
            );
        }
        out
    }

    /// Checks the arrays agree; a mismatch is a runner bug, reported rather than panicking.
    pub fn validate(&self, block_size: usize) -> Result<()> {
        let n = self.num_tokens();
        let bad = |what: &str| Err(ModelError::config("forward_batch", what.to_owned()));
        if self.positions.len() != n || self.slot_mapping.len() != n {
            return bad("token_ids, positions and slot_mapping differ in length");
        }
        let mut next = 0;
        for s in &self.seqs {
            if s.query_start != next {
                return bad("sequences must be contiguous and in order");
            }
            next += s.query_len;
            let last = s.query_start + s.query_len;
            if let Some(&end) = self.positions[s.query_start..last].last() {
                if end >= s.block_table.len() * block_size {
                    return bad("a position lies beyond its sequence's block table");
                }
            }
        }
        if next != n {
            return bad("sequence spans do not cover the batch");
        }
        Ok(())
    }
}
