//! CUDA graphs for decode against the eager forward, on the tiny bf16 model (skips without a
//! GPU; fails under NOVAINFER_REQUIRE_GPU, as `scripts/gpu-test run` sets):
//!
//! * batch 1: a replayed step runs the eager step's launches over the same rows, so its
//!   logits are the eager ones bit for bit;
//! * 3 sequences (padded to bucket 4) and 64 (bucket 64): the same greedy tokens, and logits
//!   within bf16 noise (the GEMMs run over the bucket's rows, and cuBLAS may sum a row
//!   differently for another row count; see `ops::gemm`);
//! * with graphs on, each of 64 requests decodes the same greedy tokens alone as in the batch;
//! * the fused decode linears (`DecodeLinear::Fused`), eager and captured, against the separate
//!   ones: the same greedy tokens with two launches a layer fewer;
//! * passes left in flight (`Executor::enqueue`), each decode step enqueued before the one
//!   before it is read back and taking its tokens from that one's draws on the device, eager
//!   and captured: the same greedy tokens as steps run one by one;
//! * a speculative verify step of many sequences (each draft right, or wrong at its second
//!   token), eager and captured (its one-token spans replay a decode graph): the greedy
//!   tokens up to each draft's first miss, and 17 sequences' 68 rows in two passes.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use common::weights;
use novainfer_cuda::gpu_test::{when_unavailable_from_env, WhenUnavailable};
use novainfer_model::{
    load_weights, Checkpoint, CudaGraphs, DecodeLinear, Device, Draw, Enqueued, Executor,
    ForwardBatch, ForwardOutput, LoadOptions, ModelError, Qwen2Config, SpanOutput, StepLimits,
};

const LIMITS: StepLimits = StepLimits {
    max_num_batched_tokens: 512,
    max_num_seqs: 64,
    max_seq_len: 64,
};
const BLOCK_SIZE: usize = 4;
/// Blocks a sequence owns: positions 0..16.
const PER_SEQ: usize = 4;
const NUM_BLOCKS: usize = 64 * PER_SEQ;
const DECODE_STEPS: usize = 6;

fn write_checkpoint(dir: &Path, cfg: &Qwen2Config) {
    let w: HashMap<String, Tensor> = weights(cfg)
        .into_iter()
        .map(|(k, t)| (k, t.to_dtype(DType::BF16).expect("bf16")))
        .collect();
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).expect("safetensors");
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "eos_token_id": 1,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
}

fn load(dir: &Path, graphs: CudaGraphs) -> Result<Box<dyn Executor>, ModelError> {
    load_linear(dir, graphs, DecodeLinear::Separate)
}

fn load_linear(
    dir: &Path,
    graphs: CudaGraphs,
    linear: DecodeLinear,
) -> Result<Box<dyn Executor>, ModelError> {
    let opts = LoadOptions {
        cuda_graphs: graphs,
        decode_linear: linear,
        ..LoadOptions::default()
    };
    load_weights(Device::Cuda(0), Checkpoint::open(dir)?, &opts, LIMITS)?
        .into_executor(NUM_BLOCKS, BLOCK_SIZE)
}

/// Whether a GPU is there; `false` (skipped) without one, a panic under NOVAINFER_REQUIRE_GPU.
fn have_gpu(test: &str) -> bool {
    let Err(why) = novainfer_model::cuda::probe(0) else {
        return true;
    };
    match when_unavailable_from_env() {
        WhenUnavailable::Skip => {
            println!("{test}: skipped: no CUDA device ({why})");
            false
        }
        WhenUnavailable::Fail => panic!("NOVAINFER_REQUIRE_GPU is set but no CUDA device: {why}"),
    }
}

