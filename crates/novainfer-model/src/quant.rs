//! Load-time conversions between GGUF quant formats.
//!
//! candle has SIMD (and repacked VNNI) kernels for Q8_0 but only a generic path
//! for Q5_0. Q5_0 and Q8_0 share the 32-value block and the f16 scale, and Q5_0's
//! integers (-16..=15) fit in an i8, so re-encoding Q5_0 as Q8_0 is exact: the
//! dequantized weights are bit-identical while matmuls take candle's Q8_0 path.
//! It costs 34/22 of the bytes for those tensors. On x86-64 our own kernels
//! (`layers::qmatmul`) handle Q5_0 natively, so this matters only for the
//! candle fallback.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;

use crate::error::Result;

const QK: usize = 32;
const Q5_0_BLOCK_BYTES: usize = 2 + 4 + QK / 2;
const Q8_0_BLOCK_BYTES: usize = 2 + QK;

/// Returns `t` re-encoded as Q8_0 when that is lossless, else `t` unchanged.
pub fn to_fast_format(t: QTensor) -> Result<QTensor> {
    if t.dtype() != GgmlDType::Q5_0 {
        return Ok(t);
    }
    let q8 = q5_0_to_q8_0(&t.data()?);
    let storage = QStorage::from_data(Cow::Owned(q8), &Device::Cpu, GgmlDType::Q8_0)?;
    Ok(QTensor::new(storage, t.shape().clone())?)
}

/// Re-encodes ggml Q5_0 blocks (`d: f16, qh: u32, qs: [u8; 16]`) as Q8_0 blocks (`d: f16, qs: [i8; 32]`).
fn q5_0_to_q8_0(q5: &[u8]) -> Vec<u8> {
    let blocks = q5.len() / Q5_0_BLOCK_BYTES;
    let mut out = Vec::with_capacity(blocks * Q8_0_BLOCK_BYTES);
    for block in q5.chunks_exact(Q5_0_BLOCK_BYTES) {
        let (d, rest) = block.split_at(2);
        let (qh, qs) = rest.split_at(4);
        let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
        out.extend_from_slice(d);
        // Value j lives in the low nibble of qs[j] (j < 16) or the high nibble of
        // qs[j - 16], with its fifth bit at bit j of qh; stored offset by +16.
        let value = |j: usize| -> u8 {
            let nibble = if j < QK / 2 {
                qs[j] & 0x0F
            } else {
                qs[j - QK / 2] >> 4
            };
            let high = ((qh >> j) & 1) as u8;
            ((nibble | (high << 4)) as i8 - 16) as u8
        };
        out.extend((0..QK).map(value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn q5_0_to_q8_0_is_bit_exact() {
        let values: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let t = Tensor::from_vec(values, (32, 128), &Device::Cpu).expect("tensor");
        let q5 = QTensor::quantize(&t, GgmlDType::Q5_0).expect("quantize");
        let before = q5
            .dequantize(&Device::Cpu)
            .expect("dequantize")
            .flatten_all()
            .expect("flat");
        let q8 = to_fast_format(q5).expect("convert");
        assert_eq!(q8.dtype(), GgmlDType::Q8_0);
        let after = q8
            .dequantize(&Device::Cpu)
            .expect("dequantize")
            .flatten_all()
            .expect("flat");
        let (b, a) = (
            before.to_vec1::<f32>().expect("vec"),
            after.to_vec1::<f32>().expect("vec"),
        );
        assert!(
            b.iter().zip(&a).all(|(x, y)| x.to_bits() == y.to_bits()),
            "dequantized values differ"
        );
    }
}
