//! Which ISA a format's products run on, chosen by speed per regime ([`Isas`]).
//!
//! Neither ISA is right everywhere, and which wins where depends on the CPU and the thread
//! count. Measured (docs/benchmarks.md, issue 30): on an Intel Xeon (Emerald Rapids) the
//! AVX-512 VNNI code is 1.3x faster than AVX2 on Q4_K prefill tiles but 1.5-3.4x slower at
//! 1-row decode, where AVX2 has streaming GEMV/few-row paths with software prefetches; on an
//! AMD EPYC (Zen 4) with 2 threads, decode streaming from memory runs Q4_K and Q8_0 faster
//! on AVX-512 (1.2x, 1.1x) and Q5_0 faster on AVX2 (1.5x), with 1 thread AVX2 wins all but
//! Q8_0. So each format times three regimes on first use ([`crate::kernel_select`]):
//! * decode (1 row) and verify (4 rows) streaming a matrix twice the size of the last-level
//!   cache (8 to 64 MiB, [`stream_bytes`]), so that where the cache is small the runs read
//!   memory, the way a decode step streams the model. An 8 MiB problem, which sits in a
//!   32 MiB L3, called Q5_0 an AVX-512 win by 1.3x on the Zen 4 where decoding from memory
//!   is 1.5x faster on AVX2. Where the cache is larger than 32 MiB (the Xeon's VM reports
//!   the host's 300-480 MiB) the problem stays in it and its 1-row timings tie (within
//!   1-7% on a Xeon with AMX, every format) whatever the model does. There the verify
//!   regime's winner, which on AVX-512 runs the same streaming code, is kept for 1-row
//!   decode unless another ISA beats it by the usual margin: on that Xeon the engine decoded
//!   8-15% faster with AVX-512 than with the AVX2 that the ties used to keep (an Emerald
//!   Rapids VM had decoded ~4% slower on AVX-512, before its 1-8-row products streamed with
//!   prefetches spread over a block). Flushing the matrix before each run was tried: ~180 ns
//!   a line in a VM, and it showed ties where the model decoded 14% slower. For the same
//!   reason an ISA without a streaming few-row path (VNNI-256) is timed for these two only
//!   where the problem reads memory ([`is_candidate`]);
//! * batch (a decode step of [`super::BATCH_ROWS`] sequences or fewer) and prefill:
//!   [`BATCH_PROBLEM_ROWS`] and [`PREFILL_ROWS`] rows against a small matrix that stays in
//!   cache. They differ where AMX is among the candidates: it unpacks a group's weights once
//!   per work item, which a prefill's hundreds of rows repay and a batch's few row tiles may
//!   not.
//!
//! Every problem times the products alone: its input is quantized once, outside the runs.
//!
//! Every candidate runs on one packed matrix (the layout is the same for every ISA), so the
//! streaming problem costs its size once. Its rows repeat 16 rows of weights quantized by
//! candle (a real format instance, not random bytes whose scales could be NaN or subnormal).

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::activation::QuantizedActs;
use super::simd::{self, IsaChoice};
use super::{Format, Isas, PackedMatrix, GROUP};
use crate::kernel_select::{self, Candidate, Selection};

