use super::*;
use crate::ids::BlockId;

fn config(batched: usize, seqs: usize, block_size: usize, num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig::builder()
        .max_num_batched_tokens(batched)
        .max_num_seqs(seqs)
        .max_model_len(num_blocks * block_size)
        .block_size(block_size)
        .num_blocks(num_blocks)
        .build()
        .expect("valid test config")
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request::new(RequestId(id), prompt, max_tokens)
}

/// Runs one step, sampling `token` for every request that needs it.
fn step(s: &mut Scheduler, token: u32) -> (SchedulerOutput, Vec<RequestUpdate>) {
    let out = s.schedule();
    let sampled: Vec<_> = out
        .scheduled
        .iter()
        .filter(|r| r.sample())
        .map(|r| (r.request_id, vec![token]))
        .collect();
    let updates = s.update(&out, &sampled);
    (out, updates)
}

fn shape(out: &SchedulerOutput) -> Vec<(u64, usize, usize, bool)> {
    out.scheduled
        .iter()
        .map(|r| {
            (
                r.request_id.0,
                r.start_position,
                r.token_ids.len(),
                r.sample(),
            )
        })
        .collect()
}

#[test]
fn a_long_prompt_is_chunked_and_sampled_only_at_its_end() {
    let mut s = Scheduler::new(config(4, 4, 4, 8));
    s.add_request(req(1, (0..10).collect(), 2));
    let (out, _) = step(&mut s, 50);
    assert_eq!(shape(&out), vec![(1, 0, 4, false)]);
    assert_eq!(out.scheduled[0].token_ids, vec![0, 1, 2, 3]);
    assert_eq!(out.scheduled[0].block_table, vec![BlockId(0)]);
    let (out, _) = step(&mut s, 50);
    assert_eq!(shape(&out), vec![(1, 4, 4, false)]);
    let (out, updates) = step(&mut s, 50);
    assert_eq!(shape(&out), vec![(1, 8, 2, true)]);
    assert_eq!(updates[0].new_token_ids, vec![50]);
    let (out, updates) = step(&mut s, 51);
    assert_eq!(shape(&out), vec![(1, 10, 1, true)]);
    assert_eq!(out.scheduled[0].token_ids, vec![50]);
    assert_eq!(updates[0].finish_reason, Some(FinishReason::Length));
    assert_eq!(s.kv_stats().num_used_blocks, 0);
    let out = s.schedule();
    assert_eq!(out.finished[0].request_id, RequestId(1));
    assert!(!s.has_work());
}

#[test]
fn running_requests_go_first_then_waiting_ones_fill_the_budget() {
    let mut s = Scheduler::new(config(6, 4, 4, 16));
    s.add_request(req(1, vec![1, 2], 8));
    step(&mut s, 9);
    s.add_request(req(2, (0..20).collect(), 8));
    s.add_request(req(3, vec![5], 8));
    let (out, _) = step(&mut s, 9);
    assert_eq!(shape(&out), vec![(1, 2, 1, true), (2, 0, 5, false)]);
    assert_eq!(out.num_batched_tokens, 6);
    let (out, _) = step(&mut s, 9);
    assert_eq!(shape(&out), vec![(1, 3, 1, true), (2, 5, 5, false)]);
}

#[test]
fn long_prefill_threshold_caps_each_chunk() {
    let cfg = SchedulerConfig::builder()
        .max_num_batched_tokens(100)
        .max_model_len(64)
        .block_size(4)
        .num_blocks(16)
        .long_prefill_token_threshold(Some(3))
        .build()
        .unwrap();
    let mut s = Scheduler::new(cfg);
    s.add_request(req(1, (0..7).collect(), 2));
    s.add_request(req(2, (0..2).collect(), 2));
    let (out, _) = step(&mut s, 9);
    assert_eq!(shape(&out), vec![(1, 0, 3, false), (2, 0, 2, true)]);
}