/// The eager and the graph executor, or `None` (skipped) without a GPU.
fn executors(dir: &Path) -> Option<(Box<dyn Executor>, Box<dyn Executor>)> {
    if !have_gpu("cuda_graphs") {
        return None;
    }
    let eager = load(dir, CudaGraphs::Eager).expect("eager executor");
    let graphs = load(dir, CudaGraphs::Captured).expect("graph executor (capture)");
    Some((eager, graphs))
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Sequence `seq`'s block table and the slots of `positions`.
fn table(seq: usize) -> Vec<u32> {
    (0..PER_SEQ).map(|b| (seq * PER_SEQ + b) as u32).collect()
}

fn slots(table: &[u32], positions: std::ops::Range<usize>) -> Vec<usize> {
    positions
        .map(|p| table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE)
        .collect()
}

fn prompt(seq: usize, vocab: usize) -> Vec<u32> {
    (0..3 + seq % 4)
        .map(|i| ((seq * 7 + i * 13 + 2) % vocab) as u32)
        .collect()
}

/// Greedy decoding of sequences `seqs` together: the prefill, then [`DECODE_STEPS`] decode
/// steps (the ones a graph replays). Returns each sequence's tokens and each decode step's
/// logits.
fn generate(ex: &mut dyn Executor, seqs: &[usize]) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let vocab = ex.config().vocab_size;
    let prompts: Vec<Vec<u32>> = seqs.iter().map(|&s| prompt(s, vocab)).collect();
    let mut batch = ForwardBatch::default();
    for (&s, p) in seqs.iter().zip(&prompts) {
        batch.push(p, 0, slots(&table(s), 0..p.len()), table(s), true);
    }
    let logits = ex.forward(&batch).expect("prefill").logits;
    let mut tokens: Vec<Vec<u32>> = logits.chunks(vocab).map(|r| vec![argmax(r)]).collect();
    let mut steps = Vec::new();
    for step in 0..DECODE_STEPS {
        let mut batch = ForwardBatch::default();
        for ((&s, p), t) in seqs.iter().zip(&prompts).zip(&tokens) {
            let pos = p.len() + step;
            batch.push(
                &[t[step]],
                pos,
                slots(&table(s), pos..pos + 1),
                table(s),
                true,
            );
        }
        let logits = ex.forward(&batch).expect("decode").logits;
        for (t, row) in tokens.iter_mut().zip(logits.chunks(vocab)) {
            t.push(argmax(row));
        }
        steps.push(logits);
    }
    (tokens, steps)
}

/// Logits within bf16 noise of each other: 2% of the row set's largest magnitude (at least 1).
fn assert_logits_close(got: &[f32], want: &[f32], what: &str) {
    let worst = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
    assert!(
        worst <= 2e-2 * scale,
        "{what}: logits differ by {worst} (scale {scale})"
    );
}

#[test]
fn graphs_match_the_eager_forward_and_batching_changes_no_token() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = common::config_hd64(false);
    write_checkpoint(dir.path(), &cfg);
    let Some((mut eager, mut graphs)) = executors(dir.path()) else {
        return;
    };
    for n in [1usize, 3, 64] {
        let seqs: Vec<usize> = (0..n).collect();
        let (want_tokens, want_logits) = generate(eager.as_mut(), &seqs);
        let (got_tokens, got_logits) = generate(graphs.as_mut(), &seqs);
        assert_eq!(got_tokens, want_tokens, "{n} sequences: greedy tokens");
        for (step, (got, want)) in got_logits.iter().zip(&want_logits).enumerate() {
            if n == 1 {
                assert_eq!(got, want, "batch 1, step {step}: bit for bit");
            } else {
                assert_logits_close(got, want, &format!("{n} sequences, step {step}"));
            }
        }
    }
    let all: Vec<usize> = (0..64).collect();
    let (together, _) = generate(graphs.as_mut(), &all);
    for s in all {
        let (alone, _) = generate(graphs.as_mut(), &[s]);
        assert_eq!(
            alone[0], together[s],
            "sequence {s}: alone vs in a batch of 64"
        );
    }
}

/// The tests of this file one at a time: the launch count is process-wide, and another test's
/// launches during a count would be counted (`cargo test` runs tests on several threads).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Kernels and cuBLAS calls of one decode step of `seqs` (after their prompts).
fn launches_of_a_decode_step(ex: &mut dyn Executor, seqs: &[usize]) -> u64 {
    let vocab = ex.config().vocab_size;
    let mut prefill = ForwardBatch::default();
    let mut decode = ForwardBatch::default();
    for &s in seqs {
        let p = prompt(s, vocab);
        prefill.push(&p, 0, slots(&table(s), 0..p.len()), table(s), true);
        let pos = p.len();
        decode.push(&[2], pos, slots(&table(s), pos..pos + 1), table(s), true);
    }
    ex.forward(&prefill).expect("prefill");
    let before = novainfer_cuda::ops::launches();
    ex.forward(&decode).expect("decode");
    novainfer_cuda::ops::launches() - before
}

