//! The engine's side of sampling on the device, with a toy backend (no model): which rows the
//! engine asks the backend to draw, that drawn tokens reach the right requests, and that a
//! backend whose capabilities say it draws nothing (the CPU) is never asked to.
//!
//! The toy's logits are a fixed function of a sequence's last token and position, and it
//! draws with the device kernel's CPU twin (`Draw::on_host`), exactly as the GPU would.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use novainfer_core::{RequestId, SamplingParams, SchedulerConfig};
use novainfer_model::capabilities::{self, Capabilities};
use novainfer_model::draw::RowEdit;
use novainfer_model::{
    Device, Draw, DrawRule, Enqueued, Executor, ForwardBatch, ForwardOutput, PassTicket,
    Qwen2Config, SpanOutput,
};

use crate::engine::LoadedEngine;
use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;
use crate::output_processor::OutputEvent;
use crate::{EngineCore, Scheduling};
use novainfer_model::sampler::SampledToken;

const BLOCK: usize = 4;

/// What the toy was asked for, per sampled span: its draw, or `None` for a logits row.
pub(crate) type Asked = Arc<Mutex<Vec<Option<Draw>>>>;

struct Toy {
    config: Qwen2Config,
    caps: Capabilities,
    asked: Asked,
    /// Verify spans drawn on the device (`SpanOutput::DrawEach`).
    verifies: Arc<AtomicUsize>,
    /// Rows depend on the position too (a token at the wrong position changes the output).
    positional: bool,
    /// Leaves its passes "in flight" as the CUDA executor does, taking chained tokens from
    /// its own record of the last pass's draws (`None`: runs each pass at once).
    in_flight: Option<InFlightToy>,
}

/// The toy's passes left in flight: each computed at enqueue, read back by `finish`.
#[derive(Default)]
pub(crate) struct InFlightToy {
    /// The tokens the last enqueued pass drew, in order (what a chained pass takes); `None`
    /// once a pass run at once (one that is not sampled rows only) may have drawn over them,
    /// as the CUDA executor's `last_draws`.
    last_draws: Option<Vec<u32>>,
    passes: HashMap<u64, (ForwardOutput, std::time::Instant)>,
    next: u64,
    /// Passes enqueued while an earlier one was not yet read back.
    pub overlapped: Arc<AtomicUsize>,
}

