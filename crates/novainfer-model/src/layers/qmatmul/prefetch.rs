//! How far ahead of the block it reads, and into which cache, a streaming product (decode's
//! one row, verify's few) asks for weight lines.
//!
//! A decode step streams every matrix from memory once, and the hardware prefetchers alone
//! leave a core far below the bus (the kernels re-read each line from L1, so the L2 streamer
//! sees few requests to run ahead on): on Zen 3 one core read Q6_K at ~9 GB/s without
//! software prefetches and ~22 GB/s with `prefetcht0` anywhere from 7 to 28 KiB ahead. The
//! right distance and level are the CPU's, not the format's:
//! * AMD (and any CPU not measured otherwise): into L1, 10 KiB ahead, the middle of that
//!   plateau; not re-measured on Zen 4/5 with the L2 form below;
//! * Intel: into L2 (`prefetcht1`) 4 KiB ahead, then from L2 into L1 1 KiB ahead. On a Xeon
//!   with AMX (2 threads, a 1.5B decode step's matrices, docs/benchmarks.md) a step took 50-52
//!   ms with the L1 form at 10 KiB, 42.5 with it at 4 KiB, and 39.5-40.4 into L2 at 3-4 KiB
//!   (6-8 KiB: 41-42); the 0.5B's 24.4 ms became 16.1, and AVX2's 1.5B step 60.6 ms became
//!   41.9. An L1 request holds one of the core's few fill buffers until its line arrives, and
//!   far ahead they are the bound; an L2 request leaves them to the kernel's own loads. Those
//!   loads then wait on L2 for every line; the near request (a short trip, its fill buffer
//!   soon free) hides that too: 1.5B 39.4-39.9 → 37.1-37.7 ms, 0.5B 15.8-16.7 → 14.7-15.2
//!   (near 0.5 and 2 KiB in between; far 3, 6 or 8 KiB slower with it).
//!
//! `NOVAINFER_DECODE_PREFETCH` overrides the choice (to measure another CPU without a
//! rebuild): `l1:BYTES` or `l2:BYTES`, and optionally a nearer request after a comma
//! (`l2:4096,l1:1024`).

use std::sync::OnceLock;

/// The variable that overrides [`decode`]'s choice.
const VAR: &str = "NOVAINFER_DECODE_PREFETCH";

/// The cache a software prefetch fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// `prefetcht0`: every level down to L1.
    L1,
    /// `prefetcht1`: L2 (and the levels below), not L1.
    L2,
}

/// One request for weight lines: `bytes` past the block a kernel reads, into `level`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub bytes: usize,
    pub level: Level,
}

impl Request {
    /// `l1:BYTES` or `l2:BYTES` (case-insensitive level; bytes at most 1 MiB).
    fn parse(s: &str) -> Option<Self> {
        let (level, bytes) = s.trim().split_once(':')?;
        let level = match level.trim().to_ascii_lowercase().as_str() {
            "l1" => Level::L1,
            "l2" => Level::L2,
            _ => return None,
        };
        let bytes: usize = bytes.trim().parse().ok()?;
        (bytes <= 1 << 20).then_some(Self { bytes, level })
    }
}

/// Where a streaming kernel asks for weight lines: far ahead, and optionally again nearer
/// (a line the far request brought to L2, on to L1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Prefetch {
    pub far: Request,
    /// Fewer bytes ahead than `far` (`parse` holds to that).
    pub near: Option<Request>,
}

impl Prefetch {
    /// AMD's, and the default where nothing else was measured (see the module docs).
    const L1_10K: Self = Self {
        far: Request {
            bytes: 10 * 1024,
            level: Level::L1,
        },
        near: None,
    };
    /// Intel's (see the module docs).
    const L2_4K_L1_1K: Self = Self {
        far: Request {
            bytes: 4 * 1024,
            level: Level::L2,
        },
        near: Some(Request {
            bytes: 1024,
            level: Level::L1,
        }),
    };

    /// The choice for a CPU whose CPUID vendor string is `vendor`.
    fn for_vendor(vendor: &[u8; 12]) -> Self {
        if vendor == b"GenuineIntel" {
            Self::L2_4K_L1_1K
        } else {
            Self::L1_10K
        }
    }

    /// A request ([`Request::parse`]), or a far and a nearer one separated by a comma.
    fn parse(s: &str) -> Option<Self> {
        let (far, near) = match s.split_once(',') {
            Some((far, near)) => (Request::parse(far)?, Some(Request::parse(near)?)),
            None => (Request::parse(s)?, None),
        };
        if near.is_some_and(|near| near.bytes >= far.bytes) {
            return None;
        }
        Some(Self { far, near })
    }
}

