"""GPU benchmarks for docs/benchmarks.md, run by `scripts/gpu-test run` on a machine with an NVIDIA GPU.

Two modes.

``--synthetic`` (what `scripts/gpu-test run` always runs): real-shape Qwen2 checkpoints with random bf16 weights
(tools/synthetic_checkpoint.py; a GPU machine that cannot fetch a model still measures 0.5B, 1.5B and 7B speed),
written under ``--synthetic-root`` unless already there. Each shape runs in a child process of its own (a crash or
a hang costs its points only, and the GPU memory is surely freed between shapes), in order of priority within a
time budget (``--budget-s``): a point that would not fit is reported as not run, and one that overruns is stopped.
- 0.5B and 1.5B: batch-1 decode (128-token prompt, 256 tokens), prefill of a 4096-token prompt and decode at that
  depth, 16 and 64 sequences of 512 prompt + 128 output tokens (`novainfer.bench.bench_batched`).
- 0.5B: a kernel-time breakdown (`kernel_breakdown`) at batch 1 and batch 64 right after its batch-1 decode, and,
  last of all, nano-vllm's workload.
- 0.5B with `async_scheduling=True` (a child of its own; rows marked "async"): batch-1 decode, its breakdown (the
  GPU-busy fraction is the point) and 64 x (512 + 128), beside the same points in order.
- 7B: batch-1 decode and 64 × (512 + 128).
Decode rates are given as a share of the bandwidth limit: the GPU's measured device-to-device copy rate over the
bytes one step reads (bf16 weights, one embedding row, and the bf16 KV of every sequence's context). A markdown
summary table is printed last (and written to ``--table-out``).

Without ``--synthetic`` (the demo mode; for each demo model cached under $NOVAINFER_HOME, the 0.5B one staged by
`scripts/gpu-test stage-model`):
- batch-1 decode tokens/s through NovaInfer on ``device="cuda"``, next to the bandwidth limit: the bytes of
  weights one decoded token reads (bf16, as the CUDA executor holds them; the embedding table contributes one
  row) divided into the GPU's measured device-to-device copy rate;
- nano-vllm's workload: 256 requests with prompt and output lengths uniform in [100, 1024] (seed 0, EOS
  ignored), all submitted at once; output tokens/s;
- the same two workloads through HF transformers (bf16, eager attention's default, static batches of 64 with
  left padding) on the same GPU, from the f32 checkpoint tools/gguf_to_hf.py writes.

Timings are wall-clock around whole generate calls after one warm-up (the figures are rates over seconds of
work, far above launch jitter); the copy bandwidth uses CUDA events. The pure helpers (bandwidth limits, the
profile's aggregation, the tables, the plan) are tested on the CPU in tests/test_gpu_tools.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
# hf_peer.py beside this file, also when a test loads this module by its path.
sys.path.insert(0, str(ROOT / "scripts"))

DEMOS = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}
WORKLOAD = {"num_requests": 256, "lengths": (100, 1024), "seed": 0}


def copy_bandwidth() -> float:
    """Bytes moved per second (read + written) by a 1 GiB device-to-device copy, best of 10."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = max(best, 2 * n / (start.elapsed_time(end) / 1e3))
    return best


