//! The CPU twin of `kernels/gemv_quant.cu`'s tiled GEMM over packed weights (`gemm_packed_*`):
//! its geometry, and an emulation that follows the kernel thread by thread and lane by lane
//! (which piece of x and which chunk of W each thread stages, which shared words each lane
//! loads into which fragment register, which output each accumulator lands in), with the
//! tensor-core tile (`mma.sync.m16n8k16`) computed from the PTX ISA's fragment layout, written
//! here independently of the kernel's loads. A test checks that the emulation computes the
//! product of the expanded weights, every output once, so the kernel's index arithmetic is
//! checked on the CPU; `parity.rs` compares the kernel with this emulation on a GPU.
//!
//! The tensor cores' order of summation inside a tile is not specified, so the emulation sums
//! each tile's 16 products in f64 and rounds once: the kernel's results equal it within f32
//! rounding, not bit for bit.

use half::bf16;

use crate::gemv_plan::{chunk, part_of, GemvWeights, HostRun, CHUNK};

/// Activation rows of a block's tile.
pub const TILE_M: usize = 64;
/// Weight rows of a block's tile.
pub const TILE_N: usize = 64;
/// Values of k a step stages.
pub const TILE_K: usize = 32;
/// Threads of a block: 4 warps.
pub const THREADS: usize = 128;
const WARP: usize = 32;
/// 8-value pieces of a tile row per step.
const PIECES: usize = TILE_K / CHUNK;

/// f32 values of partial sums an executor gives the split products (16 MiB: a step of 64 rows by
/// a 1.5B projection in 12 ranges takes 1.2M); products whose ranges would not fit are split
/// less ([`splits`]).
pub const PARTIALS: usize = 1 << 22;
/// Most k ranges a launch is split into.
pub const MAX_SPLITS: usize = 16;
/// Blocks a launch aims at per multiprocessor: enough resident blocks to keep loads in flight.
const BLOCKS_PER_SM: usize = 4;
/// Fewest steps of k a range takes (shorter ones spend more on the reduction than they gain).
const MIN_STEPS_PER_SPLIT: usize = 4;

/// The launch grid `(x, y)`: weight-row tiles by activation-row tiles (times the k ranges).
pub fn grid(rows: usize, m: usize) -> (usize, usize) {
    (rows.div_ceil(TILE_N), m.div_ceil(TILE_M))
}

/// How many k ranges a product of `m` rows by a `[rows, k]` matrix is split into on a device
/// of `multiprocessors`, when `workspace` f32 values can hold the ranges' partial sums: enough
/// for [`BLOCKS_PER_SM`] blocks a multiprocessor, at most [`MAX_SPLITS`], each range at least
/// [`MIN_STEPS_PER_SPLIT`] steps, and the partials (`splits · m · rows`) within the workspace.
/// 1: not split (written straight to the output).
pub fn splits(rows: usize, m: usize, k: usize, multiprocessors: usize, workspace: usize) -> usize {
    let (gx, gy) = grid(rows, m);
    let want = (BLOCKS_PER_SM * multiprocessors).div_ceil((gx * gy).max(1));
    let by_steps = (k / TILE_K) / MIN_STEPS_PER_SPLIT;
    let by_workspace = workspace / (m * rows).max(1);
    let s = want.min(MAX_SPLITS).min(by_steps).min(by_workspace).max(1);
    // Every range non-empty: as many as ranges of ⌈steps / s⌉ steps take.
    (k / TILE_K).div_ceil(k_split(k, s) / TILE_K)
}

/// Values of k in each of `splits` ranges (the last may be shorter): whole steps.
pub fn k_split(k: usize, splits: usize) -> usize {
    (k / TILE_K).div_ceil(splits.max(1)) * TILE_K
}

