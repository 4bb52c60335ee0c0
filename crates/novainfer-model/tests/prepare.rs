//! Host-side preparation for the GPU, checked without one: the fused QKV and gate|up
//! matrices (and the QKV bias) against the CPU's separate `Linear`s, quantized parts
//! against candle, and the reader's name and shape checks against the CPU builder's.

mod common;

use std::collections::HashMap;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use common::{config, round_to_bf16, tensor, weights, MemorySource, Stored};
use novainfer_model::layers::Linear;
use novainfer_model::prepare::{HostMatrix, HostModelReader, PartData};
use novainfer_model::{ModelError, Qwen2Config};

fn to_f32_tensor(m: &HostMatrix) -> Tensor {
    let values: Vec<f32> = m
        .to_bf16()
        .expect("assemble")
        .into_iter()
        .map(f32::from)
        .collect();
    Tensor::from_vec(values, (m.rows(), m.cols), &Device::Cpu).expect("tensor")
}

fn vec_of(t: &Tensor) -> Vec<f32> {
    t.flatten_all().and_then(|t| t.to_vec1()).expect("vector")
}

/// Splits `[rows, sum(widths)]` into one `[rows, width]` block per width.
fn split_columns(y: &[f32], rows: usize, widths: &[usize]) -> Vec<Vec<f32>> {
    let total: usize = widths.iter().sum();
    let mut parts = vec![Vec::new(); widths.len()];
    for r in 0..rows {
        let mut at = r * total;
        for (part, &w) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&y[at..at + w]);
            at += w;
        }
    }
    parts
}

#[test]
fn fused_qkv_and_gate_up_equal_the_separate_cpu_linears() {
    let cfg = config(false);
    // bf16-exact weights: the fused matrix is bf16, and the comparison is about layout.
    let w = round_to_bf16(weights(&cfg));
    let mut reader = HostModelReader::new(cfg.clone(), MemorySource::dense(w.clone()));
    reader.embedding().expect("embedding");
    let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
    let kv = cfg.num_key_value_heads * cfg.head_dim();
    let rows = 5;
    let x = vec_of(&tensor(&[rows, h], 77, 1.0));
    let xf = vec_of(&tensor(&[rows, f], 78, 1.0));
    for i in 0..cfg.num_hidden_layers {
        let layer = reader.layer(i).expect("layer");
        let p = format!("model.layers.{i}");
        let separate = |name: &str, bias: bool, input: &[f32]| {
            let b = bias.then(|| vec_of(&w[&format!("{p}.{name}.bias")]));
            let lin = Linear::dense(w[&format!("{p}.{name}.weight")].clone(), b).expect("linear");
            lin.forward(input, rows).expect("forward")
        };

        let fused = Linear::dense(to_f32_tensor(&layer.qkv), Some(layer.qkv_bias.clone()))
            .expect("fused qkv");
        let y = fused.forward(&x, rows).expect("forward");
        let parts = split_columns(&y, rows, &[h, kv, kv]);
        for (part, name) in parts.iter().zip(["q_proj", "k_proj", "v_proj"]) {
            assert_eq!(
                *part,
                separate(&format!("self_attn.{name}"), true, &x),
                "{p} {name}"
            );
        }

        let fused = Linear::dense(to_f32_tensor(&layer.gate_up), None).expect("fused gate_up");
        let y = fused.forward(&x, rows).expect("forward");
        let parts = split_columns(&y, rows, &[f, f]);
        assert_eq!(
            parts[0],
            separate("mlp.gate_proj", false, &x),
            "{p} gate rows first"
        );
        assert_eq!(
            parts[1],
            separate("mlp.up_proj", false, &x),
            "{p} up rows second"
        );

        let o = Linear::dense(to_f32_tensor(&layer.o_proj), None).expect("o_proj");
        assert_eq!(
            o.forward(&x, rows).expect("o"),
            separate("self_attn.o_proj", false, &x)
        );
        let down = Linear::dense(to_f32_tensor(&layer.down_proj), None).expect("down");
        assert_eq!(
            down.forward(&xf, rows).expect("down"),
            separate("mlp.down_proj", false, &xf)
        );
        assert_eq!(
            layer.input_layernorm,
            vec_of(&w[&format!("{p}.input_layernorm.weight")])
        );
        assert_eq!(
            layer.post_attention_layernorm,
            vec_of(&w[&format!("{p}.post_attention_layernorm.weight")])
        );
    }
    assert_eq!(
        reader.final_norm().expect("norm"),
        vec_of(&w["model.norm.weight"])
    );
    let head = reader.lm_head().expect("lm_head").expect("untied");
    assert_eq!(
        to_f32_tensor(&head).to_vec2::<f32>().expect("v"),
        w["lm_head.weight"].to_vec2::<f32>().expect("v")
    );
    reader.finish().expect("nothing left over");
}

