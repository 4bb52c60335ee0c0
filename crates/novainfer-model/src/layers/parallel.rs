//! Writing disjoint parts of one output buffer from candle's barrier pool.
//!
//! All CPU parallelism goes through candle's pool (`execute_chunked`): a second
//! pool spinning against it on a 2-core machine cost ~40% of decode time.

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
