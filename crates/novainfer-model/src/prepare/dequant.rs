//! The CPU twin of the device's GGUF → bf16 expansion (`kernels/dequant.cu`).
//!
//! Each value is computed in f32 with candle's operations in candle's order (so it equals
//! `QTensor::dequantize` exactly: Rust never contracts `a * b - c` into an FMA, and the
//! kernel spells every operation with an `_rn` intrinsic), then rounded once to bf16 by
//! round-to-nearest-even (`half::bf16::from_f32`, NaN kept quiet), as the kernel's
//! `f32_to_bf16` does. The twin indexes a block the way the kernel does (one value at a
//! time) rather than the way candle loops, so a test against candle checks the kernel's
//! indexing too; a GPU parity test compares the kernel to [`dequantize_bf16`].

use candle_core::quantized::GgmlDType;
use half::{bf16, f16};

use novainfer_cuda::quant_type::scale_min_k4;

use crate::error::{ModelError, Result};

/// The block formats the GPU expands (and, with `gpu_weight_dtype="native"`, multiplies)
/// itself: the GGUF types of the demo models, AWQ/GPTQ grouped int4 and FP8 blocks. The device's own enum,
/// shared with its launchers; every other GGUF type is dequantized on the host by candle.
pub use novainfer_cuda::quant_type::QuantType as GpuQuant;

/// The GGUF ones.
pub const GGUF_KINDS: [GpuQuant; 4] =
    [GpuQuant::Q4K, GpuQuant::Q5_0, GpuQuant::Q6K, GpuQuant::Q8_0];

/// The device's format for a GGUF type, if it has one.
pub fn gpu_quant_of(dtype: GgmlDType) -> Option<GpuQuant> {
    match dtype {
        GgmlDType::Q4K => Some(GpuQuant::Q4K),
        GgmlDType::Q5_0 => Some(GpuQuant::Q5_0),
        GgmlDType::Q6K => Some(GpuQuant::Q6K),
        GgmlDType::Q8_0 => Some(GpuQuant::Q8_0),
        _ => None,
    }
}

/// The GGUF type of a device format (`None` for int4 and FP8).
pub fn ggml_of(kind: GpuQuant) -> Option<GgmlDType> {
    match kind {
        GpuQuant::Q4K => Some(GgmlDType::Q4K),
        GpuQuant::Q5_0 => Some(GgmlDType::Q5_0),
        GpuQuant::Q6K => Some(GgmlDType::Q6K),
        GpuQuant::Q8_0 => Some(GgmlDType::Q8_0),
        GpuQuant::Int4 | GpuQuant::Fp8 => None,
    }
}

/// One value of a block, in f32, exactly as candle (int4: `GroupedInt4::dequantize`) computes it.
fn value(kind: GpuQuant, block: &[u8], e: usize) -> f32 {
    match kind {
        GpuQuant::Int4 => crate::int4::block_value(block, e),
        GpuQuant::Fp8 => crate::fp8_blocks::block_value(block, e),
        GpuQuant::Q8_0 => f32::from(block[2 + e] as i8) * f16_at(block, 0),
        GpuQuant::Q5_0 => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let qs = &block[6..22];
            let low = if e < 16 {
                qs[e] & 0x0F
            } else {
                qs[e - 16] >> 4
            };
            let high = (((qh >> e) & 1) << 4) as u8;
            (i32::from(low | high) - 16) as f32 * f16_at(block, 0)
        }
        GpuQuant::Q4K => {
            let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
            let (scales, qs) = (&block[4..16], &block[16..144]);
            let (chunk, idx) = (e / 64, e % 64);
            let sub = 2 * chunk + usize::from(idx >= 32);
            let byte = qs[32 * chunk + idx % 32];
            let q = if idx < 32 { byte & 0x0F } else { byte >> 4 };
            let (sc, m) = scale_min_k4(sub, scales);
            let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
            d1 * f32::from(q) - m1
        }
        GpuQuant::Q6K => {
            let (ql, qh) = (&block[..128], &block[128..192]);
            let scale = |i: usize| f32::from(block[192 + i] as i8);
            let d = f16_at(block, 208);
            let (h, g, l) = (e / 128, e % 128 / 32, e % 32);
            let low_byte = ql[64 * h + l + if g & 1 == 1 { 32 } else { 0 }];
            let low = if g < 2 {
                low_byte & 0x0F
            } else {
                low_byte >> 4
            };
            let high = (qh[32 * h + l] >> (2 * g)) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            d * scale(8 * h + l / 16 + 2 * g) * q as f32
        }
    }
}

fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// `blocks` (whole GGUF blocks of `kind`, back to back) → bf16 values, as the GPU does it.
pub fn dequantize_bf16(kind: GpuQuant, blocks: &[u8]) -> Result<Vec<bf16>> {
    let (bytes, values) = (kind.block_bytes(), kind.block_values());
    if !blocks.len().is_multiple_of(bytes) {
        return Err(ModelError::Compute(candle_core::Error::Msg(format!(
            "{} bytes is not a whole number of {kind:?} blocks of {bytes} bytes",
            blocks.len()
        ))));
    }
    let mut out = Vec::with_capacity(blocks.len() / bytes * values);
    for block in blocks.chunks_exact(bytes) {
        out.extend((0..values).map(|e| bf16::from_f32(value(kind, block, e))));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use candle_core::quantized::{QStorage, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{RngExt, SeedableRng};

    use super::*;

    /// candle's dequantize, rounded to bf16 by the stated rule.
    fn candle_bf16(q: &QTensor) -> Vec<u16> {
        q.dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("candle dequantize")
            .into_iter()
            .map(|v| bf16::from_f32(v).to_bits())
            .collect()
    }

    fn twin_bits(kind: GpuQuant, q: &QTensor) -> Vec<u16> {
        let data = q.data().expect("raw bytes");
        dequantize_bf16(kind, &data)
            .expect("whole blocks")
            .into_iter()
            .map(bf16::to_bits)
            .collect()
    }

    fn assert_same(kind: GpuQuant, q: &QTensor, what: &str) {
        let (want, got) = (candle_bf16(q), twin_bits(kind, q));
        assert_eq!(want.len(), got.len());
        if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
            panic!(
                "{kind:?} ({what}) value {i}: twin {:#06x}, candle {:#06x}",
                got[i], want[i]
            );
        }
    }

    #[test]
    fn the_twin_equals_candle_rounded_to_bf16_on_quantized_weights() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (rows, cols) = (8, 512);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-1.0f32..1.0) * if i % 97 == 0 { 8.0 } else { 0.5 })
            .collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        for kind in GGUF_KINDS {
            let q = QTensor::quantize(&t, ggml_of(kind).expect("gguf")).expect("quantize");
            assert_same(kind, &q, "quantized from f32");
        }
    }

    #[test]
    fn the_device_int4_block_is_grouped_int4s() {
        assert_eq!(GpuQuant::Int4.block_bytes(), crate::int4::BLOCK_BYTES);
        assert_eq!(GpuQuant::Int4.block_values(), crate::int4::GROUP_K);
    }

    #[test]
    fn the_int4_twin_equals_grouped_int4_rounded_to_bf16() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        let (rows, cols) = (5, 384);
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let w = crate::int4::GroupedInt4::quantize(rows, cols, &values).expect("quantize");
        let want: Vec<u16> = w
            .dequantize()
            .into_iter()
            .map(|v| bf16::from_f32(v).to_bits())
            .collect();
        let got: Vec<u16> = dequantize_bf16(GpuQuant::Int4, w.blocks())
            .expect("whole blocks")
            .into_iter()
            .map(bf16::to_bits)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_fp8_twin_equals_fp8_blocks_rounded_to_bf16() {
        assert_eq!(GpuQuant::Fp8.block_bytes(), crate::fp8_blocks::BLOCK_BYTES);
        assert_eq!(GpuQuant::Fp8.block_values(), crate::fp8_blocks::GROUP_K);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let (rows, cols) = (5, 384);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-1.0f32..1.0) * if i % 61 == 0 { 30.0 } else { 0.2 })
            .collect();
        let w = crate::fp8_blocks::Fp8Blocks::quantize_rows("w", rows, cols, &values)
            .expect("quantize");
        let want: Vec<u16> = w
            .dequantize()
            .into_iter()
            .map(|v| bf16::from_f32(v).to_bits())
            .collect();
        let got: Vec<u16> = dequantize_bf16(GpuQuant::Fp8, w.blocks())
            .expect("whole blocks")
            .into_iter()
            .map(bf16::to_bits)
            .collect();
        assert_eq!(got, want);
    }

    /// Arbitrary block bytes reach every bit pattern of every field (negative Q6_K scales,
    /// all 6-bit Q4_K scales and mins, both nibbles, every qh bit); only the f16 block scales
    /// are kept finite, as in any real checkpoint (a NaN scale's payload is the GPU's own).
    #[test]
    fn the_twin_equals_candle_rounded_to_bf16_on_arbitrary_blocks() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for kind in GGUF_KINDS {
            let num_blocks = 64;
            let mut bytes: Vec<u8> = (0..num_blocks * kind.block_bytes())
                .map(|_| rng.random())
                .collect();
            let scale_offsets: &[usize] = match kind {
                GpuQuant::Q8_0 | GpuQuant::Q5_0 => &[0],
                GpuQuant::Q4K => &[0, 2],
                GpuQuant::Q6K => &[208],
                GpuQuant::Int4 | GpuQuant::Fp8 => unreachable!("GGUF types only"),
            };
            for block in bytes.chunks_exact_mut(kind.block_bytes()) {
                for &at in scale_offsets {
                    let d = f16::from_f32(rng.random_range(-0.05f32..0.05));
                    block[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
            let storage = QStorage::from_data(
                Cow::Owned(bytes),
                &Device::Cpu,
                ggml_of(kind).expect("gguf"),
            )
            .expect("storage");
            let q = QTensor::new(storage, (num_blocks, kind.block_values())).expect("qtensor");
            assert_same(kind, &q, "arbitrary bytes");
        }
    }

    #[test]
    fn a_partial_block_is_an_error() {
        assert!(dequantize_bf16(GpuQuant::Q8_0, &[0u8; 35]).is_err());
        assert!(dequantize_bf16(GpuQuant::Q8_0, &[])
            .expect("empty")
            .is_empty());
    }
}
