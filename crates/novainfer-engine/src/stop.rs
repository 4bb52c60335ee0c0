//! Stop strings over a stream of text deltas.
//!
//! Invariants: text is emitted as soon as it can no longer be part of a stop string; what is held
//! back is the longest suffix of the pending text that is a proper prefix of some stop string, so
//! at most `max(len(stop)) - 1` bytes, always starting on a char boundary. The stop string itself
//! is never emitted. The stream stops at the stop occurrence that *ends* first (the one a
//! character-by-character stream would complete first); among occurrences ending at the same byte
//! the longest wins. Hence the output does not depend on how the text was split into deltas.

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that is final: no stop string can start in it any more.
    pub emit: String,
    /// A stop string completed; `emit` ends right before it and later input is ignored.
    pub stopped: bool,
}

#[derive(Debug, Clone)]
pub struct StopStringMatcher {
    stops: Vec<String>,
    max_stop_len: usize,
    pending: String,
    matched: Option<usize>,
    /// Emit the stop string itself before stopping (`include_stop_str_in_output`).
    include_stop: bool,
}

impl StopStringMatcher {
    /// Empty stop strings are ignored: they would match before any text.
    pub fn new(stops: &[String]) -> StopStringMatcher {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_stop_len = stops.iter().map(String::len).max().unwrap_or(0);
        StopStringMatcher {
            stops,
            max_stop_len,
            pending: String::new(),
            matched: None,
            include_stop: false,
        }
    }