#[test]
fn fused_decode_linears_follow_the_separate_ones_with_fewer_launches() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = common::config_hd64(false);
    write_checkpoint(dir.path(), &cfg);
    if !have_gpu("fused decode linears") {
        return;
    }
    let mut separate = load(dir.path(), CudaGraphs::Eager).expect("separate");
    let mut fused = load_linear(dir.path(), CudaGraphs::Eager, DecodeLinear::Fused).expect("fused");
    let mut captured =
        load_linear(dir.path(), CudaGraphs::Captured, DecodeLinear::Fused).expect("fused graphs");
    // 1, 3 and 8 rows run fused (8: the GEMV's most); 9 runs the separate path in both.
    for n in [1usize, 3, 8, 9] {
        let seqs: Vec<usize> = (0..n).collect();
        let (want_tokens, want_logits) = generate(separate.as_mut(), &seqs);
        let (got_tokens, got_logits) = generate(fused.as_mut(), &seqs);
        let (replayed_tokens, replayed_logits) = generate(captured.as_mut(), &seqs);
        // The GEMV sums in another order than cuBLAS: bf16 noise, not a token.
        assert_eq!(got_tokens, want_tokens, "{n} sequences: greedy tokens");
        for (step, (got, want)) in got_logits.iter().zip(&want_logits).enumerate() {
            assert_logits_close(got, want, &format!("{n} sequences, step {step}"));
        }
        // A graph replays the fused launches over the bucket's rows, and no row of a GEMV
        // depends on another: bit for bit up to 8 rows (9 rows are a 16-row bucket of cuBLAS
        // GEMMs, which may sum a row differently for another row count).
        assert_eq!(replayed_tokens, got_tokens, "{n} sequences: graphs");
        if n <= 8 {
            assert_eq!(
                replayed_logits, got_logits,
                "{n} sequences: graphs, bit for bit"
            );
        }
    }
    let layers = cfg.num_hidden_layers as u64;
    for n in [1usize, 8] {
        let seqs: Vec<usize> = (0..n).collect();
        let before = launches_of_a_decode_step(separate.as_mut(), &seqs);
        let after = launches_of_a_decode_step(fused.as_mut(), &seqs);
        println!(
            "decode step of {n} rows, {layers} layers: {before} launches separate, {after} fused \
             ({} a layer fewer)",
            (before - after) as f64 / layers as f64
        );
        // QKV's bias/RoPE/cache kernel and SiLU·mul go into the GEMVs (cuBLAS calls count one
        // each here, whatever kernels they run).
        assert_eq!(before - after, 2 * layers, "{n} rows");
    }
}

fn greedy() -> SpanOutput {
    SpanOutput::Draw(Draw::greedy())
}

fn read_back(ex: &mut dyn Executor, pass: Enqueued) -> ForwardOutput {
    match pass {
        Enqueued::Done(out) => out,
        Enqueued::InFlight(ticket) => ex.finish(ticket).expect("finish"),
    }
}

/// [`generate`]'s greedy decoding with every step drawn on the device and enqueued before the
/// step before it is read back, its tokens chained to that step's draws on the device.
fn generate_in_flight(ex: &mut dyn Executor, seqs: &[usize]) -> Vec<Vec<u32>> {
    let vocab = ex.config().vocab_size;
    let prompts: Vec<Vec<u32>> = seqs.iter().map(|&s| prompt(s, vocab)).collect();
    let mut prefill = ForwardBatch::default();
    for (&s, p) in seqs.iter().zip(&prompts) {
        let slots = slots(&table(s), 0..p.len());
        prefill.push_adapted(p, 0, slots, table(s), greedy(), None);
    }
    let mut pass = ex.enqueue(&prefill, &[]).expect("enqueue the prefill");
    let mut tokens = vec![Vec::new(); seqs.len()];
    for step in 0..DECODE_STEPS {
        let mut batch = ForwardBatch::default();
        for (&s, p) in seqs.iter().zip(&prompts) {
            let pos = p.len() + step;
            let slots = slots(&table(s), pos..pos + 1);
            batch.push_adapted(&[0], pos, slots, table(s), greedy(), None);
        }
        // Sequence i's token is the i-th the step before drew.
        let chained: Vec<(usize, usize)> = (0..seqs.len()).map(|i| (i, i)).collect();
        let next = ex
            .enqueue(&batch, &chained)
            .expect("enqueue a chained step");
        assert!(
            matches!(next, Enqueued::InFlight(_)),
            "a decode step stays in flight"
        );
        let out = read_back(ex, std::mem::replace(&mut pass, next));
        for (t, d) in tokens.iter_mut().zip(&out.tokens) {
            t.push(d.token_id);
        }
    }
    let out = read_back(ex, pass);
    for (t, d) in tokens.iter_mut().zip(&out.tokens) {
        t.push(d.token_id);
    }
    tokens
}

