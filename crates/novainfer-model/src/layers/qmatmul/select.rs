//! Which ISA a format's products run on, chosen by speed per regime ([`Isas`]).
//!
//! Measured on an Intel Xeon (Emerald Rapids, 1 thread): the AVX-512 VNNI code is 1.3x
//! faster than AVX2 on Q4_K prefill tiles, but 1.5-3.4x slower at decode, where AVX2 has
//! streaming GEMV/few-row paths with software prefetches and the AVX-512 code runs its
//! generic tiles. Neither ISA is right for both, and which wins where depends on the CPU,
//! so each format times three regimes on first use ([`crate::kernel_select`]):
//! * decode (1 row) and verify (4 rows) streaming an 8 MiB matrix: past every core's L2, so
//!   the run streams it from the last-level cache (or memory where that is small), the way a
//!   decode step streams the model. Flushing the matrix to memory before each run was tried:
//!   it cost ~180 ns a line in a VM and showed ties where the real model decodes 14% slower
//!   on AVX-512. From L3 the K-quants show AVX2's prefetching lead (1.2-1.8x) but Q8_0 still
//!   reads as a tie, and with a 5% margin the default decoded the 0.5B ~4% slower than AVX2
//!   forced; so 1-row decode leaves AVX2 only for a 15% win ([`DECODE_MARGIN`]);
//! * prefill: 64 rows against a small matrix that stays in cache.
//!
//! Both problems repeat 16 rows of weights quantized by candle (a real format instance,
//! not random bytes whose scales could be NaN or subnormal).

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::simd::{self, IsaChoice};
use super::{Format, Isas, PackedMatrix, GROUP};
use crate::kernel_select::{self, Candidate, Selection};

/// The variable that forces an ISA for every format and regime: `avx2`, `vnni256`, `avx512`.
const ISA_VAR: &str = "NOVAINFER_QMATMUL_ISA";
/// k of both problems: a multiple of every format's block (256 values at most).
const K: usize = 2048;
/// Bytes of the decode problem's packed matrix: past the L2 of every core we know of (1-2 MiB).
const DECODE_BYTES: usize = 8 << 20;
/// How much faster than AVX2 another ISA must decode one row to replace it (see
/// [`time_regime`]).
const DECODE_MARGIN: f64 = 0.15;
/// Rows and output columns of the prefill problem (its weights: 256 × 2048, ≤ 0.6 MiB).
const PREFILL_ROWS: usize = 64;
const PREFILL_N: usize = 256;

/// The ISAs for products of `format` on this CPU, chosen on first use and kept for the
/// process; `None` without AVX2+FMA (candle's kernels run then).
pub(super) fn isas_for(format: Format) -> Option<Isas> {
    static CHOSEN: Mutex<Option<HashMap<Format, Option<Isas>>>> = Mutex::new(None);
    let mut chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner());
    let map = chosen.get_or_insert_with(HashMap::new);
    *map.entry(format).or_insert_with(|| choose(format))
}

fn choose(format: Format) -> Option<Isas> {
    let available = simd::available();
    let &baseline = available.first()?;
    let forced = kernel_select::forced_by(ISA_VAR);
    let forced = forced.as_ref().map(|(var, v)| (*var, v.as_str()));
    let Some(rows) = sample_rows(format) else {
        // Quantizing 16 rows failed (it does not): the baseline, untimed.
        return Some(Isas::all(baseline));
    };
    let time = |regime| {
        let (isa, s) = time_regime(format, &available, forced, &rows, regime);
        kernel_select::record(&s);
        isa
    };
    Some(Isas {
        one: time(Regime::Decode),
        few: time(Regime::Verify),
        many: time(Regime::Prefill),
    })
}

/// The timing problem of each of [`Isas`]'s choices.
#[derive(Clone, Copy, PartialEq)]
enum Regime {
    /// One row streaming a matrix larger than L2.
    Decode,
    /// Four rows (a speculative verification step) over the same matrix.
    Verify,
    /// [`PREFILL_ROWS`] rows against a matrix in cache.
    Prefill,
}

/// 16 rows of `K` values quantized to `format` by candle: ggml's raw blocks.
fn sample_rows(format: Format) -> Option<Vec<u8>> {
    let dtype = match format {
        Format::Q5_0 => GgmlDType::Q5_0,
        Format::Q8_0 => GgmlDType::Q8_0,
        Format::Q4K => GgmlDType::Q4K,
        Format::Q6K => GgmlDType::Q6K,
    };
    let values: Vec<f32> = (0..GROUP * K).map(|i| wave(i, 0.37)).collect();
    let t = Tensor::from_vec(values, (GROUP, K), &Device::Cpu).ok()?;
    QTensor::quantize(&t, dtype)
        .ok()?
        .data()
        .ok()
        .map(|d| d.into_owned())
}

/// A deterministic value in (-1, 1) for index `i`, not periodic over any problem here.
fn wave(i: usize, rate: f32) -> f32 {
    (i as f32 * rate).sin() * (i as f32 * 0.011).cos()
}

