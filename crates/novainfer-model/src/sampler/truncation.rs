//! Temperature, top-k, top-p and min-p truncation, then one draw, without sorting the vocabulary.
//!
//! Everything works on `d = (logit - max) / temperature <= 0`, the log of a token's
//! probability relative to the most likely token; its weight is `w = exp(d)` and the most
//! likely token weighs exactly 1. The order is top-k, then top-p on the top-k distribution,
//! then min-p (keep `p >= min_p · p_max`, i.e. `d >= ln(min_p)`, a test that renormalising
//! does not change); the most likely token always survives.
//!
//! The row is narrowed to candidates in one pass, and the candidates are never fully sorted:
//! - top-p without top-k: candidates are the tokens with `d >= -NUCLEUS_FIRST_GAP` if they
//!   carry `top_p` of the mass, else those with `d >= -ln(V / (1 - top_p))`: each token
//!   below that weighs less than `(1 - top_p) / V`, all of them together less than
//!   `1 - top_p`, while the row weighs at least 1, so the nucleus is always inside the set;
//! - top-k: candidates start at `d >= -TOP_K_GAP` and widen to the whole row when fewer than
//!   `k` tokens are that close, then `select_nth_unstable` keeps exactly `k`;
//! - top-p's boundary is found with a histogram of the mass by `d` (see [`nucleus_cutoff`]).
//!
//! Ranking is by `d` descending then id ascending: a total order, so ties (at the top-k or
//! top-p boundary) resolve the same way every time.

use std::cmp::Ordering;

use super::row_math::{exp_nonpos, sum_exp_chunked, BlockMaxima, BLOCK, CHUNK};

/// Initial candidate window for top-k, in nats below the maximum. Tokens further away weigh
/// less than 1e-7 of the top token, so the window almost always already holds k tokens.
const TOP_K_GAP: f32 = 16.0;

/// First candidate window for top-p, in nats below the maximum (a weight ratio of 3e-4).
const NUCLEUS_FIRST_GAP: f32 = 8.0;

/// Resolution of the top-p boundary search: ~0.03 nats per bin on the widest window.
const NUCLEUS_BINS: usize = 512;

/// A sequence's truncation settings, as validated by `SamplingParams`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Truncation {
    pub inv_temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
}

/// One token still in the running: `d` as above and its weight `w = exp(d)`, computed once
/// (vectorised) when the candidate is collected.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    id: u32,
    d: f32,
    w: f32,
}

fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    // `d` is never NaN (sanitized rows, finite positive scale), so `partial_cmp` is total
    // here, and unlike `total_cmp` it calls -0 and +0 equal, as the `>=` filters do.
    b.d.partial_cmp(&a.d)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// `c` ranks at or above `cutoff`: `by_rank(c, cutoff) != Greater`, written with
/// non-short-circuit `&`/`|` so that the draw loops stay branch-free.
fn ranks_at_or_above(c: &Candidate, cutoff: &Candidate) -> bool {
    (c.d > cutoff.d) | ((c.d == cutoff.d) & (c.id <= cutoff.id))
}

/// A cutoff that every candidate ranks at or above.
const KEEP_ALL: Candidate = Candidate {
    id: u32::MAX,
    d: f32::NEG_INFINITY,
    w: 0.0,
};

/// `Σ exp((x - max) · scale)` over a row, cached for the one step that owns it.
///
/// The raw logprob pass and an untruncated draw at temperature 1 without penalties need the
/// same sum; the cache lets them share one pass. The key is `(max, scale)`, so the owner must
/// [`invalidate`](Self::invalidate) it whenever the row's contents change.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowSums {
    key: Option<(f32, f32)>,
    total: f64,
    chunks: Vec<f64>,
}

impl RowSums {
    pub fn total(&mut self, row: &[f32], max: f32, scale: f32) -> f64 {
        if self.key != Some((max, scale)) {
            self.total = sum_exp_chunked(row, max, scale, &mut self.chunks);
            self.key = Some((max, scale));
        }
        self.total
    }

    pub fn invalidate(&mut self) {
        self.key = None;
    }
}

/// Buffers reused from step to step so that sampling allocates nothing once warm.
#[derive(Debug, Clone, Default)]
pub(crate) struct Scratch {
    pub sums: RowSums,
    candidates: Vec<Candidate>,
    boundary: Vec<Candidate>,
    chunk_sums: Vec<f64>,
}

