//! Async scheduling with the drawing toy backend of [`crate::device_draw_tests`]: a run that
//! schedules steps ahead streams exactly what the same run in order streams (tokens, logprobs,
//! finish reasons), through aborts, stop strings and arrivals while a step runs ahead, and
//! leaves no block held.

use std::collections::HashMap;
use std::sync::mpsc;

use novainfer_core::{FinishReason, RequestId, SamplingParams};
use novainfer_model::capabilities::{self, Capabilities};
use novainfer_model::sampler::SampledToken;

use crate::device_draw_tests::{drawing, engine_in_flight, engine_scheduling, params, Tokens};
use crate::output_processor::OutputEvent;
use crate::{EngineStats, Scheduling};

/// Something done to the engine between two steps.
#[derive(Clone)]
enum Action {
    Add(u64, Vec<u32>, Box<SamplingParams>),
    Abort(u64),
    /// What the output thread does when it finds a stop string.
    StopString(u64),
    /// A prompt to score (every position's logits): a prefill-only request whose steps are
    /// not sampled rows only, so a backend runs them at once, not in flight.
    Score(u64, Vec<u32>),
}

/// What a run streamed and counted.
struct Run {
    tokens: Tokens,
    finish: HashMap<RequestId, FinishReason>,
    stats: EngineStats,
    /// Rows the backend computed a token for.
    rows: usize,
}

/// Runs `actions` (each before the step of its index) to the end.
fn run(caps: Capabilities, async_scheduling: bool, actions: &[(usize, Action)]) -> Run {
    let (core, rx, asked, _) = engine_scheduling(caps, None, async_scheduling);
    run_on(core, rx, &asked, actions)
}

/// [`run`] with async scheduling over a backend that leaves passes in flight and takes chained
/// tokens from its own draws (as the CUDA executor does); and how many passes were enqueued
/// while an earlier one was still in flight.
fn run_in_flight(caps: Capabilities, actions: &[(usize, Action)]) -> (Run, usize) {
    let (core, rx, asked, overlapped) = engine_in_flight(caps);
    let run = run_on(core, rx, &asked, actions);
    (run, overlapped.load(std::sync::atomic::Ordering::Relaxed))
}

fn run_on(
    mut core: crate::EngineCore,
    rx: mpsc::Receiver<Vec<OutputEvent>>,
    asked: &crate::device_draw_tests::Asked,
    actions: &[(usize, Action)],
) -> Run {
    let (sink, _deltas) = mpsc::channel();
    let mut tokens = Tokens::new();
    let mut finish = HashMap::new();
    let mut step = 0;
    loop {
        for (_, action) in actions.iter().filter(|(at, _)| *at == step) {
            match action.clone() {
                Action::Add(id, prompt, params) => {
                    let request = core
                        .frontend()
                        .check_request(prompt, *params)
                        .expect("request accepted");
                    core.add_request(
                        RequestId(id),
                        request,
                        Scheduling::default(),
                        sink.clone().into(),
                    );
                }
                Action::Abort(id) => core.abort(RequestId(id)),
                Action::StopString(id) => core.finish(RequestId(id), FinishReason::Stop),
                Action::Score(id, prompt) => {
                    let reply: crate::prefill::Reply<Vec<f32>> = Box::new(|scored| {
                        assert!(scored.is_ok(), "the prompt was scored: {:?}", scored.err());
                    });
                    core.add_prefill(
                        RequestId(id),
                        prompt,
                        crate::prefill::PrefillTask::PromptLogits(reply),
                        None,
                    );
                }
            }
        }
        let more_actions = actions.iter().any(|(at, _)| *at > step);
        if !core.has_work() && !more_actions {
            break;
        }
        assert!(step < 400, "the requests finished");
        core.step();
        step += 1;
        while let Ok(events) = rx.try_recv() {
            for event in events {
                match event {
                    OutputEvent::Token {
                        id,
                        token,
                        finish: f,
                        ..
                    } => {
                        assert!(!finish.contains_key(&id), "{id}: a token after its end");
                        tokens.entry(id).or_default().push(token);
                        if let Some(f) = f {
                            finish.insert(id, f);
                        }
                    }
                    OutputEvent::Finished { id, reason } => {
                        finish.entry(id).or_insert(reason);
                    }
                    OutputEvent::Failed { error, .. } => panic!("request failed: {error}"),
                    OutputEvent::Register { .. } => {}
                }
            }
        }
    }
    let rows = asked.lock().expect("lock").len();
    Run {
        tokens,
        finish,
        stats: core.stats(),
        rows,
    }
}

