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

/// An element as the kernels take it: f32, or bf16 as its bit pattern (`u16`). Each test file
/// extends it with the kernels of its own file.
pub trait Dtype: Copy + Send + Sync + 'static {
    const NAME: &'static str;
    /// The GPU tests' relative tolerance for one output of this type (`TestDtype::TOL` in
    /// novainfer-cuda's tests): f32 rounding, or one bf16 rounding (2^-8) plus inputs rounded
    /// along the way.
    const TOL: f32;
    /// Rounded to nearest even for bf16, as `f32_to_bf16` and `half` round.
    fn from_f32(v: f32) -> Self;
    /// Exact.
    fn to_f32(self) -> f32;
}

impl Dtype for f32 {
    const NAME: &'static str = "f32";
    const TOL: f32 = 2e-5;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Dtype for u16 {
    const NAME: &'static str = "bf16";
    const TOL: f32 = 1.6e-2;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v).to_bits()
    }
    fn to_f32(self) -> f32 {
        bf16::from_bits(self).to_f32()
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
