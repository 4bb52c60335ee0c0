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
use novainfer_model::{Executor, ForwardBatch, ModelError, Qwen2Config, SpanOutput};

use crate::draft_policy::{DraftWork, STEADY_FEED};

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
        self.computed = self.confirmed(request);
        self.speculated.clear();
    }

    /// How many of the request's tokens the KV holds once the fed drafts are checked against
    /// the request's tokens.
    fn confirmed(&self, request: &Request) -> usize {
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
        let computed = if self.computed > n {
            0
        } else {
            self.computed + confirmed
        };
        // The next draft needs the last token's logits: feed it again if its KV is all there
        // (a verifier that confirms drafts past a rejection could leave it so).
        computed.min(n.saturating_sub(1))
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

    /// Drafts only while a sequence is shorter than `max_positions` (by default the draft's
    /// `max_position_embeddings`; the engine gives its RoPE-scaled context).
    pub fn with_max_positions(mut self, max_positions: usize) -> Self {
        self.max_positions = max_positions;
        self
    }

    pub fn config(&self) -> &Qwen2Config {
        self.executor.config()
    }

    /// The tokens of `request` the draft model has yet to read beyond [`STEADY_FEED`] before
    /// it can draft for it: what drafting for it now would cost in catch-up.
    pub fn catch_up(&self, request: &Request) -> usize {
        let computed = self
            .seqs
            .get(&request.id)
            .map_or(0, |seq| seq.confirmed(request));
        (request.num_tokens() - computed).saturating_sub(STEADY_FEED)
    }

    /// Blocks of the draft's pool in use.
    pub fn num_used_blocks(&self) -> usize {
        self.seqs.values().map(|s| s.blocks.len()).sum()
    }

    /// Drafts of `k` tokens for `wants` (`(request, k)`), in order; a request gets an empty draft
    /// when `k` is 0 (it is caught up later, when it drafts again), while the draft model is
    /// still catching up with it, or when the pool cannot hold it.
    pub fn propose(
        &mut self,
        wants: &[(&Request, usize)],
    ) -> Result<(Vec<Vec<u32>>, DraftWork), ModelError> {
        let plans = self.plan(wants);
        let mut work = DraftWork::default();
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); wants.len()];
        let index: HashMap<RequestId, usize> = wants
            .iter()
            .enumerate()
            .map(|(i, (r, _))| (r.id, i))
            .collect();
        if plans.is_empty() {
            return Ok((drafts, work));
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
            let catch_up = if caught_up {
                p.feed.len().saturating_sub(STEADY_FEED)
            } else {
                p.feed.len()
            };
            work.catch_up += catch_up;
            work.rows += p.feed.len() - catch_up;
        }
        work.passes += 1;
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
            work.passes += 1;
            work.rows += last.len();
            let logits = self.run(&batch)?;
            let next = self.argmax_rows(&logits);
            for ((id, t), n) in last.iter_mut().zip(next) {
                let seq = self.seqs.get_mut(id).expect("planned");
                seq.speculated.push(*t);
                drafts[index[id]].push(n);
                *t = n;
            }
        }
        Ok((drafts, work))
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
            let n = request.num_tokens();
            // Past the draft's context: nothing to propose, and its KV is of no more use.
            if n >= self.max_positions {
                if let Some(seq) = self.seqs.remove(&request.id) {
                    self.free.extend(seq.blocks);
                }
                continue;
            }
            let seq = self.seqs.entry(request.id).or_default();
            seq.reconcile(request);
            // Drafts 1..k-1 are fed; the last is only proposed.
            let k = k.min(self.max_positions - n + 1);
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
    use novainfer_model::{Device, ForwardOutput, Qwen2Config};

    const VOCAB: usize = 11;

    /// A model whose next token is a function of the tokens its pool holds for the sequence
    /// (read back through the block table), so stale or missing KV changes its answers.
    struct PoolEcho {
        config: Qwen2Config,
        /// Per slot: the token written there.
        pool: Vec<Option<u32>>,
    }

    impl PoolEcho {
        fn new(num_blocks: usize, max_positions: usize) -> Self {
            Self {
                config: Qwen2Config {
                    vocab_size: VOCAB,
                    hidden_size: 8,
                    intermediate_size: 8,
                    num_hidden_layers: 1,
                    num_attention_heads: 1,
                    num_key_value_heads: 1,
                    max_position_embeddings: max_positions,
                    rope_theta: 1e4,
                    rms_norm_eps: 1e-6,
                    tie_word_embeddings: false,
                    torch_dtype: None,
                    bos_token_id: None,
                    eos_token_ids: vec![],
                },
                pool: vec![None; num_blocks * DRAFT_BLOCK_SIZE],
            }
        }
    }

    /// The toy model's next token after `tokens`.
    fn next(tokens: &[u32]) -> u32 {
        let h = tokens.iter().enumerate().fold(7u64, |h, (i, &t)| {
            h.wrapping_mul(31)
                .wrapping_add((i as u64 + 1) * u64::from(t))
        });
        (h % VOCAB as u64) as u32
    }

    impl Executor for PoolEcho {
        fn device(&self) -> Device {
            Device::Cpu
        }
        fn capabilities(&self) -> novainfer_model::Capabilities {
            novainfer_model::capabilities::CPU
        }
        fn config(&self) -> &Qwen2Config {
            &self.config
        }
        fn block_size(&self) -> usize {
            DRAFT_BLOCK_SIZE
        }
        fn num_blocks(&self) -> usize {
            self.pool.len() / DRAFT_BLOCK_SIZE
        }
        fn kv_bytes_per_block(&self) -> usize {
            1
        }
        fn copy_block(&mut self, _: usize, _: usize, _: usize) -> novainfer_model::Result<()> {
            unreachable!("drafts never fork")
        }
        fn forward(&mut self, batch: &ForwardBatch) -> novainfer_model::Result<ForwardOutput> {
            for (i, &slot) in batch.slot_mapping.iter().enumerate() {
                self.pool[slot] = Some(batch.token_ids[i]);
            }
            let mut logits = Vec::new();
            for span in &batch.seqs {
                if span.output != SpanOutput::LastLogits {
                    continue;
                }
                let last = span.query_start + span.query_len - 1;
                let history: Vec<u32> = (0..=batch.positions[last])
                    .map(|p| {
                        let block = span.block_table[p / DRAFT_BLOCK_SIZE] as usize;
                        self.pool[block * DRAFT_BLOCK_SIZE + p % DRAFT_BLOCK_SIZE]
                            .expect("every earlier position was written")
                    })
                    .collect();
                let mut row = vec![0.0; VOCAB];
                row[next(&history) as usize] = 1.0;
                logits.extend(row);
            }
            Ok(ForwardOutput {
                logits,
                ..ForwardOutput::default()
            })
        }
        fn embed(&mut self, _: &[u32]) -> novainfer_model::Result<Vec<f32>> {
            unreachable!()
        }
        fn prompt_logits(&mut self, _: &[u32], _: bool) -> novainfer_model::Result<Vec<f32>> {
            unreachable!()
        }
    }

    /// The drafts a model without KV would make: each from the whole sequence so far.
    fn reference(tokens: &[u32], k: usize) -> Vec<u32> {
        let mut seq = tokens.to_vec();
        for _ in 0..k {
            seq.push(next(&seq));
        }
        seq.split_off(tokens.len())
    }

    #[test]
    fn drafts_follow_the_sequence_through_rejections_and_catch_up() {
        // A catch-up budget of 20 tokens a step: the 45-token prompt takes three steps.
        let mut draft = DraftModel::new(Box::new(PoolEcho::new(64, 4096)), VOCAB, 20);
        let prompt: Vec<u32> = (0..45).map(|i| (i * 7 % VOCAB) as u32).collect();
        let mut a = Request::new(RequestId(1), prompt, 500);
        a.output_token_ids.push(3);
        let mut b = Request::new(RequestId(2), vec![1, 2, 3], 500);
        b.output_token_ids.push(4);
        let mut rng = 12345u64;
        let (mut drafted_a, mut drafted_b) = (0, 0);
        for step in 0..40 {
            let (out, work) = draft.propose(&[(&a, 4), (&b, 3)]).expect("runs");
            if step == 0 {
                // Only a's first 20 prompt tokens, in one pass.
                assert_eq!(
                    work,
                    DraftWork {
                        passes: 1,
                        rows: 0,
                        catch_up: 20
                    }
                );
            }
            if out[0].len() == 4 {
                assert_eq!(
                    work.passes, 4,
                    "one pass per draft token of the longest draft"
                );
            }
            if !out[0].is_empty() {
                drafted_a += 1;
                assert_eq!(
                    out[0],
                    reference(&a.token_ids(0..a.num_tokens()), 4),
                    "step {step}"
                );
            }
            // b waits while a's catch-up takes the whole budget.
            if !out[1].is_empty() {
                drafted_b += 1;
                assert_eq!(
                    out[1],
                    reference(&b.token_ids(0..b.num_tokens()), 3),
                    "step {step}"
                );
            }
            // The target keeps a random prefix of each draft, then adds a token of its own.
            for (r, d) in [(&mut a, &out[0]), (&mut b, &out[1])] {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let keep = (rng >> 33) as usize % (d.len() + 1);
                r.output_token_ids.extend_from_slice(&d[..keep]);
                r.output_token_ids.push((rng >> 40) as u32 % VOCAB as u32);
            }
        }
        // Three steps of catch-up, then a draft every step for both.
        assert_eq!((drafted_a, drafted_b), (38, 38));
        draft.retain(|id| id == RequestId(2));
        assert!(draft.num_used_blocks() > 0);
        draft.retain(|_| false);
        assert_eq!(draft.num_used_blocks(), 0);
    }

    #[test]
    fn a_full_pool_or_the_context_end_gives_no_draft() {
        // Three blocks: room for one of the two sequences (two blocks each) only.
        let mut draft = DraftModel::new(Box::new(PoolEcho::new(3, 40)), VOCAB, 1000);
        let a = Request::new(RequestId(1), vec![1; 20], 100);
        let b = Request::new(RequestId(2), vec![2; 20], 100);
        let (out, _) = draft.propose(&[(&a, 4), (&b, 4)]).expect("runs");
        assert_eq!(out[0], reference(&a.token_ids(0..20), 4));
        assert!(out[1].is_empty(), "no room for b");
        assert_eq!(draft.num_used_blocks(), 2);
        // At the draft's context end: nothing, and its blocks come back.
        let long = Request::new(RequestId(1), vec![1; 40], 100);
        assert_eq!(
            draft.propose(&[(&long, 4)]).expect("runs").0,
            vec![Vec::<u32>::new()]
        );
        assert_eq!(draft.num_used_blocks(), 0);
        // Near it, the draft is shortened to fit.
        let near = Request::new(RequestId(3), vec![1; 38], 100);
        assert_eq!(draft.propose(&[(&near, 4)]).expect("runs").0[0].len(), 3);
    }

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
