//! A draft model for speculative decoding: a smaller Qwen2 with the target's tokenizer that
//! proposes each request's next tokens greedily, batched over the requests it drafts for.
//!
//! It keeps its own paged KV pool (a share of the engine's KV budget) and, per request, which
//! of the request's tokens that pool holds. Drafts it fed itself stay in its KV until the
//! target's verification says how many were right; the next proposal keeps the confirmed ones
//! and overwrites the rest, so each step computes only the tokens it has not seen.
//!
//! Greedy drafts are one-hot proposals: verification (sampling the target's row and accepting
//! while it equals the draft) keeps the target's distribution exactly, at any temperature.

use std::collections::HashMap;

use novainfer_core::{slot_mapping, BlockId, Request, RequestId};
use novainfer_model::{Executor, ForwardBatch, ModelError, SpanOutput};

/// Tokens per block of the draft's pool (its own, whatever the target's layout).
pub const DRAFT_BLOCK_SIZE: usize = 16;

/// What the draft's KV holds for one request.
#[derive(Debug, Default)]
struct DraftSeq {
    blocks: Vec<BlockId>,
    /// Positions `0..computed` hold the request's own tokens.
    computed: usize,
    /// Drafts fed at positions `computed..`, not yet confirmed.
    speculated: Vec<u32>,
}

impl DraftSeq {
    /// Keeps the fed drafts the request's tokens confirmed and forgets the rest.
    fn reconcile(&mut self, request: &Request) {
        let n = request.num_tokens();
        let end = (self.computed + self.speculated.len()).min(n);
        let confirmed = if end > self.computed {
            request
                .token_ids(self.computed..end)
                .iter()
                .zip(&self.speculated)
                .take_while(|(a, b)| a == b)
                .count()
        } else {
            0
        };
        // A request never loses tokens; if it somehow did, start over rather than trust KV.
        self.computed = if self.computed > n {
            0
        } else {
            self.computed + confirmed
        };
        self.speculated.clear();
    }
}

/// One request's part of a draft step.
struct Plan {
    id: RequestId,
    /// Drafts wanted (0: only catching up this step).
    k: usize,
    /// Tokens to feed first: the request's tokens the draft has not seen (some of them when
    /// the step's catch-up budget runs out).
    feed_from: usize,
    feed: Vec<u32>,
}

pub struct DraftModel {
    executor: Box<dyn Executor>,
    /// Logits rows considered: the vocabulary both models share (they may differ by padding).
    vocab: usize,
    free: Vec<BlockId>,
    seqs: HashMap<RequestId, DraftSeq>,
    /// Most tokens of requests' pasts fed in one step, so a long prompt the draft has not seen
    /// is caught up in chunks instead of stalling a step.
    catch_up_per_step: usize,
    /// Longest sequence the draft can take.
    max_positions: usize,
}

impl DraftModel {
    /// `target_vocab`: the target's logits width.
    pub fn new(executor: Box<dyn Executor>, target_vocab: usize, catch_up_per_step: usize) -> Self {
        let vocab = executor.config().vocab_size.min(target_vocab);
        let max_positions = executor.config().max_position_embeddings;
        let free = (0..executor.num_blocks() as u32)
            .rev()
            .map(BlockId)
            .collect();
        Self {
            executor,
            vocab,
            free,
            seqs: HashMap::new(),
            catch_up_per_step: catch_up_per_step.max(1),
            max_positions,
        }
    }

    /// Blocks of the draft's pool in use.
    pub fn num_used_blocks(&self) -> usize {
        self.seqs.values().map(|s| s.blocks.len()).sum()
    }

