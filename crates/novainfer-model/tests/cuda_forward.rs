//! The CUDA executor against the CPU executor on a tiny random Qwen2 (head_dim 64, the
//! smallest the attention kernels are built for), over the step mix the engine produces:
//! prefills of different lengths, a chunked prefill, decodes, and an n > 1 fork that copies
//! a partially filled block.
//!
//! Embeddings and prompt logits (run in a scratch pool of their own) are compared too.
//!
//! Without a usable GPU it prints `skipped: no CUDA device (<why>)` and passes, unless
//! `NOVAINFER_REQUIRE_GPU` is set (to anything but `0`), where it fails.
//!
//! Tolerance: the checkpoint is bf16, so both devices start from the same weights; the GPU
//! then rounds every activation and its KV pool to bf16 (relative error 2⁻⁹ per rounding,
//! some ten roundings deep here) while the CPU reference stays in f32 (an f32 KV pool). Each
//! logits row must agree within 4 % of the row's largest CPU logit (a layout or indexing bug
//! is an error of order 100 %) plus twice the row's own sensitivity to bf16: how far the CPU
//! itself moves when only its KV pool is bf16. Most rows move by under 0.5 % of their scale;
//! some move far more. In the schedule below, row a of "decode-only across blocks" moves
//! by 0.26 (tie=false) and 0.52 (tie=true) on the CPU alone, 2.5× its 4 %: its attention
//! weighs keys whose scores nearly tie, so a one-ulp change of a key moves the output. That
//! row is what the first GPU run (2026-11-27) reported as the fork bug: a GPU difference of
//! 0.33, within what the CPU shows against itself. The block copy itself is exact (on the
//! CPU bit for bit, `tests/fork.rs`; here the fork's logits are compared with the same
//! history computed fresh). The greedy token must agree wherever the CPU's top two are
//! further apart than the row's tolerance.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use common::weights;
use novainfer_cuda::gpu_test::{when_unavailable_from_env, WhenUnavailable};
use novainfer_model::draw::{RowEdit, RowPenalties};
use novainfer_model::lora::Target;
use novainfer_model::{
    load_weights, Adjust, Checkpoint, Device, Draw, DrawRule, Executor, ForwardBatch, KvCacheDtype,
    KvStorage, LoadOptions, ModelError, Qwen2Config, SpanOutput, StepLimits,
};

/// The GPU test's model (head_dim 64), untied or tied.
fn config(tie: bool) -> Qwen2Config {
    common::config_hd64(tie)
}

/// The tiny model as an HF directory with a bf16 checkpoint.
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

const LIMITS: StepLimits = StepLimits {
    max_num_batched_tokens: 32,
    max_num_seqs: 8,
    max_seq_len: 64,
};
const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 32;

fn executor(dir: &Path, device: Device) -> Result<Box<dyn Executor>, ModelError> {
    executor_with(dir, device, KvCacheDtype::Auto)
}

/// The CPU with a KV pool of `kv` (the GPU's is always bf16).
fn executor_with(
    dir: &Path,
    device: Device,
    kv: KvCacheDtype,
) -> Result<Box<dyn Executor>, ModelError> {
    let opened = Checkpoint::open(dir)?;
    let opts = LoadOptions {
        kv_cache_dtype: kv,
        ..LoadOptions::default()
    };
    load_weights(device, opened, &opts, LIMITS)?.into_executor(NUM_BLOCKS, BLOCK_SIZE)
}

/// Per row of `reference`: how far `perturbed` (the same steps with a bf16 KV pool) lies from
/// it, the row's own sensitivity to bf16 rounding.
fn sensitivity(reference: &[f32], perturbed: &[f32], vocab: usize) -> Vec<f32> {
    reference
        .chunks(vocab)
        .zip(perturbed.chunks(vocab))
        .map(|(r, p)| r.iter().zip(p).fold(0f32, |m, (a, b)| m.max((a - b).abs())))
        .collect()
}

