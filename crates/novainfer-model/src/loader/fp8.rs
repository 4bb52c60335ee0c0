//! FP8 (e4m3) weight checkpoints: `quantization_config` with `quant_method: fp8`, as vLLM
//! serializes them (a scale per tensor, `weight_scale`) and as transformers' FineGrainedFP8
//! and the DeepSeek/Qwen3 FP8 releases do (`weight_block_size: [bo, bi]`, one scale per
//! `bo × bi` block in `weight_scale_inv`, which is multiplied despite its name).
//!
//! A layer whose rows are whole groups of 128 with one scale each is kept as FP8
//! ([`crate::fp8_blocks`]): the GPU multiplies the codes in place. The CPU runs every layer as
//! its dense f32 values, `w = f32(q) · s` rounded once (the product vLLM's dequantization
//! computes): the weights the checkpoint defines, at 4 bytes each. Activations stay unquantized, so with
//! `activation_scheme: static` the `input_scale` tensors are not used (vLLM rounds
//! activations to FP8 with them; we keep the more exact product).

use std::num::NonZeroUsize;

use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};

use super::RawTensor;
use crate::error::{ModelError, Result};
use crate::fp8_blocks::{Fp8Blocks, GROUP_K};

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

pub use novainfer_cuda::quant_type::e4m3_to_f32;

/// The FP8 `codes` (the stored bytes, `shape` `[out, in]`) with their `scale`: a scalar (`[]`
/// or `[1]`), one per output channel (`[out]` or `[out, 1]`), or with `cfg.block` one per block
/// (`[⌈out / bo⌉, ⌈in / bi⌉]`). Kept as FP8 ([`Fp8Blocks`]) when a row is whole groups of 128
/// and every group has one scale (per tensor, per channel, or blocks whose `bi` is a multiple of
/// 128); otherwise the dense f32 weight, `f32(q) · s` each, one rounding. Either way the values
/// are the same.
pub fn load(
    name: &str,
    cfg: &Fp8,
    shape: &[usize],
    codes: &[u8],
    scale: &Tensor,
) -> Result<RawTensor> {
    let grid = ScaleGrid::new(name, cfg, shape, codes, scale)?;
    let one_scale_per_group = cfg
        .block
        .is_none_or(|(_, bi)| bi.get().is_multiple_of(GROUP_K));
    if Fp8Blocks::fits(grid.inputs) && one_scale_per_group {
        let w = Fp8Blocks::from_codes(name, grid.out, grid.inputs, codes, |o, g| {
            grid.scale(o, g * GROUP_K)
        })?;
        return Ok(RawTensor::Fp8(w));
    }
    Ok(RawTensor::Dense(grid.dense(name, codes)?))
}

/// A weight's scales, checked against its shape, and which one each element takes.
struct ScaleGrid {
    out: usize,
    inputs: usize,
    scales: Vec<f32>,
    /// `Some((bo, bi, columns of blocks))` for block scales; else per tensor (one scale) or per
    /// output channel.
    blocks: Option<(usize, usize, usize)>,
}

impl ScaleGrid {
    fn new(name: &str, cfg: &Fp8, shape: &[usize], codes: &[u8], scale: &Tensor) -> Result<Self> {
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
        let n = scales.len();
        let blocks = match cfg.block {
            Some((bo, bi)) => {
                let (rows, cols) = (out.div_ceil(bo.get()), inputs.div_ceil(bi.get()));
                if n != rows * cols {
                    return Err(bad(format!(
                        "{n} block scales for a [{out}, {inputs}] weight in blocks of [{bo}, {bi}] \
                         (expected [{rows}, {cols}])"
                    )));
                }
                Some((bo.get(), bi.get(), cols))
            }
            None if n == 1 || n == out => None,
            None => {
                return Err(bad(format!(
                    "{n} scales for a weight of {out} output channels (expected 1 or {out})"
                )))
            }
        };
        Ok(Self {
            out,
            inputs,
            scales,
            blocks,
        })
    }

    /// The scale of element `(r, c)`.
    fn scale(&self, r: usize, c: usize) -> f32 {
        match self.blocks {
            Some((bo, bi, cols)) => self.scales[(r / bo) * cols + c / bi],
            None if self.scales.len() == 1 => self.scales[0],
            None => self.scales[r],
        }
    }