/// Runs [`kernel_select::select`] for one regime; each candidate multiplies its own copy of
/// the problem's matrix (so the flush before a run leaves all of them in memory alike).
fn time_regime(
    format: Format,
    available: &[IsaChoice],
    forced: Option<(&'static str, &str)>,
    rows: &[u8],
    regime: Regime,
) -> (IsaChoice, Selection) {
    let row_bytes = rows.len() / GROUP;
    let n = match regime {
        Regime::Decode | Regime::Verify => (DECODE_BYTES / row_bytes).max(GROUP) / GROUP * GROUP,
        Regime::Prefill => PREFILL_N,
    };
    let raw = rows.repeat(n / GROUP);
    let mats: Vec<PackedMatrix> = available
        .iter()
        .map(|&isa| PackedMatrix::from_raw(format, &raw, n, K, Isas::all(isa)))
        .collect();
    let m = match regime {
        Regime::Decode => 1,
        Regime::Verify => 4,
        Regime::Prefill => PREFILL_ROWS,
    };
    let x: Vec<f32> = (0..m * K).map(|i| wave(i, 0.73)).collect();
    let candidates = available
        .iter()
        .zip(&mats)
        .map(|(&isa, mat)| {
            let x = &x;
            Candidate::new(isa, isa.name(), move || mat.matmul(x, m))
        })
        .collect();
    let mib = mats[0].storage_bytes() >> 20;
    let kernel = match regime {
        Regime::Decode => format!("qmatmul {format:?} decode (1 row streaming a {mib} MiB matrix)"),
        Regime::Verify => {
            format!("qmatmul {format:?} verify (4 rows streaming a {mib} MiB matrix)")
        }
        Regime::Prefill => format!("qmatmul {format:?} prefill ({PREFILL_ROWS} rows)"),
    };
    // Decode's problem streams from L3, where the model's largest matrix (0.5B: the 145 MB
    // Q8_0 output head) streams from memory; there AVX2's prefetching GEMV was measured faster
    // (2x single-threaded on a 62 MB Q8_0 matrix) while this problem called Q8_0 a tie, and
    // the default decoded ~4% slower than AVX2 forced with the 5% margin. So 1-row decode
    // leaves AVX2 only for a clear win.
    let margin = match regime {
        Regime::Decode => DECODE_MARGIN,
        Regime::Verify | Regime::Prefill => kernel_select::MARGIN,
    };
    kernel_select::select(
        kernel,
        forced,
        candidates,
        margin,
        &mut kernel_select::wall_clock,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_regimes_are_timed_among_every_isa_the_cpu_has_and_recorded() {
        let available = simd::available();
        if std::env::var_os(ISA_VAR).is_some() || available.is_empty() {
            return; // forced or no AVX2: nothing to time (the rule is kernel_select's tests)
        }
        let isas = isas_for(Format::Q8_0).expect("AVX2 is here");
        let recorded = kernel_select::selections();
        let regimes = [
            ("decode", isas.one),
            ("verify", isas.few),
            ("prefill", isas.many),
        ];
        for (regime, chosen) in regimes {
            assert!(available.contains(&chosen));
            let s = recorded
                .iter()
                .find(|s| s.kernel.starts_with(&format!("qmatmul Q8_0 {regime}")))
                .expect("the choice is recorded");
            // Seen with --nocapture: which code this CPU runs, and by how much it won.
            println!("{s}");
            assert_eq!(s.chosen, chosen.name());
            assert!(
                s.rejected.is_empty(),
                "an ISA disagreed with AVX2 on this CPU: {s}"
            );
            if available.len() > 1 {
                let timed: Vec<_> = s.timings.iter().map(|t| t.0).collect();
                let names: Vec<_> = available.iter().map(|i| i.name()).collect();
                assert_eq!(timed, names);
            }
        }
        // A second matrix of the format reuses the choice (other tests may record other
        // formats' meanwhile).
        let q8_0 = || {
            let all = kernel_select::selections();
            all.iter()
                .filter(|s| s.kernel.starts_with("qmatmul Q8_0 "))
                .count()
        };
        let before = q8_0();
        assert_eq!(isas_for(Format::Q8_0), Some(isas));
        assert_eq!(q8_0(), before);
    }

    /// `cargo test --release -p novainfer-model qmatmul_choices -- --ignored --nocapture`
    #[test]
    #[ignore = "timing printout, run by hand"]
    fn qmatmul_choices() {
        for format in [Format::Q4K, Format::Q6K, Format::Q5_0, Format::Q8_0] {
            let Some(rows) = sample_rows(format) else {
                continue;
            };
            for regime in [Regime::Decode, Regime::Verify, Regime::Prefill] {
                let (_, s) = time_regime(format, &simd::available(), None, &rows, regime);
                println!("{s}");
            }
        }
    }

    #[test]
    fn the_decode_problem_streams_a_matrix_larger_than_l2() {
        let rows = sample_rows(Format::Q4K).expect("quantize");
        assert_eq!(rows.len(), GROUP * K / 256 * 144, "16 rows of Q4_K blocks");
        let n = (DECODE_BYTES / (rows.len() / GROUP)) / GROUP * GROUP;
        let mat = PackedMatrix::from_raw(
            Format::Q4K,
            &rows.repeat(n / GROUP),
            n,
            K,
            Isas::all(IsaChoice::Avx2),
        );
        assert!(mat.storage_bytes() >= 7 << 20, "{}", mat.storage_bytes());
    }
}
