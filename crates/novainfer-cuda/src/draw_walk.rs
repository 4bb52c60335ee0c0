//! CPU twin of the random draw's last phase in `kernels/sampling.cu` (`sample_row`): which id a
//! target mass lands on, in the kernel's f32 arithmetic and order.
//!
//! The block's threads each own a contiguous chunk of ids and sum the live weights of their
//! chunk (`s`, from 0, in id order); thread 0 turns those sums into exclusive prefixes with one
//! sequential chain of additions and picks the first thread whose `end = prefix + s` exceeds the
//! target; that thread walks its chunk again to find the id. The walk must reproduce `end` at its
//! last live id, or a target between the walk's final sum and `end` matches no id and the row's
//! fallback (its last live id, for Qwen2 a padding id past the tokenizer) is drawn.

/// A row's live weights (`exp(d)` for ids inside the cut, `None` outside it), split as the kernel
/// splits it among `threads` threads, with what the block computes once before any draw.
pub struct DrawRow<'a> {
    pub weights: &'a [Option<f32>],
    pub threads: usize,
    /// Each thread's sum `s` of its live weights, from 0 in id order.
    pub sums: Vec<f32>,
    /// Thread 0's exclusive prefixes of `sums`, one chain of f32 additions.
    pub prefixes: Vec<f32>,
    /// The chain's end: the row's total mass.
    pub total: f32,
}

/// Where a target landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// The id the walk crossed the target at.
    Id(u32),
    /// No id: the kernel's fallback, the row's last live id with a nonzero weight.
    Fallback(u32),
}

impl<'a> DrawRow<'a> {
    pub fn new(weights: &'a [Option<f32>], threads: usize) -> Self {
        let mut row = Self {
            weights,
            threads,
            sums: Vec::new(),
            prefixes: Vec::new(),
            total: 0.0,
        };
        row.sums = (0..threads)
            .map(|t| row.live(t).fold(0.0f32, |s, w| s + w))
            .collect();
        let mut total = 0.0f32;
        row.prefixes = row
            .sums
            .iter()
            .map(|&s| {
                let before = total;
                total += s;
                before
            })
            .collect();
        row.total = total;
        row
    }

    fn chunk(&self, t: usize) -> std::ops::Range<usize> {
        let vocab = self.weights.len();
        let chunk = vocab.div_ceil(self.threads);
        let begin = (t * chunk).min(vocab);
        begin..(begin + chunk).min(vocab)
    }

    /// Thread `t`'s live (id, weight) in id order.
    fn live_ids(&self, t: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
        self.chunk(t)
            .filter_map(|i| self.weights[i].map(|w| (i, w)))
    }

    fn live(&self, t: usize) -> impl Iterator<Item = f32> + '_ {
        self.live_ids(t).map(|(_, w)| w)
    }

    fn fallback(&self) -> u32 {
        self.weights
            .iter()
            .rposition(|w| w.is_some_and(|w| w > 0.0))
            .unwrap_or(0) as u32
    }

    /// The kernel's draw for `target` (`u · total`, `u` in [0, 1)).
    pub fn land(&self, target: f32) -> Landing {
        let end = |t: usize| self.prefixes.get(t + 1).copied().unwrap_or(self.total);
        let Some(t) = (0..self.threads).find(|&t| end(t) > target) else {
            return Landing::Fallback(self.fallback());
        };
        let before = self.prefixes[t];
        let mut local = 0.0f32;
        for (i, w) in self.live_ids(t) {
            local += w;
            if before + local > target {
                return Landing::Id(i as u32);
            }
        }
        Landing::Fallback(self.fallback())
    }

    /// Thread `t`'s walk as the kernel's first version summed it, from its prefix
    /// (`prefix + w₁ + w₂ + …`): its end, which rounds differently from `prefix + s`.
    pub fn walk_from_prefix_end(&self, t: usize) -> f32 {
        self.live(t).fold(self.prefixes[t], |cum, w| cum + w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform in [0, 1) from a 64-bit LCG (the test needs spread, not quality).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
        fn normal(&mut self) -> f32 {
            let (a, b) = (self.next().max(1e-7), self.next());
            (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
        }
    }

    /// Rows like the kernel's: Qwen2's vocabulary over 1,024 threads, logits normal with a
    /// spread of 3, `exp(x − max)`; some ids outside the cut.
    fn row(rng: &mut Lcg, vocab: usize, dead_every: usize) -> Vec<Option<f32>> {
        let x: Vec<f32> = (0..vocab).map(|_| 3.0 * rng.normal()).collect();
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        x.iter()
            .enumerate()
            .map(|(i, &v)| (dead_every == 0 || i % dead_every != 0).then(|| (v - max).exp()))
            .collect()
    }

    #[test]
    fn a_target_just_below_a_threads_end_lands_in_that_thread() {
        // The gap the first walk left: the largest target that still picks thread t.
        let mut rng = Lcg(7);
        for dead_every in [0, 3] {
            let weights = row(&mut rng, 151_936, dead_every);
            let row = DrawRow::new(&weights, 1024);
            for t in 0..row.threads {
                let end = row.prefixes.get(t + 1).copied().unwrap_or(row.total);
                if row.sums[t] == 0.0 {
                    continue;
                }
                let target = f32::from_bits(end.to_bits() - 1).max(row.prefixes[t]);
                match row.land(target) {
                    Landing::Id(i) => {
                        assert!(row.chunk(t).contains(&(i as usize)), "thread {t}: id {i}")
                    }
                    Landing::Fallback(i) => panic!("thread {t}: target {target} fell back to {i}"),
                }
            }
        }
    }

    #[test]
    fn a_walk_from_the_prefix_can_stop_short_of_its_end() {
        // Why the kernel walks as it does: summed from the prefix, some thread's final sum lands
        // below the `end` that chose it, and a target in between matched no id.
        let mut rng = Lcg(11);
        let mut short = 0;
        for _ in 0..4 {
            let weights = row(&mut rng, 151_936, 0);
            let row = DrawRow::new(&weights, 1024);
            short += (0..row.threads)
                .filter(|&t| row.walk_from_prefix_end(t) < row.prefixes[t] + row.sums[t])
                .count();
        }
        assert!(
            short > 0,
            "no thread's walk stopped short: the regression case is gone"
        );
    }

    #[test]
    fn every_target_below_the_total_lands_on_a_live_id_with_weight() {
        let mut rng = Lcg(3);
        for (vocab, threads, dead_every) in [
            (151_936, 1024, 0),
            (151_936, 1024, 5),
            (3000, 1024, 2),
            (50, 1024, 0),
        ] {
            let weights = row(&mut rng, vocab, dead_every);
            let row = DrawRow::new(&weights, threads);
            let total = row.total;
            for _ in 0..2000 {
                let target = rng.next() * total;
                if target >= total {
                    continue;
                }
                match row.land(target) {
                    Landing::Id(i) => {
                        let w = row.weights[i as usize];
                        assert!(w.is_some_and(|w| w > 0.0), "id {i} has weight {w:?}");
                    }
                    Landing::Fallback(i) => panic!("target {target} of {total} fell back to {i}"),
                }
            }
        }
    }
}