#[test]
fn out_of_blocks_preempts_the_newest_and_resumes_it_with_its_output() {
    // 4 blocks of 2 tokens; both requests fill 2 blocks after one decode each.
    let mut s = Scheduler::new(config(16, 4, 2, 4));
    s.add_request(req(1, vec![1, 2, 3], 8));
    s.add_request(req(2, vec![4, 5, 6], 8));
    let (out, _) = step(&mut s, 7);
    assert_eq!(shape(&out), vec![(1, 0, 3, true), (2, 0, 3, true)]);
    // Step 2: each needs no new block for position 3.
    let (out, _) = step(&mut s, 8);
    assert_eq!(shape(&out), vec![(1, 3, 1, true), (2, 3, 1, true)]);
    // Step 3: request 1 needs a third block; none free: request 2 is preempted.
    let (out, _) = step(&mut s, 9);
    assert_eq!(shape(&out), vec![(1, 4, 1, true)]);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    assert_eq!(s.num_preemptions(), 1);
    let r2 = s.request(RequestId(2)).unwrap();
    assert_eq!(
        (r2.status(), r2.num_computed_tokens),
        (RequestStatus::Preempted, 0)
    );
    assert_eq!(r2.output_token_ids, vec![7, 8]);
    // Abort request 1: request 2 resumes, recomputing prompt + its output, except
    // its first block [4, 5], which stayed in the prefix cache while free.
    assert!(s.abort_request(RequestId(1)));
    assert_eq!(s.kv_stats().num_used_blocks, 0);
    let (out, _) = step(&mut s, 10);
    assert_eq!(shape(&out), vec![(2, 2, 3, true)]);
    assert_eq!(out.scheduled[0].token_ids, vec![6, 7, 8]);
    assert!(out.scheduled[0].is_resumed_from_preemption);
    assert_eq!(out.finished[0].reason, FinishReason::Abort);
}

#[test]
fn a_request_that_would_preempt_itself_waits() {
    let mut s = Scheduler::new(config(16, 4, 2, 4));
    s.add_request(req(1, vec![1, 2, 3, 4, 5], 8)); // 3 blocks
    s.add_request(req(2, vec![6], 8)); // 1 block
    step(&mut s, 7);
    let (out, _) = step(&mut s, 7);
    assert_eq!(shape(&out), vec![(1, 5, 1, true), (2, 1, 1, true)]);
    // Request 1 needs a 4th block: it preempts request 2 and proceeds.
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    assert_eq!(shape(&out), vec![(1, 6, 1, true)]);
}

