//! Whole-row passes over one logits row: block maxima, chunked sums of exponentials, top-n.
//!
//! A row is a whole vocabulary (151,936 entries for Qwen2), so every pass here is written
//! in the shape LLVM turns into AVX2 code (the workspace builds for x86-64-v3): fixed-size
//! blocks and independent accumulators, no branch per element. `f32::exp` from libm would
//! not vectorise, hence [`exp_nonpos`].
//!
//! [`BlockMaxima`] records the maximum of every [`BLOCK`] of the row in the first pass;
//! later passes that want only the large entries (top-n, candidate collection) read those
//! 38 KB instead of the 600 KB row and touch only the blocks that can matter. (Testing each
//! block's maximum and branching inside the streaming pass instead was measured to make the
//! top-20 logprobs cost about 0.3 ms per token rather than 0.02 ms.)
//!
//! Invariant: rows reaching these functions after [`sanitize`] contain no NaN and no `+inf`;
//! `-inf` is allowed and means "never pick this token".

/// Independent accumulators per pass; 8 f32 lanes fill one AVX2 register.
const LANES: usize = 8;

/// Elements per partial sum: short enough that an f32 running sum stays accurate to about
/// 1e-6 relative, long enough that the f64 list of partial sums stays tiny (149 for Qwen2).
pub(crate) const CHUNK: usize = 1024;

/// `exp(d)` for `d <= 0`, to about 2 ulp; `d <= -88`, `-inf` and NaN give exactly 0.
///
/// Range reduction `d = n·ln2 + r` with `|r| <= ln2/2` (ln2 split in two parts so `r` is
/// exact), a degree-6 Taylor polynomial for `exp(r)` (truncation error < 1.3e-7), then `2^n`
/// written straight into the exponent bits. Adding 1.5·2^23 rounds `d·log2(e)` to the
/// integer `n` and leaves it in the low mantissa bits, which avoids a float→int conversion.
/// Clamping at -88 gives `n = -127`, whose `2^n` bit pattern is 0, so tiny weights come out
/// exactly 0 without a final select: LLVM turns such a select into a branch, and the
/// branch stops it from vectorising the callers' loops (measured: 6× slower).
#[inline(always)]
pub(crate) fn exp_nonpos(d: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const SHIFTER: f32 = 12_582_912.0;
    // Written as a comparison so that NaN also lands on the clamp.
    let x = if d > -88.0 { d } else { -88.0 };
    let t = x * LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    let r = mul_add(-n, LN2_LO, mul_add(-n, LN2_HI, x));
    let mut p = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = mul_add(p, r, c);
    }
    let n_plus_bias = t
        .to_bits()
        .wrapping_sub(SHIFTER.to_bits())
        .wrapping_add(127);
    p * f32::from_bits(n_plus_bias << 23)
}

