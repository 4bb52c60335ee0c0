//! The packed GEMV's (`kernels/gemv_quant.cu`) launch geometry and a CPU twin of its arithmetic,
//! operation for operation: each weight row is one warp's, cut into chunks of [`CHUNK`] values
//! that lane `l` takes in the order `l, l + 32, …`; per chunk the dequantizer's integer weights and
//! scale(s), `s = Σ q·x` (and Q4_K's `t = Σ x`) by fused multiply-adds in value order, then
//! `acc = fma(a, s, acc)` (and `acc = fma(−b, t, acc)`), and the lanes meet in common.cuh's xor
//! butterfly. The GPU parity test compares the kernel with [`emulate`] bit for bit; the tests here
//! check, without a GPU, that the chunks' weights are the dequantized values exactly (candle's, and
//! `GroupedInt4::dequantize`'s), that
//! every value is used once, and that the result is the product within f32 rounding.

use half::bf16;

use crate::quant_type::{scale_min_k4, QuantType};

/// Warps (weight rows) per block: `GEMV_WARPS`.
pub const WARPS: usize = 4;
/// Most activation rows one launch takes: `GEMV_MAX_ROWS`.
pub const MAX_ROWS: usize = 8;
/// Values per chunk: `GEMV_CHUNK`.
pub const CHUNK: usize = 8;
const WARP: usize = 32;

/// Blocks of the launch for `rows` weight rows.
pub fn grid(rows: usize) -> usize {
    rows.div_ceil(WARPS)
}

/// Why a launch's shape is refused (the launcher returns these as errors).
pub fn check_shape(qtype: QuantType, rows: usize, k: usize, n: usize) -> Result<(), String> {
    if k == 0 || !k.is_multiple_of(qtype.block_values()) {
        return Err(format!(
            "k = {k} is not a positive multiple of {qtype:?}'s {} values a block",
            qtype.block_values()
        ));
    }
    if n == 0 || n > MAX_ROWS {
        return Err(format!(
            "{n} activation rows: the GEMV takes 1 to {MAX_ROWS}"
        ));
    }
    if rows == 0 {
        return Err("no weight rows".to_owned());
    }
    Ok(())
}

/// One chunk's integer weights and factors: `w_e = a · q_e − b` (`b` is Q4_K's min, else 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Chunk {
    pub q: [f32; CHUNK],
    pub a: f32,
    pub b: f32,
}

fn f16_at(block: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// Chunk `c` of `block`, as the kernel's `chunk_*` functions decode it.
pub fn chunk(qtype: QuantType, block: &[u8], c: usize) -> Chunk {
    let mut q = [0f32; CHUNK];
    match qtype {
        QuantType::Q8_0 => {
            for (e, v) in q.iter_mut().enumerate() {
                *v = f32::from(block[2 + CHUNK * c + e] as i8);
            }
            Chunk {
                q,
                a: f16_at(block, 0),
                b: 0.0,
            }
        }
        QuantType::Q5_0 => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let qs = &block[6..22];
            for (e, v) in q.iter_mut().enumerate() {
                let j = CHUNK * c + e;
                let low = if j < 16 {
                    qs[j] & 0x0F
                } else {
                    qs[j - 16] >> 4
                };
                let high = (((qh >> j) & 1) << 4) as u8;
                *v = (i32::from(low | high) - 16) as f32;
            }
            Chunk {
                q,
                a: f16_at(block, 0),
                b: 0.0,
            }
        }
        QuantType::Q4K => {
            let e0 = CHUNK * c;
            let (part, idx0) = (e0 / 64, e0 % 64);
            let sub = 2 * part + usize::from(idx0 >= 32);
            let (sc, m) = scale_min_k4(sub, &block[4..16]);
            let qs = &block[16 + 32 * part..16 + 32 * part + 32];
            for (e, v) in q.iter_mut().enumerate() {
                let idx = idx0 + e;
                let byte = qs[idx % 32];
                *v = f32::from(if idx < 32 { byte & 0x0F } else { byte >> 4 });
            }
            Chunk {
                q,
                a: f16_at(block, 0) * f32::from(sc),
                b: f16_at(block, 2) * f32::from(m),
            }
        }
        QuantType::Int4 => {
            let (e0, z) = (CHUNK * c, i32::from(block[4]));
            let (t, c0) = (e0 / 32, e0 % 32);
            let qs = &block[5 + 16 * t..5 + 16 * t + 16];
            for (e, v) in q.iter_mut().enumerate() {
                let j = c0 + e;
                let nibble = if j < 16 {
                    qs[j] & 0x0F
                } else {
                    qs[j - 16] >> 4
                };
                *v = (i32::from(nibble) - z) as f32;
            }
            Chunk {
                q,
                a: f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
                b: 0.0,
            }
        }
        QuantType::Q6K => {
            let e0 = CHUNK * c;
            let (h, g, l0) = (e0 / 128, (e0 % 128) / 32, e0 % 32);
            let ql = &block[64 * h + if g & 1 == 1 { 32 } else { 0 }..];
            let qh = &block[128 + 32 * h..];
            for (e, v) in q.iter_mut().enumerate() {
                let l = l0 + e;
                let low = if g < 2 { ql[l] & 0x0F } else { ql[l] >> 4 };
                let high = (qh[l] >> (2 * g)) & 3;
                *v = (i32::from(low | (high << 4)) - 32) as f32;
            }
            let sc = block[192 + 8 * h + l0 / 16 + 2 * g] as i8;
            Chunk {
                q,
                a: f16_at(block, 208) * f32::from(sc),
                b: 0.0,
            }
        }
    }
}