/// The variable that forces an ISA for every format and regime: `avx2`, `vnni256`, `avx512`.
const ISA_VAR: &str = "NOVAINFER_QMATMUL_ISA";
/// k of both problems: a multiple of every format's block (256 values at most).
const K: usize = 2048;
/// Bounds of the streaming problems' packed matrix ([`stream_bytes`]): past the L2 of every
/// core we know of (1-2 MiB), and at most 64 MiB (two candidates' runs and the bit check read
/// it 16 times: ~30 ms at 35 GB/s).
const STREAM_MIN_BYTES: usize = 8 << 20;
const STREAM_MAX_BYTES: usize = 64 << 20;
/// Rows and output columns of the prefill problem (its weights: 1024 × 2048, ≤ 2.2 MiB: in the
/// last-level cache, and large enough that the products, not the fork/join, are timed). 128
/// rows, not fewer: AMX unpacks a group's weights once per work item for all its rows, and at
/// 64 rows it tied AVX-512 on Q4_K where 128 gained 1.24x and a 512-token prompt's 1.4x
/// (Intel Xeon with AMX, 2 threads; docs/benchmarks.md).
const PREFILL_ROWS: usize = 128;
const PREFILL_N: usize = 1024;
/// Rows of the batch problem: two AMX row tiles, the middle of the batch regime (9 to
/// [`super::BATCH_ROWS`] rows), on the prefill problem's matrix.
const BATCH_PROBLEM_ROWS: usize = 32;

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
    // Decode and verify share the streaming matrix; each is packed only if something is timed.
    let stream = Problem::streaming(format, &rows, baseline);
    let prefill = Problem::new(format, &rows, PREFILL_N, baseline);
    let time = |problem: &Problem, regime, incumbent| {
        time_regime(format, &available, forced, problem, regime, incumbent)
    };
    let (few, few_record) = time(&stream, Regime::Verify, None);
    // Where the streaming problem stays in the cache, its 1-row timing cannot see the memory
    // stream that bounds decode (see the module docs): the verify regime's winner, which on
    // AVX-512 is the same streaming code, is kept unless another ISA wins by the margin.
    let incumbent = (!streams_from_memory()).then_some(few);
    let (one, one_record) = time(&stream, Regime::Decode, incumbent);
    drop(stream);
    let (many, many_record) = time(&prefill, Regime::Prefill, None);
    let (batch, batch_record) = time(&prefill, Regime::Batch, None);
    // Logged in the regimes' order of rows (decode, verify, batch, prefill), whatever the
    // timing's.
    for record in [one_record, few_record, batch_record, many_record] {
        kernel_select::record(&record);
    }
    Some(Isas {
        one,
        few,
        batch,
        many,
    })
}

/// A timing problem's matrix: `n` rows repeating the 16 sample rows, packed on first use.
struct Problem<'a> {
    format: Format,
    rows: &'a [u8],
    n: usize,
    baseline: IsaChoice,
    mat: OnceCell<RefCell<PackedMatrix>>,
}

impl<'a> Problem<'a> {
    fn new(format: Format, rows: &'a [u8], n: usize, baseline: IsaChoice) -> Self {
        Self {
            format,
            rows,
            n,
            baseline,
            mat: OnceCell::new(),
        }
    }

    /// The decode and verify problem: [`stream_bytes`] of the sample rows.
    fn streaming(format: Format, rows: &'a [u8], baseline: IsaChoice) -> Self {
        let n = (stream_bytes() / (rows.len() / GROUP)).max(GROUP) / GROUP * GROUP;
        Self::new(format, rows, n, baseline)
    }

    fn mat(&self) -> &RefCell<PackedMatrix> {
        self.mat.get_or_init(|| {
            let isas = Isas::all(self.baseline);
            let group = PackedMatrix::from_raw(self.format, self.rows, GROUP, K, isas);
            RefCell::new(group.repeat_groups(self.n / GROUP))
        })
    }

    fn storage_mib(&self) -> usize {
        ((self.n / GROUP) * self.rows.len()) >> 20
    }
}

/// The timing problem of each of [`Isas`]'s choices.
#[derive(Clone, Copy, PartialEq)]
enum Regime {
    /// One row streaming a matrix twice the last-level cache ([`stream_bytes`]).
    Decode,
    /// Four rows (a speculative verification step) over the same matrix.
    Verify,
    /// [`BATCH_PROBLEM_ROWS`] rows against the prefill problem's matrix.
    Batch,
    /// [`PREFILL_ROWS`] rows against a matrix in cache.
    Prefill,
}

impl Regime {
    /// Whether the problem's rows fill whole 16-row tiles (AMX's candidates).
    fn tiled(self) -> bool {
        matches!(self, Self::Batch | Self::Prefill)
    }
}