fn ids(tokens: &[SampledToken]) -> Vec<u32> {
    tokens.iter().map(|t| t.token_id).collect()
}

/// Every completion got the same tokens (and logprobs) and the same end in both runs.
fn assert_same_streams(ordered: &Run, ahead: &Run) {
    assert_eq!(ordered.finish, ahead.finish, "finish reasons");
    assert_eq!(ordered.tokens.len(), ahead.tokens.len(), "completions");
    for (id, want) in &ordered.tokens {
        let got = &ahead.tokens[id];
        assert_eq!(ids(got), ids(want), "{id}: tokens");
        for (a, b) in got.iter().zip(want) {
            assert!((a.logprob - b.logprob).abs() < 1e-6, "{id}: logprob");
            assert_eq!(a.top_logprobs.len(), b.top_logprobs.len(), "{id}: top");
        }
    }
    for run in [ordered, ahead] {
        assert_eq!(run.stats.kv.num_used_blocks, 0, "a block is still held");
        assert_eq!((run.stats.num_running, run.stats.num_waiting), (0, 0));
    }
}

fn build(b: novainfer_core::SamplingParamsBuilder) -> Box<SamplingParams> {
    Box::new(b.build().expect("valid"))
}

/// The greedy tokens the toy gives `prompt` (to pick a stop token it will meet).
fn greedy_tokens(prompt: &[u32], max_tokens: i64) -> Vec<u32> {
    let add = Action::Add(0, prompt.to_vec(), build(params(0.0, max_tokens)));
    ids(&run(drawing(), false, &[(0, add)]).tokens[&RequestId(0)])
}

#[test]
fn steps_ahead_stream_what_steps_in_order_stream() {
    let walk = greedy_tokens(&[9, 8, 7], 12);
    // Request 60 stops on the fourth token of that walk (its first occurrence).
    let stop = walk[3];
    let stops_at = walk.iter().position(|&t| t == stop).expect("in the walk");
    let requests = vec![
        (0, vec![5, 6, 7], params(0.0, 14)),
        (
            10,
            vec![8, 9],
            params(0.9, 14).seed(Some(3)).logprobs(Some(2)),
        ),
        (20, vec![11], params(1.0, 9).top_p(0.8).top_k(30)),
        (
            30,
            vec![17],
            params(0.0, 12).logit_bias(vec![(3, 1.5), (9, -100.0)]),
        ),
        (
            40,
            vec![21],
            params(0.7, 12).min_tokens(3).stop_token_ids(vec![2, 5]),
        ),
        (
            60,
            vec![9, 8, 7],
            params(0.0, 12).stop_token_ids(vec![stop]),
        ),
    ];
    let actions: Vec<(usize, Action)> = requests
        .into_iter()
        .map(|(id, prompt, p)| (0, Action::Add(id, prompt, build(p))))
        .collect();
    let ordered = run(drawing(), false, &actions);
    let ahead = run(drawing(), true, &actions);
    assert_same_streams(&ordered, &ahead);
    assert_eq!(ahead.tokens[&RequestId(60)].len(), stops_at + 1);
    assert_eq!(ahead.finish[&RequestId(60)], FinishReason::Stop);
    assert_eq!(ordered.stats.num_steps_ahead, 0);
    // Only the first step (nothing runs before it) and the last (everything ends by length)
    // are scheduled in order.
    assert_eq!(
        ahead.stats.num_steps - ahead.stats.num_steps_ahead,
        2,
        "steps in order"
    );
    // Each step applied one step's output: as many steps, as many tokens.
    assert_eq!(ahead.stats.num_steps, ordered.stats.num_steps);
    assert_eq!(
        ahead.stats.num_generated_tokens,
        ordered.stats.num_generated_tokens
    );
    // Request 60's stop token was not known when the step after it was launched: that row
    // was computed and dropped (a length end is known ahead, so it costs no row).
    assert!(ahead.rows > ordered.rows, "the stopped request's extra row");
}