def weight_bytes_per_token(config: dict) -> int:
    """bf16 bytes of the weights one decode step reads (every matrix once; one embedding row)."""
    h, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    d = h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * f
    return 2 * (layers * per_layer + vocab * h + h)


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmark: (prompts, output lengths), lengths uniform in WORKLOAD's range, ids below `vocab`."""
    rng = random.Random(WORKLOAD["seed"])
    lo, hi = WORKLOAD["lengths"]
    top = min(vocab, 150_000)
    first = min(1000, top // 2)  # 1000 for every real vocabulary; a test's tiny tokenizer has 448 tokens
    prompts = [[rng.randrange(first, top) for _ in range(rng.randint(lo, hi))]
               for _ in range(WORKLOAD["num_requests"])]
    outputs = [rng.randint(lo, hi) for _ in prompts]
    return prompts, outputs


def native_decode_figures(gguf: Path) -> dict[str, float]:
    """Batch-1 decode with gpu_weight_dtype="native" (the file's blocks multiplied in place), and the bytes a
    token reads that way: the issue's packed-weights limit."""
    from novainfer import LLM
    from novainfer.bench import bench_latency

    llm = LLM(gguf, device="cuda", max_num_seqs=256, max_num_batched_tokens=8192, gpu_weight_dtype="native")
    bench_latency(llm, 128, 16)
    _, decode = max(bench_latency(llm, 128, 256) for _ in range(3))
    figures = {"decode_b1_tok_s": decode, "weight_bytes_per_token": float(llm.stats()["weight_bytes_per_token"])}
    del llm
    return figures


def novainfer_figures(gguf: Path) -> dict[str, float]:
    from novainfer import LLM, SamplingParams
    from novainfer.bench import bench_latency

    llm = LLM(gguf, device="cuda", max_num_seqs=256, max_num_batched_tokens=8192)
    assert llm.device.startswith("cuda"), llm.device
    bench_latency(llm, 128, 16)  # warm-up: kernels loaded, pool touched
    _, decode = max(bench_latency(llm, 128, 256) for _ in range(3))
    prompts, outputs = workload(llm._engine.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"decode_b1_tok_s": decode, "workload_output_tok_s": sum(outputs) / seconds,
            "workload_seconds": seconds}


def hf_figures(hf_dir: Path) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to("cuda").eval()
    vocab = model.config.vocab_size

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate([list(range(1000, 1128))], 16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate([list(range(1000, 1128))], 256)
        torch.cuda.synchronize()
        decode = 255 / (time.perf_counter() - start)
        prompts, outputs = workload(vocab)
        start = time.perf_counter()
        for i in range(0, len(prompts), 64):
            generate(prompts[i:i + 64], max(outputs[i:i + 64]))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"decode_b1_tok_s": decode, "workload_output_tok_s": sum(outputs) / seconds, "workload_seconds": seconds}


def demo_main() -> int:
    """The demo mode: NovaInfer and transformers on each cached demo model (see the module docstring)."""
    from gguf_to_hf import convert
    from novainfer.fetch import cache_dir, models_dir

    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)")
    ran = 0
    for name, file in DEMOS.items():
        gguf = models_dir() / file
        if not gguf.is_file():
            print(f"{name}: not cached, skipped")
            continue
        ran += 1
        hf_dir = cache_dir() / "test-artifacts" / f"{name}-f32"
        if not (hf_dir / "model.safetensors").exists():
            convert(gguf, hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        limit = bandwidth / weight_bytes_per_token(config)
        ours = novainfer_figures(gguf)
        try:
            native = native_decode_figures(gguf)
        except Exception as e:  # noqa: BLE001 - a first run of new kernels: report, keep the other figures
            print(f"{name}: native weights FAILED: {e!r}")
            native = None
        # Ours first: the peer below may be missing (transformers is not carried) or be stopped at the budget.
        print(f"{name}: weight bytes/token {weight_bytes_per_token(config) / 2**20:.0f} MiB (bf16), "
              f"bandwidth limit {limit:.0f} tok/s", flush=True)
        print(f"  batch-1 decode: novainfer {ours['decode_b1_tok_s']:.1f} tok/s "
              f"({100 * ours['decode_b1_tok_s'] / limit:.0f}% of the limit)", flush=True)
        print(f"  256 requests, lengths U[100, 1024]: novainfer {ours['workload_output_tok_s']:.0f} output tok/s "
              f"({ours['workload_seconds']:.1f} s)", flush=True)
        if native is not None:
            packed_limit = bandwidth / native["weight_bytes_per_token"]
            print(f"  batch-1 decode, gpu_weight_dtype=native: {native['decode_b1_tok_s']:.1f} tok/s "
                  f"({native['decode_b1_tok_s'] / ours['decode_b1_tok_s']:.2f}x bf16; "
                  f"{native['weight_bytes_per_token'] / 2**20:.0f} MiB/token, "
                  f"{100 * native['decode_b1_tok_s'] / packed_limit:.0f}% of the packed limit {packed_limit:.0f} tok/s)",
                  flush=True)
        missing = peer_missing()
        if missing is not None:
            print(f"  transformers: not run ({missing})", flush=True)
            continue
        theirs = hf_figures(hf_dir)  # its model is freed on return; the next model starts clean
        import torch

        torch.cuda.empty_cache()
        print(f"  transformers: batch-1 decode {theirs['decode_b1_tok_s']:.1f} tok/s; 256 requests (static batches "
              f"of 64) {theirs['workload_output_tok_s']:.0f} output tok/s ({theirs['workload_seconds']:.1f} s)",
              flush=True)
    return 0 if ran else 1


def peer_missing() -> str | None:
    """Why the transformers peer cannot run on this machine, or None: the GPU image may lack transformers (it is
    not carried), and torch.compile's Triton needs a C compiler for its first compile."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if not (shutil.which("cc") or shutil.which("gcc") or os.environ.get("CC")):
        return "no C compiler for torch.compile"
    return None


# --------------------------------------------------------------------------- bandwidth limits


def kv_bytes_per_position(config: dict) -> int:
    """bf16 bytes of K and V that one context position holds over all layers (what decode attention reads)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim


def decode_limit(bandwidth: float, config: dict, batch: int, context: float, weight_bytes: float | None = None) -> float:
    """Tokens/s a decode step of `batch` sequences with `context` positions each cannot beat when every byte it
    reads (the weights once, each sequence's KV) moves at `bandwidth` bytes/s. `weight_bytes` replaces the bf16
    weights' bytes for an engine that holds them otherwise (FP8)."""
    weights = weight_bytes_per_token(config) if weight_bytes is None else weight_bytes
    step_bytes = weights + batch * context * kv_bytes_per_position(config)
    return batch * bandwidth / step_bytes


# --------------------------------------------------------------------------- kernel-time breakdown

PROFILE_WINDOW = "novainfer.generate"


def _enum_name(value: object) -> str:
    """`DeviceType.CUDA` → "CUDA", whether the enum has `.name` (pybind11) or only its str()."""
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value).rsplit(".", 1)[-1]


def event_times(evt: object) -> tuple[float | None, float | None, float | None]:
    """(start_us, end_us, duration_us) of a profiler FunctionEvent, or Nones where this torch lacks them.

    The interval is `time_range.start/end` (every version; device and host events share its time base); the
    duration falls back to `device_time_total` (torch ≥ 2.4) or `cuda_time_total` (older) without it."""
    time_range = getattr(evt, "time_range", None)
    start, end = getattr(time_range, "start", None), getattr(time_range, "end", None)
    if start is not None and end is not None:
        return float(start), float(end), float(end) - float(start)
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(evt, attr, None)
        if isinstance(value, (int, float)):
            return None, None, float(value)
    return None, None, None


def is_device_event(evt: object) -> bool:
    """Whether a FunctionEvent ran on the GPU (a kernel, memcpy or memset, as CUPTI recorded it)."""
    device_type = getattr(evt, "device_type", None)
    return device_type is not None and _enum_name(device_type) == "CUDA"


def interval_union(intervals: list[tuple[float, float]], window: tuple[float, float] | None = None) -> float:
    """Total length covered by `intervals` (start, end), each clipped to `window` when one is given: the time
    the GPU was busy with at least one event, however many overlapped."""
    clipped = []
    for start, end in intervals:
        if window is not None:
            start, end = max(start, window[0]), min(end, window[1])
        if end > start:
            clipped.append((start, end))
    clipped.sort()
    total, cur_start, cur_end = 0.0, None, None
    for start, end in clipped:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _by_name(items: list[tuple[str, float]]) -> list[dict]:
    """[(name, duration_us)] → rows of name, total_us, count, mean_us, share (of the summed time), largest first."""
    totals: dict[str, list[float]] = {}
    for name, duration in items:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
    grand = sum(t for t, _ in totals.values()) or 1.0
    rows = [
        {"name": name, "total_us": t, "count": int(n), "mean_us": t / n, "share": t / grand}
        for name, (t, n) in totals.items()
    ]
    rows.sort(key=lambda r: (-r["total_us"], r["name"]))
    return rows


