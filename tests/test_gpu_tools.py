"""The GPU benchmarking tools, tested without a GPU: tools/synthetic_checkpoint.py (real-shape checkpoints with
random bf16 weights), scripts/gpu_bench.py's synthetic mode (its pure helpers, the kernel-time breakdown over fake
profiler events, one shape's run on the CPU) and scripts/gpu-test's usage text.

Nothing here downloads: the tokenizer comes from the demo GGUF when it is cached, else from the tiny test model's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import time
import types
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

import synthetic_checkpoint as sc  # noqa: E402
from tiny_qwen2 import _write_tokenizer, special_token_ids  # noqa: E402
from tiny_qwen2 import f32_to_bf16_bits as reference_bf16_bits  # noqa: E402

_spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
assert _spec is not None and _spec.loader is not None
gpu_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_bench)

DEMO_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# Real vocabulary rows (the demo tokenizer's ids reach 151664) on a tiny body: fast on a CPU, and the tokenizer
# has fewer tokens than embedding rows, as in the real models.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
SMALL_POOL = 1 << 20  # drawn in milliseconds; the large tensors wrap around it several times


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer files as `scripts/gpu-test build` writes them: from the demo GGUF if cached, else the tiny ones."""
    from novainfer.fetch import models_dir

    out = tmp_path_factory.mktemp("tokenizer")
    gguf = models_dir() / DEMO_GGUF
    if gguf.is_file():
        sc.write_tokenizer_dir(gguf, out)
    else:
        _write_tokenizer(out)
        specials = special_token_ids()
        (out / "generation_config.json").write_text(json.dumps({
            "bos_token_id": specials["<|endoftext|>"],
            "eos_token_id": [specials["<|im_end|>"], specials["<|endoftext|>"]],
            "pad_token_id": specials["<|endoftext|>"],
        }))
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The TINY shape, untied, in shards of at most 8 MiB (each vocabulary matrix, 19 MiB, alone in one)."""
    out = tmp_path_factory.mktemp("synthetic") / "tiny"
    return sc.write_checkpoint(out, TINY, tokenizer_dir, pool_values=SMALL_POOL, shard_bytes=8 << 20)


def read_safetensors(path: Path) -> tuple[dict, int]:
    """(header, offset of the payload) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return header, 8 + length


def load_tensor(path: Path, name: str) -> np.ndarray:
    """A BF16 tensor of a safetensors file as f32."""
    header, base = read_safetensors(path)
    entry = header[name]
    start, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + start)
        bits = np.frombuffer(f.read(end - start), dtype="<u2")
    return sc.bf16_bits_to_f32(bits).reshape(entry["shape"])


