//! Random workloads through `schedule()`/`update()` with a fake model whose KV is
//! simulated slot by slot: the "KV" at position p is a rolling hash of the KV at
//! p - 1 (read back through the block table) and token p, so a wrong block, a
//! stale prefix hit or a bad slot mapping changes the sampled tokens. Outputs must
//! equal what the same model gives a request run alone with no cache at all.
//! Every workload runs on the BLOCK layout or the SLOT layout (block size 1).
//! Requests with `n > 1` fork children when their prompt is computed, as the
//! engine does; child `k` starts from token `parent's + k` so the completions
//! differ, and each must equal the model run alone on prompt ++ that token.
//! Prefill-only requests (embeddings, scored prompts) are mixed in: an embedding's
//! hidden state must be its last prompt position's "KV", and a scored prompt must get a
//! row for every position, each equal to that position's "KV" computed alone.
//! Decoding requests get random drafts (speculative decoding), partly the model's true
//! continuation and partly noise; the fake model confirms the drafts that match its own next
//! tokens, and outputs must still equal the oracle's.
//! Requests carry priorities and tenants, under either scheduling policy. Beyond the
//! outputs, the bound checked: the first running request (in the policy's order) is
//! scheduled in every step once the budgets cover one token per seat, so once a request
//! heads the running order it never waits; under the priority policy, nobody is admitted
//! while a better-ranked (aged) request of the same tenant stays waiting, except a long
//! prompt held back by `max_long_partial_prefills`, or one whose LoRA adapter has no room.
//! Requests carry LoRA adapters (or none): the fake model's KV starts from the adapter's own
//! seed, so KV served across adapters by the prefix cache changes the outputs; and the running
//! requests never hold more distinct adapters than `max_loras`.
//! Half the workloads schedule ahead (async scheduling): each step is followed, where the
//! scheduler can, by one scheduled before its update (decodes fed the tokens it sampled, prompt
//! chunks, admissions) and run before that update; a request that the step ended keeps a row
//! that is computed and dropped. Outputs stay the oracle's.

use std::collections::HashMap;
use std::num::NonZeroU32;

use novainfer_core::{
    slot_mapping, AdapterId, BlockId, ChunkOutput, FinishReason, Fork, KvLayout, Request,
    RequestId, RequestKind, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput,
    SchedulingPolicy, Tenant, PENDING_TOKEN,
};
use proptest::prelude::*;

const VOCAB: u64 = 24;
const EOS: u32 = 0;

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The "KV" before position 0: the adapter's (a different adapter is a different model).
fn seed(adapter: Option<AdapterId>) -> u64 {
    adapter.map_or(0, |a| mix(a.0 ^ 0x10ca))
}

/// KV of position `pos` given the KV of `pos - 1` (or a seed at 0).
fn kv_at(prev: u64, token: u32, pos: usize) -> u64 {
    mix(prev ^ (u64::from(token) << 24) ^ pos as u64)
}

fn next_token(kv: u64) -> u32 {
    (mix(kv ^ 0xabcd) % VOCAB) as u32
}

#[derive(Debug, Clone)]
struct Arrival {
    step: usize,
    prefix: usize,
    prefix_len: usize,
    tail: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    abort_after: Option<usize>,
    n: usize,
    kind: RequestKind,
    priority: i32,
    tenant: u64,
    adapter: Option<AdapterId>,
}

#[derive(Debug, Clone)]
struct Workload {
    kv_layout: KvLayout,
    block_size: usize,
    num_blocks: usize,
    max_model_len: usize,
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
    prefix_caching: bool,
    threshold: Option<usize>,
    max_partial: Option<usize>,
    max_long_partial: Option<usize>,
    max_scored: usize,
    policy: SchedulingPolicy,
    aging_steps: usize,
    /// Most draft tokens proposed per decode (0: no speculation), and a seed for them.
    max_draft: usize,
    draft_seed: u64,
    max_loras: Option<usize>,
    /// Schedule the step after each step before its update when the scheduler can
    /// ([`Scheduler::schedule_ahead`]), as the engine's async scheduling does.
    ahead: bool,
    prefixes: Vec<Vec<u32>>,
    arrivals: Vec<Arrival>,
}

impl Workload {
    fn prompt(&self, a: &Arrival) -> Vec<u32> {
        let prefix = &self.prefixes[a.prefix];
        [&prefix[..a.prefix_len.min(prefix.len())], &a.tail[..]].concat()
    }
}

