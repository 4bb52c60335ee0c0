//! Making the CUDA libraries cudarc needs loadable, and asking whether they are.
//!
//! cudarc's `dynamic-loading` dlopens bare names (`libnvrtc.so.13`, `libcublas.so.13`, …), so
//! it finds what the dynamic loader finds (LD_LIBRARY_PATH as it was at process start, the ld
//! cache) and panics when nothing is there. Two things follow:
//!
//! * every library is probed (`is_culib_present`) before cudarc calls into it, so a missing
//!   one is [`CudaError::NotAvailable`] naming it, never a panic;
//! * libraries installed from PyPI wheels (`nvidia-cuda-nvrtc`, `nvidia-cublas`, both in
//!   `site-packages/nvidia/cu13/lib`) are not on the loader's path. [`preload_dir`] dlopens
//!   them by full path with RTLD_GLOBAL; glibc then resolves cudarc's later bare-name lookup
//!   to the already loaded object by its soname. The directories come from
//!   [`CUDA_LIB_DIR_ENV`] (and the older [`NVRTC_DIR_ENV`]).
//!
//! Load order matters where one library needs another: NVRTC dlopens its builtins by bare
//! name when it compiles, and libcublas links against libcublasLt, so those go first.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{CudaError, Result};

/// Directories (`:`-separated) holding CUDA libraries to preload, e.g.
/// `site-packages/nvidia/cu13/lib` of the `nvidia-cuda-nvrtc` and `nvidia-cublas` wheels.
pub const CUDA_LIB_DIR_ENV: &str = "NOVAINFER_CUDA_LIB_DIR";

/// The older, NVRTC-only spelling of [`CUDA_LIB_DIR_ENV`]; still honoured.
pub const NVRTC_DIR_ENV: &str = "NOVAINFER_NVRTC_DIR";

/// Library stems in load order: each one after the libraries it loads itself.
const PRELOAD_ORDER: [&str; 4] = ["libnvrtc-builtins", "libnvrtc", "libcublasLt", "libcublas"];

/// The file to load for each known library among `names` (a directory listing), in load
/// order. `lib<stem>.so*` matches its stem only (`libcublas.so` is not `libcublasLt.so`); the
/// wheels' `.alt.` builds are a second copy of the same library and never picked.
pub fn pick_libraries(names: &[String]) -> Vec<String> {
    let mut sorted: Vec<&String> = names.iter().collect();
    sorted.sort();
    PRELOAD_ORDER
        .iter()
        .filter_map(|stem| {
            let prefix = format!("{stem}.so");
            sorted
                .iter()
                .find(|n| n.starts_with(&prefix) && !n.contains(".alt."))
                .map(|n| (*n).clone())
        })
        .collect()
}

/// dlopens every known CUDA library in `dir` for the rest of the process; returns the file
/// names it loaded (possibly none).
pub fn preload_dir(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        CudaError::NotAvailable(format!(
            "cannot read CUDA library directory {}: {e}",
            dir.display()
        ))
    })?;
    let names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let picked = pick_libraries(&names);
    for name in &picked {
        let path = dir.join(name);
        // SAFETY: loading a CUDA library runs only its own initialisers; RTLD_GLOBAL makes its
        // soname visible to cudarc's later dlopen of the bare name.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| CudaError::NotAvailable(format!("cannot load {}: {e}", path.display())))?;
        // Kept loaded for the life of the process: cudarc holds function pointers into it.
        std::mem::forget(lib);
    }
    Ok(picked)
}

/// The directories named by [`NVRTC_DIR_ENV`] and [`CUDA_LIB_DIR_ENV`].
fn env_dirs() -> Vec<PathBuf> {
    [NVRTC_DIR_ENV, CUDA_LIB_DIR_ENV]
        .iter()
        .filter_map(std::env::var_os)
        .flat_map(|v| std::env::split_paths(&v).collect::<Vec<_>>())
        .filter(|d| !d.as_os_str().is_empty())
        .collect()
}

/// Preloads from the environment's directories, once per process.
pub(crate) fn preload_from_env() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for dir in env_dirs() {
            preload_dir(&dir).map_err(|e| match e {
                CudaError::NotAvailable(why) => why,
                other => other.to_string(),
            })?;
        }
        Ok(())
    })
    .clone()
    .map_err(CudaError::NotAvailable)
}

/// Checks that cuBLAS (and so cuBLASLt, which it links) can be loaded.
pub fn probe_cublas() -> Result<()> {
    preload_from_env()?;
    // SAFETY: only tries to dlopen candidate names; touches no symbol.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NotAvailable(format!(
            "libcublas.so.13 (or the libcublasLt.so.13 it needs) not found: `pip install \
             nvidia-cublas` and set {CUDA_LIB_DIR_ENV} to its site-packages/nvidia/cu13/lib, \
             or add the CUDA toolkit's lib64 to LD_LIBRARY_PATH"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn picks_each_library_once_in_load_order() {
        let dir = names(&[
            "libcublas.so.13",
            "libnvrtc.alt.so.13",
            "libcublasLt.so.13",
            "libnvrtc.so.13",
            "libnvrtc-builtins.alt.so.13.0",
            "libnvrtc-builtins.so.13.0",
            "libcudart.so.13",
            "README",
        ]);
        assert_eq!(
            pick_libraries(&dir),
            names(&[
                "libnvrtc-builtins.so.13.0",
                "libnvrtc.so.13",
                "libcublasLt.so.13",
                "libcublas.so.13",
            ])
        );
        // An NVRTC-only wheel directory yields just NVRTC.
        let nvrtc_only = names(&["libnvrtc.so.13", "libnvrtc-builtins.so.13.0"]);
        assert_eq!(
            pick_libraries(&nvrtc_only),
            names(&["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"])
        );
        assert!(pick_libraries(&names(&["libcublasLt.so.13"])).len() == 1);
    }

    #[test]
    fn an_unreadable_directory_is_not_available() {
        let err = preload_dir(Path::new("/nonexistent/novainfer")).expect_err("no such dir");
        assert!(matches!(err, CudaError::NotAvailable(why) if why.contains("/nonexistent")));
    }

    #[test]
    fn an_empty_directory_loads_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            preload_dir(dir.path()).expect("readable"),
            Vec::<String>::new()
        );
    }
}