def aggregate_profile(events: list, window_name: str = PROFILE_WINDOW) -> dict:
    """The kernel-time breakdown of a profile's FunctionEvents (`prof.events()`).

    Device events (kernels, memcpys, memsets) by name: total time, count, mean, share of the GPU time; the GPU
    time (summed), the busy time (union of device intervals within the window), the window (the host event named
    `window_name`, else the span of the device events) and the busy fraction; every `Memcpy ... Pageable` by name
    (a host copy from unpinned memory: synchronous and slow); the host events (CUDA API calls as CUPTI saw them)
    by name. Where a torch lists kernels only under their launching host event (`evt.kernels`, old versions),
    those are used, without intervals (busy time then None)."""
    device: list[tuple[str, float]] = []
    intervals: list[tuple[float, float]] = []
    host: list[tuple[str, float]] = []
    window: tuple[float, float] | None = None
    nested_kernels: list[tuple[str, float]] = []
    for evt in events:
        name = str(getattr(evt, "name", None) or getattr(evt, "key", "?"))
        start, end, duration = event_times(evt)
        if is_device_event(evt):
            # Kineto mirrors record_function ranges onto the GPU timeline (gpu_user_annotation): not GPU work.
            if duration is None or name == window_name or getattr(evt, "is_user_annotation", False) is True:
                continue
            device.append((name, duration))
            if start is not None and end is not None:
                intervals.append((start, end))
            continue
        if name == window_name:
            if start is not None and end is not None and (window is None or end - start > window[1] - window[0]):
                window = (start, end)
            continue
        if duration is not None:
            host.append((name, duration))
        for kernel in getattr(evt, "kernels", None) or ():
            kernel_duration = getattr(kernel, "duration", None)
            if kernel_duration is None:
                interval = getattr(kernel, "interval", None)
                if interval is not None:
                    kernel_duration = interval.end - interval.start
            if kernel_duration is not None:
                nested_kernels.append((str(getattr(kernel, "name", "?")), float(kernel_duration)))
    if not device and nested_kernels:
        device = nested_kernels
    if window is None and intervals:
        window = (min(s for s, _ in intervals), max(e for _, e in intervals))
    busy = interval_union(intervals, window) if intervals else None
    window_us = None if window is None else window[1] - window[0]
    rows = _by_name(device)
    pageable = [r for r in rows if "memcpy" in r["name"].lower() and "pageable" in r["name"].lower()]
    return {
        "rows": rows,
        "device_us": sum(d for _, d in device),
        "device_events": len(device),
        "busy_us": busy,
        "window_us": window_us,
        "busy_fraction": None if busy is None or not window_us else busy / window_us,
        "pageable": pageable,
        "host_rows": _by_name(host),
    }


def _us(value: float) -> str:
    return f"{value / 1e3:.2f} ms" if value >= 1e3 else f"{value:.1f} us"


def format_breakdown(breakdown: dict, *, title: str, steps: int | None = None, top: int = 25) -> str:
    """A plain-text report of `aggregate_profile`'s result (plus the optional `steps` and `wall_s` keys the
    profiling run adds): the top device events by time, the busy fraction, per-step times, pageable copies."""
    lines = [title]
    device_us, window_us, busy = breakdown["device_us"], breakdown["window_us"], breakdown["busy_us"]
    if not breakdown["rows"]:
        lines.append("  no device events recorded (CUPTI saw no kernels: is the CUDA profiler activity available?)")
        return "\n".join(lines)
    wall_s = breakdown.get("wall_s")
    summary = f"  GPU time {_us(device_us)} in {breakdown['device_events']} device events"
    if busy is not None and window_us:
        summary += f"; GPU busy {_us(busy)} of a {_us(window_us)} window ({100 * busy / window_us:.1f}%)"
    lines.append(summary)
    if steps:
        per_step = f"  per step ({steps} steps): GPU time {_us(device_us / steps)}"
        if window_us:
            per_step += f", wall {_us(window_us / steps)} (profiled window)"
        if wall_s:
            per_step += f", wall {_us(wall_s * 1e6 / steps)} (perf_counter)"
        per_step += f", {breakdown['device_events'] / steps:.1f} device events"
        lines.append(per_step)
    if breakdown["pageable"]:
        total = sum(r["count"] for r in breakdown["pageable"])
        lines.append(f"  WARNING: {total} pageable memcpy events (host memory not pinned: synchronous copies):")
        lines += [f"    {r['count']} x {r['name']} ({_us(r['total_us'])})" for r in breakdown["pageable"]]
    width = min(90, max(len(r["name"]) for r in breakdown["rows"][:top]))
    lines.append(f"  {'device event':<{width}} {'total':>10} {'count':>7} {'mean':>10} {'share':>6}")
    for r in breakdown["rows"][:top]:
        name = r["name"] if len(r["name"]) <= width else r["name"][: width - 3] + "..."
        lines.append(
            f"  {name:<{width}} {_us(r['total_us']):>10} {r['count']:>7} {_us(r['mean_us']):>10} "
            f"{100 * r['share']:>5.1f}%"
        )
    if len(breakdown["rows"]) > top:
        rest = breakdown["rows"][top:]
        lines.append(f"  ... {len(rest)} more names, {100 * sum(r['share'] for r in rest):.1f}% of the GPU time")
    host = breakdown["host_rows"][:8]
    if host:
        lines.append("  host side (CUDA API calls as CUPTI saw them; the engine's own work is not recorded):")
        lines += [f"    {r['name'][:60]:<60} {_us(r['total_us']):>10} {r['count']:>7}" for r in host]
    return "\n".join(lines)


def kernel_breakdown(llm, batch: int, prompt_tokens: int = 128, decode_steps: int = 32) -> dict:  # noqa: ANN001
    """Profile one `llm.generate` of `batch` distinct `prompt_tokens`-token prompts decoding `decode_steps` tokens
    each (EOS ignored) under torch.profiler (CPU + CUDA: CUPTI records the kernels our extension launches
    through the driver API too) and return `aggregate_profile`'s breakdown plus steps, wall_s, tokens and the
    prompt tokens the profiled call computed.

    The same call runs once before, unprofiled: its prompts' KV lands in the prefix cache (so the profiled call is
    decode steps, bar the prompts' last tokens) and every kernel of this batch size is loaded and warm."""
    from novainfer import SamplingParams
    from novainfer.bench import _prompt, _vocab
    from torch.profiler import ProfilerActivity, profile, record_function

    prompts = [_prompt(prompt_tokens, _vocab(llm), seed=5000 + i) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True)
    llm.generate(prompts, params)
    before = llm.stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(PROFILE_WINDOW):
            start = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - start
    after = llm.stats()
    breakdown = aggregate_profile(list(prof.events()))
    breakdown.update(
        steps=int(after["num_steps"] - before["num_steps"]),
        steps_ahead=int(after["num_steps_ahead"] - before["num_steps_ahead"]),
        wall_s=wall,
        tokens=batch * decode_steps,
        prompt_tokens_computed=int(after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]),
    )
    return breakdown


