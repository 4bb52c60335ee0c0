//! 4-bit weights with one scale and one integer zero point per 128 input channels of a row:
//! `w[o][i] = s[o][g] · (q[o][i] − z[o][g])`, `g = i / 128`. This is the form AWQ and GPTQ
//! int4 layers (group size 128, the size Qwen publishes, or any multiple of it, or one
//! group per row) take after loading, at 4 + 40/128 ≈ 4.3 bits per weight, exactly: the
//! integers are the checkpoint's and the scale is held in f32 (f16, bf16 and f32 scales all
//! widen to it exactly).
//!
//! The CPU repacks it for its int8-activation kernels (`layers::qmatmul`), whose integer
//! sums take the zero point exactly (`Σ q·a − z·Σa`); the GPU expands it to bf16.
//!
//! GPTQ's act-order (`desc_act`) assigns input channels to groups out of order (`g_idx`); such a
//! layer is stored with its columns sorted by group and an [input order](GroupedInt4::input_order)
//! saying which input channel each stored column is: the product permutes its input the same
//! way (`W x = W' x'` with `x'[j] = x[order[j]]`), the weights stay 4-bit.
//!
//! Block layout, one per (row, group), [`BLOCK_BYTES`] bytes:
//! ```text
//! [ s: f32 LE ][ z: u8 ][ 4 sub-blocks × 16 bytes ]
//!   sub-block t covers channels 32t..32t+31 of the group; its byte j holds channel
//!   32t + j in the low nibble and 32t + 16 + j in the high one (ggml's Q4_0 order)
//! ```

use std::sync::Arc;

use crate::error::{ModelError, Result};

/// Input channels per group.
pub const GROUP_K: usize = 128;
/// Bytes of one (row, group) block.
pub const BLOCK_BYTES: usize = 4 + 1 + GROUP_K / 2;
/// Offset of the nibbles in a block.
const QS: usize = 5;
/// Largest zero point: GPTQ's historical `+1` convention reaches `2^4`.
pub const MAX_ZERO: u8 = 16;

/// A `[rows, cols]` matrix of 4-bit weights in groups of [`GROUP_K`] input channels. Built
/// only through [`GroupedInt4::from_blocks`], which checks the shape and every zero point.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupedInt4 {
    rows: usize,
    cols: usize,
    /// `[rows, cols / GROUP_K]` blocks of [`BLOCK_BYTES`], columns in stored order.
    blocks: Vec<u8>,
    /// Stored column `j` is input channel `order[j]`; `None`: the identity.
    order: Option<Arc<[u32]>>,
}

impl GroupedInt4 {
    /// `name` is for error messages.
    pub fn from_blocks(name: &str, rows: usize, cols: usize, blocks: Vec<u8>) -> Result<Self> {
        let bad = |reason: String| ModelError::InvalidQuantTensor {
            name: name.to_owned(),
            reason,
        };
        if !cols.is_multiple_of(GROUP_K) {
            return Err(bad(format!(
                "{cols} input channels are not whole groups of {GROUP_K}"
            )));
        }
        if blocks.len() != rows * (cols / GROUP_K) * BLOCK_BYTES {
            return Err(bad(format!(
                "{} bytes of int4 blocks for a [{rows}, {cols}] matrix",
                blocks.len()
            )));
        }
        if let Some(block) = blocks
            .chunks_exact(BLOCK_BYTES)
            .find(|b| b[4] > MAX_ZERO || !scale_of(b).is_finite())
        {
            return Err(bad(format!(
                "a group has zero point {} and scale {}",
                block[4],
                scale_of(block)
            )));
        }
        Ok(Self {
            rows,
            cols,
            blocks,
            order: None,
        })
    }

