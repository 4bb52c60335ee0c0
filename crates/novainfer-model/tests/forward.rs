//! Model-level tests on a tiny random Qwen2 held in memory.

mod common;

use common::{build, build_kv, config, tensor, weights};
use novainfer_model::{LogitsFor, ModelError};

#[test]
fn prefill_equals_step_by_step_decode() {
    for tie in [false, true] {
        let cfg = config(tie);
        let model = build(cfg.clone(), weights(&cfg)).expect("valid tiny model");
        let tokens = [3u32, 17, 42, 8, 8, 0, 31];
        let mut cache = model.new_cache(64);
        let all = model
            .forward(&tokens, &mut cache, LogitsFor::AllTokens)
            .expect("prefill");
        assert_eq!(cache.len(), tokens.len());
        let mut step_cache = model.new_cache(64);
        for (i, &t) in tokens.iter().enumerate() {
            let row = model
                .forward(&[t], &mut step_cache, LogitsFor::LastToken)
                .expect("decode");
            let expected = &all[i * cfg.vocab_size..(i + 1) * cfg.vocab_size];
            let diff = row
                .iter()
                .zip(expected)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "tie={tie} position {i}: max diff {diff}");
        }
        let spread = all.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            - all.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(
            spread > 0.5,
            "logits are degenerate ({spread}); the comparison would prove nothing"
        );
    }
}

#[test]
fn chunked_prefill_equals_one_prefill() {
    let cfg = config(false);
    let model = build(cfg.clone(), weights(&cfg)).expect("valid tiny model");
    let tokens = [1u32, 2, 3, 4, 5, 6, 7, 8, 9];
    let mut one = model.new_cache(64);
    let full = model
        .forward(&tokens, &mut one, LogitsFor::LastToken)
        .expect("prefill");
    let mut chunked = model.new_cache(64);
    model
        .forward(&tokens[..4], &mut chunked, LogitsFor::LastToken)
        .expect("chunk 1");
    let last = model
        .forward(&tokens[4..], &mut chunked, LogitsFor::LastToken)
        .expect("chunk 2");
    let diff = full
        .iter()
        .zip(&last)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-5, "max diff {diff}");
}

#[test]
fn missing_tensor_is_named() {
    let cfg = config(false);
    let mut w = weights(&cfg);
    w.remove("model.layers.1.mlp.up_proj.weight");
    match build(cfg, w) {
        Err(ModelError::MissingTensor { name }) => {
            assert_eq!(name, "model.layers.1.mlp.up_proj.weight")
        }
        other => panic!("expected MissingTensor, got {:?}", other.err()),
    }
}

#[test]
fn misshaped_tensor_names_both_shapes() {
    let cfg = config(false);
    let mut w = weights(&cfg);
    w.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        tensor(&[32, 32], 9, 0.1),
    );
    let err = build(cfg, w).err().expect("k_proj has the wrong shape");
    let msg = err.to_string();
    assert!(
        msg.contains("model.layers.0.self_attn.k_proj.weight")
            && msg.contains("[32, 32]")
            && msg.contains("[16, 32]"),
        "{msg}"
    );
}

#[test]
fn unexpected_tensor_is_named() {
    let cfg = config(false);
    let mut w = weights(&cfg);
    w.insert(
        "model.layers.2.mlp.up_proj.weight".into(),
        tensor(&[48, 32], 9, 0.1),
    );
    match build(cfg, w) {
        Err(ModelError::UnexpectedTensor { name }) => {
            assert_eq!(name, "model.layers.2.mlp.up_proj.weight")
        }
        other => panic!("expected UnexpectedTensor, got {:?}", other.err()),
    }
}

#[test]
fn out_of_range_token_and_overflow_are_errors() {
    let cfg = config(false);
    let model = build(cfg.clone(), weights(&cfg)).expect("valid tiny model");
    let mut cache = model.new_cache(4);
    assert!(matches!(
        model.forward(&[50], &mut cache, LogitsFor::LastToken),
        Err(ModelError::TokenOutOfRange { id: 50, .. })
    ));
    assert!(matches!(
        model.forward(&[1, 2, 3, 4, 5], &mut cache, LogitsFor::LastToken),
        Err(ModelError::ContextOverflow {
            needed: 5,
            capacity: 4
        })
    ));
    assert_eq!(
        cache.len(),
        0,
        "a rejected forward must not change the cache"
    );
}