/// A GGUF-like layer: each projection in a different quant type, as in the demo files.
fn quantized_config() -> Qwen2Config {
    Qwen2Config {
        hidden_size: 256,
        intermediate_size: 512,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        num_hidden_layers: 1,
        ..config(false)
    }
}

#[test]
fn fused_quantized_parts_equal_candles_dequantize_rounded_to_bf16() {
    let cfg = quantized_config();
    let mut stored: HashMap<String, Stored> = weights(&cfg)
        .into_iter()
        .map(|(k, t)| (k, Stored::Dense(t)))
        .collect();
    let types = [
        ("self_attn.q_proj", GgmlDType::Q4K),
        ("self_attn.k_proj", GgmlDType::Q6K),
        ("self_attn.v_proj", GgmlDType::Q8_0),
        ("mlp.gate_proj", GgmlDType::Q5_0),
        ("mlp.up_proj", GgmlDType::Q4K),
        ("mlp.down_proj", GgmlDType::Q4_1), // no GPU kernel: dequantized on the host
    ];
    for (m, dtype) in types {
        let name = format!("model.layers.0.{m}.weight");
        let Stored::Dense(t) = &stored[&name] else {
            unreachable!()
        };
        let q = Stored::quantize(t, dtype);
        stored.insert(name, q);
    }
    let expected = |name: &str| -> Vec<u16> {
        vec_of(&stored[&format!("model.layers.0.{name}.weight")].to_f32())
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    let want_qkv: Vec<u16> = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        .iter()
        .flat_map(|n| expected(n))
        .collect();
    let want_gate_up: Vec<u16> = ["mlp.gate_proj", "mlp.up_proj"]
        .iter()
        .flat_map(|n| expected(n))
        .collect();
    let want_down = expected("mlp.down_proj");

    let mut reader = HostModelReader::new(cfg.clone(), MemorySource(stored));
    reader.embedding().expect("embedding");
    let layer = reader.layer(0).expect("layer");
    let bits = |m: &HostMatrix| -> Vec<u16> {
        m.to_bf16()
            .expect("assemble")
            .into_iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(&layer.qkv), want_qkv);
    assert_eq!(bits(&layer.gate_up), want_gate_up);
    assert_eq!(bits(&layer.down_proj), want_down);
    // Raw upload for the GPU's types, host bf16 for the rest; offsets are row blocks.
    let kinds: Vec<bool> = layer
        .qkv
        .parts
        .iter()
        .map(|p| matches!(p.data, PartData::Quantized { .. }))
        .collect();
    assert_eq!(kinds, [true, true, true]);
    assert!(matches!(layer.down_proj.parts[0].data, PartData::Bf16(_)));
    let offsets: Vec<usize> = layer.qkv.placed().map(|(at, _)| at).collect();
    assert_eq!(offsets, [0, 256 * 256, 256 * 256 + 128 * 256]);
}

#[test]
fn the_reader_checks_names_and_shapes_like_the_cpu_builder() {
    let cfg = config(false);
    let read_all = |w: HashMap<String, Tensor>, cfg: &Qwen2Config| -> Result<(), ModelError> {
        let mut r = HostModelReader::new(cfg.clone(), MemorySource::dense(w));
        r.embedding()?;
        for i in 0..cfg.num_hidden_layers {
            r.layer(i)?;
        }
        r.final_norm()?;
        r.lm_head()?;
        r.finish()
    };
    read_all(weights(&cfg), &cfg).expect("valid");

    let mut w = weights(&cfg);
    w.remove("model.layers.1.mlp.up_proj.weight");
    assert!(matches!(
        read_all(w, &cfg),
        Err(ModelError::MissingTensor { name }) if name == "model.layers.1.mlp.up_proj.weight"
    ));

    let mut w = weights(&cfg);
    w.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        tensor(&[32, 32], 9, 0.1),
    );
    assert!(matches!(
        read_all(w, &cfg),
        Err(ModelError::ShapeMismatch { name, .. }) if name == "model.layers.0.self_attn.k_proj.weight"
    ));

    let mut w = weights(&cfg);
    w.insert(
        "model.layers.2.mlp.up_proj.weight".into(),
        tensor(&[48, 32], 9, 0.1),
    );
    assert!(matches!(
        read_all(w, &cfg),
        Err(ModelError::UnexpectedTensor { name }) if name == "model.layers.2.mlp.up_proj.weight"
    ));

    // Tied: a shipped copy of the table is skipped, and the head is the table.
    let tied = config(true);
    let mut w = weights(&tied);
    w.insert("lm_head.weight".into(), tensor(&[50, 32], 3, 0.1));
    read_all(w, &tied).expect("a tied checkpoint may carry an lm_head copy");
}