fn workload() -> impl Strategy<Value = Workload> {
    // SLOT: one cell per token, so block size 1 and the pool counted in cells.
    let layout = prop_oneof![
        (Just(KvLayout::Block), 1usize..=16, 4usize..=32),
        (Just(KvLayout::Slot), Just(1usize), 4usize..=160),
    ];
    layout
        .prop_flat_map(|(kv_layout, block_size, num_blocks)| {
            let capacity = block_size * num_blocks;
            (
                Just(kv_layout),
                Just(block_size),
                Just(num_blocks),
                (capacity.min(96) / 2).max(2)..=capacity.min(96),
                1usize..=64,
                1usize..=8,
                any::<bool>(),
                (
                    proptest::option::of(1usize..=16),
                    proptest::option::of(1usize..=3),
                    proptest::option::of(1usize..=2),
                    1usize..=12,
                ),
                (
                    prop_oneof![
                        Just(SchedulingPolicy::Fcfs),
                        Just(SchedulingPolicy::Priority)
                    ],
                    1usize..=8,
                    prop_oneof![Just(0usize), 1usize..=5],
                    any::<u64>(),
                    proptest::option::of(1usize..=2),
                    any::<bool>(),
                ),
                proptest::collection::vec(proptest::collection::vec(0u32..VOCAB as u32, 40), 3),
                proptest::collection::vec(arrival(), 1..=16),
            )
        })
        .prop_map(
            |(
                layout,
                bs,
                nb,
                mml,
                mnbt,
                mns,
                pc,
                (th, mp, mlp, ms),
                (policy, aging_steps, max_draft, draft_seed, max_loras, ahead),
                prefixes,
                arrivals,
            )| {
                Workload {
                    kv_layout: layout,
                    block_size: bs,
                    num_blocks: nb,
                    max_model_len: mml,
                    max_num_batched_tokens: mnbt,
                    max_num_seqs: mns,
                    prefix_caching: pc,
                    threshold: th,
                    max_partial: mp,
                    // Long prompts need a threshold to be told apart.
                    max_long_partial: mlp.filter(|_| th.is_some()),
                    max_scored: ms,
                    policy,
                    aging_steps,
                    max_draft,
                    draft_seed,
                    max_loras,
                    ahead,
                    prefixes,
                    arrivals,
                }
            },
        )
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (
        0usize..40,
        0usize..3,
        0usize..=32,
        proptest::collection::vec(0u32..VOCAB as u32, 0..=8),
        1usize..=24,
        any::<bool>(),
        proptest::option::weighted(0.2, 0usize..30),
        prop_oneof![3 => Just(1usize), 1 => 2usize..=3],
        prop_oneof![
            4 => Just(RequestKind::Generate),
            1 => Just(RequestKind::Embed),
            1 => Just(RequestKind::ScorePrompt)
        ],
        (
            -2i32..=2,
            0u64..3,
            prop_oneof![3 => Just(None), 1 => (1u64..=3).prop_map(|a| Some(AdapterId(a)))],
        ),
    )
        .prop_map(
            |(
                step,
                prefix,
                prefix_len,
                tail,
                max_tokens,
                ignore_eos,
                abort_after,
                n,
                kind,
                (priority, tenant, adapter),
            )| {
                Arrival {
                    step,
                    prefix,
                    prefix_len,
                    tail,
                    max_tokens,
                    ignore_eos,
                    abort_after,
                    // One completion: a prefill-only request has no samples to fork from.
                    n: if kind.is_prefill_only() { 1 } else { n },
                    kind,
                    priority,
                    tenant,
                    adapter,
                }
            },
        )
}

/// The "KV" at every position of `prompt` computed alone.
fn prompt_kv(prompt: &[u32], adapter: Option<AdapterId>) -> Vec<u64> {
    let mut kv = seed(adapter);
    prompt
        .iter()
        .enumerate()
        .map(|(pos, &t)| {
            kv = kv_at(kv, t, pos);
            kv
        })
        .collect()
}