/// 16 rows of `K` values quantized to `format` by candle (ggml's raw blocks), or for
/// [`Format::Int4`] by [`crate::int4::GroupedInt4::quantize`].
fn sample_rows(format: Format) -> Option<Vec<u8>> {
    let values: Vec<f32> = (0..GROUP * K).map(|i| wave(i, 0.37)).collect();
    let dtype = match format {
        Format::Q5_0 => GgmlDType::Q5_0,
        Format::Q8_0 => GgmlDType::Q8_0,
        Format::Q4K => GgmlDType::Q4K,
        Format::Q6K => GgmlDType::Q6K,
        Format::Int4 => {
            let w = crate::int4::GroupedInt4::quantize(GROUP, K, &values).ok()?;
            return Some(w.blocks().to_vec());
        }
    };
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

/// Bytes of the decode and verify problems' matrix: twice the last-level cache, within
/// [`STREAM_MIN_BYTES`]..=[`STREAM_MAX_BYTES`].
fn stream_bytes() -> usize {
    last_level_cache_bytes().map_or(STREAM_MIN_BYTES, |llc| {
        llc.saturating_mul(2)
            .clamp(STREAM_MIN_BYTES, STREAM_MAX_BYTES)
    })
}

/// Whether the streaming problem is at least twice the last-level cache, so that its runs
/// read memory as a decode step does (false where the cache size is unknown).
fn streams_from_memory() -> bool {
    last_level_cache_bytes().is_some_and(|llc| stream_bytes() >= llc.saturating_mul(2))
}

/// The largest cache the first CPU reports (Linux sysfs: `index*/size`, e.g. `32768K`),
/// read once.
fn last_level_cache_bytes() -> Option<usize> {
    static LLC: OnceLock<Option<usize>> = OnceLock::new();
    *LLC.get_or_init(|| {
        let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
            .filter_map(|size| parse_cache_size(size.trim()))
            .max()
    })
}

fn parse_cache_size(size: &str) -> Option<usize> {
    let (digits, unit) = match size.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => size.split_at(i),
        None => (size, ""),
    };
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    digits.parse::<usize>().ok()?.checked_mul(scale)
}

/// Whether `isa` is timed for `regime` of `format` (unless forced). AMX runs only whole 16-row
/// tiles (fewer rows run the AVX-512 code), so it is a candidate for the batch and prefill
/// problems of a format that has an AMX form. An ISA whose few-row products do not stream
/// ([`IsaChoice::streams_few_rows`]) is a candidate for decode and verify only where their
/// problem reads memory (`from_memory`), where the timing shows that lack: in a cache that
/// holds the problem (an Emerald Rapids VM's 260 MiB L3) VNNI-256's 1-row Q8_0 won by 7% and
/// chose itself for the 0.5B's `lm_head`, which then streamed from memory at 80% of the probe
/// where AVX-512's path read 93%.
fn is_candidate(isa: IsaChoice, format: Format, regime: Regime, from_memory: bool) -> bool {
    match isa {
        IsaChoice::Amx => regime.tiled() && format.has_amx(),
        _ => regime.tiled() || from_memory || isa.streams_few_rows(),
    }
}

