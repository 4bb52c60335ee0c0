//! Weights quantized at load (`quantization`, vLLM's `--quantization`), for checkpoints that
//! hold them dense.
//!
//! * `none` (the default): the checkpoint's weights as stored.
//! * `fp8`: every decoder linear layer (q/k/v/o, gate/up/down) of a dense checkpoint (f32, bf16,
//!   f16; HF or GGUF) quantized to e4m3 with a scale per output channel, as vLLM's dynamic FP8
//!   quantization does ([`Fp8Blocks::quantize_rows`]). Embeddings, norms, biases and the lm_head
//!   stay as they are (vLLM keeps them too). On a GPU the layers stay FP8 (half a bf16 matrix's
//!   bytes; decode multiplies the codes in place); the CPU, which has no FP8 arithmetic, runs
//!   their dense values, so both devices compute with the same weights. A checkpoint that is
//!   already FP8 (`quant_method: fp8`) is kept as it is, every layer (those its scale layout
//!   leaves dense too); one quantized some other way (AWQ, GPTQ, GGUF blocks) is a load error
//!   naming its method or first such layer, since quantizing it again would only lose more.

use candle_core::DType;

use crate::error::{ModelError, Result};
use crate::fp8_blocks::Fp8Blocks;
use crate::loader::{RawTensor, TensorSource};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum WeightQuantization {
    #[default]
    None,
    Fp8,
}

impl WeightQuantization {
    pub const ALL: [WeightQuantization; 2] = [Self::None, Self::Fp8];

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Self::None),
            "fp8" => Ok(Self::Fp8),
            other => Err(ModelError::config(
                "quantization",
                format!("unknown quantization {other:?}; expected \"fp8\" (or none)"),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fp8 => "fp8",
        }
    }
}

/// The projections of a decoder layer: the linear layers `fp8` quantizes.
const LINEARS: [&str; 7] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// Whether `name` is a decoder layer's projection weight (`model.layers.N.<LINEARS>`).
fn is_decoder_linear(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return false;
    };
    let Some((index, leaf)) = rest.split_once('.') else {
        return false;
    };
    !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) && LINEARS.contains(&leaf)
}

/// A checkpoint read with its weights quantized as [`WeightQuantization`] says: what every
/// device's builder reads, so the CPU and the GPU see the same tensors.
pub struct QuantizedAtLoad<S> {
    inner: S,
    quantization: WeightQuantization,
    /// A layer left dense (its rows are not whole FP8 groups) has been logged.
    warned: bool,
}

impl<S> QuantizedAtLoad<S> {
    pub fn new(inner: S, quantization: WeightQuantization) -> Self {
        Self {
            inner,
            quantization,
            warned: false,
        }
    }
}