/// What the model gives `prompt` alone, with the first sampled token replaced by
/// `first` if given: (output tokens, finish reason).
fn oracle(
    prompt: &[u32],
    a: &Arrival,
    max_model_len: usize,
    first: Option<u32>,
) -> (Vec<u32>, FinishReason) {
    if prompt.is_empty() || prompt.len() + 1 > max_model_len {
        return (Vec::new(), FinishReason::Ignored);
    }
    let mut tokens = prompt.to_vec();
    let mut kv = seed(a.adapter);
    let mut computed = 0;
    loop {
        for (pos, &t) in tokens.iter().enumerate().skip(computed) {
            kv = kv_at(kv, t, pos);
        }
        let t = match first {
            Some(t) if computed == 0 => t,
            _ => next_token(kv),
        };
        computed = tokens.len();
        tokens.push(t);
        let output = &tokens[prompt.len()..];
        if !a.ignore_eos && t == EOS {
            return (output.to_vec(), FinishReason::Stop);
        }
        if output.len() >= a.max_tokens || tokens.len() >= max_model_len {
            return (output.to_vec(), FinishReason::Length);
        }
    }
}

/// Simulated physical KV: one value per slot, tagged with its position; and what the
/// prefill-only requests got back: hidden states, and scored rows by position.
struct FakeModel {
    slots: Vec<Option<(usize, u64)>>,
    block_size: usize,
    hidden: HashMap<RequestId, u64>,
    rows: HashMap<RequestId, HashMap<usize, u64>>,
}

impl FakeModel {
    fn execute(&mut self, out: &SchedulerOutput, sched: &Scheduler) -> Vec<(RequestId, Vec<u32>)> {
        let kv = sched.kv().as_dyn();
        let bs = self.block_size;
        for c in &out.block_copies {
            for j in 0..c.num_tokens {
                self.slots[c.dst.index() * bs + j] = self.slots[c.src.index() * bs + j];
            }
        }
        let mut sampled = Vec::new();
        for s in &out.scheduled {
            let mut rows = Vec::new();
            let bs = self.block_size;
            let slots = slot_mapping(&s.block_table, s.start_position, s.token_ids.len(), bs);
            let mut prev = match s.start_position {
                0 => seed(s.adapter),
                p => {
                    let slot = s.block_table[(p - 1) / bs].index() * bs + (p - 1) % bs;
                    let (pos, kv) = self.slots[slot].expect("reading a slot never written");
                    assert_eq!(pos, p - 1, "slot holds another position");
                    kv
                }
            };
            for (i, (&t, &slot)) in s.token_ids.iter().zip(&slots).enumerate() {
                let pos = s.start_position + i;
                let block = BlockId((slot / bs) as u32);
                assert_eq!(
                    kv.ref_count(block),
                    1,
                    "writing into a shared block {block}"
                );
                prev = kv_at(prev, t, pos);
                self.slots[slot] = Some((pos, prev));
                rows.push(prev);
                if s.output == ChunkOutput::PromptLogits {
                    self.rows.entry(s.request_id).or_default().insert(pos, prev);
                }
            }
            if s.output == ChunkOutput::Hidden {
                assert!(
                    self.hidden.insert(s.request_id, prev).is_none(),
                    "hidden twice"
                );
            }
            if s.output == ChunkOutput::Verify {
                // Confirm drafts while they are the model's own next tokens, then sample one.
                let draft = s.draft_token_ids();
                let mut tokens = Vec::new();
                for (row, &d) in rows.iter().zip(draft) {
                    let t = next_token(*row);
                    tokens.push(t);
                    if t != d {
                        break;
                    }
                }
                if tokens.len() == draft.len() && tokens == draft {
                    tokens.push(next_token(rows[draft.len()]));
                }
                sampled.push((s.request_id, tokens));
            } else if s.sample() {
                sampled.push((s.request_id, vec![next_token(prev)]));
            }
        }
        sampled
    }

    /// A draft for a request whose tokens so far are `history`: each token the model's true
    /// continuation or noise, by `rng`.
    fn draft(history: &[u32], adapter: Option<AdapterId>, len: usize, rng: &mut u64) -> Vec<u32> {
        let mut kv = seed(adapter);
        for (pos, &t) in history.iter().enumerate() {
            kv = kv_at(kv, t, pos);
        }
        let mut out = Vec::new();
        for i in 0..len {
            *rng = mix(*rng);
            let t = if (*rng).is_multiple_of(4) {
                (*rng >> 8) as u32 % VOCAB as u32
            } else {
                next_token(kv)
            };
            kv = kv_at(kv, t, history.len() + i);
            out.push(t);
        }
        out
    }
}