/// Why the kernel cannot take a matrix of `rows` rows of `k` in `weights`, if it cannot: only
/// packed formats (bf16 matrices go to cuBLAS), `k` whole steps, at least one row.
pub fn check_shape(weights: GemvWeights, rows: usize, k: usize, m: usize) -> Result<(), String> {
    if weights == GemvWeights::Bf16 {
        return Err("the tiled GEMM takes packed weights; bf16 ones go to cuBLAS".into());
    }
    if k == 0 || !k.is_multiple_of(TILE_K) || !k.is_multiple_of(weights.block_values()) {
        return Err(format!(
            "k = {k} is not whole steps of {TILE_K} and blocks of {}",
            weights.block_values()
        ));
    }
    if rows == 0 || m == 0 {
        return Err(format!("an empty product ({m} x {rows})"));
    }
    Ok(())
}

/// One weight row's chunk `c` decoded to bf16 as the kernel stages it: `a·q − b`, rounded once.
fn staged_chunk(weights: GemvWeights, row: &[u8], c: usize) -> [bf16; CHUNK] {
    let per_block = weights.block_values() / CHUNK;
    let block = &row[c / per_block * weights.block_bytes()..];
    let ch = chunk(weights, block, c % per_block);
    ch.q.map(|q| bf16::from_f32(ch.a * q - ch.b))
}

/// The 32-bit word at `at` of a shared tile: values `at` (low half) and `at + 1`.
fn word(tile: &[bf16], at: usize) -> [bf16; 2] {
    [tile[at], tile[at + 1]]
}

/// One warp's `mma.sync.m16n8k16.row.col` (bf16 in, f32 accumulate) from its lanes' fragment
/// registers, in the PTX ISA's layout (g = lane / 4, t = lane % 4): A `a0 (g, 2t)`, `a1 (g + 8, 2t)`,
/// `a2 (g, 2t + 8)`, `a3 (g + 8, 2t + 8)`; B `b0 (k 2t, n g)`, `b1 (k 2t + 8, n g)`; D `d0, d1
/// (g, 2t, 2t + 1)`, `d2, d3 (g + 8, ...)`; each register's low half the lower column (A) or k (B).
fn mma(d: &mut [[f32; 4]; WARP], a: &[[[bf16; 2]; 4]; WARP], b: &[[[bf16; 2]; 2]; WARP]) {
    let mut am = [[0f64; 16]; 16];
    let mut bm = [[0f64; 8]; 16];
    for lane in 0..WARP {
        let (g, t) = (lane / 4, lane % 4);
        for (reg, (row, col)) in [
            (g, 2 * t),
            (g + 8, 2 * t),
            (g, 2 * t + 8),
            (g + 8, 2 * t + 8),
        ]
        .into_iter()
        .enumerate()
        {
            am[row][col] = f64::from(a[lane][reg][0].to_f32());
            am[row][col + 1] = f64::from(a[lane][reg][1].to_f32());
        }
        for (reg, k) in [2 * t, 2 * t + 8].into_iter().enumerate() {
            bm[k][g] = f64::from(b[lane][reg][0].to_f32());
            bm[k + 1][g] = f64::from(b[lane][reg][1].to_f32());
        }
    }
    for (lane, d) in d.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (e, (row, col)) in [
            (g, 2 * t),
            (g, 2 * t + 1),
            (g + 8, 2 * t),
            (g + 8, 2 * t + 1),
        ]
        .into_iter()
        .enumerate()
        {
            let sum: f64 = (0..16).map(|k| am[row][k] * bm[k][col]).sum();
            d[e] = (f64::from(d[e]) + sum) as f32;
        }
    }
}

