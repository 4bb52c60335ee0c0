//! A checkpoint's RoPE scaling, read from `config.json` (`rope_scaling`, or transformers 5's
//! `rope_parameters`) or from GGUF metadata (llama.cpp's `qwen2.rope.scaling.*` keys), into the
//! [`RopeScaling`] the CPU model and the GPU table share (`novainfer_cuda::rope_scaling`, where
//! the formulas live).
//!
//! What is read, and what is refused:
//!
//! * config.json: the type is `rope_type`, else `type` (transformers' order); `"default"`, a
//!   null or an absent `rope_scaling` mean none; `linear`, `dynamic` and `yarn` are built;
//!   any other type (`longrope`, `llama3`, ...) is a load error naming the field. `factor` is
//!   required, positive and finite (below 1 it is used as transformers uses it, with a
//!   warning). YaRN reads `original_max_position_embeddings` (default
//!   `max_position_embeddings`), `beta_fast`/`beta_slow` (a missing, null or zero value is 32/1,
//!   transformers' `or`), `attention_factor`, `mscale`/`mscale_all_dim` and `truncate`. Keys
//!   transformers does not read for the type are ignored, as transformers ignores them, with
//!   a warning.
//! * GGUF (what llama.cpp's `convert_hf_to_gguf.py` writes): `rope.scaling.type` (`none`,
//!   `linear`, `yarn`; absent means llama.cpp's default, linear), `rope.scaling.factor` (or
//!   the older `rope.scale_linear`; absent or 0 is llama.cpp's "no scaling" for linear and an
//!   error for yarn), `rope.scaling.original_context_length` (default `context_length`),
//!   `rope.scaling.yarn_beta_fast`/`yarn_beta_slow`, and `rope.scaling.yarn_attn_factor`, which
//!   the converter writes from the HF config's `attention_factor` and is read back as that.
//!   Keys that would change the rotation in ways with no transformers equivalent
//!   (`yarn_ext_factor` other than 1, `yarn_log_multiplier` other than 0, `attn_factor` other
//!   than 1, any `alpha`) are refused by name rather than ignored.
//!
//! Every error is [`ModelError::InvalidConfig`] whose field is the key as the file spells it
//! (`rope_scaling.factor`, `rope_parameters.type`, `qwen2.rope.scaling.type`, ...).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde_json::{Map, Value};

pub use novainfer_cuda::rope_scaling::{RopeScaling, Yarn};

use crate::error::{ModelError, Result};

/// The types we build, for error messages.
const SUPPORTED: &str = "\"default\", \"linear\", \"dynamic\" or \"yarn\"";

/// What the model around the scaling says: needed to resolve defaults and check the result.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ModelDims {
    pub head_dim: usize,
    pub max_position_embeddings: usize,
}

