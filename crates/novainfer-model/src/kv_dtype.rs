//! How the KV pool stores keys and values (vLLM's `kv_cache_dtype`).
//!
//! A pool row is one token's key (or value) for one KV head: `head_dim` numbers, stored as
//!
//! ```text
//!   f32:   head_dim × 4 bytes
//!   f16:   head_dim × 2 bytes (IEEE half)          bf16: head_dim × 2 bytes (bfloat16)
//!   q8_0:  head_dim / qk blocks of [f16 scale d | qk × i8]   (llama.cpp's Q8_0; x ≈ d·q)
//! ```
//! where `qk` is 32 when `head_dim` is a multiple of 32 (llama.cpp's block) and `head_dim`
//! otherwise (one scale per row), so every head size has a q8_0 layout.
//!
//! Encoding rounds (to nearest even); decoding is exact (every stored value is an f32), so the
//! attention kernel sees the same f32 numbers whichever way it reads them.

use crate::error::{ModelError, Result};

/// The dtype a user asks for; `Auto` is resolved per device ([`Self::for_cpu`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// f16 on the CPU (half the bytes of f32, llama.cpp's default); the GPU's own dtype there.
    #[default]
    Auto,
    Fixed(KvStorage),
}

/// A concrete storage format of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvStorage {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl KvCacheDtype {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            other => KvStorage::parse(other).map(Self::Fixed).ok_or_else(|| {
                ModelError::config(
                    "kv_cache_dtype",
                    format!(
                        "unknown kv_cache_dtype {other:?}; expected one of \"auto\", \"f32\", \
                         \"f16\", \"bf16\", \"q8_0\""
                    ),
                )
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fixed(s) => s.as_str(),
        }
    }

    /// What the CPU pool stores for this choice.
    pub fn for_cpu(self) -> KvStorage {
        match self {
            Self::Auto => KvStorage::F16,
            Self::Fixed(s) => s,
        }
    }
}

impl KvStorage {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "f32" | "float32" => Self::F32,
            "f16" | "float16" | "half" => Self::F16,
            "bf16" | "bfloat16" => Self::Bf16,
            "q8_0" => Self::Q8_0,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8_0 => "q8_0",
        }
    }

    /// Bytes of one row of `head_dim` numbers.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::F32 => head_dim * 4,
            Self::F16 | Self::Bf16 => head_dim * 2,
            Self::Q8_0 => {
                let qk = q8_block(head_dim);
                head_dim / qk * (2 + qk)
            }
        }
    }

    /// Stores `src` (one row) into `dst` (`row_bytes(src.len())` bytes).
    pub fn encode(self, src: &[f32], dst: &mut [u8]) {
        match self {
            Self::F32 => {
                for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            }
            Self::F16 => {
                for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                    d.copy_from_slice(&half::f16::from_f32(*x).to_bits().to_le_bytes());
                }
            }
            Self::Bf16 => {
                for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                    d.copy_from_slice(&half::bf16::from_f32(*x).to_bits().to_le_bytes());
                }
            }
            Self::Q8_0 => {
                let qk = q8_block(src.len());
                for (block, d) in src.chunks_exact(qk).zip(dst.chunks_exact_mut(2 + qk)) {
                    encode_q8_block(block, d);
                }
            }
        }
    }

    /// Reads one row of `dst.len()` numbers back from `src` (the portable path; the attention
    /// kernel has SIMD versions that give the same numbers).
    pub fn decode(self, src: &[u8], dst: &mut [f32]) {
        match self {
            Self::F32 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            Self::F16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
                }
            }
            Self::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = f32::from_bits(u32::from(u16::from_le_bytes([s[0], s[1]])) << 16);
                }
            }
            Self::Q8_0 => {
                let qk = q8_block(dst.len());
                for (block, s) in dst.chunks_exact_mut(qk).zip(src.chunks_exact(2 + qk)) {
                    let scale = half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
                    for (d, &q) in block.iter_mut().zip(&s[2..]) {
                        *d = f32::from(q as i8) * scale;
                    }
                }
            }
        }
    }
}

/// Numbers per q8_0 block for rows of `head_dim`.
pub(crate) fn q8_block(head_dim: usize) -> usize {
    if head_dim.is_multiple_of(32) {
        32
    } else {
        head_dim
    }
}

/// ggml's Q8_0 quantization: `d = amax / 127`, `q = round(x / d)`, `d` stored as f16.
fn encode_q8_block(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        *o = ((v * id).round() as i8) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_name_round_trip() {
        for name in ["auto", "f32", "f16", "bf16", "q8_0"] {
            assert_eq!(KvCacheDtype::parse(name).expect("known").as_str(), name);
        }
        assert_eq!(KvCacheDtype::Auto.for_cpu(), KvStorage::F16);
        let err = KvCacheDtype::parse("fp8").expect_err("unknown").to_string();
        assert!(
            err.contains("kv_cache_dtype") && err.contains("q8_0"),
            "{err}"
        );
    }

    #[test]
    fn rows_round_trip_within_each_format_precision() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        for (dtype, bytes, tol) in [
            (KvStorage::F32, 256, 0.0),
            (KvStorage::F16, 128, 4.1 * 2f32.powi(-11)),
            (KvStorage::Bf16, 128, 4.1 * 2f32.powi(-8)),
            (KvStorage::Q8_0, 68, 4.1 / 127.0),
        ] {
            assert_eq!(dtype.row_bytes(64), bytes);
            let mut enc = vec![0u8; bytes];
            dtype.encode(&x, &mut enc);
            let mut dec = vec![0f32; 64];
            dtype.decode(&enc, &mut dec);
            for (a, b) in x.iter().zip(&dec) {
                assert!((a - b).abs() <= tol, "{dtype:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q8_0_of_a_head_not_a_multiple_of_32_uses_one_block_per_row() {
        assert_eq!(KvStorage::Q8_0.row_bytes(16), 18);
        let x: Vec<f32> = (0..16).map(|i| i as f32 - 8.0).collect();
        let mut enc = vec![0u8; 18];
        KvStorage::Q8_0.encode(&x, &mut enc);
        let mut dec = vec![0f32; 16];
        KvStorage::Q8_0.decode(&enc, &mut dec);
        // One scale for the row: amax 8 → d = 8/127, so every value is within d/2 (+ f16 of d).
        assert!(
            dec.iter().zip(&x).all(|(a, b)| (a - b).abs() < 0.04),
            "{dec:?}"
        );
        assert_eq!(dec[8], 0.0);
    }
}
