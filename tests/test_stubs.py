"""`_native.pyi` must describe the compiled extension exactly (mypy stubtest)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_native_stub_matches_the_extension():
    pytest.importorskip("mypy")
    res = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "novainfer._native", "--ignore-missing-stub"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
