//! Shared by the integration tests: finding NVRTC (and cuBLAS) without a system CUDA, and
//! the runtime skip for tests that need a GPU — which fails instead under
//! `NOVAINFER_REQUIRE_GPU=1` (see `novainfer_cuda::gpu_test`).

#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod host;

use novainfer_cuda::gpu_test::{when_unavailable_from_env, WhenUnavailable, REQUIRE_GPU_ENV};
use novainfer_cuda::{CudaError, GpuContext};

/// Set to 1 (CI does) to turn "NVRTC not found" from a skip into a failure.
pub const REQUIRE_NVRTC_ENV: &str = "NOVAINFER_REQUIRE_NVRTC";

#[cfg(feature = "cuda")]
mod locate {
    use std::path::PathBuf;
    use std::process::Command;

    use novainfer_cuda::{libs, nvrtc, CudaError};

    /// `site-packages/nvidia/cu13/lib` of the `nvidia-cuda-nvrtc` wheel, as seen by `python3`
    /// (or `$NOVAINFER_PYTHON`).
    fn wheel_lib_dir() -> Option<PathBuf> {
        let python = std::env::var("NOVAINFER_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let script = "import site, sysconfig\n\
                      paths = [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']]\n\
                      paths += site.getsitepackages() + [site.getusersitepackages()]\n\
                      print('\\n'.join(paths))";
        let out = Command::new(python).args(["-c", script]).output().ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|p| PathBuf::from(p).join("nvidia/cu13/lib"))
            .find(|dir| dir.join("libnvrtc.so.13").is_file())
    }

    /// Makes NVRTC loadable: `$NOVAINFER_NVRTC_DIR` / `$NOVAINFER_CUDA_LIB_DIR` (read by the
    /// crate itself), else the pip wheel (with cuBLAS if that wheel is there too), else
    /// whatever the system loader finds.
    pub fn nvrtc() -> Result<(), CudaError> {
        let from_env = [nvrtc::NVRTC_DIR_ENV, libs::CUDA_LIB_DIR_ENV]
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|d| !d.is_empty()));
        if !from_env {
            if let Some(dir) = wheel_lib_dir() {
                if let Err(e) = nvrtc::load_from_dir(&dir) {
                    panic!("NVRTC in {} does not load: {e}", dir.display());
                }
            }
        }
        nvrtc::probe()
    }
}

/// `None` (with a "skipped" line) when NVRTC is absent and CI did not require it.
#[cfg(feature = "cuda")]
pub fn nvrtc_or_skip() -> Option<()> {
    match locate::nvrtc() {
        Ok(()) => Some(()),
        Err(e) if std::env::var(REQUIRE_NVRTC_ENV).as_deref() != Ok("1") => {
            println!(
                "skipped: {e}; `pip install nvidia-cuda-nvrtc==13.0.88` into python3's \
                 environment or set {} to run this test",
                novainfer_cuda::libs::CUDA_LIB_DIR_ENV
            );
            None
        }
        Err(e) => panic!("{REQUIRE_NVRTC_ENV}=1 but {e}"),
    }
}

/// Whether GPU 0 opens (after the same library search as [`gpu_or_skip`]).
pub fn gpu_opens() -> bool {
    #[cfg(feature = "cuda")]
    let _ = locate::nvrtc();
    GpuContext::new(0).is_ok()
}

/// GPU 0, or `None` after printing "skipped: no CUDA device (<why>)" — unless
/// `NOVAINFER_REQUIRE_GPU` is set, which makes a missing GPU a failure.
pub fn gpu_or_skip(test: &str) -> Option<GpuContext> {
    // A missing NVRTC shows up below as NotAvailable from `GpuContext::new`.
    #[cfg(feature = "cuda")]
    let _ = locate::nvrtc();
    match GpuContext::new(0) {
        Ok(gpu) => Some(gpu),
        Err(CudaError::NotAvailable(why)) => match when_unavailable_from_env() {
            WhenUnavailable::Skip => {
                println!("{test}: skipped: no CUDA device ({why})");
                None
            }
            WhenUnavailable::Fail => {
                panic!("{test}: {REQUIRE_GPU_ENV} is set but no CUDA device is usable: {why}")
            }
        },
        Err(e) => panic!("{test}: opening the GPU failed: {e}"),
    }
}