/// Skips (or, under NOVAINFER_REQUIRE_GPU, fails) when no GPU can be used here.
fn gpu_executor(dir: &Path) -> Option<Box<dyn Executor>> {
    let why = match novainfer_model::cuda::probe(0) {
        Err(why) => why,
        Ok(()) => match executor(dir, Device::Cuda(0)) {
            Ok(e) => return Some(e),
            Err(ModelError::DeviceUnavailable { reason, .. }) => reason,
            Err(e) => panic!("loading the model on cuda:0 failed: {e}"),
        },
    };
    match when_unavailable_from_env() {
        WhenUnavailable::Skip => {
            println!("cuda_forward: skipped: no CUDA device ({why})");
            None
        }
        WhenUnavailable::Fail => panic!("NOVAINFER_REQUIRE_GPU is set but no CUDA device: {why}"),
    }
}

/// `copy_block(src, dst, num_tokens)` before a step.
type Fork = (usize, usize, usize);

/// A sequence's slots for `positions`, stored in `table`.
fn slots(table: &[u32], positions: std::ops::Range<usize>) -> Vec<usize> {
    positions
        .map(|p| table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE)
        .collect()
}

/// One engine-like step: `(tokens, first position, block table, sample)` per sequence.
fn step(seqs: &[(&[u32], usize, &[u32], bool)]) -> ForwardBatch {
    let mut b = ForwardBatch::default();
    for &(tokens, start, table, sample) in seqs {
        b.push(
            tokens,
            start,
            slots(table, start..start + tokens.len()),
            table.to_vec(),
            sample,
        );
    }
    b
}

fn compare(step_name: &str, cpu: &[f32], gpu: &[f32], vocab: usize) {
    compare_within(step_name, cpu, gpu, vocab, &[]);
}

/// [`compare`] with `slack[r]` more tolerance for row r (twice its bf16 sensitivity).
fn compare_within(step_name: &str, cpu: &[f32], gpu: &[f32], vocab: usize, sensitive: &[f32]) {
    assert_eq!(cpu.len(), gpu.len(), "{step_name}: row count");
    for (r, (c, g)) in cpu.chunks(vocab).zip(gpu.chunks(vocab)).enumerate() {
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let tol = 0.04 * scale + 2.0 * sensitive.get(r).copied().unwrap_or(0.0);
        let diff = c.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= tol && g.iter().all(|v| v.is_finite()),
            "{step_name} row {r}: max |gpu - cpu| = {diff} > {tol} (row max |logit| {scale})"
        );
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| c[b].total_cmp(&c[a]));
        let argmax_gpu = (0..vocab).max_by(|&a, &b| g[a].total_cmp(&g[b]));
        if c[order[0]] - c[order[1]] > 2.0 * tol {
            assert_eq!(
                argmax_gpu,
                Some(order[0]),
                "{step_name} row {r}: greedy token"
            );
        }
    }
}

