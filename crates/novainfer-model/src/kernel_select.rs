//! Choosing among bit-identical kernel implementations by measured speed.
//!
//! Our CPU kernels come in several instruction sets (attention: portable, AVX2, AVX-512;
//! quantized matmul: AVX2, AVX-VNNI, AVX-512 VNNI) that compute the same bits by
//! construction. Which is fastest is a property of the CPU, not of its feature flags: the
//! same AVX-512 code can win on one Xeon and lose on a Zen 4, which splits 512-bit
//! operations into two halves. So the widest detected ISA is no longer chosen blindly: each
//! kernel family runs a small fixed problem through every candidate at first use, rejects a
//! candidate whose output differs in a single bit from the baseline's, and keeps the fastest
//! (the choice is memoised for the process by the caller).
//!
//! The rule, [`select`], takes the stopwatch as an argument so that tests drive it with a
//! fake one. Every choice is logged (`tracing`, target `novainfer::kernels`) and kept in
//! [`selections`], so `novainfer bench` and bug reports can say which code ran.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One implementation to consider: `run` computes the family's fixed problem once and
/// returns its output.
pub(crate) struct Candidate<'a, T> {
    pub choice: T,
    pub name: &'static str,
    pub run: Box<dyn FnMut() -> Vec<f32> + 'a>,
}

impl<'a, T> Candidate<'a, T> {
    pub(crate) fn new(choice: T, name: &'static str, run: impl FnMut() -> Vec<f32> + 'a) -> Self {
        Self {
            choice,
            name,
            run: Box::new(run),
        }
    }
}

/// Untimed runs per candidate after its bit check, interleaved, before any timing: the first
/// kernel timed in a process ran up to 5x slow for a few milliseconds (seen on a Xeon VM).
pub(crate) const WARMUP: usize = 2;

/// Timed runs per candidate, interleaved (candidate A, B, A, B, ...), the fastest kept: a
/// burst of other work on the machine slows one run, not one candidate.
pub(crate) const ROUNDS: usize = 5;

/// How much faster than the baseline another candidate must be to replace it: within it the
/// two are a tie that noise could flip from run to run (memory-bound decode on a large matrix
/// runs at the bus's speed whatever the ISA), and the baseline is the code every test
/// machine runs.
pub(crate) const MARGIN: f64 = 0.05;

/// How a [`Selection`] was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The fastest of the candidates that passed the bit check.
    Timed,
    /// Named by the environment variable (`NOVAINFER_*_ISA`); nothing was timed.
    Forced { var: &'static str },
    /// Only one candidate was left; nothing was timed.
    Only,
}

/// A kernel family's choice, as logged.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The kernel family and its problem, e.g. `attention (head_dim 64, 7 heads per KV head, f16)`.
    pub kernel: String,
    pub chosen: &'static str,
    pub decision: Decision,
    /// Each timed candidate's fastest run, in the order given (empty unless `Timed`).
    pub timings: Vec<(&'static str, Duration)>,
    /// Candidates whose output differed from the baseline's (a bug in that code path).
    pub rejected: Vec<&'static str>,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kernel, self.chosen)?;
        match &self.decision {
            Decision::Forced { var } => write!(f, " (forced by {var})")?,
            Decision::Only => write!(f, " (the only candidate)")?,
            Decision::Timed => {
                let best = self
                    .timings
                    .iter()
                    .find(|(n, _)| *n == self.chosen)
                    .map_or(Duration::ZERO, |t| t.1);
                let others: Vec<String> = self
                    .timings
                    .iter()
                    .filter(|(n, _)| *n != self.chosen)
                    .map(|(n, t)| {
                        let ratio = t.as_secs_f64() / best.as_secs_f64().max(1e-12);
                        if ratio >= 1.0 {
                            format!("{ratio:.2}x faster than {n} ({best:.2?} vs {t:.2?})")
                        } else {
                            // The baseline kept within the margin.
                            format!(
                                "{n} {:.2}x faster, within the margin ({best:.2?} vs {t:.2?})",
                                1.0 / ratio
                            )
                        }
                    })
                    .collect();
                write!(f, " ({})", others.join(", "))?;
            }
        }
        if !self.rejected.is_empty() {
            write!(
                f,
                "; rejected for output bits differing from {}: {}",
                self.baseline_name(),
                self.rejected.join(", ")
            )?;
        }
        Ok(())
    }
}

