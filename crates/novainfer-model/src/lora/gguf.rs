//! llama.cpp's GGUF LoRA adapters (`convert_lora_to_gguf.py`): `general.type = adapter`,
//! `adapter.type = lora`, `adapter.lora.alpha`, and tensors `blk.{i}.{attn_q|...}.weight.lora_a`
//! (`[r, in]`) and `.lora_b` (`[out, r]`), in any GGML type (dequantized to f32 here). As in
//! llama.cpp, the scale is `alpha / r`, or 1 when the file's alpha is 0 or absent.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use candle_core::Device;

use super::{RawPair, Scale, Target};
use crate::error::{ModelError, Result};

/// Reads the adapter's updates (shapes are checked by the caller).
pub(super) fn load(path: &Path) -> Result<Vec<RawPair>> {
    let err = |field: &str, reason: String| ModelError::Adapter {
        path: path.to_owned(),
        field: field.to_owned(),
        reason,
    };
    let corrupt = |detail: String| ModelError::Corrupt {
        path: path.to_owned(),
        detail,
    };
    let mut magic = [0u8; 4];
    let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    std::io::Read::read_exact(&mut file, &mut magic).map_err(|e| corrupt(e.to_string()))?;
    if &magic != b"GGUF" {
        return Err(err(
            "path",
            "is neither a PEFT adapter directory nor a GGUF adapter file".into(),
        ));
    }
    let mut file = BufReader::new(File::open(path).map_err(|e| ModelError::io(path, e))?);
    let content = Content::read(&mut file).map_err(|e| corrupt(e.to_string()))?;
    let text = |key: &str| {
        content
            .metadata
            .get(key)
            .and_then(|v| v.to_string().ok())
            .cloned()
    };
    match text("general.type").as_deref() {
        Some("adapter") => {}
        other => {
            return Err(err(
                "general.type",
                format!("is {other:?}: this GGUF file is not an adapter"),
            ))
        }
    }
    if let Some(t) = text("adapter.type") {
        if t != "lora" {
            return Err(err("adapter.type", format!("{t:?} is not a LoRA adapter")));
        }
    }
    match text("general.architecture").as_deref() {
        Some("qwen2") => {}
        other => {
            return Err(err(
                "general.architecture",
                format!(
                    "is {other:?}: the adapter was made for another base architecture than qwen2"
                ),
            ))
        }
    }
    let alpha = content
        .metadata
        .get("adapter.lora.alpha")
        .and_then(|v| v.to_f32().ok().map(f64::from).or_else(|| v.to_f64().ok()))
        .unwrap_or(0.0);
    let scale = if alpha == 0.0 {
        Scale::Fixed(1.0)
    } else {
        Scale::Alpha { alpha, rs: false }
    };

    // (layer, target index) → the target and the names of its lora_a and lora_b tensors.
    type Halves = (Target, Option<String>, Option<String>);
    let mut found: BTreeMap<(usize, usize), Halves> = BTreeMap::new();
    for name in content.tensor_infos.keys() {
        let Some((layer, target, is_a)) = parse_name(name) else {
            return Err(err(
                name,
                "is not a lora_a/lora_b tensor of a q/k/v/o/gate/up/down projection of a layer"
                    .into(),
            ));
        };
        let entry = found
            .entry((layer, target.index()))
            .or_insert((target, None, None));
        *(if is_a { &mut entry.1 } else { &mut entry.2 }) = Some(name.clone());
    }
    let mut out = Vec::with_capacity(found.len());
    for ((layer, _), (target, a, b)) in found {
        let (a_name, b_name) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (Some(n), None) | (None, Some(n)) => {
                return Err(err(&n, "has no matching lora_a/lora_b tensor".into()))
            }
            (None, None) => unreachable!("an entry is made with one half"),
        };
        let mut read = |name: &str| -> Result<(Vec<usize>, Vec<f32>, bool)> {
            let q = content
                .tensor(&mut file, name, &Device::Cpu)
                .map_err(|e| corrupt(format!("tensor `{name}`: {e}")))?;
            let bf16 = q.dtype() == candle_core::quantized::GgmlDType::BF16;
            let t = q.dequantize(&Device::Cpu)?;
            Ok((t.dims().to_vec(), t.flatten_all()?.to_vec1::<f32>()?, bf16))
        };
        let (a_shape, a, a_bf16) = read(&a_name)?;
        let (b_shape, b, b_bf16) = read(&b_name)?;
        out.push(RawPair {
            layer,
            target,
            bf16: a_bf16 && b_bf16,
            a_name,
            a_shape,
            a,
            b_name,
            b_shape,
            b,
            scale,
        });
    }
    Ok(out)
}

/// `(layer, target, is_a)` of `blk.{i}.{module}.weight.lora_{a|b}`.
fn parse_name(name: &str) -> Option<(usize, Target, bool)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, half) = rest.split_once(".weight.")?;
    let is_a = match half {
        "lora_a" => true,
        "lora_b" => false,
        _ => return None,
    };
    Some((layer.parse().ok()?, Target::from_gguf_name(module)?, is_a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_lora_names_parse() {
        assert_eq!(
            parse_name("blk.2.attn_output.weight.lora_b"),
            Some((2, Target::O, false))
        );
        assert_eq!(
            parse_name("blk.0.ffn_gate.weight.lora_a"),
            Some((0, Target::Gate, true))
        );
        assert_eq!(parse_name("token_embd.weight.lora_a"), None);
        assert_eq!(parse_name("blk.0.attn_norm.weight.lora_a"), None);
    }
}
