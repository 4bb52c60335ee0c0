//! The LoRA kernels' (`kernels/lora.cu`) launch geometry and a CPU twin of their arithmetic,
//! checked here without a GPU: every (row, rank) cell of the shrink and every (row, column)
//! of the expand is computed by exactly one thread, in the kernels' summation order, and the
//! result equals a plain reference of `y[r, off + c] += s · (x_r · Aᵀ) · Bᵀ` per row's adapter.

/// One projection of one resident adapter, as the kernels read it (`LoraPair` in lora.cu):
/// device addresses of `A` (`[rank, in]`, f32) and `Bᵀ` (`[rank, out]`, f32), 0 where the
/// adapter leaves the projection alone.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoraPair {
    pub a: u64,
    pub bt: u64,
    pub rank: i32,
    pub scale: f32,
}
const _: () = assert!(std::mem::size_of::<LoraPair>() == 24);

/// Warps per shrink block (`LORA_SHRINK_WARPS`): each computes one rank of one row.
pub const SHRINK_WARPS: usize = 4;
/// Threads per expand block (`LORA_EXPAND_THREADS`): each adds one output column of one row.
pub const EXPAND_THREADS: usize = 256;
const WARP: usize = 32;

/// Grid of the shrink: `(rows, ⌈max_rank / SHRINK_WARPS⌉)`.
pub fn shrink_grid(rows: usize, max_rank: usize) -> (usize, usize) {
    (rows, max_rank.div_ceil(SHRINK_WARPS))
}

/// Grid of the expand: `(rows, ⌈out / EXPAND_THREADS⌉)`. Rows on x, whose limit is 2³¹ − 1 (y's is
/// 65,535, which a step's batched tokens may exceed).
pub fn expand_grid(out_features: usize, rows: usize) -> (usize, usize) {
    (rows, out_features.div_ceil(EXPAND_THREADS))
}

/// A resident adapter's projection on the host, for the twin: `a` `[rank, in]`, `bt`
/// `[rank, out]`; `None` where the adapter has no update for the projection.
#[derive(Debug, Clone)]
pub struct HostPair {
    pub a: Option<Vec<f32>>,
    pub bt: Vec<f32>,
    pub rank: usize,
    pub scale: f32,
}

/// What each shrink thread of the kernel computes, in its order: per (block, warp) the cell
/// `(r, j)` with lanes summing `k ≡ lane (mod 32)` in increasing order, then the xor butterfly.
pub fn emulate_shrink(
    x: &[f32],
    in_features: usize,
    row_slot: &[i32],
    pairs: &[HostPair],
    max_rank: usize,
) -> Vec<f32> {
    let rows = row_slot.len();
    let mut t = vec![f32::NAN; rows * max_rank];
    let (gx, gy) = shrink_grid(rows, max_rank);
    for r in 0..gx {
        for by in 0..gy {
            for warp in 0..SHRINK_WARPS {
                let j = by * SHRINK_WARPS + warp;
                if j >= max_rank {
                    continue;
                }
                let cell = &mut t[r * max_rank + j];
                let slot = row_slot[r];
                let pair = usize::try_from(slot).ok().and_then(|s| pairs.get(s));
                let Some((p, a)) = pair.and_then(|p| p.a.as_ref().map(|a| (p, a))) else {
                    *cell = 0.0;
                    continue;
                };
                if j >= p.rank {
                    *cell = 0.0;
                    continue;
                }
                let mut lanes = [0f32; WARP];
                for (lane, acc) in lanes.iter_mut().enumerate() {
                    for k in (lane..in_features).step_by(WARP) {
                        *acc += x[r * in_features + k] * a[j * in_features + k];
                    }
                }
                *cell = p.scale * butterfly(lanes);
            }
        }
    }
    t
}

/// The kernel's `warp_sum`: lane i adds lane i ^ offset, offsets 16, 8, 4, 2, 1; lane 0's result.
fn butterfly(mut lanes: [f32; WARP]) -> f32 {
    let mut offset = WARP / 2;
    while offset > 0 {
        let before = lanes;
        for (i, v) in lanes.iter_mut().enumerate() {
            *v = before[i] + before[i ^ offset];
        }
        offset /= 2;
    }
    lanes[0]
}

