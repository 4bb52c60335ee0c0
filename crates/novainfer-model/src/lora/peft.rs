//! PEFT adapter directories: `adapter_config.json` and `adapter_model.safetensors`.
//!
//! Tensors are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`
//! (older saves put the adapter's name before `.weight`), `lora_A` being `[r, in]` and
//! `lora_B` `[out, r]`. Each module's scale is `lora_alpha / r` (`/ √r` with `use_rslora`),
//! `r` being that module's rank (it may differ per module under `rank_pattern`).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::{RawPair, Scale, Target};
use crate::error::{ModelError, Result};

const CONFIG: &str = "adapter_config.json";
const WEIGHTS: &str = "adapter_model.safetensors";

/// Reads the adapter's updates (shapes are checked by the caller).
pub(super) fn load(dir: &Path) -> Result<Vec<RawPair>> {
    let err = |field: &str, reason: String| ModelError::Adapter {
        path: dir.to_owned(),
        field: field.to_owned(),
        reason,
    };
    let config_path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&config_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => err(
            CONFIG,
            "missing: a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors"
                .into(),
        ),
        _ => ModelError::io(&config_path, e),
    })?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| err(CONFIG, format!("is not valid JSON: {e}")))?;
    let scale = check_config(&config, &err)?;
    let weights = dir.join(WEIGHTS);
    if !weights.is_file() {
        let reason = if dir.join("adapter_model.bin").is_file() {
            "missing: only the pickled adapter_model.bin is there, which NovaInfer does not \
             load (pickles can run code); save the adapter with safe_serialization=True"
        } else {
            "missing"
        };
        return Err(err(WEIGHTS, reason.into()));
    }
    let tensors = candle_core::safetensors::load(&weights, &Device::Cpu).map_err(|e| {
        ModelError::Corrupt {
            path: weights.clone(),
            detail: e.to_string(),
        }
    })?;
    pairs(tensors, scale, &|name: &str, reason: String| {
        err(name, reason)
    })
}

/// Checks the options we do not implement and returns how scales follow from ranks.
fn check_config(config: &Value, err: &dyn Fn(&str, String) -> ModelError) -> Result<Scale> {
    if let Some(t) = config.get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(err("peft_type", format!("{t:?} is not a LoRA adapter")));
        }
    }
    let truthy = |key: &str| config.get(key).and_then(Value::as_bool).unwrap_or(false);
    if truthy("use_dora") {
        return Err(err("use_dora", "DoRA adapters are not supported".into()));
    }
    if truthy("fan_in_fan_out") {
        return Err(err(
            "fan_in_fan_out",
            "transposed (Conv1D-style) weights do not fit a Qwen2 model".into(),
        ));
    }
    if truthy("lora_bias") {
        return Err(err("lora_bias", "a bias on lora_B is not supported".into()));
    }
    if let Some(bias) = config.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(err(
                "bias",
                format!("{bias:?}: adapters that train the base model's biases are not supported"),
            ));
        }
    }
    let non_empty = |key: &str| match config.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    if non_empty("modules_to_save") {
        return Err(err(
            "modules_to_save",
            "adapters that replace whole modules (embeddings, lm_head) are not supported".into(),
        ));
    }
    if non_empty("alpha_pattern") {
        return Err(err(
            "alpha_pattern",
            "per-module lora_alpha is not supported".into(),
        ));
    }
    if let Some(Value::Array(modules)) = config.get("target_modules") {
        for m in modules {
            let name = m.as_str().unwrap_or_default();
            if Target::from_hf_name(name).is_none() {
                return Err(err(
                    "target_modules",
                    format!(
                        "{m} is not a projection NovaInfer adapts (q_proj, k_proj, v_proj, o_proj, \
                         gate_proj, up_proj, down_proj)"
                    ),
                ));
            }
        }
    }
    let alpha = match config.get("lora_alpha") {
        None => 8.0, // PEFT's default
        Some(v) => v
            .as_f64()
            .filter(|a| a.is_finite())
            .ok_or_else(|| err("lora_alpha", format!("{v} is not a number")))?,
    };
    Ok(Scale::Alpha {
        alpha,
        rs: truthy("use_rslora"),
    })
}