#[test]
fn a_waiting_request_that_does_not_fit_blocks_later_ones() {
    let mut s = Scheduler::new(config(64, 8, 2, 8));
    s.add_request(req(1, (0..10).collect(), 8)); // 5 blocks (+1 for its first decode)
    step(&mut s, 1);
    s.add_request(req(2, (0..8).map(|t| t + 100).collect(), 8)); // needs 4, only 2 left
    s.add_request(req(3, vec![1], 8)); // would fit, but must not overtake
    let (out, _) = step(&mut s, 1);
    assert_eq!(shape(&out), vec![(1, 10, 1, true)]);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn max_num_seqs_limits_admission() {
    let mut s = Scheduler::new(config(64, 2, 4, 16));
    for id in 1..=3 {
        s.add_request(req(id, vec![id as u32], 8));
    }
    let (out, _) = step(&mut s, 1);
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!(s.num_running(), 2);
}

#[test]
fn a_prompt_that_can_never_fit_is_ignored_and_reported() {
    let mut s = Scheduler::new(config(64, 2, 4, 4)); // max_model_len 16
    s.add_request(req(1, (0..16).collect(), 8));
    s.add_request(req(2, vec![], 8));
    assert!(s.has_work());
    let out = s.schedule();
    assert!(out.scheduled.is_empty());
    let reasons: Vec<_> = out
        .finished
        .iter()
        .map(|f| (f.request_id.0, f.reason))
        .collect();
    assert_eq!(
        reasons,
        vec![(1, FinishReason::Ignored), (2, FinishReason::Ignored)]
    );
    let detail = out.finished[0].detail.as_deref().unwrap();
    assert!(
        detail.contains("16 tokens") && detail.contains("max_model_len=16"),
        "{detail}"
    );
    assert!(!s.has_work());
}

#[test]
fn stop_tokens_eos_and_ignore_eos() {
    let mut s = Scheduler::new(config(64, 4, 4, 16));
    s.add_request(req(1, vec![1], 8).with_eos_token_ids(vec![0]));
    s.add_request(
        req(2, vec![1], 8)
            .with_eos_token_ids(vec![0])
            .with_ignore_eos(true),
    );
    s.add_request(req(3, vec![1], 8).with_stop_token_ids(vec![0]));
    let (_, updates) = step(&mut s, 0);
    let reasons: Vec<_> = updates.iter().map(|u| u.finish_reason).collect();
    assert_eq!(
        reasons,
        vec![Some(FinishReason::Stop), None, Some(FinishReason::Stop)]
    );
    assert_eq!(s.num_running(), 1);
    assert!(s.finish_request(RequestId(2), FinishReason::Stop));
    assert!(!s.finish_request(RequestId(2), FinishReason::Stop));
    assert_eq!(s.kv_stats().num_used_blocks, 0);
}

#[test]
fn a_prefix_hit_skips_cached_tokens_and_is_reported() {
    let mut s = Scheduler::new(config(64, 4, 4, 16));
    s.add_request(req(1, (0..10).collect(), 1));
    step(&mut s, 99);
    s.add_request(req(2, (0..9).collect(), 1));
    let (out, updates) = step(&mut s, 99);
    assert_eq!(shape(&out), vec![(2, 8, 1, true)]);
    assert_eq!(
        out.scheduled[0].block_table,
        vec![BlockId(0), BlockId(1), BlockId(3)]
    );
    assert_eq!(updates[0].num_cached_tokens, 8);
}

#[test]
fn aborting_a_waiting_request_removes_it() {
    let mut s = Scheduler::new(config(64, 4, 4, 16));
    s.add_request(req(1, vec![1], 8));
    assert!(s.abort_request(RequestId(1)));
    assert!(!s.abort_request(RequestId(1)));
    let out = s.schedule();
    assert!(out.scheduled.is_empty());
    assert_eq!(out.finished.len(), 1);
}

#[test]
fn without_prefix_caching_a_preempted_request_recomputes_everything() {
    let cfg = SchedulerConfig::builder()
        .max_num_batched_tokens(16)
        .max_model_len(8)
        .block_size(2)
        .num_blocks(4)
        .enable_prefix_caching(false)
        .build()
        .unwrap();
    let mut s = Scheduler::new(cfg);
    s.add_request(req(1, vec![1, 2, 3], 8));
    s.add_request(req(2, vec![4, 5, 6], 8));
    step(&mut s, 7);
    step(&mut s, 8);
    let (out, _) = step(&mut s, 9);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    s.abort_request(RequestId(1));
    let (out, _) = step(&mut s, 10);
    assert_eq!(shape(&out), vec![(2, 0, 5, true)]);
    assert_eq!(out.scheduled[0].token_ids, vec![4, 5, 6, 7, 8]);
    assert!(out.scheduled[0].is_resumed_from_preemption);
}

#[test]
fn a_self_preempting_request_is_not_scheduled_this_step() {
    let mut s = Scheduler::new(config(16, 4, 2, 4));
    s.add_request(req(1, vec![1, 2, 3], 8)); // blocks 0, 1 (room for position 3)
    s.add_request(req(2, vec![4, 5, 6, 7], 8)); // blocks 2, 3 (full)
    step(&mut s, 9);
    s.add_request(req(3, vec![1], 8));
    let (out, _) = step(&mut s, 9);
    // Request 2, the newest, needs a block for position 4: it preempts itself.
    assert_eq!(shape(&out), vec![(1, 3, 1, true)]);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    // No admission in a step that preempted; request 2 is ahead of request 3.
    assert_eq!(
        s.waiting_ids().collect::<Vec<_>>(),
        vec![RequestId(2), RequestId(3)]
    );
    assert_eq!(
        s.request(RequestId(2)).unwrap().status(),
        RequestStatus::Preempted
    );
}

fn fork_of(parent: u64, child: u64, prompt: Vec<u32>, first_token: u32) -> Fork {
    Fork {
        parent: RequestId(parent),
        child: req(child, prompt, 4),
        first_token,
    }
}

#[test]
fn forks_share_full_blocks_copy_the_partial_one_and_skip_the_prompt() {
    let mut s = Scheduler::new(config(64, 4, 4, 16));
    let prompt: Vec<u32> = (0..10).collect();
    s.add_request(req(1, prompt.clone(), 4));
    let out = s.schedule();
    assert_eq!(shape(&out), vec![(1, 0, 10, true)]);
    let forks = vec![
        fork_of(1, 2, prompt.clone(), 21),
        fork_of(1, 3, prompt.clone(), 22),
    ];
    let updates = s.update_with_forks(&out, &[(RequestId(1), vec![20])], forks);
    let firsts: Vec<_> = updates
        .iter()
        .map(|u| (u.request_id.0, u.new_token_ids.clone()))
        .collect();
    assert_eq!(firsts, vec![(1, vec![20]), (2, vec![21]), (3, vec![22])]);
    let kv = s.kv().as_block().expect("block layout");
    let parent = kv.block_table(RequestId(1)).to_vec();
    for child in [2, 3] {
        let table = kv.block_table(RequestId(child));
        assert_eq!(table[..2], parent[..2], "full blocks are shared");
        assert_ne!(table[2], parent[2], "the partial block is the child's own");
    }
    assert_eq!(kv.pool().ref_count(parent[0]), 3);
    let out = s.schedule();
    // The prompt is not computed again: one decode token each.
    assert_eq!(
        shape(&out),
        vec![(1, 10, 1, true), (2, 10, 1, true), (3, 10, 1, true)]
    );
    let copies: Vec<_> = out
        .block_copies
        .iter()
        .map(|c| (c.src, c.num_tokens))
        .collect();
    assert_eq!(copies, vec![(parent[2], 2), (parent[2], 2)]);
    assert_eq!(out.scheduled[1].token_ids, vec![21]);
}

#[test]
fn a_fork_without_a_free_seq_waits_first_in_line_and_recomputes() {
    let mut s = Scheduler::new(config(64, 1, 4, 16));
    let prompt: Vec<u32> = (0..6).collect();
    s.add_request(req(1, prompt.clone(), 2));
    s.add_request(req(9, vec![7, 7], 2));
    let out = s.schedule();
    let updates = s.update_with_forks(
        &out,
        &[(RequestId(1), vec![20])],
        vec![fork_of(1, 2, prompt, 21)],
    );
    assert_eq!(updates.len(), 2);
    assert_eq!(
        s.waiting_ids().collect::<Vec<_>>(),
        vec![RequestId(2), RequestId(9)]
    );
    step(&mut s, 30); // request 1 finishes (max_tokens 2)
    let (out, _) = step(&mut s, 31);
    // Prompt plus its first token, recomputed after the prefix cache's full block.
    assert_eq!(shape(&out), vec![(2, 4, 3, true)]);
    assert_eq!(*out.scheduled[0].token_ids.last().unwrap(), 21);
}

#[test]
fn a_fork_done_at_its_first_token_never_takes_kv() {
    let mut s = Scheduler::new(config(64, 4, 4, 16));
    let prompt: Vec<u32> = (0..6).collect();
    s.add_request(req(1, prompt.clone(), 4));
    let out = s.schedule();
    let mut fork = fork_of(1, 2, prompt, 0);
    fork.child = fork.child.with_eos_token_ids(vec![0]);
    let updates = s.update_with_forks(&out, &[(RequestId(1), vec![20])], vec![fork]);
    assert_eq!(updates[1].finish_reason, Some(FinishReason::Stop));
    assert!(s.kv().as_dyn().block_table(RequestId(2)).is_empty());
    assert_eq!(s.num_running(), 1);
    assert_eq!(s.schedule().finished[0].request_id, RequestId(2));
}

fn outputs(out: &SchedulerOutput) -> Vec<(u64, usize, usize, ChunkOutput)> {
    out.scheduled
        .iter()
        .map(|r| {
            (
                r.request_id.0,
                r.start_position,
                r.token_ids.len(),
                r.output,
            )
        })
        .collect()
}

#[test]
fn an_embedding_is_chunked_returns_its_hidden_state_once_and_finishes_without_sampling() {
    let mut s = Scheduler::new(config(4, 4, 4, 8));
    s.add_request(Request::prefill_only(
        RequestId(1),
        (0..10).collect(),
        RequestKind::Embed,
    ));
    let (out, updates) = step(&mut s, 50);
    assert_eq!(outputs(&out), vec![(1, 0, 4, ChunkOutput::Nothing)]);
    assert_eq!(updates[0].finish_reason, None);
    step(&mut s, 50);
    let (out, updates) = step(&mut s, 50);
    assert_eq!(outputs(&out), vec![(1, 8, 2, ChunkOutput::Hidden)]);
    assert_eq!(updates[0].new_token_ids, Vec::<u32>::new());
    assert_eq!(updates[0].finish_reason, Some(FinishReason::Stop));
    assert_eq!(s.kv_stats().num_used_blocks, 0);
    assert_eq!(s.schedule().finished[0].request_id, RequestId(1));
    assert!(!s.has_work());
}

#[test]
fn an_input_of_exactly_max_model_len_fits_an_embedding_but_not_a_generation() {
    let mut s = Scheduler::new(config(64, 4, 4, 4)); // max_model_len 16
    s.add_request(Request::prefill_only(
        RequestId(1),
        (0..16).collect(),
        RequestKind::Embed,
    ));
    s.add_request(req(2, (0..16).collect(), 1));
    let (out, _) = step(&mut s, 0);
    assert_eq!(outputs(&out), vec![(1, 0, 16, ChunkOutput::Hidden)]);
    let ignored: Vec<_> = out
        .finished
        .iter()
        .filter(|f| f.reason == FinishReason::Ignored)
        .map(|f| f.request_id.0)
        .collect();
    assert_eq!(ignored, vec![2]);
}

#[test]
fn scored_prompts_share_a_row_budget_per_step_and_never_take_a_prefix_hit() {
    let cfg = SchedulerConfig::builder()
        .max_num_batched_tokens(64)
        .max_num_seqs(4)
        .max_model_len(64)
        .block_size(4)
        .num_blocks(64)
        .max_scored_tokens_per_step(6)
        .build()
        .unwrap();
    let mut s = Scheduler::new(cfg);
    // Cache a prefix first: a generation over the same 12 tokens.
    s.add_request(req(1, (0..12).collect(), 1));
    step(&mut s, 7);
    s.add_request(Request::prefill_only(
        RequestId(2),
        (0..12).collect(),
        RequestKind::ScorePrompt,
    ));
    s.add_request(Request::prefill_only(
        RequestId(3),
        (0..3).collect(),
        RequestKind::ScorePrompt,
    ));
    s.add_request(req(4, vec![9, 9], 1));
    let (out, _) = step(&mut s, 7);
    // 2 scores from 0 (no hit) with all 6 rows; 3 finds no rows left and, FCFS, holds back 4.
    assert_eq!(outputs(&out), vec![(2, 0, 6, ChunkOutput::PromptLogits)]);
    let (out, _) = step(&mut s, 7);
    assert_eq!(outputs(&out), vec![(2, 6, 6, ChunkOutput::PromptLogits)]);
    let (out, updates) = step(&mut s, 7);
    assert_eq!(
        outputs(&out),
        vec![
            (3, 0, 3, ChunkOutput::PromptLogits),
            (4, 0, 2, ChunkOutput::Sample)
        ]
    );
    assert!(updates.iter().all(|u| u.finish_reason.is_some()));
    assert_eq!(s.kv_stats().num_used_blocks, 0);
}

#[test]
fn a_preempted_scored_prompt_is_recomputed_from_its_first_token() {
    // Pool of 5 blocks of 4, budget 4: the scored prompt (14 tokens) fills the pool while an
    // older generation decodes; the generation's next block preempts it.
    let mut s = Scheduler::new(config(4, 4, 4, 5));
    s.add_request(req(1, vec![1, 2], 12));
    s.add_request(Request::prefill_only(
        RequestId(2),
        (0..14).collect(),
        RequestKind::ScorePrompt,
    ));
    let mut chunks = Vec::new();
    for _ in 0..40 {
        if !s.has_work() {
            break;
        }
        let (out, _) = step(&mut s, 3);
        chunks.extend(
            out.scheduled
                .iter()
                .filter(|r| r.request_id == RequestId(2))
                .map(|r| (r.start_position, r.token_ids.len())),
        );
    }
    assert!(!s.has_work());
    assert!(
        s.num_preemptions() > 0,
        "the test must exercise a preemption"
    );
    // Every (re)start computes from token 0: no row is skipped; it ends with the last token.
    assert!(
        chunks.iter().filter(|c| c.0 == 0).count() >= 2,
        "{chunks:?}"
    );
    assert_eq!(chunks.last().map(|c| c.0 + c.1), Some(14), "{chunks:?}");
}

#[test]
fn decodes_are_scheduled_before_older_prefill_chunks() {
    let cfg = SchedulerConfig::builder()
        .max_num_batched_tokens(8)
        .max_model_len(64)
        .block_size(4)
        .num_blocks(32)
        .long_prefill_token_threshold(Some(6))
        .build()
        .unwrap();
    let mut s = Scheduler::new(cfg);
    s.add_request(req(1, (0..40).collect(), 4));
    s.add_request(req(2, vec![1, 2], 4));
    let (out, _) = step(&mut s, 9);
    assert_eq!(
        outputs(&out),
        vec![
            (1, 0, 6, ChunkOutput::Nothing),
            (2, 0, 2, ChunkOutput::Sample)
        ]
    );
    // 1 is older, but 2's decode goes first; 1's chunk gets what is left.
    let (out, _) = step(&mut s, 9);
    assert_eq!(
        outputs(&out),
        vec![
            (2, 2, 1, ChunkOutput::Sample),
            (1, 6, 6, ChunkOutput::Nothing)
        ]
    );
}

#[test]
fn a_short_prompt_overtakes_a_long_one_held_by_the_long_prefill_limit() {
    let cfg = SchedulerConfig::builder()
        .max_num_batched_tokens(16)
        .max_num_seqs(8)
        .max_model_len(128)
        .block_size(4)
        .num_blocks(64)
        .long_prefill_token_threshold(Some(8))
        .max_num_partial_prefills(Some(3))
        .max_long_partial_prefills(Some(1))
        .build()
        .unwrap();
    let mut s = Scheduler::new(cfg);
    s.add_request(req(1, (0..60).collect(), 2)); // long
    s.add_request(req(2, (100..160).collect(), 2)); // long, waits for a long slot
    s.add_request(req(3, vec![5, 6, 7], 2)); // short: goes ahead of 2
    let (out, _) = step(&mut s, 9);
    assert_eq!(
        outputs(&out),
        vec![
            (1, 0, 8, ChunkOutput::Nothing),
            (3, 0, 3, ChunkOutput::Sample)
        ]
    );
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![RequestId(2)]);
    // 2 keeps its place at the head and is admitted once 1's prompt is done (8 chunks).
    let mut admitted_at = None;
    for i in 2..=12 {
        let (out, _) = step(&mut s, 9);
        if out.scheduled.iter().any(|r| r.request_id == RequestId(2)) {
            admitted_at = Some(i);
            break;
        }
    }
    assert_eq!(admitted_at, Some(9));
}

