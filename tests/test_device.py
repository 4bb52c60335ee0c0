"""`device=`: the choice between the CPU and a CUDA GPU, as users reach it (LLM, AsyncLLM, CLI, server).

These tests run on any machine. Where no GPU can be used (CI), an explicit ``cuda`` must fail with
`DeviceUnavailableError` saying what is missing and ``auto`` must run on the CPU and say why; where one can,
``auto`` must pick it. Which branch runs is decided by the engine's own probe, so neither can pass by
accident on the other kind of machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from novainfer import LLM, AsyncLLM, DeviceUnavailableError, InvalidParameterError, NovaInferError, SamplingParams
from novainfer import _native

from conftest import PROMPT

GPU_MISSING = _native.cuda_unavailable_reason()


def test_auto_is_the_default_and_reports_its_choice(tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="novainfer"):
        llm = LLM(tiny_models["f32"], kv_cache_bytes=1 << 22)
    # The tiny model's head size (16) has no GPU kernels, so `auto` runs it on the CPU even beside a GPU
    # (tests/test_cuda.py checks that `auto` picks the GPU for a model it can run).
    assert llm.device == "cpu"
    assert any("cpu" in r.getMessage() for r in caplog.records), caplog.text
    # The log line carries the reason, so a user sees why the GPU was not used.
    assert (GPU_MISSING or "not supported on cuda:0") in caplog.text


@pytest.mark.skipif(GPU_MISSING is None, reason="a usable GPU is present: device='cuda' would succeed")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7"])
def test_explicit_cuda_without_a_gpu_is_a_typed_error_never_a_cpu_run(tiny_models, device):
    with pytest.raises(DeviceUnavailableError) as info:
        LLM(tiny_models["f32"], device=device)
    message = str(info.value)
    assert isinstance(info.value, NovaInferError) and info.value.param == "device"
    assert ("cuda:0" if device == "cuda" else device) in message, message
    # What is missing is named: the driver, NVRTC, cuBLAS, a GPU, or the build.
    assert GPU_MISSING in message, message


def test_explicit_cpu_runs_on_the_cpu_with_the_same_tokens(tiny_models, tiny_llm):
    llm = LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    assert llm.device == "cpu"
    params = SamplingParams(temperature=0, max_tokens=8)
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == tiny_llm.generate(PROMPT, params)[0].outputs[0].token_ids


def test_enforce_eager_is_accepted_and_changes_nothing_on_the_cpu(tiny_models, tiny_llm, monkeypatch):
    # CUDA graphs are a GPU executor's matter; on the CPU the option (and the graphs switch) has no effect.
    monkeypatch.setenv("NOVAINFER_CUDA_GRAPHS", "1")
    llm = LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == tiny_llm.generate(PROMPT, params)[0].outputs[0].token_ids


def test_a_misspelt_gpu_kernel_choice_is_refused_before_the_model_loads(tiny_models, tiny_llm, monkeypatch):
    # NOVAINFER_CUDA_DECODE_LINEAR picks the CUDA executor's decode linears (separate by default, or fused); the
    # CPU ignores a valid choice, and any engine refuses a value that is neither, naming the variable.
    params = SamplingParams(temperature=0, max_tokens=8)
    monkeypatch.setenv("NOVAINFER_CUDA_DECODE_LINEAR", "fused")
    llm = LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == tiny_llm.generate(PROMPT, params)[0].outputs[0].token_ids
    monkeypatch.setenv("NOVAINFER_CUDA_DECODE_LINEAR", "fast")
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    assert info.value.param == "NOVAINFER_CUDA_DECODE_LINEAR" and "fused" in str(info.value)
    # Likewise the GEMM library the GPU context picks (cuBLAS, or cuBLASLt with `lt`).
    monkeypatch.setenv("NOVAINFER_CUDA_DECODE_LINEAR", "fused")
    monkeypatch.setenv("NOVAINFER_CUDA_GEMM", "lt")
    LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    monkeypatch.setenv("NOVAINFER_CUDA_GEMM", "fastest")
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    assert info.value.param == "NOVAINFER_CUDA_GEMM" and "lt" in str(info.value)
    # And how larger steps multiply packed matrices (expanded for cuBLAS, or the tiled GEMM with `tile`).
    monkeypatch.setenv("NOVAINFER_CUDA_GEMM", "lt")
    monkeypatch.setenv("NOVAINFER_CUDA_PACKED_GEMM", "tile")
    LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    monkeypatch.setenv("NOVAINFER_CUDA_PACKED_GEMM", "marlin")
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    assert info.value.param == "NOVAINFER_CUDA_PACKED_GEMM" and "tile" in str(info.value)


def test_async_scheduling_with_speculative_decoding_is_refused(tiny_models):
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert info.value.param == "async_scheduling" and "speculative" in str(info.value)


@pytest.mark.parametrize("device", ["tpu", "cuda:", "cuda:-1", "gpu:1", ""])
def test_unknown_device_names_the_parameter(tiny_models, device):
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], device=device)
    assert info.value.param == "device" and "cuda:N" in str(info.value)


@pytest.mark.parametrize("value", [0, -0.5, 1.01, float("nan"), True, "0.5"])
def test_gpu_memory_utilization_is_checked(tiny_models, value):
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], gpu_memory_utilization=value)
    assert info.value.param == "gpu_memory_utilization"


def test_gpu_memory_utilization_does_not_size_a_cpu_pool(tiny_models):
    small = LLM(tiny_models["f32"], device="cpu", gpu_memory_utilization=0.1)
    assert small.stats()["kv_pool_bytes"] == pytest.approx(2 << 30, rel=0.01)


@pytest.mark.skipif(GPU_MISSING is None, reason="a usable GPU is present")
def test_slot_layout_or_cuda_never_silently_runs_elsewhere(tiny_models):
    with pytest.raises(NovaInferError):
        LLM(tiny_models["f32"], device="cuda", kv_layout="slot")


def test_async_llm_takes_the_device(tiny_models):
    llm = AsyncLLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22)
    assert llm.device == "cpu"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("novainfer")
    cmd = [exe] if exe else [sys.executable, "-m", "novainfer.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(GPU_MISSING is None, reason="a usable GPU is present")
def test_cli_device_cuda_fails_in_one_line(tiny_models):
    res = _cli("generate", "--model", str(tiny_models["f32"]), "--device", "cuda", "--max-tokens", "2", "hi")
    assert res.returncode == 1
    assert res.stderr.startswith("error:") and "not available" in res.stderr and "Traceback" not in res.stderr


def test_cli_device_cpu_generates(tiny_models):
    res = _cli("generate", "--model", str(tiny_models["f32"]), "--device", "cpu", "--max-tokens", "2", "hi")
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(GPU_MISSING is None, reason="a usable GPU is present")
def test_server_device_cuda_refuses_to_start(tiny_models):
    res = subprocess.run(
        [sys.executable, "-m", "novainfer.server", "--model", str(tiny_models["f32"]), "--device", "cuda", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode != 0
    assert "not available" in res.stderr, res.stderr
    assert "NovaInfer is serving" not in res.stdout


def test_pip_installed_cuda_libraries_are_found_and_user_settings_kept(tmp_path, monkeypatch):
    from novainfer import cuda_libs

    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.13").touch()
    (lib / "libcublas.so.13").touch()
    monkeypatch.setattr(cuda_libs, "_site_dirs", lambda: [tmp_path / "elsewhere", tmp_path])
    monkeypatch.delenv(cuda_libs.NVRTC_DIR_ENV, raising=False)
    monkeypatch.setenv(cuda_libs.CUDA_LIB_DIR_ENV, "/opt/mine")
    found = cuda_libs.find_cuda_libraries()
    assert found == {cuda_libs.NVRTC_DIR_ENV: str(lib)}
    assert os.environ[cuda_libs.NVRTC_DIR_ENV] == str(lib)
    assert os.environ[cuda_libs.CUDA_LIB_DIR_ENV] == "/opt/mine", "a user's own setting wins"