impl Toy {
    /// Logits of the position after `token`: a broad spread with a few clear leaders, a
    /// function of the token alone (so a greedy walk falls into a cycle, which prompt-lookup
    /// drafts then predict and verifies accept).
    fn row(&self, token: u32, position: usize) -> Vec<f32> {
        let v = self.config.vocab_size;
        let salt = if self.positional { position as u64 } else { 0 };
        let mut h = (u64::from(token) + 1 + (salt << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (0..v)
            .map(|_| {
                h ^= h >> 29;
                h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
                h ^= h >> 32;
                let x = (h % 1000) as f32 / 250.0 - 2.0;
                if h.is_multiple_of(97) {
                    x + 6.0
                } else {
                    x
                }
            })
            .collect()
    }
}

impl Executor for Toy {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn config(&self) -> &Qwen2Config {
        &self.config
    }
    fn block_size(&self) -> usize {
        BLOCK
    }
    fn num_blocks(&self) -> usize {
        256
    }
    fn kv_bytes_per_block(&self) -> usize {
        64
    }
    fn copy_block(&mut self, _: usize, _: usize, _: usize) -> novainfer_model::Result<()> {
        Ok(())
    }
    fn forward(&mut self, batch: &ForwardBatch) -> novainfer_model::Result<ForwardOutput> {
        if let Some(state) = self.in_flight.as_mut() {
            state.last_draws = None;
        }
        let mut out = ForwardOutput::default();
        for s in &batch.seqs {
            let last = s.query_start + s.query_len - 1;
            let row = || self.row(batch.token_ids[last], batch.positions[last]);
            match &s.output {
                SpanOutput::None => {}
                SpanOutput::LastLogits => {
                    self.asked.lock().expect("lock").push(None);
                    out.logits.extend(row());
                }
                SpanOutput::Draw(draw) => {
                    if !self.caps.sampling.draws {
                        return Err(novainfer_model::ModelError::Unsupported {
                            what: "draws".into(),
                            device: "toy".into(),
                        });
                    }
                    self.asked.lock().expect("lock").push(Some(draw.clone()));
                    out.tokens.push(draw.on_host(&row())?);
                }
                SpanOutput::DrawEach(each) => {
                    self.verifies.fetch_add(1, Ordering::Relaxed);
                    for (t, draw) in (s.query_start..=last).zip(each) {
                        self.asked.lock().expect("lock").push(Some(draw.clone()));
                        let row = self.row(batch.token_ids[t], batch.positions[t]);
                        out.tokens.push(draw.on_host(&row)?);
                    }
                }
                SpanOutput::AllLogits => {
                    for t in s.query_start..=last {
                        self.asked.lock().expect("lock").push(None);
                        out.logits
                            .extend(self.row(batch.token_ids[t], batch.positions[t]));
                    }
                }
                SpanOutput::LastHidden => unreachable!("not asked here"),
            }
        }
        Ok(out)
    }
    fn chains_on_device(&self, batch: &ForwardBatch) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|s| batch.only_samples() && s.last_draws.is_some())
    }
    fn enqueue(
        &mut self,
        batch: &ForwardBatch,
        chained: &[(usize, usize)],
    ) -> novainfer_model::Result<Enqueued> {
        if self.in_flight.is_none() || !batch.only_samples() || batch.seqs.is_empty() {
            // As the CUDA executor: only a step of sampled rows is left in flight.
            assert!(chained.is_empty(), "chained inputs into a pass run at once");
            return Ok(Enqueued::Done(self.forward(batch)?));
        }
        let state = self.in_flight.as_mut().expect("in flight");
        let mut batch = batch.clone();
        let last = state.last_draws.as_ref();
        for &(flat, k) in chained {
            assert_eq!(batch.token_ids[flat], 0, "the runner's placeholder");
            batch.token_ids[flat] = last.expect("draws of the pass before")[k];
        }
        if !state.passes.is_empty() {
            state.overlapped.fetch_add(1, Ordering::Relaxed);
        }
        let ticket = state.next;
        state.next += 1;
        // Computed now, as a device would while the host goes on; read back later.
        let in_flight = self.in_flight.take();
        let out = self.forward(&batch);
        self.in_flight = in_flight;
        let state = self.in_flight.as_mut().expect("in flight");
        let out = out?;
        state.last_draws = Some(out.tokens.iter().map(|t| t.token_id).collect());
        state
            .passes
            .insert(ticket, (out, std::time::Instant::now()));
        Ok(Enqueued::InFlight(PassTicket(ticket)))
    }
    fn is_done(&mut self, pass: &PassTicket) -> novainfer_model::Result<bool> {
        // "Running" until a later pass is enqueued or a few milliseconds pass.
        let state = self.in_flight.as_ref().expect("in flight");
        Ok(state.next > pass.0 + 1
            || state
                .passes
                .get(&pass.0)
                .is_none_or(|(_, at)| at.elapsed() > std::time::Duration::from_millis(3)))
    }
    fn finish(&mut self, pass: PassTicket) -> novainfer_model::Result<ForwardOutput> {
        let state = self.in_flight.as_mut().expect("in flight");
        Ok(state.passes.remove(&pass.0).expect("a pass in flight").0)
    }
    fn embed(&mut self, _: &[u32]) -> novainfer_model::Result<Vec<f32>> {
        unreachable!()
    }
    fn prompt_logits(&mut self, _: &[u32], _: bool) -> novainfer_model::Result<Vec<f32>> {
        unreachable!()
    }
}

/// An engine over the toy with `caps` (and speculative decoding, if given), what it asked
/// the toy for, and a count of the verify spans the toy drew.
fn engine_with(
    caps: Capabilities,
    speculative: Option<crate::speculative::SpeculativeConfig>,
) -> (
    EngineCore,
    mpsc::Receiver<Vec<OutputEvent>>,
    Asked,
    Arc<AtomicUsize>,
) {
    engine_toy(caps, speculative, false, false, None)
}

/// An engine over the toy with rows that depend on positions too (a token computed at a wrong
/// position shows), scheduling ahead if `async_scheduling`.
pub(crate) fn engine_scheduling(
    caps: Capabilities,
    speculative: Option<crate::speculative::SpeculativeConfig>,
    async_scheduling: bool,
) -> (
    EngineCore,
    mpsc::Receiver<Vec<OutputEvent>>,
    Asked,
    Arc<AtomicUsize>,
) {
    engine_toy(caps, speculative, async_scheduling, true, None)
}