def weight_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name → the file holding it (single file or shards)."""
    index = checkpoint / "model.safetensors.index.json"
    if not index.exists():
        header, _ = read_safetensors(checkpoint / "model.safetensors")
        return {n: checkpoint / "model.safetensors" for n in header if n != "__metadata__"}
    weight_map = json.loads(index.read_text())["weight_map"]
    return {n: checkpoint / f for n, f in weight_map.items()}


# --------------------------------------------------------------------------- synthetic_checkpoint


def test_named_shapes_have_the_published_parameter_counts() -> None:
    # Qwen2.5-0.5B, DeepSeek-R1-Distill-Qwen-1.5B and Qwen2.5-7B as their model cards count them.
    expected = {"0.5b": 494_032_768, "1.5b": 1_777_088_000, "7b": 7_615_616_512}
    for name, count in expected.items():
        _, spec = sc.resolve_shape(name)
        assert sum(math.prod(s) for s, _ in sc.tensor_shapes(spec).values()) == count, name
    assert "lm_head.weight" not in sc.tensor_shapes(sc.resolve_shape("0.5b")[1])
    assert "lm_head.weight" in sc.tensor_shapes(sc.resolve_shape("7b")[1])
    assert gpu_bench.checkpoint_bytes("7b") == 2 * expected["7b"]


def test_bad_shapes_are_refused_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        sc.resolve_shape("3b")
    with pytest.raises(ValueError, match="missing keys \\['vocab_size'\\]"):
        sc.resolve_shape({k: v for k, v in TINY.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="unknown keys \\['head_size'\\]"):
        sc.resolve_shape({**TINY, "head_size": 16})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        sc.resolve_shape({**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="positive int"):
        sc.resolve_shape({**TINY, "hidden_size": 0})
    name, spec = sc.resolve_shape({**TINY, "name": "tiny", "rope_theta": 1e4})
    assert name == "tiny" and spec["rope_theta"] == 1e4 and spec["max_position_embeddings"] == 32768


def test_bf16_rounding_is_round_to_nearest_even() -> None:
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0xBF807FFF, 0x7F7FFFFF], dtype=np.uint32)
    values = bits.view(np.float32)
    # A tie rounds to the even neighbour; above the tie up; below it down (sign apart).
    assert sc.f32_to_bf16_bits(values).tolist() == [0x3F80, 0x3F82, 0x3F81, 0xBF80, 0x7F80]
    random = np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 0.02
    assert np.array_equal(sc.f32_to_bf16_bits(random), reference_bf16_bits(random))
    assert np.array_equal(sc.bf16_bits_to_f32(sc.f32_to_bf16_bits(values[:3])), [1.0, 1.015625, 1.0078125])


def test_pool_slices_wrap_around() -> None:
    pool = np.arange(10, dtype=np.uint16)
    assert sc.pool_slice(pool, 3, 4).tolist() == [3, 4, 5, 6]
    assert np.shares_memory(sc.pool_slice(pool, 3, 4), pool)  # no copy when it fits
    assert sc.pool_slice(pool, 7, 25).tolist() == [7, 8, 9, *range(10), *range(10), 0, 1]
    assert sc.pool_slice(pool, 17, 3).tolist() == [7, 8, 9]


def test_pool_values_are_normal_with_the_weight_std() -> None:
    values = sc.bf16_bits_to_f32(sc.value_pool(seed=3, size=1 << 18))
    assert np.isfinite(values).all()
    assert abs(values.std() - sc.WEIGHT_STD) < 0.02 * sc.WEIGHT_STD
    assert abs(values.mean()) < 0.01 * sc.WEIGHT_STD
    assert np.array_equal(sc.value_pool(seed=3, size=1000), sc.value_pool(seed=3, size=1000))


def test_checkpoint_files_header_and_values(tiny_checkpoint: Path, tokenizer_dir: Path) -> None:
    _, spec = sc.resolve_shape(TINY)
    expected = sc.tensor_shapes(spec)
    files = weight_files(tiny_checkpoint)
    assert set(files) == set(expected)
    assert len(set(files.values())) > 1, "8 MiB shards: the vocabulary matrices each need one of their own"
    total = 0
    for file in sorted(set(files.values())):
        header, base = read_safetensors(file)
        assert base % 8 == 0
        end = 0
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            assert entry["dtype"] == "BF16", name
            assert tuple(entry["shape"]) == expected[name][0], name
            assert entry["data_offsets"][0] == end, name  # packed in header order
            end = entry["data_offsets"][1]
            total += end - entry["data_offsets"][0]
        assert file.stat().st_size == base + end
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total == 2 * sum(math.prod(s) for s, _ in expected.values())

    for name, (_, kind) in expected.items():
        values = load_tensor(files[name], name)
        assert np.isfinite(values).all(), name
        if kind == "norm":
            assert (values == 1.0).all(), name
        elif values.size >= 4096:
            assert abs(values.std() - sc.WEIGHT_STD) < 0.1 * sc.WEIGHT_STD, name
        else:
            assert 0 < values.std() < 3 * sc.WEIGHT_STD, name  # biases: small
    # Tensors start at different places in the pool (values need not differ for speed, but a copy of one
    # matrix everywhere would be a bug in the offsets).
    q0 = load_tensor(files["model.layers.0.self_attn.q_proj.weight"], "model.layers.0.self_attn.q_proj.weight")
    q1 = load_tensor(files["model.layers.1.self_attn.q_proj.weight"], "model.layers.1.self_attn.q_proj.weight")
    assert not np.array_equal(q0, q1)

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    generation = json.loads((tokenizer_dir / "generation_config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["torch_dtype"] == "bfloat16" and config["hidden_act"] == "silu"
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert config["max_position_embeddings"] == 32768
    assert config["eos_token_id"] == generation["eos_token_id"][0]
    assert config["bos_token_id"] == generation["bos_token_id"]
    assert {k: config[k] for k in TINY} == TINY
    for file in sc.TOKENIZER_FILES:
        assert (tiny_checkpoint / file).read_bytes() == (tokenizer_dir / file).read_bytes()
    assert sc.is_complete(tiny_checkpoint, TINY, pool_values=SMALL_POOL, shard_bytes=8 << 20)


def test_novainfer_loads_and_generates_from_the_checkpoint(tiny_checkpoint: Path) -> None:
    from novainfer import LLM, SamplingParams

    llm = LLM(tiny_checkpoint, device="cpu", kv_cache_bytes=64 << 20)
    assert llm.device == "cpu"
    config = llm._engine.model_config
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == {
        "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 151936}
    out = llm.generate([list(range(100, 116))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 6 and all(0 <= t < 151936 for t in ids)
    # An id past the tokenizer's last token (the rows real models pad their vocabulary with) decodes to nothing
    # instead of failing: random weights pick such ids.
    forced = llm.generate([[100, 101]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                        logit_bias={151900: 100.0}))
    assert forced[0].outputs[0].token_ids == [151900, 151900]


def test_tied_single_file_checkpoint_is_deterministic(tmp_path: Path, tokenizer_dir: Path) -> None:
    small = {**TINY, "vocab_size": 512, "tie_word_embeddings": True}
    pool = 10_007  # prime: every tensor wraps at a different phase

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    a = sc.write_checkpoint(tmp_path / "a", small, tokenizer_dir, pool_values=pool)
    b = sc.write_checkpoint(tmp_path / "b", small, tokenizer_dir, pool_values=pool)
    c = sc.write_checkpoint(tmp_path / "c", small, tokenizer_dir, pool_values=pool, seed=1)
    assert digest(a) == digest(b) != digest(c)
    header, _ = read_safetensors(a / "model.safetensors")
    assert "lm_head.weight" not in header and not (a / "model.safetensors.index.json").exists()
    assert json.loads((a / "config.json").read_text())["tie_word_embeddings"] is True


def test_ensure_checkpoint_writes_only_what_is_missing(tmp_path: Path, tokenizer_dir: Path) -> None:
    small = {**TINY, "vocab_size": 512}
    kwargs = {"pool_values": 10_007, "shard_bytes": 40_000}
    out, written = sc.ensure_checkpoint(tmp_path / "m", small, tokenizer_dir, **kwargs)
    assert written and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert sc.ensure_checkpoint(out, small, tokenizer_dir, **kwargs) == (out, False)
    # Another seed, a lost shard, or an unfinished write (no synthetic.json) each mean writing it again.
    assert not sc.is_complete(out, small, seed=1, **kwargs)
    next(out.glob("model-00002-of-*.safetensors")).unlink()
    assert not sc.is_complete(out, small, **kwargs)
    assert sc.ensure_checkpoint(out, small, tokenizer_dir, **kwargs)[1]
    assert sc.is_complete(out, small, **kwargs)
    (out / "synthetic.json").unlink()
    assert not sc.is_complete(out, small, **kwargs)
    # Rewritten as one file: no shard of the old layout may stay beside it.
    sc.write_checkpoint(out, small, tokenizer_dir, pool_values=10_007)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_cli_writes_and_then_skips(tmp_path: Path, tokenizer_dir: Path) -> None:
    shape = json.dumps({**TINY, "vocab_size": 512})
    cmd = [sys.executable, str(ROOT / "tools" / "synthetic_checkpoint.py"), "write", shape, str(tmp_path / "m"),
           "--tokenizer", str(tokenizer_dir)]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert first.stderr.startswith("wrote")
    again = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert again.stderr.startswith("already there")
    missing = subprocess.run([*cmd[:-1], str(tmp_path / "nowhere"), "--force"], capture_output=True, text=True)
    assert missing.returncode != 0 and "lacks tokenizer files" in missing.stderr


# --------------------------------------------------------------------------- gpu_bench: pure helpers


@dataclass
class Interval:
    start: float
    end: float


class NamedEnum:
    """pybind11 enums (torch's DeviceType) have `.name`."""

    def __init__(self, name: str) -> None:
        self.name = name


class StrEnum:
    """An enum seen only through str(), as "DeviceType.CUDA"."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class NewEvent:
    """A FunctionEvent as torch >= 2.4 has it: time_range, device_type, device_time_total, is_user_annotation."""

    def __init__(self, name: str, start: float, end: float, device: str = "CUDA", annotation: bool = False) -> None:
        self.name = name
        self.time_range = Interval(start, end)
        self.device_type = NamedEnum(device)
        self.device_time_total = end - start if device == "CUDA" else 0
        self.is_user_annotation = annotation
        self.kernels: list = []


class OldEvent:
    """An older spelling: no time_range, the duration as cuda_time_total, the device type only as a string."""

    def __init__(self, name: str, duration: float, device: str = "DeviceType.CUDA") -> None:
        self.name = name
        self.cuda_time_total = duration
        self.device_type = StrEnum(device)


Kernel = namedtuple("Kernel", ["name", "device", "duration"])


def test_interval_union() -> None:
    union = gpu_bench.interval_union
    assert union([]) == 0
    assert union([(0, 10), (5, 15), (20, 30)]) == 25  # overlap merged, gap not counted
    assert union([(20, 30), (0, 100), (40, 50)]) == 100  # nested, unsorted
    assert union([(0, 10), (10, 20)]) == 20  # touching
    assert union([(0, 10), (5, 15), (20, 30)], window=(8, 25)) == 7 + 5  # clipped to the window
    assert union([(0, 5)], window=(10, 20)) == 0


def test_aggregate_profile_with_new_spelling() -> None:
    events = [
        NewEvent(gpu_bench.PROFILE_WINDOW, 100, 1100, device="CPU", annotation=True),
        NewEvent(gpu_bench.PROFILE_WINDOW, 110, 1090, annotation=True),  # kineto's GPU mirror of the range
        NewEvent("cuLaunchKernel", 120, 125, device="CPU"),
        NewEvent("cuLaunchKernel", 320, 324, device="CPU"),
        NewEvent("gemm_bf16", 130, 330),
        NewEvent("gemm_bf16", 330, 530),
        NewEvent("rms_norm", 500, 600),  # overlaps the second gemm by 30
        NewEvent("Memcpy HtoD (Pageable -> Device)", 50, 150),  # starts before the window
        NewEvent("Memcpy DtoH (Device -> Pinned)", 900, 910),
    ]
    b = gpu_bench.aggregate_profile(events)
    assert [(r["name"], r["count"]) for r in b["rows"]] == [
        ("gemm_bf16", 2), ("Memcpy HtoD (Pageable -> Device)", 1), ("rms_norm", 1),
        ("Memcpy DtoH (Device -> Pinned)", 1)]
    gemm = b["rows"][0]
    assert gemm["total_us"] == 400 and gemm["mean_us"] == 200 and gemm["share"] == pytest.approx(400 / 610)
    assert b["device_us"] == 610 and b["device_events"] == 5
    assert b["window_us"] == 1000
    # Union within [100, 1100]: [100, 600] from the copy, gemms and norm, then [900, 910].
    assert b["busy_us"] == 510 and b["busy_fraction"] == pytest.approx(0.51)
    assert [r["name"] for r in b["pageable"]] == ["Memcpy HtoD (Pageable -> Device)"]
    assert b["host_rows"] == [{"name": "cuLaunchKernel", "total_us": 9, "count": 2, "mean_us": 4.5, "share": 1.0}]

    text = gpu_bench.format_breakdown({**b, "wall_s": 0.002}, title="tiny: breakdown", steps=2)
    assert text.splitlines()[0] == "tiny: breakdown"
    assert "GPU busy 510.0 us of a 1.00 ms window (51.0%)" in text
    assert "per step (2 steps): GPU time 305.0 us, wall 500.0 us (profiled window), wall 1.00 ms (perf_counter)" in text
    assert "WARNING: 1 pageable memcpy" in text
    assert "gemm_bf16" in text and "65.6%" in text
    assert "cuLaunchKernel" in text


def test_aggregate_profile_with_old_spellings() -> None:
    # Durations only (cuda_time_total), device type only as a string: totals, no busy time.
    b = gpu_bench.aggregate_profile([OldEvent("k1", 30), OldEvent("k1", 10), OldEvent("k2", 60),
                                     OldEvent("aten::mm", 5, device="DeviceType.CPU")])
    assert [(r["name"], r["total_us"], r["count"]) for r in b["rows"]] == [("k2", 60, 1), ("k1", 40, 2)]
    assert b["busy_us"] is None and b["window_us"] is None and b["busy_fraction"] is None
    assert "GPU time 100.0 us in 3 device events" in gpu_bench.format_breakdown(b, title="t", steps=4)

    # device_time_total without a time_range.
    evt = types.SimpleNamespace(name="k3", device_type=NamedEnum("CUDA"), device_time_total=7.0)
    assert gpu_bench.event_times(evt) == (None, None, 7.0)

    # Kernels listed only under their launching host event (legacy): used when no device event exists.
    host = NewEvent("aten::addmm", 0, 50, device="CPU")
    host.kernels = [Kernel("gemm", 0, 20.0), Kernel("gemm", 0, 22.0)]
    b = gpu_bench.aggregate_profile([host])
    assert [(r["name"], r["total_us"], r["count"]) for r in b["rows"]] == [("gemm", 42.0, 2)]

    # No device events at all: said plainly, not a crash.
    empty = gpu_bench.aggregate_profile([NewEvent("cudaMalloc", 0, 5, device="CPU")])
    assert empty["rows"] == [] and "no device events recorded" in gpu_bench.format_breakdown(empty, title="t")


def test_bandwidth_limits() -> None:
    _, spec = sc.resolve_shape("0.5b")
    config = {**spec}
    weights = gpu_bench.weight_bytes_per_token(config)
    # Every matrix once in bf16 (the tied embedding counted once, as the lm_head read) and the final norm.
    assert weights == 2 * (24 * (896 * 18 * 64 + 14 * 64 * 896 + 3 * 896 * 4864) + 151936 * 896 + 896)
    kv = gpu_bench.kv_bytes_per_position(config)
    assert kv == 2 * 2 * 24 * 2 * 64  # K and V, bf16, 24 layers, 2 KV heads of 64
    assert gpu_bench.decode_limit(1e12, config, 1, 0) == pytest.approx(1e12 / weights)
    assert gpu_bench.decode_limit(1e12, config, 64, 576) == pytest.approx(64e12 / (weights + 64 * 576 * kv))


def test_summary_table_and_plan() -> None:
    planned = gpu_bench.planned_rows("7b", ("decode_b1", "batched_64"))
    assert planned == [("7b", "decode b1 (128+256)"), ("7b", "prefill 64x512"), ("7b", "decode 64x(512+128)")]
    rows = [{"shape": "7b", "point": "decode b1 (128+256)", "tok_s": 150.26, "limit_tok_s": 282.0, "note": "best of 3"}]
    rows = gpu_bench.fill_missing(rows, planned, "not run: time budget")
    assert [r["point"] for r in rows] == [p for _, p in planned]
    table = gpu_bench.summary_table(rows).splitlines()
    assert table[0] == "| shape | point | tok/s | % of bandwidth limit | note |"
    assert table[2] == "| 7b | decode b1 (128+256) | 150 | 53% of 282 | best of 3 |"
    assert table[3] == "| 7b | prefill 64x512 |  |  | not run: time budget |"
    # Every step's rows are planned, and every shape has its group.
    assert {s for s, _, _ in gpu_bench.GROUPS} == set(gpu_bench.SHAPE_ORDER) == set(sc.SHAPES)
    assert all(step in gpu_bench.STEPS for _, steps, _ in gpu_bench.GROUPS for step in steps)


# --------------------------------------------------------------------------- gpu_bench: on a real engine (CPU)


def test_kernel_breakdown_over_a_fake_profiler(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from novainfer import LLM

    seen: dict[str, object] = {}

    class FakeProfile:
        def __init__(self, activities: list) -> None:
            seen["activities"] = activities

        def __enter__(self) -> FakeProfile:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def events(self) -> list:
            return [NewEvent(gpu_bench.PROFILE_WINDOW, 0, 1000, device="CPU"), NewEvent("attention", 10, 410)]

    class FakeRecord:
        def __init__(self, name: str) -> None:
            seen["window"] = name

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    profiler = types.ModuleType("torch.profiler")
    profiler.ProfilerActivity = types.SimpleNamespace(CPU="cpu", CUDA="cuda")
    profiler.profile = FakeProfile
    profiler.record_function = FakeRecord
    torch = types.ModuleType("torch")
    torch.profiler = profiler
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)

    llm = LLM(tiny_checkpoint, device="cpu", kv_cache_bytes=64 << 20)
    b = gpu_bench.kernel_breakdown(llm, batch=3, prompt_tokens=40, decode_steps=5)
    assert seen == {"activities": ["cpu", "cuda"], "window": gpu_bench.PROFILE_WINDOW}
    assert b["busy_fraction"] == pytest.approx(0.4) and b["rows"][0]["name"] == "attention"
    assert b["tokens"] == 15 and b["wall_s"] > 0
    # The warm-up put the prompts in the prefix cache: the profiled call computed at most a block per prompt and
    # then only decoded (one step for the first tokens, one per later token).
    assert b["prompt_tokens_computed"] < 3 * 40
    assert 5 <= b["steps"] <= 6
    assert b["steps_ahead"] == 0


def test_child_runs_a_step_and_stops_at_its_deadline(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = gpu_bench.child_main("tiny", tiny_checkpoint, ("decode_b1", "workload"), time.time() + 30, 1e11,
                              device="cpu")
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line[len(gpu_bench.RESULT_PREFIX):]) for line in lines
            if line.startswith(gpu_bench.RESULT_PREFIX)]
    assert rc == 0
    assert rows[0]["point"] == "decode b1 (128+256)" and rows[0]["tok_s"] > 0 and rows[0]["limit_tok_s"] > 0
    assert rows[1]["point"] == "256 req U[100,1024]" and rows[1]["note"].startswith("not run: time budget")

    # A step that overruns the deadline is stopped by the alarm (generate aborts its batch) and reported.
    monkeypatch.setitem(gpu_bench.STEPS, "workload", (gpu_bench.STEPS["workload"][0], 0))
    start = time.time()
    rc = gpu_bench.child_main("tiny", tiny_checkpoint, ("workload", "decode_b1"), time.time() + 3, 1e11,
                              device="cpu")
    assert time.time() - start < 10
    out = capsys.readouterr().out
    assert rc == 0 and "stopped at its time budget" in out
    assert out.count('"note": "stopped: time budget"') == 2


def test_async_steps_run_on_an_async_engine_in_a_child_of_their_own(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = gpu_bench.child_main("tiny", tiny_checkpoint, ("decode_b1_async",), time.time() + 30, 1e11, device="cpu")
    rows = [json.loads(line[len(gpu_bench.RESULT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(gpu_bench.RESULT_PREFIX)]
    assert rc == 0
    assert [r["point"] for r in rows] == ["decode b1 (128+256) async"] and rows[0]["tok_s"] > 0
    assert gpu_bench.planned_rows("0.5b", ("profile_b1_async",)) == [("0.5b", "profile b1 (128+32) async")]
    with pytest.raises(ValueError, match="mix async and default"):
        gpu_bench.child_main("tiny", tiny_checkpoint, ("decode_b1", "decode_b1_async"), time.time() + 30, 1e11,
                             device="cpu")
    with pytest.raises(ValueError, match="mix async and fused"):
        gpu_bench.child_main("tiny", tiny_checkpoint, ("decode_b1_fused", "decode_b1_async"), time.time() + 30,
                             1e11, device="cpu")


def test_fused_steps_set_the_decode_linear_choice_for_their_child(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CPU executor ignores the choice; what matters here is that the child sets it and names its rows.
    # Set first so that the test's end restores what was there before.
    monkeypatch.setenv("NOVAINFER_CUDA_DECODE_LINEAR", "separate")
    rc = gpu_bench.child_main("tiny", tiny_checkpoint, ("decode_b1_fused",), time.time() + 30, 1e11, device="cpu")
    rows = [json.loads(line[len(gpu_bench.RESULT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(gpu_bench.RESULT_PREFIX)]
    assert rc == 0
    assert [r["point"] for r in rows] == ["decode b1 (128+256) fused"] and rows[0]["tok_s"] > 0
    assert os.environ.get("NOVAINFER_CUDA_DECODE_LINEAR") == "fused"
    assert gpu_bench.variant_of("profile_b1_fused") == gpu_bench.FUSED and gpu_bench.variant_of("decode_b1") == ""


def test_fp8_steps_quantize_their_childs_engine_and_take_its_bytes_for_the_limit(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = gpu_bench.child_main("tiny", tiny_checkpoint, ("decode_b1_fp8",), time.time() + 30, 1e11, device="cpu")
    rows = [json.loads(line[len(gpu_bench.RESULT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(gpu_bench.RESULT_PREFIX)]
    assert rc == 0
    assert [r["point"] for r in rows] == ["decode b1 (128+256) fp8"] and rows[0]["tok_s"] > 0
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert gpu_bench.decode_limit(1e11, config, 1, 256, weight_bytes=1e6) > gpu_bench.decode_limit(1e11, config, 1, 256)
    # The tiled variant is FP8 too, with its own rows and the packed GEMM's environment.
    assert gpu_bench.variant_of("batched_64_fp8tile") == gpu_bench.FP8_TILE
    assert gpu_bench.variant_of("batched_64_fp8") == gpu_bench.FP8
    assert gpu_bench.planned_rows("1.5b", ("batched_64_fp8tile",))[1] == ("1.5b", "decode 64x(512+128) fp8 tiled")
    assert gpu_bench.VARIANT_ENV[gpu_bench.FP8_TILE] == {"NOVAINFER_CUDA_PACKED_GEMM": "tile"}


def test_the_yarn_view_reads_the_same_weights_with_qwens_128k_settings(tiny_checkpoint: Path) -> None:
    view = gpu_bench.yarn_view(tiny_checkpoint)
    config = json.loads((view / "config.json").read_text())
    assert config["rope_scaling"] == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    original = json.loads((tiny_checkpoint / "config.json").read_text())
    assert "rope_scaling" not in original, "the original checkpoint is left alone"
    assert {k: v for k, v in config.items() if k != "rope_scaling"} == original
    for entry in tiny_checkpoint.iterdir():
        if entry.name != "config.json":
            assert (view / entry.name).resolve() == entry.resolve()
    assert gpu_bench.yarn_view(tiny_checkpoint) == view, "a second call reuses the view"
    assert gpu_bench.planned_rows("0.5b", ("long_128k_yarn",)) == [
        ("0.5b", "prefill 128k YaRN"), ("0.5b", "decode b1 @128k YaRN")]


def test_synthetic_mode_end_to_end_on_the_cpu(
    tiny_checkpoint: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The parent writes missing checkpoints, runs a child process per group and writes the table; on the CPU."""
    # The benchmarks' prompts use ids up to the tokenizer's size: the vocabulary must be real-sized.
    monkeypatch.setitem(sc.SHAPES, "tiny", TINY)
    monkeypatch.setattr(gpu_bench, "SHAPE_ORDER", ("tiny",))
    # The last group gets too little time to start: its row is reported as not run. The fused group is not among
    # the variants asked for: it has no row at all.
    monkeypatch.setattr(gpu_bench, "GROUPS", (("tiny", ("decode_b1",), 60), ("tiny", ("decode_b1_fused",), 60),
                                              ("tiny", ("workload",), 5)))
    table = tmp_path / "table.md"
    args = gpu_bench.argparse.Namespace(
        shapes="tiny", synthetic_root=tmp_path / "synthetic", tokenizer=tokenizer_dir, budget_s=120.0,
        table_out=table, bandwidth=1e11, device="cpu", variants="default")
    assert gpu_bench.synthetic_main(args) == 0
    out = capsys.readouterr().out
    assert "tiny: wrote" in out and "tiny: decode b1 (128+256):" in out and gpu_bench.RESULT_PREFIX not in out
    assert "fused" not in out
    assert sc.is_complete(tmp_path / "synthetic" / "tiny", "tiny")
    text = table.read_text()
    assert text.startswith("## Speed on synthetic checkpoints")
    lines = text.strip().splitlines()
    assert lines[-2].startswith("| tiny | decode b1 (128+256) | ")
    assert lines[-1] == "| tiny | 256 req U[100,1024] |  |  | not run: time budget (5 s for it) |"


def test_a_stopped_synthetic_run_still_writes_its_table_and_a_missing_peer_is_not_a_failure(
    tiny_checkpoint: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpu-test stops the synthetic mode with SIGINT at the run's budget: the points measured before stay in the
    table (rewritten after every group), the rest read "not run". Peer groups without transformers are not run and
    fail nothing."""
    monkeypatch.setitem(sc.SHAPES, "tiny", TINY)
    monkeypatch.setattr(gpu_bench, "SHAPE_ORDER", ("tiny",))
    monkeypatch.setattr(gpu_bench, "GROUPS", (("tiny", ("decode_b1_peer",), 60), ("tiny", ("decode_b1",), 60),
                                              ("tiny", ("batched_16",), 60)))
    monkeypatch.setattr(gpu_bench, "peer_missing", lambda: "transformers is not installed")
    calls = []

    def child(shape, model_dir, steps, bandwidth, seconds, device):  # noqa: ANN001, ANN202 - run_child's signature
        calls.append(steps)
        if steps == ("batched_16",):
            raise KeyboardInterrupt
        return [{"shape": shape, "point": gpu_bench.STEPS[steps[0]][0][0], "tok_s": 123.0, "limit_tok_s": 1000.0,
                 "note": ""}], None

    monkeypatch.setattr(gpu_bench, "run_child", child)
    table = tmp_path / "table.md"
    args = gpu_bench.argparse.Namespace(
        shapes="tiny", synthetic_root=tmp_path / "synthetic", tokenizer=tokenizer_dir, budget_s=300.0,
        table_out=table, bandwidth=1e11, device="cpu", variants="all")
    assert gpu_bench.synthetic_main(args) == 1, "a stopped run is not a clean one"
    assert calls == [("decode_b1",), ("batched_16",)], "the peer's child never started"
    lines = table.read_text().strip().splitlines()[-4:]
    assert lines[0].endswith("| not run: transformers is not installed |")
    assert lines[1].startswith("| tiny | decode b1 (128+256) | 123")
    assert all(line.endswith("| not run: the run was stopped |") for line in lines[2:])


# --------------------------------------------------------------------------- scripts/gpu-test


def test_gpu_test_usage_lists_its_modes() -> None:
    script = ROOT / "scripts" / "gpu-test"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2
    lines = usage.stdout.splitlines()
    assert lines[0].startswith("# GPU verification in one command")
    for mode in ("build", "stage-model", "receive-part N", "run", "bench"):
        assert any(line.startswith(f"#   scripts/gpu-test {mode} ") for line in lines), mode
    assert not any(line.startswith("set -") for line in lines)


# --------------------------------------------------------------------------- synthetic Q4_K_M GGUF files

GGUF_SHAPE = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "vocab_size": 151936}


def test_a_synthetic_q4_k_m_gguf_has_llama_cpps_types_and_runs(tokenizer_dir: Path, tmp_path: Path) -> None:
    import gguf

    import synthetic_gguf as sg
    from novainfer import LLM, SamplingParams

    path, written = sg.ensure_gguf(tmp_path / "m.gguf", GGUF_SHAPE, tokenizer_dir, seed=3)
    assert written and sg.ensure_gguf(path, GGUF_SHAPE, tokenizer_dir, seed=3) == (path, False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    # 8 layers: the first and last (8 // 8 = 1, 7 · 8 // 8 = 7) and every third from the first eighth on.
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == [
        "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert types["blk.0.ffn_gate.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["token_embd.weight"] == "Q4_K"
    # The engine loads it (GGUF tokenizer included) and decodes finite logits.
    llm = LLM(path, device="cpu", kv_cache_bytes=16 << 20)
    out = llm.generate([[100, 200, 300]], SamplingParams(temperature=0, max_tokens=4, logprobs=1,
                                                         ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(np.isfinite(lp[t]) for t, lp in zip(out.token_ids, out.logprobs))
    with pytest.raises(ValueError, match="whole Q4_K blocks"):
        sg.write_gguf(tmp_path / "odd.gguf", {**GGUF_SHAPE, "hidden_size": 192, "num_attention_heads": 4},
                      tokenizer_dir)


def test_q4km_steps_load_the_shapes_synthetic_gguf_beside_its_checkpoint(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = sc.write_checkpoint(tmp_path / "small", GGUF_SHAPE, tokenizer_dir, pool_values=SMALL_POOL)
    rc = gpu_bench.child_main("small", checkpoint, ("decode_b1_q4km",), time.time() + 60, 1e11, device="cpu")
    out = capsys.readouterr().out
    rows = [json.loads(line[len(gpu_bench.RESULT_PREFIX):]) for line in out.splitlines()
            if line.startswith(gpu_bench.RESULT_PREFIX)]
    assert rc == 0, out
    assert [r["point"] for r in rows] == ["decode b1 (128+256) Q4_K_M native"] and rows[0]["tok_s"] > 0
    assert (tmp_path / "small-q4_k_m.gguf").is_file() and "small-q4_k_m.gguf written" in out
    assert gpu_bench.variant_of("batched_64_q4kmtile") == gpu_bench.Q4KM_TILE


def test_variants_are_selected_by_name() -> None:
    assert gpu_bench.selected_variants("all") >= {"default", "q4km", "fp8tile", "async"}
    assert gpu_bench.selected_variants("default, q4km") == {"default", "q4km"}
    assert gpu_bench.variant_name(gpu_bench.variant_of("batched_64_q4kmtile")) == "q4kmtile"
    assert gpu_bench.variant_name(gpu_bench.variant_of("batched_64")) == "default"
    with pytest.raises(SystemExit, match="unknown variants"):
        gpu_bench.selected_variants("fast")
    # Prompt attention on the tensor cores for the flash points and for 128k tokens (the legacy kernel is serial in
    # the context: ~10 minutes for 128k, past the point's time).
    for variant in (gpu_bench.FLASH, gpu_bench.YARN):
        assert gpu_bench.VARIANT_ENV[variant] == {"NOVAINFER_CUDA_PREFILL": "flash"}
    assert gpu_bench.STEPS["depth_4096_flash"][0] == ("prefill 4096 flash", "decode b1 @4096 flash")


def test_peer_steps_run_transformers_in_their_own_child(tiny_checkpoint: Path) -> None:
    # Issue 31's same-run peer (scripts/hf_peer.py: transformers, static cache, torch.compile) is a variant of its
    # own, on both shapes the issue names, and reports decode rates against the same bandwidth limits as ours.
    assert "peer" in gpu_bench.selected_variants("all")
    peer_groups = [(shape, steps) for shape, steps, _ in gpu_bench.GROUPS if gpu_bench.variant_of(steps[0]) == "_peer"]
    assert {shape for shape, _ in peer_groups} == {"0.5b", "1.5b"}
    assert all(gpu_bench.variant_of(step) == "_peer" for _, steps in peer_groups for step in steps)

    class FakePeer:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int, int, int]] = []

        def decode_rate(self, batch: int, prompt: int, n1: int, n2: int) -> float:
            self.calls.append((batch, prompt, n1, n2))
            return 100.0 * batch

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    peer = FakePeer()
    rows = [row for _, steps in peer_groups[:1] for step in steps
            for row in gpu_bench._run_peer_step(step, peer, config, 1e12, "0.5b")]
    assert [r["tok_s"] for r in rows] == [100.0, 6400.0]
    assert [r["point"] for r in rows] == [gpu_bench.STEPS[s][0][0] for s in peer_groups[0][1]]
    assert all(r["limit_tok_s"] and r["limit_tok_s"] > r["tok_s"] for r in rows)
    assert rows[1]["limit_tok_s"] == gpu_bench.decode_limit(1e12, config, 64, 512 + 64)
    assert peer.calls == [(1, 128, 32, 256), (64, 512, 16, 128)]
    with pytest.raises(ValueError, match="unknown peer step"):
        gpu_bench._run_peer_step("decode_b1", peer, config, 1e12, "0.5b")
