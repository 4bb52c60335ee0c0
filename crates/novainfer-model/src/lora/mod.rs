//! LoRA adapters: low-rank updates to a base model's projections, applied per request.
//!
//! An adapter changes projection `W` (`y = x Wᵀ`) into `W + s·B·A`, with `A: [r, in]`,
//! `B: [out, r]` and `r` small (8-64). Merging that into the weights would cost a copy of
//! the model per adapter and forbid mixing adapters in a batch, so the update is applied
//! beside the base product instead (Punica / S-LoRA): `y += s · (x Aᵀ) Bᵀ` on the rows of the
//! requests that use the adapter ([`apply`]). The scale `s` (`lora_alpha / r`, or
//! `lora_alpha / √r` for rsLoRA) multiplies `x Aᵀ`, so both matrices stay exactly as stored.
//!
//! Two file formats load into the same [`LoraAdapter`]: PEFT directories ([`peft`]) and
//! llama.cpp's GGUF adapters ([`gguf`]). Both are checked against the base model's config:
//! a wrong shape, an unknown tensor or an option we do not implement is a load error that
//! names the field or tensor, never a silently different model.

pub mod apply;
mod gguf;
mod peft;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use novainfer_core::AdapterId;

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};

/// The projections an adapter may change, in the order a layer runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module's name in transformers (and so in PEFT's `target_modules`).
    pub fn hf_name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The module's path inside a decoder layer (`self_attn.q_proj`, `mlp.down_proj`).
    fn hf_path(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// The module's name in llama.cpp's GGUF files (`blk.N.<name>.weight`).
    fn gguf_name(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }

    fn from_hf_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.hf_name() == name)
    }

    fn from_gguf_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.gguf_name() == name)
    }

    /// `(out_features, in_features)` of the projection in a model of `cfg`.
    pub fn shape(self, cfg: &Qwen2Config) -> (usize, usize) {
        let (h, kv, ffn) = (
            cfg.hidden_size,
            cfg.num_key_value_heads * cfg.head_dim(),
            cfg.intermediate_size,
        );
        match self {
            Target::Q | Target::O => (h, h),
            Target::K | Target::V => (kv, h),
            Target::Gate | Target::Up => (ffn, h),
            Target::Down => (h, ffn),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// An adapter matrix, exactly as its file holds it: bf16 files stay bf16 (half the bytes a
/// decode step streams, converted in registers), every other type is held as f32 (f16 and
/// quantized GGUF types widen exactly). Never rounded to a narrower type than the file's.
#[derive(Clone)]
pub enum Weights {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

impl Weights {
    /// `values`, kept as bf16 when `bf16` says they all are (their low 16 bits are zero).
    fn new(values: Vec<f32>, bf16: bool) -> Self {
        if bf16 && values.iter().all(|v| v.to_bits() & 0xffff == 0) {
            Weights::Bf16(values.iter().map(|v| (v.to_bits() >> 16) as u16).collect())
        } else {
            Weights::F32(values)
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every value as f32 (bf16 widens exactly).
    fn to_f32(&self) -> Vec<f32> {
        match self {
            Weights::F32(w) => w.clone(),
            Weights::Bf16(w) => w
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Weights::F32(w) => std::mem::size_of_val(w.as_slice()),
            Weights::Bf16(w) => std::mem::size_of_val(w.as_slice()),
        }
    }

    /// Element `i` as f32.
    #[cfg(test)]
    fn get(&self, i: usize) -> f32 {
        match self {
            Weights::F32(w) => w[i],
            Weights::Bf16(w) => f32::from_bits(u32::from(w[i]) << 16),
        }
    }
}

/// One projection's update: `y += scale · (x Aᵀ) Bᵀ`.
#[derive(Clone)]
pub struct LoraPair {
    rank: usize,
    /// `lora_alpha / r` (or `/ √r`), applied to `x Aᵀ` so both matrices stay as stored.
    scale: f32,
    /// `[rank, in]`, row-major.
    a: Weights,
    /// `Bᵀ`: `[rank, out]`, row-major. Transposed so that applying it is `rank` passes over
    /// contiguous rows of `out` values (see [`apply`]), not `out` dot products of length `rank`.
    bt: Weights,
}

impl LoraPair {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// `A` (`[rank, in]`) widened to f32, exactly: what a device holds of it.
    pub fn a_f32(&self) -> Vec<f32> {
        self.a.to_f32()
    }

    /// `Bᵀ` (`[rank, out]`) widened to f32.
    pub fn bt_f32(&self) -> Vec<f32> {
        self.bt.to_f32()
    }

    /// Output features of the projection.
    fn out_features(&self) -> usize {
        self.bt.len() / self.rank
    }
}

/// An adapter's updates for one decoder layer, by [`Target`].
#[derive(Clone, Default)]
pub struct LayerLora([Option<LoraPair>; 7]);

impl LayerLora {
    pub fn get(&self, target: Target) -> Option<&LoraPair> {
        self.0[target.index()].as_ref()
    }
}

/// A loaded adapter: its identity and its updates for every layer of one base model.
pub struct LoraAdapter {
    id: AdapterId,
    name: String,
    source: PathBuf,
    rank: usize,
    layers: Vec<LayerLora>,
}

impl fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("source", &self.source)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

/// What loading an adapter may not exceed, and the model it must fit.
#[derive(Debug, Clone, Copy)]
pub struct AdapterLimits {
    /// Largest rank accepted (vLLM's `max_lora_rank`).
    pub max_rank: usize,
}

impl Default for AdapterLimits {
    fn default() -> Self {
        // vLLM's default; PEFT adapters are rarely above 64.
        Self { max_rank: 16 }
    }
}

impl LoraAdapter {
    /// Loads the adapter at `path` (a PEFT directory or a GGUF adapter file) for a model of
    /// `cfg`, as adapter `id` named `name`.
    pub fn load(
        path: &Path,
        id: AdapterId,
        name: &str,
        cfg: &Qwen2Config,
        limits: AdapterLimits,
    ) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_owned()));
        }
        let parts = if path.is_dir() {
            peft::load(path)?
        } else {
            gguf::load(path)?
        };
        Self::from_parts(path, id, name, cfg, limits, parts)
    }

    /// Checks every update's shape against `cfg`, works out its scale and transposes `B`.
    fn from_parts(
        path: &Path,
        id: AdapterId,
        name: &str,
        cfg: &Qwen2Config,
        limits: AdapterLimits,
        parts: Vec<RawPair>,
    ) -> Result<Self> {
        let err = |field: String, reason: String| ModelError::Adapter {
            path: path.to_owned(),
            field,
            reason,
        };
        if parts.is_empty() {
            return Err(err(
                "tensors".into(),
                "the adapter has no LoRA tensors for any projection".into(),
            ));
        }
        let mut layers = vec![LayerLora::default(); cfg.num_hidden_layers];
        let mut max_rank = 0;
        for p in parts {
            let (out, inp) = p.target.shape(cfg);
            // A malformed file may hold a scalar: its rank is 0, refused below.
            let rank = p.a_shape.first().copied().unwrap_or(0);
            if p.layer >= cfg.num_hidden_layers {
                return Err(err(
                    p.a_name,
                    format!(
                        "layer {} does not exist: the base model has {} layers",
                        p.layer, cfg.num_hidden_layers
                    ),
                ));
            }
            if p.a_shape != [rank, inp] || rank == 0 {
                return Err(err(
                    p.a_name,
                    format!(
                        "has shape {:?}, but {} of this base model needs [r, {inp}]",
                        p.a_shape,
                        p.target.hf_name()
                    ),
                ));
            }
            if p.b_shape != [out, rank] {
                return Err(err(
                    p.b_name,
                    format!(
                        "has shape {:?}, but {} of this base model with r = {rank} needs [{out}, {rank}]",
                        p.b_shape,
                        p.target.hf_name()
                    ),
                ));
            }
            if rank > limits.max_rank {
                return Err(err(
                    "r".into(),
                    format!(
                        "rank {rank} (of {}) exceeds max_lora_rank = {}",
                        p.a_name, limits.max_rank
                    ),
                ));
            }
            let scale = p.scale.of(rank);
            let slot = &mut layers[p.layer].0[p.target.index()];
            if slot.is_some() {
                return Err(err(p.a_name, "appears twice".into()));
            }
            let mut bt = vec![0f32; rank * out];
            for (o, row) in p.b.chunks_exact(rank).enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    bt[j * out + o] = v;
                }
            }
            *slot = Some(LoraPair {
                rank,
                scale,
                a: Weights::new(p.a, p.bf16),
                bt: Weights::new(bt, p.bf16),
            });
            max_rank = max_rank.max(rank);
        }
        Ok(Self {
            id,
            name: name.to_owned(),
            source: path.to_owned(),
            rank: max_rank,
            layers,
        })
    }

    pub fn id(&self) -> AdapterId {
        self.id
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file or directory it was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The largest rank among its updates.
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn layer(&self, index: usize) -> &LayerLora {
        &self.layers[index]
    }

    /// Bytes of its weights in memory.
    pub fn weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.0.iter().flatten())
            .map(|p| p.a.bytes() + p.bt.bytes())
            .sum()
    }
}

