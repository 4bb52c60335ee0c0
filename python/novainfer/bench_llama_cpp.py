"""`novainfer bench llama-cpp`: NovaInfer and llama.cpp side by side on one GGUF, one point at a time.

Every point runs in a fresh process for each engine, one after the other, NovaInfer first, so that a point's
peak RSS is its own and both engines see the same machine state:

- prefill at each ``--prompt-lengths`` (tokens/s over the whole prompt): ``novainfer bench latency`` against
  ``llama-bench -p P -n 0``; both run the prompt once untimed first (llama-bench's warm-up, our latency
  bench's too);
- decode at each ``--depths`` (64 tokens after a prompt of that many tokens; a 16-token prompt stands for
  depth 0): ``novainfer bench latency`` against ``llama-bench -p 0 -n 64 -d D``;
- batched decode at each ``--batch-sizes`` (128-token prompts, 64 tokens each, aggregate tokens/s):
  ``novainfer bench batched`` against one ``llama-batched-bench`` run over all sizes;
- KV-cache bytes per token for each ``kv_cache_dtype``, from the engine's own pool layout;
- the memory roof of each decode point: a decode step reads every weight and the sequence's KV once, so
  ``read bandwidth / bytes per token`` bounds it. The bandwidth is measured (``_native.read_bandwidth``, the
  same threads) before the first decode point and after the last, since a VM's changes with its neighbours.

Both engines use the same thread count (``--threads``, also ``RAYON_NUM_THREADS``) and an f16 KV cache
(llama.cpp's default, our ``auto``) unless ``--kv-cache-dtype`` says otherwise. The table it prints is
Markdown, for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["add_llama_cpp_args", "run_bench_llama_cpp", "Measured"]

DECODE_TOKENS = 64
BATCH_PROMPT_TOKENS = 128


@dataclass
class Measured:
    """One engine's figure at one point, with the peak RSS of the process that measured it."""

    tok_s: float | None
    peak_rss_mib: float | None
    error: str | None = None


def add_llama_cpp_args(p: argparse._ActionsContainer) -> None:
    """The options of `novainfer bench llama-cpp` (`--llama-cpp BIN_DIR` is shared with `speculative`)."""
    p.add_argument("--prompt-lengths", type=int, nargs="*", default=[512, 4096, 16384], help="llama-cpp: prefill points")
    p.add_argument("--depths", type=int, nargs="*", default=[0, 4096, 16384], help="llama-cpp: decode depths")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 32, 64], help="llama-cpp: batched decode")


