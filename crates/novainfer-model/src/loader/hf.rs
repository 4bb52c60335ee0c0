//! Hugging Face safetensors checkpoints, single file or sharded; float weights, AWQ/GPTQ
//! integer layers (`qweight`, `qzeros`, `scales`, `g_idx`) presented as one `weight` each, or
//! FP8 weights whose scales are folded in at load.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{Device, Tensor};
use serde::Deserialize;

use super::fp8::{self, Fp8};
use super::int_quant::{self, Repacked};
use super::quant_config::{self, IntQuant, Quantization};
use super::{RawTensor, TensorSource};
use crate::config::read_json;
use crate::error::{ModelError, Result};

/// Tensors that some checkpoints carry but that are derived, not learned.
const DERIVED_SUFFIXES: &[&str] = &["rotary_emb.inv_freq"];

pub struct HfCheckpoint {
    tensors: MmapedSafetensors,
    /// What [`TensorSource`] exposes: packed layers appear as `{prefix}.weight` `[out, in]`.
    shapes: HashMap<String, Vec<usize>>,
    files: Vec<PathBuf>,
    packed: Option<PackedLayers>,
    /// `quant_method: fp8`: how its FP8 weights' scales are laid out.
    fp8: Option<Fp8>,
}

/// The AWQ/GPTQ layers of a checkpoint and how they are packed.
struct PackedLayers {
    scheme: IntQuant,
    /// Layer prefixes (`model.layers.0.mlp.up_proj`) that have a `qweight`.
    prefixes: BTreeSet<String>,
    /// Whether a layer has been dequantized to dense yet (said once, at warn level).
    warned_dense: bool,
}

/// The tensors of a packed layer besides `qweight`, which it replaces by one `weight`.
const PACKED_PARTS: &[&str] = &["qweight", "qzeros", "scales", "g_idx"];

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let files = shard_files(dir)?;
        // SAFETY: the files are mapped read-only; like every mmap-based loader we
        // rely on nobody truncating them while the model is being loaded.
        let tensors =
            unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| ModelError::Corrupt {
                path: dir.to_owned(),
                detail: e.to_string(),
            })?;
        let mut shapes: HashMap<String, Vec<usize>> = tensors
            .tensors()
            .into_iter()
            .filter(|(name, _)| !DERIVED_SUFFIXES.iter().any(|s| name.ends_with(s)))
            .map(|(name, view)| (name, view.shape().to_vec()))
            .collect();
        let quantization = quant_config::read(dir)?;
        let fp8 = match quantization {
            Some(Quantization::Fp8(cfg)) => {
                // Each scale belongs to its weight, which is presented already scaled.
                shapes.retain(|name, _| {
                    !fp8::SCALE_SUFFIXES
                        .iter()
                        .any(|s| name.strip_suffix(s).is_some_and(|p| p.ends_with('.')))
                });
                if cfg.static_activations {
                    tracing::info!(
                        "FP8 checkpoint with static activation scales: activations stay \
                         unquantized here, its input_scale tensors are not used"
                    );
                }
                Some(cfg)
            }
            _ => None,
        };
        let int = match quantization {
            Some(Quantization::Int(q)) => Some(q),
            _ => None,
        };
        let packed = packed_layers(int, &mut shapes)?;
        Ok(Self {
            tensors,
            shapes,
            files,
            packed,
            fp8,
        })
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

/// Reads the quantization scheme (an unsupported one is an error even if no tensor is packed:
/// the weights would otherwise be misread) and replaces each packed layer's parts in `shapes`
/// by its logical `{prefix}.weight`.
fn packed_layers(
    scheme: Option<IntQuant>,
    shapes: &mut HashMap<String, Vec<usize>>,
) -> Result<Option<PackedLayers>> {
    let prefixes: BTreeSet<String> = shapes
        .keys()
        .filter_map(|n| n.strip_suffix(".qweight"))
        .map(str::to_owned)
        .collect();
    let scheme = match scheme {
        Some(scheme) => scheme,
        None => match prefixes.first() {
            Some(p) => {
                return Err(ModelError::InvalidQuantTensor {
                    name: format!("{p}.qweight"),
                    reason: "packed integer weights, but config.json has no awq or gptq \
                             quantization_config"
                        .into(),
                })
            }
            None => return Ok(None),
        },
    };
    for prefix in &prefixes {
        let weight = format!("{prefix}.weight");
        if shapes.contains_key(&weight) {
            return Err(ModelError::InvalidQuantTensor {
                name: weight,
                reason: "the layer is stored both packed (qweight) and dense (weight)".into(),
            });
        }
        let qweight = format!("{prefix}.qweight");
        let (rows, cols) = match shapes.get(&qweight).map(Vec::as_slice) {
            Some(&[a, b]) => (a, b),
            other => {
                return Err(ModelError::InvalidQuantTensor {
                    name: qweight,
                    reason: format!("expected a 2-D tensor, found shape {other:?}"),
                })
            }
        };
        let logical = match scheme {
            // [in, out / 8]
            IntQuant::Awq(_) => vec![cols * 8, rows],
            // [in / per_word, out]
            IntQuant::Gptq(g) => vec![cols, rows * g.bits.per_word()],
        };
        for part in PACKED_PARTS {
            shapes.remove(&format!("{prefix}.{part}"));
        }
        shapes.insert(weight, logical);
    }
    Ok(Some(PackedLayers {
        scheme,
        prefixes,
        warned_dense: false,
    }))
}