/// [`engine_scheduling`] with async scheduling over a toy that leaves its passes in flight and
/// chains tokens itself, as the CUDA executor does; and its count of overlapped passes.
pub(crate) fn engine_in_flight(
    caps: Capabilities,
) -> (
    EngineCore,
    mpsc::Receiver<Vec<OutputEvent>>,
    Asked,
    Arc<AtomicUsize>,
) {
    let state = InFlightToy::default();
    let overlapped = state.overlapped.clone();
    let (core, rx, asked, _) = engine_toy(caps, None, true, true, Some(state));
    (core, rx, asked, overlapped)
}

fn engine_toy(
    caps: Capabilities,
    speculative: Option<crate::speculative::SpeculativeConfig>,
    async_scheduling: bool,
    positional: bool,
    in_flight: Option<InFlightToy>,
) -> (
    EngineCore,
    mpsc::Receiver<Vec<OutputEvent>>,
    Asked,
    Arc<AtomicUsize>,
) {
    let tokenizer = tiny_byte_level_tokenizer();
    let vocab = tokenizer.vocab_size();
    let config = crate::test_support::toy_config(vocab, 256);
    let asked = Asked::default();
    let verifies = Arc::new(AtomicUsize::new(0));
    let toy = Toy {
        config,
        caps,
        asked: asked.clone(),
        verifies: verifies.clone(),
        positional,
        in_flight,
    };
    let scheduler = SchedulerConfig::builder()
        .max_num_batched_tokens(256)
        .max_num_seqs(16)
        .max_model_len(256)
        .block_size(BLOCK)
        .num_blocks(256)
        .build()
        .expect("scheduler config");
    let mut loaded =
        LoadedEngine::for_tests(Box::new(toy), tokenizer, scheduler, speculative, None);
    loaded.async_scheduling = async_scheduling;
    let (tx, rx) = mpsc::channel();
    (EngineCore::new(loaded, tx), rx, asked, verifies)
}

/// Each completion's tokens with their logprobs.
pub(crate) type Tokens = HashMap<RequestId, Vec<SampledToken>>;

/// Runs `requests` (id, prompt, params) to completion: the tokens, and what the backend was
/// asked for.
fn run(
    caps: Capabilities,
    requests: &[(u64, Vec<u32>, SamplingParams)],
) -> (Tokens, Vec<Option<Draw>>) {
    let (tokens, asked, _) = run_with(caps, None, requests);
    (tokens, asked)
}

/// [`run`] with speculative decoding; also the number of verify spans drawn and of draft
/// tokens accepted.
fn run_with(
    caps: Capabilities,
    speculative: Option<crate::speculative::SpeculativeConfig>,
    requests: &[(u64, Vec<u32>, SamplingParams)],
) -> (Tokens, Vec<Option<Draw>>, (usize, u64)) {
    let (mut core, rx, asked, verifies) = engine_with(caps, speculative);
    let (sink, _deltas) = mpsc::channel();
    for (id, prompt, params) in requests {
        let request = core
            .frontend()
            .check_request(prompt.clone(), params.clone())
            .expect("request accepted");
        core.add_request(
            RequestId(*id),
            request,
            Scheduling::default(),
            sink.clone().into(),
        );
    }
    let mut tokens = Tokens::new();
    for _ in 0..200 {
        if !core.has_work() {
            break;
        }
        core.step();
        while let Ok(events) = rx.try_recv() {
            for event in events {
                match event {
                    OutputEvent::Token { id, token, .. } => {
                        tokens.entry(id).or_default().push(token);
                    }
                    OutputEvent::Failed { error, .. } => panic!("request failed: {error}"),
                    _ => {}
                }
            }
        }
    }
    assert!(!core.has_work(), "the requests finished");
    let asked = asked.lock().expect("lock").clone();
    let verifies = (
        verifies.load(Ordering::Relaxed),
        core.stats().num_accepted_tokens,
    );
    (tokens, asked, verifies)
}

pub(crate) fn params(temperature: f32, max_tokens: i64) -> novainfer_core::SamplingParamsBuilder {
    SamplingParams::builder()
        .temperature(temperature)
        .max_tokens(Some(max_tokens))
        .ignore_eos(true)
}

