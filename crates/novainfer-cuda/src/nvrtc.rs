//! NVRTC through cudarc: finding the library, its version, and compiling one kernel to a
//! CUBIN for one architecture — no GPU involved.
//!
//! cudarc's `dynamic-loading` dlopens bare names (`libnvrtc.so`, `libnvrtc.so.13`, …), so it
//! finds what the dynamic loader finds (LD_LIBRARY_PATH as it was at process start, the ld
//! cache) and panics when nothing is there. We therefore probe with
//! `nvrtc::sys::is_culib_present` before any other call, and, for NVRTC installed from the
//! PyPI wheel `nvidia-cuda-nvrtc` (`site-packages/nvidia/cu13/lib`), [`load_from_dir`]
//! dlopens it by path first: glibc then resolves cudarc's bare-name lookup to the already
//! loaded object by its soname. NVRTC itself dlopens `libnvrtc-builtins.so.<maj>.<min>` by
//! bare name when it compiles, so that one is preloaded too.

use std::ffi::{c_char, CStr, CString};
use std::path::Path;
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use crate::cache::NvrtcVersion;
use crate::error::{CudaError, Result};
use crate::kernels::KernelSource;

/// Environment variable naming a directory holding `libnvrtc.so.13` (and its builtins).
pub const NVRTC_DIR_ENV: &str = "NOVAINFER_NVRTC_DIR";

/// dlopens NVRTC (and its builtins) from `dir` for the rest of the process.
pub fn load_from_dir(dir: &Path) -> Result<()> {
    let not_found = |what: String| CudaError::NotAvailable(what);
    let entries = std::fs::read_dir(dir).map_err(|e| {
        not_found(format!(
            "cannot read NVRTC directory {}: {e}",
            dir.display()
        ))
    })?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    // The `.alt` variants are a second build of the same library; never pick them.
    let pick = |prefix: &str| {
        names
            .iter()
            .find(|n| n.starts_with(prefix) && n.contains(".so") && !n.contains(".alt."))
            .cloned()
    };
    let builtins = pick("libnvrtc-builtins");
    let nvrtc = pick("libnvrtc.so")
        .ok_or_else(|| not_found(format!("no libnvrtc.so* in {}", dir.display())))?;
    for name in builtins.iter().chain(std::iter::once(&nvrtc)) {
        let path = dir.join(name);
        // SAFETY: loading NVRTC runs only its own initialisers; RTLD_GLOBAL makes its soname
        // visible to cudarc's later dlopen of the bare name.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| not_found(format!("cannot load {}: {e}", path.display())))?;
        // Kept loaded for the life of the process: cudarc holds function pointers into it.
        std::mem::forget(lib);
    }
    Ok(())
}

/// Checks that NVRTC can be loaded (from `NOVAINFER_NVRTC_DIR` or the loader's search path).
pub fn probe() -> Result<()> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            if let Some(dir) = std::env::var_os(NVRTC_DIR_ENV).filter(|d| !d.is_empty()) {
                load_from_dir(Path::new(&dir)).map_err(|e| match e {
                    CudaError::NotAvailable(why) => why,
                    other => other.to_string(),
                })?;
            }
            // SAFETY: only tries to dlopen candidate names; touches no symbol.
            if unsafe { sys::is_culib_present() } {
                Ok(())
            } else {
                Err(format!(
                    "libnvrtc not found (set {NVRTC_DIR_ENV} to the directory of libnvrtc.so.13, \
                     e.g. site-packages/nvidia/cu13/lib of the `nvidia-cuda-nvrtc` wheel, or add \
                     it to LD_LIBRARY_PATH)"
                ))
            }
        })
        .clone()
        .map_err(CudaError::NotAvailable)
}

pub fn version() -> Result<NvrtcVersion> {
    probe()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (probe); both pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::NotAvailable(format!("nvrtcVersion failed: {e:?}")))?;
    Ok(NvrtcVersion { major, minor })
}

/// Compiles `kernel` for `arch` (`"sm_80"`, `"sm_90"`, …) and returns the CUBIN.
pub fn compile_cubin(kernel: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    probe()?;
    let source = kernel.expand()?;
    let compile_err = |log: String| CudaError::Compile {
        kernel: kernel.name,
        arch: arch.to_owned(),
        log,
    };
    let src = CString::new(source).map_err(|_| compile_err("source contains a NUL byte".into()))?;
    let name = CString::new(format!("{}.cu", kernel.name))
        .map_err(|_| compile_err("kernel name contains a NUL byte".into()))?;
    let program = Program(
        result::create_program(&src, Some(&name)).map_err(|e| compile_err(format!("{e:?}")))?,
    );
    // `-lineinfo` keeps profiles readable; fmad stays on: kernels that need exact
    // rounding spell it with `__f*_rn` intrinsics, which are never contracted.
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
        "-default-device".to_owned(),
        "-lineinfo".to_owned(),
    ];
    // SAFETY: `program` is a live program created above.
    if let Err(e) = unsafe { result::compile_program(program.0, &options) } {
        return Err(compile_err(format!("{e:?}: {}", program.log())));
    }
    program
        .cubin()
        .map_err(|e| compile_err(format!("nvrtcGetCUBIN: {e:?}")))
}

/// Owns an `nvrtcProgram`; destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Program {
    fn log(&self) -> String {
        // SAFETY: `self.0` is live; the buffer is sized by NVRTC and NUL-terminated.
        match unsafe { result::get_program_log(self.0) } {
            Ok(raw) => unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
            Err(e) => format!("(no log: {e:?})"),
        }
    }

    fn cubin(&self) -> std::result::Result<Vec<u8>, result::NvrtcError> {
        let mut size = 0usize;
        // SAFETY: `self.0` is a compiled program; `size` is valid for writes, and the buffer
        // has exactly the size NVRTC reported.
        unsafe {
            sys::nvrtcGetCUBINSize(self.0, &mut size).result()?;
            let mut bytes = vec![0u8; size];
            sys::nvrtcGetCUBIN(self.0, bytes.as_mut_ptr().cast::<c_char>()).result()?;
            Ok(bytes)
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed only here. A failure to free a
        // program leaks host memory and is not worth a panic in drop.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}
