//! Zeroed byte buffers for the memory a decode step streams (the packed weights and the KV
//! pool), backed by transparent huge pages where the OS offers them.
//!
//! A decode step reads every weight and its sequences' KV rows from memory, so it runs at
//! the machine's read bandwidth. With 4 KiB pages every page costs a TLB miss and the
//! hardware prefetchers stop at every page boundary: on the dev VM (Zen 3, AVX2) a 2-thread
//! stream over 512 MiB read 20–21 GB/s on 4 KiB pages and 23.6 GB/s on 2 MiB ones, and
//! decode speed follows that bandwidth (docs/benchmarks.md). Linux's default THP mode,
//! `madvise`, gives huge pages only to ranges that ask, so these buffers ask.
//!
//! Pages stay lazy as in a `calloc`ed buffer, but a touched huge page costs its whole 2 MiB:
//! the KV pool pays that for a faster long-context attention (`paged_kv::LayerPool` says how
//! much of each).
//!
//! A buffer shorter than a huge page cannot have one of its own without wasting most of it,
//! yet the small matrices stream like the large ones: a 0.5B decode step reads 96 matrices of
//! 0.1-0.6 MB (Q/K/V and O of every layer), which on 4 KiB pages streamed at 16 GB/s where the
//! 3 MB ones ran at 26 (2 threads, an Intel Xeon VM probing 32 GB/s; docs/benchmarks.md). So
//! small buffers are carved one after the other from shared 32 MiB slabs on huge pages, in
//! the order they are made (a layer's matrices side by side). A slab lives as long as a
//! buffer in it; its space is never handed out twice, so a share is zeroed like the rest.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The huge page size THP uses on x86_64 and most aarch64 kernels; a mapping is aligned to
/// it so that its first bytes can be huge-paged too.
const HUGE_PAGE: usize = 2 << 20;
/// The alignment every buffer gets (the packed weights need cache-line alignment).
const LINE: usize = 64;
/// Bytes of one slab of small buffers: 16 huge pages, so that the unused end of a full slab
/// (less than the buffer that did not fit) is a small share of it.
const SLAB: usize = 16 * HUGE_PAGE;

/// `len` zero bytes, at least [`LINE`]-aligned.
pub(crate) struct LargeBuffer {
    storage: Storage,
    /// Where the buffer starts in `storage`.
    offset: usize,
    len: usize,
}

enum Storage {
    /// An anonymous mapping of `len` + [`HUGE_PAGE`] bytes, advised to use huge pages.
    Mapped(memmap2::MmapMut),
    /// A range of a slab that buffers shorter than a huge page carve up (`offset` counts
    /// from the slab's first byte).
    Shared(Arc<Slab>),
    /// Where there is no mapping (other OSes, or one that failed): `len` + [`LINE`] bytes
    /// from the heap (zeroed lazily by `calloc`).
    Heap(Vec<u8>),
}

impl LargeBuffer {
    pub(crate) fn zeroed(len: usize) -> Self {
        let buffer = match len {
            0 => None,
            1..HUGE_PAGE => Self::shared(len),
            _ => huge_mapping(len).map(|(map, offset)| Self {
                storage: Storage::Mapped(map),
                offset,
                len,
            }),
        };
        if let Some(buffer) = buffer {
            return buffer;
        }
        let heap = vec![0u8; len + LINE];
        let offset = heap.as_ptr().align_offset(LINE);
        Self {
            storage: Storage::Heap(heap),
            offset,
            len,
        }
    }

    /// The next `len` bytes of the slab small buffers are carved from now, or of a new one
    /// when they do not fit in it (or no buffer holds it any more).
    fn shared(len: usize) -> Option<Self> {
        /// The slab being carved and the offset of its first free byte. Weak: a slab goes
        /// back to the OS with its last buffer, not with the process.
        static CARVING: Mutex<Option<(Weak<Slab>, usize)>> = Mutex::new(None);
        let mut carving = CARVING.lock().unwrap_or_else(PoisonError::into_inner);
        let share = len.next_multiple_of(LINE);
        let current = carving
            .as_ref()
            .and_then(|(slab, free)| Some((slab.upgrade()?, *free)))
            .filter(|&(_, free)| free + len <= SLAB);
        let (slab, offset) = match current {
            Some(current) => current,
            None => (Arc::new(Slab::new()?), 0),
        };
        *carving = Some((Arc::downgrade(&slab), offset + share));
        Some(Self {
            storage: Storage::Shared(slab),
            offset,
            len,
        })
    }

    /// Whether the buffer lies in a mapping that asked for huge pages (for the tests).
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_) | Storage::Shared(_))
    }
}