#[test]
fn penalties_grammars_and_forks_run_in_order_beside_steps_ahead() {
    let regex = || Some(novainfer_core::StructuredOutput::Regex("(ab|ba)+c".into()));
    let actions = vec![
        (0, Action::Add(0, vec![5, 6], build(params(0.0, 16)))),
        // Penalties depend on the next token: the batch runs in order while 10 runs.
        (
            0,
            Action::Add(10, vec![7], build(params(0.0, 4).presence_penalty(1.0))),
        ),
        // A grammar's mask follows the next token.
        (
            5,
            Action::Add(
                20,
                vec![5, 6],
                build(params(0.0, 4).ignore_eos(false).structured_output(regex())),
            ),
        ),
        // n > 1: the shared first row is sampled on the host; the completions then draw.
        (
            10,
            Action::Add(30, vec![4, 4], build(params(1.0, 6).seed(Some(7)).n(2))),
        ),
    ];
    let ordered = run(drawing(), false, &actions);
    let ahead = run(drawing(), true, &actions);
    assert_same_streams(&ordered, &ahead);
    assert_eq!(
        ahead.tokens.len(),
        5,
        "four requests, one with two completions"
    );
    assert!(ahead.stats.num_steps_ahead > 0);
}

/// Four long greedy requests: one aborted after 4 steps, one stopped by a stop string after 6 (and
/// aborted again later, which changes nothing), one arriving after 8.
fn interrupted_actions() -> Vec<(usize, Action)> {
    let long = |id| Action::Add(id, vec![id as u32 % 20 + 3, 9], build(params(0.0, 24)));
    vec![
        (0, long(0)),
        (0, long(10)),
        (0, long(20)),
        (4, Action::Abort(10)),
        (6, Action::StopString(20)),
        (8, long(30)),
        (12, Action::Abort(20)),
    ]
}

#[test]
fn aborts_stop_strings_and_arrivals_while_a_step_runs_ahead() {
    let actions = interrupted_actions();
    let ordered = run(drawing(), false, &actions);
    let ahead = run(drawing(), true, &actions);
    assert_same_streams(&ordered, &ahead);
    assert_eq!(ahead.finish[&RequestId(10)], FinishReason::Abort);
    assert_eq!(ahead.finish[&RequestId(20)], FinishReason::Stop);
    assert_eq!(ahead.finish[&RequestId(0)], FinishReason::Length);
    assert_eq!(ahead.tokens[&RequestId(0)].len(), 24);
    assert_eq!(ahead.tokens[&RequestId(30)].len(), 24);
    // Stopped after 4 and 6 applied steps: as many tokens as in order.
    assert_eq!(ahead.tokens[&RequestId(10)].len(), 4);
    assert_eq!(ahead.tokens[&RequestId(20)].len(), 6);
    // An arrival is admitted by a step ahead; an abort or a stop string of a request in the
    // running step costs one step in order, as does the first.
    assert!(
        ahead.stats.num_steps - ahead.stats.num_steps_ahead <= 3,
        "{} of {} steps ahead",
        ahead.stats.num_steps_ahead,
        ahead.stats.num_steps
    );
    // The aborted and the stopped request each computed one row that was dropped.
    assert_eq!(ahead.rows, ordered.rows + 2);
}

