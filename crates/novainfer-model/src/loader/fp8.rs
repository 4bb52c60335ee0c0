//! FP8 (e4m3) weight checkpoints: `quantization_config` with `quant_method: fp8`, as vLLM
//! serializes them (a scale per tensor, `weight_scale`) and as transformers' FineGrainedFP8
//! and the DeepSeek/Qwen3 FP8 releases do (`weight_block_size: [bo, bi]`, one scale per
//! `bo × bi` block in `weight_scale_inv`, which is multiplied despite its name).
//!
//! On the CPU a layer is dequantized at load, `w = f32(q) · s` rounded once to f32 (the
//! product vLLM's dequantization computes), and runs as a dense f32 layer: the weights the
//! checkpoint defines, at 4 bytes each. Activations stay unquantized, so with
//! `activation_scheme: static` the `input_scale` tensors are not used (vLLM rounds
//! activations to FP8 with them; we keep the more exact product).

use std::num::NonZeroUsize;

use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// What `quant_method: fp8` says about the tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8 {
    /// `weight_block_size`: scales per block of `[out, in]`; `None`: per tensor (or per
    /// output channel, whichever shape `weight_scale` has).
    pub block: Option<(NonZeroUsize, NonZeroUsize)>,
    /// `activation_scheme: static`: the checkpoint carries `input_scale`s (read, unused).
    pub static_activations: bool,
}

/// Scale tensors of an FP8 checkpoint, by their last name component: a weight's own (folded
/// into it at load), its static activation scale, and an FP8 KV cache's (`self_attn.k_scale`;
/// the KV cache keeps its own dtype here), none of which is a tensor of the model.
pub const SCALE_SUFFIXES: &[&str] = &[
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "k_scale",
    "v_scale",
    "kv_scale",
];

const FP8_SUPPORTED: &str = "NovaInfer loads quant_method fp8 with e4m3 weights, per-tensor, \
    per-channel or [bo, bi] block scales";

fn unsupported(field: &str, value: &Value) -> ModelError {
    ModelError::UnsupportedQuantization {
        field: field.to_owned(),
        value: value.to_string(),
        supported: FP8_SUPPORTED,
    }
}

impl Fp8 {
    /// `map`: the `quantization_config` object, whose `quant_method` is `fp8`.
    pub fn from_json(map: &Map<String, Value>) -> Result<Self> {
        // transformers' and vLLM's spellings of the element format, where written at all.
        for key in ["fmt", "format"] {
            if let Some(v) = map.get(key) {
                if !matches!(v.as_str(), Some("e4m3" | "float8_e4m3fn")) {
                    return Err(unsupported(key, v));
                }
            }
        }
        let static_activations = match map.get("activation_scheme") {
            None => false,
            Some(v) => match v.as_str() {
                Some("dynamic") => false,
                Some("static") => true,
                _ => return Err(unsupported("activation_scheme", v)),
            },
        };
        let block = match map.get("weight_block_size") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let sizes: Option<Vec<NonZeroUsize>> = v.as_array().and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().and_then(|n| NonZeroUsize::new(n as usize)))
                        .collect()
                });
                match sizes.as_deref() {
                    Some(&[bo, bi]) => Some((bo, bi)),
                    _ => return Err(unsupported("weight_block_size", v)),
                }
            }
        };
        Ok(Self {
            block,
            static_activations,
        })
    }
}

/// `e4m3fn` (the OCP format every FP8 checkpoint uses: no infinities, `S.1111.111` is NaN)
/// as f32, exactly.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((byte >> 3) & 0xF), f32::from(byte & 7));
    match (exp, byte & 7) {
        (15, 7) => f32::NAN,
        (0, _) => sign * man / 8.0 * (-6f32).exp2(),
        _ => sign * (1.0 + man / 8.0) * ((exp - 7) as f32).exp2(),
    }
}

