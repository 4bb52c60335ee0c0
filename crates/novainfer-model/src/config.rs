//! Qwen2 hyper-parameters, read from an HF `config.json` or from GGUF metadata.
//!
//! Both sources end in the same [`Qwen2Config`], validated once: a config that
//! passes [`Qwen2Config::validate`] can build a model whose shapes are consistent.
//! The RoPE scaling is read beside it ([`Qwen2Config::from_hf_dir_with_rope_scaling`],
//! `crate::rope_scaling`) and travels with the opened checkpoint
//! ([`crate::OpenedCheckpoint::rope_scaling`]).

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{ModelError, Result};
use crate::rope_scaling::{self, ModelDims, RopeScaling};

/// Weight storage types a checkpoint may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
    F16,
}

impl WeightDtype {
    /// Parses the spellings used by transformers (`float32`, `bfloat16`, ...) and by us (`f32`, ...).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Some(Self::F32),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            "f16" | "float16" | "half" => Some(Self::F16),
            _ => None,
        }
    }

    pub fn candle(self) -> candle_core::DType {
        match self {
            Self::F32 => candle_core::DType::F32,
            Self::Bf16 => candle_core::DType::BF16,
            Self::F16 => candle_core::DType::F16,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    /// The checkpoint's own storage type; `None` for GGUF (per-tensor types).
    pub torch_dtype: Option<WeightDtype>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl Qwen2Config {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Query heads served by each KV head (grouped-query attention).
    pub fn num_queries_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ModelError::config(field, "must be positive"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(ModelError::config(
                "hidden_size",
                format!(
                    "{} is not divisible by num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ModelError::config(
                "hidden_size",
                "head_dim must be even for rotary embeddings",
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(ModelError::config(
                "rope_theta",
                format!("must be positive, got {}", self.rope_theta),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ModelError::config(
                "rms_norm_eps",
                format!("must be positive, got {}", self.rms_norm_eps),
            ));
        }
        Ok(())
    }

    /// Reads `config.json` and, when present, `generation_config.json` from an HF directory
    /// (a bad `rope_scaling` is an error here too).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        Self::from_hf_dir_with_rope_scaling(dir).map(|(cfg, _)| cfg)
    }

    /// [`Self::from_hf_dir`] and the RoPE scaling config.json asks for (`rope_scaling`, else
    /// transformers 5's `rope_parameters`; see `crate::rope_scaling`).
    pub fn from_hf_dir_with_rope_scaling(dir: &Path) -> Result<(Self, RopeScaling)> {
        let raw: HfConfig = read_json(&dir.join("config.json"))?;
        let generation: Option<GenerationConfig> = match dir.join("generation_config.json") {
            p if p.exists() => Some(read_json(&p)?),
            _ => None,
        };
        let (cfg, rope_spec) = raw.into_config(generation)?;
        cfg.validate()?;
        let scaling = match rope_spec {
            None => RopeScaling::None,
            Some((section, spec)) => rope_scaling::from_hf(section, &spec, ModelDims::of(&cfg))?,
        };
        Ok((cfg, scaling))
    }
}

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Corrupt {
        path: path.to_owned(),
        detail: e.to_string(),
    })
}

/// One id or several: `eos_token_id` is spelled both ways in the wild.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(id) => vec![id],
            OneOrMany::Many(ids) => ids,
        }
    }
}

/// `config.json` as transformers writes it; newer versions moved some fields.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: usize,
    rope_theta: Option<f64>,
    /// transformers 5: `rope_theta` and the scaling in one object (maybe per layer type).
    rope_parameters: Option<Value>,
    /// transformers 4: the scaling (`type`/`rope_type`, `factor`, ...); wins when not null.
    rope_scaling: Option<Value>,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    hidden_act: Option<String>,
}

