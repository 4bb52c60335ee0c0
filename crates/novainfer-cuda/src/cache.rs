//! Where compiled kernels are kept on disk and under which name.
//!
//! A binary is valid for exactly one (expanded source, NVRTC options, GPU architecture, NVRTC
//! version), so all four are in its file name:
//! `<kernel>-<arch>-nvrtc<major>.<minor>-<xxh3 of source and options>.cubin`.
//! A stale file is never read, only left behind. Writes go to a temporary file renamed into
//! place, so a concurrent reader sees a whole binary or none.

use std::path::{Path, PathBuf};

use crate::error::{CudaError, Result};
use crate::kernels::{compile_options, KernelSource};

/// `$NOVAINFER_HOME/kernels`, else `~/.cache/novainfer/kernels`, else a temp dir.
pub fn default_cache_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("NOVAINFER_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home).join("kernels");
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".cache/novainfer/kernels"),
        None => std::env::temp_dir().join("novainfer-kernels"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvrtcVersion {
    pub major: i32,
    pub minor: i32,
}

/// A directory of compiled kernels.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where `kernel` compiled for `arch` with [`compile_options`] lives.
    pub fn path_for(
        &self,
        kernel: &KernelSource,
        arch: &str,
        nvrtc: NvrtcVersion,
    ) -> Result<PathBuf> {
        self.path_with_options(kernel, arch, nvrtc, &compile_options(arch))
    }

    /// As [`Self::path_for`], for an explicit option list.
    pub fn path_with_options(
        &self,
        kernel: &KernelSource,
        arch: &str,
        nvrtc: NvrtcVersion,
        options: &[String],
    ) -> Result<PathBuf> {
        let mut key = kernel.expand()?.into_bytes();
        // NUL never occurs in a source or an option, so the concatenation is unambiguous.
        for option in options {
            key.push(0);
            key.extend_from_slice(option.as_bytes());
        }
        Ok(self.dir.join(format!(
            "{}-{arch}-nvrtc{}.{}-{:016x}.cubin",
            kernel.name,
            nvrtc.major,
            nvrtc.minor,
            xxhash_rust::xxh3::xxh3_64(&key)
        )))
    }

    /// The cached binary, if one was stored under exactly this key.
    pub fn load(&self, path: &Path) -> Option<Vec<u8>> {
        std::fs::read(path).ok().filter(|b| !b.is_empty())
    }

    pub fn store(&self, path: &Path, binary: &[u8]) -> Result<()> {
        let io = |source| CudaError::Cache {
            path: path.to_owned(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, binary).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::RMS_NORM;

    const V13: NvrtcVersion = NvrtcVersion {
        major: 13,
        minor: 0,
    };

    #[test]
    fn key_separates_arch_and_nvrtc_version() {
        let cache = KernelCache::new("/c");
        let a = cache.path_for(&RMS_NORM, "sm_80", V13).expect("path");
        let b = cache.path_for(&RMS_NORM, "sm_90", V13).expect("path");
        let c = cache
            .path_for(
                &RMS_NORM,
                "sm_80",
                NvrtcVersion {
                    major: 13,
                    minor: 1,
                },
            )
            .expect("path");
        assert!(a
            .to_string_lossy()
            .starts_with("/c/rms_norm-sm_80-nvrtc13.0-"));
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn key_separates_compile_options() {
        let cache = KernelCache::new("/c");
        let mut options = compile_options("sm_80");
        let plain = cache
            .path_with_options(&RMS_NORM, "sm_80", V13, &options)
            .expect("path");
        assert_eq!(
            plain,
            cache.path_for(&RMS_NORM, "sm_80", V13).expect("path")
        );
        options.push("--use_fast_math".to_owned());
        let fast = cache
            .path_with_options(&RMS_NORM, "sm_80", V13, &options)
            .expect("path");
        assert_ne!(plain, fast);
    }

    #[test]
    fn store_then_load_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = KernelCache::new(dir.path().join("nested"));
        let path = cache.path_for(&RMS_NORM, "sm_80", V13).expect("path");
        assert_eq!(cache.load(&path), None);
        cache.store(&path, b"\x7fELF..").expect("store");
        assert_eq!(cache.load(&path).as_deref(), Some(&b"\x7fELF.."[..]));
    }
}