/// The safetensors files of a checkpoint, in the index's order when sharded.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let index: ShardIndex = read_json(&index)?;
        let mut names: Vec<String> = index.weight_map.into_values().collect();
        names.sort();
        names.dedup();
        let files: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(ModelError::NotFound(missing.clone()));
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(ModelError::NotFound(single))
}

impl TensorSource for HfCheckpoint {
    fn names(&self) -> Vec<String> {
        self.shapes.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.shapes.get(name).cloned()
    }

    fn load(&mut self, name: &str) -> Result<RawTensor> {
        if let Some(prefix) = self.packed_prefix(name) {
            return self.load_packed(&prefix);
        }
        let tensor = self.raw(name)?;
        if tensor.dtype() == candle_core::DType::F8E4M3 {
            return self.load_fp8(name);
        }
        if !matches!(
            tensor.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16
        ) {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: format!("{:?}", tensor.dtype()),
            });
        }
        Ok(RawTensor::Dense(tensor))
    }

    fn quant_method(&self) -> Option<&'static str> {
        match (&self.fp8, &self.packed) {
            (Some(_), _) => Some("fp8"),
            (None, Some(p)) => Some(match p.scheme {
                IntQuant::Awq(_) => "awq",
                IntQuant::Gptq(_) => "gptq",
            }),
            (None, None) => None,
        }
    }
}

impl HfCheckpoint {
    /// `name` as stored, any dtype.
    fn raw(&self, name: &str) -> Result<Tensor> {
        self.tensors
            .load(name, &Device::Cpu)
            .map_err(|e| ModelError::Corrupt {
                path: self.files[0].clone(),
                detail: format!("tensor `{name}`: {e}"),
            })
    }

    /// FP8 `name` with its scales: FP8 blocks, or dense f32 where they do not fit ([`fp8::load`]).
    fn load_fp8(&self, name: &str) -> Result<RawTensor> {
        let Some(cfg) = self.fp8 else {
            return Err(ModelError::InvalidQuantTensor {
                name: name.to_owned(),
                reason: "FP8 weights, but config.json has no quant_method fp8 \
                         quantization_config"
                    .into(),
            });
        };
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        // Block-wise checkpoints name their scales `weight_scale_inv` (multiplied all the
        // same), per-tensor ones `weight_scale`; either is accepted for either.
        let scale = match cfg.block {
            Some(_) => ["weight_scale_inv", "weight_scale"],
            None => ["weight_scale", "weight_scale_inv"],
        }
        .iter()
        .find_map(|part| self.part(prefix, part).ok());
        let Some(scale) = scale else {
            return Err(ModelError::MissingTensor {
                name: format!("{prefix}.weight_scale"),
            });
        };
        let view = self.tensors.get(name).map_err(|e| ModelError::Corrupt {
            path: self.files[0].clone(),
            detail: format!("tensor `{name}`: {e}"),
        })?;
        fp8::load(name, &cfg, view.shape(), view.data(), &scale)
    }

    /// A part of a packed layer, which must exist.
    fn part(&self, prefix: &str, part: &str) -> Result<Tensor> {
        let name = format!("{prefix}.{part}");
        if self.tensors.get(&name).is_err() {
            return Err(ModelError::MissingTensor { name });
        }
        self.raw(&name)
    }

    /// The layer prefix when `name` is the logical weight of a packed layer.
    fn packed_prefix(&self, name: &str) -> Option<String> {
        let packed = self.packed.as_ref()?;
        let prefix = name.strip_suffix(".weight")?;
        packed.prefixes.contains(prefix).then(|| prefix.to_owned())
    }