fn default_max_positions() -> usize {
    32768
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

#[derive(Debug, Deserialize)]
struct GenerationConfig {
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

const QWEN2_ARCH: &str = "Qwen2ForCausalLM";

/// Where a config.json's rope scaling lives, and that object.
type RopeSpec = Option<(&'static str, Map<String, Value>)>;

impl HfConfig {
    /// The config and its rope scaling's source, read as transformers 5 reads them: a non-null
    /// `rope_scaling` is the scaling, else `rope_parameters` is.
    fn into_config(self, generation: Option<GenerationConfig>) -> Result<(Qwen2Config, RopeSpec)> {
        let is_qwen2 = self.architectures.iter().any(|a| a == QWEN2_ARCH)
            || (self.architectures.is_empty() && self.model_type.as_deref() == Some("qwen2"));
        if !is_qwen2 {
            let found = self
                .architectures
                .first()
                .cloned()
                .or(self.model_type)
                .unwrap_or_default();
            return Err(ModelError::UnsupportedArchitecture {
                found,
                expected: QWEN2_ARCH,
            });
        }
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(ModelError::config(
                "hidden_act",
                format!("only silu is supported, got {act:?}"),
            ));
        }
        let object =
            |field: &'static str, v: Option<Value>| -> Result<Option<Map<String, Value>>> {
                match v {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::Object(m)) => Ok(Some(m)),
                    Some(other) => Err(ModelError::config(
                        field,
                        format!("must be an object or null, got {other}"),
                    )),
                }
            };
        let rope_parameters = object("rope_parameters", self.rope_parameters)?
            .map(|p| rope_scaling::flatten_rope_parameters(&p))
            .transpose()?;
        let theta_in_parameters = match rope_parameters.as_ref().and_then(|p| p.get("rope_theta")) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_f64().ok_or_else(|| {
                ModelError::config(
                    "rope_parameters.rope_theta",
                    format!("must be a number, got {v}"),
                )
            })?),
        };
        let rope_theta = self.rope_theta.or(theta_in_parameters).unwrap_or(10_000.0);
        let rope_spec = match object("rope_scaling", self.rope_scaling)? {
            Some(spec) => Some(("rope_scaling", spec)),
            None => rope_parameters.map(|p| ("rope_parameters", p)),
        };
        let torch_dtype = match self.torch_dtype.or(self.dtype) {
            None => None,
            Some(s) => Some(WeightDtype::parse(&s).ok_or_else(|| {
                ModelError::config("torch_dtype", format!("unknown dtype {s:?}"))
            })?),
        };
        // generation_config.json is what generate() honours, so its eos list wins.
        let (gen_bos, gen_eos) = generation
            .map(|g| (g.bos_token_id, g.eos_token_id))
            .unwrap_or((None, None));
        let eos_token_ids = gen_eos
            .or(self.eos_token_id)
            .map(OneOrMany::into_vec)
            .unwrap_or_default();
        let cfg = Qwen2Config {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            max_position_embeddings: self.max_position_embeddings,
            rope_theta,
            rms_norm_eps: self.rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings,
            torch_dtype,
            bos_token_id: gen_bos.or(self.bos_token_id),
            eos_token_ids,
        };
        Ok((cfg, rope_spec))
    }
}