fn priority_config(seqs: usize, num_blocks: usize, aging: usize) -> SchedulerConfig {
    SchedulerConfig::builder()
        .max_num_batched_tokens(64)
        .max_num_seqs(seqs)
        .max_model_len(24)
        .block_size(4)
        .num_blocks(num_blocks)
        .policy(SchedulingPolicy::Priority)
        .priority_aging_steps(aging)
        .build()
        .unwrap()
}

fn admitted(out: &SchedulerOutput) -> Vec<u64> {
    out.scheduled
        .iter()
        .filter(|r| r.start_position == 0)
        .map(|r| r.request_id.0)
        .collect()
}

#[test]
fn the_priority_policy_admits_lower_values_first_and_fcfs_among_equals() {
    let mut s = Scheduler::new(priority_config(2, 32, 1000));
    s.add_request(req(1, vec![1, 2], 4).with_priority(5));
    s.add_request(req(2, vec![1, 2], 4).with_priority(-1));
    s.add_request(req(3, vec![1, 2], 4).with_priority(0));
    s.add_request(req(4, vec![1, 2], 4).with_priority(-1));
    let (out, _) = step(&mut s, 9);
    assert_eq!(admitted(&out), vec![2, 4]);
    assert_eq!(s.num_waiting_by_priority(), vec![(0, 1), (5, 1)]);
}