    /// This matrix with stored column `j` being input channel `order[j]` (a permutation of
    /// `0..cols`, checked; the identity is dropped).
    pub fn with_input_order(mut self, name: &str, order: Vec<u32>) -> Result<Self> {
        let mut seen = vec![false; self.cols];
        let is_permutation = order.len() == self.cols
            && order.iter().all(|&i| {
                (i as usize) < self.cols && !std::mem::replace(&mut seen[i as usize], true)
            });
        if !is_permutation {
            return Err(ModelError::InvalidQuantTensor {
                name: name.to_owned(),
                reason: format!("the input order is not a permutation of 0..{}", self.cols),
            });
        }
        let identity = order.iter().enumerate().all(|(j, &i)| i as usize == j);
        self.order = (!identity).then(|| order.into());
        Ok(self)
    }

    /// Which input channel each stored column is, when not the identity.
    pub fn input_order(&self) -> Option<&Arc<[u32]>> {
        self.order.as_ref()
    }

    /// Quantizes `values` (`[rows, cols]`) with each group's minimum and maximum
    /// (asymmetric, as AWQ does) and an f16 scale, as a checkpoint would hold it. For tests
    /// and kernel timing; loading never requantizes.
    pub fn quantize(rows: usize, cols: usize, values: &[f32]) -> Result<Self> {
        assert_eq!(values.len(), rows * cols, "quantize: shape");
        let mut blocks = Vec::with_capacity(rows * (cols / GROUP_K) * BLOCK_BYTES);
        for group in values.chunks_exact(GROUP_K) {
            let lo = group.iter().fold(0f32, |a, &v| a.min(v));
            let hi = group.iter().fold(0f32, |a, &v| a.max(v));
            let s = half::f16::from_f32((hi - lo) / 15.0).to_f32();
            let z = if s > 0.0 {
                (-lo / s).round().clamp(0.0, 15.0)
            } else {
                0.0
            };
            let q: Vec<u8> = group
                .iter()
                .map(|&v| match s > 0.0 {
                    true => (v / s + z).round().clamp(0.0, 15.0) as u8,
                    false => z as u8,
                })
                .collect();
            blocks.extend_from_slice(&s.to_le_bytes());
            blocks.push(z as u8);
            blocks.extend(encode_nibbles(&q));
        }
        Self::from_blocks("quantize", rows, cols, blocks)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The blocks, row by row, groups in order.
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }

    /// `(s, z, q)` of row `o`, stored column `j`.
    pub fn stored_parts(&self, o: usize, j: usize) -> (f32, u8, u8) {
        let block = self.block(o, j / GROUP_K);
        (scale_of(block), block[4], nibble(block, j % GROUP_K))
    }

    fn block(&self, o: usize, g: usize) -> &[u8] {
        let at = (o * (self.cols / GROUP_K) + g) * BLOCK_BYTES;
        &self.blocks[at..at + BLOCK_BYTES]
    }

    /// The weights as f32, `[rows, cols]` in input-channel order: `s · (q − z)` rounded once,
    /// exact for scales of up to 19 significant bits (f16 and bf16 ones; the integer has at
    /// most 5).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for block in self.blocks.chunks_exact(BLOCK_BYTES) {
            out.extend((0..GROUP_K).map(|j| block_value(block, j)));
        }
        match &self.order {
            Some(order) => in_input_order(&out, order),
            None => out,
        }
    }
}

/// Rows of `stored` (`order.len()` values each, stored column `j` being input channel
/// `order[j]`) with their columns put back in input-channel order.
pub fn in_input_order<T: Copy + Default>(stored: &[T], order: &[u32]) -> Vec<T> {
    let mut out = vec![T::default(); stored.len()];
    for (dst, src) in out
        .chunks_exact_mut(order.len())
        .zip(stored.chunks_exact(order.len()))
    {
        for (&i, &v) in order.iter().zip(src) {
            dst[i as usize] = v;
        }
    }
    out
}

/// Weight `j` (0..128) of a block: `s · (q − z)`, rounded once (what every reader of the blocks,
/// the GPU's expansion included, computes).
pub fn block_value(block: &[u8], j: usize) -> f32 {
    scale_of(block) * (i32::from(nibble(block, j)) - i32::from(block[4])) as f32
}

fn scale_of(block: &[u8]) -> f32 {
    f32::from_le_bytes([block[0], block[1], block[2], block[3]])
}

