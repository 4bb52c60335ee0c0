//! Host buffers and random data for the emulated-kernel tests.
#![allow(dead_code)]

use half::bf16;

/// xorshift64: fresh, reproducible inputs without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-scale, scale).
    pub fn f32(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
    }
    pub fn f32s(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(scale)).collect()
    }
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.f32(scale))).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A copy of `v` on 16 bytes, as device allocations are (kernels load 16-byte pieces).
pub struct Aligned<T: Copy> {
    store: Vec<u128>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy> Aligned<T> {
    pub fn new(v: &[T]) -> Self {
        let bytes = std::mem::size_of_val(v);
        let mut store = vec![0u128; bytes.div_ceil(16).max(1)];
        // SAFETY: `store` holds at least `bytes` bytes; T is Copy (plain data here).
        unsafe {
            std::ptr::copy_nonoverlapping(
                v.as_ptr() as *const u8,
                store.as_mut_ptr() as *mut u8,
                bytes,
            );
        }
        Aligned {
            store,
            len: v.len(),
            _t: std::marker::PhantomData,
        }
    }
    pub fn ptr(&self) -> *const T {
        self.store.as_ptr() as *const T
    }
    pub fn mut_ptr(&mut self) -> *mut T {
        self.store.as_mut_ptr() as *mut T
    }
    pub fn to_vec(&self) -> Vec<T> {
        // SAFETY: `store` holds `len` values of T written by `new` or a kernel.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len).to_vec() }
    }
}

/// A pointer value the emulated threads can share (captured by the launch closure).
pub fn addr<T>(p: *const T) -> usize {
    p as usize
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
