//! Prompt lookup (n-gram speculation): the longest suffix n-gram of a sequence that occurred
//! before proposes the tokens that followed that earlier occurrence.
//!
//! The index is updated as tokens arrive, so a step costs O(`max_n`) hash operations per
//! sequence, never a rescan: for each n in `min_n..=max_n` it maps an n-gram to where the token
//! after its latest occurrence sits. The suffix itself is never in the map (nothing follows it
//! yet), so a lookup finds an earlier occurrence only.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// vLLM's `prompt_lookup_min` / `prompt_lookup_max`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramRange {
    min_n: usize,
    max_n: usize,
}

impl NgramRange {
    /// `None` unless `1 <= min_n <= max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Option<Self> {
        (1 <= min_n && min_n <= max_n).then_some(Self { min_n, max_n })
    }
    pub fn min_n(self) -> usize {
        self.min_n
    }
    pub fn max_n(self) -> usize {
        self.max_n
    }
}

/// One sequence's tokens and its n-gram index.
#[derive(Debug, Clone)]
pub struct NgramIndex {
    range: NgramRange,
    tokens: Vec<u32>,
    /// Per n (`min_n..=max_n`): hash of an n-gram → index of the token after its latest
    /// occurrence. A hash collision only costs a check (see `propose`).
    follow: Vec<HashMap<u64, usize, FixedState>>,
}

/// A fixed hasher: proposals must not depend on a per-process random seed.
#[derive(Debug, Clone, Copy, Default)]
struct FixedState;

impl BuildHasher for FixedState {
    type Hasher = std::collections::hash_map::DefaultHasher;
    fn build_hasher(&self) -> Self::Hasher {
        std::collections::hash_map::DefaultHasher::new()
    }
}

fn gram_hash(gram: &[u32]) -> u64 {
    let mut h = FixedState.build_hasher();
    for &t in gram {
        h.write_u32(t);
    }
    h.finish()
}

impl NgramIndex {
    pub fn new(range: NgramRange) -> Self {
        Self {
            range,
            tokens: Vec::new(),
            follow: (range.min_n..=range.max_n)
                .map(|_| HashMap::with_hasher(FixedState))
                .collect(),
        }
    }

    /// An index over `tokens` (a prompt).
    pub fn with_tokens(range: NgramRange, tokens: &[u32]) -> Self {
        let mut index = Self::new(range);
        index.extend(tokens);
        index
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends tokens: each makes the n-grams ending just before it point at it.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            let at = self.tokens.len();
            for (i, map) in self.follow.iter_mut().enumerate() {
                let n = self.range.min_n + i;
                if at >= n {
                    map.insert(gram_hash(&self.tokens[at - n..at]), at);
                }
            }
            self.tokens.push(t);
        }
    }

    /// Drops the last `n` tokens (those a verification rejected), forgetting the grams they
    /// ended or followed. Entries of those grams' earlier occurrences are lost too, which
    /// only makes a later proposal miss, never wrong.
    pub fn truncate(&mut self, len: usize) {
        while self.tokens.len() > len {
            let at = self.tokens.len() - 1;
            for (i, map) in self.follow.iter_mut().enumerate() {
                let n = self.range.min_n + i;
                if at >= n {
                    let key = gram_hash(&self.tokens[at - n..at]);
                    if map.get(&key) == Some(&at) {
                        map.remove(&key);
                    }
                }
            }
            self.tokens.pop();
        }
    }

    /// Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    /// n-gram (`max_n` down to `min_n`); empty when none occurred.
    pub fn propose(&self, k: usize) -> Vec<u32> {
        let len = self.tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for (i, map) in self.follow.iter().enumerate().rev() {
            let n = self.range.min_n + i;
            if len < n {
                continue;
            }
            let suffix = &self.tokens[len - n..];
            let Some(&next) = map.get(&gram_hash(suffix)) else {
                continue;
            };
            // A colliding hash would name another gram: check before trusting it.
            if next < n || self.tokens[next - n..next] != *suffix {
                continue;
            }
            let end = (next + k).min(len);
            return self.tokens[next..end].to_vec();
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(min: usize, max: usize) -> NgramRange {
        NgramRange::new(min, max).unwrap()
    }

    /// The reference: scan for the longest suffix gram's latest earlier occurrence.
    fn scan(tokens: &[u32], r: NgramRange, k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (r.min_n..=r.max_n).rev() {
            if len < n {
                continue;
            }
            let suffix = &tokens[len - n..];
            for start in (0..len - n).rev() {
                if &tokens[start..start + n] == suffix {
                    let next = start + n;
                    return tokens[next..(next + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn the_longest_suffix_gram_proposes_what_followed_it_last() {
        let mut idx = NgramIndex::with_tokens(range(1, 3), &[1, 2, 3, 4, 9, 2, 3, 5, 6]);
        idx.extend(&[1, 2, 3]);
        // "1 2 3" occurred at the start: 4 9 2 followed.
        assert_eq!(idx.propose(3), vec![4, 9, 2]);
        idx.extend(&[7]);
        assert_eq!(idx.propose(3), Vec::<u32>::new());
        assert!(NgramRange::new(0, 2).is_none() && NgramRange::new(3, 2).is_none());
    }

    #[test]
    fn the_index_agrees_with_a_scan_as_tokens_arrive_and_are_taken_back() {
        let r = range(2, 4);
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % 5) as u32
        };
        let mut idx = NgramIndex::new(r);
        for step in 0..2000 {
            if step % 7 == 6 && idx.tokens().len() > 3 {
                let len = idx.tokens().len() - 2;
                idx.truncate(len);
                // Truncation may forget earlier occurrences: the index may miss, never invent.
                let got = idx.propose(4);
                let want = scan(idx.tokens(), r, 4);
                assert!(got.is_empty() || got == want, "{got:?} vs {want:?}");
                // Rebuilding the index from scratch restores exact agreement.
                idx = NgramIndex::with_tokens(r, idx.tokens());
            } else {
                idx.extend(&[next()]);
            }
            assert_eq!(idx.propose(4), scan(idx.tokens(), r, 4), "step {step}");
        }
    }
}