impl<S: TensorSource> TensorSource for QuantizedAtLoad<S> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(name)
    }

    fn load(&mut self, name: &str) -> Result<RawTensor> {
        if self.quantization == WeightQuantization::None || !is_decoder_linear(name) {
            return self.inner.load(name);
        }
        let already = |what: String| ModelError::InvalidQuantTensor {
            name: name.to_owned(),
            reason: format!(
                "quantization=\"fp8\" quantizes a dense checkpoint's weights, and this one is \
                 already {what}; load it without quantization"
            ),
        };
        // Asked before a layer is read (an AWQ one is unpacked on reading).
        match self.inner.quant_method() {
            // An FP8 checkpoint's layers are FP8 values already, whatever form they load in.
            Some("fp8") => return self.inner.load(name),
            Some(method) => return Err(already(format!("quantized (quant_method {method})"))),
            None => {}
        }
        match self.inner.load(name)? {
            RawTensor::Dense(t) => {
                let &[rows, cols] = t.dims() else {
                    return Ok(RawTensor::Dense(t));
                };
                if !Fp8Blocks::fits(cols) {
                    if !self.warned {
                        self.warned = true;
                        tracing::warn!(
                            tensor = name,
                            cols,
                            "quantization=fp8: rows of {cols} values are not whole groups of {}; \
                             such layers stay dense",
                            crate::fp8_blocks::GROUP_K
                        );
                    }
                    return Ok(RawTensor::Dense(t));
                }
                let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Ok(RawTensor::Fp8(Fp8Blocks::quantize_rows(
                    name, rows, cols, &values,
                )?))
            }
            RawTensor::Fp8(w) => Ok(RawTensor::Fp8(w)),
            RawTensor::Quantized(q) => Err(already(format!("{:?} (GGUF)", q.dtype()))),
            RawTensor::Int4(_) => Err(already("int4".to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;

    #[test]
    fn spellings_round_trip_and_unknown_ones_are_named() {
        for q in WeightQuantization::ALL {
            assert_eq!(WeightQuantization::parse(q.as_str()).expect("known"), q);
        }
        let e = WeightQuantization::parse("awq")
            .expect_err("unknown")
            .to_string();
        assert!(e.contains("awq") && e.contains("fp8"), "{e}");
    }

    #[test]
    fn only_decoder_projections_are_quantized() {
        assert!(is_decoder_linear("model.layers.0.self_attn.q_proj.weight"));
        assert!(is_decoder_linear("model.layers.27.mlp.down_proj.weight"));
        for other in [
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.input_layernorm.weight",
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers..mlp.up_proj.weight",
            "model.layers.x.mlp.up_proj.weight",
        ] {
            assert!(!is_decoder_linear(other), "{other}");
        }
    }

    /// A source of named tensors, for the wrapper to read, with a checkpoint's `quant_method`.
    struct Tensors(Vec<(&'static str, RawTensor)>, Option<&'static str>);

    impl TensorSource for Tensors {
        fn quant_method(&self) -> Option<&'static str> {
            self.1
        }
        fn names(&self) -> Vec<String> {
            self.0.iter().map(|(n, _)| (*n).to_owned()).collect()
        }
        fn shape(&self, name: &str) -> Option<Vec<usize>> {
            self.0.iter().find(|(n, _)| *n == name).map(|_| vec![])
        }
        fn load(&mut self, name: &str) -> Result<RawTensor> {
            let i = self.0.iter().position(|(n, _)| *n == name).expect("known");
            Ok(self.0.remove(i).1)
        }
    }

    fn dense(rows: usize, cols: usize) -> Tensor {
        let v: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).expect("tensor")
    }

    #[test]
    fn fp8_quantizes_dense_projections_and_leaves_the_rest() {
        let q = "model.layers.0.self_attn.q_proj.weight";
        let narrow = "model.layers.0.mlp.down_proj.weight";
        let head = "lm_head.weight";
        let w = dense(4, 256);
        let mut src = QuantizedAtLoad::new(
            Tensors(
                vec![
                    (q, RawTensor::Dense(w.to_dtype(DType::BF16).expect("bf16"))),
                    (narrow, RawTensor::Dense(dense(4, 96))),
                    (head, RawTensor::Dense(dense(4, 256))),
                ],
                None,
            ),
            WeightQuantization::Fp8,
        );
        let RawTensor::Fp8(got) = src.load(q).expect("load") else {
            panic!("a projection of whole groups is FP8")
        };
        let values = w
            .to_dtype(DType::BF16)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values");
        assert_eq!(
            got,
            Fp8Blocks::quantize_rows(q, 4, 256, &values).expect("quantize")
        );
        assert!(matches!(src.load(narrow), Ok(RawTensor::Dense(_))));
        assert!(matches!(src.load(head), Ok(RawTensor::Dense(_))));
        let mut plain = QuantizedAtLoad::new(
            Tensors(vec![(q, RawTensor::Dense(dense(4, 256)))], None),
            WeightQuantization::None,
        );
        assert!(matches!(plain.load(q), Ok(RawTensor::Dense(_))));
    }

    #[test]
    fn an_already_quantized_projection_is_an_error_naming_it() {
        let name = "model.layers.3.mlp.gate_proj.weight";
        let q = QTensor::quantize(&dense(4, 256), GgmlDType::Q8_0).expect("q8_0");
        let mut src = QuantizedAtLoad::new(
            Tensors(vec![(name, RawTensor::Quantized(q))], None),
            WeightQuantization::Fp8,
        );
        let e = src.load(name).expect_err("refused").to_string();
        assert!(e.contains(name) && e.contains("Q8_0"), "{e}");
        // An AWQ/GPTQ checkpoint is refused by its method, whatever form a layer loads in (a
        // dequantized one included); an FP8 checkpoint's dense layers stay as they are.
        for (method, refused) in [("gptq", true), ("fp8", false)] {
            let mut src = QuantizedAtLoad::new(
                Tensors(vec![(name, RawTensor::Dense(dense(4, 256)))], Some(method)),
                WeightQuantization::Fp8,
            );
            match src.load(name) {
                Err(e) => assert!(refused && e.to_string().contains(method), "{e}"),
                Ok(raw) => assert!(!refused && matches!(raw, RawTensor::Dense(_))),
            }
        }
    }
}