pub(crate) fn drawing() -> Capabilities {
    Capabilities {
        sampling: novainfer_model::DeviceSampling { draws: true },
        ..capabilities::CPU
    }
}

#[test]
fn the_engine_never_asks_the_cpu_backend_to_draw() {
    let requests = vec![
        (0, vec![5, 6, 7], params(0.0, 6).build().expect("valid")),
        (
            10,
            vec![8, 9],
            params(0.9, 6).seed(Some(3)).build().expect("valid"),
        ),
        (
            20,
            vec![11],
            params(1.0, 5).top_p(0.8).build().expect("valid"),
        ),
    ];
    let (tokens, asked) = run(capabilities::CPU, &requests);
    assert_eq!(tokens.len(), 3);
    assert!(!asked.is_empty());
    assert!(
        asked.iter().all(Option::is_none),
        "the CPU backend was asked to draw"
    );
}

/// Greedy rows drawn by the backend are the tokens (and logprobs) the engine's own sampler
/// picks from the same rows, penalties, bias, `min_tokens` and top logprobs included, whatever
/// else shares the step; n > 1's shared first row comes back as logits beside drawn ones.
#[test]
fn drawn_tokens_reach_their_requests_and_greedy_matches_the_host() {
    let greedy = |max_tokens| params(0.0, max_tokens);
    let requests = vec![
        (0, vec![5, 6, 7], greedy(7)),
        (10, vec![8, 9], greedy(7).logprobs(Some(2))),
        (
            20,
            vec![3],
            greedy(7).presence_penalty(1.5).frequency_penalty(0.7),
        ),
        (30, vec![12, 13, 14, 15, 16], greedy(7)),
        (40, vec![4, 4], greedy(6).n(2)),
        (
            50,
            vec![17],
            greedy(6).logit_bias(vec![(3, 1.5), (9, -100.0)]),
        ),
        (60, vec![18, 19, 18], greedy(7).repetition_penalty(1.8)),
        (
            70,
            vec![21],
            greedy(6).min_tokens(3).stop_token_ids(vec![2, 5]),
        ),
    ];
    let requests: Vec<_> = requests
        .into_iter()
        .map(|(id, prompt, p)| (id, prompt, p.build().expect("valid")))
        .collect();
    let (host, host_asked) = run(capabilities::CPU, &requests);
    let (device, asked) = run(drawing(), &requests);
    assert!(host_asked.iter().all(Option::is_none));
    assert_eq!(
        host.keys().len(),
        9,
        "eight requests, one with two completions"
    );
    for (id, want) in &host {
        let got = &device[id];
        assert_eq!(
            got.iter().map(|t| t.token_id).collect::<Vec<_>>(),
            want.iter().map(|t| t.token_id).collect::<Vec<_>>(),
            "{id}: tokens"
        );
        for (a, b) in got.iter().zip(want) {
            assert!((a.logprob - b.logprob).abs() < 1e-5, "{id}: logprob");
            // Top logprobs (request 10's): the same ids in the same order, and the rank.
            assert_eq!(a.rank, b.rank, "{id}: rank");
            let ids = |t: &SampledToken| t.top_logprobs.iter().map(|p| p.0).collect::<Vec<_>>();
            assert_eq!(ids(a), ids(b), "{id}: top logprobs");
            for (x, y) in a.top_logprobs.iter().zip(&b.top_logprobs) {
                assert!((x.1 - y.1).abs() < 1e-5, "{id}: top logprob");
            }
        }
    }
    let drawn = asked.iter().filter(|d| d.is_some()).count();
    let rows = asked.len();
    // Every row is drawn but 40's shared first row (10's top logprobs come with its draws).
    assert_eq!(rows - drawn, 1, "logits rows");
    assert!(asked.iter().flatten().any(|d| d.logprobs == Some(2)));
    assert!(asked.iter().flatten().all(|d| d.rule == DrawRule::Greedy));
    // The edits carry what the host sampler would do: 50's bias, 70's mask until its third
    // token, 20's and 60's penalties.
    let edited: Vec<_> = asked
        .iter()
        .flatten()
        .filter_map(|d| d.adjust.clone())
        .collect();
    assert!(edited
        .iter()
        .any(|a| a.edits.iter().any(|e| e.token_id == 9 && e.bias == -100.0)));
    let masks = edited
        .iter()
        .filter(|a| a.edits.iter().any(|e| e.flags & RowEdit::MASK != 0))
        .count();
    assert_eq!(masks, 3, "70's first three rows hold back its stop ids");
    assert!(edited.iter().any(|a| a.penalties.repetition == 1.8
        && a.edits.iter().any(|e| e.flags & RowEdit::IN_PROMPT != 0)));
}

