//! One model step over many sequences, flattened (vLLM's layout).
//!
//! ```text
//!   token_ids:     [ a0 a1 a2 a3 | b7 | c0 c1 ]     seq a: prefill chunk, b: decode, c: chunk
//!   positions:     [  0  1  2  3 |  7 |  0  1 ]
//!   slot_mapping:  [ where each token's K/V is written in the paged pool ]
//!   seqs:          a {start 0, len 4}, b {start 4, len 1}, c {start 5, len 2}
//!   logits rows:   one per sequence with `sample`, for its last token, in `seqs` order
//! ```
//! A sequence attends to its own history (through its block table) and never
//! sees another sequence's tokens.

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct SeqSpan {
    /// Index of the sequence's first token in the flattened arrays.
    pub query_start: usize,
    pub query_len: usize,
    /// Block ids holding positions `0..` of this sequence.
    pub block_table: Vec<u32>,
    /// Whether the last token of this span needs logits.
    pub sample: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<usize>,
    pub slot_mapping: Vec<usize>,
    pub seqs: Vec<SeqSpan>,
}

impl ForwardBatch {
    /// Appends one sequence's chunk: tokens at positions `start..`, K/V written to `slots`.
    pub fn push(
        &mut self,
        token_ids: &[u32],
        start: usize,
        slots: Vec<usize>,
        block_table: Vec<u32>,
        sample: bool,
    ) {
        let query_start = self.token_ids.len();
        self.token_ids.extend_from_slice(token_ids);
        self.positions.extend(start..start + token_ids.len());
        self.slot_mapping.extend(slots);
        self.seqs.push(SeqSpan {
            query_start,
            query_len: token_ids.len(),
            block_table,
            sample,
        });
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Rows (flattened token indices) whose logits are returned.
    pub fn logits_indices(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .filter(|s| s.sample && s.query_len > 0)
            .map(|s| s.query_start + s.query_len - 1)
            .collect()
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
