//! Which ISA a format's products run on, chosen by speed per regime ([`Isas`]).
//!
//! Measured on an Intel Xeon (Emerald Rapids, 1 thread): the AVX-512 VNNI code is 1.3x
//! faster than AVX2 on Q4_K prefill tiles, but 1.5-3.4x slower at decode, where AVX2 has
//! streaming GEMV/few-row paths with software prefetches and the AVX-512 code runs its
//! generic tiles. Neither ISA is right for both, and which wins where depends on the CPU,
//! so each format times both regimes on first use ([`crate::kernel_select`]):
//! * decode: 1 row against one matrix, then 4 rows against another, both flushed from
//!   every cache level before each run, so the run streams them from memory like a decode step streams the model (an
//!   in-cache problem would favour AVX-512 and pick the wrong code);
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
/// Bytes of each packed matrix of the decode problem: enough for the hardware prefetchers to
/// reach their stride (a run takes ~100 µs), small because flushing costs ~180 ns a line in a VM.
const DECODE_BYTES: usize = 1 << 20;
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
        return Some(Isas {
            few: baseline,
            many: baseline,
        });
    };
    let (few, s) = time_regime(format, &available, forced, &rows, Regime::Decode);
    kernel_select::record(&s);
    let (many, s) = time_regime(format, &available, forced, &rows, Regime::Prefill);
    kernel_select::record(&s);
    Some(Isas { few, many })
}

#[derive(Clone, Copy, PartialEq)]
enum Regime {
    Decode,
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
        Regime::Decode => (DECODE_BYTES / row_bytes).max(GROUP) / GROUP * GROUP,
        Regime::Prefill => PREFILL_N,
    };
    let raw = rows.repeat(n / GROUP);
    // Decode: one matrix for the single row and another for the four, so that the second
    // product does not find the first one's weights in the last-level cache.
    let copies = if regime == Regime::Decode { 2 } else { 1 };
    let mats: Vec<Vec<PackedMatrix>> = available
        .iter()
        .map(|&isa| {
            let isas = Isas {
                few: isa,
                many: isa,
            };
            (0..copies)
                .map(|_| PackedMatrix::from_raw(format, &raw, n, K, isas))
                .collect()
        })
        .collect();
    let m = match regime {
        Regime::Decode => 4,
        Regime::Prefill => PREFILL_ROWS,
    };
    let x: Vec<f32> = (0..m * K).map(|i| wave(i, 0.73)).collect();
    // Which candidate ran last: its matrices are the ones in cache.
    let last = std::cell::Cell::new(None);
    let candidates = available
        .iter()
        .zip(&mats)
        .enumerate()
        .map(|(i, (&isa, mats))| {
            let (x, last) = (&x, &last);
            Candidate::new(isa, isa.name(), move || {
                last.set(Some(i));
                match regime {
                    // One decode row, then a 4-row verification step: both stream a matrix.
                    Regime::Decode => {
                        let mut out = mats[0].matmul(&x[..K], 1);
                        out.extend(mats[1].matmul(x, 4));
                        out
                    }
                    Regime::Prefill => mats[0].matmul(x, PREFILL_ROWS),
                }
            })
        })
        .collect();
    let kernel = match regime {
        Regime::Decode => format!(
            "qmatmul {format:?} decode (1 and 4 rows, {} KiB matrices from memory)",
            mats[0][0].storage_bytes() >> 10
        ),
        Regime::Prefill => format!("qmatmul {format:?} prefill ({PREFILL_ROWS} rows)"),
    };
    // The untimed bit checks leave every candidate's matrices in the last-level cache: flush
    // them all before the first timed run, then only those of the run before.
    let mut flushed_all = false;
    let mut time = |run: &mut dyn FnMut() -> Vec<f32>| {
        if regime == Regime::Decode {
            let dirty: &[Vec<PackedMatrix>] = match last.get() {
                Some(i) if flushed_all => &mats[i..=i],
                _ => &mats,
            };
            for mat in dirty.iter().flatten() {
                flush(mat.data.bytes());
            }
            flushed_all = true;
        }
        kernel_select::wall_clock(run)
    };
    kernel_select::select(kernel, forced, candidates, &mut time)
}

/// Evicts `bytes` from every cache level (clflush, SSE2: every x86-64 CPU).
fn flush(bytes: &[u8]) {
    use std::arch::x86_64::{_mm_clflush, _mm_mfence};
    for line in bytes.chunks(64) {
        // SAFETY: the pointer is inside `bytes`; clflush only writes back and evicts.
        unsafe { _mm_clflush(line.as_ptr()) };
    }
    // SAFETY: a fence has no operands.
    unsafe { _mm_mfence() };
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
        assert!(available.contains(&isas.few) && available.contains(&isas.many));
        let recorded = kernel_select::selections();
        for (regime, chosen) in [("decode", isas.few), ("prefill", isas.many)] {
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
            for regime in [Regime::Decode, Regime::Prefill] {
                let (_, s) = time_regime(format, &simd::available(), None, &rows, regime);
                println!("{s}");
            }
        }
    }

    #[test]
    fn the_decode_problem_matrix_holds_a_mebibyte() {
        let rows = sample_rows(Format::Q4K).expect("quantize");
        assert_eq!(rows.len(), GROUP * K / 256 * 144, "16 rows of Q4_K blocks");
        let n = (DECODE_BYTES / (rows.len() / GROUP)) / GROUP * GROUP;
        let mat = PackedMatrix::from_raw(
            Format::Q4K,
            &rows.repeat(n / GROUP),
            n,
            K,
            Isas::both(IsaChoice::Avx2),
        );
        // Past L2 (1-2 MiB a core on current CPUs) only together; flushed, each streams anyway.
        assert!(mat.storage_bytes() >= 1000 << 10, "{}", mat.storage_bytes());
    }
}