/// Slots for `positions` of a sequence stored in `table` (blocks of `bs` tokens).
fn slots(table: &[u32], positions: std::ops::Range<usize>, bs: usize) -> Vec<usize> {
    positions
        .map(|p| table[p / bs] as usize * bs + p % bs)
        .collect()
}

#[test]
fn mixed_batch_rows_equal_each_sequence_alone_bit_for_bit() {
    for dtype in ["f32", "f16", "bf16", "q8_0"] {
        mixed_batch_rows_equal_each_sequence_alone(dtype);
    }
}

fn mixed_batch_rows_equal_each_sequence_alone(dtype: &str) {
    use novainfer_model::{ForwardBatch, PagedKvCache};
    let cfg = config(false);
    let model = build_kv(cfg.clone(), weights(&cfg), dtype).expect("valid tiny model");
    let bs = 4;
    let a: Vec<u32> = vec![3, 17, 42, 8, 8, 0, 31, 5, 9];
    let b: Vec<u32> = vec![11, 12, 13, 14, 15, 16];
    let c: Vec<u32> = vec![7, 7, 2];
    let (ta, tb, tc) = (vec![5u32, 1, 8], vec![0u32, 6], vec![3u32]);
    let mut kv = PagedKvCache::new(&cfg, 10, bs, model.kv_dtype());

    // Step 1: a's first 5 tokens and b's first 5 (prefill chunks); nothing of c yet.
    let mut step1 = ForwardBatch::default();
    step1.push(&a[..5], 0, slots(&ta, 0..5, bs), ta.clone(), false);
    step1.push(&b[..5], 0, slots(&tb, 0..5, bs), tb.clone(), true);
    model
        .forward_batch(&step1, &mut kv, LogitsFor::LastToken)
        .expect("step 1");
    // Step 2: the rest of a (chunk), one decode token of b, and all of c.
    let mut step2 = ForwardBatch::default();
    step2.push(&a[5..], 5, slots(&ta, 5..9, bs), ta.clone(), true);
    step2.push(&b[5..], 5, slots(&tb, 5..6, bs), tb.clone(), true);
    step2.push(&c, 0, slots(&tc, 0..3, bs), tc.clone(), true);
    let batched = model
        .forward_batch(&step2, &mut kv, LogitsFor::LastToken)
        .expect("step 2");

    let v = cfg.vocab_size;
    for (i, seq) in [&a, &b, &c].into_iter().enumerate() {
        let mut alone = model.new_cache(16);
        let expected = model
            .forward(seq, &mut alone, LogitsFor::LastToken)
            .expect("alone");
        assert_eq!(
            batched[i * v..(i + 1) * v],
            expected[..],
            "{dtype}: sequence {i} differs when batched"
        );
    }
}

#[test]
fn a_batch_beyond_its_block_table_is_an_error_not_a_panic() {
    use novainfer_model::{ForwardBatch, PagedKvCache};
    let cfg = config(false);
    let model = build(cfg.clone(), weights(&cfg)).expect("valid tiny model");
    let mut kv = PagedKvCache::new(&cfg, 2, 4, model.kv_dtype());
    let mut batch = ForwardBatch::default();
    batch.push(&[1, 2, 3, 4, 5], 0, vec![0, 1, 2, 3, 4], vec![0], true);
    assert!(model
        .forward_batch(&batch, &mut kv, LogitsFor::LastToken)
        .is_err());
    let mut batch = ForwardBatch::default();
    batch.push(&[1], 0, vec![99], vec![0], true);
    assert!(model
        .forward_batch(&batch, &mut kv, LogitsFor::LastToken)
        .is_err());
}

#[test]
fn embedding_is_the_unit_final_hidden_state_of_the_last_token() {
    let cfg = config(true);
    let w = weights(&cfg);
    let table: Vec<f32> = w["model.embed_tokens.weight"]
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("embedding table");
    let model = build(cfg.clone(), w).expect("valid tiny model");
    let tokens = [3u32, 17, 42, 8];
    let e = model.embed(&tokens).expect("embed");
    assert_eq!(e.len(), cfg.hidden_size);
    let norm: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    // With tied weights the logits are table · (final normed hidden state), so they
    // must be a positive multiple of table · embedding.
    let logits = model
        .forward(&tokens, &mut model.new_cache(8), LogitsFor::LastToken)
        .expect("forward");
    let projected: Vec<f32> = table
        .chunks_exact(cfg.hidden_size)
        .map(|row| row.iter().zip(&e).map(|(a, b)| a * b).sum())
        .collect();
    let scale = logits
        .iter()
        .zip(&projected)
        .map(|(a, b)| a * b)
        .sum::<f32>()
        / projected.iter().map(|b| b * b).sum::<f32>();
    assert!(scale > 0.0);
    for (l, p) in logits.iter().zip(&projected) {
        assert!((l - scale * p).abs() < 1e-4, "{l} vs {}", scale * p);
    }
    assert!(matches!(model.embed(&[]), Err(ModelError::EmptyInput)));
}