#[test]
fn passes_in_flight_chain_their_tokens_on_the_device_and_decode_the_same() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = common::config_hd64(false);
    write_checkpoint(dir.path(), &cfg);
    if !have_gpu("passes in flight") {
        return;
    }
    for graphs in [CudaGraphs::Eager, CudaGraphs::Captured] {
        let mut ex = load(dir.path(), graphs).expect("executor");
        for n in [1usize, 3, 8] {
            let seqs: Vec<usize> = (0..n).collect();
            let (want, _) = generate(ex.as_mut(), &seqs);
            let got = generate_in_flight(ex.as_mut(), &seqs);
            assert_eq!(got, want, "{graphs:?}, {n} sequences");
        }
        // A chained step with no pass before it on the device is refused, not run on junk.
        let mut batch = ForwardBatch::default();
        batch.push_adapted(&[0], 0, vec![0], table(0), greedy(), None);
        ex.forward(&batch).expect("a forward between passes");
        let err = ex
            .enqueue(&batch, &[(0, 0)])
            .expect_err("no draws to chain to");
        assert!(
            err.to_string().contains("no pass enqueued just before"),
            "{err}"
        );
    }
}

/// One verify step over sequences `seqs` after their prompts: each span is its first greedy
/// token (`want[s][0]`) and a draft of [`DRAFT`] tokens, the true continuation, or for odd
/// sequences wrong at its second token. Returns each sequence's drawn rows, and the launches
/// the verify step took.
const DRAFT: usize = 3;
fn verify(ex: &mut dyn Executor, seqs: &[usize], want: &[Vec<u32>]) -> (Vec<Vec<u32>>, u64) {
    let vocab = ex.config().vocab_size;
    let mut prefill = ForwardBatch::default();
    let mut step = ForwardBatch::default();
    for (&s, w) in seqs.iter().zip(want) {
        let p = prompt(s, vocab);
        prefill.push(&p, 0, slots(&table(s), 0..p.len()), table(s), false);
        let mut span = w[..=DRAFT].to_vec();
        if s % 2 == 1 {
            span[2] = (span[2] + 1) % vocab as u32;
        }
        let at = p.len()..p.len() + span.len();
        let each = SpanOutput::DrawEach(vec![Draw::greedy(); span.len()]);
        step.push_adapted(&span, at.start, slots(&table(s), at), table(s), each, None);
    }
    ex.forward(&prefill).expect("prefill");
    let before = novainfer_cuda::ops::launches();
    let out = ex.forward(&step).expect("verify");
    let launches = novainfer_cuda::ops::launches() - before;
    assert_eq!(
        out.tokens.len(),
        seqs.len() * (DRAFT + 1),
        "a token per row"
    );
    let rows = out
        .tokens
        .chunks(DRAFT + 1)
        .map(|r| r.iter().map(|t| t.token_id).collect())
        .collect();
    (rows, launches)
}

#[test]
fn a_verify_step_of_many_sequences_draws_the_greedy_rows_in_few_passes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = common::config_hd64(false);
    write_checkpoint(dir.path(), &cfg);
    let Some((mut eager, mut graphs)) = executors(dir.path()) else {
        return;
    };
    // 16 sequences: 64 rows, one pass; 17: 68 rows, two passes (max_num_seqs is 64).
    for n in [1usize, 16, 17] {
        let seqs: Vec<usize> = (0..n).collect();
        let (want, _) = generate(eager.as_mut(), &seqs);
        let (got, eager_launches) = verify(eager.as_mut(), &seqs, &want);
        for (s, (rows, w)) in got.iter().zip(&want).enumerate() {
            // Row i follows the draft's first i tokens: right up to the first wrong one.
            let kept = if s % 2 == 1 { 2 } else { DRAFT + 1 };
            assert_eq!(rows[..kept], w[1..=kept], "{n} sequences, sequence {s}");
        }
        let (replayed, _) = verify(graphs.as_mut(), &seqs, &want);
        for (s, (a, b)) in replayed.iter().zip(&got).enumerate() {
            let kept = if s % 2 == 1 { 2 } else { DRAFT + 1 };
            assert_eq!(
                a[..kept],
                b[..kept],
                "{n} sequences, sequence {s}: captured"
            );
        }
        // One pass's launches, or two's: never one pass per sequence.
        // (The draw tail's few kernels beside a logits tail's: 8 a pass of slack.)
        let one_decode = launches_of_a_decode_step(eager.as_mut(), &[0]);
        let passes = (n * (DRAFT + 1)).div_ceil(LIMITS.max_num_seqs) as u64;
        assert!(
            eager_launches <= passes * (one_decode + 8),
            "{n} sequences: {eager_launches} launches, a decode step takes {one_decode}"
        );
    }
}