impl ModelDims {
    pub(crate) fn of(cfg: &Qwen2Config) -> Self {
        Self {
            head_dim: cfg.head_dim(),
            max_position_embeddings: cfg.max_position_embeddings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write test file");
    }

    const BASE: &str = r#"{"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "eos_token_id": 299}"#;

    #[test]
    fn generation_config_eos_list_wins() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path(), "config.json", BASE);
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": [297, 298]}"#,
        );
        let cfg = Qwen2Config::from_hf_dir(dir.path()).expect("valid config");
        assert_eq!(cfg.eos_token_ids, vec![297, 298]);
        assert_eq!(cfg.head_dim(), 16);
        assert_eq!(cfg.num_queries_per_kv(), 2);
        assert_eq!(cfg.torch_dtype, Some(WeightDtype::Bf16));
    }

    #[test]
    fn newer_transformers_spellings_are_accepted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = BASE
            .replace(
                r#""rope_theta": 10000.0"#,
                r#""rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}"#,
            )
            .replace("torch_dtype", "dtype");
        write(dir.path(), "config.json", &text);
        let cfg = Qwen2Config::from_hf_dir(dir.path()).expect("valid config");
        assert_eq!(cfg.rope_theta, 1e6);
        assert_eq!(cfg.eos_token_ids, vec![299]);
    }

    #[test]
    fn rope_scaling_is_read_in_both_spellings() {
        let dir = tempfile::tempdir().expect("tempdir");
        let qwen = BASE.replace(
            r#""eos_token_id": 299"#,
            r#""eos_token_id": 299, "rope_scaling": {"type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 128}"#,
        );
        write(dir.path(), "config.json", &qwen);
        let (cfg, scaling) = Qwen2Config::from_hf_dir_with_rope_scaling(dir.path()).expect("valid");
        assert_eq!(cfg.max_position_embeddings, 512, "stays the model's");
        assert_eq!(scaling.max_positions(cfg.max_position_embeddings), 512);
        let RopeScaling::Yarn(y) = scaling else {
            panic!("{scaling:?}")
        };
        assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 128));

        // transformers 5: the scaling inside rope_parameters, beside rope_theta.
        let v5 = BASE.replace(
            r#""rope_theta": 10000.0"#,
            r#""rope_parameters": {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 2.0}"#,
        );
        write(dir.path(), "config.json", &v5);
        let (cfg, scaling) = Qwen2Config::from_hf_dir_with_rope_scaling(dir.path()).expect("valid");
        assert_eq!(cfg.rope_theta, 1e6);
        assert_eq!(scaling, RopeScaling::Linear { factor: 2.0 });

        // A null rope_scaling, or none at all, is plain RoPE.
        write(
            dir.path(),
            "config.json",
            &BASE.replace(
                r#""eos_token_id": 299"#,
                r#""eos_token_id": 299, "rope_scaling": null"#,
            ),
        );
        let (_, scaling) = Qwen2Config::from_hf_dir_with_rope_scaling(dir.path()).expect("valid");
        assert_eq!(scaling, RopeScaling::None);
    }

    #[test]
    fn a_bad_rope_scaling_fails_the_load_naming_its_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (extra, field) in [
            (
                r#""rope_scaling": {"type": "su", "factor": 4.0}"#,
                "rope_scaling.type",
            ),
            (r#""rope_scaling": {"type": "yarn"}"#, "rope_scaling.factor"),
            (r#""rope_scaling": [4]"#, "rope_scaling"),
            (
                r#""rope_parameters": {"rope_type": "yarn", "factor": -1}"#,
                "rope_parameters.factor",
            ),
            (
                r#""rope_parameters": {"rope_theta": "big"}"#,
                "rope_parameters.rope_theta",
            ),
        ] {
            let text = BASE.replace(
                r#""eos_token_id": 299"#,
                &format!(r#""eos_token_id": 299, {extra}"#),
            );
            write(dir.path(), "config.json", &text);
            let err = Qwen2Config::from_hf_dir(dir.path()).expect_err(extra);
            assert!(
                matches!(&err, ModelError::InvalidConfig { field: f, .. } if f == field),
                "{extra}: {err}"
            );
        }
    }

    #[test]
    fn other_architectures_are_rejected_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "config.json",
            &BASE.replace("Qwen2ForCausalLM", "LlamaForCausalLM"),
        );
        let err = Qwen2Config::from_hf_dir(dir.path()).expect_err("llama is not qwen2");
        assert!(err.to_string().contains("LlamaForCausalLM"), "{err}");
    }

    #[test]
    fn inconsistent_heads_name_the_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "config.json",
            &BASE.replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 3"#),
        );
        let err = Qwen2Config::from_hf_dir(dir.path()).expect_err("4 heads over 3 kv heads");
        assert!(err.to_string().contains("num_key_value_heads"), "{err}");
    }

    #[test]
    fn missing_config_is_not_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Qwen2Config::from_hf_dir(dir.path()).expect_err("no config.json");
        assert!(matches!(err, ModelError::NotFound(_)), "{err}");
    }
}