    /// Makes the matched stop string part of the output (text after it is still dropped).
    pub fn including_stop(mut self, include: bool) -> StopStringMatcher {
        self.include_stop = include;
        self
    }

    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.matched.is_some() {
            return StopOutput {
                emit: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(delta);
        if let Some((start, stop_index)) = self.first_completed_stop() {
            let end = if self.include_stop {
                start + self.stops[stop_index].len()
            } else {
                start
            };
            self.pending.truncate(end);
            self.matched = Some(stop_index);
            return StopOutput {
                emit: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let held_from = self.held_suffix_start();
        let emit: String = self.pending.drain(..held_from).collect();
        StopOutput {
            emit,
            stopped: false,
        }
    }

    /// The held-back text at the end of the stream (empty once stopped: it was never output).
    pub fn flush(&mut self) -> String {
        if self.matched.is_some() {
            return String::new();
        }
        std::mem::take(&mut self.pending)
    }

    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended the stream (OpenAI-style `stop_reason`).
    pub fn matched_stop(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// `(start, index into stops)` of the occurrence that ends first, longest on a tie.
    /// A stop's first occurrence is also its earliest-ending one, since all have its length.
    fn first_completed_stop(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| self.pending.find(stop.as_str()).map(|start| (start, i)))
            .min_by_key(|&(start, i)| (start + self.stops[i].len(), start))
    }

    /// Start of the longest suffix of `pending` that is a proper prefix of a stop string; only
    /// suffixes shorter than the longest stop can qualify. `pending.len()` when none does.
    fn held_suffix_start(&self) -> usize {
        let lowest = self
            .pending
            .len()
            .saturating_sub(self.max_stop_len.saturating_sub(1));
        (lowest..self.pending.len())
            .filter(|&i| self.pending.is_char_boundary(i))
            .find(|&i| {
                let suffix = &self.pending[i..];
                self.stops.iter().any(|stop| stop.starts_with(suffix))
            })
            .unwrap_or(self.pending.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopStringMatcher {
        let stops: Vec<String> = stops.iter().map(|s| (*s).to_owned()).collect();
        StopStringMatcher::new(&stops)
    }

    fn out(emit: &str, stopped: bool) -> StopOutput {
        StopOutput {
            emit: emit.to_owned(),
            stopped,
        }
    }

    #[test]
    fn an_included_stop_ends_the_output() {
        let mut m = matcher(&["STOP"]).including_stop(true);
        assert_eq!(m.push("one ST"), out("one ", false));
        assert_eq!(m.push("OP two"), out("STOP", true));
        assert_eq!(m.matched_stop(), Some("STOP"));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn no_stops_passes_text_through() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("hello"), out("hello", false));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn stop_spanning_three_deltas() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("one S"), out("one ", false));
        assert_eq!(m.push("T"), out("", false));
        assert_eq!(m.push("OP two"), out("", true));
        assert_eq!(m.matched_stop(), Some("STOP"));
        assert_eq!(m.push("more"), out("", true));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn false_start_is_released() {
        let mut m = matcher(&["abc"]);
        assert_eq!(m.push("xab"), out("x", false));
        assert_eq!(m.push("x"), out("abx", false));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn held_back_prefix_is_flushed_at_end() {
        let mut m = matcher(&["abc"]);
        assert_eq!(m.push("xyab"), out("xy", false));
        assert_eq!(m.flush(), "ab");
    }

    #[test]
    fn earliest_ending_of_overlapping_stops_wins() {
        // "bcd" ends before "abcde" would; the shorter, earlier-ending one stops the stream.
        let mut m = matcher(&["abcde", "bcd"]);
        assert_eq!(m.push("xab"), out("x", false));
        assert_eq!(m.push("cd"), out("a", true));
        assert_eq!(m.matched_stop(), Some("bcd"));

        // Same end: the longer one is removed whole.
        let mut m = matcher(&["c", "abc"]);
        assert_eq!(m.push("xabc"), out("x", true));
        assert_eq!(m.matched_stop(), Some("abc"));
    }

    #[test]
    fn holds_only_the_longest_viable_suffix() {
        // "aab": suffixes "ab" and "b" are prefixes of "abx"/"bx"; "aab" is not a prefix of any.
        let mut m = matcher(&["abx", "bxy"]);
        assert_eq!(m.push("aab"), out("a", false));
        assert_eq!(m.pending, "ab");
    }

    #[test]
    fn multibyte_characters_split_on_char_boundaries() {
        let mut m = matcher(&["世界!"]);
        assert_eq!(m.push("你好世"), out("你好", false));
        assert_eq!(m.push("界"), out("", false));
        assert_eq!(m.push("?"), out("世界?", false));
        assert_eq!(m.push("🙂世界!"), out("🙂", true));

        let mut m = matcher(&["é"]);
        assert_eq!(m.push("café"), out("caf", true));
    }

    /// xorshift64*: deterministic randomness without a dependency.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
        }
    }

    /// The whole-string oracle: cut at the earliest-ending occurrence, longest on a tie.
    fn stop_whole(text: &str, stops: &[&str]) -> (String, bool) {
        let hit = stops
            .iter()
            .filter_map(|s| text.find(s).map(|start| (start + s.len(), start)))
            .min();
        match hit {
            Some((_, start)) => (text[..start].to_owned(), true),
            None => (text.to_owned(), false),
        }
    }

    #[test]
    fn random_splits_match_whole_string_stopping() {
        let alphabet = ["a", "b", "c", "é", "🙂", " "];
        let stop_sets: [&[&str]; 4] = [
            &["abc"],
            &["ab", "bcé", "🙂a"],
            &["cc", "c🙂c", "aaa"],
            &["é🙂", "🙂é🙂", "b a"],
        ];
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for stops in stop_sets {
            let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
            for _ in 0..400 {
                let len = rng.below(24);
                let text: String = (0..len)
                    .map(|_| alphabet[rng.below(alphabet.len())])
                    .collect();
                let boundaries: Vec<usize> = (0..=text.len())
                    .filter(|&i| text.is_char_boundary(i))
                    .collect();
                let mut cuts: Vec<usize> = (0..rng.below(6))
                    .map(|_| boundaries[rng.below(boundaries.len())])
                    .collect();
                cuts.push(text.len());
                cuts.sort_unstable();

                let mut m = matcher(stops);
                let (mut total, mut stopped, mut from) = (String::new(), false, 0);
                for cut in cuts {
                    let step = m.push(&text[from..cut]);
                    from = cut;
                    total.push_str(&step.emit);
                    stopped |= step.stopped;
                    assert!(
                        m.pending.len() < max_len.max(1),
                        "held too much: {:?}",
                        m.pending
                    );
                }
                total.push_str(&m.flush());
                assert_eq!(
                    (total, stopped),
                    stop_whole(&text, stops),
                    "text {text:?} stops {stops:?}"
                );
            }
        }
    }
}
