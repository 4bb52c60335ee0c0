//! FP8 (e4m3) weights kept as FP8: one f32 scale per 128 input channels of a row,
//! `w[o][i] = s[o][g] · q[o][i]`, `g = i / 128`, at 8.25 bits per weight.
//!
//! Every FP8 scale layout we read fits this form when a row is whole groups: one scale per
//! tensor, per output channel, or per `[bo, bi]` block with `bi` a multiple of 128 (the
//! `[128, 128]` of the DeepSeek/Qwen3 releases) all give each (row, group) one scale. So do
//! the per-channel scales of `quantization="fp8"` ([`Fp8Blocks::quantize_rows`]). The GPU
//! keeps the blocks as they are (`kernels/dequant.cu`, `kernels/gemv_quant.cu`); the CPU,
//! which has no FP8 arithmetic, runs the layer as its dense f32 values ([`Fp8Blocks::dequantize`]:
//! `f32(q) · s` rounded once, vLLM's dequantization).
//!
//! Block layout, one per (row, group), [`BLOCK_BYTES`] bytes:
//! ```text
//! [ s: f32 LE ][ 128 e4m3fn codes, channel order ]
//! ```

use std::sync::Mutex;

use novainfer_cuda::quant_type::e4m3_to_f32;

use crate::error::{ModelError, Result};
use crate::layers::parallel::SharedOut;

/// Input channels per group.
pub const GROUP_K: usize = 128;
/// Bytes of one (row, group) block.
pub const BLOCK_BYTES: usize = 4 + GROUP_K;
/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// A `[rows, cols]` matrix of e4m3 codes with a scale per (row, group of [`GROUP_K`]).
/// Built only through [`Fp8Blocks::from_codes`] or [`Fp8Blocks::quantize_rows`], which check
/// the shape, every scale and every code.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Blocks {
    rows: usize,
    cols: usize,
    /// `[rows, cols / GROUP_K]` blocks of [`BLOCK_BYTES`].
    blocks: Vec<u8>,
}

fn invalid(name: &str, reason: String) -> ModelError {
    ModelError::InvalidQuantTensor {
        name: name.to_owned(),
        reason,
    }
}

impl Fp8Blocks {
    /// Whether a row of `cols` values is whole groups (else a layer stays dense).
    pub fn fits(cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(GROUP_K)
    }

    /// The `[rows, cols]` `codes` (row-major) with `scale(row, group)`. `name` is for errors:
    /// a shape that is not whole groups, a scale that is not finite, or a NaN code.
    pub fn from_codes(
        name: &str,
        rows: usize,
        cols: usize,
        codes: &[u8],
        scale: impl Fn(usize, usize) -> f32 + Sync,
    ) -> Result<Self> {
        if codes.len() != rows * cols {
            return Err(invalid(
                name,
                format!("{} codes for a [{rows}, {cols}] weight", codes.len()),
            ));
        }
        Self::build(name, rows, cols, |o, blocks| {
            let row = &codes[o * cols..(o + 1) * cols];
            for (g, (block, group)) in blocks
                .chunks_exact_mut(BLOCK_BYTES)
                .zip(row.chunks_exact(GROUP_K))
                .enumerate()
            {
                let s = scale(o, g);
                if !s.is_finite() {
                    return Err(format!("a scale of {s}"));
                }
                if let Some(j) = group.iter().position(|&c| c & 0x7F == 0x7F) {
                    return Err(format!(
                        "a NaN code (0x{:02x}) at [{o}, {}]",
                        group[j],
                        g * GROUP_K + j
                    ));
                }
                block[..4].copy_from_slice(&s.to_le_bytes());
                block[4..].copy_from_slice(group);
            }
            Ok(())
        })
    }

