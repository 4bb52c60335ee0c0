"""Finding CUDA's user-space libraries (NVRTC, cuBLAS) that pip installed, for the GPU executor.

The Rust core loads libcuda, NVRTC and cuBLAS at run time. The driver's libcuda is on the system loader's
path; NVRTC and cuBLAS often are not: they come from PyPI wheels (``nvidia-cuda-nvrtc``, ``nvidia-cublas``,
which PyTorch also installs) under ``site-packages/nvidia/cu13/lib``. This module points the core at that
folder through environment variables, before an engine starts, so ``device="cuda"`` works in a plain
``pip install`` environment with no CUDA toolkit. Variables the user has set are left alone.
"""

from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path

__all__ = ["find_cuda_libraries", "NVRTC_DIR_ENV", "CUDA_LIB_DIR_ENV"]

#: Folder holding ``libnvrtc.so.13`` (read by the core's NVRTC loader).
NVRTC_DIR_ENV = "NOVAINFER_NVRTC_DIR"
#: Folder holding ``libcublas.so.13`` and ``libcublasLt.so.13``.
CUDA_LIB_DIR_ENV = "NOVAINFER_CUDA_LIB_DIR"


def _site_dirs() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # some virtualenvs lack it
        pass
    paths.add(site.getusersitepackages())
    return [Path(p) for p in sorted(paths)]


def _wheel_lib_dir(library: str) -> Path | None:
    for base in _site_dirs():
        candidate = base / "nvidia" / "cu13" / "lib"
        if (candidate / library).is_file():
            return candidate
    return None


def find_cuda_libraries() -> dict[str, str]:
    """Sets `NOVAINFER_NVRTC_DIR` and `NOVAINFER_CUDA_LIB_DIR` to the pip-installed CUDA 13 libraries when
    they are found and the variables are unset; returns what it set. Safe to call on any machine."""
    found: dict[str, str] = {}
    for env, library in ((NVRTC_DIR_ENV, "libnvrtc.so.13"), (CUDA_LIB_DIR_ENV, "libcublas.so.13")):
        if os.environ.get(env):
            continue
        folder = _wheel_lib_dir(library)
        if folder is not None:
            os.environ[env] = str(folder)
            found[env] = str(folder)
    return found