/// How an update's scale follows from its rank.
#[derive(Debug, Clone, Copy)]
enum Scale {
    /// `alpha / r` (LoRA), or `alpha / √r` with `rs` (rsLoRA).
    Alpha { alpha: f64, rs: bool },
    /// A fixed factor (llama.cpp's adapters without an alpha: 1).
    Fixed(f64),
}

impl Scale {
    fn of(self, rank: usize) -> f32 {
        let r = rank as f64;
        (match self {
            Scale::Alpha { alpha, rs: false } => alpha / r,
            Scale::Alpha { alpha, rs: true } => alpha / r.sqrt(),
            Scale::Fixed(s) => s,
        }) as f32
    }
}

/// One projection's update as read from a file, before it is checked.
struct RawPair {
    layer: usize,
    target: Target,
    a_name: String,
    a_shape: Vec<usize>,
    a: Vec<f32>,
    b_name: String,
    b_shape: Vec<usize>,
    b: Vec<f32>,
    /// Both matrices are bf16 in the file (and are kept so).
    bf16: bool,
    scale: Scale,
}

/// A shared handle on a loaded adapter; equal when the ids are (ids are never reused).
#[derive(Clone)]
pub struct AdapterRef(pub Arc<LoraAdapter>);

impl AdapterRef {
    pub fn id(&self) -> AdapterId {
        self.0.id
    }
}

