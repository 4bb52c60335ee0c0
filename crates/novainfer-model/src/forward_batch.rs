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

    /// The batch's spans other than embeddings, as passes of at most `max_spans` spans each
    /// returning at most its last token's row, for a device that returns only last-token rows
    /// and at most `max_spans` of them: a span that wants a row per token (a scored prompt, a
    /// speculative verify) becomes one-token spans over its block table, each with its own
    /// output (logits, or row i's draw rule). Spans keep the batch's order and each span's
    /// tokens their own, so every token's K/V is written (in its pass or an earlier one) before
    /// a later token of its sequence reads it, and the passes' logits rows and tokens, joined
    /// in order, are the batch's in [`ForwardOutput`]'s order. Embeddings (`LastHidden`) are
    /// left out: their rows come from another tail.
    pub fn row_passes(&self, max_spans: usize) -> Result<Vec<ForwardBatch>> {
        let max_spans = max_spans.max(1);
        let mut passes = vec![ForwardBatch::default()];
        let mut push = |token: std::ops::Range<usize>, s: &SeqSpan, output: SpanOutput| {
            if passes.last().is_some_and(|p| p.seqs.len() == max_spans) {
                passes.push(ForwardBatch::default());
            }
            let pass = passes.last_mut().expect("one pass at least");
            pass.push_adapted(
                &self.token_ids[token.clone()],
                self.positions.get(token.start).copied().unwrap_or(0),
                self.slot_mapping[token].to_vec(),
                s.block_table.clone(),
                output,
                s.adapter.clone(),
            );
        };
        for s in &self.seqs {
            let all = s.query_start..s.query_start + s.query_len;
            match &s.output {
                SpanOutput::LastHidden => {}
                SpanOutput::None | SpanOutput::LastLogits | SpanOutput::Draw(_) => {
                    push(all, s, s.output.clone())
                }
                SpanOutput::AllLogits => {
                    for t in all {
                        push(t..t + 1, s, SpanOutput::LastLogits);
                    }
                }
                SpanOutput::DrawEach(each) => {
                    if each.len() != s.query_len {
                        return Err(ModelError::config(
                            "draw",
                            format!(
                                "a verify span of {} tokens has {} draw rules",
                                s.query_len,
                                each.len()
                            ),
                        ));
                    }
                    for (t, draw) in all.zip(each) {
                        push(t..t + 1, s, SpanOutput::Draw(draw.clone()));
                    }
                }
            }
        }
        passes.retain(|p| !p.seqs.is_empty());
        Ok(passes)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens `tokens` at positions `start..` of a sequence whose table is `table` (block size
    /// 4), with `output`.
    fn push(b: &mut ForwardBatch, tokens: &[u32], start: usize, table: &[u32], out: SpanOutput) {
        let slots = (start..start + tokens.len())
            .map(|p| table[p / 4] as usize * 4 + p % 4)
            .collect();
        b.push_span(tokens, start, slots, table.to_vec(), out);
    }

    fn seeded(seed: u64) -> Draw {
        Draw {
            seed,
            ..Draw::greedy()
        }
    }

    /// A step of a decode, a prompt chunk, an embedding, a verify and a scored prompt.
    fn mixed() -> ForwardBatch {
        let mut b = ForwardBatch::default();
        push(&mut b, &[9], 6, &[0, 1], SpanOutput::Draw(seeded(1)));
        push(&mut b, &[1, 2, 3], 0, &[2], SpanOutput::None);
        push(&mut b, &[4, 5], 0, &[3], SpanOutput::LastHidden);
        let each = (10..13).map(seeded).collect();
        push(&mut b, &[7, 8, 9], 5, &[4, 5], SpanOutput::DrawEach(each));
        push(&mut b, &[3, 1, 4, 1, 5], 0, &[6, 7], SpanOutput::AllLogits);
        push(&mut b, &[2], 3, &[8], SpanOutput::LastLogits);
        b
    }

    /// Each pass's spans as (positions, slots, table, output), all passes in order.
    type Unit = (Vec<usize>, Vec<usize>, Vec<u32>, SpanOutput);
    fn units(passes: &[ForwardBatch]) -> Vec<Unit> {
        passes
            .iter()
            .flat_map(|p| {
                p.seqs.iter().map(|s| {
                    let r = s.query_start..s.query_start + s.query_len;
                    (
                        p.positions[r.clone()].to_vec(),
                        p.slot_mapping[r].to_vec(),
                        s.block_table.clone(),
                        s.output.clone(),
                    )
                })
            })
            .collect()
    }

    #[test]
    fn row_passes_cut_per_token_spans_into_one_token_spans_in_order() {
        let b = mixed();
        let one = b.row_passes(64).expect("passes");
        assert_eq!(one.len(), 1, "everything fits one pass");
        let got = units(&one);
        // The decode, the chunk, the verify's three tokens each with its rule, the scored
        // prompt's five tokens each with its row, the last decode; no embedding.
        assert_eq!(got.len(), 1 + 1 + 3 + 5 + 1);
        assert_eq!(
            got[0],
            (vec![6], vec![6], vec![0, 1], SpanOutput::Draw(seeded(1)))
        );
        assert_eq!(
            got[1],
            (vec![0, 1, 2], vec![8, 9, 10], vec![2], SpanOutput::None)
        );
        for (i, unit) in got[2..5].iter().enumerate() {
            let p = 5 + i;
            let slot = [4, 5][p / 4] as usize * 4 + p % 4;
            let want = (
                vec![p],
                vec![slot],
                vec![4, 5],
                SpanOutput::Draw(seeded(10 + i as u64)),
            );
            assert_eq!(unit, &want);
        }
        for (p, unit) in got[5..10].iter().enumerate() {
            assert_eq!(unit.0, vec![p]);
            assert_eq!(unit.3, SpanOutput::LastLogits);
        }
        assert_eq!(got[10].3, SpanOutput::LastLogits);
        // Rows are computed in the batch's order (by position): the decode's draw, the
        // verify's three, the scored prompt's five, the last decode's.
        let rows: Vec<usize> = one[0]
            .logits_indices()
            .iter()
            .map(|&r| one[0].positions[r])
            .collect();
        assert_eq!(rows, vec![6, 5, 6, 7, 0, 1, 2, 3, 4, 3]);
    }

    #[test]
    fn row_passes_hold_at_most_max_spans_and_keep_the_order_across_passes() {
        let b = mixed();
        let whole = units(&b.row_passes(64).expect("passes"));
        for max in 1..=11 {
            let passes = b.row_passes(max).expect("passes");
            assert!(passes
                .iter()
                .all(|p| !p.seqs.is_empty() && p.seqs.len() <= max));
            assert_eq!(passes.len(), 11usize.div_ceil(max), "max {max}");
            assert_eq!(units(&passes), whole, "max {max}");
            for p in &passes {
                p.validate(4).expect("a consistent batch");
            }
        }
    }

    #[test]
    fn a_verify_with_the_wrong_number_of_rules_is_an_error_and_embeddings_alone_give_none() {
        let mut b = ForwardBatch::default();
        push(
            &mut b,
            &[7, 8],
            2,
            &[0],
            SpanOutput::DrawEach(vec![Draw::greedy()]),
        );
        assert!(b.row_passes(8).is_err());
        let mut b = ForwardBatch::default();
        push(&mut b, &[7, 8], 0, &[0], SpanOutput::LastHidden);
        assert!(b.row_passes(8).expect("passes").is_empty());
    }
}
