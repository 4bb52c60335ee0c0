//! Reading checkpoints into the tensors a Qwen2 model is built from.
//!
//! Every format exposes its tensors under the Hugging Face names
//! (`model.layers.0.self_attn.q_proj.weight`, shapes `[out, in]`), so the model
//! builder is written once. [`CheckedSource`] wraps a format and enforces the
//! contract: each tensor the model asks for exists with the expected shape, and
//! after building, no tensor is left over.

mod fp8;
mod gguf;
mod hf;
mod int_quant;
pub mod quant_config;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::quantized::QTensor;
use candle_core::Tensor;

pub use gguf::GgufCheckpoint;
pub use hf::HfCheckpoint;

use crate::error::{ModelError, Result};

/// A tensor as stored: dense (any float dtype) or in a GGUF quantized format.
#[derive(Debug)]
pub enum RawTensor {
    Dense(Tensor),
    Quantized(QTensor),
    /// AWQ and GPTQ int4 layers.
    Int4(crate::int4::GroupedInt4),
    /// FP8 layers whose rows are whole groups of 128 (FP8 checkpoints, `quantization="fp8"`).
    Fp8(crate::fp8_blocks::Fp8Blocks),
}

impl RawTensor {
    /// The tensor's values in f32, flattened (quantized ones through candle's dequantize).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        Ok(match self {
            RawTensor::Dense(t) => t.to_dtype(candle_core::DType::F32)?.flatten_all()?,
            RawTensor::Quantized(q) => q.dequantize(&candle_core::Device::Cpu)?.flatten_all()?,
            RawTensor::Int4(w) => return Ok(w.dequantize()),
            RawTensor::Fp8(w) => return Ok(w.dequantize()),
        }
        .to_vec1::<f32>()?)
    }
}

/// One checkpoint format.
pub trait TensorSource {
    /// Every tensor in the checkpoint, by canonical (HF) name.
    fn names(&self) -> Vec<String>;
    /// The logical shape (`[out, in]` for matrices) of a tensor, if present.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Loads a tensor; quantized tensors stay quantized.
    fn load(&mut self, name: &str) -> Result<RawTensor>;
    /// The checkpoint's `quant_method` (config.json's `quantization_config`: `awq`, `gptq`,
    /// `fp8`), when it has one; a GGUF file's types are per tensor and say nothing here.
    fn quant_method(&self) -> Option<&'static str> {
        None
    }
}

/// Which kind of model file a path holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFormat {
    HfDir(PathBuf),
    Gguf(PathBuf),
}

impl ModelFormat {
    pub fn detect(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_owned()));
        }
        if path.is_dir() {
            if path.join("config.json").is_file() {
                return Ok(ModelFormat::HfDir(path.to_owned()));
            }
            return Err(ModelError::UnknownFormat {
                path: path.to_owned(),
            });
        }
        let mut magic = [0u8; 4];
        let read = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map_err(|e| ModelError::io(path, e));
        match read {
            Ok(()) if &magic == b"GGUF" => Ok(ModelFormat::Gguf(path.to_owned())),
            Ok(()) => Err(ModelError::UnknownFormat {
                path: path.to_owned(),
            }),
            Err(ModelError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                Err(ModelError::Corrupt {
                    path: path.to_owned(),
                    detail: "file is shorter than a GGUF header".into(),
                })
            }
            Err(e) => Err(e),
        }
    }
}

/// Either checkpoint format, opened with its config: what every device's model builder
/// starts from.
pub enum Checkpoint {
    Hf(HfCheckpoint),
    Gguf(GgufCheckpoint),
}