/// The `rope_scaling` (or `rope_parameters`) object of a config.json, `section` being its name
/// (error fields are `section.key`).
pub(crate) fn from_hf(
    section: &str,
    spec: &Map<String, Value>,
    dims: ModelDims,
) -> Result<RopeScaling> {
    let field = |key: &str| format!("{section}.{key}");
    let (type_key, kind) = match (spec.get("rope_type"), spec.get("type")) {
        (Some(v), _) if !v.is_null() => ("rope_type", v),
        (_, Some(v)) if !v.is_null() => ("type", v),
        _ => {
            if spec.get("factor").is_some_and(|f| !f.is_null()) {
                return Err(ModelError::config(
                    field("type"),
                    format!("missing (no `rope_type` or `type`) although a factor is given; expected {SUPPORTED}"),
                ));
            }
            return Ok(RopeScaling::None);
        }
    };
    let kind = kind.as_str().ok_or_else(|| {
        ModelError::config(field(type_key), format!("must be a string, got {kind}"))
    })?;
    let num = |key: &str| -> Result<Option<f64>> {
        match spec.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(ModelError::config(
                    field(key),
                    format!("must be a finite number, got {v}"),
                )),
            },
        }
    };
    let factor = || -> Result<f64> {
        let f = num("factor")?.ok_or_else(|| {
            ModelError::config(
                field("factor"),
                format!("missing; rope type {kind:?} needs it"),
            )
        })?;
        check_factor(&field("factor"), f)
    };
    if let Some(p) = num("partial_rotary_factor")?.filter(|&p| p != 1.0) {
        return Err(ModelError::config(
            field("partial_rotary_factor"),
            format!("{p} is not supported (Qwen2 rotates the whole head)"),
        ));
    }
    let (scaling, known): (RopeScaling, &[&str]) = match kind {
        "default" => (RopeScaling::None, &[]),
        "linear" => (RopeScaling::Linear { factor: factor()? }, &["factor"]),
        "dynamic" => {
            if dims.head_dim <= 2 {
                return Err(ModelError::config(
                    field(type_key),
                    format!("dynamic NTK needs head_dim > 2, got {}", dims.head_dim),
                ));
            }
            (
                RopeScaling::Dynamic {
                    factor: factor()?,
                    max_position_embeddings: dims.max_position_embeddings,
                },
                &["factor"],
            )
        }
        "yarn" => {
            let factor = factor()?;
            let original = match spec.get("original_max_position_embeddings") {
                None | Some(Value::Null) => dims.max_position_embeddings,
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        ModelError::config(
                            field("original_max_position_embeddings"),
                            format!("must be a positive integer, got {v}"),
                        )
                    })?,
            };
            let beta = |key: &str, default: f64| -> Result<f64> {
                match num(key)? {
                    // transformers: `get(key) or default`, so 0 is the default too.
                    None => Ok(default),
                    Some(0.0) => Ok(default),
                    Some(b) if b > 0.0 => Ok(b),
                    Some(b) => Err(ModelError::config(
                        field(key),
                        format!("must be positive, got {b}"),
                    )),
                }
            };
            let beta_fast = beta("beta_fast", Yarn::DEFAULT_BETA_FAST)?;
            let beta_slow = beta("beta_slow", Yarn::DEFAULT_BETA_SLOW)?;
            if beta_fast < beta_slow {
                tracing::warn!(
                    beta_fast,
                    beta_slow,
                    "{section}: yarn's beta_fast is below beta_slow (transformers warns too); used as given"
                );
            }
            let attention_factor = match num("attention_factor")? {
                Some(a) if a > 0.0 => a,
                Some(a) => {
                    return Err(ModelError::config(
                        field("attention_factor"),
                        format!("must be positive, got {a}"),
                    ))
                }
                None => {
                    Yarn::default_attention_factor(factor, num("mscale")?, num("mscale_all_dim")?)
                }
            };
            let truncate = match spec.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ModelError::config(
                        field("truncate"),
                        format!("must be true or false, got {v}"),
                    ))
                }
            };
            (
                RopeScaling::Yarn(Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast,
                    beta_slow,
                    attention_factor,
                    truncate,
                }),
                &[
                    "factor",
                    "original_max_position_embeddings",
                    "beta_fast",
                    "beta_slow",
                    "attention_factor",
                    "mscale",
                    "mscale_all_dim",
                    "truncate",
                ],
            )
        }
        other => {
            return Err(ModelError::config(
                field(type_key),
                format!("rope scaling {other:?} is not supported; expected {SUPPORTED}"),
            ))
        }
    };
    let ignored: Vec<&str> = spec
        .keys()
        .map(String::as_str)
        .filter(|k| {
            !known.contains(k)
                && !["rope_type", "type", "rope_theta", "partial_rotary_factor"].contains(k)
        })
        .collect();
    if !ignored.is_empty() {
        tracing::warn!(
            ?ignored,
            "{section}: keys that transformers does not read for rope type {kind:?} are ignored"
        );
    }
    check_context(&field("factor"), &scaling, dims)?;
    Ok(scaling)
}

/// A factor must be positive and finite; below 1 it shrinks the context (transformers warns
/// and goes on, and so do we).
fn check_factor(field: &str, factor: f64) -> Result<f64> {
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::config(
            field,
            format!("must be a positive finite number, got {factor}"),
        ));
    }
    if factor < 1.0 {
        tracing::warn!(
            factor,
            "{field} is below 1 (transformers warns too): used as given, the context shrinks"
        );
    }
    Ok(factor)
}

/// The scaled context must hold at least one token.
fn check_context(field: &str, scaling: &RopeScaling, dims: ModelDims) -> Result<()> {
    match scaling.max_positions(dims.max_position_embeddings) {
        0 => Err(ModelError::config(
            field,
            format!("{scaling:?} leaves a context of no token"),
        )),
        _ => Ok(()),
    }
}