/// Channel `j` (0..128) of a block.
fn nibble(block: &[u8], j: usize) -> u8 {
    let (t, c) = (j / 32, j % 32);
    let byte = block[QS + 16 * t + c % 16];
    if c < 16 {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// A group's 128 integers (each < 16) in the block's nibble order.
pub fn encode_nibbles(q: &[u8]) -> [u8; GROUP_K / 2] {
    debug_assert!(q.len() == GROUP_K && q.iter().all(|&v| v < 16));
    std::array::from_fn(|b| {
        let (t, j) = (b / 16, b % 16);
        q[32 * t + j] | (q[32 * t + 16 + j] << 4)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_through_the_nibble_order() {
        let q: Vec<u8> = (0..GROUP_K).map(|i| (i * 7 % 16) as u8).collect();
        let mut block = Vec::from(0.25f32.to_le_bytes());
        block.push(3);
        block.extend(encode_nibbles(&q));
        let m = GroupedInt4::from_blocks("t", 1, GROUP_K, block).expect("valid");
        for (i, &v) in q.iter().enumerate() {
            assert_eq!(m.stored_parts(0, i), (0.25, 3, v));
        }
        let want: Vec<f32> = q.iter().map(|&v| 0.25 * (f32::from(v) - 3.0)).collect();
        assert_eq!(m.dequantize(), want);
    }

    #[test]
    fn an_input_order_puts_each_stored_column_back_in_its_channel() {
        let values: Vec<f32> = (0..2 * 256).map(|i| (i % 29) as f32 - 14.0).collect();
        let m = GroupedInt4::quantize(2, 256, &values).expect("quantize");
        let stored = m.dequantize();
        let order: Vec<u32> = (0..256u32).map(|j| (j * 7) % 256).collect();
        let p = m
            .clone()
            .with_input_order("w", order.clone())
            .expect("a permutation");
        let logical = p.dequantize();
        for o in 0..2 {
            for (j, &i) in order.iter().enumerate() {
                assert_eq!(logical[o * 256 + i as usize], stored[o * 256 + j]);
            }
        }
        let identity = m
            .clone()
            .with_input_order("w", (0..256).collect())
            .expect("valid");
        assert!(identity.input_order().is_none());
        let mut twice = order;
        twice[1] = twice[0];
        let e = m
            .with_input_order("w", twice)
            .expect_err("not a permutation");
        assert!(e.to_string().contains("permutation"), "{e}");
    }

    #[test]
    fn bad_shapes_and_zero_points_are_errors() {
        let block = |z: u8, s: f32| {
            let mut b = Vec::from(s.to_le_bytes());
            b.push(z);
            b.extend([0u8; GROUP_K / 2]);
            b
        };
        let err = |r: Result<GroupedInt4>| r.expect_err("invalid").to_string();
        assert!(err(GroupedInt4::from_blocks("w", 1, 64, block(0, 1.0))).contains("whole groups"));
        assert!(err(GroupedInt4::from_blocks("w", 2, 128, block(0, 1.0))).contains("bytes"));
        assert!(
            err(GroupedInt4::from_blocks("w", 1, 128, block(17, 1.0))).contains("zero point 17")
        );
        assert!(err(GroupedInt4::from_blocks("w", 1, 128, block(0, f32::NAN))).contains("NaN"));
        assert!(GroupedInt4::from_blocks("w", 1, 128, block(16, 1.0)).is_ok());
    }

    #[test]
    fn quantizing_keeps_each_value_within_half_a_step() {
        let values: Vec<f32> = (0..3 * 256)
            .map(|i| ((i * 37 % 101) as f32 - 40.0) / 50.0)
            .collect();
        let m = GroupedInt4::quantize(3, 256, &values).expect("quantize");
        for (i, (&v, w)) in values.iter().zip(m.dequantize()).enumerate() {
            let (s, _, _) = m.stored_parts(i / 256, i % 256);
            // Half a step, and the f16 rounding of the scale (≤ 15·2⁻¹¹ of a step at the ends).
            assert!((v - w).abs() <= 0.51 * s + 1e-6, "{i}: {v} became {w}");
        }
    }
}