/// A seeded random request draws the same tokens alone and in a batch: each row's draw is
/// keyed by its seed and counted by its own tokens, and its offsets run 0, 1, 2, ...
#[test]
fn seeded_draws_do_not_depend_on_the_batch() {
    let seeded = params(0.8, 8)
        .top_k(20)
        .seed(Some(77))
        .build()
        .expect("valid");
    let alone = run(drawing(), &[(0, vec![5, 6], seeded.clone())]);
    let crowd: Vec<_> = (1..6)
        .map(|i| {
            (
                i * 10,
                vec![i as u32 + 3, 9],
                params(1.0, 8).build().expect("valid"),
            )
        })
        .chain([(0, vec![5, 6], seeded)])
        .collect();
    let crowded = run(drawing(), &crowd);
    let ids = |t: &Tokens| {
        t[&RequestId(0)]
            .iter()
            .map(|t| t.token_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&alone.0), ids(&crowded.0));
    let offsets: Vec<u64> = alone.1.iter().flatten().map(|d| d.offset).collect();
    assert_eq!(offsets, (0..8).collect::<Vec<_>>());
    assert!(alone.1.iter().flatten().all(|d| d.seed == 77));
    // Unseeded requests are keyed by the engine's seed and their id, so they differ.
    let keys: std::collections::HashSet<u64> = crowded.1.iter().flatten().map(|d| d.seed).collect();
    assert_eq!(keys.len(), 6);
}

/// On a drawing backend the n completions of a seeded request are the lone requests with
/// seeds seed, seed + 1, ...: the shared first row is sampled on the host by the device's
/// rule, the later rows are drawn, one stream per completion either way.
#[test]
fn n_completions_draw_what_lone_requests_draw() {
    let p = |seed, n| {
        params(1.0, 8)
            .top_p(0.95)
            .seed(Some(seed))
            .n(n)
            .build()
            .expect("valid")
    };
    let (together, asked) = run(drawing(), &[(0, vec![5, 6, 7], p(7, 3))]);
    assert!(
        asked.iter().any(Option::is_none),
        "the shared first row came back as logits"
    );
    for i in 0..3u64 {
        let (alone, _) = run(drawing(), &[(0, vec![5, 6, 7], p(7 + i, 1))]);
        assert_eq!(
            together[&RequestId(i)]
                .iter()
                .map(|t| t.token_id)
                .collect::<Vec<_>>(),
            alone[&RequestId(0)]
                .iter()
                .map(|t| t.token_id)
                .collect::<Vec<_>>(),
            "completion {i}"
        );
    }
}

/// A grammar's rows are drawn with its mask: greedy tokens equal the host's, the output
/// follows the grammar, and an n > 1 request's completions equal lone seeded requests.
#[test]
fn grammar_rows_are_drawn_with_their_mask() {
    let regex = || Some(novainfer_core::StructuredOutput::Regex("(ab|ba)+c".into()));
    let greedy = params(0.0, 12)
        .ignore_eos(false)
        .structured_output(regex())
        .build()
        .expect("valid");
    let (host, _) = run(capabilities::CPU, &[(0, vec![5, 6], greedy.clone())]);
    let (device, asked) = run(drawing(), &[(0, vec![5, 6], greedy)]);
    let ids = |t: &Tokens, id: u64| {
        t[&RequestId(id)]
            .iter()
            .map(|t| t.token_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&device, 0), ids(&host, 0));
    assert!(asked
        .iter()
        .all(|d| d.as_ref().is_some_and(|d| d.allowed.is_some())));
    let tokenizer = tiny_byte_level_tokenizer();
    let text = tokenizer.decode(&ids(&device, 0), false).expect("decode");
    // max_tokens may end it before its `c`: the text is a prefix of the language.
    let body = text.strip_suffix('c').unwrap_or(&text);
    assert!(
        !body.is_empty()
            && body
                .as_bytes()
                .chunks(2)
                .all(|p| p == b"ab" || p == b"ba" || p == b"a" || p == b"b"),
        "{text:?} is a prefix of (ab|ba)+c"
    );

    let seeded = |seed, n| {
        params(1.0, 12)
            .ignore_eos(false)
            .structured_output(regex())
            .seed(Some(seed))
            .n(n)
            .build()
            .expect("valid")
    };
    let (together, _) = run(drawing(), &[(0, vec![5, 6], seeded(3, 2))]);
    for i in 0..2 {
        let (alone, _) = run(drawing(), &[(0, vec![5, 6], seeded(3 + i, 1))]);
        assert_eq!(ids(&together, i), ids(&alone, 0), "completion {i}");
    }
}

