//! Dense f32 matmul `y = x Wᵀ` whose result for a row never depends on the other rows.
//!
//! General GEMM libraries pick kernels and blockings by matrix size, so the same
//! row can round differently in a batch of 1 and a batch of 64. Here every output
//! element is one [`dot`] over `k` in a fixed order, whatever `rows` is: the price
//! of batch invariance is a simpler kernel (weight rows are reused across a tile of
//! activation rows from cache, but there is no register blocking).

use super::ops::dot;
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
    debug_assert!(
        x.len() == rows * k && w.len() >= n * k,
        "dense matmul shapes: this is a bug"
    );
    y.clear();
    y.resize(rows * n, 0.0);
    let out = SharedOut::new(y);
    let col_chunks = n.div_ceil(COL_CHUNK);
    let row_tiles = rows.div_ceil(ROW_TILE);
    candle_core::utils::barrier_pool().execute_chunked(col_chunks * row_tiles, |items| {
        for item in items {
            let (tile, chunk) = (item / col_chunks, item % col_chunks);
            let cols = chunk * COL_CHUNK..((chunk + 1) * COL_CHUNK).min(n);
            for j in cols.clone() {
                let w_row = &w[j * k..(j + 1) * k];
                for i in tile * ROW_TILE..((tile + 1) * ROW_TILE).min(rows) {
                    // SAFETY: (i, j) lies inside `y`, and each item owns a disjoint
                    // (row tile × column chunk) block, so no other thread writes it.
                    let cell = unsafe { out.range(i * n + j, 1) };
                    cell[0] = dot(&x[i * k..(i + 1) * k], w_row);
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
