//! A draft model for speculative decoding: a smaller Qwen2 with the target's tokenizer that
//! proposes each request's next tokens greedily, batched over the requests it drafts for.
//!
//! Where its KV lives (as in vLLM v1, whose draft and EAGLE layers get KV tensors indexed by
//! the target's block table): in the target's blocks. The draft's executor holds a pool of as
//! many blocks of the same size as the target's, so block `b` holds a request's KV twice, the
//! target's layers in the target's pool and the draft's in the draft's, and a block's cost in
//! the KV budget is both models' bytes. So the scheduler's block manager is the one allocator
//! and the one budget: a request's block table (from the scheduler) places the draft's KV
//! too, a preemption or a finish frees both, and the draft needs no free list of its own. Its
//! passes go through a [`ModelRunner`], the target's contract with the device, so what runs
//! the target on a GPU runs the draft there too.
//!
//! What the draft adds to the scheduler's protocol: its drafts' KV is written ahead of the
//! target's, at the positions the next step will verify, so before a pass it has the
//! request's table cover them ([`Running::reserve`]: free blocks only, never preempting; the
//! verify then finds them held). A refused reservation means no draft for the request this
//! step. The draft cannot tell from the blocks whether its own layers' KV is there (the
//! target computes every token; the draft reads a request only when drafting pays), so it
//! tracks, per request, how many positions it wrote; a preemption
//! ([`Proposer::preempted`](crate::proposer::Proposer::preempted)) forgets that. Blocks shared
//! through the prefix cache or a fork hold the same tokens at the same positions, so a
//! request catching up there rewrites the draft KV already in them with the same values.
//!
//! Drafts it fed itself stay in its KV until the target's verification says how many were
//! right; the next proposal keeps the confirmed ones and overwrites the rest, so each step
//! computes only the tokens it has not seen.
//!
//! Greedy drafts are one-hot proposals: verification (sampling the target's row and accepting
//! while it equals the draft) keeps the target's distribution exactly, at any temperature.

use std::collections::HashMap;

use novainfer_core::{Request, RequestId};
use novainfer_model::{Executor, Qwen2Config, SpanOutput};

use crate::draft_policy::{DraftWork, STEADY_FEED};
use crate::error::Result;
use crate::model_runner::{ModelRunner, Span};
use crate::proposer::Running;

/// What the draft's layers hold of one request's KV.
#[derive(Debug, Default)]
struct DraftSeq {
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
    /// Over a pool of the target's layout: as many blocks, of the same size.
    runner: ModelRunner,
    /// Logits rows considered: the vocabulary both models share (they may differ by padding).
    vocab: usize,
    seqs: HashMap<RequestId, DraftSeq>,
    /// Most tokens of requests' pasts fed in one step, so a long prompt the draft has not seen
    /// is caught up in chunks instead of stalling a step.
    catch_up_per_step: usize,
    /// Longest sequence the draft can take.
    max_positions: usize,
}

impl DraftModel {
    /// `executor`: the draft's, over a pool of the target's layout (the number of blocks and
    /// the block size of the scheduler's pool), whose block tables it reads; `target_vocab`:
    /// the target's logits width.
    pub fn new(executor: Box<dyn Executor>, target_vocab: usize, catch_up_per_step: usize) -> Self {
        let vocab = executor.config().vocab_size.min(target_vocab);
        let max_positions = executor.config().max_position_embeddings;
        Self {
            runner: ModelRunner::new(executor),
            vocab,
            seqs: HashMap::new(),
            catch_up_per_step: catch_up_per_step.max(1),
            max_positions,
        }
    }

    /// Drafts only while a sequence is shorter than `max_positions` (by default the draft's
    /// `max_position_embeddings`; the engine gives its RoPE-scaled context, or the target's
    /// `max_model_len` if shorter: the scheduler reserves no position past that).
    pub fn with_max_positions(mut self, max_positions: usize) -> Self {
        self.max_positions = max_positions;
        self
    }

    pub fn config(&self) -> &Qwen2Config {
        self.runner.config()
    }

    /// Bytes of the draft's KV pool, and of one of its blocks: the draft's half of the shared
    /// blocks ([`crate::engine_core::EngineStats`] counts both models').
    pub fn kv_pool_bytes(&self) -> usize {
        self.runner.kv_pool_bytes()
    }