/// The CUDA executor runs a step with embeddings and scored prompts as several forwards
/// (`ForwardBatch::select`, `row_passes`); on the CPU, those pieces give exactly what
/// the one mixed step gives, and the mixed step's rows equal each request computed alone.
#[test]
fn a_mixed_step_equals_its_pieces_and_each_request_alone() {
    use novainfer_model::{ForwardBatch, PagedKvCache, SpanOutput};
    let cfg = config(false);
    let model = build(cfg.clone(), weights(&cfg)).expect("valid tiny model");
    let bs = 4;
    let gen: Vec<u32> = vec![3, 17, 42, 8, 8];
    let emb: Vec<u32> = (10..20).collect();
    let score: Vec<u32> = vec![7, 7, 2, 40, 41, 5, 9];
    let spans = [
        (&gen[..], vec![0u32, 1], SpanOutput::LastLogits),
        (&emb[..], vec![2, 3, 4], SpanOutput::LastHidden),
        (&score[..], vec![5, 6], SpanOutput::AllLogits),
    ];
    let mut mixed = ForwardBatch::default();
    for (tokens, table, out) in &spans {
        let slots = slots(table, 0..tokens.len(), bs);
        mixed.push_span(tokens, 0, slots, table.clone(), out.clone());
    }
    let mut kv = PagedKvCache::new(&cfg, 16, bs, model.kv_dtype());
    let got = model.forward_outputs(&mixed, &mut kv).expect("mixed step");
    let v = cfg.vocab_size;
    assert_eq!(got.logits.len(), (1 + score.len()) * v);
    assert_eq!(got.hidden.len(), cfg.hidden_size);

    // The pieces, in a fresh pool, as the CUDA executor runs them: the embedding alone, the
    // rest as `row_passes` (the scored tokens as one-token spans), 3 or 4 spans a pass.
    for max_spans in [3, 4, 64] {
        let mut kv = PagedKvCache::new(&cfg, 16, bs, model.kv_dtype());
        let hidden = model
            .forward_outputs(&mixed.select(&[1]), &mut kv)
            .expect("embedding")
            .hidden;
        let passes = mixed.row_passes(max_spans).expect("passes");
        assert_eq!(passes.len(), (1 + score.len()).div_ceil(max_spans));
        let mut logits = Vec::new();
        for pass in &passes {
            logits.extend(model.forward_outputs(pass, &mut kv).expect("pass").logits);
        }
        assert_eq!(logits, got.logits, "{max_spans} spans a pass");
        assert_eq!(hidden, got.hidden);
    }

    // Each alone, apart from any pool: the same numbers.
    let mut alone = model
        .forward(&gen, &mut model.new_cache(8), LogitsFor::LastToken)
        .expect("generation alone");
    alone.extend(
        model
            .forward(&score, &mut model.new_cache(8), LogitsFor::AllTokens)
            .expect("scored alone"),
    );
    assert_eq!(alone, got.logits);
    let mut unit = got.hidden.clone();
    let norm = unit
        .iter()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt() as f32;
    unit.iter_mut().for_each(|x| *x /= norm);
    let want = model.embed(&emb).expect("embedding alone");
    for (a, b) in unit.iter().zip(&want) {
        assert!((a - b).abs() < 1e-6, "embedding {a} vs {b}");
    }
}

