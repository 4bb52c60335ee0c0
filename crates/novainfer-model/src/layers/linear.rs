//! Matmul weights (`y = x Wᵀ + b`) and token embeddings, dense or GGUF-quantized.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::error::Result;
use crate::layers::qmatmul::PackedMatrix;

enum Weight {
    /// `[out, in]` in the storage dtype; activations are cast to it for the matmul.
    Dense(Tensor),
    /// Quant types with our own kernels (see `qmatmul`).
    Packed(PackedMatrix),
    /// Every other quant type, through candle.
    Quantized(QMatMul),
}

pub struct Linear {
    weight: Weight,
    bias: Option<Vec<f32>>,
    out_features: usize,
    in_features: usize,
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Vec<f32>>) -> Result<Self> {
        let (out_features, in_features) = weight.dims2()?;
        Ok(Self {
            weight: Weight::Dense(weight),
            bias,
            out_features,
            in_features,
        })
    }

    pub fn quantized(weight: Arc<QTensor>, bias: Option<Vec<f32>>) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let weight = match PackedMatrix::from_qtensor(&weight)? {
            Some(packed) => Weight::Packed(packed),
            None => Weight::Quantized(QMatMul::from_arc(weight)?),
        };
        Ok(Self {
            weight,
            bias,
            out_features,
            in_features,
        })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// `x`: `[rows, in]` → `[rows, out]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        debug_assert_eq!(
            x.len(),
            rows * self.in_features,
            "linear input shape: this is a bug"
        );
        let xt = || Tensor::from_slice(x, (rows, self.in_features), &Device::Cpu);
        let mut y = match &self.weight {
            Weight::Packed(w) => w.matmul(x, rows),
            Weight::Quantized(w) => to_vec(w.forward(&xt()?)?)?,
            Weight::Dense(w) if w.dtype() == DType::F32 && w.is_contiguous() => {
                let (storage, layout) = w.storage_and_layout();
                let candle_core::Storage::Cpu(cpu) = &*storage else {
                    unreachable!("weights are loaded on the CPU: this is a bug")
                };
                let data = &cpu.as_slice::<f32>()?[layout.start_offset()..];
                super::dense::matmul_f32(x, rows, data, self.out_features, self.in_features)
            }
            Weight::Dense(w) => to_vec(
                xt()?
                    .to_dtype(w.dtype())?
                    .matmul(&w.t()?)?
                    .to_dtype(DType::F32)?,
            )?,
        };
        self.add_bias(&mut y);
        Ok(y)
    }

    /// `forward` of several layers on the same input: the quantized matmuls share one int8
    /// quantization of `x` and one fork/join of the pool; results equal `forward`'s bit for bit.
    pub fn forward_many(layers: &[&Linear], x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
        let packed: Option<Vec<&PackedMatrix>> = layers
            .iter()
            .map(|l| match &l.weight {
                Weight::Packed(w) => Some(w),
                _ => None,
            })
            .collect();
        let Some(packed) = packed else {
            return layers.iter().map(|l| l.forward(x, rows)).collect();
        };
        let mut outs = super::qmatmul::matmul_many(&packed, x, rows);
        for (l, y) in layers.iter().zip(&mut outs) {
            l.add_bias(y);
        }
        Ok(outs)
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.out_features) {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
        }
    }
}

fn to_vec(t: Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// The token embedding table; its rows are looked up, never multiplied in full.
#[derive(Clone)]
pub enum Embedding {
    Dense(Tensor),
    Quantized(Arc<QTensor>),
}

impl Embedding {
    /// `ids` → `[ids.len(), hidden]` in f32.
    pub fn forward(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
        let rows = match self {
            Embedding::Dense(table) => table.index_select(&ids, 0)?,
            Embedding::Quantized(table) => table.embedding(&ids)?,
        };
        Ok(rows.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The same table as an output projection (tied embeddings).
    pub fn as_linear(&self) -> Result<Linear> {
        match self {
            Embedding::Dense(table) => Linear::dense(table.clone(), None),
            Embedding::Quantized(table) => Linear::quantized(table.clone(), None),
        }
    }
}