# --------------------------------------------------------------------------- synthetic mode: the plan

SHAPE_ORDER = ("0.5b", "1.5b", "7b")
KV_CACHE_BYTES = 16 << 30  # far more than any point needs; a fixed size keeps start-up the same on every GPU
MAX_MODEL_LEN = 8192

# step → (rows it reports, seconds it must have left to start). Rows are named here so that a step which never
# ran still has its rows in the table.
STEPS: dict[str, tuple[tuple[str, ...], float]] = {
    "decode_b1": (("decode b1 (128+256)",), 15),
    "depth_4096": (("prefill 4096", "decode b1 @4096"), 20),
    "batched_16": (("prefill 16x512", "decode 16x(512+128)"), 15),
    "batched_64": (("prefill 64x512", "decode 64x(512+128)"), 20),
    "profile_b1": (("profile b1 (128+32)",), 30),
    "profile_b64": (("profile b64 (128+32)",), 30),
    "workload": (("256 req U[100,1024]",), 60),
    # Only as `long_128k_yarn`: a 128k-token prompt on the checkpoint with Qwen's YaRN settings (issue 32 point 4).
    "long_128k": (("prefill 128k", "decode b1 @128k"), 150),
}
# A step named `<step><suffix>` is `<step>` on an engine variant, its rows marked with the variant's label: `_async`
# on an engine with `async_scheduling=True`, `_fused` with NOVAINFER_CUDA_DECODE_LINEAR=fused (decode steps' linear
# layers through the GEMV with the next kernel in its epilogue), `_lt` with NOVAINFER_CUDA_GEMM=lt (cuBLASLt, one
# algorithm a shape without split-K), `_fp8` with quantization="fp8" (decoder layers quantized to FP8 at load and
# kept as FP8: decode limits from the bytes the engine reports), `_fp8tile` the same with
# NOVAINFER_CUDA_PACKED_GEMM=tile (steps of more than 8 rows through the tiled GEMM over the FP8 blocks, not expanded
# for cuBLAS), `_flash` with NOVAINFER_CUDA_PREFILL=flash (prompt attention on the tensor cores: issue 32's prefill
# figures; the YaRN point uses it too, as the legacy prefill kernel would need ~10 minutes for 128k tokens). A child
# runs steps of one variant only, on an engine of that variant.
ASYNC = "_async"
FUSED = "_fused"
LT = "_lt"
YARN = "_yarn"
FLASH = "_flash"
FP8 = "_fp8"
FP8_TILE = "_fp8tile"
Q4KM = "_q4km"
Q4KM_TILE = "_q4kmtile"
# Not an engine of ours: issue 31's same-run peer, transformers with a static cache and torch.compile
# (scripts/hf_peer.py) on the same checkpoint; its child runs `decode_b1_peer` and `batched_64_peer` only.
PEER = "_peer"
VARIANTS: dict[str, str] = {ASYNC: "async", FUSED: "fused", LT: "cuBLASLt", YARN: "YaRN", FLASH: "flash", FP8: "fp8",
                            FP8_TILE: "fp8 tiled", Q4KM: "Q4_K_M native", Q4KM_TILE: "Q4_K_M native tiled",
                            PEER: "HF static cache + torch.compile (peer)"}
# Variants whose engine quantizes the checkpoint to FP8 at load.
FP8_VARIANTS = (FP8, FP8_TILE)
# Variants that load the shape's synthetic Q4_K_M GGUF (tools/synthetic_gguf.py, written beside the bf16 checkpoint
# with its tokenizer) with gpu_weight_dtype="native": the packed-weights figures on the shapes it names.
Q4KM_VARIANTS = (Q4KM, Q4KM_TILE)
# Variants whose decode limits come from the bytes the engine reports rather than the bf16 checkpoint's.
PACKED_VARIANTS = FP8_VARIANTS + Q4KM_VARIANTS
# Qwen's documented YaRN settings for 128k (config.json's `rope_scaling`), and the context they give.
YARN_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN_MAX_MODEL_LEN = 131072
# What each variant sets in its child's environment before the engine loads.
VARIANT_ENV: dict[str, dict[str, str]] = {FUSED: {"NOVAINFER_CUDA_DECODE_LINEAR": "fused"}, LT: {"NOVAINFER_CUDA_GEMM": "lt"},
                                          FLASH: {"NOVAINFER_CUDA_PREFILL": "flash"},
                                          YARN: {"NOVAINFER_CUDA_PREFILL": "flash"},
                                          FP8_TILE: {"NOVAINFER_CUDA_PACKED_GEMM": "tile"},
                                          Q4KM_TILE: {"NOVAINFER_CUDA_PACKED_GEMM": "tile"}}
for _suffix, _steps in (
    (ASYNC, ("decode_b1", "profile_b1", "batched_64")),
    (FUSED, ("decode_b1", "profile_b1")),
    (LT, ("batched_16", "batched_64", "profile_b64")),
    (YARN, ("long_128k",)),
    (FLASH, ("depth_4096", "batched_64")),
    (FP8, ("decode_b1", "batched_64")),
    (FP8_TILE, ("batched_16", "batched_64")),
    (Q4KM, ("decode_b1", "batched_64")),
    (Q4KM_TILE, ("batched_64",)),
):
    STEPS.update({
        step + _suffix: (tuple(f"{point} {VARIANTS[_suffix]}" for point in STEPS[step][0]), STEPS[step][1])
        for step in _steps
    })
# The peer's points: decode rates only (the prompt's prefill cancels out, see hf_peer.py); their first run compiles.
STEPS.update({
    "decode_b1" + PEER: ((f"decode b1 (128+256) {VARIANTS[PEER]}",), 90),
    "batched_64" + PEER: ((f"decode 64x(512+128) {VARIANTS[PEER]}",), 120),
})