/// Pairs each `lora_A` with its `lora_B`, by layer and projection.
fn pairs(
    tensors: std::collections::HashMap<String, Tensor>,
    scale: Scale,
    err: &dyn Fn(&str, String) -> ModelError,
) -> Result<Vec<RawPair>> {
    // (layer, target) → (A, B), each with its file name.
    type Half = Option<(String, Tensor)>;
    let mut found: BTreeMap<(usize, usize), (Target, Half, Half)> = BTreeMap::new();
    for (name, tensor) in tensors {
        let Some((layer, target, is_a)) = parse_name(&name) else {
            let why = if name.contains("lora_magnitude_vector") {
                "is a DoRA magnitude: DoRA adapters are not supported"
            } else if name.contains("embed") || name.contains("lm_head") {
                "adapts the embeddings or lm_head, which is not supported"
            } else {
                "is not a LoRA A/B weight of a q/k/v/o/gate/up/down projection of a Qwen2 layer"
            };
            return Err(err(&name, why.into()));
        };
        let entry = found
            .entry((layer, target.index()))
            .or_insert((target, None, None));
        let half = if is_a { &mut entry.1 } else { &mut entry.2 };
        if let Some((other, _)) = half {
            // `lora_A.weight` beside `lora_A.<adapter>.weight`: two adapters in one file.
            return Err(err(
                &name,
                format!(
                    "adapts the same projection as `{other}`: the file holds more than one adapter"
                ),
            ));
        }
        *half = Some((name, tensor));
    }
    let mut out = Vec::with_capacity(found.len());
    for ((layer, _), (target, a, b)) in found {
        let missing = |have: &(String, Tensor), other: &str| {
            err(
                &have.0,
                format!("has no matching {other} tensor in the adapter"),
            )
        };
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (Some(a), None) => return Err(missing(&a, "lora_B")),
            (None, Some(b)) => return Err(missing(&b, "lora_A")),
            (None, None) => unreachable!("an entry is made with one half"),
        };
        out.push(RawPair {
            layer,
            target,
            bf16: a.1.dtype() == DType::BF16 && b.1.dtype() == DType::BF16,
            a_shape: a.1.dims().to_vec(),
            a: to_f32(&a.1)?,
            a_name: a.0,
            b_shape: b.1.dims().to_vec(),
            b: to_f32(&b.1)?,
            b_name: b.0,
            scale,
        });
    }
    Ok(out)
}

fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// `(layer, target, is_A)` of a PEFT tensor name, or `None` for anything else.
fn parse_name(name: &str) -> Option<(usize, Target, bool)> {
    let rest = name.strip_prefix("base_model.model.")?;
    let rest = rest.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (block, rest) = rest.split_once('.')?;
    let (module, rest) = rest.split_once('.')?;
    let target = Target::from_hf_name(module)?;
    if target.hf_path() != format!("{block}.{module}") {
        return None;
    }
    let (half, rest) = rest.split_once('.')?;
    let is_a = match half {
        "lora_A" => true,
        "lora_B" => false,
        _ => return None,
    };
    // `weight`, or `<adapter name>.weight` in older saves.
    let ok = rest == "weight"
        || rest
            .strip_suffix(".weight")
            .is_some_and(|adapter| !adapter.is_empty() && !adapter.contains('.'));
    ok.then_some((layer, target, is_a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_parse_and_others_do_not() {
        assert_eq!(
            parse_name("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Some((3, Target::Q, true))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight"),
            Some((0, Target::Down, false))
        );
        for bad in [
            "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A",
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            "base_model.model.model.layers.x.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn unsupported_options_name_their_field() {
        let err = |v: Value| -> String {
            let f = |field: &str, reason: String| ModelError::Adapter {
                path: "x".into(),
                field: field.to_owned(),
                reason,
            };
            match check_config(&v, &f) {
                Err(ModelError::Adapter { field, .. }) => field,
                other => panic!("accepted {v}: {other:?}"),
            }
        };
        use serde_json::json;
        assert_eq!(err(json!({"use_dora": true})), "use_dora");
        assert_eq!(
            err(json!({"modules_to_save": ["lm_head"]})),
            "modules_to_save"
        );
        assert_eq!(
            err(json!({"target_modules": ["q_proj", "embed_tokens"]})),
            "target_modules"
        );
        assert_eq!(err(json!({"bias": "all"})), "bias");
        assert_eq!(err(json!({"peft_type": "IA3"})), "peft_type");
        assert_eq!(
            err(json!({"alpha_pattern": {"q_proj": 4}})),
            "alpha_pattern"
        );
        assert_eq!(err(json!({"lora_alpha": "x"})), "lora_alpha");
        let ok = json!({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                        "modules_to_save": null, "bias": "none", "use_rslora": true});
        assert!(matches!(
            check_config(&ok, &|_, _| unreachable!()),
            Ok(Scale::Alpha { alpha, rs: true }) if alpha == 16.0
        ));
    }
}
