//! Hugging Face safetensors checkpoints, single file or sharded.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::Device;
use serde::Deserialize;

use super::{RawTensor, TensorSource};
use crate::config::read_json;
use crate::error::{ModelError, Result};

/// Tensors that some checkpoints carry but that are derived, not learned.
const DERIVED_SUFFIXES: &[&str] = &["rotary_emb.inv_freq"];

pub struct HfCheckpoint {
    tensors: MmapedSafetensors,
    shapes: HashMap<String, Vec<usize>>,
    files: Vec<PathBuf>,
}

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
        let shapes = tensors
            .tensors()
            .into_iter()
            .filter(|(name, _)| !DERIVED_SUFFIXES.iter().any(|s| name.ends_with(s)))
            .map(|(name, view)| (name, view.shape().to_vec()))
            .collect();
        Ok(Self {
            tensors,
            shapes,
            files,
        })
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
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
        let tensor = self
            .tensors
            .load(name, &Device::Cpu)
            .map_err(|e| ModelError::Corrupt {
                path: self.files[0].clone(),
                detail: format!("tensor `{name}`: {e}"),
            })?;
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
}