/// An opened model file: the checkpoint, its config, and what the engine needs from the
/// files besides tensors.
pub struct OpenedCheckpoint {
    pub checkpoint: Checkpoint,
    pub config: crate::config::Qwen2Config,
    /// How the checkpoint scales RoPE (config.json's `rope_scaling`, GGUF's
    /// `rope.scaling.*`): every device builds its rotations from it.
    pub rope_scaling: crate::rope_scaling::RopeScaling,
    pub format: ModelFormat,
    /// GGUF metadata (tokenizer, chat template) when the model came from a GGUF file.
    pub gguf_metadata:
        Option<std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>>,
}

impl OpenedCheckpoint {
    /// The longest sequence the model serves: `max_position_embeddings`, scaled by the RoPE
    /// scaling as vLLM derives `max_model_len` (times the factor for linear and dynamic,
    /// `original_max_position_embeddings · factor` for YaRN). The engine's context limit.
    pub fn max_model_len(&self) -> usize {
        self.rope_scaling
            .max_positions(self.config.max_position_embeddings)
    }
}

impl Checkpoint {
    /// Opens an HF directory or a GGUF file, whichever `path` is, and reads its config.
    pub fn open(path: &Path) -> Result<OpenedCheckpoint> {
        let format = ModelFormat::detect(path)?;
        Ok(match &format {
            ModelFormat::HfDir(dir) => {
                let (config, rope_scaling) =
                    crate::config::Qwen2Config::from_hf_dir_with_rope_scaling(dir)?;
                OpenedCheckpoint {
                    config,
                    rope_scaling,
                    checkpoint: Checkpoint::Hf(HfCheckpoint::open(dir)?),
                    format,
                    gguf_metadata: None,
                }
            }
            ModelFormat::Gguf(file) => {
                let ckpt = GgufCheckpoint::open(file)?;
                let config = ckpt.config()?;
                OpenedCheckpoint {
                    rope_scaling: ckpt.rope_scaling(&config)?,
                    config,
                    gguf_metadata: Some(ckpt.metadata().clone()),
                    checkpoint: Checkpoint::Gguf(ckpt),
                    format,
                }
            }
        })
    }
}

impl TensorSource for Checkpoint {
    fn names(&self) -> Vec<String> {
        match self {
            Checkpoint::Hf(c) => c.names(),
            Checkpoint::Gguf(c) => c.names(),
        }
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Checkpoint::Hf(c) => c.shape(name),
            Checkpoint::Gguf(c) => c.shape(name),
        }
    }

    fn load(&mut self, name: &str) -> Result<RawTensor> {
        match self {
            Checkpoint::Hf(c) => c.load(name),
            Checkpoint::Gguf(c) => c.load(name),
        }
    }

    fn quant_method(&self) -> Option<&'static str> {
        match self {
            Checkpoint::Hf(c) => c.quant_method(),
            Checkpoint::Gguf(c) => c.quant_method(),
        }
    }
}

/// A [`TensorSource`] that checks shapes and remembers what was taken.
pub struct CheckedSource<S> {
    source: S,
    unused: BTreeSet<String>,
}

impl<S: TensorSource> CheckedSource<S> {
    pub fn new(source: S) -> Self {
        let unused = source.names().into_iter().collect();
        Self { source, unused }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.source.shape(name).is_some()
    }

    /// Loads `name`, which must have exactly `expected` as its shape.
    pub fn take(&mut self, name: &str, expected: &[usize]) -> Result<RawTensor> {
        let found = self
            .source
            .shape(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })?;
        if found != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_owned(),
                expected: expected.to_vec(),
                found,
            });
        }
        self.unused.remove(name);
        self.source.load(name)
    }

    /// Marks a tensor as deliberately ignored (e.g. an `lm_head` duplicate of tied embeddings).
    pub fn skip(&mut self, name: &str) {
        self.unused.remove(name);
    }

    /// Fails on the first tensor nobody asked for: a sign of a wrong config or architecture.
    pub fn finish(self) -> Result<()> {
        match self.unused.into_iter().next() {
            Some(name) => Err(ModelError::UnexpectedTensor { name }),
            None => Ok(()),
        }
    }
}