#[test]
fn cuda_logits_match_the_cpu_over_a_mixed_schedule() {
    for tie in [false, true] {
        let cfg = config(tie);
        let dir = tempfile::tempdir().expect("tempdir");
        write_checkpoint(dir.path(), &cfg);
        let f32_kv = KvCacheDtype::Fixed(KvStorage::F32);
        let mut cpu = executor_with(dir.path(), Device::Cpu, f32_kv).expect("cpu executor");
        let mut cpu_bf16 = executor_with(
            dir.path(),
            Device::Cpu,
            KvCacheDtype::Fixed(KvStorage::Bf16),
        )
        .expect("cpu executor with a bf16 pool");
        let v = cfg.vocab_size;

        let a: Vec<u32> = vec![3, 17, 42, 8, 8, 0, 31, 5, 9];
        let b: Vec<u32> = (10..20).collect();
        let c: Vec<u32> = vec![7, 7, 2, 60, 61];
        let (ta, tb, tc) = ([3u32, 9, 12], [0u32, 1, 2], [20u32, 21]);
        let ta_fork = [3u32, 11, 13];

        let steps: Vec<(&str, ForwardBatch, Option<Fork>)> = vec![
            // Two prefills of different lengths; b's is a first chunk, not sampled.
            (
                "prefill a + chunk b",
                step(&[(&a[..6], 0, &ta[..2], true), (&b[..5], 0, &tb, false)]),
                None,
            ),
            // Mixed: a decodes, b finishes its prompt, c prefills (the prefill kernel).
            (
                "decode a + chunk b + prefill c",
                step(&[
                    (&a[6..7], 6, &ta[..2], true),
                    (&b[5..], 5, &tb, true),
                    (&c[..3], 0, &tc[..1], true),
                ]),
                None,
            ),
            // a forks (n > 1): its partial block 9 (positions 4..7, 3 filled) is copied to 11.
            (
                "decode-only after a fork",
                step(&[
                    (&a[7..8], 7, &ta[..2], true),
                    (&c[3..4], 7, &ta_fork[..2], true),
                    (&c[4..5], 3, &tc[..1], true),
                ]),
                Some((9, 11, 3)),
            ),
            // Everyone crosses into a new block (a, its fork) or decodes on.
            (
                "decode-only across blocks",
                step(&[
                    (&a[8..9], 8, &ta, true),
                    (&b[..1], 8, &ta_fork, true),
                    (&c[..1], 4, &tc, true),
                ]),
                None,
            ),
        ];
        // The CPU runs the schedule first (it checks the schedule itself, GPU or not), and
        // again with a bf16 pool for each row's sensitivity.
        let mut expected = Vec::new();
        let mut sensitive = Vec::new();
        for (_, batch, fork) in &steps {
            if let Some((src, dst, n)) = *fork {
                cpu.copy_block(src, dst, n).expect("cpu fork");
                cpu_bf16.copy_block(src, dst, n).expect("cpu fork");
            }
            let want = cpu.forward(batch).expect("cpu step").logits;
            let rounded = cpu_bf16.forward(batch).expect("cpu step").logits;
            sensitive.push(sensitivity(&want, &rounded, v));
            expected.push(want);
        }
        assert!(expected.iter().all(|rows| !rows.is_empty()));
        // The fork's last row, against the same history computed fresh in unused blocks
        // (28..31) as one prefill: bit for bit on the CPU.
        let mut history: Vec<u32> = a[..7].to_vec();
        history.extend([c[3], b[0]]);
        let fresh_step = step(&[(&history, 0, &[28, 29, 30], true)]);
        let fresh = cpu.forward(&fresh_step).expect("cpu fresh").logits;
        assert_eq!(
            fresh[..],
            expected[3][v..2 * v],
            "tie={tie}: the forked sequence equals its history computed without a fork"
        );

        let Some(mut gpu) = gpu_executor(dir.path()) else {
            return;
        };
        let mut got_steps = Vec::new();
        for (((name, batch, fork), want), slack) in steps.iter().zip(&expected).zip(&sensitive) {
            if let Some((src, dst, n)) = *fork {
                gpu.copy_block(src, dst, n).expect("gpu fork");
            }
            let got = gpu.forward(batch).expect("gpu step").logits;
            compare_within(&format!("tie={tie} {name}"), want, &got, v, slack);
            got_steps.push(got);
        }
        // The GPU's fork against its own fresh computation of the same history: a wrong block
        // copy would put other K/V under the fork (an error of order 100 %).
        let gpu_fresh = gpu.forward(&fresh_step).expect("gpu fresh").logits;
        compare_within(
            &format!("tie={tie} fork vs fresh on the GPU"),
            &gpu_fresh,
            &got_steps[3][v..2 * v],
            v,
            &sensitive[3][1..2],
        );

        // Bad values are errors before anything runs, and the executor goes on working.
        let mut bad = step(&[(&[1], 0, &[30], true)]);
        bad.token_ids[0] = v as u32;
        assert!(matches!(
            gpu.forward(&bad),
            Err(ModelError::TokenOutOfRange { .. })
        ));
        let mut bad = step(&[(&[1], 0, &[30], true)]);
        bad.slot_mapping[0] = NUM_BLOCKS * BLOCK_SIZE;
        assert!(gpu.forward(&bad).is_err());
        assert!(gpu.copy_block(NUM_BLOCKS, 0, 1).is_err());
        let ok = step(&[(&[1, 2], 0, &[30], true)]);
        let want = cpu.forward(&ok).expect("cpu after errors").logits;
        let got = gpu.forward(&ok).expect("gpu after errors").logits;
        compare(&format!("tie={tie} after errors"), &want, &got, v);

        // One step mixing every output: a decode of a fresh sequence, an embedding's last
        // and a scored prompt, each over blocks of its own (20.. are unused above).
        let mut mixed = ForwardBatch::default();
        for (tokens, table, out) in [
            (&a[..5], &[20u32, 21][..], SpanOutput::LastLogits),
            (&c[..], &[22, 23][..], SpanOutput::LastHidden),
            // Ten scored tokens: two groups of at most max_num_seqs (8) one-token spans.
            (&b[..], &[24, 25, 26][..], SpanOutput::AllLogits),
        ] {
            let slots = slots(table, 0..tokens.len());
            mixed.push_span(tokens, 0, slots, table.to_vec(), out);
        }
        let want = cpu.forward(&mixed).expect("cpu mixed");
        let got = gpu.forward(&mixed).expect("gpu mixed");
        assert_eq!(
            want.logits.len(),
            11 * v,
            "one sampled row and ten scored ones"
        );
        compare(
            &format!("tie={tie} mixed logits"),
            &want.logits,
            &got.logits,
            v,
        );
        compare(
            &format!("tie={tie} mixed hidden"),
            &want.hidden,
            &got.hidden,
            cfg.hidden_size,
        );

        // Apart from the pool: an embedding over two chunks of max_num_batched_tokens, and
        // prompt logits in steps of max_num_seqs rows and token by token.
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % v as u32).collect();
        compare(
            &format!("tie={tie} embed"),
            &cpu.embed(&prompt).expect("cpu embed"),
            &gpu.embed(&prompt).expect("gpu embed"),
            cfg.hidden_size,
        );
        for by_step in [false, true] {
            compare(
                &format!("tie={tie} prompt_logits step_by_step={by_step}"),
                &cpu.prompt_logits(&prompt[..11], by_step).expect("cpu"),
                &gpu.prompt_logits(&prompt[..11], by_step).expect("gpu"),
                v,
            );
        }
        assert!(matches!(gpu.embed(&[]), Err(ModelError::EmptyInput)));
        // The engine's pool was left alone: a decode of the first sequence still matches.
        let again = step(&[(&a[..1], 9, &ta, true)]);
        let want = cpu.forward(&again).expect("cpu").logits;
        let got = gpu.forward(&again).expect("gpu").logits;
        compare(&format!("tie={tie} pool untouched"), &want, &got, v);

        // Draws on the device: the same step with its rows drawn (greedy and seeded) returns
        // tokens and no logits; each is what the draw's CPU twin picks from the GPU's own
        // logits row (greedy exactly; a random draw among the twin's survivors), with the
        // row's raw logprob.
        let rules = [
            DrawRule::Greedy,
            DrawRule::Random {
                temperature: 0.8,
                top_k: Some(20),
                top_p: 0.9,
                min_p: 0.0,
            },
            DrawRule::Random {
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                min_p: 0.05,
            },
        ];
        let seqs: [(&[u32], usize, &[u32]); 3] =
            [(&a[..1], 9, &ta), (&b[..1], 9, &ta_fork), (&c[..1], 5, &tc)];
        let mut logits_step = ForwardBatch::default();
        let mut draw_step = ForwardBatch::default();
        for (i, &(tokens, start, table)) in seqs.iter().enumerate() {
            let slots = slots(table, start..start + 1);
            logits_step.push(tokens, start, slots.clone(), table.to_vec(), true);
            let draw = Draw {
                seed: 40 + i as u64,
                offset: 3,
                rule: rules[i],
                adjust: None,
                // The greedy row also asks for its rank and 3 top logprobs.
                logprobs: (i == 0).then_some(3),
                allowed: None,
            };
            draw_step.push_span(tokens, start, slots, table.to_vec(), SpanOutput::Draw(draw));
        }
        let rows = gpu.forward(&logits_step).expect("gpu logits").logits;
        let drawn = gpu.forward(&draw_step).expect("gpu draws");
        assert!(drawn.logits.is_empty(), "drawn rows send no logits");
        assert_eq!(drawn.tokens.len(), 3);
        for (i, (row, got)) in rows.chunks(v).zip(&drawn.tokens).enumerate() {
            let SpanOutput::Draw(draw) = &draw_step.seqs[i].output else {
                unreachable!()
            };
            let twin = draw.on_host(row).expect("twin");
            if i == 0 {
                assert_eq!(got.token_id, twin.token_id, "tie={tie}: greedy draw");
                assert_eq!(got.rank, twin.rank, "tie={tie}: rank");
                let ids = |t: &[(u32, f32)]| t.iter().map(|p| p.0).collect::<Vec<_>>();
                assert_eq!(ids(&got.top_logprobs), ids(&twin.top_logprobs), "tie={tie}");
                for (a, b) in got.top_logprobs.iter().zip(&twin.top_logprobs) {
                    assert!((a.1 - b.1).abs() < 1e-4, "tie={tie}: top logprob");
                }
            }
            assert!(
                (got.logprob - twin.logprob).abs() < 1e-4,
                "tie={tie} row {i}: logprob {} vs {}",
                got.logprob,
                twin.logprob
            );
            assert!(row[got.token_id as usize].is_finite());
        }
        // A batch mixing drawn and logits rows returns each kind in span order.
        let mut mixed = ForwardBatch::default();
        let s0 = &draw_step.seqs[0];
        mixed.push_span(
            &a[..1],
            9,
            slots(&ta, 9..10),
            ta.to_vec(),
            s0.output.clone(),
        );
        mixed.push(&c[..1], 5, slots(&tc, 5..6), tc.to_vec(), true);
        let out = gpu.forward(&mixed).expect("gpu mixed draws");
        assert_eq!(out.tokens.len(), 1);
        assert_eq!(out.tokens[0].token_id, drawn.tokens[0].token_id);
        compare(
            &format!("tie={tie} logits beside a draw"),
            &rows[2 * v..],
            &out.logits,
            v,
        );
        // A drawn row with edits: its best token masked, another biased and a third
        // penalised; the GPU draws what the twin draws from the same row after the edits.
        let best = (0..v as u32)
            .max_by(|&x, &y| rows[x as usize].total_cmp(&rows[y as usize]))
            .expect("a row");
        let edits = vec![
            RowEdit {
                token_id: best,
                output_count: 0,
                flags: RowEdit::MASK,
                bias: 0.0,
            },
            RowEdit {
                token_id: (best + 1) % v as u32,
                output_count: 2,
                flags: RowEdit::PENALIZE | RowEdit::IN_PROMPT,
                bias: 0.0,
            },
            RowEdit {
                token_id: (best + 7) % v as u32,
                output_count: 0,
                flags: 0,
                bias: 1.0,
            },
        ];
        let mut edits = edits;
        edits.sort_by_key(|e| e.token_id);
        let edited = Draw {
            seed: 1,
            offset: 0,
            rule: DrawRule::Greedy,
            adjust: Some(std::sync::Arc::new(Adjust {
                penalties: RowPenalties {
                    repetition: 1.3,
                    frequency: 0.4,
                    presence: 0.2,
                    _pad: 0.0,
                },
                edits,
            })),
            logprobs: None,
            allowed: None,
        };
        let mut one = ForwardBatch::default();
        one.push_span(
            &a[..1],
            9,
            slots(&ta, 9..10),
            ta.to_vec(),
            SpanOutput::Draw(edited.clone()),
        );
        let got = gpu.forward(&one).expect("gpu edited draw").tokens;
        let twin = edited.on_host(&rows[..v]).expect("twin");
        assert_eq!(
            got[0].token_id, twin.token_id,
            "tie={tie}: edited greedy draw"
        );
        assert_ne!(
            got[0].token_id, best,
            "tie={tie}: the masked best is never drawn"
        );
        assert!((got[0].logprob - twin.logprob).abs() < 1e-4);

        // A grammar's mask: only ids 5 and 17 allowed; the logprob is the masked row's.
        let mut words = vec![0u32; v.div_ceil(32)];
        words[0] |= 1 << 5;
        words[0] |= 1 << 17;
        let masked = Draw {
            allowed: Some(words.into()),
            logprobs: Some(2),
            ..edited
        };
        let mut one = ForwardBatch::default();
        one.push_span(
            &a[..1],
            9,
            slots(&ta, 9..10),
            ta.to_vec(),
            SpanOutput::Draw(masked.clone()),
        );
        let got = gpu.forward(&one).expect("gpu masked draw").tokens;
        let twin = masked.on_host(&rows[..v]).expect("twin");
        assert!([5, 17].contains(&got[0].token_id), "tie={tie}: masked draw");
        assert_eq!(got[0].token_id, twin.token_id, "tie={tie}: masked draw");
        assert!((got[0].logprob - twin.logprob).abs() < 1e-4);
        assert_eq!(got[0].top_logprobs.len(), 2);

        // The CPU draws nothing itself: such a batch is refused, not sampled.
        assert!(matches!(
            cpu.forward(&draw_step),
            Err(ModelError::Unsupported { .. })
        ));
    }
}