/// What the kernel computes before its store (f32; a bf16 output rounds each once):
/// `[n, rows]`, row-major, for `w` (`rows` rows of `k / block_values` blocks) and `x` (`[n, k]`).
///
/// # Panics
/// On a shape [`check_shape`] refuses or buffers of the wrong length (test inputs).
pub fn emulate(
    qtype: QuantType,
    w: &[u8],
    rows: usize,
    k: usize,
    x: &[bf16],
    n: usize,
) -> Vec<f32> {
    check_shape(qtype, rows, k, n).expect("a valid GEMV shape");
    let (bv, bb) = (qtype.block_values(), qtype.block_bytes());
    let row_bytes = k / bv * bb;
    assert_eq!(w.len(), rows * row_bytes, "weight bytes");
    assert_eq!(x.len(), n * k, "activations");
    let chunks_per_block = bv / CHUNK;
    let chunks = k / CHUNK;
    let mut out = vec![0f32; n * rows];
    for o in 0..rows {
        let row = &w[o * row_bytes..(o + 1) * row_bytes];
        let mut lanes = vec![[0f32; MAX_ROWS]; WARP];
        for (lane, acc) in lanes.iter_mut().enumerate() {
            for c in (lane..chunks).step_by(WARP) {
                let block = &row[(c / chunks_per_block) * bb..][..bb];
                let ch = chunk(qtype, block, c % chunks_per_block);
                for (r, a) in acc.iter_mut().enumerate().take(n) {
                    let xr = &x[r * k + c * CHUNK..][..CHUNK];
                    let (mut s, mut t) = (0f32, 0f32);
                    for (q, xe) in ch.q.iter().zip(xr) {
                        let xe = xe.to_f32();
                        s = q.mul_add(xe, s);
                        t += xe;
                    }
                    *a = ch.a.mul_add(s, *a);
                    if qtype == QuantType::Q4K {
                        *a = (-ch.b).mul_add(t, *a);
                    }
                }
            }
        }
        for r in 0..n {
            let partials: Vec<f32> = lanes.iter().map(|acc| acc[r]).collect();
            out[r * rows + o] = warp_sum(&partials);
        }
    }
    out
}