#[test]
fn preemption_takes_the_worst_ranked_newest_running_request() {
    // 6 blocks of 4: three requests of 8 tokens fill the pool; a decode needs a block.
    let mut s = Scheduler::new(priority_config(4, 6, 1000));
    s.add_request(req(1, (0..8).collect(), 8).with_priority(0));
    s.add_request(req(2, (10..18).collect(), 8).with_priority(3));
    s.add_request(req(3, (20..28).collect(), 8).with_priority(1));
    let (out, _) = step(&mut s, 9);
    assert_eq!(admitted(&out), vec![1, 3, 2]);
    let (out, _) = step(&mut s, 9);
    // Request 1 (first in rank) needs a 3rd block: 2 (priority 3) goes, though 3 is newer.
    assert_eq!(out.preempted, vec![RequestId(2)]);
}

/// The step at which request 1000 (priority 2, arriving first) is admitted to the one seat
/// while a priority-0 request arrives every step and each runs 3 steps, if within 100 steps.
fn admission_among_a_stream(aging: usize) -> Option<u64> {
    let mut s = Scheduler::new(priority_config(1, 32, aging));
    s.add_request(req(1000, vec![1, 2], 3).with_priority(2));
    for i in 0..100u64 {
        s.add_request(req(i, vec![1, 2], 3).with_priority(0));
        let (out, _) = step(&mut s, 9);
        if admitted(&out).contains(&1000) {
            return Some(i);
        }
    }
    None
}