/// A backend that leaves its passes in flight and takes chained tokens from its own draws (as
/// the CUDA executor does) streams what steps in order stream, through the first test's mix of
/// sampling options and the aborts, stop strings and arrivals above; and passes did overlap.
#[test]
fn passes_left_in_flight_stream_what_steps_in_order_stream() {
    let mixes = [
        vec![
            (0, Action::Add(0, vec![5, 6, 7], build(params(0.0, 14)))),
            (
                0,
                Action::Add(
                    10,
                    vec![8, 9],
                    build(params(0.9, 14).seed(Some(3)).logprobs(Some(2))),
                ),
            ),
            (
                0,
                Action::Add(20, vec![11], build(params(1.0, 9).top_p(0.8).top_k(30))),
            ),
            (
                0,
                Action::Add(
                    30,
                    vec![17],
                    build(params(0.0, 12).logit_bias(vec![(3, 1.5), (9, -100.0)])),
                ),
            ),
            (
                2,
                Action::Add(40, vec![21], build(params(0.0, 6).presence_penalty(0.5))),
            ),
        ],
        interrupted_actions(),
    ];
    for actions in mixes {
        let ordered = run(drawing(), false, &actions);
        let (in_flight, overlapped) = run_in_flight(drawing(), &actions);
        assert_same_streams(&ordered, &in_flight);
        assert!(in_flight.stats.num_steps_ahead > 0);
        assert!(overlapped > 0, "no pass was enqueued behind one in flight");
    }
}

/// A prompt scored among requests decoding ahead: its step runs at once (it is not sampled rows
/// only) and draws over what the pass before drew on the device, so the step after it must take
/// its chained tokens from the host, as the CUDA executor then says (`chains_on_device`).
#[test]
fn a_step_run_at_once_among_passes_in_flight_breaks_no_chain() {
    let actions = vec![
        (0, Action::Add(0, vec![5, 6, 7], build(params(0.0, 14)))),
        (
            0,
            Action::Add(10, vec![8, 9], build(params(0.9, 14).seed(Some(3)))),
        ),
        (3, Action::Score(50, vec![11, 12, 13, 14, 15])),
        (6, Action::Score(60, vec![16, 17])),
    ];
    let ordered = run(drawing(), false, &actions);
    let (in_flight, overlapped) = run_in_flight(drawing(), &actions);
    assert_same_streams(&ordered, &in_flight);
    assert!(in_flight.stats.num_steps_ahead > 0);
    assert!(overlapped > 0, "no pass was enqueued behind one in flight");
}

/// A backend that samples nothing itself (the CPU) gets its rows drawn on the device thread by
/// the device kernel's host twin: it then runs ahead and streams what a drawing backend streams in
/// order (the same counter-based generator), and greedy tokens equal its own host-sampled ones.
#[test]
fn a_backend_that_draws_nothing_gets_its_rows_drawn_and_runs_ahead() {
    let actions = vec![
        (0, Action::Add(0, vec![5, 6], build(params(0.0, 8)))),
        (
            0,
            Action::Add(10, vec![7], build(params(0.8, 8).seed(Some(1)))),
        ),
        (
            3,
            Action::Add(20, vec![8, 9], build(params(0.0, 6).presence_penalty(0.5))),
        ),
    ];
    let host = run(capabilities::CPU, false, &actions);
    let ahead = run(capabilities::CPU, true, &actions);
    let drawn = run(drawing(), false, &actions);
    assert_same_streams(&drawn, &ahead);
    assert!(ahead.stats.num_steps_ahead > 0);
    for id in [0, 20] {
        let id = RequestId(id);
        assert_eq!(
            ids(&ahead.tokens[&id]),
            ids(&host.tokens[&id]),
            "{id}: greedy"
        );
    }
}