def _run(cmd: list[str], env: dict[str, str]) -> tuple[str, float | None, str | None]:
    """Runs `cmd` to the end; returns its stdout, its peak RSS in MiB and an error line if it failed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        except OSError as e:  # vanished or lost its exec bit since `_missing_tools` looked: a failed cell
            return "", None, f"cannot start {cmd[0]}: {e.strerror}"
        # wait4 reaps the child itself, so its rusage is the child's own peak RSS (KiB on Linux).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rss = usage.ru_maxrss / 1024
    if proc.returncode != 0:
        tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
        return stdout, rss, f"exit {proc.returncode}: {tail}"
    return stdout, rss, None


def _ours(args: argparse.Namespace, mode: str, *extra: str) -> tuple[str, float | None, str | None]:
    cmd = [sys.executable, "-m", "novainfer.cli", "bench", mode, "--model", str(args.model), "--threads",
           str(args.threads), "--kv-cache-dtype", args.kv_cache_dtype, "--repeat", str(args.repeat), *extra]
    return _run(cmd, _env(args))


def _env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}


def _number(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def llama_kv_type(args: argparse.Namespace) -> str:
    return {"auto": "f16", "f16": "f16", "bf16": "bf16", "f32": "f32", "q8_0": "q8_0"}[args.kv_cache_dtype]


def _llama_bench(args: argparse.Namespace, *extra: str) -> Measured:
    tool = Path(args.llama_cpp) / "llama-bench"
    kv = llama_kv_type(args)
    cmd = [str(tool), "-m", str(args.model), "-t", str(args.threads), "-r", str(args.repeat), "-o", "jsonl",
           "-ctk", kv, "-ctv", kv, *extra]
    out, rss, error = _run(cmd, _env(args))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return Measured(rows[-1]["avg_ts"] if rows else None, rss, error)


def _prefill(args: argparse.Namespace, tokens: int) -> tuple[Measured, Measured]:
    out, rss, error = _ours(args, "latency", "--prompt-tokens", str(tokens), "--decode-tokens", "2",
                            "--max-model-len", str(tokens + 64))
    ours = Measured(_number(r"prefill=([\d.]+) tok/s", out), rss, error)
    return ours, _llama_bench(args, "-p", str(tokens), "-n", "0")


def _decode(args: argparse.Namespace, depth: int) -> tuple[Measured, Measured]:
    prompt = max(depth, 16)
    out, rss, error = _ours(args, "latency", "--prompt-tokens", str(prompt), "--decode-tokens",
                            str(DECODE_TOKENS), "--max-model-len", str(prompt + DECODE_TOKENS + 64))
    ours = Measured(_number(r"decode=([\d.]+) tok/s", out), rss, error)
    return ours, _llama_bench(args, "-p", "0", "-n", str(DECODE_TOKENS), "-d", str(depth))


def _batched(args: argparse.Namespace) -> list[tuple[int, Measured, Measured]]:
    sizes = args.batch_sizes
    theirs: dict[int, Measured] = {}
    if sizes:
        kv = llama_kv_type(args)
        ctx = max(sizes) * (BATCH_PROMPT_TOKENS + DECODE_TOKENS) + 256
        cmd = [str(Path(args.llama_cpp) / "llama-batched-bench"), "-m", str(args.model), "-t", str(args.threads),
               "-c", str(ctx), "-b", "2048", "-ub", "512", "-ctk", kv, "-ctv", kv,
               "-npp", str(BATCH_PROMPT_TOKENS), "-ntg", str(DECODE_TOKENS),
               "-npl", ",".join(str(n) for n in sizes), "--output-format", "jsonl"]
        out, rss, error = _run(cmd, _env(args))
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                theirs[int(row["pl"])] = Measured(row["speed_tg"], rss)
        for n in sizes:
            theirs.setdefault(n, Measured(None, rss, error or "no result"))
    rows = []
    for n in sizes:
        out, rss, error = _ours(args, "batched", "--num-seqs", str(n), "--prompt-tokens",
                                str(BATCH_PROMPT_TOKENS), "--decode-tokens", str(DECODE_TOKENS))
        rows.append((n, Measured(_number(r"decode=([\d.]+) tok/s", out), rss, error), theirs[n]))
    return rows


@dataclass
class EngineSizes:
    """What a decode step of `model` reads: its weights, and KV bytes per token of context for each dtype."""

    weight_bytes_per_token: float
    kv_bytes_per_token: dict[str, float]


def engine_sizes(model: str) -> EngineSizes:
    """`model`'s decode-step weight bytes and its KV-cache bytes per token for each `kv_cache_dtype`, from
    the engine itself (its packed weights and its pool layout)."""
    from .llm import LLM

    kv, weights = {}, 0.0
    for dtype in ("f32", "f16", "bf16", "q8_0"):
        llm = LLM(model, kv_cache_dtype=dtype, kv_cache_bytes=64 << 20, device="cpu", block_size=16)
        stats = llm.stats()
        kv[dtype] = stats["kv_bytes_per_block"] / 16
        weights = stats["weight_bytes_per_token"]
        del llm
    return EngineSizes(weights, kv)


def read_bandwidth(args: argparse.Namespace) -> tuple[float | None, str | None]:
    """The machine's read bandwidth (bytes/s) with `--threads` threads, measured in a fresh process."""
    code = "from novainfer import _native; print(_native.read_bandwidth())"
    out, _, error = _run([sys.executable, "-c", code], _env(args))
    return (None, error) if error else (float(out.strip()), None)


def _cell(m: Measured) -> str:
    if m.tok_s is None:
        return f"failed ({m.error})"
    return f"{m.tok_s:.1f}"


def _ratio(ours: Measured, theirs: Measured) -> str:
    if ours.tok_s is None or not theirs.tok_s:
        return "—"
    return f"{ours.tok_s / theirs.tok_s:.2f}×"


def _rss(m: Measured) -> str:
    return "—" if m.peak_rss_mib is None else f"{m.peak_rss_mib:.0f}"