    fn load_packed(&mut self, prefix: &str) -> Result<RawTensor> {
        let Some(scheme) = self.packed.as_ref().map(|p| p.scheme) else {
            return Err(ModelError::MissingTensor {
                name: format!("{prefix}.weight"),
            });
        };
        let (qweight, qzeros, scales) = (
            self.part(prefix, "qweight")?,
            self.part(prefix, "qzeros")?,
            self.part(prefix, "scales")?,
        );
        let matrix = match scheme {
            IntQuant::Awq(cfg) => int_quant::unpack_awq(prefix, cfg, &qweight, &qzeros, &scales)?,
            IntQuant::Gptq(cfg) => {
                let g_idx = match self.part(prefix, "g_idx") {
                    Ok(t) => Some(t),
                    Err(ModelError::MissingTensor { .. }) => None,
                    Err(e) => return Err(e),
                };
                int_quant::unpack_gptq(prefix, cfg, &qweight, &qzeros, &scales, g_idx.as_ref())?
            }
        };
        let (tensor, how) = int_quant::repack(&matrix)?;
        if let (Repacked::Dense(why), Some(packed)) = (how, self.packed.as_mut()) {
            if !packed.warned_dense {
                packed.warned_dense = true;
                tracing::warn!(
                    layer = prefix,
                    reason = ?why,
                    "quantized layer has no exact block encoding: dequantized to dense f32 \
                     (4 bytes per weight); further such layers are logged at debug level"
                );
            }
        }
        tracing::debug!(layer = prefix, ?how, "repacked quantized layer");
        Ok(tensor)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Tensor};
    use half::f16;

    use super::HfCheckpoint;
    use crate::error::ModelError;
    use crate::loader::{RawTensor, TensorSource};

    const LAYER: &str = "model.layers.0.mlp.up_proj";

    /// A directory with config.json (`quantization` as its quantization_config, if any) and
    /// one AWQ layer of shape [64, 32] (every q = 3, z = 1, s = 0.5: w = 1) plus a norm.
    fn awq_dir(quantization: Option<serde_json::Value>, parts: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = serde_json::json!({"model_type": "qwen2"});
        if let Some(q) = quantization {
            config["quantization_config"] = q;
        }
        std::fs::write(dir.path().join("config.json"), config.to_string()).expect("config");
        let int32 = |word: u32, shape: (usize, usize)| {
            Tensor::from_vec(vec![word as i32; shape.0 * shape.1], shape, &Device::Cpu)
                .expect("int32")
        };
        let all: HashMap<&str, Tensor> = HashMap::from([
            ("qweight", int32(0x3333_3333, (32, 8))),
            ("qzeros", int32(0x1111_1111, (1, 8))),
            (
                "scales",
                Tensor::from_vec(vec![f16::from_f32(0.5); 64], (1, 64), &Device::Cpu)
                    .expect("scales"),
            ),
        ]);
        let mut tensors: HashMap<String, Tensor> = parts
            .iter()
            .map(|p| (format!("{LAYER}.{p}"), all[p].clone()))
            .collect();
        tensors.insert(
            "model.norm.weight".into(),
            Tensor::ones(32, candle_core::DType::F32, &Device::Cpu).expect("norm"),
        );
        candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors"))
            .expect("save");
        dir
    }

    fn awq_config(method: &str) -> Option<serde_json::Value> {
        Some(
            serde_json::json!({"quant_method": method, "bits": 4, "group_size": -1,
                                "version": "gemm", "zero_point": true}),
        )
    }

    #[test]
    fn awq_layers_appear_as_one_weight_of_their_logical_shape() {
        let dir = awq_dir(awq_config("awq"), &["qweight", "qzeros", "scales"]);
        let mut ckpt = HfCheckpoint::open(dir.path()).expect("open");
        let mut names = ckpt.names();
        names.sort();
        assert_eq!(
            names,
            [format!("{LAYER}.weight"), "model.norm.weight".into()]
        );
        assert_eq!(ckpt.shape(&format!("{LAYER}.weight")), Some(vec![64, 32]));
        let raw = ckpt.load(&format!("{LAYER}.weight")).expect("load");
        assert!(matches!(&raw, RawTensor::Quantized(q)
            if q.dtype() == candle_core::quantized::GgmlDType::Q5_0));
        assert!(raw.to_f32_vec().expect("values").iter().all(|&w| w == 1.0));
    }

    #[test]
    fn unsupported_or_missing_quantization_is_a_load_error_naming_it() {
        let parts = ["qweight", "qzeros", "scales"];
        let bnb = awq_dir(awq_config("bitsandbytes"), &parts);
        match HfCheckpoint::open(bnb.path()) {
            Err(e @ ModelError::UnsupportedQuantization { .. }) => {
                assert!(e.to_string().contains("bitsandbytes"), "{e}")
            }
            other => panic!("expected UnsupportedQuantization, got {:?}", other.err()),
        }
        let bare = awq_dir(None, &parts);
        let e = HfCheckpoint::open(bare.path()).err().expect("no config");
        assert!(e.to_string().contains("quantization_config"), "{e}");
        let no_zeros = awq_dir(awq_config("awq"), &["qweight", "scales"]);
        let mut ckpt = HfCheckpoint::open(no_zeros.path()).expect("open");
        match ckpt.load(&format!("{LAYER}.weight")) {
            Err(ModelError::MissingTensor { name }) => assert_eq!(name, format!("{LAYER}.qzeros")),
            other => panic!("expected MissingTensor, got {:?}", other.err()),
        }
    }
}
