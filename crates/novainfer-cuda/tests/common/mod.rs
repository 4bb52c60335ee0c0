//! Shared by the integration tests: finding NVRTC without a system CUDA, and the runtime
//! skip for tests that need a GPU.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use novainfer_cuda::{nvrtc, CudaError, GpuContext};

/// Set to 1 (CI does) to turn "NVRTC not found" from a skip into a failure.
pub const REQUIRE_NVRTC_ENV: &str = "NOVAINFER_REQUIRE_NVRTC";

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

/// Makes NVRTC loadable: `$NOVAINFER_NVRTC_DIR`, else the pip wheel, else whatever the
/// system loader finds.
fn locate_nvrtc() -> Result<(), CudaError> {
    let dir = std::env::var_os(nvrtc::NVRTC_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(wheel_lib_dir);
    if let Some(dir) = &dir {
        if let Err(e) = nvrtc::load_from_dir(dir) {
            panic!("NVRTC in {} does not load: {e}", dir.display());
        }
    }
    nvrtc::probe()
}

/// `None` (with a "skipped" line) when NVRTC is absent and CI did not require it.
pub fn nvrtc_or_skip() -> Option<()> {
    match locate_nvrtc() {
        Ok(()) => Some(()),
        Err(e) if std::env::var(REQUIRE_NVRTC_ENV).as_deref() != Ok("1") => {
            println!(
                "skipped: {e}; `pip install nvidia-cuda-nvrtc==13.0.88` into python3's \
                 environment or set {} to run this test",
                nvrtc::NVRTC_DIR_ENV
            );
            None
        }
        Err(e) => panic!("{REQUIRE_NVRTC_ENV}=1 but {e}"),
    }
}

/// GPU 0, or `None` after printing "skipped: no CUDA device (<why>)".
pub fn gpu_or_skip(test: &str) -> Option<GpuContext> {
    // A missing NVRTC shows up below as NotAvailable from `GpuContext::new`.
    let _ = locate_nvrtc();
    match GpuContext::new(0) {
        Ok(gpu) => Some(gpu),
        Err(CudaError::NotAvailable(why)) => {
            println!("{test}: skipped: no CUDA device ({why})");
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed: {e}"),
    }
}
