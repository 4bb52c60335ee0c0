//! AWQ and GPTQ layers: their packed tensors unpacked into one form, [`IntMatrix`], which
//! [`repack`] turns into what our CPU kernels run.
//!
//! Both formats store, per linear layer of logical shape `[out, in]`, integers
//! `q ∈ [0, 2^bits)`, and per (group, output channel) an integer zero point `z` and a
//! scale `s`; the weight is `w[o][i] = s[g(i)][o] · (q[o][i] − z[g(i)][o])`. They differ in
//! how the integers are packed into int32 words ([`awq`], [`gptq`]) and how input
//! channels map to groups (contiguous runs, or GPTQ's `g_idx` under act-order).

mod awq;
mod gptq;
mod repack;
#[cfg(test)]
mod tests;

use candle_core::{DType, Tensor};
use half::f16;

use super::quant_config::Bits;
use crate::error::{ModelError, Result};

pub use awq::unpack as unpack_awq;
pub use gptq::unpack as unpack_gptq;
pub use repack::{repack, Repacked};

/// The scales as stored. f16 (what AutoAWQ and AutoGPTQ write) is kept as is, because a
/// GGML block's scale is an f16 and the repacking is exact only then; bf16 and f32 scales
/// are widened to f32 (exactly) and their layers are dequantized instead.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Scales {
    fn len(&self) -> usize {
        match self {
            Scales::F16(v) => v.len(),
            Scales::F32(v) => v.len(),
        }
    }

    fn get(&self, i: usize) -> f32 {
        match self {
            Scales::F16(v) => v[i].to_f32(),
            Scales::F32(v) => v[i],
        }
    }
}

/// One quantized linear layer, unpacked: `w[o][i] = s[g][o] · (q[o][i] − z[g][o])` with
/// `g = group_of[i]`. Built only through [`IntMatrix::new`], which checks every length and
/// range, so code holding one can index without checks failing.
#[derive(Debug, Clone, PartialEq)]
pub struct IntMatrix {
    rows: usize,
    cols: usize,
    bits: Bits,
    /// `[rows, cols]`, each `< 2^bits`.
    q: Vec<u8>,
    /// `[cols]`, each `< groups`.
    group_of: Vec<u32>,
    /// `[groups, rows]`, each `≤ 2^bits` (GPTQ's historical `+1` can reach `2^bits`).
    zeros: Vec<u16>,
    /// `[groups, rows]`.
    scales: Scales,
}

impl IntMatrix {
    /// `name` (the layer's prefix) is for error messages.
    pub fn new(
        name: &str,
        (rows, cols): (usize, usize),
        bits: Bits,
        q: Vec<u8>,
        group_of: Vec<u32>,
        zeros: Vec<u16>,
        scales: Scales,
    ) -> Result<Self> {
        let bad = |reason: String| ModelError::InvalidQuantTensor {
            name: name.to_owned(),
            reason,
        };
        let groups = zeros.len() / rows.max(1);
        if q.len() != rows * cols || group_of.len() != cols {
            return Err(bad(format!(
                "{} weights and {} group indices for a [{rows}, {cols}] matrix",
                q.len(),
                group_of.len()
            )));
        }
        if zeros.len() != groups * rows || scales.len() != groups * rows {
            return Err(bad(format!(
                "{} zero points and {} scales for {rows} output channels",
                zeros.len(),
                scales.len()
            )));
        }
        let max = 1u32 << bits.width();
        if let Some(v) = q.iter().find(|&&v| u32::from(v) >= max) {
            return Err(bad(format!("weight value {v} has more than {max} levels")));
        }
        if let Some(z) = zeros.iter().find(|&&z| u32::from(z) > max) {
            return Err(bad(format!("zero point {z} is above {max}")));
        }
        if let Some(g) = group_of.iter().find(|&&g| g as usize >= groups) {
            return Err(bad(format!(
                "g_idx names group {g} but there are {groups} groups"
            )));
        }
        Ok(Self {
            rows,
            cols,
            bits,
            q,
            group_of,
            zeros,
            scales,
        })
    }

    #[cfg(test)]
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// `q − z` of weight `(o, i)`.
    fn centered(&self, o: usize, i: usize) -> i32 {
        let g = self.group_of[i] as usize;
        i32::from(self.q[o * self.cols + i]) - i32::from(self.zeros[g * self.rows + o])
    }

    fn scale(&self, o: usize, i: usize) -> f32 {
        self.scales.get(self.group_of[i] as usize * self.rows + o)
    }

    /// The weights as f32, `[rows, cols]` row-major: `s · (q − z)` rounded once to f32,
    /// which is exact for f16 and bf16 scales (≤ 11 significant bits times ≤ 9).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for o in 0..self.rows {
            out.extend((0..self.cols).map(|i| self.scale(o, i) * self.centered(o, i) as f32));
        }
        out
    }
}

/// A packed tensor's 32-bit words (int32 as written by PyTorch; uint32 accepted too).
fn words(name: &str, t: &Tensor) -> Result<Vec<u32>> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::I32 => flat
            .to_vec1::<i32>()?
            .into_iter()
            .map(|w| w as u32)
            .collect(),
        DType::U32 => flat.to_vec1::<u32>()?,
        other => {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: format!("{other:?} (packed weights must be int32)"),
            })
        }
    })
}

fn scales(name: &str, t: &Tensor) -> Result<Scales> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F16 => Scales::F16(flat.to_vec1::<f16>()?),
        DType::BF16 | DType::F32 => Scales::F32(flat.to_dtype(DType::F32)?.to_vec1::<f32>()?),
        other => {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: format!("{other:?} (scales must be f16, bf16 or f32)"),
            })
        }
    })
}

/// `t`'s shape, which must be 2-D.
fn dims2(name: &str, t: &Tensor) -> Result<(usize, usize)> {
    match t.dims() {
        &[a, b] => Ok((a, b)),
        other => Err(ModelError::InvalidQuantTensor {
            name: name.to_owned(),
            reason: format!("expected a 2-D tensor, found shape {other:?}"),
        }),
    }
}

fn expect_shape(name: &str, t: &Tensor, expected: [usize; 2]) -> Result<()> {
    if t.dims() != expected {
        return Err(ModelError::ShapeMismatch {
            name: name.to_owned(),
            expected: expected.to_vec(),
            found: t.dims().to_vec(),
        });
    }
    Ok(())
}

/// Extracts value `index` of `bits` width from a word packed low bits first.
fn field(word: u32, index: usize, bits: Bits) -> u32 {
    (word >> (bits.width() as usize * index)) & bits.mask()
}