#[test]
fn chunked_prefill_is_bit_identical_for_every_kv_dtype() {
    // 600 tokens cross the kernel's partitions (256 positions); chunks of 7, 64 and 512 split
    // them in unaligned places, and every row's logits must equal one prefill's bit for bit.
    let mut cfg = config(false);
    cfg.max_position_embeddings = 1024;
    let tokens: Vec<u32> = (0..600).map(|i| (i * 7 + 3) % 50).collect();
    for dtype in ["f32", "f16", "bf16", "q8_0"] {
        let model = build_kv(cfg.clone(), weights(&cfg), dtype).expect("valid tiny model");
        let mut one = model.new_cache(tokens.len());
        let whole = model
            .forward(&tokens, &mut one, LogitsFor::AllTokens)
            .expect("prefill");
        for chunk in [7, 64, 512] {
            let mut cache = model.new_cache(tokens.len());
            let mut rows = Vec::new();
            for part in tokens.chunks(chunk) {
                rows.extend(
                    model
                        .forward(part, &mut cache, LogitsFor::AllTokens)
                        .expect("chunk"),
                );
            }
            assert!(
                rows == whole,
                "{dtype}: chunks of {chunk} differ from one prefill"
            );
        }
    }
}

/// A decode step reads every tensor of the checkpoint once except the embedding table, of which it
/// looks up one row; tied, that table is the output head and is read whole.
#[test]
fn weight_bytes_per_token_counts_every_weight_a_step_reads() {
    for tie in [false, true] {
        let w = weights(&config(tie));
        let all: usize = w.values().map(|t| t.elem_count() * 4).sum();
        let table = w["model.embed_tokens.weight"].elem_count() * 4;
        let expected = if tie { all } else { all - table };
        let model = build(config(tie), w).expect("builds");
        assert_eq!(model.weight_bytes_per_token(), expected, "tied: {tie}");
    }
}

/// `lm_head_dtype = q8_0` quantizes a dense head (tied or not): fewer bytes a token, logits
/// close to the exact head's; a head the checkpoint already quantized is left as it is.
#[test]
fn a_q8_0_lm_head_reads_fewer_bytes_and_moves_logits_by_little() {
    use common::{MemorySource, Stored};
    use novainfer_model::{LmHeadDtype, LoadOptions, Qwen2Model};
    let q8 = LoadOptions {
        lm_head_dtype: LmHeadDtype::Q8_0,
        ..LoadOptions::default()
    };
    let tokens = [3u32, 17, 42, 8, 8, 0, 31];
    for tie in [false, true] {
        let cfg = config(tie);
        let exact = build(cfg.clone(), weights(&cfg)).expect("builds");
        let quant = Qwen2Model::build(cfg.clone(), MemorySource::dense(weights(&cfg)), &q8)
            .expect("builds");
        let head_f32 = cfg.vocab_size * cfg.hidden_size * 4;
        assert!(
            quant.weight_bytes_per_token() < exact.weight_bytes_per_token() - head_f32 / 2,
            "tied: {tie}: {} vs {}",
            quant.weight_bytes_per_token(),
            exact.weight_bytes_per_token()
        );
        let logits = |m: &Qwen2Model| {
            let mut cache = m.new_cache(64);
            m.forward(&tokens, &mut cache, LogitsFor::AllTokens)
                .expect("prefill")
        };
        let (a, b) = (logits(&exact), logits(&quant));
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let spread = a.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            - a.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(diff > 0.0, "tied: {tie}: the head was not quantized");
        assert!(
            diff < 0.02 * spread,
            "tied: {tie}: max diff {diff}, spread {spread}"
        );
    }
    // A checkpoint's own quantized head (GGUF) is not quantized again.
    let cfg = config(false);
    let stored = || {
        let mut w: std::collections::HashMap<String, Stored> = weights(&cfg)
            .into_iter()
            .map(|(k, t)| (k, Stored::Dense(t)))
            .collect();
        let head = Stored::quantize(
            &tensor(&[50, 32], 9, 0.5),
            candle_core::quantized::GgmlDType::Q5_0,
        );
        w.insert("lm_head.weight".into(), head);
        MemorySource(w)
    };
    let auto = Qwen2Model::build(cfg.clone(), stored(), &LoadOptions::default()).expect("builds");
    let kept = Qwen2Model::build(cfg.clone(), stored(), &q8).expect("builds");
    assert_eq!(kept.weight_bytes_per_token(), auto.weight_bytes_per_token());
    let mut c1 = auto.new_cache(64);
    let mut c2 = kept.new_cache(64);
    assert_eq!(
        auto.forward(&tokens, &mut c1, LogitsFor::AllTokens)
            .expect("a"),
        kept.forward(&tokens, &mut c2, LogitsFor::AllTokens)
            .expect("b")
    );
}