#[test]
fn aging_lets_a_low_priority_request_pass_a_stream_of_high_priority_ones() {
    // Everyone ages, so only requests arriving within (2 - 0) * aging steps of request 1000
    // can ever rank before it (and one more on the tie step): its wait is their service.
    let aging = 5;
    let at = admission_among_a_stream(aging).expect("the low-priority request starved");
    let overtakers = 2 * aging as u64 + 1;
    assert!(at <= overtakers * 3, "admitted at step {at}");
    // Without aging it would starve.
    assert_eq!(admission_among_a_stream(1_000_000), None);
}

#[test]
fn aging_never_reorders_two_running_requests() {
    // B is one level better than A and arrives 2 steps later; a level is worth 6 steps, so B
    // ranks first for good. Counting age in whole levels made A and B swap places every time
    // one of them crossed a level boundary: two requests that cannot share the KV pool then
    // preempted each other for ever (found by the property test).
    let mut s = Scheduler::new(priority_config(2, 32, 6));
    s.add_request(req(1, vec![1, 2], 100).with_priority(0));
    step(&mut s, 9);
    step(&mut s, 9);
    s.add_request(req(2, vec![1, 2], 100).with_priority(-1));
    // Admitted at the back; the next step sorts the running order.
    step(&mut s, 9);
    for _ in 0..18 {
        step(&mut s, 9);
        assert_eq!(s.running_ids(), &[RequestId(2), RequestId(1)]);
    }
}

