//! config.json's `quantization_config` for weight-only checkpoints: integer (AWQ, GPTQ) or
//! FP8 ([`super::fp8`]).
//!
//! Only what changes how the tensors are read is kept, as types with no invalid values;
//! everything else (calibration settings, kernel preferences such as `use_exllama`) is
//! ignored, as vLLM does. A method, layout or width we cannot read exactly is an error
//! naming the field, never a silent misread: a wrong zero-point convention or packing order
//! would load and produce garbage.

use std::num::NonZeroUsize;
use std::path::Path;

use serde_json::{Map, Value};

use super::fp8::Fp8;
use crate::config::read_json;
use crate::error::{ModelError, Result};

/// The scheme of the HF directory `dir`: config.json's `quantization_config`, else
/// AutoGPTQ's separate `quantize_config.json` (GPTQ when it names no method); `None` for
/// an unquantized checkpoint.
pub fn read(dir: &Path) -> Result<Option<Quantization>> {
    let config: Value = read_json(&dir.join("config.json"))?;
    if let Some(q) = config.get("quantization_config").filter(|v| !v.is_null()) {
        return Quantization::from_json(q).map(Some);
    }
    let autogptq = dir.join("quantize_config.json");
    if autogptq.is_file() {
        let q: Value = read_json(&autogptq)?;
        return IntQuant::from_json(&q, Some("gptq")).map(|q| Some(Quantization::Int(q)));
    }
    Ok(None)
}

/// A checkpoint's weight quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// Packed integer layers (`qweight`, `qzeros`, `scales`, `g_idx`).
    Int(IntQuant),
    /// FP8 `weight`s with their scales.
    Fp8(Fp8),
}

impl Quantization {
    /// Reads config.json's `quantization_config`.
    pub fn from_json(config: &Value) -> Result<Self> {
        let method = config.get("quant_method").and_then(Value::as_str);
        match (
            method.map(str::to_ascii_lowercase).as_deref(),
            config.as_object(),
        ) {
            (Some("fp8"), Some(map)) => Ok(Quantization::Fp8(Fp8::from_json(map)?)),
            _ => IntQuant::from_json(config, None).map(Quantization::Int),
        }
    }
}

/// The weight-only integer formats we load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntQuant {
    Awq(Awq),
    Gptq(Gptq),
}

/// AutoAWQ's GEMM layout: 4-bit, asymmetric (a zero point per group), f16 scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Awq {
    pub group: GroupSize,
}

/// AutoGPTQ / GPTQModel's layout (what `QuantLinear` of `qlinear_cuda_old`/`exllama` reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gptq {
    pub bits: Bits,
    pub group: GroupSize,
    pub zeros: ZeroConvention,
    /// `desc_act` (act-order): `g_idx` then assigns input channels to groups out of
    /// order. Kept for messages; the loader decides from `g_idx` itself.
    pub desc_act: bool,
}

/// Bits per weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    Four,
    Eight,
}

impl Bits {
    pub fn width(self) -> u32 {
        match self {
            Bits::Four => 4,
            Bits::Eight => 8,
        }
    }

    /// Values per packed 32-bit word.
    pub fn per_word(self) -> usize {
        32 / self.width() as usize
    }

    pub fn mask(self) -> u32 {
        (1 << self.width()) - 1
    }
}

/// Input channels per (scale, zero) group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupSize {
    /// `group_size: -1`: one group spans every input channel (per-output-channel scales).
    PerChannel,
    Channels(NonZeroUsize),
}

impl GroupSize {
    /// The group length for a layer with `inputs` input channels.
    pub fn len(self, inputs: usize) -> usize {
        match self {
            GroupSize::PerChannel => inputs,
            GroupSize::Channels(n) => n.get(),
        }
    }
}

/// How GPTQ stores zero points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroConvention {
    /// AutoGPTQ's original format (`checkpoint_format: gptq`, or absent): the packer stores
    /// `z − 1` and every reader adds the 1 back, so a stored field f means z = f + 1.
    MinusOne,
    /// GPTQModel's `checkpoint_format: gptq_v2`: z is stored as is.
    Exact,
}

impl ZeroConvention {
    pub fn offset(self) -> u32 {
        match self {
            ZeroConvention::MinusOne => 1,
            ZeroConvention::Exact => 0,
        }
    }
}