/// A PEFT adapter directory for the test model: rank `r`, `lora_alpha` 2r, random A and B
/// (uniform in ±0.3, seeded) for `targets` in every layer.
fn write_adapter(dir: &Path, cfg: &Qwen2Config, r: usize, targets: &[(Target, &str)], seed: u64) {
    std::fs::create_dir_all(dir).expect("adapter dir");
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.6
            })
            .collect()
    };
    let mut tensors = HashMap::new();
    for layer in 0..cfg.num_hidden_layers {
        for &(target, path) in targets {
            let (out, inp) = target.shape(cfg);
            let prefix = format!("base_model.model.model.layers.{layer}.{path}");
            let a = Tensor::from_vec(values(r * inp), (r, inp), &candle_core::Device::Cpu);
            let b = Tensor::from_vec(values(out * r), (out, r), &candle_core::Device::Cpu);
            tensors.insert(format!("{prefix}.lora_A.weight"), a.expect("A"));
            tensors.insert(format!("{prefix}.lora_B.weight"), b.expect("B"));
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors"))
        .expect("adapter safetensors");
    let modules: Vec<&str> = targets
        .iter()
        .map(|(_, p)| p.rsplit('.').next().expect("module"))
        .collect();
    let config = serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
        "target_modules": modules, "bias": "none"});
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).expect("config");
}