/// What the kernel (and, with `splits > 1`, the reduction after it) writes: `y` (`[m, ld]`,
/// columns `col0 .. col0 + Σ rows` of each row; the rest left as they are) for the runs (each
/// `rows` rows of `k / block_values` blocks) and `x` (`[m, k]`), k in `splits` ranges.
/// Returns how many times each output was written (the kernel writes each once).
///
/// # Panics
/// On a shape [`check_shape`] refuses or buffers of the wrong length (test inputs).
#[allow(clippy::too_many_arguments)]
pub fn emulate(
    runs: &[HostRun<'_>],
    k: usize,
    x: &[bf16],
    m: usize,
    y: &mut [f32],
    ld: usize,
    col0: usize,
    splits: usize,
) -> Vec<u32> {
    let rows: usize = runs.iter().map(|r| r.rows).sum();
    for run in runs {
        check_shape(run.weights, run.rows, k, m).expect("shape");
        assert_eq!(run.bytes.len(), run.rows * run.weights.row_bytes(k));
    }
    assert_eq!(x.len(), m * k);
    assert!(col0 + rows <= ld && y.len() >= m * ld);
    let ends: Vec<usize> = runs
        .iter()
        .scan(0, |end, r| {
            *end += r.rows;
            Some(*end)
        })
        .collect();
    let row_of = |o: usize| {
        let (p, row0) = part_of(&ends, o);
        let (run, local) = (&runs[p], o - row0);
        let bytes = run.weights.row_bytes(k);
        (run.weights, &run.bytes[local * bytes..(local + 1) * bytes])
    };
    let row_len = TILE_K + 8;
    let mut writes = vec![0u32; m * ld];
    let mut partial = vec![f32::NAN; splits * m * rows];
    let (gx, gy) = grid(rows, m);
    let step = k_split(k, splits);
    let blocks =
        (0..splits).flat_map(|bz| (0..gy).flat_map(move |by| (0..gx).map(move |bx| (bx, by, bz))));
    for (bx, by, bz) in blocks {
        let (n0, m0) = (bx * TILE_N, by * TILE_M);
        let (k_begin, k_end) = (bz * step, (bz * step + step).min(k));
        // acc[warp][mi][ni][lane][e]
        let mut acc = vec![[[[[0f32; 4]; WARP]; 4]; 2]; THREADS / WARP];
        for k0 in (k_begin..k_end).step_by(TILE_K) {
            let mut xs = vec![bf16::ZERO; TILE_M * row_len];
            let mut ws = vec![bf16::ZERO; TILE_N * row_len];
            for tid in 0..THREADS {
                for p in (tid..TILE_M * PIECES).step_by(THREADS) {
                    let (r, piece) = (p / PIECES, p % PIECES);
                    if m0 + r < m {
                        let src = (m0 + r) * k + k0 + CHUNK * piece;
                        let dst = r * row_len + CHUNK * piece;
                        xs[dst..dst + CHUNK].copy_from_slice(&x[src..src + CHUNK]);
                    }
                }
                for p in (tid..TILE_N * PIECES).step_by(THREADS) {
                    let (r, piece) = (p / PIECES, p % PIECES);
                    if n0 + r < rows {
                        let (weights, row) = row_of(n0 + r);
                        let dst = r * row_len + CHUNK * piece;
                        ws[dst..dst + CHUNK].copy_from_slice(&staged_chunk(
                            weights,
                            row,
                            k0 / CHUNK + piece,
                        ));
                    }
                }
            }
            for (warp, acc) in acc.iter_mut().enumerate() {
                let (wm, wn) = ((warp / 2) * 32, (warp % 2) * 32);
                for ks in (0..TILE_K).step_by(16) {
                    let mut a = [[[[bf16::ZERO; 2]; 4]; WARP]; 2];
                    let mut b = [[[[bf16::ZERO; 2]; 2]; WARP]; 4];
                    for lane in 0..WARP {
                        let (g, t) = (lane / 4, lane % 4);
                        for (mi, a) in a.iter_mut().enumerate() {
                            let base = (wm + 16 * mi + g) * row_len + ks + 2 * t;
                            a[lane] = [
                                word(&xs, base),
                                word(&xs, base + 8 * row_len),
                                word(&xs, base + 8),
                                word(&xs, base + 8 * row_len + 8),
                            ];
                        }
                        for (ni, b) in b.iter_mut().enumerate() {
                            let base = (wn + 8 * ni + g) * row_len + ks + 2 * t;
                            b[lane] = [word(&ws, base), word(&ws, base + 8)];
                        }
                    }
                    for (ni, b) in b.iter().enumerate() {
                        for (mi, a) in a.iter().enumerate() {
                            mma(&mut acc[mi][ni], a, b);
                        }
                    }
                }
            }
        }
        for (warp, acc) in acc.iter().enumerate() {
            let (wm, wn) = ((warp / 2) * 32, (warp % 2) * 32);
            for lane in 0..WARP {
                let (g, t) = (lane / 4, lane % 4);
                for (mi, acc) in acc.iter().enumerate() {
                    for (ni, acc) in acc.iter().enumerate() {
                        let c = n0 + wn + 8 * ni + 2 * t;
                        for half in 0..2 {
                            let r = m0 + wm + 16 * mi + g + 8 * half;
                            for j in 0..2 {
                                if r >= m || c + j >= rows {
                                    continue;
                                }
                                let v = acc[lane][2 * half + j];
                                if splits == 1 {
                                    let at = r * ld + col0 + c + j;
                                    y[at] = v;
                                    writes[at] += 1;
                                } else {
                                    partial[(bz * m + r) * rows + c + j] = v;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if splits > 1 {
        // gemm_packed_reduce: the ranges added in order, one output each.
        for r in 0..m {
            for o in 0..rows {
                let i = r * rows + o;
                let sum = (1..splits).fold(partial[i], |s, z| s + partial[z * m * rows + i]);
                let at = r * ld + col0 + o;
                y[at] = sum;
                writes[at] += 1;
            }
        }
    }
    writes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant_type::QuantType;

    fn wave(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 1001.5 - 1.0)
            .collect()
    }

    /// `rows` × `k` weights in `q`'s blocks (int4, FP8: their own quantizers; GGUF types: candle)
    /// and the values the expansion gives them (bf16).
    fn packed(q: QuantType, rows: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<f32>) {
        use candle_core::quantized::{GgmlDType, QTensor};
        let values = wave(rows * k, seed);
        let (raw, deq) = match q {
            QuantType::Int4 => {
                let w = novainfer_model::int4::GroupedInt4::quantize(rows, k, &values).expect("q");
                (w.blocks().to_vec(), w.dequantize())
            }
            QuantType::Fp8 => {
                let w =
                    novainfer_model::fp8_blocks::Fp8Blocks::quantize_rows("w", rows, k, &values)
                        .expect("q");
                (w.blocks().to_vec(), w.dequantize())
            }
            _ => {
                let ggml = match q {
                    QuantType::Q4K => GgmlDType::Q4K,
                    QuantType::Q5_0 => GgmlDType::Q5_0,
                    QuantType::Q6K => GgmlDType::Q6K,
                    _ => GgmlDType::Q8_0,
                };
                let t = candle_core::Tensor::from_vec(values, (rows, k), &candle_core::Device::Cpu)
                    .expect("t");
                let qt = QTensor::quantize(&t, ggml).expect("quantize");
                let deq = qt
                    .dequantize(&candle_core::Device::Cpu)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("dequantize");
                (qt.data().expect("raw").into_owned(), deq)
            }
        };
        (
            raw,
            deq.into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect(),
        )
    }

    #[test]
    fn the_emulated_kernel_is_the_expanded_product_and_writes_each_output_once() {
        // Three runs of different formats (a fused matrix), rows and m that leave partial tiles,
        // k = 512 (16 steps), outputs into columns of a wider row.
        let k = 512;
        let formats = [
            (QuantType::Q4K, 37),
            (QuantType::Fp8, 30),
            (QuantType::Q8_0, 9),
        ];
        let mats: Vec<(Vec<u8>, Vec<f32>)> = formats
            .iter()
            .enumerate()
            .map(|(i, &(q, rows))| packed(q, rows, k, i + 1))
            .collect();
        let runs: Vec<HostRun<'_>> = formats
            .iter()
            .zip(&mats)
            .map(|(&(q, rows), (raw, _))| HostRun {
                weights: q.into(),
                bytes: raw,
                rows,
            })
            .collect();
        let w: Vec<f32> = mats.iter().flat_map(|(_, v)| v.iter().copied()).collect();
        let rows = 76;
        for (m, splits) in [(9, 1), (64, 1), (70, 1), (9, 3), (70, 16)] {
            let x: Vec<bf16> = wave(m * k, 7).into_iter().map(bf16::from_f32).collect();
            let (ld, col0) = (rows + 5, 3);
            let mut y = vec![-7.0f32; m * ld];
            let writes = emulate(&runs, k, &x, m, &mut y, ld, col0, splits);
            for r in 0..m {
                for c in 0..ld {
                    let inside = (col0..col0 + rows).contains(&c);
                    assert_eq!(writes[r * ld + c], u32::from(inside), "({r}, {c})");
                    if !inside {
                        assert_eq!(y[r * ld + c], -7.0);
                        continue;
                    }
                    let o = c - col0;
                    let terms =
                        (0..k).map(|i| f64::from(x[r * k + i].to_f32()) * f64::from(w[o * k + i]));
                    let exact: f64 = terms.clone().sum();
                    let scale: f64 = terms.map(f64::abs).sum();
                    let got = f64::from(y[r * ld + c]);
                    assert!(
                        (got - exact).abs() <= 1e-5 * scale.max(1e-3),
                        "m={m} splits={splits} ({r}, {o}): {got} vs {exact}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_packed_format_stages_the_expansions_values() {
        // The staged bf16 values are the load-time expansion's (dequant.cu's), for each format.
        let k = 256;
        for q in QuantType::ALL {
            let (raw, values) = packed(q, 3, k, 11);
            let weights: GemvWeights = q.into();
            for r in 0..3 {
                let row = &raw[r * weights.row_bytes(k)..(r + 1) * weights.row_bytes(k)];
                for c in 0..k / CHUNK {
                    let got = staged_chunk(weights, row, c);
                    for e in 0..CHUNK {
                        let want = values[r * k + c * CHUNK + e];
                        assert_eq!(
                            got[e].to_f32().to_bits(),
                            want.to_bits(),
                            "{q:?} ({r}, {c}, {e})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn narrow_products_are_split_into_whole_nonempty_ranges_within_the_workspace() {
        // 64 sequences by the 1.5B's o_proj on 132 multiprocessors: 24 tiles, split for ~4 a multiprocessor.
        assert_eq!(splits(1536, 64, 1536, 132, 1 << 22), 12);
        // Capped by the steps: 1536 / 32 = 48 steps, at least 4 a range.
        assert_eq!(splits(64, 64, 1536, 1000, 1 << 22), 12);
        // Capped by the workspace, and never below 1.
        assert_eq!(splits(1536, 64, 8960, 132, 3 * 64 * 1536), 3);
        assert_eq!(splits(1536, 64, 8960, 132, 0), 1);
        // Wide enough already: the 151,936-row head at 256 rows.
        assert_eq!(splits(151_936, 256, 1536, 132, 1 << 22), 1);
        for k in [256, 512, 1536, 4864, 8960] {
            for want in 1..=MAX_SPLITS {
                let s = splits(64, 9, k, want * 1000, 1 << 30);
                let step = k_split(k, s);
                assert!(step.is_multiple_of(TILE_K) && step > 0, "k={k} s={s}");
                assert!(
                    (s - 1) * step < k && s * step >= k,
                    "k={k} s={s}: an empty or missing range"
                );
            }
        }
    }

    #[test]
    fn shapes_the_kernel_cannot_take_are_refused() {
        let q8: GemvWeights = QuantType::Q8_0.into();
        assert!(check_shape(q8, 4, 64, 9).is_ok());
        assert!(check_shape(GemvWeights::Bf16, 4, 64, 9).is_err());
        assert!(check_shape(q8, 4, 48, 9).is_err());
        assert!(check_shape(QuantType::Q4K.into(), 4, 224, 9).is_err());
        assert!(check_shape(q8, 0, 64, 9).is_err());
        assert_eq!(grid(76, 70), (2, 2));
    }
}
