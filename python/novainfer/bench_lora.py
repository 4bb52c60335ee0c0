"""`novainfer bench lora`: decode speed with LoRA adapters against the base model, in one engine.

Two points, as issue 34 states its targets: one stream (batch 1) on an adapter against one on the base model,
and `--num-requests` streams spread round-robin over `--lora-adapters` adapters against as many on the base
model (aggregate tok/s). Runs alternate base and adapted so a busy machine slows both alike; the median of
`--repeat` runs is reported. Adapters are `--lora PATH` (repeatable), else random ones of rank `--lora-rank` on
all seven projections, written for the model's shape into a temporary directory (their values do not change
the arithmetic, only its result).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import struct
import tempfile
from array import array
from pathlib import Path

from .bench import _decode_speed, _prompt, _vocab
from .llm import LLM
from .lora import LoRARequest
from ._native import SamplingParams

__all__ = ["add_lora_args", "run_bench_lora", "write_random_adapter"]

#: (module, block, out, in) of each projection, from the model's config.
_PROJECTIONS = (
    ("q_proj", "self_attn", "h", "h"),
    ("k_proj", "self_attn", "kv", "h"),
    ("v_proj", "self_attn", "kv", "h"),
    ("o_proj", "self_attn", "h", "h"),
    ("gate_proj", "mlp", "ffn", "h"),
    ("up_proj", "mlp", "ffn", "h"),
    ("down_proj", "mlp", "h", "ffn"),
)


def write_random_adapter(
    out_dir: Path, config: dict[str, int], rank: int, seed: int, dtype: str = "f32"
) -> Path:
    """A PEFT adapter of `rank` on every projection of a model of `config`, stored as `dtype` ("f32" or
    "bf16"), with small pseudo-random values (a fixed pool of them, reused at shifting offsets: generating
    every value would take longer than the benchmark)."""
    sizes = {
        "h": config["hidden_size"],
        "kv": config["num_key_value_heads"] * config["head_dim"],
        "ffn": config["intermediate_size"],
    }
    rng = random.Random(seed)
    values = array("f", (rng.uniform(-0.02, 0.02) for _ in range(1 << 16)))
    # bf16: the high half of each f32's bits (truncated: any bf16 values will do).
    pool = array("H", (b >> 16 for b in array("I", values.tobytes()))) if dtype == "bf16" else values
    tag = {"f32": "F32", "bf16": "BF16"}[dtype]
    tensors: list[tuple[str, tuple[int, int]]] = []
    for layer in range(config["num_hidden_layers"]):
        for module, block, out, inp in _PROJECTIONS:
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors.append((f"{prefix}.lora_A.weight", (rank, sizes[inp])))
            tensors.append((f"{prefix}.lora_B.weight", (sizes[out], rank)))
    header, offset = {}, 0
    for name, (rows, cols) in tensors:
        size = pool.itemsize * rows * cols
        header[name] = {"dtype": tag, "shape": [rows, cols], "data_offsets": [offset, offset + size]}
        offset += size
    out_dir.mkdir(parents=True, exist_ok=True)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(out_dir / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for i, (_, (rows, cols)) in enumerate(tensors):
            n, start = rows * cols, (i * 7919) % len(pool)
            while n > 0:
                chunk = pool[start : start + n]
                chunk.tofile(f)
                n -= len(chunk)
                start = 0
    config_json = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m for m, *_ in _PROJECTIONS], "task_type": "CAUSAL_LM",
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config_json))
    return out_dir


def add_lora_args(g: argparse._ArgumentGroup) -> None:
    """The `lora` mode's options."""
    g.add_argument("--lora", action="append", default=None, metavar="PATH",
                   help="lora: an adapter to run (repeatable); default: random ones")
    g.add_argument("--lora-adapters", type=int, default=4, help="lora: adapters the batched point spreads over")
    g.add_argument("--lora-rank", type=int, default=16, help="lora: rank of the random adapters")
    g.add_argument("--lora-dtype", choices=("f32", "bf16"), default="f32",
                   help="lora: how the random adapters are stored (bf16 ones stay bf16 in memory)")


def bench_lora(llm: LLM, adapters: list[LoRARequest], num_requests: int, prompt_tokens: int, decode_tokens: int,
               repeat: int) -> dict[str, float]:
    """Median decode tok/s of each point, base and adapted, runs alternating, and the median CPU ms per token
    (`<point>_cpu_ms`: the process's CPU time, which other programs on a shared machine disturb less)."""
    vocab = _vocab(llm)
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    for a in adapters:
        llm.add_lora(a)
    one = [_prompt(prompt_tokens, vocab)]
    many = [_prompt(prompt_tokens, vocab, seed=2000 + i) for i in range(num_requests)]
    spread = [adapters[i % len(adapters)].lora_name for i in range(num_requests)]
    points = {
        "batch1_base": (one, None),
        "batch1_lora": (one, [adapters[0].lora_name]),
        "batched_base": (many, None),
        "batched_lora": (many, spread),
    }
    # Untimed: first touches of the pool and buffers, and of each adapter's weights.
    for prompts, names in points.values():
        llm.reset_prefix_cache()
        _decode_speed(llm, prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), names)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in points}
    for _ in range(repeat):
        for name, (prompts, names) in points.items():
            llm.reset_prefix_cache()
            runs[name].append(_decode_speed(llm, prompts, params, names))
    out = {name: statistics.median(r[0] for r in rs) for name, rs in runs.items()}
    out.update({f"{name}_cpu_ms": statistics.median(r[1] for r in rs) for name, rs in runs.items()})
    return out


def run_bench_lora(llm: LLM, args: argparse.Namespace) -> int:
    """Prints one line: each point's tok/s and the adapted/base ratio."""
    threads = os.environ.get("RAYON_NUM_THREADS", str(os.cpu_count()))
    config = llm._engine.model_config
    with tempfile.TemporaryDirectory(prefix="novainfer-lora-bench-") as tmp:
        if args.lora:
            paths = [Path(p) for p in args.lora]
            rank = "given"
        else:
            paths = [write_random_adapter(Path(tmp) / f"a{i}", config, args.lora_rank, seed=i, dtype=args.lora_dtype)
                     for i in range(args.lora_adapters)]
            rank = f"{args.lora_rank} ({args.lora_dtype})"
        adapters = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        r = bench_lora(llm, adapters, args.num_requests, args.prompt_tokens, args.decode_tokens, args.repeat)
    print(
        f"model={llm.model_path.name} threads={threads} rank={rank} adapters={len(adapters)} "
        f"prompt={args.prompt_tokens} decode={args.decode_tokens} (median of {args.repeat}) | "
        f"batch 1: base={r['batch1_base']:.1f} lora={r['batch1_lora']:.1f} tok/s "
        f"({100 * r['batch1_lora'] / r['batch1_base']:.0f}%; by CPU time "
        f"{100 * r['batch1_base_cpu_ms'] / r['batch1_lora_cpu_ms']:.0f}%) | "
        f"{args.num_requests} requests: base={r['batched_base']:.1f} lora={r['batched_lora']:.1f} tok/s "
        f"({100 * r['batched_lora'] / r['batched_base']:.0f}%; by CPU time "
        f"{100 * r['batched_base_cpu_ms'] / r['batched_lora_cpu_ms']:.0f}%)"
    )
    return 0