const METHODS: &str = "NovaInfer loads quant_method awq (version gemm), gptq and fp8";

fn unsupported(field: &str, value: &Value, supported: &'static str) -> ModelError {
    ModelError::UnsupportedQuantization {
        field: field.to_owned(),
        value: value.to_string(),
        supported,
    }
}

impl IntQuant {
    /// Reads a `quantization_config` object (config.json's, or AutoGPTQ's
    /// `quantize_config.json`, whose `quant_method` may be absent: `default_method`).
    pub fn from_json(config: &Value, default_method: Option<&str>) -> Result<Self> {
        let Some(map) = config.as_object() else {
            return Err(unsupported(
                "quantization_config",
                config,
                "expected a JSON object",
            ));
        };
        let method = match (map.get("quant_method"), default_method) {
            (Some(Value::String(m)), _) => m.to_ascii_lowercase(),
            (None, Some(m)) => m.to_owned(),
            (Some(other), _) => return Err(unsupported("quant_method", other, METHODS)),
            (None, None) => return Err(unsupported("quant_method", &Value::Null, METHODS)),
        };
        match method.as_str() {
            "awq" => Ok(IntQuant::Awq(awq(map)?)),
            "gptq" => Ok(IntQuant::Gptq(gptq(map)?)),
            _ => Err(unsupported("quant_method", &Value::String(method), METHODS)),
        }
    }
}

fn awq(map: &Map<String, Value>) -> Result<Awq> {
    // AutoAWQ's own quant_config.json spells these w_bit / q_group_size; transformers'
    // AwqConfig (what config.json holds) bits / group_size.
    let bits = field(map, &["bits", "w_bit"]);
    if let Some(b) = bits {
        if b.as_u64() != Some(4) {
            return Err(unsupported(
                "bits",
                b,
                "AutoAWQ's GEMM layout is 4-bit only",
            ));
        }
    }
    if let Some(v) = map.get("version") {
        let ok = v.as_str().is_some_and(|s| s.eq_ignore_ascii_case("gemm"));
        if !ok {
            return Err(unsupported(
                "version",
                v,
                "only AWQ's GEMM layout (version \"gemm\") is supported; gemv, gemv_fast, marlin and exllama pack differently",
            ));
        }
    }
    if let Some(v) = map.get("zero_point") {
        if v.as_bool() != Some(true) {
            return Err(unsupported(
                "zero_point",
                v,
                "AWQ checkpoints without zero points are not supported",
            ));
        }
    }
    Ok(Awq {
        group: group_size(map, &["group_size", "q_group_size"])?,
    })
}

fn gptq(map: &Map<String, Value>) -> Result<Gptq> {
    let bits = match field(map, &["bits"]) {
        Some(b) => match b.as_u64() {
            Some(4) => Bits::Four,
            Some(8) => Bits::Eight,
            _ => return Err(unsupported("bits", b, "GPTQ with bits 4 or 8")),
        },
        None => return Err(unsupported("bits", &Value::Null, "GPTQ with bits 4 or 8")),
    };
    let flag = |name: &str| -> Result<bool> {
        match map.get(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(unsupported(name, other, "expected true or false")),
        }
    };
    if flag("is_marlin_format")? {
        return Err(unsupported(
            "is_marlin_format",
            &Value::Bool(true),
            "Marlin-repacked GPTQ is not supported; use the plain GPTQ checkpoint",
        ));
    }
    let zeros = match field(map, &["checkpoint_format", "format"]) {
        None => ZeroConvention::MinusOne,
        Some(v) => match v.as_str().map(str::to_ascii_lowercase).as_deref() {
            Some("gptq") => ZeroConvention::MinusOne,
            Some("gptq_v2") => ZeroConvention::Exact,
            _ => {
                return Err(unsupported(
                    "checkpoint_format",
                    v,
                    "GPTQ checkpoint_format gptq or gptq_v2",
                ))
            }
        },
    };
    if let Some(v) = map.get("pack_dtype") {
        if v.as_str() != Some("int32") {
            return Err(unsupported("pack_dtype", v, "GPTQ packed in int32 words"));
        }
    }
    // GPTQModel's per-module overrides (other bits or group sizes for some layers).
    if let Some(v) = map.get("dynamic") {
        let empty = v.is_null() || v.as_object().is_some_and(Map::is_empty);
        if !empty {
            return Err(unsupported(
                "dynamic",
                v,
                "per-module GPTQ overrides are not supported",
            ));
        }
    }
    Ok(Gptq {
        bits,
        group: group_size(map, &["group_size"])?,
        zeros,
        desc_act: flag("desc_act")?,
    })
}