    /// Drafts of `k` tokens for `wants` (`(request, k)`), in order; a request gets an empty draft
    /// when `k` is 0 (it is caught up later, when it drafts again), while the draft model is
    /// still catching up with it, or when the pool cannot hold it.
    pub fn propose(&mut self, wants: &[(&Request, usize)]) -> Result<Vec<Vec<u32>>, ModelError> {
        let plans = self.plan(wants);
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); wants.len()];
        let index: HashMap<RequestId, usize> = wants
            .iter()
            .enumerate()
            .map(|(i, (r, _))| (r.id, i))
            .collect();
        if plans.is_empty() {
            return Ok(drafts);
        }
        // Round 0: the unseen tokens of each request; the last one's logits give draft 1.
        let mut batch = ForwardBatch::default();
        let mut sampled_ids = Vec::new();
        for p in &plans {
            let seq = &self.seqs[&p.id];
            let caught_up = p.k > 0;
            let output = if caught_up {
                sampled_ids.push(p.id);
                SpanOutput::LastLogits
            } else {
                SpanOutput::None
            };
            push(&mut batch, seq, &p.feed, p.feed_from, output);
        }
        let logits = self.run(&batch)?;
        for p in &plans {
            let seq = self.seqs.get_mut(&p.id).expect("planned");
            seq.computed = p.feed_from + p.feed.len();
        }
        let mut last: Vec<(RequestId, u32)> = sampled_ids
            .iter()
            .zip(self.argmax_rows(&logits))
            .map(|(id, t)| (*id, t))
            .collect();
        for (id, t) in &last {
            drafts[index[id]].push(*t);
        }
        // Rounds 1..: feed each request its newest draft while it wants more.
        let wanted: HashMap<RequestId, usize> = plans.iter().map(|p| (p.id, p.k)).collect();
        loop {
            last.retain(|(id, _)| drafts[index[id]].len() < wanted[id]);
            if last.is_empty() {
                break;
            }
            let mut batch = ForwardBatch::default();
            for (id, t) in &last {
                let seq = &self.seqs[id];
                let at = seq.computed + seq.speculated.len();
                push(&mut batch, seq, &[*t], at, SpanOutput::LastLogits);
            }
            let logits = self.run(&batch)?;
            let next = self.argmax_rows(&logits);
            for ((id, t), n) in last.iter_mut().zip(next) {
                let seq = self.seqs.get_mut(id).expect("planned");
                seq.speculated.push(*t);
                drafts[index[id]].push(n);
                *t = n;
            }
        }
        Ok(drafts)
    }

    /// Brings each request's state up to date and decides what it feeds this step; requests
    /// the pool cannot hold are dropped (they get no draft) and their blocks freed.
    fn plan(&mut self, wants: &[(&Request, usize)]) -> Vec<Plan> {
        let mut budget = self.catch_up_per_step;
        let mut plans = Vec::new();
        for &(request, k) in wants {
            if k == 0 {
                continue;
            }
            let seq = self.seqs.entry(request.id).or_default();
            seq.reconcile(request);
            let n = request.num_tokens();
            // Drafts 1..k-1 are fed; the last is only proposed.
            let k = k.min(self.max_positions.saturating_sub(n) + 1);
            let unseen = n - seq.computed;
            if unseen == 0 || budget == 0 {
                continue;
            }
            let take = unseen.min(budget);
            budget -= take;
            let k = if take == unseen { k } else { 0 };
            let end = seq.computed + take + k.saturating_sub(1);
            let need = end
                .div_ceil(DRAFT_BLOCK_SIZE)
                .saturating_sub(seq.blocks.len());
            if need > self.free.len() {
                let seq = self.seqs.remove(&request.id).expect("just added");
                self.free.extend(seq.blocks);
                continue;
            }
            let at = self.free.len() - need;
            seq.blocks.extend(self.free.drain(at..));
            plans.push(Plan {
                id: request.id,
                k,
                feed_from: seq.computed,
                feed: request.token_ids(seq.computed..seq.computed + take),
            });
        }
        plans
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>, ModelError> {
        Ok(self.executor.forward(batch)?.logits)
    }

    fn argmax_rows(&self, logits: &[f32]) -> Vec<u32> {
        let width = self.executor.config().vocab_size;
        logits
            .chunks_exact(width)
            .map(|row| argmax(&row[..self.vocab]))
            .collect()
    }

    /// Keeps the state of requests for which `alive` holds and frees the others' blocks.
    pub fn retain(&mut self, mut alive: impl FnMut(RequestId) -> bool) {
        let free = &mut self.free;
        self.seqs.retain(|id, seq| {
            let keep = alive(*id);
            if !keep {
                free.append(&mut seq.blocks);
            }
            keep
        });
    }
}

fn push(batch: &mut ForwardBatch, seq: &DraftSeq, tokens: &[u32], start: usize, out: SpanOutput) {
    let slots = slot_mapping(&seq.blocks, start, tokens.len(), DRAFT_BLOCK_SIZE);
    let table = seq.blocks.iter().map(|b| b.0).collect();
    batch.push_span(tokens, start, slots, table, out);
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_keeps_the_confirmed_drafts_only() {
        let mut r = Request::new(RequestId(1), vec![1, 2, 3], 10);
        let mut seq = DraftSeq {
            blocks: vec![],
            computed: 3,
            speculated: vec![7, 8, 9],
        };
        // The target confirmed 7 and 8, then sampled 5 instead of 9.
        r.output_token_ids.extend([7, 8, 5]);
        seq.reconcile(&r);
        assert_eq!((seq.computed, seq.speculated.len()), (5, 0));
        // Nothing confirmed.
        seq.speculated = vec![4];
        r.output_token_ids.push(6);
        seq.reconcile(&r);
        assert_eq!(seq.computed, 5);
    }

    #[test]
    fn argmax_takes_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
    }
}
