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

use std::ops::{Deref, DerefMut};

/// The huge page size THP uses on x86_64 and most aarch64 kernels; a mapping is aligned to
/// it so that its first bytes can be huge-paged too.
const HUGE_PAGE: usize = 2 << 20;
/// The alignment a plain-heap buffer gets (the packed weights need cache-line alignment).
const LINE: usize = 64;

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
    /// Where there is no mapping (other OSes, or one that failed): `len` + [`LINE`] bytes
    /// from the heap (zeroed lazily by `calloc`).
    Heap(Vec<u8>),
}

impl LargeBuffer {
    pub(crate) fn zeroed(len: usize) -> Self {
        if len >= HUGE_PAGE {
            if let Some(buffer) = Self::mapped(len) {
                return buffer;
            }
        }
        let heap = vec![0u8; len + LINE];
        let offset = heap.as_ptr().align_offset(LINE);
        Self {
            storage: Storage::Heap(heap),
            offset,
            len,
        }
    }

    fn mapped(len: usize) -> Option<Self> {
        let map = memmap2::MmapMut::map_anon(len + HUGE_PAGE).ok()?;
        let offset = map.as_ptr().align_offset(HUGE_PAGE);
        // Only a hint: the buffer works the same without huge pages (THP off, or a kernel
        // without it), just slower.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Some(Self {
            storage: Storage::Mapped(map),
            offset,
            len,
        })
    }

    fn storage(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped(map) => map,
            Storage::Heap(heap) => heap,
        }
    }

    /// Whether the buffer is a mapping that asked for huge pages (for the tests).
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_))
    }
}

impl Deref for LargeBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.storage()[self.offset..self.offset + self.len]
    }
}

impl DerefMut for LargeBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        let range = self.offset..self.offset + self.len;
        match &mut self.storage {
            Storage::Mapped(map) => &mut map[range],
            Storage::Heap(heap) => &mut heap[range],
        }
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
            if len >= HUGE_PAGE && cfg!(unix) {
                assert!(b.is_mapped(), "{len} bytes came from the heap");
                // Aligned to the huge page, so that the first one can be huge.
                assert_eq!(b.as_ptr().align_offset(HUGE_PAGE), 0);
            }
            // Writable end to end.
            b.fill(7);
            assert!(b.iter().all(|&x| x == 7));
        }
    }
}