/// Runs [`kernel_select::select`] for one regime; every candidate multiplies the problem's
/// packed matrix, switched to its ISA for its run.
fn time_regime(
    format: Format,
    available: &[IsaChoice],
    forced: Option<(&'static str, &str)>,
    problem: &Problem<'_>,
    regime: Regime,
    incumbent: Option<IsaChoice>,
) -> (IsaChoice, Selection) {
    let m = match regime {
        Regime::Decode => 1,
        Regime::Verify => 4,
        Regime::Batch => BATCH_PROBLEM_ROWS,
        Regime::Prefill => PREFILL_ROWS,
    };
    let x: Vec<f32> = (0..m * K).map(|i| wave(i, 0.73)).collect();
    // Quantized once: the candidates differ only in the products (quantizing 128 rows took
    // about as long as a 256-column product of them, and hid AMX's gain over AVX-512).
    let mut acts = QuantizedActs::default();
    acts.fill(problem.mat().borrow().act_kind(), &x, m, K);
    let is_forced = |isa: IsaChoice| forced.is_some_and(|(_, v)| v == isa.name());
    let candidates = available
        .iter()
        .filter(|&&isa| is_candidate(isa, format, regime, streams_from_memory()) || is_forced(isa))
        .map(|&isa| {
            let acts = &acts;
            Candidate::new(isa, isa.name(), move || {
                problem.mat().borrow_mut().set_isas(Isas::all(isa));
                problem.mat().borrow().product(acts, m)
            })
        })
        .collect();
    // The raw ggml bytes (the packed copy is within a few bytes a row of them).
    let mib = problem.storage_mib();
    let kernel = match regime {
        Regime::Decode => format!("qmatmul {format:?} decode (1 row streaming a {mib} MiB matrix)"),
        Regime::Verify => {
            format!("qmatmul {format:?} verify (4 rows streaming a {mib} MiB matrix)")
        }
        Regime::Batch => format!("qmatmul {format:?} batch ({BATCH_PROBLEM_ROWS} rows)"),
        Regime::Prefill => format!("qmatmul {format:?} prefill ({PREFILL_ROWS} rows)"),
    };
    kernel_select::select_keeping(
        kernel,
        forced,
        candidates,
        incumbent.map(IsaChoice::name),
        kernel_select::MARGIN,
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
            ("batch", isas.batch),
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
            // Every candidate the rule names for the regime was timed (AMX for batch and prefill
            // only; VNNI-256 for decode and verify only where their problem reads memory).
            let timed_regime = match regime {
                "decode" => Regime::Decode,
                "verify" => Regime::Verify,
                "batch" => Regime::Batch,
                _ => Regime::Prefill,
            };
            let names: Vec<_> = available
                .iter()
                .filter(|&&i| is_candidate(i, Format::Q8_0, timed_regime, streams_from_memory()))
                .map(|i| i.name())
                .collect();
            if names.len() > 1 {
                let timed: Vec<_> = s.timings.iter().map(|t| t.0).collect();
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
        for format in [
            Format::Q4K,
            Format::Q6K,
            Format::Q5_0,
            Format::Q8_0,
            Format::Int4,
        ] {
            let Some(rows) = sample_rows(format) else {
                continue;
            };
            let available = simd::available();
            let stream = Problem::streaming(format, &rows, available[0]);
            let prefill = Problem::new(format, &rows, PREFILL_N, available[0]);
            // As `choose` decides: decode keeps verify's winner where its problem stays in
            // the cache.
            let (few, verify) =
                time_regime(format, &available, None, &stream, Regime::Verify, None);
            let incumbent = (!streams_from_memory()).then_some(few);
            let (_, decode) =
                time_regime(format, &available, None, &stream, Regime::Decode, incumbent);
            println!("{decode}\n{verify}");
            for regime in [Regime::Batch, Regime::Prefill] {
                let (_, s) = time_regime(format, &available, None, &prefill, regime, None);
                println!("{s}");
            }
        }
    }

    #[test]
    fn few_row_regimes_time_only_streaming_isas_unless_the_problem_reads_memory() {
        use IsaChoice::{Amx, Avx2, Avx512, Vnni256};
        for from_memory in [false, true] {
            for regime in [Regime::Decode, Regime::Verify] {
                assert!(is_candidate(Avx2, Format::Q8_0, regime, from_memory));
                assert!(is_candidate(Avx512, Format::Q8_0, regime, from_memory));
                assert_eq!(
                    is_candidate(Vnni256, Format::Q8_0, regime, from_memory),
                    from_memory
                );
                assert!(!is_candidate(Amx, Format::Q4K, regime, from_memory));
            }
            for regime in [Regime::Batch, Regime::Prefill] {
                assert!(is_candidate(Vnni256, Format::Q8_0, regime, from_memory));
                assert!(is_candidate(Amx, Format::Q4K, regime, from_memory));
                assert!(!is_candidate(Amx, Format::Int4, regime, from_memory));
            }
        }
    }

    #[test]
    fn the_streaming_problem_is_twice_the_last_level_cache_within_bounds() {
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12Q"), None);
        let bytes = stream_bytes();
        assert!((STREAM_MIN_BYTES..=STREAM_MAX_BYTES).contains(&bytes));
        if let Some(llc) = last_level_cache_bytes() {
            assert_eq!(bytes, (2 * llc).clamp(STREAM_MIN_BYTES, STREAM_MAX_BYTES));
            // Decode's margin is the usual one exactly where the problem leaves the cache.
            assert_eq!(streams_from_memory(), 2 * llc <= STREAM_MAX_BYTES);
        }
        // Stacking packed groups is packing the stacked rows.
        let rows = sample_rows(Format::Q6K).expect("quantize");
        let isas = Isas::all(IsaChoice::Avx2);
        let stacked = PackedMatrix::from_raw(Format::Q6K, &rows, GROUP, K, isas).repeat_groups(3);
        let packed = PackedMatrix::from_raw(Format::Q6K, &rows.repeat(3), 3 * GROUP, K, isas);
        assert_eq!(stacked.data.bytes(), packed.data.bytes());
        assert_eq!(
            (stacked.n, stacked.group_bytes),
            (packed.n, packed.group_bytes)
        );
        // The problem's matrix really is that large (past every L2).
        let rows = sample_rows(Format::Q4K).expect("quantize");
        assert_eq!(rows.len(), GROUP * K / 256 * 144, "16 rows of Q4_K blocks");
        let problem = Problem::streaming(Format::Q4K, &rows, IsaChoice::Avx2);
        let stored = problem.mat().borrow().storage_bytes();
        assert!(stored >= bytes - (1 << 20), "{stored}");
    }
}