    fn dense(&self, name: &str, codes: &[u8]) -> Result<Tensor> {
        let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
        let mut values = Vec::with_capacity(codes.len());
        for (i, &code) in codes.iter().enumerate() {
            let (r, c) = (i / self.inputs, i % self.inputs);
            let q = table[code as usize];
            if q.is_nan() {
                return Err(ModelError::InvalidQuantTensor {
                    name: name.to_owned(),
                    reason: format!("a NaN code (0x{code:02x}) at [{r}, {c}]"),
                });
            }
            values.push(q * self.scale(r, c));
        }
        Ok(Tensor::from_vec(
            values,
            (self.out, self.inputs),
            &Device::Cpu,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: Value) -> Result<Fp8> {
        Fp8::from_json(v.as_object().expect("object"))
    }

    /// What [`load`] makes of a weight, as values, and whether it stayed FP8.
    fn values(
        cfg: &Fp8,
        shape: &[usize],
        codes: &[u8],
        scale: &Tensor,
    ) -> Result<(Vec<f32>, bool)> {
        let raw = load("w", cfg, shape, codes, scale)?;
        Ok((raw.to_f32_vec()?, matches!(raw, RawTensor::Fp8(_))))
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
        let got = values(&per_tensor, &shape, &w, &scalar).expect("per tensor");
        assert_eq!(got, (vec![0.25, 0.5, -0.125, 112.0, 0.25, 0.25], false));
        let channels = Tensor::new(&[[2f32], [3.0]], &Device::Cpu).expect("[out, 1]");
        let got = values(&per_tensor, &shape, &w, &channels).expect("per channel");
        assert_eq!(got, (vec![2.0, 4.0, -1.0, 1344.0, 3.0, 3.0], false));
        // Blocks of [1, 2] over [2, 3]: scales [2, 2] (the last column's block is partial).
        let blocks = Fp8 {
            block: NonZeroUsize::new(1).zip(NonZeroUsize::new(2)),
            static_activations: false,
        };
        let s = Tensor::new(&[[1f32, 10.0], [100.0, 1000.0]], &Device::Cpu).expect("scales");
        let got = values(&blocks, &shape, &w, &s).expect("per block");
        assert_eq!(got, (vec![1.0, 2.0, -5.0, 44800.0, 100.0, 1000.0], false));
        let e = load("w", &blocks, &shape, &w, &scalar)
            .expect_err("wrong count")
            .to_string();
        assert!(e.contains("block scales") && e.contains("[2, 2]"), "{e}");
        let nan = [0x7F, one, one, one, one, one];
        let e = load("w", &per_tensor, &shape, &nan, &scalar)
            .expect_err("NaN")
            .to_string();
        assert!(e.contains("NaN"), "{e}");
    }

    #[test]
    fn rows_of_whole_groups_stay_fp8_with_the_same_values() {
        // [3, 256] with a scale per channel, per tensor, per [2, 128] block and per [1, 64] block:
        // the last has two scales in a group of 128, so it stays dense.
        let (out, inputs) = (3usize, 256usize);
        let codes: Vec<u8> = (0..out * inputs)
            .map(|i| (i * 37 % 0x7E) as u8 | (i as u8 & 0x80))
            .collect();
        let table: Vec<f32> = codes.iter().map(|&c| e4m3_to_f32(c)).collect();
        let block = |bo, bi| Fp8 {
            block: NonZeroUsize::new(bo).zip(NonZeroUsize::new(bi)),
            static_activations: false,
        };
        let per = block(0, 0);
        type ScaleOf = Box<dyn Fn(usize, usize) -> f32>;
        let cases: [(Fp8, Tensor, bool, ScaleOf); 4] = [
            (
                per,
                Tensor::new(&[[0.5f32], [2.0], [4.0]], &Device::Cpu).expect("s"),
                true,
                Box::new(|r, _| [0.5, 2.0, 4.0][r]),
            ),
            (
                per,
                Tensor::new(3f32, &Device::Cpu).expect("s"),
                true,
                Box::new(|_, _| 3.0),
            ),
            (
                block(2, 128),
                Tensor::new(&[[1f32, 2.0], [3.0, 5.0]], &Device::Cpu).expect("s"),
                true,
                Box::new(|r, c| [[1.0, 2.0], [3.0, 5.0]][r / 2][c / 128]),
            ),
            (
                block(1, 64),
                Tensor::new(&[[1f32, 2.0, 3.0, 4.0]; 3], &Device::Cpu).expect("s"),
                false,
                Box::new(|_, c| [1.0, 2.0, 3.0, 4.0][c / 64]),
            ),
        ];
        for (i, (cfg, scale, packed, want)) in cases.into_iter().enumerate() {
            let (got, fp8) = values(&cfg, &[out, inputs], &codes, &scale).expect("load");
            assert_eq!(fp8, packed, "case {i}");
            for (j, (g, q)) in got.iter().zip(&table).enumerate() {
                let w = q * want(j / inputs, j % inputs);
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "case {i} [{}, {}]",
                    j / inputs,
                    j % inputs
                );
            }
        }
    }
}
