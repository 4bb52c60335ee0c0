//! How fast this machine streams memory into the CPU threads the kernels use.
//!
//! A single-stream decode step reads every weight once, so on a CPU its speed is bounded by
//! `read bandwidth / bytes read per token`. That roof moves with the machine (a cloud VM's
//! bandwidth changes with its neighbours from one hour to the next), so a benchmark that
//! says "decode is memory-bound" measures it next to the figures it explains, on the same
//! pool of threads and the same way the kernels read: every thread streaming its own
//! contiguous part of a buffer far larger than the caches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::large_buffer::LargeBuffer;

/// Bytes one work item reads: large enough that the hardware prefetchers settle into a
/// stream, small enough that the pool's shared cursor balances the threads.
const CHUNK: usize = 1 << 20;

/// One measurement of [`read_bandwidth`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadBandwidth {
    /// The fastest pass, in bytes per second.
    pub best_bytes_per_s: f64,
    /// Threads that read (candle's pool and the calling thread).
    pub threads: usize,
}

/// Reads a buffer of `bytes` (rounded up to whole MiB, at least 1 MiB) `passes` times in each of
/// the [`Ahead`] forms with the kernels' thread pool and returns the fastest pass. Make `bytes`
/// several times the last-level cache (256 MiB is plenty on today's CPUs) or this measures the
/// cache.
pub fn read_bandwidth(bytes: usize, passes: usize) -> ReadBandwidth {
    let chunks = bytes.div_ceil(CHUNK).max(1);
    // On huge pages like the weights it stands for (`LargeBuffer`), and written once, so every
    // page is mapped before the timed passes (and not the zero page).
    let mut bytes = LargeBuffer::zeroed(chunks * CHUNK);
    let buf = words(&mut bytes);
    for (i, w) in buf.iter_mut().enumerate() {
        *w = i as u64;
    }
    let buf = &*buf;
    let pool = candle_core::utils::barrier_pool();
    let mut best = 0f64;
    for ahead in (0..passes.max(1)).flat_map(|_| [Ahead::Probe, Ahead::Kernels]) {
        let checksum = AtomicU64::new(0);
        let start = Instant::now();
        pool.execute_chunked(chunks, |range| {
            let words = &buf[range.start * CHUNK / 8..range.end * CHUNK / 8];
            let x = match ahead {
                Ahead::Probe => xor_all::<false>(words),
                Ahead::Kernels => xor_all::<true>(words),
            };
            checksum.fetch_xor(x, Ordering::Relaxed);
        });
        let secs = start.elapsed().as_secs_f64();
        // Consuming the checksum keeps the compiler from skipping the reads.
        std::hint::black_box(checksum.load(Ordering::Relaxed));
        best = best.max((chunks * CHUNK) as f64 / secs);
    }
    ReadBandwidth {
        best_bytes_per_s: best,
        threads: pool.n_workers() + 1,
    }
}

/// `bytes` as words (a [`LargeBuffer`] is cache-line aligned, and a whole number of chunks).
fn words(bytes: &mut [u8]) -> &mut [u64] {
    // SAFETY: every bit pattern is a valid u64.
    let (head, words, tail) = unsafe { bytes.align_to_mut::<u64>() };
    debug_assert!(head.is_empty() && tail.is_empty());
    words
}

/// How a pass asks for lines ahead of the one it reads. Each pass runs both, and the faster
/// is the roof, the stricter one: which reads faster depends on the CPU. On a Xeon with AMX
/// the probe's own form read 37 GB/s against 31 for the kernels' L2 request 4 KiB ahead
/// alone, and 30-33 against 35-36 once the kernels added a near L1 request (alternated).
#[derive(Clone, Copy)]
enum Ahead {
    /// Into L1, [`PREFETCH_BYTES`] ahead.
    Probe,
    /// As the decode kernels on this CPU ([`crate::layers::qmatmul::prefetch`]).
    Kernels,
}

/// How far ahead of the line it reads [`Ahead::Probe`] asks for lines (into L1): the decode
/// kernels' distance where they ask into L1.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 10 * 1024;
/// (Elsewhere [`prefetch`] asks for nothing.)
#[cfg(not(target_arch = "x86_64"))]
const PREFETCH_BYTES: usize = 0;

/// The xor of all `words`, one 64-byte line at a time over eight independent lanes (so that
/// the loop is bound by the loads, not by one dependency chain), asking for lines ahead as
/// the decode kernels ask for theirs: [`Ahead::Kernels`] with `KERNELS`, else
/// [`Ahead::Probe`]. Without those requests the probe read less than the kernels themselves
/// on AMD cores, whose hardware prefetchers alone leave a thread well below the bus (Zen 5, 2
/// threads: a 1.5B decode step read its weights at 116-120% of the plain probe's best pass).
fn xor_all<const KERNELS: bool>(words: &[u64]) -> u64 {
    const LINE_WORDS: usize = 8;
    let mut lanes = [0u64; LINE_WORDS];
    let mut lines = words.chunks_exact(LINE_WORDS);
    for line in &mut lines {
        let at = line.as_ptr().cast::<u8>();
        if KERNELS {
            kernels_prefetch(at);
        } else {
            prefetch(at.wrapping_add(PREFETCH_BYTES));
        }
        for (l, w) in lanes.iter_mut().zip(line) {
            *l ^= w;
        }
    }
    let tail = lines.remainder().iter().fold(0, |a, w| a ^ w);
    lanes.iter().fold(tail, |a, l| a ^ l)
}

/// Asks for the lines the decode kernels would ask for, reading the line at `p`.
#[inline(always)]
fn kernels_prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    crate::layers::qmatmul::prefetch::ahead(p, 0, 1);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks for the line at `p` (which may lie past the buffer: a prefetch never faults).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it reads nothing and cannot fault; SSE is baseline.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xor_all_reads_every_word() {
        let words: Vec<u64> = (0..1003).map(|i| i * 0x9e37_79b9).collect();
        let expected = words.iter().fold(0, |a, w| a ^ w);
        for xor_all in [xor_all::<false>, xor_all::<true>] {
            assert_eq!(xor_all(&words), expected);
            assert_eq!(xor_all(&words[..3]), words[0] ^ words[1] ^ words[2]);
        }
    }

    #[test]
    fn a_measurement_is_a_positive_rate_over_the_pool() {
        let bw = read_bandwidth(4 << 20, 2);
        assert!(bw.best_bytes_per_s.is_finite() && bw.best_bytes_per_s > 0.0);
        assert_eq!(
            bw.threads,
            candle_core::utils::barrier_pool().n_workers() + 1
        );
    }
}