def run_bench_llama_cpp(args: argparse.Namespace) -> int:
    """Runs every point and prints the Markdown table; exit status 1 if any point failed."""
    if not args.llama_cpp:
        raise SystemExit("bench llama-cpp needs --llama-cpp BIN_DIR (llama-bench and llama-batched-bench)")
    from .fetch import resolve_model

    args.model = resolve_model(args.model, progress=False)
    if not str(args.model).endswith(".gguf"):
        raise SystemExit("bench llama-cpp needs a GGUF model (llama.cpp reads GGUF only)")
    missing = _missing_tools(args)
    if missing:
        # Checked before the first point: the batched tool is needed last, after many minutes of work.
        raise SystemExit(f"bench llama-cpp: {args.llama_cpp} lacks {', '.join(missing)} (build those llama.cpp "
                         "targets, or drop the points that need them)")
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    rows: list[tuple[str, Measured, Measured]] = []
    for tokens in args.prompt_lengths:
        rows.append((f"prefill {tokens}", *_prefill(args, tokens)))
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    bandwidth: list[float] = []
    decodes: list[tuple[int, Measured, Measured]] = []
    for i, depth in enumerate(args.depths):
        if i == 0:
            bandwidth += _bandwidth_line(args)
        decodes.append((depth, *_decode(args, depth)))
        rows.append((f"decode at depth {depth}", *decodes[-1][1:]))
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    if decodes:
        bandwidth += _bandwidth_line(args)
    for n, ours, theirs in _batched(args):
        rows.append((f"batched decode, {n} seqs (aggregate)", ours, theirs))
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    print(f"model={Path(args.model).name} threads={args.threads} kv_cache_dtype={args.kv_cache_dtype} "
          f"repeat={args.repeat}\n")
    print("| point | NovaInfer tok/s | llama.cpp tok/s | ratio | peak RSS MiB (ours / llama.cpp) |")
    print("| --- | --- | --- | --- | --- |")
    for name, ours, theirs in rows:
        print(f"| {name} | {_cell(ours)} | {_cell(theirs)} | {_ratio(ours, theirs)} | {_rss(ours)} / {_rss(theirs)} |")
    sizes = engine_sizes(str(args.model))
    print("\nKV-cache bytes per token: " + ", ".join(f"{dtype} {size:,.0f}" for dtype, size in
                                                   sizes.kv_bytes_per_token.items()))
    if decodes:
        _print_roofs(args, sizes, bandwidth, decodes)
    failed = any(m.tok_s is None for _, ours, theirs in rows for m in (ours, theirs))
    return 1 if failed else 0


def _missing_tools(args: argparse.Namespace) -> list[str]:
    """The llama.cpp executables the requested points need that `--llama-cpp` does not hold."""
    needed = (["llama-bench"] if args.prompt_lengths or args.depths else []) + \
        (["llama-batched-bench"] if args.batch_sizes else [])
    return [tool for tool in needed
            if not (Path(args.llama_cpp) / tool).is_file() or not os.access(Path(args.llama_cpp) / tool, os.X_OK)]


def _line(row: tuple[str, Measured, Measured]) -> str:
    name, ours, theirs = row
    return f"{name}: ours {_cell(ours)} tok/s, llama.cpp {_cell(theirs)} tok/s ({_ratio(ours, theirs)})"


def _bandwidth_line(args: argparse.Namespace) -> list[float]:
    bw, error = read_bandwidth(args)
    print(f"memory read bandwidth, {args.threads} threads: " + (f"{bw / 1e9:.1f} GB/s" if bw else f"failed ({error})"),
          file=sys.stderr, flush=True)
    return [bw] if bw else []


def _print_roofs(args: argparse.Namespace, sizes: EngineSizes, bandwidth: list[float],
                 decodes: list[tuple[int, Measured, Measured]]) -> None:
    """Each decode point against the machine's memory roof: the best tok/s a step that reads its bytes once
    could reach at the highest bandwidth measured."""
    if not bandwidth:
        print("\nMemory read bandwidth: not measured; no decode roofs.")
        return
    kv = sizes.kv_bytes_per_token[llama_kv_type(args)]
    low, high = min(bandwidth), max(bandwidth)
    print(f"\nMemory read bandwidth with {args.threads} threads: {low / 1e9:.1f}–{high / 1e9:.1f} GB/s (before the "
          f"first decode point and after the last). Weights read per decode step: {sizes.weight_bytes_per_token / 1e6:,.0f} MB.\n")
    print("| point | MB read per token | roof tok/s | NovaInfer, share of roof | llama.cpp, share of roof |")
    print("| --- | --- | --- | --- | --- |")
    for depth, ours, theirs in decodes:
        per_token = sizes.weight_bytes_per_token + depth * kv
        roof = high / per_token

        def share(m: Measured) -> str:
            return "—" if m.tok_s is None else f"{m.tok_s / roof:.0%}"

        print(f"| decode at depth {depth} | {per_token / 1e6:,.1f} | {roof:.1f} | {share(ours)} | {share(theirs)} |")
