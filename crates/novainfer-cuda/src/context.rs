//! The device context: one GPU, one stream, every kernel entry point, one cuBLAS handle.
//!
//! [`GpuContext::new`] is the only way in, and it never panics for want of CUDA: libcuda,
//! libnvrtc and libcublas are probed before cudarc touches them (cudarc's `dynamic-loading`
//! panics on a missing library), and a driver without devices maps to
//! [`CudaError::NotAvailable`]. Everything a launch needs is prepared here, once: every
//! module is compiled (or read from the disk cache) and every entry point looked up into a
//! [`KernelTable`], so launchers do no NVRTC, no string work and take no lock.
//!
//! cudarc's event tracking is switched off before anything is allocated. With it on, every
//! buffer carries two CUDA events and every kernel argument costs a wait and a record — two
//! driver calls per argument — and the recorded events break CUDA-graph capture. We run one
//! stream, whose order is the only synchronisation we need.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::blas::Blas;
use crate::blas_lt::LtGemms;
use crate::cache::{default_cache_dir, KernelCache};
use crate::error::{CudaError, Result};
use crate::gemm_choice::{GemmLibrary, GEMM_ENV};
use crate::kernels::KernelSource;
use crate::table::KernelTable;
use crate::{libs, nvrtc};

pub struct GpuContext {
    // Field order is drop order: the handles and functions go before the stream and context.
    blas: Blas,
    /// With `NOVAINFER_CUDA_GEMM=lt`: the GEMMs' cuBLASLt plans ([`crate::blas_lt`]).
    lt: Option<LtGemms>,
    kernels: KernelTable,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    arch: String,
    name: String,
    ordinal: usize,
    multiprocessors: usize,
}

/// How `novainfer-cuemu`'s fake libcuda names its device.
pub const EMULATED_DEVICE_PREFIX: &str = "cuemu";

// The runner opens the context on one thread and may drive it from another (the engine
// thread); every field is Send + Sync, and this keeps it so.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<GpuContext>();
};