/// Speculative decoding on a drawing backend: each verify's rows are drawn on the device
/// (row i by the sampler's rule after the draft's first i tokens) and the engine keeps them up
/// to the first that is not the draft's; greedy outputs equal the host's, with penalties too.
#[test]
fn verify_rows_are_drawn_and_cut_at_the_first_mismatch() {
    let spec = || {
        Some(
            crate::speculative::SpeculativeConfig::from_json(&serde_json::json!({
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 2,
                "draft_policy": "always",
            }))
            .expect("config"),
        )
    };
    let requests: Vec<_> = [
        (0, vec![5, 6, 5, 6, 5], params(0.0, 48)),
        (10, vec![7, 8, 7, 8], params(0.0, 48).presence_penalty(0.3)),
        (20, vec![9, 9, 9], params(0.0, 48).logprobs(Some(1))),
    ]
    .into_iter()
    .map(|(id, p, b)| (id, p, b.build().expect("valid")))
    .collect();
    let (host, _, (host_verifies, host_accepted)) = run_with(capabilities::CPU, spec(), &requests);
    let (device, _, (verifies, accepted)) = run_with(drawing(), spec(), &requests);
    assert_eq!(host_verifies, 0, "the CPU backend is never asked to draw");
    assert!(verifies > 0, "verify rows were drawn on the device");
    // Drafts were accepted, and as many as on the host: the same tokens confirmed.
    assert!(accepted > 0);
    assert_eq!(accepted, host_accepted);
    for (id, want) in &host {
        let got = &device[id];
        let ids = |t: &[SampledToken]| t.iter().map(|t| t.token_id).collect::<Vec<_>>();
        assert_eq!(ids(got), ids(want), "{id}");
        for (a, b) in got.iter().zip(want) {
            assert!((a.logprob - b.logprob).abs() < 1e-5, "{id}");
            assert_eq!(a.rank, b.rank, "{id}");
        }
    }
}

/// A grammar's verify rows come back as logits (its matcher cannot be advanced on a copy for
/// the device's rules), and are sampled here by the device's rule: a seeded request's tokens
/// come from one random stream whether or not it drafts, as without a grammar.
#[test]
fn a_grammar_verify_sampled_here_keeps_the_device_stream() {
    let spec = crate::speculative::SpeculativeConfig::from_json(&serde_json::json!({
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
        "draft_policy": "always",
    }))
    .expect("config");
    let seeded = |seed| {
        params(1.0, 24)
            .ignore_eos(false)
            .structured_output(Some(novainfer_core::StructuredOutput::Regex(
                "(ab|ba)+c".into(),
            )))
            .seed(Some(seed))
            .build()
            .expect("valid")
    };
    // Prompts of the grammar's own bytes, so that n-gram drafts find matches.
    let prompt: Vec<u32> = b"abbaabab".iter().map(|&b| b as u32).collect();
    let ids = |t: &Tokens| {
        t[&RequestId(0)]
            .iter()
            .map(|t| t.token_id)
            .collect::<Vec<_>>()
    };
    let mut drafted = 0;
    for seed in 0..6 {
        let request = [(0, prompt.clone(), seeded(seed))];
        let (plain, _, _) = run_with(drawing(), None, &request);
        let (speculating, _, (verifies, accepted)) =
            run_with(drawing(), Some(spec.clone()), &request);
        assert_eq!(
            verifies, 0,
            "a grammar's verify rows are not drawn on the device"
        );
        drafted += accepted;
        assert_eq!(ids(&speculating), ids(&plain), "seed {seed}");
    }
    assert!(drafted > 0, "drafts were accepted");
}