/// Picks one token of `row` (sanitized, `maxima` scanned from it) under `t`, using the
/// uniform variate `u` in `[0, 1)`. An all `-inf` row gives token 0.
pub(crate) fn draw(
    row: &[f32],
    maxima: &BlockMaxima,
    t: &Truncation,
    u: f64,
    scratch: &mut Scratch,
) -> u32 {
    let max = maxima.max();
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let scale = t.inv_temperature;
    let log_min_p = if t.min_p > 0.0 {
        t.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let top_k = t.top_k.filter(|&k| k < row.len());
    let use_top_p = t.top_p < 1.0;
    let cands = &mut scratch.candidates;

    if top_k.is_none() && !use_top_p {
        if log_min_p == f32::NEG_INFINITY {
            return draw_whole_row(row, max, scale, u, &mut scratch.sums);
        }
        collect(row, maxima, scale, log_min_p, cands);
        return pick(cands, &KEEP_ALL, log_min_p, u, &mut scratch.chunk_sums);
    }

    // Top-p's mass is over the top-k distribution when top-k is on, else over the whole row.
    let top_p_total = match top_k {
        None => {
            let total = scratch.sums.total(row, max, scale);
            let target = f64::from(t.top_p) * total;
            collect_nucleus_candidates(row, maxima, scale, t.top_p, log_min_p, target, cands);
            total
        }
        Some(k) => {
            // Tokens below min-p still count towards top-p's normaliser under top-k.
            let floor = if use_top_p {
                f32::NEG_INFINITY
            } else {
                log_min_p
            };
            collect_top_k(row, maxima, scale, k, floor, cands);
            cands.iter().map(|c| f64::from(c.w)).sum()
        }
    };
    let cutoff = if use_top_p {
        nucleus_cutoff(
            cands,
            f64::from(t.top_p) * top_p_total,
            &mut scratch.boundary,
        )
    } else {
        KEEP_ALL
    };
    // The most likely token has d = 0 >= ln(min_p) and ranks first, so something survives.
    pick(cands, &cutoff, log_min_p, u, &mut scratch.chunk_sums)
}

/// The last token of the nucleus: the shortest rank-ordered prefix of `cands` whose mass
/// reaches `target`. [`KEEP_ALL`] when rounding leaves the whole set just short.
///
/// Candidates go into `NUCLEUS_BINS` bins by `d`. A bin index is monotone in `d`, so the
/// bins cut the rank order into consecutive runs: every bin before the one where the running
/// mass crosses `target` is kept whole, and only the crossing bin (gathered into `boundary`)
/// is sorted. Linear passes and one small sort, where sorting a wide nucleus (100k tokens
/// on a flat row at high temperature) would take milliseconds.
fn nucleus_cutoff(cands: &[Candidate], target: f64, boundary: &mut Vec<Candidate>) -> Candidate {
    const LAST_BIN: f32 = (NUCLEUS_BINS - 1) as f32;
    // Weights below -88 are exactly 0 (see `exp_nonpos`), so the bins need not reach lower.
    let lowest = cands.iter().fold(0.0f32, |m, c| m.min(c.d)).max(-88.0);
    let inv_width = if lowest < 0.0 {
        NUCLEUS_BINS as f32 / -lowest
    } else {
        0.0
    };
    // Bins count from the top; -inf lands past the last bin and is clamped into it.
    let bin = |c: &Candidate| (-c.d * inv_width).min(LAST_BIN) as usize;
    // Four interleaved histograms: neighbouring candidates often share a bin, and one
    // histogram would chain each addition to the previous one's store.
    let mut partial = [[0.0f64; NUCLEUS_BINS]; 4];
    let mut quads = cands.chunks_exact(4);
    for q in &mut quads {
        for (h, c) in partial.iter_mut().zip(q) {
            h[bin(c)] += f64::from(c.w);
        }
    }
    for c in quads.remainder() {
        partial[0][bin(c)] += f64::from(c.w);
    }
    let bin_mass: [f64; NUCLEUS_BINS] =
        std::array::from_fn(|b| partial.iter().map(|h| h[b]).sum::<f64>());
    let mut mass = 0.0;
    let crossing = bin_mass.iter().position(|&m| {
        let crossed = mass + m >= target;
        if !crossed {
            mass += m;
        }
        crossed
    });
    let Some(crossing) = crossing else {
        return KEEP_ALL;
    };
    boundary.clear();
    boundary.extend(cands.iter().filter(|c| bin(c) == crossing));
    boundary.sort_unstable_by(by_rank);
    boundary
        .iter()
        .find(|c| {
            mass += f64::from(c.w);
            mass >= target
        })
        .or(boundary.last())
        .copied()
        .unwrap_or(KEEP_ALL)
}

/// Replaces `out` with a set of top-ranked tokens that holds the whole nucleus (mass
/// `target`), cut at min-p.
///
/// First tries the tokens within `NUCLEUS_FIRST_GAP` of the top, which is enough whenever
/// the model is fairly sure and costs next to nothing through the block maxima; when those
/// carry less than `target`, falls back to the provable window `-ln(V / (1 - top_p))`.
fn collect_nucleus_candidates(
    row: &[f32],
    maxima: &BlockMaxima,
    scale: f32,
    top_p: f32,
    log_min_p: f32,
    target: f64,
    out: &mut Vec<Candidate>,
) {
    let provable = (-((row.len() as f64) / (1.0 - f64::from(top_p))).ln() as f32).max(log_min_p);
    let first = provable.max(-NUCLEUS_FIRST_GAP);
    collect(row, maxima, scale, first, out);
    if first > provable && out.iter().map(|c| f64::from(c.w)).sum::<f64>() < target {
        collect(row, maxima, scale, provable, out);
    }
}

/// Replaces `out` with the `k` best-ranked tokens whose `d` is at least `floor` (fewer if
/// fewer pass), in no particular order.
fn collect_top_k(
    row: &[f32],
    maxima: &BlockMaxima,
    scale: f32,
    k: usize,
    floor: f32,
    out: &mut Vec<Candidate>,
) {
    let narrow = floor.max(-TOP_K_GAP);
    collect(row, maxima, scale, narrow, out);
    if out.len() < k && narrow > floor {
        collect(row, maxima, scale, floor, out);
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, by_rank);
        out.truncate(k);
    }
}