/// What a step sampled, per request.
type Sampled = Vec<(RequestId, Vec<u32>)>;

fn ran_in(out: &SchedulerOutput, id: RequestId) -> bool {
    out.scheduled.iter().any(|s| s.request_id == id)
}

fn check_blocks(sched: &Scheduler) {
    let layouts = sched.kv();
    let kv = layouts.as_dyn();
    let stats = kv.stats();
    assert_eq!(
        stats.num_free_blocks + stats.num_used_blocks,
        stats.num_blocks
    );
    let mut holders = vec![0u32; stats.num_blocks];
    for (id, table) in kv.block_tables() {
        let r = sched.request(id).expect("a table for an unknown request");
        assert!(r.num_computed_tokens <= table.len() * kv.block_size());
        for b in table {
            holders[b.index()] += 1;
        }
    }
    for (b, &n) in holders.iter().enumerate() {
        assert_eq!(kv.ref_count(BlockId(b as u32)), n, "refcount of block {b}");
    }
    let Some(block) = layouts.as_block() else {
        // SLOT: no cached cells, so a cell is used iff a table holds it (forks share).
        let used = holders.iter().filter(|&&n| n > 0).count();
        assert_eq!(used, stats.num_used_blocks, "a used cell no table holds");
        return;
    };
    let pool = block.pool();
    let free = pool.free_queue();
    assert_eq!(free.len(), pool.num_free_blocks());
    assert!(free.iter().all(|&b| pool.ref_count(b) == 0));
}