/// common.cuh's `warp_sum`: an xor butterfly over offsets 16, 8, 4, 2, 1 (lane 0's value).
fn warp_sum(partials: &[f32]) -> f32 {
    let mut v = partials.to_vec();
    let mut offset = WARP / 2;
    while offset > 0 {
        v = (0..WARP).map(|l| v[l] + v[l ^ offset]).collect();
        offset /= 2;
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn ggml(q: QuantType) -> GgmlDType {
        match q {
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q6K => GgmlDType::Q6K,
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Int4 => unreachable!("int4 blocks are quantized by GroupedInt4"),
        }
    }

    fn wave(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 1001.5 - 1.0)
            .collect()
    }

    /// `rows` rows of `k` values quantized by candle (int4: by `GroupedInt4`), with their
    /// dequantized values.
    fn matrix(q: QuantType, rows: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<f32>) {
        if q == QuantType::Int4 {
            let w = novainfer_model::int4::GroupedInt4::quantize(rows, k, &wave(rows * k, seed))
                .expect("quantize");
            return (w.blocks().to_vec(), w.dequantize());
        }
        let t = Tensor::from_vec(wave(rows * k, seed), (rows, k), &Device::Cpu).expect("t");
        let qt = QTensor::quantize(&t, ggml(q)).expect("quantize");
        let values = qt
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("dequantize");
        (qt.data().expect("raw").into_owned(), values)
    }

    #[test]
    fn each_chunk_holds_the_dequantizers_values_exactly() {
        for q in QuantType::ALL {
            let k = 512;
            let (raw, values) = matrix(q, 3, k, 1);
            let (bv, bb) = (q.block_values(), q.block_bytes());
            for (b, block) in raw.chunks_exact(bb).enumerate() {
                for c in 0..bv / CHUNK {
                    let ch = chunk(q, block, c);
                    for e in 0..CHUNK {
                        // The dequantizer's own operations: a·q, then − b (Q4_K).
                        let w = ch.a * ch.q[e] - ch.b;
                        let want = values[b * bv + c * CHUNK + e];
                        assert_eq!(
                            w.to_bits(),
                            want.to_bits(),
                            "{q:?} block {b} chunk {c} value {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_emulated_kernel_is_the_product_within_f32_rounding_and_batch_invariant() {
        for q in QuantType::ALL {
            // k = 1536 (the 1.5B hidden size): chunks do not divide evenly among the lanes.
            let (rows, k, n) = (9, 1536, MAX_ROWS);
            let (raw, w) = matrix(q, rows, k, 2);
            let x: Vec<bf16> = wave(n * k, 3).into_iter().map(bf16::from_f32).collect();
            let got = emulate(q, &raw, rows, k, &x, n);
            for r in 0..n {
                let xr: Vec<f64> = x[r * k..(r + 1) * k]
                    .iter()
                    .map(|v| f64::from(v.to_f32()))
                    .collect();
                let alone = emulate(q, &raw, rows, k, &x[r * k..(r + 1) * k], 1);
                for o in 0..rows {
                    let wr = &w[o * k..(o + 1) * k];
                    let exact: f64 = wr.iter().zip(&xr).map(|(&w, x)| f64::from(w) * x).sum();
                    let scale: f64 = wr
                        .iter()
                        .zip(&xr)
                        .map(|(&w, x)| (f64::from(w) * x).abs())
                        .sum();
                    let v = got[r * rows + o];
                    assert!(
                        (f64::from(v) - exact).abs() <= 1e-5 * scale,
                        "{q:?} ({r}, {o}): {v} vs {exact}"
                    );
                    assert_eq!(
                        v.to_bits(),
                        alone[o].to_bits(),
                        "{q:?}: row {r} alone differs"
                    );
                }
            }
        }
    }

    #[test]
    fn the_lanes_take_every_chunk_once_and_the_grid_covers_every_row() {
        for k in [256, 1536, 8960] {
            let chunks = k / CHUNK;
            let mut seen = vec![0u8; chunks];
            for lane in 0..WARP {
                for c in (lane..chunks).step_by(WARP) {
                    seen[c] += 1;
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "k = {k}");
        }
        for rows in [1, 4, 5, 17920, 151_936] {
            assert!(grid(rows) * WARPS >= rows && (grid(rows) - 1) * WARPS < rows);
        }
        assert!(check_shape(QuantType::Q4K, 8, 1000, 1).is_err());
        assert!(check_shape(QuantType::Q8_0, 8, 64, MAX_ROWS + 1).is_err());
        assert!(check_shape(QuantType::Q8_0, 8, 64, 0).is_err());
        assert!(check_shape(QuantType::Q6K, 8, 512, MAX_ROWS).is_ok());
    }
}