    /// `values` (`[rows, cols]`, row-major) quantized per output channel, as vLLM's dynamic FP8
    /// quantization of a dense checkpoint does: `s = amax / 448` per row (1 for a row of
    /// zeros), `q = e4m3(x / s)` rounded to nearest even and saturated at ±448. Every group of
    /// a row gets the row's scale. Non-finite values are an error naming `name`.
    pub fn quantize_rows(name: &str, rows: usize, cols: usize, values: &[f32]) -> Result<Self> {
        if values.len() != rows * cols {
            return Err(invalid(
                name,
                format!("{} values for a [{rows}, {cols}] weight", values.len()),
            ));
        }
        Self::build(name, rows, cols, |o, blocks| {
            let row = &values[o * cols..(o + 1) * cols];
            if let Some(i) = row.iter().position(|v| !v.is_finite()) {
                return Err(format!("a value of {} at [{o}, {i}]", row[i]));
            }
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            for (block, group) in blocks
                .chunks_exact_mut(BLOCK_BYTES)
                .zip(row.chunks_exact(GROUP_K))
            {
                block[..4].copy_from_slice(&s.to_le_bytes());
                for (code, &v) in block[4..].iter_mut().zip(group) {
                    *code = f32_to_e4m3(v / s);
                }
            }
            Ok(())
        })
    }

    /// The blocks of `rows` rows of `cols` (whole groups), each row's written by `row(o, its
    /// blocks)` on the CPU pool (a 1.5B model's projections are a billion weights); the first
    /// row's error, if any, names `name`.
    fn build(
        name: &str,
        rows: usize,
        cols: usize,
        row: impl Fn(usize, &mut [u8]) -> std::result::Result<(), String> + Sync,
    ) -> Result<Self> {
        if !Self::fits(cols) {
            return Err(invalid(
                name,
                format!("{cols} input channels are not whole groups of {GROUP_K}"),
            ));
        }
        let row_bytes = cols / GROUP_K * BLOCK_BYTES;
        let mut blocks = vec![0u8; rows * row_bytes];
        // The first failing row's message, by row (the same error whatever the threads' order).
        let failed: Mutex<Option<(usize, String)>> = Mutex::new(None);
        let shared = SharedOut::new(&mut blocks);
        candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
            for o in range {
                // SAFETY: row o's blocks belong to this item alone.
                let dst = unsafe { shared.range(o * row_bytes, row_bytes) };
                if let Err(why) = row(o, dst) {
                    let mut first = failed.lock().unwrap_or_else(|e| e.into_inner());
                    if first.as_ref().is_none_or(|(at, _)| o < *at) {
                        *first = Some((o, why));
                    }
                    return;
                }
            }
        });
        match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some((_, why)) => Err(invalid(name, why)),
            None => Ok(Self { rows, cols, blocks }),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The blocks, `[rows, cols / GROUP_K]` of [`BLOCK_BYTES`]: what the device holds.
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }

    /// The dense `[rows, cols]` weights, `f32(q) · s` each, one rounding; rows on the CPU pool.
    pub fn dequantize(&self) -> Vec<f32> {
        let (cols, row_bytes) = (self.cols, self.cols / GROUP_K * BLOCK_BYTES);
        let mut out = vec![0f32; self.rows * cols];
        let shared = SharedOut::new(&mut out);
        candle_core::utils::barrier_pool().execute_chunked(self.rows, |range| {
            for o in range {
                // SAFETY: row o's values belong to this item alone.
                let dst = unsafe { shared.range(o * cols, cols) };
                let blocks = &self.blocks[o * row_bytes..(o + 1) * row_bytes];
                for (values, block) in dst
                    .chunks_exact_mut(GROUP_K)
                    .zip(blocks.chunks_exact(BLOCK_BYTES))
                {
                    for (j, v) in values.iter_mut().enumerate() {
                        *v = block_value(block, j);
                    }
                }
            }
        });
        out
    }
}

/// Value `j` of a block, as [`Fp8Blocks::dequantize`] computes it.
pub fn block_value(block: &[u8], j: usize) -> f32 {
    let s = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    e4m3_to_f32(block[4 + j]) * s
}