    pub fn kv_bytes_per_block(&self) -> usize {
        self.runner.kv_bytes_per_block()
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

    /// Drafts of `k` tokens for `wants` (`(request, k)`, requests `running` holds), in order; a
    /// request gets an empty draft when `k` is 0 (it is caught up later, when it drafts
    /// again), while the draft model is still catching up with it, or when its blocks cannot
    /// be made to cover the draft.
    pub fn propose(
        &mut self,
        running: &mut dyn Running,
        wants: &[(RequestId, usize)],
    ) -> Result<(Vec<Vec<u32>>, DraftWork)> {
        let plans = self.plan(running, wants);
        let mut work = DraftWork::default();
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); wants.len()];
        let index: HashMap<RequestId, usize> = wants
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (*id, i))
            .collect();
        if plans.is_empty() {
            return Ok((drafts, work));
        }
        // Round 0: the unseen tokens of each request; the last one's logits give draft 1.
        let mut spans = Vec::with_capacity(plans.len());
        let mut sampled_ids = Vec::new();
        for p in &plans {
            let caught_up = p.k > 0;
            let output = if caught_up {
                sampled_ids.push(p.id);
                SpanOutput::LastLogits
            } else {
                SpanOutput::None
            };
            spans.push(span(&*running, p.id, &p.feed, p.feed_from, output));
            let catch_up = if caught_up {
                p.feed.len().saturating_sub(STEADY_FEED)
            } else {
                p.feed.len()
            };
            work.catch_up += catch_up;
            work.rows += p.feed.len() - catch_up;
        }
        work.passes += 1;
        let logits = self.run(spans)?;
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
            let spans: Vec<Span<'_>> = last
                .iter()
                .map(|(id, t)| {
                    let seq = &self.seqs[id];
                    let at = seq.computed + seq.speculated.len();
                    span(
                        &*running,
                        *id,
                        std::slice::from_ref(t),
                        at,
                        SpanOutput::LastLogits,
                    )
                })
                .collect();
            work.passes += 1;
            work.rows += last.len();
            let logits = self.run(spans)?;
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

    /// Brings each request's state up to date, decides what it feeds this step, and has its
    /// blocks cover that and its drafts; a request whose blocks cannot is left out (no draft
    /// this step; what the draft holds of it stays).
    fn plan(&mut self, running: &mut dyn Running, wants: &[(RequestId, usize)]) -> Vec<Plan> {
        let mut budget = self.catch_up_per_step;
        let mut plans = Vec::new();
        for &(id, k) in wants {
            if k == 0 {
                continue;
            }
            let Some(request) = running.request(id) else {
                continue;
            };
            let n = request.num_tokens();
            // Past the draft's context: nothing to propose, and its KV is of no more use.
            if n >= self.max_positions {
                self.seqs.remove(&id);
                continue;
            }
            let seq = self.seqs.entry(id).or_default();
            seq.reconcile(request);
            // Drafts 1..k-1 are fed; the last is only proposed.
            let k = k.min(self.max_positions - n + 1);
            let unseen = n - seq.computed;
            if unseen == 0 || budget == 0 {
                continue;
            }
            let take = unseen.min(budget);
            let k = if take == unseen { k } else { 0 };
            let feed_from = seq.computed;
            let feed = request.token_ids(feed_from..feed_from + take);
            // The positions this step writes: the fed tokens', then drafts 1..k-1.
            if !running.reserve(id, feed_from + take + k.saturating_sub(1)) {
                continue;
            }
            budget -= take;
            plans.push(Plan {
                id,
                k,
                feed_from,
                feed,
            });
        }
        plans
    }

    fn run(&mut self, spans: Vec<Span<'_>>) -> Result<Vec<f32>> {
        Ok(self.runner.forward(spans)?.logits)
    }

    fn argmax_rows(&self, logits: &[f32]) -> Vec<u32> {
        let width = self.runner.config().vocab_size;
        logits
            .chunks_exact(width)
            .map(|row| argmax(&row[..self.vocab]))
            .collect()
    }

    /// Keeps the state of requests for which `alive` holds.
    pub fn retain(&mut self, alive: &mut dyn FnMut(RequestId) -> bool) {
        self.seqs.retain(|id, _| alive(*id));
    }

    /// Request `id`'s blocks were freed (a preemption): the KV the draft wrote there is gone.
    pub fn forget(&mut self, id: RequestId) {
        self.seqs.remove(&id);
    }
}

/// Request `id`'s `tokens` at positions `start..`, in its blocks.
fn span<'a>(
    running: &'a dyn Running,
    id: RequestId,
    tokens: &'a [u32],
    start: usize,
    output: SpanOutput,
) -> Span<'a> {
    Span {
        token_ids: tokens,
        start_position: start,
        block_table: running.block_table(id),
        output,
        adapter: None,
    }
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