/// Checks that libcuda can be loaded and reports a usable device count.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen candidate names; touches no symbol.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NotAvailable(
            "libcuda not found (no NVIDIA driver installed?)".to_owned(),
        ));
    }
    check_driver_version()?;
    let count = CudaContext::device_count()
        .map_err(|e| CudaError::NotAvailable(format!("the CUDA driver reports {e:?}")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The bindings are cudarc's `cuda-13000` and the CUBINs come from NVRTC 13; an older
/// driver lacks entry points cudarc would panic on and cannot load the binaries, so it is
/// refused here, with `cuDriverGetVersion`, which every driver has.
fn check_driver_version() -> Result<()> {
    const NEEDED: i32 = 13_000;
    let mut version = 0;
    // SAFETY: libcuda is present (checked by the caller); `version` is valid for writes.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| CudaError::NotAvailable(format!("cuDriverGetVersion failed: {e:?}")))?;
    if version < NEEDED {
        return Err(CudaError::NotAvailable(format!(
            "the NVIDIA driver supports CUDA {}.{}, NovaInfer's kernels need a CUDA 13 driver",
            version / 1000,
            version % 1000 / 10
        )));
    }
    Ok(())
}

impl GpuContext {
    /// Opens GPU `ordinal` with kernels cached under [`default_cache_dir`].
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_cache(ordinal, KernelCache::new(default_cache_dir()))
    }

    pub fn with_cache(ordinal: usize, cache: KernelCache) -> Result<Self> {
        // A misspelt choice fails before anything is loaded.
        let gemm = GemmLibrary::from_env().map_err(|why| CudaError::invalid(GEMM_ENV, why))?;
        Self::open(ordinal, cache, gemm)
    }

    /// [`Self::new`] with the GEMM library given rather than read from the environment.
    pub fn with_gemm_library(ordinal: usize, gemm: GemmLibrary) -> Result<Self> {
        Self::open(ordinal, KernelCache::new(default_cache_dir()), gemm)
    }

    fn open(ordinal: usize, cache: KernelCache, gemm: GemmLibrary) -> Result<Self> {
        let count = device_count()?;
        if count == 0 {
            return Err(CudaError::NotAvailable("no CUDA device found".to_owned()));
        }
        if ordinal >= count {
            return Err(CudaError::NotAvailable(format!(
                "device cuda:{ordinal} requested but only {count} device(s) present"
            )));
        }
        nvrtc::probe()?;
        libs::probe_cublas()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("cuCtxCreate", e))?;
        // SAFETY: nothing has been allocated on this context yet, and all of NovaInfer's work
        // goes to the one stream created below, so stream order is all the synchronisation
        // there is to track (see the module doc).
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("cuDeviceGetAttribute", e))?;
        let name = ctx.name().map_err(|e| driver("cuDeviceGetName", e))?;
        let multiprocessors = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| driver("cuDeviceGetAttribute", e))?
            .max(1) as usize;
        let stream = ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?;
        let arch = format!("sm_{major}{minor}");
        let kernels = KernelTable::load(&ctx, &cache, &arch)?;
        let blas = Blas::new(&stream)?;
        let lt = match gemm {
            GemmLibrary::Cublas => None,
            GemmLibrary::CublasLt => Some(LtGemms::new(&stream)?),
        };
        Ok(Self {
            blas,
            lt,
            kernels,
            stream,
            ctx,
            arch,
            name,
            ordinal,
            multiprocessors,
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cuBLASLt plans, when `NOVAINFER_CUDA_GEMM=lt` chose them for this context.
    pub(crate) fn lt(&self) -> Option<&LtGemms> {
        self.lt.as_ref()
    }

    /// The algorithm cuBLASLt was given for `shape`, once a GEMM of that shape has run
    /// (`None` without cuBLASLt or before).
    pub fn lt_choice(&self, shape: crate::blas_lt::LtShape) -> Option<crate::blas_lt::LtChoice> {
        self.lt.as_ref().and_then(|lt| lt.choice(shape))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The NVRTC architecture of this GPU, e.g. `"sm_90"`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The driver's name for the device, e.g. `"NVIDIA H100 80GB HBM3"` (for logs).
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Whether the device is `novainfer-cuemu`'s fake CUDA (kernels emulated on the CPU, a
    /// thousand times slower than a GPU): tests shrink their problems there.
    pub fn is_emulated(&self) -> bool {
        self.name.starts_with(EMULATED_DEVICE_PREFIX)
    }

    /// Streaming multiprocessors: how many blocks it takes to fill the device.
    pub fn multiprocessor_count(&self) -> usize {
        self.multiprocessors
    }

    /// The `N` of `cuda:N`.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// `(free, total)` device memory in bytes: what sizes the KV pool.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| driver("cuMemGetInfo", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver("cuStreamSynchronize", e))
    }

    pub(crate) fn kernels(&self) -> &KernelTable {
        &self.kernels
    }

    pub(crate) fn blas(&self) -> &Blas {
        &self.blas
    }
}

/// The CUBIN of `kernel` for `arch`: from `cache` when present, else compiled and stored.
/// Returns whether it came from the cache.
pub fn cached_cubin_with_origin(
    cache: &KernelCache,
    kernel: &KernelSource,
    arch: &str,
) -> Result<(Vec<u8>, bool)> {
    let path = cache.path_for(kernel, arch, nvrtc::version()?)?;
    if let Some(bytes) = cache.load(&path) {
        return Ok((bytes, true));
    }
    let bytes = nvrtc::compile_cubin(kernel, arch)?;
    // A read-only cache costs a recompile next time, not this run.
    let _ = cache.store(&path, &bytes);
    Ok((bytes, false))
}

pub(crate) fn cached_cubin(
    cache: &KernelCache,
    kernel: &KernelSource,
    arch: &str,
) -> Result<Vec<u8>> {
    cached_cubin_with_origin(cache, kernel, arch).map(|(bytes, _)| bytes)
}

pub(crate) fn driver(op: &'static str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver {
        op,
        message: format!("{e:?}"),
    }
}

/// As [`driver`], naming what the call was about (a kernel, an entry point).
pub(crate) fn driver_named(op: &'static str, what: &str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver {
        op,
        message: format!("{what}: {e:?}"),
    }
}