fn tenant(id: u64, weight: u32) -> crate::request::Tenant {
    crate::request::Tenant {
        id,
        weight: std::num::NonZeroU32::new(weight).unwrap(),
    }
}

#[test]
fn a_flooding_tenant_leaves_seats_to_the_others_in_proportion_to_their_weights() {
    let cfg = SchedulerConfig::builder()
        .max_num_batched_tokens(256)
        .max_num_seqs(8)
        .max_model_len(32)
        .block_size(4)
        .num_blocks(256)
        .build()
        .unwrap();
    let mut s = Scheduler::new(cfg);
    // Tenant 1 (weight 1) queues 40 requests before tenant 2 (weight 3) queues 40.
    for i in 0..40 {
        s.add_request(req(i, vec![1, 2], 4).with_tenant(tenant(1, 1)));
    }
    for i in 100..140 {
        s.add_request(req(i, vec![1, 2], 4).with_tenant(tenant(2, 3)));
    }
    let (out, _) = step(&mut s, 9);
    // First step: seats go 1:3 although all of tenant 1's requests came first.
    let of = |ids: &[u64], t: u64| ids.iter().filter(|&&i| (i >= 100) == (t == 2)).count();
    let first = admitted(&out);
    assert_eq!((of(&first, 1), of(&first, 2)), (2, 6), "{first:?}");
    // Over the whole run, completions keep the 1:3 ratio while both have work queued.
    let mut done = (0, 0);
    while done.0 + done.1 < 40 {
        let (_, updates) = step(&mut s, 9);
        for u in updates.iter().filter(|u| u.finish_reason.is_some()) {
            if u.request_id.0 >= 100 {
                done.1 += 1;
            } else {
                done.0 += 1;
            }
        }
    }
    assert_eq!(done, (10, 30));
}