fn run(w: &Workload) -> Result<(), TestCaseError> {
    let cfg = SchedulerConfig::builder()
        .kv_layout(w.kv_layout)
        .block_size(w.block_size)
        .num_blocks(w.num_blocks)
        .max_model_len(w.max_model_len)
        .max_num_batched_tokens(w.max_num_batched_tokens)
        .max_num_seqs(w.max_num_seqs)
        .enable_prefix_caching(w.prefix_caching)
        .long_prefill_token_threshold(w.threshold)
        .max_scored_tokens_per_step(w.max_scored)
        .max_num_partial_prefills(w.max_partial)
        .max_long_partial_prefills(w.max_long_partial)
        .policy(w.policy)
        .priority_aging_steps(w.aging_steps)
        .max_loras(w.max_loras)
        .build()
        .expect("the strategy only makes valid configs");
    let mut sched = Scheduler::new(cfg);
    let mut model = FakeModel {
        slots: vec![None; w.num_blocks * w.block_size],
        block_size: w.block_size,
        hidden: HashMap::new(),
        rows: HashMap::new(),
    };
    let prompts: Vec<Vec<u32>> = w.arrivals.iter().map(|a| w.prompt(a)).collect();
    // Request id -> (arrival, completion index); children are `CHILD * (k) + arrival`.
    const CHILD: u64 = 1000;
    let origin = |id: RequestId| ((id.0 % CHILD) as usize, (id.0 / CHILD) as usize);
    let mut history: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut finished: HashMap<RequestId, FinishReason> = HashMap::new();
    let last_arrival = w.arrivals.iter().map(|a| a.step).max().unwrap_or(0);
    let request = |i: usize, k: usize| {
        let a = &w.arrivals[i];
        // Tenant t weighs t + 1.
        let tenant = Tenant {
            id: a.tenant,
            weight: NonZeroU32::new(a.tenant as u32 + 1).expect("nonzero"),
        };
        let r = if a.kind.is_prefill_only() {
            Request::prefill_only(RequestId(i as u64), prompts[i].clone(), a.kind)
        } else {
            Request::new(
                RequestId(i as u64 + CHILD * k as u64),
                prompts[i].clone(),
                a.max_tokens,
            )
            .with_eos_token_ids(vec![EOS])
            .with_ignore_eos(a.ignore_eos)
        };
        r.with_priority(a.priority)
            .with_tenant(tenant)
            .with_adapter(a.adapter)
    };
    // Under the priority policy, a request's rank (aged priority, arrival): one level is worth
    // `aging_steps` steps of arrival, so the rank of two requests never changes with time.
    let rank = |r: &Request| {
        let virtual_arrival =
            i128::from(r.priority) * w.aging_steps as i128 + i128::from(r.arrival_step);
        (virtual_arrival, r.arrival_seq)
    };
    let is_held_long = |r: &Request| {
        w.max_long_partial.is_some() && w.threshold.is_some_and(|t| r.num_tokens() > t)
    };
    let max_steps = 20_000;
    let mut draft_rng = w.draft_seed;
    let mut inflight: Option<(SchedulerOutput, Sampled)> = None;
    for step in 0..max_steps {
        for (i, a) in w.arrivals.iter().enumerate() {
            if a.step == step {
                history.insert(RequestId(i as u64), prompts[i].clone());
                sched.add_request(request(i, 0));
            }
            if a.abort_after.map(|d| a.step + d) == Some(step) {
                // The engine aborts a request's completions together.
                for k in 0..a.n {
                    sched.abort_request(RequestId(i as u64 + CHILD * k as u64));
                }
            }
        }
        // A step scheduled ahead of the last update runs now; else a full schedule, checked.
        let (out, sampled) = match inflight.take() {
            Some(next) => next,
            None => {
                // Running requests by phase before this step: decoding (one token to compute) or still
                // computing their prompt (partial; long ones counted apart).
                let running: Vec<(RequestId, usize, usize)> = sched
                    .running_ids()
                    .iter()
                    .map(|&id| {
                        let r = sched.request(id).expect("a running request is known");
                        (id, r.num_uncomputed_tokens(), r.num_tokens())
                    })
                    .collect();
                let partial = running.iter().filter(|r| r.1 > 1);
                if let Some(max) = w.max_partial {
                    prop_assert!(partial.clone().count() <= max, "too many partial prefills");
                }
                if let (Some(max), Some(t)) = (w.max_long_partial, w.threshold) {
                    prop_assert!(
                        partial.filter(|r| r.2 > t).count() <= max,
                        "too many long partial prefills"
                    );
                }
                let waiting_before: Vec<(RequestId, Request)> = sched
                    .waiting_ids()
                    .map(|id| {
                        (
                            id,
                            sched
                                .request(id)
                                .expect("a waiting request is known")
                                .clone(),
                        )
                    })
                    .collect();
                let running_before: Vec<RequestId> = sched.running_ids().to_vec();
                let out = sched.schedule();
                prop_assert!(out.num_batched_tokens <= w.max_num_batched_tokens);
                let (running_adapters, _) = sched.adapters_in_use();
                if let Some(max) = w.max_loras {
                    prop_assert!(
                        running_adapters.len() <= max,
                        "more adapters running than max_loras"
                    );
                }
                // A waiting request whose adapter found no room this step.
                let held_by_adapter = |r: &Request| {
                    r.adapter.is_some_and(|a| !running_adapters.contains(&a))
                        && w.max_loras.is_some_and(|m| running_adapters.len() >= m)
                };
                // The bound: the head of the running order never waits a step.
                if w.max_num_batched_tokens >= w.max_num_seqs && w.max_scored >= w.max_num_seqs {
                    if let Some(head) = sched.running_ids().first() {
                        if running_before.contains(head) {
                            prop_assert!(ran_in(&out, *head), "head {} did not run", head);
                        }
                    }
                }
                if w.policy == SchedulingPolicy::Priority {
                    let admitted = waiting_before.iter().filter(|(id, _)| {
                        sched
                            .request(*id)
                            .is_some_and(|r| r.status() == RequestStatus::Running)
                    });
                    for (id, a) in admitted {
                        for (other, o) in &waiting_before {
                            let still_waiting = sched.request(*other).is_some_and(|r| {
                                matches!(
                                    r.status(),
                                    RequestStatus::Waiting | RequestStatus::Preempted
                                )
                            });
                            if o.tenant == a.tenant && still_waiting && rank(o) < rank(a) {
                                prop_assert!(
                                    is_held_long(o) || held_by_adapter(o),
                                    "{} admitted before better-ranked {}",
                                    id,
                                    other
                                );
                            }
                        }
                    }
                }
                // A prefill chunk never takes a decode's place: if anything but decodes ran, every
                // decoding request that was not preempted ran too.
                let decoding: Vec<RequestId> =
                    running.iter().filter(|r| r.1 == 1).map(|r| r.0).collect();
                let ran = |id: &RequestId| out.scheduled.iter().any(|s| s.request_id == *id);
                if out
                    .scheduled
                    .iter()
                    .any(|s| !decoding.contains(&s.request_id))
                {
                    for id in decoding.iter().filter(|id| !out.preempted.contains(id)) {
                        prop_assert!(ran(id), "decode of {} skipped for a prefill", id);
                    }
                }
                prop_assert_eq!(
                    out.num_batched_tokens,
                    out.scheduled
                        .iter()
                        .map(|s| s.token_ids.len())
                        .sum::<usize>()
                );
                prop_assert!(sched.num_running() <= w.max_num_seqs);
                for s in &out.scheduled {
                    let h = &history[&s.request_id];
                    let known = s.token_ids.len() - s.draft_token_ids().len();
                    let end = s.start_position + known;
                    prop_assert!(!s.token_ids.is_empty() && end <= h.len());
                    prop_assert_eq!(&s.token_ids[..known], &h[s.start_position..end]);
                    if s.output == ChunkOutput::Verify {
                        let r = sched
                            .request(s.request_id)
                            .expect("a verified request is known");
                        prop_assert_eq!(known, 1, "drafts only extend a decode");
                        prop_assert!(r.output_token_ids.len() + s.token_ids.len() <= r.max_tokens);
                        prop_assert!(h.len() + s.token_ids.len() <= w.max_model_len);
                    }
                    let kind = w.arrivals[origin(s.request_id).0].kind;
                    let want = match kind {
                        RequestKind::Generate if end == h.len() && s.token_ids.len() > known => {
                            ChunkOutput::Verify
                        }
                        RequestKind::Generate if end == h.len() => ChunkOutput::Sample,
                        RequestKind::Embed if end == h.len() => ChunkOutput::Hidden,
                        RequestKind::ScorePrompt => ChunkOutput::PromptLogits,
                        _ => ChunkOutput::Nothing,
                    };
                    prop_assert_eq!(s.output, want);
                }
                let scored: usize = out
                    .scheduled
                    .iter()
                    .filter(|s| s.output == ChunkOutput::PromptLogits)
                    .map(|s| s.token_ids.len())
                    .sum();
                prop_assert!(scored <= w.max_scored);
                check_blocks(&sched);
                let sampled = model.execute(&out, &sched);
                (out, sampled)
            }
        };
        for f in &out.finished {
            prop_assert!(finished.insert(f.request_id, f.reason).is_none());
        }
        if w.ahead {
            if let Some(ahead) = sched.schedule_ahead(&out) {
                // A pending request's input is the token `out` sampled for it, at the position
                // after its history (which `update(out)` has not extended yet); any other chunk
                // is known tokens after what `out` computed.
                let tokens: HashMap<RequestId, u32> = sampled
                    .iter()
                    .map(|(id, t)| (*id, *t.last().expect("a sample")))
                    .collect();
                let (mut next, pending_chunks) = ahead.into_parts();
                let mut pending = Vec::new();
                for i in pending_chunks {
                    let s = &mut next.scheduled[i];
                    prop_assert_eq!(&s.token_ids, &vec![PENDING_TOKEN]);
                    s.token_ids = vec![tokens[&s.request_id]];
                    pending.push(s.request_id);
                }
                prop_assert!(next.num_batched_tokens <= w.max_num_batched_tokens);
                prop_assert!(next.scheduled.len() <= w.max_num_seqs);
                prop_assert!(next.preempted.is_empty(), "a step ahead preempted");
                for s in &next.scheduled {
                    let h = &history[&s.request_id];
                    if pending.contains(&s.request_id) {
                        prop_assert_eq!(&s.token_ids, &vec![tokens[&s.request_id]]);
                        prop_assert_eq!(s.start_position, h.len());
                        prop_assert_eq!(s.output, ChunkOutput::Sample);
                    } else {
                        let end = s.start_position + s.token_ids.len();
                        prop_assert!(!s.token_ids.is_empty() && end <= h.len());
                        prop_assert_eq!(&s.token_ids[..], &h[s.start_position..end]);
                        let before = out.scheduled.iter().find(|c| c.request_id == s.request_id);
                        if let Some(c) = before {
                            prop_assert_eq!(s.start_position, c.start_position + c.token_ids.len());
                        }
                    }
                }
                check_blocks(&sched);
                let next_sampled = model.execute(&next, &sched);
                inflight = Some((next, next_sampled));
            }
        }
        let mut forks = Vec::new();
        for (id, tokens) in &sampled {
            let (i, k) = origin(*id);
            if k == 0 && history[id].len() == prompts[i].len() {
                for child in 1..w.arrivals[i].n {
                    let first_token = (tokens[0] + child as u32) % VOCAB as u32;
                    history.insert(request(i, child).id, prompts[i].clone());
                    forks.push(Fork {
                        parent: *id,
                        child: request(i, child),
                        first_token,
                    });
                }
            }
        }
        for u in sched.update_with_forks(&out, &sampled, forks) {
            history
                .get_mut(&u.request_id)
                .expect("an update for a request never added")
                .extend(&u.new_token_ids);
        }
        check_blocks(&sched);
        // No drafts while a step runs ahead (a draft follows the newest token, unknown then).
        if w.max_draft > 0 && inflight.is_none() {
            for id in sched.running_ids().to_vec() {
                draft_rng = mix(draft_rng ^ id.0);
                let len = (draft_rng % (w.max_draft as u64 + 1)) as usize;
                let adapter = sched.request(id).and_then(|r| r.adapter);
                let draft = FakeModel::draft(&history[&id], adapter, len, &mut draft_rng);
                // Half the time, as a draft model does, the blocks are first made to cover
                // the positions the draft writes (the newest token's, then drafts 1..len-1).
                let decoding = sched
                    .request(id)
                    .filter(|r| r.num_uncomputed_tokens() == 1)
                    .map(|r| r.num_tokens());
                if let Some(n) = decoding.filter(|_| draft_rng & 2 == 0) {
                    sched.reserve_slots(id, n + len.saturating_sub(1));
                }
                sched.set_draft(id, draft);
            }
        }
        if step > last_arrival && !sched.has_work() && inflight.is_none() {
            prop_assert_eq!(sched.kv_stats().num_used_blocks, 0, "a block leaked");
            prop_assert_eq!(finished.len(), history.len(), "a request vanished");
            for (&id, h) in &history {
                let (i, k) = origin(id);
                let a = &w.arrivals[i];
                if a.kind.is_prefill_only() {
                    let kv = prompt_kv(&prompts[i], a.adapter);
                    let fits = !kv.is_empty() && kv.len() <= w.max_model_len;
                    prop_assert_eq!(h, &prompts[i], "a prefill-only request got tokens");
                    match finished[&id] {
                        FinishReason::Abort => {}
                        FinishReason::Ignored => prop_assert!(!fits),
                        reason => {
                            prop_assert!(fits);
                            prop_assert_eq!(reason, FinishReason::Stop);
                            if a.kind == RequestKind::Embed {
                                prop_assert_eq!(model.hidden.get(&id), kv.last());
                            } else {
                                let rows = &model.rows[&id];
                                prop_assert_eq!(rows.len(), kv.len());
                                for (pos, v) in kv.iter().enumerate() {
                                    prop_assert_eq!(rows.get(&pos), Some(v), "row {}", pos);
                                }
                            }
                        }
                    }
                    continue;
                }
                let first = (k > 0).then(|| {
                    let (parent, _) = oracle(&prompts[i], a, w.max_model_len, None);
                    (parent[0] + k as u32) % VOCAB as u32
                });
                let (want, want_reason) = oracle(&prompts[i], a, w.max_model_len, first);
                let got = &h[prompts[i].len()..];
                if finished[&id] == FinishReason::Abort {
                    prop_assert!(want.starts_with(got), "aborted {}: not a prefix", id);
                } else {
                    prop_assert_eq!(got, &want[..], "request {}", id);
                    prop_assert_eq!(finished[&id], want_reason);
                }
            }
            // Every completion of a request that was not aborted or ignored was forked.
            for (i, a) in w.arrivals.iter().enumerate() {
                if matches!(
                    finished.get(&RequestId(i as u64)),
                    Some(FinishReason::Stop | FinishReason::Length)
                ) {
                    let forked = (1..a.n)
                        .filter(|&k| history.contains_key(&RequestId(i as u64 + CHILD * k as u64)))
                        .count();
                    prop_assert_eq!(forked, a.n - 1, "request {}: children missing", i);
                }
            }
            return Ok(());
        }
    }
    Err(TestCaseError::fail(format!(
        "not finished after {max_steps} steps"
    )))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_workloads_keep_invariants_and_outputs(w in workload()) {
        run(&w)?;
    }
}