impl Selection {
    fn baseline_name(&self) -> &'static str {
        self.timings.first().map_or(self.chosen, |t| t.0)
    }
}

/// Wall time of one run, and its output.
pub(crate) fn wall_clock(run: &mut dyn FnMut() -> Vec<f32>) -> (Duration, Vec<f32>) {
    let start = Instant::now();
    let out = run();
    (start.elapsed(), out)
}

/// Chooses among `candidates` (at least one; the first is the baseline, the code every test
/// machine runs, whose output the others must reproduce bit for bit):
/// * `forced`, a candidate's name (from `var`), wins outright where it is a candidate; a
///   name that is not (an ISA this CPU lacks) is ignored and the rule below applies;
/// * otherwise each candidate runs once untimed (warming caches and pages) and is rejected if
///   its output differs in any bit from the baseline's; the survivors run [`WARMUP`] more
///   rounds untimed, then are timed [`ROUNDS`]
///   times each, interleaved, with `time`, and the fastest minimum wins (the earlier
///   candidate on a tie), provided it beats the baseline's by `margin` (a fraction: [`MARGIN`]
///   unless the family knows its problem to be less representative); else the baseline.
///
/// Returns the chosen candidate's value and the record of the choice (not yet logged: see
/// [`record`]).
// The stopwatch's type is spelled out: behind an alias its higher-ranked lifetimes no
// longer accept `wall_clock`.
#[allow(clippy::type_complexity)]
pub(crate) fn select<T: Copy>(
    kernel: String,
    forced: Option<(&'static str, &str)>,
    candidates: Vec<Candidate<'_, T>>,
    margin: f64,
    time: &mut dyn FnMut(&mut dyn FnMut() -> Vec<f32>) -> (Duration, Vec<f32>),
) -> (T, Selection) {
    select_keeping(kernel, forced, candidates, None, margin, time)
}

/// [`select`], except that the margin protects `incumbent` (a candidate's name) rather than
/// the baseline, where it is a candidate and passed the bit check: a family whose timing
/// problem cannot tell its candidates apart names the choice other evidence favours. The
/// baseline's output stays the reference for the bit check.
#[allow(clippy::type_complexity)]
pub(crate) fn select_keeping<T: Copy>(
    kernel: String,
    forced: Option<(&'static str, &str)>,
    mut candidates: Vec<Candidate<'_, T>>,
    incumbent: Option<&str>,
    margin: f64,
    time: &mut dyn FnMut(&mut dyn FnMut() -> Vec<f32>) -> (Duration, Vec<f32>),
) -> (T, Selection) {
    assert!(!candidates.is_empty(), "select needs a baseline candidate");
    let done = |c: &Candidate<'_, T>, decision, timings, rejected| {
        let s = Selection {
            kernel: kernel.clone(),
            chosen: c.name,
            decision,
            timings,
            rejected,
        };
        (c.choice, s)
    };
    if let Some((var, name)) = forced {
        if let Some(c) = candidates.iter().find(|c| c.name == name) {
            return done(c, Decision::Forced { var }, Vec::new(), Vec::new());
        }
    }
    if candidates.len() == 1 {
        return done(&candidates[0], Decision::Only, Vec::new(), Vec::new());
    }
    let want = (candidates[0].run)();
    let mut rejected = Vec::new();
    let mut index = 0;
    candidates.retain_mut(|c| {
        index += 1;
        if index == 1 {
            return true; // the baseline: `want` is its output
        }
        let got = (c.run)();
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            rejected.push(c.name);
        }
        same
    });
    if candidates.len() == 1 {
        return done(&candidates[0], Decision::Only, Vec::new(), rejected);
    }
    for _ in 0..WARMUP {
        for c in candidates.iter_mut() {
            (c.run)();
        }
    }
    let mut best = vec![Duration::MAX; candidates.len()];
    for _ in 0..ROUNDS {
        for (c, b) in candidates.iter_mut().zip(&mut best) {
            let (t, _) = time(&mut c.run);
            *b = (*b).min(t);
        }
    }
    // `min_by_key` keeps the first of equal keys: the earlier candidate on a tie.
    let fastest = (0..candidates.len()).min_by_key(|&i| best[i]).unwrap_or(0);
    let kept = incumbent
        .and_then(|name| candidates.iter().position(|c| c.name == name))
        .unwrap_or(0);
    let winner = if best[fastest].as_secs_f64() * (1.0 + margin) <= best[kept].as_secs_f64() {
        fastest
    } else {
        kept
    };
    let timings = candidates.iter().map(|c| c.name).zip(best).collect();
    done(&candidates[winner], Decision::Timed, timings, rejected)
}