/// The first of `names` present (and not null).
fn field<'a>(map: &'a Map<String, Value>, names: &[&str]) -> Option<&'a Value> {
    names
        .iter()
        .find_map(|n| map.get(*n).filter(|v| !v.is_null()))
}

fn group_size(map: &Map<String, Value>, names: &[&str]) -> Result<GroupSize> {
    let Some(v) = field(map, names) else {
        return Err(unsupported(
            names[0],
            &Value::Null,
            "group_size is required (-1 or a positive channel count)",
        ));
    };
    match v.as_i64() {
        Some(-1) => Ok(GroupSize::PerChannel),
        Some(n) if n > 0 => Ok(GroupSize::Channels(
            NonZeroUsize::new(n as usize).ok_or_else(|| unsupported(names[0], v, "positive"))?,
        )),
        _ => Err(unsupported(
            names[0],
            v,
            "group_size must be -1 or a positive channel count",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: Value) -> String {
        IntQuant::from_json(&v, None)
            .expect_err("must be refused")
            .to_string()
    }

    #[test]
    fn reads_awq_and_gptq_configs_as_written_by_their_tools() {
        // Qwen2.5-*-AWQ's config.json.
        let awq = json!({"bits": 4, "group_size": 128, "modules_to_not_convert": null,
                         "quant_method": "awq", "version": "gemm", "zero_point": true});
        assert_eq!(
            IntQuant::from_json(&awq, None).expect("awq"),
            IntQuant::Awq(Awq {
                group: GroupSize::Channels(NonZeroUsize::new(128).expect("128"))
            })
        );
        // Qwen2.5-*-GPTQ-Int8's (optimum) config.json.
        let gptq = json!({"bits": 8, "group_size": -1, "desc_act": true, "sym": true,
                          "quant_method": "gptq", "use_exllama": false, "exllama_config": {"version": 1}});
        assert_eq!(
            IntQuant::from_json(&gptq, None).expect("gptq"),
            IntQuant::Gptq(Gptq {
                bits: Bits::Eight,
                group: GroupSize::PerChannel,
                zeros: ZeroConvention::MinusOne,
                desc_act: true,
            })
        );
        // GPTQModel's v2 zero points; AutoGPTQ's quantize_config.json has no quant_method.
        let v2 = json!({"bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2", "pack_dtype": "int32"});
        match IntQuant::from_json(&v2, Some("gptq")).expect("v2") {
            IntQuant::Gptq(g) => assert_eq!(g.zeros, ZeroConvention::Exact),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn refusals_name_the_field_and_value() {
        let bnb = err(json!({"quant_method": "bitsandbytes", "load_in_4bit": true}));
        assert!(
            bnb.contains("quant_method") && bnb.contains("bitsandbytes"),
            "{bnb}"
        );
        let gemv =
            err(json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}));
        assert!(gemv.contains("version") && gemv.contains("gemv"), "{gemv}");
        let three = err(json!({"quant_method": "gptq", "bits": 3, "group_size": 128}));
        assert!(three.contains("bits") && three.contains('3'), "{three}");
        let marlin = err(
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": true}),
        );
        assert!(marlin.contains("is_marlin_format"), "{marlin}");
        let group = err(json!({"quant_method": "gptq", "bits": 4, "group_size": 0}));
        assert!(group.contains("group_size"), "{group}");
        let no_zero =
            err(json!({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": false}));
        assert!(no_zero.contains("zero_point"), "{no_zero}");
        let missing = err(json!({"bits": 4}));
        assert!(missing.contains("quant_method"), "{missing}");
        let dynamic = err(json!({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                 "dynamic": {"-:.*down": {}}}));
        assert!(dynamic.contains("dynamic"), "{dynamic}");
    }
}