/// A toy model for the draft's tests and the engine's: its next token is a function of the
/// tokens its pool holds for the sequence (read back through the block table), so stale or
/// missing KV changes its answers.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use novainfer_model::{Device, ForwardBatch, ForwardOutput};

    pub const BLOCK: usize = 4;

    pub struct PoolEcho {
        config: Qwen2Config,
        /// Per slot: the token written there.
        pool: Vec<Option<u32>>,
    }

    impl PoolEcho {
        /// Over `num_blocks` blocks of [`BLOCK`] tokens, with `vocab` tokens.
        pub fn new(num_blocks: usize, vocab: usize) -> Self {
            Self {
                config: crate::test_support::toy_config(vocab, 4096),
                pool: vec![None; num_blocks * BLOCK],
            }
        }
    }

    /// The toy model's next token after `tokens`, of `vocab`.
    pub fn next(tokens: &[u32], vocab: usize) -> u32 {
        let h = tokens.iter().enumerate().fold(7u64, |h, (i, &t)| {
            h.wrapping_mul(31)
                .wrapping_add((i as u64 + 1) * u64::from(t))
        });
        (h % vocab as u64) as u32
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
            BLOCK
        }
        fn num_blocks(&self) -> usize {
            self.pool.len() / BLOCK
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
                let end = span.query_start + span.query_len;
                let rows = match span.output {
                    SpanOutput::LastLogits => end - 1..end,
                    SpanOutput::AllLogits => span.query_start..end,
                    _ => continue,
                };
                for at in rows {
                    let history: Vec<u32> = (0..=batch.positions[at])
                        .map(|p| {
                            let block = span.block_table[p / BLOCK] as usize;
                            self.pool[block * BLOCK + p % BLOCK]
                                .expect("every earlier position was written")
                        })
                        .collect();
                    let vocab = self.config.vocab_size;
                    let mut row = vec![0.0; vocab];
                    row[next(&history, vocab) as usize] = 1.0;
                    logits.extend(row);
                }
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
}

#[cfg(test)]
mod tests {
    use super::test_support::{PoolEcho, BLOCK};
    use super::*;
    use novainfer_core::{Scheduler, SchedulerConfig};

    const VOCAB: usize = 11;

    /// The drafts a model without KV would make: each from the whole sequence so far.
    fn reference(tokens: &[u32], k: usize) -> Vec<u32> {
        let mut seq = tokens.to_vec();
        for _ in 0..k {
            seq.push(test_support::next(&seq, VOCAB));
        }
        seq.split_off(tokens.len())
    }

