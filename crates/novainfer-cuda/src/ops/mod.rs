//! One launcher per `kernels/<op>.cu` (and cuBLAS in [`gemm`]): argument checking, the
//! launch configuration, the launch. Launchers check every length against the shapes they
//! are given and refuse with [`CudaError::InvalidArgument`] (naming the parameter) rather
//! than let a kernel read out of bounds. They cannot check values that live on the device
//! (token ids, slots, block ids, positions): the runner validates those on the host before
//! upload ([`crate::validate::validate_step`]), and the kernels skip or zero what lies
//! outside their buffers instead of faulting.
//!
//! Device memory is passed as views (`&CudaView` in, `&mut CudaViewMut` out), so a caller
//! can hand over the first rows of a preallocated buffer; lengths must match the shapes
//! exactly. Entry points come from the context's table ([`crate::table`]), looked up once:
//! a launch does no string work, no lock and no NVRTC.

pub mod dequant;
pub mod embedding;
pub mod flash_prefill;
pub mod gather;
pub mod gemm;
pub mod gemv_quant;
pub mod kv;
pub mod lora;
pub mod paged_attention;
pub mod qkv;
pub mod reshape_and_cache;
pub mod rms_norm;
pub mod rope;
pub mod sampling;
pub mod silu_mul;

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{DeviceRepr, LaunchArgs, LaunchConfig, ValidAsZeroBits};
use half::bf16;

use crate::context::driver;
use crate::error::{CudaError, Result};
pub use crate::kernels::DtypeKind;

/// An activation dtype a kernel is instantiated for.
pub trait Dtype: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    const KIND: DtypeKind;
}

impl Dtype for f32 {
    const KIND: DtypeKind = DtypeKind::F32;
}

impl Dtype for bf16 {
    const KIND: DtypeKind = DtypeKind::Bf16;
}

/// One thing per activation dtype, picked by `T: Dtype` with no lookup.
#[derive(Debug)]
pub(crate) struct PerDtype<F> {
    pub f32: F,
    pub bf16: F,
}

impl<F> PerDtype<F> {
    pub fn get<T: Dtype>(&self) -> &F {
        match T::KIND {
            DtypeKind::F32 => &self.f32,
            DtypeKind::Bf16 => &self.bf16,
        }
    }
}

pub(crate) fn to_i32(param: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::invalid(param, format!("{v} exceeds i32::MAX")))
}

pub(crate) fn to_u32(param: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaError::invalid(param, format!("{v} exceeds u32::MAX")))
}

pub(crate) fn check_len(param: &'static str, found: usize, expected: usize) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(CudaError::invalid(
            param,
            format!("holds {found} elements, the shapes given imply {expected}"),
        ))
    }
}

pub(crate) fn check_multiple(param: &'static str, len: usize, of: usize) -> Result<usize> {
    if of == 0 || !len.is_multiple_of(of) {
        return Err(CudaError::invalid(
            param,
            format!("length {len} is not a multiple of the row length {of}"),
        ));
    }
    Ok(len / of)
}

/// One block of `threads` per row: the shape of every row-wise kernel here.
pub(crate) fn per_row(rows: usize, threads: u32) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (to_u32("rows", rows)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A grid-stride launch over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    // Enough blocks to fill any current GPU; the kernels loop over the rest.
    let blocks = n.div_ceil(THREADS).clamp(1, 65_536) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kernel launches and cuBLAS calls this process has enqueued ([`launches`]).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many kernels and cuBLAS calls this process has enqueued so far (a cuBLAS call may run
/// more than one kernel; a graph replay counts nothing). The difference around a step is its
/// launch count: what fusing kernels brings down.
pub fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

pub(crate) fn count_launch() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn launch(mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    count_launch();
    // SAFETY: every launcher pushes exactly the arguments of its entry point, in order and
    // with the kernel's types, after checking that each buffer holds what the shapes imply.
    unsafe { args.launch(cfg) }
        .map(|_| ())
        .map_err(|e| driver("cuLaunchKernel", e))
}