/// Replaces `out` with every token whose `d` is at least `floor` (rows are NaN-free; `-inf`
/// passes only a `-inf` floor, with weight 0).
///
/// Only blocks whose maximum passes are read: `d` is monotone in the logit, so the block
/// maximum passes exactly when some element does. Inside a block the weights are computed
/// for all 16 at once and the compaction is branch-free, because on a flat row elements
/// pass or fail at random and a branch per element would mispredict half the time.
fn collect(row: &[f32], maxima: &BlockMaxima, scale: f32, floor: f32, out: &mut Vec<Candidate>) {
    const UNSET: Candidate = Candidate {
        id: 0,
        d: 0.0,
        w: 0.0,
    };
    let max = maxima.max();
    out.clear();
    for (start, block_max) in maxima.blocks() {
        if (block_max - max) * scale < floor {
            continue;
        }
        let len = BLOCK.min(row.len() - start);
        let mut padded = [f32::NEG_INFINITY; BLOCK];
        let block: &[f32; BLOCK] = match row[start..start + len].try_into() {
            Ok(full) => full,
            Err(_) => {
                padded[..len].copy_from_slice(&row[start..]);
                &padded
            }
        };
        let mut d = [0.0f32; BLOCK];
        let mut w = [0.0f32; BLOCK];
        for i in 0..BLOCK {
            d[i] = (block[i] - max) * scale;
            w[i] = exp_nonpos(d[i]);
        }
        // Room for the whole block, written in place, then cut back to what passed.
        let num_before = out.len();
        out.resize(num_before + BLOCK, UNSET);
        let dst = &mut out[num_before..];
        let mut n = 0;
        for i in 0..len {
            // `n <= i < BLOCK`, so the mask changes nothing but drops the bounds check.
            dst[n & (BLOCK - 1)] = Candidate {
                id: (start + i) as u32,
                d: d[i],
                w: w[i],
            };
            n += usize::from(d[i] >= floor);
        }
        out.truncate(num_before + n);
    }
}

