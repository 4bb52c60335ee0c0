//! The device context: one GPU, one stream, and the kernel modules loaded on it.
//!
//! [`GpuContext::new`] is the only way in, and it never panics for want of CUDA: libcuda and
//! libnvrtc are probed before cudarc touches them (cudarc's `dynamic-loading` panics on a
//! missing library), and a driver without devices maps to [`CudaError::NotAvailable`].
//! Modules are compiled (or read from the disk cache) on first use, once per context.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::cache::{default_cache_dir, KernelCache};
use crate::error::{CudaError, Result};
use crate::kernels::KernelSource;
use crate::nvrtc;

pub struct GpuContext {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    cache: KernelCache,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

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
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("cuCtxCreate", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("cuDeviceGetAttribute", e))?;
        let stream = ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?;
        Ok(Self {
            ctx,
            stream,
            arch: format!("sm_{major}{minor}"),
            cache,
            modules: Mutex::new(HashMap::new()),
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The NVRTC architecture of this GPU, e.g. `"sm_90"`.
    pub fn arch(&self) -> &str {
        &self.arch
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

    /// Entry point `name` of `kernel`, compiling or loading its module on first use.
    pub fn function(&self, kernel: &KernelSource, name: &str) -> Result<CudaFunction> {
        let module = self.module(kernel)?;
        module
            .load_function(name)
            .map_err(|e| driver("cuModuleGetFunction", e))
    }

    fn module(&self, kernel: &KernelSource) -> Result<Arc<CudaModule>> {
        let mut modules = self
            .modules
            .lock()
            .expect("module map poisoned: this is a bug");
        if let Some(m) = modules.get(kernel.name) {
            return Ok(m.clone());
        }
        let cubin = cached_cubin(&self.cache, kernel, &self.arch)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(|e| driver("cuModuleLoadData", e))?;
        modules.insert(kernel.name, module.clone());
        Ok(module)
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

fn cached_cubin(cache: &KernelCache, kernel: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    cached_cubin_with_origin(cache, kernel, arch).map(|(bytes, _)| bytes)
}

pub(crate) fn driver(op: &'static str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver {
        op,
        message: format!("{e:?}"),
    }
}
