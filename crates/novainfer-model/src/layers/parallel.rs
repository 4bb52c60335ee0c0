//! Writing disjoint parts of one output buffer from candle's barrier pool.
//!
//! All CPU parallelism goes through candle's pool (`execute_chunked`): a second
//! pool spinning against it on a 2-core machine cost ~40% of decode time.

/// An output buffer's base pointer, shared with the pool's threads. Each work
/// item must write only the range it owns.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(*mut f32);

impl SharedOut {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        Self(out.as_mut_ptr())
    }

    /// The mutable range `start..start + len` of the buffer.
    ///
    /// # Safety
    /// The range must lie inside the buffer, and no other thread may access it
    /// while the returned slice lives.
    pub(crate) unsafe fn range<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        // SAFETY: guaranteed by the caller (see above).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

// SAFETY: threads only write through it to disjoint ranges (see `range`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