/// `a·b + c`, fused when the target has FMA (the workspace builds for x86-64-v3: 40% faster
/// row sums, measured). Without FMA, `f32::mul_add` would call libm's software `fmaf`,
/// far slower than the two plain operations used instead.
#[inline(always)]
fn mul_add(a: f32, b: f32, c: f32) -> f32 {
    if cfg!(target_feature = "fma") {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Replaces NaN with `-inf` and `+inf` with `f32::MAX` so that every later comparison and
/// subtraction is well defined. Rows rarely need it: [`BlockMaxima::scan`] says when.
pub(crate) fn sanitize(row: &mut [f32]) {
    for x in row.iter_mut() {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
    }
}

/// Elements per block of [`BlockMaxima`]: two AVX2 registers.
pub(crate) const BLOCK: usize = 16;

/// The maximum of each `BLOCK`-long run of a row (the last, shorter run included) and of
/// the whole row. Only valid for the row contents it was scanned from.
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockMaxima {
    maxima: Vec<f32>,
    max: f32,
}

impl BlockMaxima {
    /// Rescans `row`. Returns false when the row holds NaN or `+inf`: the maxima are then
    /// meaningless, and the caller must [`sanitize`] the row and scan it again.
    pub fn scan(&mut self, row: &[f32]) -> bool {
        self.maxima.clear();
        let mut dirty = [false; BLOCK];
        let mut blocks = row.chunks_exact(BLOCK);
        for block in &mut blocks {
            let block: &[f32; BLOCK] = block
                .try_into()
                .expect("chunks_exact yields full blocks: this is a bug");
            for (dirty, &x) in dirty.iter_mut().zip(block) {
                // Non-short-circuit `|` keeps the loop branch-free.
                *dirty |= x.is_nan() | (x == f32::INFINITY);
            }
            self.maxima.push(block_max(block));
        }
        let tail = blocks.remainder();
        if !tail.is_empty() {
            let mut padded = [f32::NEG_INFINITY; BLOCK];
            padded[..tail.len()].copy_from_slice(tail);
            dirty[0] |= tail.iter().any(|&x| x.is_nan() || x == f32::INFINITY);
            self.maxima.push(block_max(&padded));
        }
        self.max = self.maxima.iter().copied().fold(f32::NEG_INFINITY, max);
        !dirty.contains(&true)
    }

    /// The row maximum, `-inf` for an empty or all `-inf` row.
    pub fn max(&self) -> f32 {
        self.max
    }

    /// `(index of the block's first element, block maximum)` for every block.
    pub fn blocks(&self) -> impl Iterator<Item = (usize, f32)> + '_ {
        self.maxima.iter().enumerate().map(|(b, &m)| (b * BLOCK, m))
    }
}

/// Maximum of one (NaN-free) block, reduced as a tree (16 → 8 → 4 → 2 → 1) so that every
/// step is one vector `vmaxps`; a linear fold would stay scalar.
#[inline(always)]
fn block_max(block: &[f32; BLOCK]) -> f32 {
    let m8: [f32; 8] = std::array::from_fn(|j| max(block[j], block[j + 8]));
    let m4: [f32; 4] = std::array::from_fn(|j| max(m8[j], m8[j + 4]));
    let m2: [f32; 2] = std::array::from_fn(|j| max(m4[j], m4[j + 2]));
    max(m2[0], m2[1])
}

/// `a > b ? a : b`, which lowers to `vmaxps` (unlike `f32::max` with its NaN rules).
#[inline(always)]
fn max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Lowest index holding the row maximum (so ties resolve to the lowest token id); 0 for an
/// empty or all `-inf` row, which leaves the caller a valid id.
pub(crate) fn first_index_of_max(row: &[f32], maxima: &BlockMaxima) -> usize {
    let max = maxima.max();
    maxima
        .blocks()
        .find(|&(_, m)| m == max)
        .and_then(|(start, _)| {
            row[start..]
                .iter()
                .position(|&x| x == max)
                .map(|i| start + i)
        })
        .unwrap_or(0)
}

/// `Σ exp((x - max) · scale)` over the row, also pushing one partial sum per [`CHUNK`]
/// elements into `chunk_sums` (cleared first) so that a later draw can find its chunk
/// without a second full pass. `max` must be the row maximum and `scale > 0`.
pub(crate) fn sum_exp_chunked(row: &[f32], max: f32, scale: f32, chunk_sums: &mut Vec<f64>) -> f64 {
    chunk_sums.clear();
    let mut total = 0.0f64;
    for chunk in row.chunks(CHUNK) {
        let s = f64::from(sum_exp(chunk, max, scale));
        chunk_sums.push(s);
        total += s;
    }
    total
}

/// `Σ exp((x - max) · scale)` over one short slice, in f32 with [`LANES`] accumulators.
fn sum_exp(xs: &[f32], max: f32, scale: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] += exp_nonpos((c[j] - max) * scale);
        }
    }
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&x| exp_nonpos((x - max) * scale))
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// The `n` largest entries as `(id, value)`, sorted by value descending then id ascending.
///
/// Blocks are visited through their maxima: once `n` values are held, a block whose
/// maximum does not beat the n-th is never read.
pub(crate) fn top_n(row: &[f32], maxima: &BlockMaxima, n: usize) -> Vec<(u32, f32)> {
    let n = n.min(row.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (start, m) in maxima.blocks() {
        if best.len() == n && m <= best[n - 1].1 {
            continue;
        }
        for (i, &x) in row[start..(start + BLOCK).min(row.len())]
            .iter()
            .enumerate()
        {
            // Strictly greater: an equal value arriving later has a higher id and loses the tie.
            if best.len() == n && x <= best[n - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, v)| v >= x);
            best.insert(at, ((start + i) as u32, x));
            best.truncate(n);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_over_the_whole_range() {
        let mut worst = 0.0f64;
        let mut d = 0.0f32;
        while d > -86.9 {
            let rel = ((f64::from(exp_nonpos(d)) - f64::from(d).exp()) / f64::from(d).exp()).abs();
            worst = worst.max(rel);
            d -= 0.000_37;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-88.0), 0.0);
        assert!(exp_nonpos(-87.5) < 2e-38);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(f32::NAN), 0.0);
    }

    fn scanned(row: &[f32]) -> BlockMaxima {
        let mut maxima = BlockMaxima::default();
        assert!(maxima.scan(row), "test rows are clean");
        maxima
    }

    #[test]
    fn scan_flags_nan_and_infinity_and_sanitize_maps_them() {
        let mut row = vec![1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 2.0];
        let mut maxima = BlockMaxima::default();
        assert!(!maxima.scan(&row));
        sanitize(&mut row);
        assert_eq!(
            row[..4],
            [1.0, f32::NEG_INFINITY, f32::MAX, f32::NEG_INFINITY]
        );
        assert!(maxima.scan(&row));
        assert_eq!(maxima.max(), f32::MAX);
        assert!(!maxima.scan(&[f32::NAN; 11]));
        assert!(!maxima.scan(&[0.0, 1.0, f32::INFINITY]));
    }

    #[test]
    fn block_maxima_cover_every_block_including_the_last_short_one() {
        // 37 elements: blocks [0, 16), [16, 32), [32, 37).
        let row: Vec<f32> = (0..37).map(|i| ((i * 7) % 37) as f32).collect();
        let maxima = scanned(&row);
        let want: Vec<(usize, f32)> = row
            .chunks(BLOCK)
            .enumerate()
            .map(|(b, c)| (b * BLOCK, c.iter().copied().fold(f32::MIN, f32::max)))
            .collect();
        assert_eq!(maxima.blocks().collect::<Vec<_>>(), want);
        assert_eq!(maxima.max(), 36.0);
        assert_eq!(scanned(&[]).max(), f32::NEG_INFINITY);
    }

    #[test]
    fn first_index_of_max_prefers_the_lowest_id() {
        let mut row = vec![0.5f32; 40];
        (row[20], row[23], row[35]) = (3.0, 3.0, 3.0);
        assert_eq!(first_index_of_max(&row, &scanned(&row)), 20);
        let masked = [f32::NEG_INFINITY; 4];
        assert_eq!(first_index_of_max(&masked, &scanned(&masked)), 0);
    }

    #[test]
    fn chunked_sum_matches_f64_reference() {
        let row: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
            .collect();
        let max = scanned(&row).max();
        let mut chunks = Vec::new();
        let got = sum_exp_chunked(&row, max, 1.0 / 0.7, &mut chunks);
        let want: f64 = row
            .iter()
            .map(|&x| ((f64::from(x) - f64::from(max)) / 0.7).exp())
            .sum();
        assert!(((got - want) / want).abs() < 1e-6, "{got} vs {want}");
        assert_eq!(chunks.len(), 5);
        assert!((chunks.iter().sum::<f64>() - got).abs() < 1e-9);
    }

    #[test]
    fn top_n_is_sorted_with_ties_by_id() {
        let row = [1.0, 5.0, 3.0, 5.0, f32::NEG_INFINITY, 3.0, 0.0];
        let top = |row: &[f32], n| top_n(row, &scanned(row), n);
        assert_eq!(top(&row, 4), vec![(1, 5.0), (3, 5.0), (2, 3.0), (5, 3.0)]);
        assert_eq!(top(&row, 0), vec![]);
        assert_eq!(top(&row, 100).len(), row.len());
        // Across blocks: the winners sit in blocks 0, 3 and 6 of a 100-long row.
        let mut long = vec![0.0f32; 100];
        (long[5], long[50], long[99]) = (2.0, 3.0, 2.0);
        assert_eq!(
            top(&long, 4),
            vec![(50, 3.0), (5, 2.0), (99, 2.0), (0, 0.0)]
        );
    }
}
