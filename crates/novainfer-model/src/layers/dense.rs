//! Dense matmul `y = x Wᵀ` (f32 activations; weights f32, bf16 or f16) whose result for a row
//! never depends on the other rows.
//!
//! General GEMM libraries pick kernels and blockings by matrix size, so the same
//! row can round differently in a batch of 1 and a batch of 64. Here every output
//! element is one [`dot`] over `k` in a fixed order, whatever `rows` is: the price
//! of batch invariance is a simpler kernel (weight rows are reused across a tile of
//! activation rows from cache, but there is no register blocking).
//!
//! 16-bit weights widen exactly to f32 and the dot is the same, so a matmul over bf16 or f16
//! weights has the bits of the f32 matmul over the same values, at half the bytes a decode
//! step reads. With several activation rows, a weight row is widened once into a scratch row
//! and shared by the tile (widening per FMA would cost prefill its speed).

use super::ops::{dot, dot_with, DotElem};
use super::parallel::SharedOut;

/// Activation rows per tile: the tile stays in L2 while a chunk of weight rows streams past it.
const ROW_TILE: usize = 32;
/// Weight rows (output columns) per work item.
const COL_CHUNK: usize = 16;

/// `x`: `[rows, k]`, `w`: `[n, k]` → `[rows, n]`.
pub fn matmul_f32(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = Vec::new();
    matmul_f32_into(x, rows, w, n, k, &mut y);
    y
}

/// [`matmul_f32`] into `y` (resized to `rows · n`, its capacity reused).
pub fn matmul_f32_into(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize, y: &mut Vec<f32>) {
    matmul_into(x, rows, w, n, k, y)
}

/// [`matmul_f32_into`] with weights of any [`DotElem`] type (f32, `half::bf16`, `half::f16`):
/// bit-identical to it on the weights widened to f32.
pub fn matmul_into<W: DotElem + Sync>(
    x: &[f32],
    rows: usize,
    w: &[W],
    n: usize,
    k: usize,
    y: &mut Vec<f32>,
) {
    debug_assert!(
        x.len() == rows * k && w.len() >= n * k,
        "dense matmul shapes: this is a bug"
    );
    y.clear();
    y.resize(rows * n, 0.0);
    let out = SharedOut::new(y);
    let col_chunks = n.div_ceil(COL_CHUNK);
    let row_tiles = rows.div_ceil(ROW_TILE);
    // f32 weights are read in place; narrower ones are widened once per tile of several rows.
    let widen = std::mem::size_of::<W>() != 4 && rows > 1;
    candle_core::utils::barrier_pool().execute_chunked(col_chunks * row_tiles, |items| {
        let mut wide = Vec::new();
        for item in items {
            let (tile, chunk) = (item / col_chunks, item % col_chunks);
            let cols = chunk * COL_CHUNK..((chunk + 1) * COL_CHUNK).min(n);
            for j in cols.clone() {
                let w_row = &w[j * k..(j + 1) * k];
                if widen {
                    wide.clear();
                    wide.extend(w_row.iter().map(|v| v.to_f32()));
                }
                for i in tile * ROW_TILE..((tile + 1) * ROW_TILE).min(rows) {
                    // SAFETY: (i, j) lies inside `y`, and each item owns a disjoint
                    // (row tile × column chunk) block, so no other thread writes it.
                    let cell = unsafe { out.range(i * n + j, 1) };
                    let xi = &x[i * k..(i + 1) * k];
                    cell[0] = if widen {
                        dot(xi, &wide)
                    } else {
                        dot_with(xi, w_row)
                    };
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 - 1001.0) / 500.0)
            .collect()
    }

    #[test]
    fn matches_the_definition() {
        let (rows, n, k) = (5, 37, 70);
        let (x, w) = (data(rows * k, 1), data(n * k, 2));
        let y = matmul_f32(&x, rows, &w, n, k);
        for i in 0..rows {
            for j in 0..n {
                let exact: f64 = (0..k)
                    .map(|t| f64::from(x[i * k + t]) * f64::from(w[j * k + t]))
                    .sum();
                assert!((f64::from(y[i * n + j]) - exact).abs() < 1e-3, "({i}, {j})");
            }
        }
    }

    /// bf16 and f16 weights give the f32 kernel's bits on the same values, for one row (the
    /// weights widened in the dot) and many (widened once per tile), odd k and n included.
    #[test]
    fn sixteen_bit_weights_give_the_f32_bits() {
        for (rows, n, k) in [
            (1, 37, 70),
            (1, 16, 896),
            (5, 33, 96),
            (40, 17, 131),
            (64, 5, 8),
        ] {
            let (x, w) = (data(rows * k, 5), data(n * k, 6));
            let bf: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let hf: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
            let bf_wide: Vec<f32> = bf.iter().map(|v| v.to_f32()).collect();
            let hf_wide: Vec<f32> = hf.iter().map(|v| v.to_f32()).collect();
            let (mut got, mut want) = (Vec::new(), Vec::new());
            matmul_into(&x, rows, &bf, n, k, &mut got);
            matmul_f32_into(&x, rows, &bf_wide, n, k, &mut want);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "bf16 {rows}x{n}x{k}");
            matmul_into(&x, rows, &hf, n, k, &mut got);
            matmul_f32_into(&x, rows, &hf_wide, n, k, &mut want);
            assert_eq!(bits(&got), bits(&want), "f16 {rows}x{n}x{k}");
        }
    }

    #[test]
    fn a_row_is_bit_identical_in_any_batch() {
        let (rows, n, k) = (70, 33, 96);
        let (x, w) = (data(rows * k, 3), data(n * k, 4));
        let batch = matmul_f32(&x, rows, &w, n, k);
        for r in [0, 31, 32, 69] {
            let alone = matmul_f32(&x[r * k..(r + 1) * k], 1, &w, n, k);
            assert_eq!(alone, batch[r * n..(r + 1) * n], "row {r}");
        }
    }
}