/// LoRA on the GPU: steps mixing two adapters (rank 8 on every projection; rank 16 on q, v and
/// down only), the base model, prefills and decodes, against the CPU executor on the same
/// adapters. On the CPU alone (no GPU) it checks that the adapters change the logits, so the
/// comparison on a GPU would notice an update that was never applied.
#[test]
fn cuda_lora_updates_match_the_cpu_in_mixed_batches() {
    use novainfer_model::lora::{AdapterId, AdapterLimits, AdapterRef, LoraAdapter};
    use std::sync::Arc;
    const ALL: [(Target, &str); 7] = [
        (Target::Q, "self_attn.q_proj"),
        (Target::K, "self_attn.k_proj"),
        (Target::V, "self_attn.v_proj"),
        (Target::O, "self_attn.o_proj"),
        (Target::Gate, "mlp.gate_proj"),
        (Target::Up, "mlp.up_proj"),
        (Target::Down, "mlp.down_proj"),
    ];
    let cfg = config(false);
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(dir.path(), &cfg);
    write_adapter(&dir.path().join("a"), &cfg, 8, &ALL, 1);
    write_adapter(
        &dir.path().join("b"),
        &cfg,
        16,
        &[ALL[0], ALL[2], ALL[6]],
        2,
    );
    let limits = AdapterLimits { max_rank: 16 };
    let load = |name: &str, id: u64| {
        let path = dir.path().join(name);
        let adapter = LoraAdapter::load(&path, AdapterId(id), name, &cfg, limits).expect("adapter");
        AdapterRef(Arc::new(adapter))
    };
    let (a, b) = (load("a", 1), load("b", 2));
    let v = cfg.vocab_size;
    // (tokens, first position, block table, adapter) per sequence.
    type Tagged<'a> = (&'a [u32], usize, &'a [u32], Option<&'a AdapterRef>);
    let tagged = |spans: &[Tagged<'_>]| {
        let plain: Vec<(&[u32], usize, &[u32], bool)> = spans
            .iter()
            .map(|&(t, s, tb, _)| (t, s, tb, true))
            .collect();
        let mut batch = step(&plain);
        for (seq, span) in batch.seqs.iter_mut().zip(spans) {
            seq.adapter = span.3.cloned();
        }
        batch
    };
    let (p0, p1, p2, p3): (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>) = (
        vec![3, 17, 42, 8, 9, 5],
        vec![10, 11, 12, 13],
        vec![7, 7, 2, 60, 61],
        vec![20, 21, 22],
    );
    let steps = [
        // Three prefills: adapter a, the base model, adapter b.
        tagged(&[
            (&p0[..5], 0, &[0, 1], Some(&a)),
            (&p1[..3], 0, &[2], None),
            (&p2[..4], 0, &[3, 4], Some(&b)),
        ]),
        // Their decodes with a new prompt on adapter a: a mixed step.
        tagged(&[
            (&p0[5..6], 5, &[0, 1], Some(&a)),
            (&p1[3..4], 3, &[2], None),
            (&p2[4..5], 4, &[3, 4], Some(&b)),
            (&p3[..], 0, &[5], Some(&a)),
        ]),
    ];
    let f32_kv = KvCacheDtype::Fixed(KvStorage::F32);
    let mut cpu = executor_with(dir.path(), Device::Cpu, f32_kv).expect("cpu executor");
    let mut base = executor_with(dir.path(), Device::Cpu, f32_kv).expect("cpu executor");
    let expected: Vec<Vec<f32>> = steps
        .iter()
        .map(|s| cpu.forward(s).expect("cpu step").logits)
        .collect();
    // The adapters move their rows' logits well past the GPU comparison's tolerance.
    let untagged: Vec<ForwardBatch> = steps
        .iter()
        .map(|s| {
            let mut s = s.clone();
            s.seqs.iter_mut().for_each(|q| q.adapter = None);
            s
        })
        .collect();
    for (i, (s, want)) in untagged.iter().zip(&expected).enumerate() {
        let plain = base.forward(s).expect("cpu base step").logits;
        for (r, (w, p)) in want.chunks(v).zip(plain.chunks(v)).enumerate() {
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            let moved = w.iter().zip(p).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            let has_adapter = steps[i].seqs[r].adapter.is_some();
            assert_eq!(
                moved > 0.2 * scale,
                has_adapter,
                "step {i} row {r}: the adapter moved the logits by {moved} (scale {scale})"
            );
        }
    }
    let Some(mut gpu) = gpu_executor(dir.path()) else {
        return;
    };
    for (i, (s, want)) in steps.iter().zip(&expected).enumerate() {
        let got = gpu.forward(s).expect("gpu step with adapters").logits;
        compare(&format!("lora step {i}"), want, &got, v);
    }
}