impl std::ops::Deref for AdapterRef {
    type Target = LoraAdapter;
    fn deref(&self) -> &LoraAdapter {
        &self.0
    }
}

impl PartialEq for AdapterRef {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for AdapterRef {}

impl fmt::Debug for AdapterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AdapterRef({} {:?})", self.0.id, self.0.name)
    }
}

/// Adapters built in memory, for tests elsewhere in the crate.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// Adapter `id` with no updates (`layers` empty layers): enough to tag spans.
    pub fn empty_adapter(id: u64, layers: usize) -> AdapterRef {
        AdapterRef(Arc::new(LoraAdapter {
            id: AdapterId(id),
            name: format!("a{id}"),
            source: PathBuf::from("mem"),
            rank: 1,
            layers: vec![LayerLora::default(); layers],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Qwen2Config {
        Qwen2Config {
            vocab_size: 32,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            max_position_embeddings: 64,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    fn pair(layer: usize, a_shape: Vec<usize>, b_shape: Vec<usize>) -> RawPair {
        let (a, b) = (a_shape.iter().product(), b_shape.iter().product());
        RawPair {
            layer,
            target: Target::Up,
            a_name: "A".into(),
            a_shape,
            a: vec![0.5; a],
            b_name: "B".into(),
            b_shape,
            b: vec![0.25; b],
            bf16: false,
            scale: Scale::Alpha {
                alpha: 8.0,
                rs: false,
            },
        }
    }

    fn load(parts: Vec<RawPair>) -> Result<LoraAdapter> {
        let limits = AdapterLimits { max_rank: 4 };
        LoraAdapter::from_parts(Path::new("x"), AdapterId(1), "x", &cfg(), limits, parts)
    }

    fn field(r: Result<LoraAdapter>) -> String {
        match r {
            Err(ModelError::Adapter { field, .. }) => field,
            other => panic!("expected an adapter error, got {other:?}"),
        }
    }

    #[test]
    fn malformed_updates_are_errors_naming_the_tensor_not_panics() {
        assert_eq!(field(load(vec![pair(0, vec![], vec![16, 2])])), "A");
        assert_eq!(field(load(vec![pair(0, vec![0, 8], vec![16, 0])])), "A");
        assert_eq!(field(load(vec![pair(0, vec![2, 8], vec![16, 3])])), "B");
        assert_eq!(field(load(vec![pair(5, vec![2, 8], vec![16, 2])])), "A");
        assert_eq!(field(load(vec![pair(0, vec![8, 8], vec![16, 8])])), "r");
        assert_eq!(field(load(Vec::new())), "tensors");
        let twice = vec![
            pair(0, vec![2, 8], vec![16, 2]),
            pair(0, vec![2, 8], vec![16, 2]),
        ];
        assert_eq!(field(load(twice)), "A");
    }

    #[test]
    fn the_scale_follows_the_rank_and_b_is_transposed() {
        let a = load(vec![pair(1, vec![2, 8], vec![16, 2])]).expect("valid");
        let p = a.layer(1).get(Target::Up).expect("present");
        assert_eq!((p.rank, p.scale, p.out_features()), (2, 4.0, 16));
        assert!(a.layer(0).get(Target::Up).is_none());
        assert_eq!(a.weight_bytes(), (2 * 8 + 2 * 16) * 4);
        assert_eq!(
            Scale::Alpha {
                alpha: 16.0,
                rs: true
            }
            .of(16),
            4.0
        );
        assert_eq!(Scale::Fixed(1.0).of(7), 1.0);
    }
}