def yarn_view(model_dir: Path) -> Path:
    """A sibling of `model_dir` whose config.json adds Qwen's YaRN `rope_scaling` as Qwen documents it (the 128k
    context follows from it), its other files links to the original's: the same weights, read as the 128k model."""
    view = model_dir.parent / f"{model_dir.name}-yarn"
    view.mkdir(exist_ok=True)
    for entry in model_dir.iterdir():
        link = view / entry.name
        if entry.name != "config.json" and not link.exists():
            link.symlink_to(entry.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = dict(YARN_SCALING)
    (view / "config.json").write_text(json.dumps(config, indent=1))
    return view


def variant_name(suffix: str) -> str:
    """A variant's name on the command line: its suffix without the underscore, "default" for none."""
    return suffix.removeprefix("_") or "default"


def selected_variants(spec: str) -> set[str]:
    """The variant names `--variants` selects ("all", or names separated by commas); an unknown one is an error."""
    known = {"default"} | {variant_name(v) for v in VARIANTS}
    names = {n.strip() for n in spec.split(",") if n.strip()}
    if names == {"all"}:
        return known
    if names - known:
        raise SystemExit(f"unknown variants {sorted(names - known)}; known: all, {', '.join(sorted(known))}")
    return names


def config_shape(config: dict) -> dict:
    """The synthetic-checkpoint shape (synthetic_checkpoint.resolve_shape's keys) a config.json describes."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rms_norm_eps")
    return {k: config[k] for k in keys}


def variant_of(step: str) -> str:
    """The variant suffix a step name ends with, or "" for the default engine."""
    return next((suffix for suffix in VARIANTS if step.endswith(suffix)), "")
# Child runs in order of priority: (shape, steps, most seconds it may take once its checkpoint is there).
# nano-vllm's workload is the longest and least predictable point, so it runs last, in a run of its own.
GROUPS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    # Each issue's headline figures first (a `run` leaves the benchmarks a few minutes), the variants after.
    # The breakdowns right after the first rate: they say where a step's time goes, whatever else is cut.
    ("0.5b", ("decode_b1", "profile_b1", "profile_b64", "depth_4096", "batched_16", "batched_64"), 180),
    ("1.5b", ("decode_b1", "depth_4096", "batched_16", "batched_64"), 150),
    # Decode with the fused GEMVs: the rate, and the device events (launches) per step against profile_b1's.
    ("0.5b", ("decode_b1" + FUSED, "profile_b1" + FUSED), 90),
    # Prompts through the tensor-core prefill (issue 32: >= 100,000 tok/s for a 4,096-token prompt on the 0.5B).
    ("0.5b", ("depth_4096" + FLASH, "batched_64" + FLASH), 90),
    # The same points with the step ahead scheduled while the GPU runs (issue 31's GPU-busy fraction).
    ("0.5b", ("decode_b1" + ASYNC, "profile_b1" + ASYNC, "batched_64" + ASYNC), 120),
    # Issue 33's figures: Q4_K_M blocks kept packed, batch-1 decode (>= 2x the bf16 rows above) and 64 sequences
    # (no slower than bf16), expanded for cuBLAS and through the tiled GEMM. The child writes the GGUF first (~1 GB).
    ("1.5b", ("decode_b1" + Q4KM, "batched_64" + Q4KM), 150),
    ("1.5b", ("depth_4096" + FLASH, "batched_64" + FLASH), 90),
    # FP8 weights (issue 33 point 3): batch-1 decode against the 2x the halved bytes allow, and 64 sequences.
    ("1.5b", ("decode_b1" + FP8, "batched_64" + FP8), 90),
    # Batched steps' GEMMs through cuBLASLt (no split-K): against batched_16/64 and profile_b64 above.
    ("0.5b", ("batched_16" + LT, "batched_64" + LT, "profile_b64" + LT), 90),
    ("1.5b", ("decode_b1" + FUSED,), 60),
    ("7b", ("decode_b1", "batched_64"), 150),
    ("1.5b", ("batched_64" + Q4KM_TILE,), 120),
    # The same FP8 blocks, batches through the tiled GEMM instead of the expansion (issue 33: 64 sequences no slower
    # than bf16).
    ("1.5b", ("batched_16" + FP8_TILE, "batched_64" + FP8_TILE), 90),
    # A 128k-token prompt through YaRN (chunked prefill, then decode at that depth).
    ("0.5b", ("long_128k" + YARN,), 240),
    ("0.5b", ("workload",), 240),
    # Last, so that it never displaces one of ours: the same-run peer on the shapes issue 31 names, against decode_b1
    # and batched_64 above (`--variants default,peer` gives it the time).
    ("0.5b", ("decode_b1" + PEER, "batched_64" + PEER), 240),
    ("1.5b", ("decode_b1" + PEER, "batched_64" + PEER), 240),
)
# A child's fixed costs (start, imports, model load, warm-up) that must fit besides its first step.
CHILD_OVERHEAD_S = 25.0
# Pessimistic write rate for a checkpoint not yet on disk (one thread into a VM's page cache ran at 0.4 GB/s, and
# 0.15-0.28 GB/s on a busy 2-core VM).
WRITE_BYTES_PER_S = 0.15e9
# Seconds kept back for the summary at the end of the budget.
RESERVE_S = 10.0


def planned_rows(shape: str, steps: tuple[str, ...]) -> list[tuple[str, str]]:
    """(shape, point) of every row the steps report, in order."""
    return [(shape, point) for step in steps for point in STEPS[step][0]]


def checkpoint_bytes(shape: str) -> int:
    """bf16 bytes of a synthetic checkpoint of a named shape."""
    from synthetic_checkpoint import resolve_shape, tensor_shapes

    _, spec = resolve_shape(shape)
    return sum(2 * math.prod(s) for s, _ in tensor_shapes(spec).values())


def fill_missing(rows: list[dict], planned: list[tuple[str, str]], note: str) -> list[dict]:
    """`rows` plus a row with `note` for every planned (shape, point) that has none, in the plan's order."""
    have = {(r["shape"], r["point"]) for r in rows}
    missing = [{"shape": s, "point": p, "tok_s": None, "limit_tok_s": None, "note": note}
               for s, p in planned if (s, p) not in have]
    return rows + missing


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def summary_table(rows: list[dict]) -> str:
    """The markdown table of result rows: shape, point, tok/s, % of the bandwidth limit (decode rows), note."""
    lines = ["| shape | point | tok/s | % of bandwidth limit | note |", "|---|---|---:|---:|---|"]
    for r in rows:
        tok_s = "" if r.get("tok_s") is None else _rate(r["tok_s"])
        limit = r.get("limit_tok_s")
        share = "" if r.get("tok_s") is None or not limit else f"{100 * r['tok_s'] / limit:.0f}% of {_rate(limit)}"
        note = str(r.get("note") or "").replace("|", "/")
        lines.append(f"| {r['shape']} | {r['point']} | {tok_s} | {share} | {note} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- synthetic mode: one shape (child)

RESULT_PREFIX = "RESULT "


class BudgetExceeded(BaseException):
    """Raised by the SIGALRM handler at the child's deadline; generate aborts its batch and lets it through. A
    BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


def _emit(row: dict, emitted: list[dict]) -> None:
    """Print a row for people and as a RESULT line for the parent; remember it in `emitted`."""
    emitted.append(row)
    tok_s = "" if row["tok_s"] is None else f"{_rate(row['tok_s'])} tok/s"
    limit = row.get("limit_tok_s")
    share = ""
    if tok_s and limit:
        share = f" ({100 * row['tok_s'] / limit:.0f}% of the {_rate(limit)} tok/s bandwidth limit)"
    text = " ".join(part for part in (tok_s + share, row.get("note") or "") if part)
    print(f"{row['shape']}: {row['point']}: {text}", flush=True)
    print(RESULT_PREFIX + json.dumps(row), flush=True)


def _row(shape: str, point: str, tok_s: float | None, limit: float | None = None, note: str = "") -> dict:
    return {"shape": shape, "point": point, "tok_s": tok_s, "limit_tok_s": limit, "note": note}


def _run_step(step: str, llm, shape: str, config: dict, bandwidth: float) -> list[dict]:  # noqa: ANN001
    """Run one step on a loaded model; returns its rows (named as in STEPS)."""
    from novainfer import SamplingParams
    from novainfer.bench import bench_batched, bench_latency

    names = STEPS[step][0]
    # An FP8 engine reads the bytes it holds, not the checkpoint's bf16 ones.
    weights = float(llm.stats()["weight_bytes_per_token"]) if variant_of(step) in PACKED_VARIANTS else None
    step = step.removesuffix(variant_of(step))
    if step == "decode_b1":
        decode = max(bench_latency(llm, 128, 256)[1] for _ in range(3))
        return [_row(shape, names[0], decode, decode_limit(bandwidth, config, 1, 128 + 128, weights), "best of 3")]
    if step == "depth_4096":
        runs = [bench_latency(llm, 4096, 129) for _ in range(2)]
        prefill, decode = max(r[0] for r in runs), max(r[1] for r in runs)
        return [
            _row(shape, names[0], prefill, None, "prompt / time to first token, best of 2"),
            _row(shape, names[1], decode, decode_limit(bandwidth, config, 1, 4096 + 64), "best of 2"),
        ]
    if step in ("batched_16", "batched_64"):
        n = 16 if step == "batched_16" else 64
        runs = [bench_batched(llm, n, 512, 128) for _ in range(2)]
        prefill, decode = max(r[0] for r in runs), max(r[1] for r in runs)
        return [
            _row(shape, names[0], prefill, None, "best of 2"),
            _row(shape, names[1], decode, decode_limit(bandwidth, config, n, 512 + 64, weights), "aggregate, best of 2"),
        ]
    if step in ("profile_b1", "profile_b64"):
        batch = 1 if step == "profile_b1" else 64
        b = kernel_breakdown(llm, batch)
        print(format_breakdown(b, title=f"{shape}: kernel-time breakdown, batch {batch}, 128-token prompts "
                                        f"(prefix-cached), {b['tokens'] // batch} tokens each; "
                                        f"{b['prompt_tokens_computed']} prompt tokens computed",
                               steps=b["steps"]), flush=True)
        notes = []
        if b["busy_fraction"] is not None:
            notes.append(f"GPU busy {100 * b['busy_fraction']:.0f}%")
        if b["steps"]:
            notes.append(f"{b['wall_s'] * 1e3 / b['steps']:.2f} ms/step")
            if b["steps_ahead"]:
                notes.append(f"{b['steps_ahead']} of {b['steps']} steps scheduled ahead")
            notes.append(f"{b['device_events'] / b['steps']:.0f} device events/step")
        if not b["rows"]:
            notes.append("no device events recorded")
        if b["pageable"]:
            notes.append(f"{sum(r['count'] for r in b['pageable'])} PAGEABLE memcpy")
        rate = b["tokens"] / b["wall_s"] if b["wall_s"] > 0 else None
        return [_row(shape, names[0], rate, None, ", ".join(notes) + " (under the profiler)")]
    if step == "long_128k":
        prompt = YARN_MAX_MODEL_LEN - 256
        prefill, decode = bench_latency(llm, prompt, 33)
        return [
            _row(shape, names[0], prefill, None, f"{prompt} tokens: {prompt / prefill:.1f} s to the first token"),
            _row(shape, names[1], decode, decode_limit(bandwidth, config, 1, prompt + 16), "one run"),
        ]
    if step == "workload":
        prompts, outputs = workload(llm._engine.vocab_size)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        return [_row(shape, names[0], sum(outputs) / seconds, None, f"output tokens, {seconds:.1f} s, EOS ignored")]
    raise ValueError(f"unknown step {step!r}")


def _run_peer_step(step: str, peer, config: dict, bandwidth: float, shape: str) -> list[dict]:  # noqa: ANN001
    """One of the peer's steps on its loaded model (scripts/hf_peer.py); rows named as in STEPS."""
    name = STEPS[step][0][0]
    if step == "decode_b1" + PEER:
        rate = peer.decode_rate(1, 128, 32, 256)
        return [_row(shape, name, rate, decode_limit(bandwidth, config, 1, 128 + 128), "tokens 32..256, best of 2")]
    if step == "batched_64" + PEER:
        rate = peer.decode_rate(64, 512, 16, 128)
        return [_row(shape, name, rate, decode_limit(bandwidth, config, 64, 512 + 64),
                     "aggregate, tokens 16..128, best of 2")]
    raise ValueError(f"unknown peer step {step!r}")


def child_main(
    shape: str, model_dir: Path, steps: tuple[str, ...], deadline: float, bandwidth: float, device: str = "cuda"
) -> int:
    """Load one synthetic checkpoint on `device` and run `steps` before `deadline` (time.time()), printing one
    RESULT line per row. Returns 1 if anything failed (a step stopped at the deadline is not a failure).
    `device="cpu"` is for testing this on a machine without a GPU (a small KV pool instead of 16 GiB). Steps named
    `..._async` run on an engine with `async_scheduling=True`, `..._fused` with the fused decode GEMVs, `..._lt` with
    cuBLASLt GEMMs (environment variables, so this process's engine only: a child runs steps of one variant),
    `..._yarn` on the checkpoint read with Qwen's YaRN settings and a 128k context (`yarn_view`), `..._fp8` with
    quantization="fp8", `..._fp8tile` with it and the tiled packed GEMM, `..._q4km` on the shape's synthetic Q4_K_M
    GGUF (written beside `model_dir` from its config and tokenizer) held packed, `..._q4kmtile` with the tiled GEMM
    too; `..._peer` steps run transformers with a static cache and torch.compile (scripts/hf_peer.py), not our
    engine."""
    import signal

    variants = {variant_of(step) for step in steps}
    if len(variants) > 1:
        names = sorted(VARIANTS.get(v, "default") for v in variants)
        raise ValueError(f"steps {steps} mix {' and '.join(names)} engines: give each variant a child of its own")
    variant = variants.pop() if variants else ""
    os.environ.update(VARIANT_ENV.get(variant, {}))

    planned = planned_rows(shape, steps)
    if variant == YARN:
        model_dir = yarn_view(model_dir)
    # The GGUF variants read the shape's config from the bf16 checkpoint and load the GGUF written beside it.
    config_dir = model_dir
    config = json.loads((config_dir / "config.json").read_text())

    def on_alarm(signum, frame):  # noqa: ANN001, ARG001
        raise BudgetExceeded

    # generate() runs Python's signal handlers while it waits, so the exception aborts its batch within ~50 ms.
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.time(), 0.01))
    emitted: list[dict] = []
    failed = 0
    try:
        from novainfer import LLM
        from novainfer.bench import bench_latency

        start = time.perf_counter()
        on_gpu = device.startswith("cuda")
        if variant == PEER:
            from hf_peer import HfStaticPeer

            peer = HfStaticPeer(model_dir, device)
            print(f"{shape}: transformers loaded on {device} in {time.perf_counter() - start:.1f} s", flush=True)

            def run_step(step: str) -> list[dict]:
                return _run_peer_step(step, peer, config, bandwidth, shape)
        else:
            extra = {}
            if variant in Q4KM_VARIANTS:
                from synthetic_gguf import ensure_gguf

                model_dir, written = ensure_gguf(model_dir.parent / f"{model_dir.name}-q4_k_m.gguf",
                                                 config_shape(config), config_dir)
                print(f"{shape}: {model_dir.name} {'written' if written else 'already there'} in "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
                extra["gpu_weight_dtype"] = "native"
            llm = LLM(model_dir, device=device, max_num_seqs=256, max_num_batched_tokens=8192, **extra,
                      kv_cache_bytes=KV_CACHE_BYTES if on_gpu else 256 << 20,
                      max_model_len=YARN_MAX_MODEL_LEN if variant == YARN else MAX_MODEL_LEN,
                      async_scheduling=variant == ASYNC, quantization="fp8" if variant in FP8_VARIANTS else None)
            assert llm.device.startswith(device), (llm.device, device)
            loaded = time.perf_counter() - start
            bench_latency(llm, 128, 16)  # warm-up: kernels loaded, pool touched
            print(f"{shape}: loaded on {llm.device} in {loaded:.1f} s, warmed up in "
                  f"{time.perf_counter() - start - loaded:.1f} s; weights "
                  f"{weight_bytes_per_token(config) / 2**30:.2f} GiB bf16, KV "
                  f"{kv_bytes_per_position(config) / 1024:.1f} KiB/position", flush=True)

            def run_step(step: str) -> list[dict]:
                return _run_step(step, llm, shape, config, bandwidth)

        for step in steps:
            left = deadline - time.time()
            if left < STEPS[step][1]:
                for point in STEPS[step][0]:
                    _emit(_row(shape, point, None, None, f"not run: time budget ({max(left, 0):.0f} s left)"), emitted)
                continue
            step_start = time.perf_counter()
            try:
                for row in run_step(step):
                    _emit(row, emitted)
            except BudgetExceeded:
                raise
            except Exception as e:  # noqa: BLE001 - one failed point must not cost the others
                failed = 1
                print(f"{shape}: {step} FAILED after {time.perf_counter() - step_start:.1f} s: {e!r}", flush=True)
                done = {(r["shape"], r["point"]) for r in emitted}
                for point in STEPS[step][0]:
                    if (shape, point) not in done:
                        _emit(_row(shape, point, None, None, f"FAILED: {type(e).__name__}: {str(e)[:120]}"), emitted)
    except BudgetExceeded:
        print(f"{shape}: stopped at its time budget", flush=True)
        for r in fill_missing(emitted, planned, "stopped: time budget")[len(emitted):]:
            _emit(r, emitted)
    except Exception as e:  # noqa: BLE001 - the load failed: every point reports it
        failed = 1
        import traceback

        traceback.print_exc()
        for r in fill_missing(emitted, planned, f"FAILED: {type(e).__name__}: {str(e)[:120]}")[len(emitted):]:
            _emit(r, emitted)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return failed


# --------------------------------------------------------------------------- synthetic mode: the parent


def run_child(
    shape: str, model_dir: Path, steps: tuple[str, ...], bandwidth: float, seconds: float, device: str = "cuda"
) -> tuple[list[dict], str | None]:
    """Run `child_main` in a fresh process with `seconds` to spend, echoing its output; returns its rows and
    None, or what went wrong ("exit code N", "killed ...")."""
    import queue
    import subprocess
    import threading

    deadline = time.time() + seconds
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--child", shape, str(model_dir),
           "--steps", ",".join(steps), "--deadline", repr(deadline), "--bandwidth", repr(bandwidth), "--device", device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    rows: list[dict] = []
    problem = None
    # The child stops itself at its deadline; past it by this much it is taken as hung.
    grace = 15.0
    while True:
        left = deadline + grace - time.time()
        try:
            line = lines.get(timeout=max(min(left, 1.0), 0.1))
        except queue.Empty:
            if problem is None and proc.poll() is not None:
                # Exited a second ago, but a process it started (a compile worker) still holds the pipe open:
                # everything it printed has been read.
                break
            if left > 0:
                continue
            if problem is not None:
                break  # killed 5 s ago and the pipe still open: give up on the rest of its output
            problem = f"killed: still running {grace:.0f} s past its time budget"
            proc.kill()
            # What it printed before it was killed is still worth its rows; the pipe closes with the process.
            deadline, grace = time.time(), 5.0
            continue
        if line is None:
            break
        if line.startswith(RESULT_PREFIX):
            try:
                rows.append(json.loads(line[len(RESULT_PREFIX):]))
            except ValueError:
                print(line, end="")
        else:
            print(line, end="", flush=True)
    code = proc.wait()
    if problem is None and code != 0:
        problem = f"exit code {code}"
    return rows, problem


def synthetic_main(args: argparse.Namespace) -> int:
    """The synthetic mode (see the module docstring); returns 1 if any point failed."""
    started = time.monotonic()
    end = started + args.budget_s - RESERVE_S
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes) - set(SHAPE_ORDER))
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(SHAPE_ORDER)}")
    bandwidth = args.bandwidth
    if bandwidth is None:
        bandwidth = copy_bandwidth()
        import torch

        torch.cuda.empty_cache()  # the copy's 2 GiB go back to the driver before the children start
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written); budget {args.budget_s:.0f} s",
          flush=True)
    rows: list[dict] = []
    failed = False
    variants = selected_variants(args.variants)
    groups = [(shape, steps, cap) for shape, steps, cap in GROUPS
              if shape in shapes and variant_name(variant_of(steps[0])) in variants]
    try:
        failed = run_groups(args, groups, (started, end), bandwidth, rows)
    except KeyboardInterrupt:
        # Stopped from outside (gpu-test's timeout at the run's budget): what ran is in `rows`.
        failed = True
        print("stopped by SIGINT: the table has the points that ran", flush=True)
    all_planned = [row for shape, steps, _ in groups for row in planned_rows(shape, steps)]
    write_table(args, fill_missing(rows, all_planned, "not run: the run was stopped"), bandwidth, started)
    return 1 if failed else 0