    /// The target's scheduler over `num_blocks` blocks of [`BLOCK`] tokens.
    fn scheduler(num_blocks: usize, max_model_len: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig::builder()
                .max_num_batched_tokens(1024)
                .max_num_seqs(8)
                .max_model_len(max_model_len)
                .block_size(BLOCK)
                .num_blocks(num_blocks)
                .build()
                .expect("valid config"),
        )
    }

    /// One step of the target (its model left out): `sample` gives the tokens of each sampled
    /// request from its verified draft (the draft's confirmed prefix, then one of its own).
    fn target_step(s: &mut Scheduler, mut sample: impl FnMut(RequestId, &[u32]) -> Vec<u32>) {
        let out = s.schedule();
        let sampled: Vec<(RequestId, Vec<u32>)> = out
            .scheduled
            .iter()
            .filter(|c| c.sample())
            .map(|c| (c.request_id, sample(c.request_id, c.draft_token_ids())))
            .collect();
        s.update(&out, &sampled);
    }

    /// A scheduler running `prompts` (ids 1, 2, …), each past its first output token.
    fn decoding(s: &mut Scheduler, prompts: &[Vec<u32>]) -> Vec<RequestId> {
        let ids: Vec<RequestId> = (1..=prompts.len() as u64).map(RequestId).collect();
        for (&id, prompt) in ids.iter().zip(prompts) {
            s.add_request(Request::new(id, prompt.clone(), 500));
        }
        target_step(s, |id, _| vec![id.0 as u32]);
        ids
    }

    fn tokens(s: &Scheduler, id: RequestId) -> Vec<u32> {
        let r = s.request(id).expect("running");
        r.token_ids(0..r.num_tokens())
    }

    #[test]
    fn drafts_follow_the_sequence_through_rejections_and_catch_up() {
        let mut s = scheduler(300, 512);
        // A catch-up budget of 20 tokens a step: the 46 tokens of a take three steps.
        let mut draft = DraftModel::new(Box::new(PoolEcho::new(300, VOCAB)), VOCAB, 20);
        let prompt: Vec<u32> = (0..45).map(|i| (i * 7 % VOCAB) as u32).collect();
        let ids = decoding(&mut s, &[prompt, vec![1, 2, 3]]);
        let (a, b) = (ids[0], ids[1]);
        let mut rng = 12345u64;
        let (mut drafted_a, mut drafted_b) = (0, 0);
        for step in 0..40 {
            let (out, work) = draft.propose(&mut s, &[(a, 4), (b, 3)]).expect("runs");
            if step == 0 {
                // Only a's first 20 prompt tokens, in one pass.
                let only_a = DraftWork {
                    passes: 1,
                    rows: 0,
                    catch_up: 20,
                };
                assert_eq!(work, only_a);
            }
            if out[0].len() == 4 {
                assert_eq!(
                    work.passes, 4,
                    "one pass per draft token of the longest draft"
                );
            }
            if !out[0].is_empty() {
                drafted_a += 1;
                assert_eq!(out[0], reference(&tokens(&s, a), 4), "step {step}");
            }
            // b waits while a's catch-up takes the whole budget.
            if !out[1].is_empty() {
                drafted_b += 1;
                assert_eq!(out[1], reference(&tokens(&s, b), 3), "step {step}");
            }
            for (id, d) in [(a, &out[0]), (b, &out[1])] {
                if !d.is_empty() {
                    assert!(s.set_draft(id, d.clone()));
                }
            }
            // The target keeps a random prefix of each draft, then adds a token of its own.
            target_step(&mut s, |_, d| {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let keep = (rng >> 33) as usize % (d.len() + 1);
                let mut kept = d[..keep].to_vec();
                kept.push((rng >> 40) as u32 % VOCAB as u32);
                kept
            });
        }
        // Three steps of catch-up, then a draft every step for both.
        assert_eq!((drafted_a, drafted_b), (38, 38));
        draft.retain(&mut |id| id == b);
        assert_eq!(draft.seqs.len(), 1);
    }

    #[test]
    fn the_drafts_blocks_come_from_the_pool_or_there_is_no_draft() {
        // Eleven blocks: the two 20-token prompts take ten; the first draft's positions take
        // the last one, and the second finds none.
        let mut s = scheduler(11, 44);
        let mut draft = DraftModel::new(Box::new(PoolEcho::new(11, VOCAB)), VOCAB, 1000);
        let ids = decoding(&mut s, &[vec![1; 20], vec![2; 20]]);
        assert_eq!(s.kv_stats().num_free_blocks, 1);
        let (out, _) = draft
            .propose(&mut s, &[(ids[0], 4), (ids[1], 4)])
            .expect("runs");
        assert_eq!(out[0], reference(&tokens(&s, ids[0]), 4));
        assert!(out[1].is_empty(), "no room for the second");
        assert_eq!(s.kv_stats().num_free_blocks, 0);
        // The target verifies the first draft in the blocks reserved for it.
        assert!(s.set_draft(ids[0], out[0].clone()));
        target_step(&mut s, |_, d| {
            let mut all = d.to_vec();
            all.push(0);
            all
        });
        assert_eq!(s.request(ids[0]).expect("running").num_tokens(), 26);
        // Finishes free every block, the draft's positions with them.
        for id in ids {
            s.abort_request(id);
        }
        assert_eq!(s.kv_stats().num_free_blocks, 11);
    }

    #[test]
    fn the_context_end_shortens_or_stops_the_drafts() {
        let mut s = scheduler(32, 64);
        let mut draft =
            DraftModel::new(Box::new(PoolEcho::new(32, VOCAB)), VOCAB, 1000).with_max_positions(30);
        // 30 tokens: at the draft's context end, nothing; 28: three drafts fit.
        let ids = decoding(&mut s, &[vec![1; 29], vec![2; 27]]);
        let (out, _) = draft
            .propose(&mut s, &[(ids[0], 4), (ids[1], 4)])
            .expect("runs");
        assert!(out[0].is_empty());
        assert_eq!(out[1], reference(&tokens(&s, ids[1]), 3));
    }

    #[test]
    fn a_preempted_request_is_read_again_from_its_first_token() {
        let mut s = scheduler(32, 64);
        let mut draft = DraftModel::new(Box::new(PoolEcho::new(32, VOCAB)), VOCAB, 1000);
        let ids = decoding(&mut s, &[vec![3; 10]]);
        let request = s.request(ids[0]).expect("running").clone();
        assert_eq!(draft.catch_up(&request), 11 - STEADY_FEED);
        draft.propose(&mut s, &[(ids[0], 2)]).expect("runs");
        assert_eq!(draft.catch_up(&request), 0);
        draft.forget(ids[0]);
        assert_eq!(draft.catch_up(&request), 11 - STEADY_FEED);
    }

    #[test]
    fn reconcile_keeps_the_confirmed_drafts_only() {
        let mut r = Request::new(RequestId(1), vec![1, 2, 3], 10);
        let mut seq = DraftSeq {
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
