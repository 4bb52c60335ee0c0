//! Writing disjoint parts of one output buffer from candle's barrier pool.
//!
//! All CPU parallelism goes through candle's pool (`execute_chunked`): a second
//! pool spinning against it on a 2-core machine cost ~40% of decode time.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most pool threads [`execute_contiguous`] gives a range of their own (more: it falls back
/// to `execute_chunked`); a fixed array, so a call allocates nothing.
const MAX_OWNERS: usize = 64;

/// Runs `f` over `0..n_items` on candle's pool, each thread streaming a contiguous share:
/// the items are split into one range per thread, a thread claims chunks from the front of
/// its own range and, once that is empty, steals chunks from the back of the others'. So
/// each thread reads one long run of memory (as a static split would) and still nobody
/// waits for a slow thread (as with `execute_chunked`, whose sixteenths of the work
/// interleave the threads: on 2 threads of a Zen 4, a decode GEMV over a 228 KiB matrix took
/// 16.4 µs that way and 11.7 µs in contiguous shares, docs/benchmarks.md, issue 30). Which
/// thread runs an item never changes a result where every item writes its own outputs with
/// the same operations.
pub(crate) fn execute_contiguous<F: Fn(Range<usize>) + Sync>(n_items: usize, f: F) {
    let pool = candle_core::utils::barrier_pool();
    let owners = pool.n_workers() + 1;
    if owners > MAX_OWNERS || n_items >= u32::MAX as usize {
        pool.execute_chunked(n_items, f);
        return;
    }
    let per = n_items.div_ceil(owners);
    // Claims of an eighth of a share: few enough to cost nothing, small enough that a
    // thief's last chunk is short.
    let chunk = (per / 8).max(1);
    let ranges: [Share; MAX_OWNERS] = std::array::from_fn(|o| {
        let (front, back) = ((o * per).min(n_items), ((o + 1) * per).min(n_items));
        Share(AtomicU64::new(pack(front, back)))
    });
    let ranges = &ranges[..owners];
    // One slot per share, handed out like any chunked work: a thread runs its slot's share
    // and then steals. Inside the pool (nested) candle runs the slots inline, one after the
    // other, which still covers every item.
    pool.execute_chunked(owners, |slots| {
        for own in slots {
            while let Some(r) = claim(&ranges[own].0, chunk, End::Front) {
                f(r);
            }
            for other in (1..owners).map(|d| (own + d) % owners) {
                while let Some(r) = claim(&ranges[other].0, chunk, End::Back) {
                    f(r);
                }
            }
        }
    });
}

/// One thread's share, on a cache line of its own: the owner claims from it while the
/// others' claims hit theirs, where adjacent shares made every claim of a small product
/// (a decode row's K or V) pull the line from the other core.
#[repr(align(64))]
struct Share(AtomicU64);

enum End {
    Front,
    Back,
}

fn pack(front: usize, back: usize) -> u64 {
    (front as u64) << 32 | back as u64
}

/// Up to `chunk` items from one end of the range `cell` holds, or `None` when it is empty.
fn claim(cell: &AtomicU64, chunk: usize, end: End) -> Option<Range<usize>> {
    let mut cur = cell.load(Ordering::Relaxed);
    loop {
        let (front, back) = ((cur >> 32) as usize, (cur & u64::from(u32::MAX)) as usize);
        if front >= back {
            return None;
        }
        let take = chunk.min(back - front);
        let (next, range) = match end {
            End::Front => (pack(front + take, back), front..front + take),
            End::Back => (pack(front, back - take), back - take..back),
        };
        match cell.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(range),
            Err(now) => cur = now,
        }
    }
}

/// An output buffer's base pointer, shared with the pool's threads. Each work
/// item must write only the range it owns.
pub(crate) struct SharedOut<T = f32>(*mut T);

// Copy for any `T` (a derive would ask `T: Copy` of what is only a pointer's target).
impl<T> Clone for SharedOut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedOut<T> {}

impl<T> SharedOut<T> {
    pub(crate) fn new(out: &mut [T]) -> Self {
        Self(out.as_mut_ptr())
    }

    /// The mutable range `start..start + len` of the buffer.
    ///
    /// # Safety
    /// The range must lie inside the buffer, and no other thread may access it
    /// while the returned slice lives.
    pub(crate) unsafe fn range<'a>(self, start: usize, len: usize) -> &'a mut [T] {
        // SAFETY: guaranteed by the caller (see above).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

// SAFETY: threads only write through it to disjoint ranges (see `range`).
unsafe impl<T: Send> Send for SharedOut<T> {}
unsafe impl<T: Send> Sync for SharedOut<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_item_runs_exactly_once() {
        for n in [0, 1, 2, 7, 63, 64, 65, 1000] {
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            execute_contiguous(n, |r| {
                for i in r {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn claims_take_chunks_from_either_end_until_the_range_is_empty() {
        let cell = AtomicU64::new(pack(10, 17));
        assert_eq!(claim(&cell, 3, End::Front), Some(10..13));
        assert_eq!(claim(&cell, 3, End::Back), Some(14..17));
        assert_eq!(claim(&cell, 3, End::Back), Some(13..14));
        assert_eq!(claim(&cell, 3, End::Front), None);
        assert_eq!(claim(&cell, 3, End::Back), None);
    }
}