def write_table(args: argparse.Namespace, rows: list[dict], bandwidth: float, started: float, final: bool = True
                ) -> None:
    """The summary table of `rows` to `--table-out` (rewritten after every group, so a run killed from outside
    still leaves the points it measured), or printed at the end without it."""
    table = summary_table(rows)
    heading = ("## Speed on synthetic checkpoints (random bf16 weights, real shapes; "
               f"{time.monotonic() - started:.0f} s)\n\n"
               f"Bandwidth limit: the device-to-device copy rate ({bandwidth / 1e12:.2f} TB/s, read + written) over "
               "the bytes a decode step reads (bf16 weights once, each sequence's bf16 KV at its mean context).\n")
    if args.table_out is not None:
        # scripts/gpu-test appends it to its summary, last; printed here too it would show twice there.
        args.table_out.write_text(heading + "\n" + table + "\n", encoding="utf-8")
        if final:
            print(f"\nsummary table written to {args.table_out}", flush=True)
    elif final:
        print("\n" + heading + "\n" + table, flush=True)


def run_groups(args: argparse.Namespace, groups: list[tuple[str, tuple[str, ...], float]],
               window: tuple[float, float], bandwidth: float, rows: list[dict]) -> bool:
    """Runs `groups` in order within the budget's (start, end) `window`, appending every planned point's row to
    `rows` (in place, so an interrupted run keeps what it measured); True if a point failed."""
    from synthetic_checkpoint import ensure_checkpoint, is_complete

    started, end = window
    failed = False
    for shape, steps, cap in groups:
        planned = planned_rows(shape, steps)
        if variant_of(steps[0]) == PEER:
            missing = peer_missing()
            if missing is not None:
                rows[:] = fill_missing(rows, planned, f"not run: {missing}")
                continue
        model_dir = args.synthetic_root / shape
        first_step = STEPS[steps[0]][1]
        left = end - time.monotonic()
        if not is_complete(model_dir, shape):
            write_s = checkpoint_bytes(shape) / WRITE_BYTES_PER_S
            if left < write_s + CHILD_OVERHEAD_S + first_step:
                rows[:] = fill_missing(rows, planned,
                                       f"not run: time budget (checkpoint not written, {max(left, 0):.0f} s left)")
                continue
            start = time.monotonic()
            try:
                ensure_checkpoint(model_dir, shape, args.tokenizer)
            except Exception as e:  # noqa: BLE001 - the other shapes still run
                failed = True
                print(f"{shape}: writing the checkpoint FAILED: {e!r}", flush=True)
                rows[:] = fill_missing(rows, planned, f"FAILED: checkpoint: {type(e).__name__}: {str(e)[:100]}")
                continue
            print(f"{shape}: wrote {model_dir} ({checkpoint_bytes(shape) / 2**30:.1f} GiB) in "
                  f"{time.monotonic() - start:.1f} s", flush=True)
        seconds = min(end - time.monotonic(), cap)
        if seconds < CHILD_OVERHEAD_S + first_step:
            rows[:] = fill_missing(rows, planned, f"not run: time budget ({max(seconds, 0):.0f} s for it)")
            continue
        child_rows, problem = run_child(shape, model_dir, steps, bandwidth, seconds, args.device)
        if problem is not None:
            failed = True
        if any(str(r.get("note", "")).startswith("FAILED") for r in child_rows):
            failed = True
        rows[:] = fill_missing(rows + child_rows, planned, f"not run: child {problem}")
        write_table(args, rows, bandwidth, started, final=False)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", action="store_true", help="benchmark synthetic checkpoints (see above)")
    parser.add_argument("--synthetic-root", type=Path,
                        help="where the checkpoints are (default $NOVAINFER_HOME/synthetic)")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / ".gpu" / "tokenizer",
                        help="tokenizer directory for new checkpoints (scripts/gpu-test build writes it)")
    parser.add_argument("--shapes", default=",".join(SHAPE_ORDER))
    parser.add_argument("--variants", default="all",
                        help="engine variants to run, comma-separated: default, " + ", ".join(
                            variant_name(v) for v in VARIANTS) + " (default: all)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds the synthetic mode may take")
    parser.add_argument("--table-out", type=Path, help="also write the summary table (markdown) here")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    # Given, the copy is not measured (tests on a machine without a GPU pass both).
    parser.add_argument("--bandwidth", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        shape, model_dir = args.child
        try:
            return child_main(shape, Path(model_dir), tuple(args.steps.split(",")), args.deadline, args.bandwidth,
                              args.device)
        except BudgetExceeded:  # the alarm between child_main's handlers: its rows are out, nothing failed
            return 0
    if args.synthetic:
        if args.synthetic_root is None:
            from novainfer.fetch import cache_dir

            args.synthetic_root = cache_dir() / "synthetic"
        return synthetic_main(args)
    return demo_main()


if __name__ == "__main__":
    sys.exit(main())