/// The e4m3fn code nearest `x` (ties to the even code), saturating at ±448 as vLLM's
/// quantization clamps before its cast. `x` must be finite.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Below the smallest normal (2^-6) the grid is the subnormals' multiples of 2^-9; their
    // code is the multiple itself (8 · 2^-9 = 2^-6 is code 0x08, the smallest normal).
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // A normal: keep 3 mantissa bits of the f32, rounding the 20 dropped ones to nearest even
    // (a carry into the exponent is the next binade's first value, as it should be).
    let bits = a.to_bits();
    let rounded = (bits + 0x7_FFFF + ((bits >> 20) & 1)) >> 20;
    let (exp, man) = ((rounded >> 3) as i32 - 127 + 7, rounded & 7);
    // 448 is the largest value: rounding cannot pass it since `a` was clamped to it.
    sign | ((exp as u8) << 3) | man as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_encodes_to_itself_and_midpoints_round_to_even() {
        for code in 0..=255u8 {
            let v = e4m3_to_f32(code);
            if v.is_nan() || code == 0x80 {
                continue;
            }
            assert_eq!(f32_to_e4m3(v), code, "{code:#04x} ({v})");
        }
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // 1 + 1/16 lies between 1 (mantissa 0) and 1.125 (mantissa 1): the even one wins.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        // Between subnormals 1 and 2 (· 2^-9), and between the largest subnormal and 2^-6.
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(f32_to_e4m3(7.5 * 2f32.powi(-9)), 0x08);
        // Saturation instead of NaN.
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(-470.0), 0xFE);
    }

    #[test]
    fn each_value_goes_to_its_nearest_code() {
        let finite: Vec<f32> = (0..=255u8)
            .map(e4m3_to_f32)
            .filter(|v| !v.is_nan())
            .collect();
        for i in 0..20_000 {
            let x = ((i as f32) * 0.618_034).sin() * 460.0 * ((i % 7) as f32 / 6.0).powi(4);
            let got = e4m3_to_f32(f32_to_e4m3(x));
            let best = finite
                .iter()
                .map(|v| (v - x.clamp(-E4M3_MAX, E4M3_MAX)).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((got - x.clamp(-E4M3_MAX, E4M3_MAX)).abs(), best, "{x}");
        }
    }

    #[test]
    fn per_row_quantization_keeps_each_value_within_half_a_step() {
        let (rows, cols) = (3, 256);
        let mut values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * (1 + i / cols) as f32 * 0.01)
            .collect();
        values[cols..2 * cols].fill(0.0);
        let w = Fp8Blocks::quantize_rows("w", rows, cols, &values).expect("quantize");
        assert_eq!(w.blocks().len(), rows * 2 * BLOCK_BYTES);
        let back = w.dequantize();
        for (o, (row, got)) in values.chunks(cols).zip(back.chunks(cols)).enumerate() {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(
                got.iter().fold(0f32, |m, v| m.max(v.abs())),
                amax,
                "row {o}"
            );
            for (x, y) in row.iter().zip(got) {
                // e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value's binade.
                assert!(
                    (x - y).abs() <= x.abs() / 16.0 + amax * 2f32.powi(-18),
                    "{x} {y}"
                );
            }
        }
        assert!(back[cols..2 * cols].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn bad_shapes_scales_and_codes_are_errors_naming_the_tensor() {
        let codes = vec![0x38u8; 2 * 128];
        assert!(Fp8Blocks::from_codes("w", 2, 128, &codes, |_, _| 1.0).is_ok());
        let e = Fp8Blocks::from_codes("w.x", 1, 256 - 8, &codes[..248], |_, _| 1.0)
            .expect_err("partial group")
            .to_string();
        assert!(e.contains("w.x") && e.contains("whole groups"), "{e}");
        let e = Fp8Blocks::from_codes(
            "w",
            2,
            128,
            &codes,
            |o, _| if o == 1 { f32::NAN } else { 1.0 },
        )
        .expect_err("scale")
        .to_string();
        assert!(e.contains("scale of NaN"), "{e}");
        let mut nan = codes.clone();
        nan[130] = 0xFF;
        let e = Fp8Blocks::from_codes("w", 2, 128, &nan, |_, _| 1.0)
            .expect_err("NaN code")
            .to_string();
        assert!(e.contains("0xff") && e.contains("[1, 2]"), "{e}");
        let e = Fp8Blocks::quantize_rows("w", 1, 128, &[f32::INFINITY; 128])
            .expect_err("inf")
            .to_string();
        assert!(e.contains("inf"), "{e}");
    }
}