static SELECTIONS: Mutex<Vec<Selection>> = Mutex::new(Vec::new());

/// Logs `s` and keeps it for [`selections`].
pub(crate) fn record(s: &Selection) {
    if s.rejected.is_empty() {
        tracing::info!(target: "novainfer::kernels", "{s}");
    } else {
        // A rejected candidate is a kernel bug on this CPU: worth a report.
        tracing::warn!(target: "novainfer::kernels", "{s} (please report it with this CPU's model)");
    }
    SELECTIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(s.clone());
}

/// Every kernel choice this process has made so far, in order.
pub fn selections() -> Vec<Selection> {
    SELECTIONS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The value of `var` if set and non-empty: a candidate's name to force.
pub(crate) fn forced_by(var: &'static str) -> Option<(&'static str, String)> {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .map(|v| (var, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::cell::Cell;

    /// A fake stopwatch: each run of candidate `i` "takes" `times[i][k]` on its `k`-th timed
    /// run (the last entry repeating); the candidates say who ran through `last`.
    fn fake<'a>(
        times: Vec<Vec<u64>>,
        last: &'a Cell<usize>,
    ) -> impl FnMut(&mut dyn FnMut() -> Vec<f32>) -> (Duration, Vec<f32>) + 'a {
        let mut calls = vec![0usize; times.len()];
        move |run| {
            let out = run();
            let i = last.get();
            let k = calls[i].min(times[i].len() - 1);
            calls[i] += 1;
            (Duration::from_micros(times[i][k]), out)
        }
    }

    /// Candidate `i` named `names[i]`, output `[1.0]`, or `[1.0 + 1 ulp]` for those in
    /// `wrong`; each run counted in `runs[i]` and noted in `last`.
    fn candidates<'a>(
        names: &[&'static str],
        wrong: &[&str],
        runs: &'a [Cell<usize>],
        last: &'a Cell<usize>,
    ) -> Vec<Candidate<'a, usize>> {
        names
            .iter()
            .enumerate()
            .map(|(i, &name)| {
                let value = if wrong.contains(&name) {
                    f32::from_bits(1.0f32.to_bits() + 1)
                } else {
                    1.0
                };
                let runs = &runs[i];
                Candidate::new(i, name, move || {
                    runs.set(runs.get() + 1);
                    last.set(i);
                    vec![value]
                })
            })
            .collect()
    }

    fn counters(n: usize) -> Vec<Cell<usize>> {
        (0..n).map(|_| Cell::new(0)).collect()
    }

    #[test]
    fn the_fastest_minimum_wins_and_the_log_says_by_how_much() {
        let last = Cell::new(0);
        let runs = counters(3);
        let c = candidates(&["avx2", "vnni256", "avx512"], &[], &runs, &last);
        // avx512's runs are noisy but its best (60) beats avx2's best (100) and vnni's (90).
        let mut time = fake(
            vec![vec![120, 100, 130], vec![90], vec![300, 60, 400]],
            &last,
        );
        let (chosen, s) = select("qmatmul".into(), None, c, MARGIN, &mut time);
        assert_eq!(
            (chosen, s.chosen, s.decision.clone()),
            (2, "avx512", Decision::Timed)
        );
        assert_eq!(
            s.timings,
            vec![
                ("avx2", Duration::from_micros(100)),
                ("vnni256", Duration::from_micros(90)),
                ("avx512", Duration::from_micros(60)),
            ]
        );
        // One untimed run each (the baseline's is the reference), WARMUP more, then ROUNDS
        // timed ones.
        assert!(runs.iter().all(|r| r.get() == 1 + WARMUP + ROUNDS));
        let line = s.to_string();
        assert!(
            line.starts_with("qmatmul: avx512 (1.67x faster than avx2 (60.00µs vs 100.00µs), 1.50x faster than vnni256"),
            "{line}"
        );
    }

    #[test]
    fn the_baseline_wins_where_a_wider_isa_is_slower() {
        let last = Cell::new(0);
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        // The Zen 4 case: the AVX-512 code takes 4x as long.
        let mut time = fake(vec![vec![100], vec![400]], &last);
        let (chosen, s) = select("attention".into(), None, c, MARGIN, &mut time);
        assert_eq!((chosen, s.chosen), (0, "avx2"));
        assert!(s.to_string().contains("4.00x faster than avx512"), "{s}");
    }

    #[test]
    fn an_incumbent_stays_within_the_margin_and_loses_beyond_it_or_when_rejected() {
        let last = Cell::new(0);
        let select_with = |times: Vec<Vec<u64>>, wrong: &[&str]| {
            let runs = counters(3);
            let c = candidates(&["avx2", "vnni256", "avx512"], wrong, &runs, &last);
            let mut time = fake(times, &last);
            let (chosen, s) =
                select_keeping("qmatmul".into(), None, c, Some("avx512"), MARGIN, &mut time);
            (chosen, s.chosen, s.to_string())
        };
        // The baseline 2% faster: the incumbent stays, and the log says by how little.
        let (chosen, name, line) = select_with(vec![vec![100], vec![150], vec![102]], &[]);
        assert_eq!((chosen, name), (2, "avx512"));
        assert!(
            line.contains("avx2 1.02x faster, within the margin"),
            "{line}"
        );
        // 10% faster: the baseline wins.
        let (chosen, _, _) = select_with(vec![vec![100], vec![150], vec![110]], &[]);
        assert_eq!(chosen, 0);
        // Another candidate beyond the margin wins too.
        let (chosen, _, _) = select_with(vec![vec![100], vec![80], vec![100]], &[]);
        assert_eq!(chosen, 1);
        // A rejected incumbent protects nothing: the baseline's rule applies.
        let (chosen, _, line) = select_with(vec![vec![100], vec![150], vec![50]], &["avx512"]);
        assert_eq!(chosen, 0);
        assert!(line.contains("rejected"), "{line}");
    }

    #[test]
    fn within_the_margin_the_baseline_stays() {
        let last = Cell::new(0);
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        // 4% faster: noise on a memory-bound problem.
        let (chosen, s) = select(
            "k".into(),
            None,
            c,
            MARGIN,
            &mut fake(vec![vec![100], vec![96]], &last),
        );
        assert_eq!((chosen, s.decision.clone()), (0, Decision::Timed));
        assert!(
            s.to_string()
                .contains("avx512 1.04x faster, within the margin"),
            "{s}"
        );
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        let (chosen, _) = select(
            "k".into(),
            None,
            c,
            MARGIN,
            &mut fake(vec![vec![100], vec![95]], &last),
        );
        assert_eq!(chosen, 1, "5% faster replaces the baseline");
        // A family's own, wider margin (qmatmul's 1-row decode: 15%).
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        let mut time = fake(vec![vec![100], vec![90]], &last);
        assert_eq!(select("k".into(), None, c, 0.15, &mut time).0, 0);
    }

    #[test]
    fn a_tie_keeps_the_earlier_candidate() {
        let last = Cell::new(0);
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        let (chosen, _) = select(
            "k".into(),
            None,
            c,
            MARGIN,
            &mut fake(vec![vec![50], vec![50]], &last),
        );
        assert_eq!(chosen, 0);
    }

    #[test]
    fn a_candidate_whose_bits_differ_is_rejected_however_fast() {
        let last = Cell::new(0);
        let runs = counters(3);
        let c = candidates(&["avx2", "vnni256", "avx512"], &["avx512"], &runs, &last);
        let mut time = fake(vec![vec![100], vec![90], vec![1]], &last);
        let (chosen, s) = select("qmatmul".into(), None, c, MARGIN, &mut time);
        assert_eq!((chosen, s.rejected.clone()), (1, vec!["avx512"]));
        // The rejected one ran once (its check) and was never timed.
        assert_eq!(runs[2].get(), 1);
        assert_eq!(s.timings.len(), 2);
        assert!(
            s.to_string()
                .contains("rejected for output bits differing from avx2: avx512"),
            "{s}"
        );
        // With every other candidate rejected, the baseline remains, untimed.
        let last = Cell::new(0);
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &["avx512"], &runs, &last);
        let (chosen, s) = select(
            "k".into(),
            None,
            c,
            MARGIN,
            &mut fake(vec![vec![100], vec![1]], &last),
        );
        assert_eq!(
            (chosen, s.decision, s.rejected),
            (0, Decision::Only, vec!["avx512"])
        );
    }

    #[test]
    fn the_environment_forces_a_candidate_without_timing_and_an_unknown_name_is_ignored() {
        let last = Cell::new(0);
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        let mut time = fake(vec![vec![1], vec![100]], &last);
        let forced = Some(("NOVAINFER_ATTN_ISA", "avx512"));
        let (chosen, s) = select("attention".into(), forced, c, MARGIN, &mut time);
        assert_eq!(
            (chosen, s.decision.clone()),
            (
                1,
                Decision::Forced {
                    var: "NOVAINFER_ATTN_ISA"
                }
            )
        );
        assert!(runs.iter().all(|r| r.get() == 0), "forcing runs nothing");
        assert_eq!(
            s.to_string(),
            "attention: avx512 (forced by NOVAINFER_ATTN_ISA)"
        );
        // A name the CPU cannot honour (not among the candidates): timed as usual.
        let last = Cell::new(0);
        let runs = counters(2);
        let c = candidates(&["avx2", "avx512"], &[], &runs, &last);
        let forced = Some(("NOVAINFER_ATTN_ISA", "avx512_bf16"));
        let (chosen, s) = select(
            "attention".into(),
            forced,
            c,
            MARGIN,
            &mut fake(vec![vec![1], vec![100]], &last),
        );
        assert_eq!((chosen, s.decision), (0, Decision::Timed));
    }

    #[test]
    fn a_single_candidate_is_not_run() {
        let last = Cell::new(0);
        let runs = counters(1);
        let c = candidates(&["avx2"], &[], &runs, &last);
        let (chosen, s) = select("k".into(), None, c, MARGIN, &mut fake(vec![vec![1]], &last));
        assert_eq!((chosen, s.decision), (0, Decision::Only));
        assert_eq!(runs[0].get(), 0);
    }

    #[test]
    fn recorded_selections_are_listed() {
        let s = Selection {
            kernel: "test-only kernel".into(),
            chosen: "avx2",
            decision: Decision::Only,
            timings: Vec::new(),
            rejected: Vec::new(),
        };
        record(&s);
        assert!(selections().contains(&s));
    }
}