/// This CPU's CPUID vendor string (`GenuineIntel`, `AuthenticAMD`, ...).
fn cpu_vendor() -> [u8; 12] {
    // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    let leaf0 = unsafe { std::arch::x86_64::__cpuid(0) };
    let mut vendor = [0u8; 12];
    for (i, reg) in [leaf0.ebx, leaf0.edx, leaf0.ecx].into_iter().enumerate() {
        vendor[4 * i..4 * i + 4].copy_from_slice(&reg.to_le_bytes());
    }
    vendor
}

/// The streaming kernels' prefetch on this CPU: [`VAR`] when set and valid, else by vendor.
/// Chosen once per process and logged.
pub(crate) fn decode() -> Prefetch {
    static CHOSEN: OnceLock<Prefetch> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let by_vendor = Prefetch::for_vendor(&cpu_vendor());
        let chosen = match std::env::var(VAR) {
            Ok(v) if !v.is_empty() => Prefetch::parse(&v).unwrap_or_else(|| {
                tracing::warn!(
                    target: "novainfer::kernels",
                    "{VAR}={v:?} is not l1:BYTES or l2:BYTES (at most 1048576), optionally \
                     followed by a nearer one after a comma; ignored"
                );
                by_vendor
            }),
            _ => by_vendor,
        };
        let near = chosen.near.map_or(String::new(), |near| {
            format!(", then {:?} {} bytes ahead", near.level, near.bytes)
        });
        tracing::info!(
            target: "novainfer::kernels",
            "decode prefetch: {:?} {} bytes ahead{near}",
            chosen.far.level,
            chosen.far.bytes
        );
        chosen
    })
}

/// Asks for `lines` cache lines from each of [`decode`]'s distances + `at` bytes past `p`.
#[inline(always)]
pub(crate) fn ahead(p: *const u8, at: usize, lines: usize) {
    let Prefetch { far, near } = decode();
    request(far, p, at, lines);
    if let Some(near) = near {
        request(near, p, at, lines);
    }
}

#[inline(always)]
fn request(Request { bytes, level }: Request, p: *const u8, at: usize, lines: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    for l in 0..lines {
        // `wrapping_add` keeps the address computation defined past the matrix's end.
        let line = p.wrapping_add(bytes + at + 64 * l) as *const i8;
        // SAFETY: a prefetch never faults, whatever the address; SSE is baseline.
        unsafe {
            match level {
                Level::L1 => _mm_prefetch::<_MM_HINT_T0>(line),
                Level::L2 => _mm_prefetch::<_MM_HINT_T1>(line),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intel_prefetches_into_l2_and_everyone_else_into_l1() {
        assert_eq!(Prefetch::for_vendor(b"GenuineIntel"), Prefetch::L2_4K_L1_1K);
        assert_eq!(Prefetch::for_vendor(b"AuthenticAMD"), Prefetch::L1_10K);
        assert_eq!(Prefetch::for_vendor(b"HygonGenuine"), Prefetch::L1_10K);
    }

    #[test]
    fn the_override_names_a_level_and_a_distance_or_two() {
        let request = |level, bytes| Request { bytes, level };
        let one = |level, bytes| {
            Some(Prefetch {
                far: request(level, bytes),
                near: None,
            })
        };
        assert_eq!(Prefetch::parse("l2:4096"), one(Level::L2, 4096));
        assert_eq!(Prefetch::parse(" L2 : 0 "), one(Level::L2, 0));
        assert_eq!(Prefetch::parse("l1:10240"), one(Level::L1, 10240));
        assert_eq!(
            Prefetch::parse("l2:4096, l1:1024"),
            Some(Prefetch {
                far: request(Level::L2, 4096),
                near: Some(request(Level::L1, 1024)),
            })
        );
        let bad = [
            "",
            "l2",
            "l3:4096",
            "l1:-1",
            "l1:4k",
            "4096",
            "l2:2000000",
            "l2:4096,",
            "l2:4096,l1:4096",
            "l2:1024,l1:4096",
            "l2:4096,l1:1024,l1:512",
        ];
        for bad in bad {
            assert_eq!(Prefetch::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn this_cpu_has_a_vendor_string() {
        let vendor = cpu_vendor();
        assert!(vendor.iter().all(|b| b.is_ascii_graphic()), "{vendor:?}");
    }
}