/// Inverse-CDF draw over the candidates that rank at or above `cutoff` and pass min-p, in
/// their current order.
fn pick(
    cands: &[Candidate],
    cutoff: &Candidate,
    log_min_p: f32,
    u: f64,
    chunk_sums: &mut Vec<f64>,
) -> u32 {
    // Branch-free: on a wide nucleus the test is true or false at random.
    let weight = |c: &Candidate| {
        if (c.d >= log_min_p) & ranks_at_or_above(c, cutoff) {
            c.w
        } else {
            0.0
        }
    };
    chunk_sums.clear();
    chunk_sums.extend(cands.chunks(CHUNK).map(|chunk| sum_by_lanes(chunk, weight)));
    let i = inverse_cdf(chunk_sums, u, cands.len(), |i| weight(&cands[i]));
    cands.get(i).map_or(0, |c| c.id)
}

/// Inverse-CDF draw over the untruncated row, through the cached per-chunk sums.
fn draw_whole_row(row: &[f32], max: f32, scale: f32, u: f64, sums: &mut RowSums) -> u32 {
    sums.total(row, max, scale);
    inverse_cdf(&sums.chunks, u, row.len(), |i| {
        exp_nonpos((row[i] - max) * scale)
    }) as u32
}

/// Index `i` of `len` weights with `Σ_{j<i} w_j <= u·W < Σ_{j<=i} w_j` (`W` the total),
/// given the sums of consecutive `CHUNK`-long runs: the chunk is found from the sums and
/// only that chunk is walked, so a draw reads about 1/150 of a Qwen2 row after the sums.
/// Zero weights are never chosen; 0 when all weights are zero.
fn inverse_cdf(chunk_sums: &[f64], u: f64, len: usize, weight: impl Fn(usize) -> f32) -> usize {
    let target = u * chunk_sums.iter().sum::<f64>();
    let mut before = 0.0;
    let mut chosen = None;
    for (i, &s) in chunk_sums.iter().enumerate() {
        if s > 0.0 {
            chosen = Some(i);
            if before + s > target {
                break;
            }
            before += s;
        }
    }
    let Some(chunk) = chosen else { return 0 };
    let range = chunk * CHUNK..((chunk + 1) * CHUNK).min(len);
    let mut mass = before;
    for i in range.clone() {
        // Adding a zero weight never makes `mass` cross, so no zero-weight index is returned.
        mass += f64::from(weight(i));
        if mass > target {
            return i;
        }
    }
    // Only reached when the chunk's running sum rounds just below its precomputed sum.
    range
        .clone()
        .rev()
        .find(|&i| weight(i) > 0.0)
        .unwrap_or(range.start)
}