/// The dense f32 weight `[out, in]` of the FP8 `codes` (the stored bytes, `shape`) and their
/// `scale`: a scalar (`[]` or `[1]`), one per output channel (`[out]` or `[out, 1]`), or
/// with `cfg.block` one per block (`[⌈out / bo⌉, ⌈in / bi⌉]`).
pub fn dequantize(
    name: &str,
    cfg: &Fp8,
    shape: &[usize],
    codes: &[u8],
    scale: &Tensor,
) -> Result<Tensor> {
    let bad = |reason: String| ModelError::InvalidQuantTensor {
        name: name.to_owned(),
        reason,
    };
    let &[out, inputs] = shape else {
        return Err(bad(format!("expected a 2-D FP8 weight, found {shape:?}")));
    };
    if codes.len() != out * inputs {
        return Err(bad(format!(
            "{} bytes for a [{out}, {inputs}] FP8 weight",
            codes.len()
        )));
    }
    let scales = scale
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some(s) = scales.iter().find(|s| !s.is_finite()) {
        return Err(bad(format!("a scale of {s}")));
    }
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    // Scale index of element (r, c).
    let scale_of: Box<dyn Fn(usize, usize) -> usize> = match (cfg.block, scales.len()) {
        (Some((bo, bi)), n) => {
            let (rows, cols) = (out.div_ceil(bo.get()), inputs.div_ceil(bi.get()));
            if n != rows * cols {
                return Err(bad(format!(
                    "{n} block scales for a [{out}, {inputs}] weight in blocks of [{bo}, {bi}] \
                     (expected [{rows}, {cols}])"
                )));
            }
            Box::new(move |r, c| (r / bo.get()) * cols + c / bi.get())
        }
        (None, 1) => Box::new(|_, _| 0),
        (None, n) if n == out => Box::new(|r, _| r),
        (None, n) => {
            return Err(bad(format!(
                "{n} scales for a weight of {out} output channels (expected 1 or {out})"
            )))
        }
    };
    let mut values = Vec::with_capacity(codes.len());
    for (i, &code) in codes.iter().enumerate() {
        let q = table[code as usize];
        if q.is_nan() {
            return Err(bad(format!(
                "a NaN code (0x{code:02x}) at [{}, {}]",
                i / inputs,
                i % inputs
            )));
        }
        values.push(q * scales[scale_of(i / inputs, i % inputs)]);
    }
    Ok(Tensor::from_vec(values, (out, inputs), &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: Value) -> Result<Fp8> {
        Fp8::from_json(v.as_object().expect("object"))
    }

    #[test]
    fn every_e4m3_code_decodes_as_the_float8_crate_and_the_ocp_table_say() {
        for code in 0..=255u8 {
            let ours = e4m3_to_f32(code);
            let theirs = float8::F8E4M3::from_bits(code).to_f32();
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "code 0x{code:02x}: {ours} vs {theirs}"
            );
        }
        // The format's landmarks: largest normal 448, smallest subnormal 2^-9, one NaN per sign.
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), (-9f32).exp2());
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!((0..=255u8).filter(|&c| e4m3_to_f32(c).is_nan()).count(), 2);
    }

    #[test]
    fn configs_as_vllm_and_transformers_write_them() {
        assert_eq!(
            cfg(json!({"quant_method": "fp8", "activation_scheme": "dynamic"})).expect("vllm"),
            Fp8 {
                block: None,
                static_activations: false
            }
        );
        let block = cfg(json!({"quant_method": "fp8", "activation_scheme": "static",
                               "fmt": "e4m3", "weight_block_size": [128, 128]}))
        .expect("block-wise");
        assert_eq!(
            block.block.map(|(a, b)| (a.get(), b.get())),
            Some((128, 128))
        );
        assert!(block.static_activations);
        for (bad, field) in [
            (json!({"fmt": "e5m2"}), "fmt"),
            (
                json!({"activation_scheme": "per_token"}),
                "activation_scheme",
            ),
            (json!({"weight_block_size": [128]}), "weight_block_size"),
            (json!({"weight_block_size": [0, 128]}), "weight_block_size"),
        ] {
            let e = cfg(bad).expect_err("refused").to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn dequantizes_per_tensor_per_channel_and_per_block() {
        // 1.0, 2.0, -0.5, 448 in e4m3.
        let (one, two, minus_half, max) = (0x38u8, 0x40u8, 0xB0u8, 0x7Eu8);
        let w = [one, two, minus_half, max, one, one];
        let shape = [2, 3];
        let per_tensor = Fp8 {
            block: None,
            static_activations: false,
        };
        let scalar = Tensor::new(0.25f32, &Device::Cpu).expect("scalar");
        let got = dequantize("w", &per_tensor, &shape, &w, &scalar).expect("per tensor");
        assert_eq!(
            got.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values"),
            [0.25, 0.5, -0.125, 112.0, 0.25, 0.25]
        );
        let channels = Tensor::new(&[[2f32], [3.0]], &Device::Cpu).expect("[out, 1]");
        let got = dequantize("w", &per_tensor, &shape, &w, &channels).expect("per channel");
        assert_eq!(
            got.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values"),
            [2.0, 4.0, -1.0, 1344.0, 3.0, 3.0]
        );
        // Blocks of [1, 2] over [2, 3]: scales [2, 2] (the last column's block is partial).
        let blocks = Fp8 {
            block: NonZeroUsize::new(1).zip(NonZeroUsize::new(2)),
            static_activations: false,
        };
        let s = Tensor::new(&[[1f32, 10.0], [100.0, 1000.0]], &Device::Cpu).expect("scales");
        let got = dequantize("w", &blocks, &shape, &w, &s).expect("per block");
        assert_eq!(
            got.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values"),
            [1.0, 2.0, -5.0, 44800.0, 100.0, 1000.0]
        );
        let e = dequantize("w", &blocks, &shape, &w, &scalar)
            .expect_err("wrong count")
            .to_string();
        assert!(e.contains("block scales") && e.contains("[2, 2]"), "{e}");
        let nan = [0x7F, one, one, one, one, one];
        let e = dequantize("w", &per_tensor, &shape, &nan, &scalar)
            .expect_err("NaN")
            .to_string();
        assert!(e.contains("NaN"), "{e}");
    }
}