/// An anonymous mapping with `len` bytes from a huge-page boundary on, advised to use huge
/// pages, and where those bytes start in it.
fn huge_mapping(len: usize) -> Option<(memmap2::MmapMut, usize)> {
    let map = memmap2::MmapMut::map_anon(len + HUGE_PAGE).ok()?;
    let offset = map.as_ptr().align_offset(HUGE_PAGE);
    // Only a hint: the buffer works the same without huge pages (THP off, or a kernel
    // without it), just slower.
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    Some((map, offset))
}

impl Deref for LargeBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let range = self.offset..self.offset + self.len;
        match &self.storage {
            Storage::Mapped(map) => &map[range],
            // SAFETY: `shared` gave this buffer `range` of the slab and no other buffer any
            // byte of it; writes to it need `&mut self`, which this `&self` excludes.
            Storage::Shared(slab) => unsafe { slab.range(range) },
            Storage::Heap(heap) => &heap[range],
        }
    }
}

impl DerefMut for LargeBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        let range = self.offset..self.offset + self.len;
        match &mut self.storage {
            Storage::Mapped(map) => &mut map[range],
            // SAFETY: as in `deref`, and `&mut self` is the only access to this buffer.
            Storage::Shared(slab) => unsafe { slab.range_mut(range) },
            Storage::Heap(heap) => &mut heap[range],
        }
    }
}

/// [`SLAB`] bytes that buffers shorter than a huge page share, each its own range of them
/// (see [`LargeBuffer::shared`]). The buffers reach their ranges through `base`, so no
/// reference ever spans another buffer's bytes.
struct Slab {
    /// Owns the mapping; not read through once `base` is taken.
    _map: memmap2::MmapMut,
    /// The slab's first byte, on a huge-page boundary.
    base: *mut u8,
}

// SAFETY: `base` points into the mapping the slab owns; the buffers that share it touch
// disjoint ranges only (see `range`), so a slab may move to and be used from any thread.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

impl Slab {
    fn new() -> Option<Self> {
        let (mut map, offset) = huge_mapping(SLAB)?;
        // SAFETY: `huge_mapping` maps `SLAB` bytes from `offset` on.
        let base = unsafe { map.as_mut_ptr().add(offset) };
        Some(Self { _map: map, base })
    }

    /// # Safety
    /// `range` must lie inside the slab, and nothing may write it while the slice lives.
    unsafe fn range(&self, range: std::ops::Range<usize>) -> &[u8] {
        debug_assert!(range.end <= SLAB);
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(self.base.add(range.start), range.len()) }
    }

    /// # Safety
    /// `range` must lie inside the slab, and nothing else may read or write it while the
    /// slice lives.
    #[allow(clippy::mut_from_ref)] // the ranges, not the slab, are what is borrowed
    unsafe fn range_mut(&self, range: std::ops::Range<usize>) -> &mut [u8] {
        debug_assert!(range.end <= SLAB);
        // SAFETY: guaranteed by the caller; the mapping is writable (`MmapMut`).
        unsafe { std::slice::from_raw_parts_mut(self.base.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_zeroed_aligned_and_as_long_as_asked_small_or_large() {
        for len in [0, 1, 100, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 5] {
            let mut b = LargeBuffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            assert_eq!(b.as_ptr().align_offset(LINE), 0);
            if len > 0 && cfg!(unix) {
                // A large one in a mapping of its own or a small one in a shared slab.
                assert!(b.is_mapped(), "{len} bytes came from the heap");
            }
            if len >= HUGE_PAGE && cfg!(unix) {
                // Aligned to the huge page, so that the first one can be huge.
                assert_eq!(b.as_ptr().align_offset(HUGE_PAGE), 0);
            }
            // Writable end to end.
            b.fill(7);
            assert!(b.iter().all(|&x| x == 7));
        }
    }

    /// Small buffers share slabs: each must get bytes of its own, zeroed even where an
    /// earlier buffer of the slab was written and dropped, across more than one slab.
    #[test]
    fn small_buffers_share_slabs_without_overlapping() {
        let lens = [1, 63, 64, 65, 4096, 100_000, HUGE_PAGE - 1, 700_000, 3];
        let mut kept = Vec::new();
        // ~48 MiB in all: past a 32 MiB slab.
        for round in 0..24 {
            for (i, &len) in lens.iter().enumerate() {
                let mut b = LargeBuffer::zeroed(len);
                assert_eq!(b.len(), len);
                assert_eq!(b.as_ptr().align_offset(LINE), 0);
                assert!(b.iter().all(|&x| x == 0), "{len} bytes not zeroed");
                let mark = (round * lens.len() + i) as u8 | 1;
                b.fill(mark);
                // Every other one dropped again: its slab lives on with the others.
                if i % 2 == 0 {
                    kept.push((mark, b));
                }
            }
        }
        for (mark, b) in &kept {
            assert!(
                b.iter().all(|x| x == mark),
                "a neighbour wrote into a buffer"
            );
        }
    }
}
