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
/// splits it among `threads` threads.
pub struct DrawRow<'a> {
    pub weights: &'a [Option<f32>],
    pub threads: usize,
}

/// Where a target landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// The id the walk crossed the target at.
    Id(u32),
    /// No id: the kernel's fallback, the row's last live id with a nonzero weight.
    Fallback(u32),
}

impl DrawRow<'_> {
    fn chunk(&self, t: usize) -> std::ops::Range<usize> {
        let vocab = self.weights.len();
        let chunk = vocab.div_ceil(self.threads);
        let begin = (t * chunk).min(vocab);
        begin..(begin + chunk).min(vocab)
    }

    /// Each thread's sum `s` of its live weights, from 0 in id order.
    pub fn thread_sums(&self) -> Vec<f32> {
        (0..self.threads)
            .map(|t| self.chunk(t).filter_map(|i| self.weights[i]).sum())
            .collect()
    }

    /// Thread 0's exclusive prefixes of `sums` and their total, one chain of f32 additions.
    pub fn prefixes(sums: &[f32]) -> (Vec<f32>, f32) {
        let mut total = 0.0f32;
        let prefixes = sums
            .iter()
            .map(|&s| {
                let before = total;
                total += s;
                before
            })
            .collect();
        (prefixes, total)
    }

    fn fallback(&self) -> u32 {
        self.weights
            .iter()
            .rposition(|w| w.is_some_and(|w| w > 0.0))
            .unwrap_or(0) as u32
    }

    /// The kernel's draw for `target` (`u · total`, `u` in [0, 1)).
    pub fn land(&self, target: f32) -> Landing {
        let sums = self.thread_sums();
        let (prefixes, total) = Self::prefixes(&sums);
        let owner = (0..self.threads).find(|&t| {
            let end = if t + 1 < self.threads {
                prefixes[t + 1]
            } else {
                total
            };
            end > target
        });
        let Some(t) = owner else {
            return Landing::Fallback(self.fallback());
        };
        let before = prefixes[t];
        let mut local = 0.0f32;
        for i in self.chunk(t) {
            let Some(w) = self.weights[i] else { continue };
            local += w;
            if before + local > target {
                return Landing::Id(i as u32);
            }
        }
        Landing::Fallback(self.fallback())
    }

    /// The final sum of a walk that starts from the prefix (the kernel's first version): thread
    /// `t`'s `prefix + w₁ + w₂ + …`, which rounds differently from `prefix + s`.
    pub fn walk_from_prefix_end(&self, t: usize, prefix: f32) -> f32 {
        self.chunk(t)
            .filter_map(|i| self.weights[i])
            .fold(prefix, |cum, w| cum + w)
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
    fn the_walk_reaches_its_threads_end_exactly() {
        let mut rng = Lcg(7);
        for dead_every in [0, 3] {
            let weights = row(&mut rng, 151_936, dead_every);
            let row = DrawRow {
                weights: &weights,
                threads: 1024,
            };
            let sums = row.thread_sums();
            let (prefixes, _) = DrawRow::prefixes(&sums);
            for t in 0..row.threads {
                // The kernel's walk: its own sum from 0, added to the prefix the way thread 0 did.
                let local: f32 = row.chunk(t).filter_map(|i| row.weights[i]).sum();
                assert_eq!(
                    (prefixes[t] + local).to_bits(),
                    (prefixes[t] + sums[t]).to_bits()
                );
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
            let row = DrawRow {
                weights: &weights,
                threads: 1024,
            };
            let sums = row.thread_sums();
            let (prefixes, _) = DrawRow::prefixes(&sums);
            short += (0..row.threads)
                .filter(|&t| row.walk_from_prefix_end(t, prefixes[t]) < prefixes[t] + sums[t])
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
            let row = DrawRow {
                weights: &weights,
                threads,
            };
            let (_, total) = DrawRow::prefixes(&row.thread_sums());
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