/// The per-layer-type form transformers 5 may write (`{"full_attention": {...}, ...}`): Qwen2
/// has one RoPE, so every entry must be the same, and that one is used.
pub(crate) fn flatten_rope_parameters(params: &Map<String, Value>) -> Result<Map<String, Value>> {
    let nested = !params.is_empty()
        && params.values().all(Value::is_object)
        && !["rope_type", "type", "rope_theta"]
            .iter()
            .any(|k| params.contains_key(*k));
    if !nested {
        return Ok(params.clone());
    }
    let mut entries = params.values().filter_map(Value::as_object);
    let first = entries.next().cloned().unwrap_or_default();
    if entries.any(|e| *e != first) {
        return Err(ModelError::config(
            "rope_parameters",
            format!(
                "differs between layer types {:?}; Qwen2 has one rotary embedding",
                params.keys().collect::<Vec<_>>()
            ),
        ));
    }
    Ok(first)
}

/// GGUF's `{arch}.rope.scaling.*` keys (see the module's docs).
pub(crate) fn from_gguf(
    md: &HashMap<String, GgufValue>,
    arch: &str,
    dims: ModelDims,
) -> Result<RopeScaling> {
    let key = |k: &str| format!("{arch}.rope.{k}");
    let num = |k: &str| -> Result<Option<f64>> {
        let name = key(k);
        match md.get(&name) {
            None => Ok(None),
            Some(v) => v
                .to_f32()
                .map(f64::from)
                .or_else(|_| v.to_f64())
                .map(Some)
                .map_err(|e| ModelError::config(name, format!("must be a number: {e}"))),
        }
    };
    let kind = match md.get(&key("scaling.type")) {
        None => None,
        Some(v) => Some(v.to_string().map_err(|e| {
            ModelError::config(key("scaling.type"), format!("must be a string: {e}"))
        })?),
    };
    let factor_key = if md.contains_key(&key("scaling.factor")) {
        key("scaling.factor")
    } else {
        key("scale_linear")
    };
    let factor = match num("scaling.factor")? {
        Some(f) => Some(f),
        None => num("scale_linear")?,
    };
    // llama.cpp: a factor of 0 (or none) is no scaling.
    let factor = factor.filter(|&f| f != 0.0);
    // Keys with no transformers equivalent: refused unless at their neutral value (alpha,
    // HunYuan's NTK variant, has none).
    for (k, neutral) in [
        ("scaling.attn_factor", Some(1.0)),
        ("scaling.yarn_ext_factor", Some(1.0)),
        ("scaling.yarn_log_multiplier", Some(0.0)),
        ("scaling.alpha", None),
    ] {
        if let Some(v) = num(k)?.filter(|&v| Some(v) != neutral) {
            let only = neutral.map_or("none".to_owned(), |n| format!("only {n}"));
            return Err(ModelError::config(
                key(k),
                format!("{v} is not supported ({only}: transformers' formulas have no such term)"),
            ));
        }
    }
    let scaling = match kind.map(String::as_str) {
        Some("none") => RopeScaling::None,
        // Absent type: llama.cpp's default is linear, a no-op without a factor.
        None | Some("linear") => match factor {
            None => RopeScaling::None,
            Some(1.0) => RopeScaling::None,
            Some(f) => RopeScaling::Linear {
                factor: check_factor(&factor_key, f)?,
            },
        },
        Some("yarn") => {
            let factor = factor.ok_or_else(|| {
                ModelError::config(key("scaling.factor"), "missing (or 0); rope type yarn needs it")
            })?;
            let factor = check_factor(&factor_key, factor)?;
            let original = match md.get(&key("scaling.original_context_length")) {
                None => dims.max_position_embeddings,
                Some(v) => v
                    .to_u32()
                    .map(u64::from)
                    .or_else(|_| v.to_u64())
                    .ok()
                    .filter(|&n| n > 0)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        ModelError::config(
                            key("scaling.original_context_length"),
                            format!("must be a positive integer, got {v:?}"),
                        )
                    })?,
            };
            let beta = |k: &str, default: f64| -> Result<f64> {
                match num(k)? {
                    None => Ok(default),
                    Some(0.0) => Ok(default),
                    Some(b) if b.is_finite() && b > 0.0 => Ok(b),
                    Some(b) => Err(ModelError::config(key(k), format!("must be positive, got {b}"))),
                }
            };
            let attention_factor = match num("scaling.yarn_attn_factor")? {
                None => Yarn::default_attention_factor(factor, None, None),
                Some(a) if a.is_finite() && a > 0.0 => a,
                Some(a) => {
                    return Err(ModelError::config(
                        key("scaling.yarn_attn_factor"),
                        format!("must be positive, got {a}"),
                    ))
                }
            };
            RopeScaling::Yarn(Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: beta("scaling.yarn_beta_fast", Yarn::DEFAULT_BETA_FAST)?,
                beta_slow: beta("scaling.yarn_beta_slow", Yarn::DEFAULT_BETA_SLOW)?,
                attention_factor,
                truncate: true,
            })
        }
        Some(other) => {
            return Err(ModelError::config(
                key("scaling.type"),
                format!("rope scaling {other:?} is not supported; expected \"none\", \"linear\" or \"yarn\""),
            ))
        }
    };
    check_context(&factor_key, &scaling, dims)?;
    Ok(scaling)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: ModelDims = ModelDims {
        head_dim: 128,
        max_position_embeddings: 32768,
    };

    fn hf(json: &str) -> Result<RopeScaling> {
        let v: Value = serde_json::from_str(json).expect("test json");
        from_hf("rope_scaling", v.as_object().expect("object"), DIMS)
    }

    fn field_of(err: ModelError) -> String {
        match err {
            ModelError::InvalidConfig { field, .. } => field,
            other => panic!("expected a config error, got {other}"),
        }
    }

    #[test]
    fn qwen25_yarn_as_documented() {
        let s = hf(r#"{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#)
            .expect("valid");
        let RopeScaling::Yarn(y) = s else {
            panic!("{s:?}")
        };
        assert_eq!(y.factor, 4.0);
        assert_eq!(y.original_max_position_embeddings, 32768);
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
        assert_eq!(y.attention_factor, 0.1 * 4f64.ln() + 1.0);
        assert_eq!(s.max_positions(32768), 131072);
    }

    #[test]
    fn newer_spelling_and_every_yarn_field() {
        let s = hf(
            r#"{"rope_type": "yarn", "type": "linear", "factor": 8, "beta_fast": 16,
            "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.5, "truncate": false}"#,
        )
        .expect("valid");
        let RopeScaling::Yarn(y) = s else {
            panic!("rope_type wins over type: {s:?}")
        };
        assert_eq!(
            y.original_max_position_embeddings, 32768,
            "defaults to max_position_embeddings"
        );
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (16.0, 2.0, false));
        assert_eq!(
            y.attention_factor,
            Yarn::default_attention_factor(8.0, Some(0.707), Some(0.5))
        );
        let given = hf(r#"{"rope_type": "yarn", "factor": 8, "attention_factor": 1.25, "mscale": 2, "mscale_all_dim": 1, "beta_fast": 0}"#)
            .expect("valid");
        let RopeScaling::Yarn(y) = given else {
            panic!("{given:?}")
        };
        assert_eq!(y.attention_factor, 1.25, "a given attention_factor wins");
        assert_eq!(y.beta_fast, 32.0, "0 is transformers' `or` default");
    }

    #[test]
    fn linear_dynamic_and_no_scaling() {
        assert_eq!(
            hf(r#"{"type": "linear", "factor": 2}"#).expect("valid"),
            RopeScaling::Linear { factor: 2.0 }
        );
        assert_eq!(
            hf(r#"{"rope_type": "dynamic", "factor": 2.0}"#).expect("valid"),
            RopeScaling::Dynamic {
                factor: 2.0,
                max_position_embeddings: 32768
            }
        );
        for none in [
            r#"{"rope_type": "default"}"#,
            "{}",
            r#"{"type": null}"#,
            r#"{"rope_theta": 1e6}"#,
        ] {
            assert_eq!(hf(none).expect("valid"), RopeScaling::None, "{none}");
        }
        // A factor below 1 is used as transformers uses it (with a warning).
        assert_eq!(
            hf(r#"{"type": "yarn", "factor": 0.5}"#)
                .expect("valid")
                .attention_factor(),
            1.0
        );
    }

    #[test]
    fn every_error_names_its_field() {
        let cases = [
            (r#"{"type": "longrope", "factor": 2}"#, "rope_scaling.type"),
            (
                r#"{"rope_type": "llama3", "factor": 2}"#,
                "rope_scaling.rope_type",
            ),
            (r#"{"type": 4}"#, "rope_scaling.type"),
            (r#"{"factor": 4.0}"#, "rope_scaling.type"),
            (r#"{"type": "yarn"}"#, "rope_scaling.factor"),
            (
                r#"{"type": "linear", "factor": null}"#,
                "rope_scaling.factor",
            ),
            (r#"{"type": "yarn", "factor": 0}"#, "rope_scaling.factor"),
            (
                r#"{"type": "dynamic", "factor": -2}"#,
                "rope_scaling.factor",
            ),
            (
                r#"{"type": "linear", "factor": "4"}"#,
                "rope_scaling.factor",
            ),
            (
                r#"{"type": "linear", "factor": 1e-9}"#,
                "rope_scaling.factor",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}"#,
                "rope_scaling.original_max_position_embeddings",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "original_max_position_embeddings": 1.5}"#,
                "rope_scaling.original_max_position_embeddings",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "beta_fast": -1}"#,
                "rope_scaling.beta_fast",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "beta_slow": "x"}"#,
                "rope_scaling.beta_slow",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "attention_factor": 0}"#,
                "rope_scaling.attention_factor",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "mscale": true}"#,
                "rope_scaling.mscale",
            ),
            (
                r#"{"type": "yarn", "factor": 4, "truncate": "no"}"#,
                "rope_scaling.truncate",
            ),
            (
                r#"{"type": "linear", "factor": 2, "partial_rotary_factor": 0.5}"#,
                "rope_scaling.partial_rotary_factor",
            ),
        ];
        for (json, field) in cases {
            let err = hf(json).expect_err(json);
            let text = err.to_string();
            assert_eq!(field_of(err), field, "{json}: {text}");
            assert!(
                text.contains(field),
                "{json}: the message names the field: {text}"
            );
        }
        let tiny = ModelDims {
            head_dim: 2,
            max_position_embeddings: 16,
        };
        let v: Value = serde_json::from_str(r#"{"type": "dynamic", "factor": 2}"#).expect("json");
        let err = from_hf("rope_parameters", v.as_object().expect("object"), tiny)
            .expect_err("head_dim 2");
        assert_eq!(field_of(err), "rope_parameters.type");
    }

    #[test]
    fn per_layer_type_parameters_must_agree() {
        let v: Value = serde_json::from_str(
            r#"{"full_attention": {"rope_type": "yarn", "factor": 4},
                "sliding_attention": {"rope_type": "yarn", "factor": 4}}"#,
        )
        .expect("json");
        let flat = flatten_rope_parameters(v.as_object().expect("object")).expect("equal");
        assert_eq!(flat["rope_type"], "yarn");
        let v: Value = serde_json::from_str(
            r#"{"full_attention": {"rope_type": "yarn", "factor": 4},
                "sliding_attention": {"rope_type": "default"}}"#,
        )
        .expect("json");
        let err = flatten_rope_parameters(v.as_object().expect("object")).expect_err("differ");
        assert_eq!(field_of(err), "rope_parameters");
        let plain: Value =
            serde_json::from_str(r#"{"rope_type": "default", "rope_theta": 1e6}"#).expect("json");
        assert_eq!(
            flatten_rope_parameters(plain.as_object().expect("object")).expect("flat"),
            *plain.as_object().expect("object")
        );
    }

    fn gguf(pairs: &[(&str, GgufValue)]) -> Result<RopeScaling> {
        let md = pairs
            .iter()
            .map(|(k, v)| (format!("qwen2.rope.{k}"), v.clone()))
            .collect();
        from_gguf(&md, "qwen2", DIMS)
    }

    fn s(text: &str) -> GgufValue {
        GgufValue::String(text.into())
    }

    #[test]
    fn gguf_keys_as_llama_cpp_writes_them() {
        use GgufValue::{F32, U32};
        let y = gguf(&[
            ("scaling.type", s("yarn")),
            ("scaling.factor", F32(4.0)),
            ("scaling.original_context_length", U32(32768)),
        ])
        .expect("valid");
        let RopeScaling::Yarn(y) = y else {
            panic!("{y:?}")
        };
        assert_eq!(
            (
                y.factor,
                y.original_max_position_embeddings,
                y.beta_fast,
                y.beta_slow
            ),
            (4.0, 32768, 32.0, 1.0)
        );
        assert_eq!(y.attention_factor, 0.1 * 4f64.ln() + 1.0);
        let y = gguf(&[
            ("scaling.type", s("yarn")),
            ("scaling.factor", F32(2.0)),
            ("scaling.yarn_beta_fast", F32(8.0)),
            ("scaling.yarn_beta_slow", F32(0.5)),
            ("scaling.yarn_attn_factor", F32(1.5)),
            ("scaling.yarn_ext_factor", F32(1.0)),
        ])
        .expect("valid");
        let RopeScaling::Yarn(y) = y else {
            panic!("{y:?}")
        };
        assert_eq!(
            y.original_max_position_embeddings, 32768,
            "defaults to the context length"
        );
        assert_eq!(
            (y.beta_fast, y.beta_slow, y.attention_factor),
            (8.0, 0.5, 1.5)
        );
        assert_eq!(
            gguf(&[("scaling.type", s("linear")), ("scaling.factor", F32(4.0))]).expect("valid"),
            RopeScaling::Linear { factor: 4.0 }
        );
        assert_eq!(
            gguf(&[("scale_linear", F32(2.0))]).expect("valid"),
            RopeScaling::Linear { factor: 2.0 },
            "the old key, llama.cpp's default type"
        );
        for none in [
            vec![],
            vec![("scaling.type", s("none"))],
            vec![("scaling.type", s("linear"))],
            vec![("scaling.type", s("linear")), ("scaling.factor", F32(1.0))],
            vec![("scaling.factor", F32(0.0))],
        ] {
            assert_eq!(gguf(&none).expect("valid"), RopeScaling::None, "{none:?}");
        }
    }

    #[test]
    fn gguf_errors_name_the_key() {
        use GgufValue::{F32, U32};
        let cases = [
            (
                vec![("scaling.type", s("longrope"))],
                "qwen2.rope.scaling.type",
            ),
            (vec![("scaling.type", U32(2))], "qwen2.rope.scaling.type"),
            (
                vec![("scaling.type", s("yarn"))],
                "qwen2.rope.scaling.factor",
            ),
            (
                vec![("scaling.type", s("yarn")), ("scaling.factor", F32(-4.0))],
                "qwen2.rope.scaling.factor",
            ),
            (
                vec![
                    ("scaling.type", s("linear")),
                    ("scaling.factor", F32(f32::NAN)),
                ],
                "qwen2.rope.scaling.factor",
            ),
            (
                vec![("scaling.type", s("linear")), ("scaling.factor", s("4"))],
                "qwen2.rope.scaling.factor",
            ),
            (
                vec![
                    ("scaling.type", s("yarn")),
                    ("scaling.factor", F32(4.0)),
                    ("scaling.original_context_length", U32(0)),
                ],
                "qwen2.rope.scaling.original_context_length",
            ),
            (
                vec![
                    ("scaling.type", s("yarn")),
                    ("scaling.factor", F32(4.0)),
                    ("scaling.yarn_beta_fast", F32(-1.0)),
                ],
                "qwen2.rope.scaling.yarn_beta_fast",
            ),
            (
                vec![
                    ("scaling.type", s("yarn")),
                    ("scaling.factor", F32(4.0)),
                    ("scaling.yarn_attn_factor", F32(0.0)),
                ],
                "qwen2.rope.scaling.yarn_attn_factor",
            ),
            (
                vec![
                    ("scaling.type", s("yarn")),
                    ("scaling.factor", F32(4.0)),
                    ("scaling.yarn_ext_factor", F32(0.5)),
                ],
                "qwen2.rope.scaling.yarn_ext_factor",
            ),
            (
                vec![
                    ("scaling.type", s("yarn")),
                    ("scaling.factor", F32(4.0)),
                    ("scaling.yarn_log_multiplier", F32(0.1)),
                ],
                "qwen2.rope.scaling.yarn_log_multiplier",
            ),
            (
                vec![("scaling.attn_factor", F32(2.0))],
                "qwen2.rope.scaling.attn_factor",
            ),
            (
                vec![("scaling.alpha", F32(1.0))],
                "qwen2.rope.scaling.alpha",
            ),
        ];
        for (pairs, field) in cases {
            let err = gguf(&pairs).expect_err(field);
            let text = err.to_string();
            assert_eq!(field_of(err), field, "{pairs:?}: {text}");
            assert!(text.contains(field), "{text}");
        }
    }
}