/// What each expand thread does: `y[r, offset + c] += Σ_j t[r, j] · Bᵀ[j, c]`, j increasing.
#[allow(clippy::too_many_arguments)]
pub fn emulate_expand(
    t: &[f32],
    row_slot: &[i32],
    pairs: &[HostPair],
    max_rank: usize,
    y: &mut [f32],
    out_features: usize,
    y_stride: usize,
    offset: usize,
) {
    let (gx, gy) = expand_grid(out_features, row_slot.len());
    for r in 0..gx {
        for by in 0..gy {
            for thread in 0..EXPAND_THREADS {
                let c = by * EXPAND_THREADS + thread;
                let slot = row_slot[r];
                let pair = usize::try_from(slot).ok().and_then(|s| pairs.get(s));
                let Some(p) = pair.filter(|p| p.a.is_some()) else {
                    continue;
                };
                if c >= out_features {
                    continue;
                }
                let mut acc = 0f32;
                for j in 0..p.rank.min(max_rank) {
                    acc += t[r * max_rank + j] * p.bt[j * out_features + c];
                }
                y[r * y_stride + offset + c] += acc;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (the crate has no rand dependency outside tests' needs).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    fn pairs(g: &mut Lcg, in_f: usize, out: usize, ranks: &[Option<usize>]) -> Vec<HostPair> {
        ranks
            .iter()
            .enumerate()
            .map(|(i, rank)| match *rank {
                Some(rank) => HostPair {
                    a: Some(g.vec(rank * in_f)),
                    bt: g.vec(rank * out),
                    rank,
                    scale: 0.5 + i as f32,
                },
                None => HostPair {
                    a: None,
                    bt: Vec::new(),
                    rank: 0,
                    scale: 0.0,
                },
            })
            .collect()
    }

    #[test]
    fn the_twin_adds_each_rows_own_update_and_nothing_else() {
        let mut g = Lcg(11);
        // The 0.5B's q (896 → 896) and gate (896 → 4864) shapes, a k-sized one, odd ones.
        for (in_f, out, stride, offset) in [
            (896, 896, 1152, 0),
            (896, 128, 1152, 896),
            (896, 4864, 9728, 4864),
            (37, 300, 301, 1),
        ] {
            let ranks = [Some(16), None, Some(8), Some(64)];
            let p = pairs(&mut g, in_f, out, &ranks);
            let max_rank = 64;
            let row_slot = [0, -1, 2, 3, 0, 1, 3, 7];
            let rows = row_slot.len();
            let x = g.vec(rows * in_f);
            let y0 = g.vec(rows * stride);
            let t = emulate_shrink(&x, in_f, &row_slot, &p, max_rank);
            assert!(t.iter().all(|v| v.is_finite()), "every cell written");
            let mut y = y0.clone();
            emulate_expand(&t, &row_slot, &p, max_rank, &mut y, out, stride, offset);
            for r in 0..rows {
                let pair = usize::try_from(row_slot[r]).ok().and_then(|s| p.get(s));
                for c in 0..stride {
                    let (got, before) = (y[r * stride + c], y0[r * stride + c]);
                    let inside = (offset..offset + out).contains(&c);
                    let want = match pair.and_then(|p| p.a.as_ref().map(|a| (p, a))) {
                        Some((p, a)) if inside => {
                            let cc = c - offset;
                            let upd: f64 = (0..p.rank)
                                .map(|j| {
                                    let xa: f64 = (0..in_f)
                                        .map(|k| {
                                            f64::from(x[r * in_f + k]) * f64::from(a[j * in_f + k])
                                        })
                                        .sum();
                                    f64::from(p.scale) * xa * f64::from(p.bt[j * out + cc])
                                })
                                .sum();
                            f64::from(before) + upd
                        }
                        _ => f64::from(before),
                    };
                    let tol = 1e-4 * (1.0 + want.abs()) * (in_f as f64).sqrt();
                    assert!(
                        (f64::from(got) - want).abs() <= tol,
                        "shape {in_f}->{out} row {r} col {c}: {got} vs {want}"
                    );
                    if pair.is_none_or(|p| p.a.is_none()) || !inside {
                        assert_eq!(got.to_bits(), before.to_bits(), "row {r} col {c} untouched");
                    }
                }
            }
        }
    }

    #[test]
    fn a_rows_update_is_the_same_alone_and_in_a_batch() {
        let mut g = Lcg(5);
        let (in_f, out) = (64, 96);
        let p = pairs(&mut g, in_f, out, &[Some(8), Some(16)]);
        let row_slot = [1, 0, -1, 1];
        let x = g.vec(row_slot.len() * in_f);
        let t = emulate_shrink(&x, in_f, &row_slot, &p, 16);
        let mut y = vec![0f32; row_slot.len() * out];
        emulate_expand(&t, &row_slot, &p, 16, &mut y, out, out, 0);
        for r in 0..row_slot.len() {
            let one = [row_slot[r]];
            let xr = &x[r * in_f..(r + 1) * in_f];
            // Alone, with another max_rank: the same bits.
            let t1 = emulate_shrink(xr, in_f, &one, &p, 32);
            let mut y1 = vec![0f32; out];
            emulate_expand(&t1, &one, &p, 32, &mut y1, out, out, 0);
            assert_eq!(
                y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y[r * out..(r + 1) * out]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn the_grids_cover_every_cell_once() {
        for (rows, rank, out) in [
            (1, 1, 1),
            (3, 16, 896),
            (64, 64, 4864),
            (5, 7, 257),
            (70_000, 1, 300),
        ] {
            let (gx, gy) = shrink_grid(rows, rank);
            let mut seen = vec![0u8; rows * rank];
            for r in 0..gx {
                for b in 0..gy {
                    for w in 0..SHRINK_WARPS {
                        let j = b * SHRINK_WARPS + w;
                        if j < rank {
                            seen[r * rank + j] += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1));
            let (ex, ey) = expand_grid(out, rows);
            assert!(ey <= 65_535, "grid.y limit");
            let mut seen = vec![0u8; rows * out];
            for r in 0..ex {
                for b in 0..ey {
                    for th in 0..EXPAND_THREADS {
                        let c = b * EXPAND_THREADS + th;
                        if c < out {
                            seen[r * out + c] += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1));
        }
    }
}
