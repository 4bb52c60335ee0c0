//! NVRTC through cudarc: its version, and compiling one kernel to a CUBIN for one
//! architecture — no GPU involved. Finding the library (including the pip wheel's copy) is
//! [`crate::libs`]'s job; [`probe`] runs it before any NVRTC call, because cudarc panics on a
//! missing library.

use std::ffi::{c_char, CStr, CString};
use std::path::Path;
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use crate::cache::NvrtcVersion;
use crate::error::{CudaError, Result};
use crate::kernels::{compile_options, KernelSource};
use crate::libs;

pub use crate::libs::NVRTC_DIR_ENV;

/// dlopens NVRTC (and its builtins, and whatever else of CUDA's is there) from `dir`;
/// [`CudaError::NotAvailable`] when `dir` has no `libnvrtc.so*`.
pub fn load_from_dir(dir: &Path) -> Result<()> {
    let loaded = libs::preload_dir(dir)?;
    if loaded.iter().any(|n| n.starts_with("libnvrtc.so")) {
        Ok(())
    } else {
        Err(CudaError::NotAvailable(format!(
            "no libnvrtc.so* in {}",
            dir.display()
        )))
    }
}

/// Checks that NVRTC can be loaded (from the directories in `NOVAINFER_CUDA_LIB_DIR` /
/// `NOVAINFER_NVRTC_DIR`, or the loader's search path).
pub fn probe() -> Result<()> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            libs::preload_from_env().map_err(|e| match e {
                CudaError::NotAvailable(why) => why,
                other => other.to_string(),
            })?;
            // SAFETY: only tries to dlopen candidate names; touches no symbol.
            if unsafe { sys::is_culib_present() } {
                Ok(())
            } else {
                Err(format!(
                    "libnvrtc not found (set {} to the directory of libnvrtc.so.13, \
                     e.g. site-packages/nvidia/cu13/lib of the `nvidia-cuda-nvrtc` wheel, or add \
                     it to LD_LIBRARY_PATH)",
                    libs::CUDA_LIB_DIR_ENV
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
    let options = compile_options(arch);
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
