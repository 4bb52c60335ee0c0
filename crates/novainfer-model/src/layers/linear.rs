//! Matmul weights (`y = x Wᵀ + b`) and token embeddings, dense or GGUF-quantized.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::error::Result;
use crate::layers::qmatmul::{PackedMatrix, MAX_MANY};

enum Weight {
    /// `[out, in]` in the storage dtype; activations are cast to it for the matmul.
    Dense(Tensor),
    /// Quant types with our own kernels (see `qmatmul`); with an input order (GPTQ act-order),
    /// input channel `order[j]` meets the matrix's column `j`.
    Packed(PackedMatrix, Option<Arc<[u32]>>),
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
            Some(packed) => Weight::Packed(packed, None),
            None => Weight::Quantized(QMatMul::from_arc(weight)?),
        };
        Ok(Self {
            weight,
            bias,
            out_features,
            in_features,
        })
    }

    /// An AWQ/GPTQ int4 layer: packed for our kernels, or without them (off x86-64, no
    /// AVX2) dequantized to dense f32, exactly.
    pub fn int4(weight: &crate::int4::GroupedInt4, bias: Option<Vec<f32>>) -> Result<Self> {
        match PackedMatrix::from_int4(weight) {
            Some(packed) => Ok(Self {
                out_features: weight.rows(),
                in_features: weight.cols(),
                weight: Weight::Packed(packed, weight.input_order().cloned()),
                bias,
            }),
            None => {
                let shape = (weight.rows(), weight.cols());
                Self::dense(
                    Tensor::from_vec(weight.dequantize(), shape, &Device::Cpu)?,
                    bias,
                )
            }
        }
    }

    /// This layer with a dense weight quantized to Q8_0 (lossy: each weight within half a
    /// step of its 32-weight block's `amax/127`); a quantized weight is returned as it is.
    pub fn dense_to_q8_0(self) -> Result<Self> {
        let Weight::Dense(w) = &self.weight else {
            return Ok(self);
        };
        let q = QTensor::quantize(&w.to_dtype(DType::F32)?, GgmlDType::Q8_0)?;
        Self::quantized(Arc::new(q), self.bias)
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes a product with this layer reads from memory for its weights and bias: what
    /// bounds a single-row (decode) product, which uses each weight once.
    pub fn weight_bytes(&self) -> usize {
        let weight = match &self.weight {
            Weight::Packed(w, order) => {
                w.storage_bytes() + order.as_ref().map_or(0, |o| o.len() * 4)
            }
            Weight::Quantized(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Weight::Dense(t)
            | Weight::Quantized(QMatMul::Tensor(t))
            | Weight::Quantized(QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        };
        weight + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// `x`: `[rows, in]` → `[rows, out]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut y = Vec::new();
        self.forward_into(x, rows, &mut y)?;
        Ok(y)
    }

    /// [`Self::forward`] into `y` (its capacity reused). Our packed kernels and the dense
    /// f32/bf16/f16 path allocate nothing for a decode row once `y` has grown (several rows of
    /// 16-bit weights widen into a scratch row per pool thread and call); candle's path (other
    /// quant types) allocates its tensors.
    pub fn forward_into(&self, x: &[f32], rows: usize, y: &mut Vec<f32>) -> Result<()> {
        debug_assert_eq!(
            x.len(),
            rows * self.in_features,
            "linear input shape: this is a bug"
        );
        let xt = || Tensor::from_slice(x, (rows, self.in_features), &Device::Cpu);
        match &self.weight {
            Weight::Packed(w, None) => w.matmul_into(x, rows, y),
            Weight::Packed(w, Some(order)) => {
                with_input_order(x, rows, order, |x| w.matmul_into(x, rows, y))
            }
            Weight::Quantized(w) => *y = to_vec(w.forward(&xt()?)?)?,
            Weight::Dense(w)
                if matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
                    && w.is_contiguous() =>
            {
                let (storage, layout) = w.storage_and_layout();
                let candle_core::Storage::Cpu(cpu) = &*storage else {
                    unreachable!("weights are loaded on the CPU: this is a bug")
                };
                let (start, n, k) = (layout.start_offset(), self.out_features, self.in_features);
                // Our kernel for every float dtype: 16-bit weights widen exactly in it, so
                // they give the f32 path's bits at half the bytes.
                match w.dtype() {
                    DType::BF16 => {
                        let data = &cpu.as_slice::<half::bf16>()?[start..];
                        super::dense::matmul_into(x, rows, data, n, k, y)
                    }
                    DType::F16 => {
                        let data = &cpu.as_slice::<half::f16>()?[start..];
                        super::dense::matmul_into(x, rows, data, n, k, y)
                    }
                    _ => {
                        let data = &cpu.as_slice::<f32>()?[start..];
                        super::dense::matmul_into(x, rows, data, n, k, y)
                    }
                }
            }
            Weight::Dense(w) => {
                *y = to_vec(
                    xt()?
                        .to_dtype(w.dtype())?
                        .matmul(&w.t()?)?
                        .to_dtype(DType::F32)?,
                )?
            }
        }
        self.add_bias(y);
        Ok(())
    }

    /// `forward` of several layers on the same input: the quantized matmuls share one int8
    /// quantization of `x` and one fork/join of the pool; results equal `forward`'s bit for bit.
    pub fn forward_many(layers: &[&Linear], x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
        let mut outs: Vec<Vec<f32>> = layers.iter().map(|_| Vec::new()).collect();
        let mut refs: Vec<&mut Vec<f32>> = outs.iter_mut().collect();
        Self::forward_many_into(layers, x, rows, &mut refs)?;
        Ok(outs)
    }

    /// [`Self::forward_many`] into `outs` (at most [`MAX_MANY`] layers; capacities reused).
    pub fn forward_many_into(
        layers: &[&Linear],
        x: &[f32],
        rows: usize,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<()> {
        let mut packed: [Option<&PackedMatrix>; MAX_MANY] = [None; MAX_MANY];
        let mut orders = layers.iter().map(|l| match &l.weight {
            Weight::Packed(_, order) => order.as_deref(),
            _ => None,
        });
        let order = orders.next().flatten();
        // One input order for all (GPTQ act-order sorts Q, K and V, or gate and up, by the same
        // input statistics, so they share it), or the products run one by one.
        let one_order = orders.all(|o| o == order);
        let all_packed = one_order
            && layers.len() <= MAX_MANY
            && layers
                .iter()
                .zip(&mut packed)
                .all(|(l, p)| match &l.weight {
                    Weight::Packed(w, _) => {
                        *p = Some(w);
                        true
                    }
                    _ => false,
                });
        if !all_packed {
            for (l, y) in layers.iter().zip(outs.iter_mut()) {
                l.forward_into(x, rows, y)?;
            }
            return Ok(());
        }
        let mut mats: [&PackedMatrix; MAX_MANY] =
            [packed[0].expect("at least one layer"); MAX_MANY];
        for (m, p) in mats.iter_mut().zip(&packed) {
            if let Some(p) = p {
                *m = p;
            }
        }
        let mats = &mats[..layers.len()];
        match order {
            None => super::qmatmul::matmul_many_into(mats, x, rows, outs),
            Some(order) => with_input_order(x, rows, order, |x| {
                super::qmatmul::matmul_many_into(mats, x, rows, outs)
            }),
        }
        for (l, y) in layers.iter().zip(outs.iter_mut()) {
            l.add_bias(y);
        }
        Ok(())
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.out_features) {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
        }
    }
}

thread_local! {
    /// Inputs permuted for a product with an input order, reused so that a decode step
    /// allocates nothing once it has grown.
    static PERMUTED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `x` (`rows` rows) with row element `j` taken from `order[j]`.
fn with_input_order(x: &[f32], rows: usize, order: &[u32], f: impl FnOnce(&[f32])) {
    PERMUTED.with(|cell| {
        // A nested call (none today) would find the buffer taken: it gets its own.
        let mut own = Vec::new();
        let mut borrowed = cell.try_borrow_mut();
        let buf = match borrowed.as_deref_mut() {
            Ok(buf) => buf,
            Err(_) => &mut own,
        };
        buf.clear();
        for row in x.chunks_exact(order.len()).take(rows) {
            buf.extend(order.iter().map(|&i| row[i as usize]));
        }
        f(buf)
    })
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
        let mut out = Vec::new();
        self.forward_into(ids, &mut out)?;
        Ok(out)
    }

    /// [`Self::forward`] into `out` (its capacity reused). Rows of a dense f32/f16/bf16 table
    /// are copied without allocating; quantized tables go through candle's dequantization.
    pub fn forward_into(&self, ids: &[u32], out: &mut Vec<f32>) -> Result<()> {
        if let Embedding::Dense(table) = self {
            if table.is_contiguous() {
                let (vocab, hidden) = table.dims2()?;
                let (storage, layout) = table.storage_and_layout();
                if let candle_core::Storage::Cpu(cpu) = &*storage {
                    let start = layout.start_offset();
                    // Ids were range-checked by the caller; a bad one is a bug, not user input.
                    let row = |id: u32| {
                        let r = id as usize;
                        assert!(r < vocab, "token id {id} out of range: this is a bug");
                        start + r * hidden..start + (r + 1) * hidden
                    };
                    out.clear();
                    match table.dtype() {
                        DType::F32 => {
                            let data = cpu.as_slice::<f32>()?;
                            ids.iter()
                                .for_each(|&id| out.extend_from_slice(&data[row(id)]));
                            return Ok(());
                        }
                        DType::F16 => {
                            let data = cpu.as_slice::<half::f16>()?;
                            ids.iter().for_each(|&id| {
                                out.extend(data[row(id)].iter().map(|v| v.to_f32()))
                            });
                            return Ok(());
                        }
                        DType::BF16 => {
                            let data = cpu.as_slice::<half::bf16>()?;
                            ids.iter().for_each(|&id| {
                                out.extend(data[row(id)].iter().map(|v| v.to_f32()))
                            });
                            return Ok(());
                        }
                        _ => {}
                    }
                }
            }
        }
        *out = self.forward_candle(ids)?;
        Ok(())
    }

    fn forward_candle(&self, ids: &[u32]) -> Result<Vec<f32>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int4::GroupedInt4;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 2654435761 + seed * 40503) % 10007) as f32 / 10007.0 - 0.5) * 2.0)
            .collect()
    }

    /// Act-order int4 layers permute their input: alone, each equals the product with its
    /// logical (dequantized) weights up to the activation rounding; together, layers sharing
    /// an order share one permuted, quantized input and give each one's bits, and a layer with
    /// another order in the set sends them one by one with the same results.
    #[test]
    fn int4_layers_with_an_input_order_multiply_in_channel_order() {
        let k = 384;
        let order: Vec<u32> = (0..k as u32).map(|j| (j * 173) % k as u32).collect();
        let other: Vec<u32> = (0..k as u32).rev().collect();
        let layer = |n: usize, seed: usize, order: &[u32]| {
            let w = GroupedInt4::quantize(n, k, &values(n * k, seed)).expect("quantize");
            let w = w
                .with_input_order("t", order.to_vec())
                .expect("a permutation");
            let dense = w.dequantize();
            (Linear::int4(&w, None).expect("linear"), dense)
        };
        let (a, wa) = layer(40, 1, &order);
        let (b, _) = layer(24, 2, &order);
        let (c, _) = layer(17, 3, &other);
        let rows = 3;
        let x = values(rows * k, 9);
        let ya = a.forward(&x, rows).expect("a");
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            for o in 0..40 {
                let exact: f32 = wa[o * k..(o + 1) * k]
                    .iter()
                    .zip(xr)
                    .map(|(w, v)| w * v)
                    .sum();
                let scale: f32 = wa[o * k..(o + 1) * k]
                    .iter()
                    .zip(xr)
                    .map(|(w, v)| (w * v).abs())
                    .sum();
                let got = ya[r * 40 + o];
                assert!(
                    (got - exact).abs() <= 0.01 * scale,
                    "({r},{o}): {got} vs {exact}"
                );
            }
        }
        let alone: Vec<Vec<f32>> = [&a, &b, &c]
            .iter()
            .map(|l| l.forward(&x, rows).expect("alone"))
            .collect();
        assert_eq!(
            Linear::forward_many(&[&a, &b], &x, rows).expect("shared"),
            alone[..2]
        );
        assert_eq!(
            Linear::forward_many(&[&a, &b, &c], &x, rows).expect("mixed"),
            alone
        );
    }
}