/// `Σ f(x)` over a slice in f64 (so that tiny weights next to large ones still count) with
/// independent accumulators, so the additions pipeline.
fn sum_by_lanes<T>(xs: &[T], f: impl Fn(&T) -> f32) -> f64 {
    const LANES: usize = 4;
    let mut acc = [0.0f64; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] += f64::from(f(&c[j]));
        }
    }
    acc.iter().sum::<f64>()
        + chunks
            .remainder()
            .iter()
            .map(|x| f64::from(f(x)))
            .sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanned(row: &[f32]) -> BlockMaxima {
        let mut maxima = BlockMaxima::default();
        assert!(maxima.scan(row), "test rows are clean");
        maxima
    }

    fn t(top_k: Option<usize>, top_p: f32, min_p: f32) -> Truncation {
        Truncation {
            inv_temperature: 1.0,
            top_k,
            top_p,
            min_p,
        }
    }

    /// The set of ids a truncation can return, found by sweeping `u` over [0, 1).
    fn support(row: &[f32], tr: &Truncation) -> Vec<u32> {
        let maxima = scanned(row);
        let mut scratch = Scratch::default();
        let mut ids: Vec<u32> = (0..4000)
            .map(|i| draw(row, &maxima, tr, i as f64 / 4000.0, &mut scratch))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    #[test]
    fn inverse_cdf_walks_ids_in_order() {
        let row = [0.0f32; 4];
        let mut scratch = Scratch::default();
        let picks: Vec<u32> = [0.0, 0.24, 0.26, 0.6, 0.99]
            .iter()
            .map(|&u| draw(&row, &scanned(&row), &t(None, 1.0, 0.0), u, &mut scratch))
            .collect();
        assert_eq!(picks, [0, 0, 1, 2, 3]);
    }

    #[test]
    fn top_k_widens_past_the_gap_and_breaks_ties_by_id() {
        // Three tokens at the top, 2000 tied ones 20 nats below: the first window holds only
        // three candidates, so k = 5 needs the widened scan, which adds the two lowest tied ids.
        let mut row = vec![-20.0f32; 2000];
        row[10..13].fill(0.0);
        let tr = t(Some(5), 1.0, 0.0);
        assert_eq!(support(&row, &tr), vec![10, 11, 12]);
        let mut cands = Vec::new();
        collect_top_k(&row, &scanned(&row), 1.0, 5, f32::NEG_INFINITY, &mut cands);
        let mut ids: Vec<u32> = cands.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 10, 11, 12]);
        // Under min-p the widened scan stops at the min-p floor.
        collect_top_k(&row, &scanned(&row), 1.0, 5, 0.01f32.ln(), &mut cands);
        assert_eq!(cands.len(), 3);
    }

    #[test]
    fn nucleus_on_a_flat_row_is_the_lowest_ids() {
        // 100,000 equal tokens: every one is a candidate; top-p 0.25 keeps the first quarter.
        let row = vec![1.0f32; 100_000];
        let ids = support(&row, &t(None, 0.25, 0.0));
        let highest = *ids.last().expect("the sweep draws something");
        assert!((24_000..25_000).contains(&highest), "{highest}");
    }

    #[test]
    fn nucleus_matches_a_full_sort() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        for trial in 0..200 {
            let n = rng.random_range(1..3000);
            let cands: Vec<Candidate> = (0..n)
                .map(|id| {
                    // Coarse values make ties common; a few -inf and exact zeros too.
                    let d = match rng.random_range(0..20) {
                        0 => f32::NEG_INFINITY,
                        1 => 0.0,
                        _ => -(rng.random_range(0..400) as f32) / 20.0,
                    };
                    Candidate {
                        id,
                        d,
                        w: exp_nonpos(d),
                    }
                })
                .collect();
            let total: f64 = cands.iter().map(|c| f64::from(c.w)).sum();
            let target = rng.random::<f64>() * total;
            let mut oracle = cands.clone();
            oracle.sort_by(by_rank);
            let mut mass = 0.0;
            let want = oracle.iter().position(|c| {
                mass += f64::from(c.w);
                mass >= target
            });
            let cutoff = nucleus_cutoff(&cands, target, &mut Vec::new());
            let ids = |cs: &mut dyn Iterator<Item = &Candidate>| {
                let mut v: Vec<u32> = cs.map(|c| c.id).collect();
                v.sort_unstable();
                v
            };
            let want = want.map_or(oracle.len(), |i| i + 1);
            let got = ids(&mut cands.iter().filter(|c| ranks_at_or_above(c, &cutoff)));
            assert_eq!(got, ids(&mut oracle[..want].iter()), "trial {trial}, n {n}");
        }
    }

    #[test]
    fn whole_row_draw_crosses_chunks() {
        // Weight only at ids 3 and 5000 (chunk 4): half of the draws each.
        let mut row = vec![f32::NEG_INFINITY; 6000];
        row[3] = 2.0;
        row[5000] = 2.0;
        assert_eq!(support(&row, &t(None, 1.0, 0.0)), vec![3, 5000]);
        let mut scratch = Scratch::default();
        assert_eq!(
            draw(&row, &scanned(&row), &t(None, 1.0, 0.0), 0.49, &mut scratch),
            3
        );
        assert_eq!(
            draw(&row, &scanned(&row), &t(None, 1.0, 0.0), 0.51, &mut scratch),
            5000
        );
    }

    #[test]
    fn all_masked_row_gives_token_zero() {
        let row = [f32::NEG_INFINITY; 8];
        let mut scratch = Scratch::default();
        for tr in [t(None, 1.0, 0.0), t(Some(2), 0.5, 0.1), t(None, 0.5, 0.0)] {
            assert_eq!(draw(&row, &scanned(&row), &tr, 0.5, &mut scratch), 0);
        }
    }
}