#[test]
fn a_prefill_chunk_preempts_nobody_when_that_would_not_make_room() {
    // 8 blocks of 4: A (12 tokens) holds 3, B and C (8 each) 2 each; 1 is free.
    let mut s = Scheduler::new(config(64, 4, 4, 8));
    s.add_request(req(1, (0..12).collect(), 8));
    s.add_request(req(2, (20..28).collect(), 8));
    s.add_request(req(3, (40..48).collect(), 8));
    step(&mut s, 9);
    let mut out = SchedulerOutput::default();
    let mut budget = StepBudget {
        tokens: 64,
        scored_tokens: 64,
    };
    // B wants 16 more tokens: 4 blocks, but only the free one and C's 2 could be had.
    assert!(!s.allocate_or_preempt_later(RequestId(2), 16, &mut budget, &mut out));
    assert!(out.preempted.is_empty(), "{:?}", out.preempted);
    assert_eq!(s.num_running(), 3);
    // 12 more tokens (3 blocks) fit once C is gone: C alone is preempted.
    assert!(s.allocate_or_preempt_later(RequestId(2), 12, &mut budget, &mut out));
    assert_eq!(out.preempted, vec![RequestId(3)]);
}

#[test]
fn reserved_slots_take_free_blocks_only_and_serve_the_next_verify() {
    // Six blocks of 4 tokens; max_model_len 24.
    let mut s = Scheduler::new(config(64, 4, 4, 6));
    s.add_request(req(1, vec![1; 8], 20));
    s.add_request(req(2, vec![2; 4], 20));
    step(&mut s, 5);
    let table = |s: &Scheduler, id: u64| s.kv().as_dyn().block_table(RequestId(id)).len();
    assert_eq!((table(&s, 1), table(&s, 2)), (2, 1));
    // Request 1's newest token (position 8) and four positions after it: two blocks more,
    // its counters untouched.
    assert!(s.reserve_slots(RequestId(1), 13));
    assert_eq!(table(&s, 1), 4);
    assert_eq!(s.request(RequestId(1)).unwrap().num_computed_tokens, 8);
    assert!(s.reserve_slots(RequestId(1), 10), "covered already");
    assert_eq!(table(&s, 1), 4);
    // Refused, with nothing taken: more blocks than are free (one), past max_model_len, or
    // a request that is not running.
    assert!(!s.reserve_slots(RequestId(2), 12));
    assert!(!s.reserve_slots(RequestId(1), 25));
    assert!(!s.reserve_slots(RequestId(9), 4));
    assert_eq!(table(&s, 2), 1);
    assert_eq!(s.kv_stats().num_free_blocks, 1);
    // The verify of four drafts runs in the reserved blocks; request 2's decode takes the
    // last free one.
    assert!(s.set_draft(RequestId(1), vec![5, 5, 5, 5]));
    let (out, _) = step(&mut s, 5);
    assert_eq!(
        shape(&out),
        vec![(1, 8, 5, true), (2, 4, 1, true)],
        "the decodes, request 1's with its drafts"
    );
    assert_eq!(table(&s, 1), 4);
    assert_eq!(s.kv_stats().num_free_blocks, 0);
}
