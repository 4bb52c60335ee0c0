"""`novainfer bench`: speed measurements (benchmarks, never tests).

- ``latency``: one stream; prefill speed is the prompt length over the time to the first token, decode speed
  the remaining tokens over the time after it. EOS is ignored so every run decodes the same count. An untimed
  warm-up run of the same prompt comes first (``--no-warmup`` skips it), as llama-bench's does.
- ``throughput``: many requests of mixed lengths, all submitted at once (continuous batching) and then one
  after another, reporting output and total tokens/s of each and the speed-up.
- ``prefix``: conversations that share a long system prompt, with the prefix cache on and then off (two
  engines), reporting time, prompt tokens actually computed, and cache hits. The first conversation runs
  alone, the rest together: conversations arrive over time, and requests admitted in the same step cannot
  share blocks that none of them has computed yet.
- ``kv-layout``: the throughput workload (all at once) on the BLOCK and the SLOT KV layout (two engines, same KV
  budget), reporting tokens/s, the pool's bytes, the KV watermark (most blocks/cells in use, and their bytes),
  and whether the two produced the same tokens.

- ``batched``: ``--num-seqs`` sequences of ``--prompt-tokens`` each decoding ``--decode-tokens`` together, as
  llama.cpp's ``llama-batched-bench`` does: prefill time is that of the same prompts with one output token, and the
  aggregate decode speed is the remaining tokens of all sequences over the remaining time.
- ``structured``: decode speed with a JSON Schema constraint against none, on the same chat prompts, at batch 1
  and at batch `--num-requests` (16 by default); the runs alternate constrained and unconstrained so a busy
  machine slows both alike, and the median of `--repeat` runs is reported, with the process's CPU time per token
  (which other programs disturb less than the wall clock). Outputs are `--decode-tokens` long (EOS ignored; the
  schema's array needs more items than that, so no constrained output ends early). The mask's own time per
  token: ``cargo bench -p novainfer-engine --bench grammar_mask``.
- ``speculative``: decode speed with speculative decoding (n-gram, and a draft model with ``--draft-model``)
  against without, on a code-editing and a free-form workload (see `bench_speculative`).
- ``serve``: the HTTP server under a bounded streaming chat load (see `bench_serve`).
- ``llama-cpp``: NovaInfer and llama.cpp's own bench tools side by side on one GGUF, point by point, each in a
  fresh process with its peak RSS (see `bench_llama_cpp`).
- ``lora``: decode speed with LoRA adapters against the base model, at batch 1 and over many requests on
  several adapters (see `bench_lora`).

Prompts are fixed pseudo-random token ids (a seeded LCG), so runs are comparable across machines.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

from . import _native
from ._native import SamplingParams
from .llm import LLM

__all__ = [
    "add_bench_args",
    "run_bench",
    "bench_latency",
    "bench_batched",
    "bench_throughput",
    "bench_prefix",
    "bench_kv_layout",
    "bench_structured",
]


def _prompt(n: int, vocab: int, seed: int = 12345) -> list[int]:
    state, ids = seed, []
    for _ in range(n):
        state = (state * 1103515245 + 12345) % 2**31
        ids.append(state % vocab)
    return ids


def _vocab(llm: LLM) -> int:
    # Stay below the special tokens at the end of Qwen2 vocabularies.
    return min(llm._engine.vocab_size, 150_000)


def bench_latency(llm: LLM, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """Returns (prefill tok/s, decode tok/s) for one run; the prompt is always computed in full."""
    prompt = _prompt(prompt_tokens, _vocab(llm))
    # Without this a repeated run would find its prompt in the prefix cache and measure nothing.
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = None
    count = 0
    for delta in llm.generate_stream(prompt, params):
        count += len(delta.token_ids)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None and count == decode_tokens, "bench run ended early: this is a bug"
    return prompt_tokens / (first - start), (count - 1) / max(end - first, 1e-9)


def bench_batched(llm: LLM, num_seqs: int, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """Returns (prefill tok/s, aggregate decode tok/s) of `num_seqs` distinct prompts decoded together."""
    if decode_tokens < 2:
        raise ValueError("bench batched needs --decode-tokens >= 2")
    prompts = [_prompt(prompt_tokens, _vocab(llm), seed=1000 + i) for i in range(num_seqs)]

    def run(max_tokens: int) -> float:
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    prefill = run(1)
    total = run(decode_tokens)
    return num_seqs * prompt_tokens / prefill, num_seqs * (decode_tokens - 1) / max(total - prefill, 1e-9)


def _workload(
    llm: LLM, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [_prompt(rng.randint(*prompt_range), _vocab(llm), seed + i) for i in range(num_requests)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(*output_range), ignore_eos=True) for _ in prompts
    ]
    return prompts, params


def bench_throughput(
    llm: LLM, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> dict[str, float]:
    """Runs the same workload batched and one by one; returns tokens/s of each."""
    prompts, params = _workload(llm, num_requests, prompt_range, output_range, seed)
    out_tokens = sum(p.max_tokens or 0 for p in params)
    all_tokens = out_tokens + sum(len(p) for p in prompts)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params)
    batched = time.perf_counter() - start
    llm.reset_prefix_cache()
    start = time.perf_counter()
    for p, sp in zip(prompts, params):
        llm.generate([p], sp)
    serial = time.perf_counter() - start
    return {
        "batched_output_tok_s": out_tokens / batched,
        "batched_total_tok_s": all_tokens / batched,
        "serial_output_tok_s": out_tokens / serial,
        "serial_total_tok_s": all_tokens / serial,
        "speedup": serial / batched,
    }


def bench_prefix(llm: LLM, num_requests: int, shared_tokens: int, own_tokens: int, output_tokens: int) -> dict[str, float]:
    """Requests = one shared prefix + their own suffix; returns seconds, computed prompt tokens, cache hits."""
    vocab = _vocab(llm)
    shared = _prompt(shared_tokens, vocab, seed=7)
    prompts = [shared + _prompt(own_tokens, vocab, seed=100 + i) for i in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    before = llm.stats()
    start = time.perf_counter()
    llm.generate(prompts[:1], params)
    llm.generate(prompts[1:], params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    return {
        "seconds": seconds,
        "prompt_tokens": float(sum(len(p) for p in prompts)),
        "computed_prompt_tokens": after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
        "hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
    }


def bench_kv_layout(
    llm: LLM, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> tuple[dict[str, float], list[list[int]]]:
    """Runs the throughput workload once, all at once, on `llm`; returns tokens/s, the KV pool's bytes and
    watermark (the engine should be fresh, so the watermark is this workload's), and the output tokens."""
    prompts, params = _workload(llm, num_requests, prompt_range, output_range, seed)
    out_tokens = sum(p.max_tokens or 0 for p in params)
    all_tokens = out_tokens + sum(len(p) for p in prompts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    s = llm.stats()
    return {
        "output_tok_s": out_tokens / seconds,
        "total_tok_s": all_tokens / seconds,
        "pool_bytes": s["kv_pool_bytes"],
        "watermark_blocks": s["kv_watermark_blocks"],
        "watermark_bytes": s["kv_watermark_blocks"] * s["kv_bytes_per_block"],
    }, [o.outputs[0].token_ids for o in outputs]


# Long enough that no output ends inside a run: `minItems` keeps the array open past the token budget.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "maxLength": 40},
                    "role": {"enum": ["dev", "ops", "pm", "design"]},
                },
                "required": ["name", "age", "email", "role"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


def _decode_speed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, adapters: list[str] | None = None
) -> tuple[float, float]:
    """Decode speed of `prompts` run together: tokens after each stream's first, over the time from the first
    stream's first token to the last stream's end (the short prompts are computed before any decoding).
    Returns (tok/s, CPU ms per token): the process's CPU time (all threads) over the same window, which other
    programs on a shared machine disturb much less than the wall clock. `adapters`: per prompt, a loaded LoRA
    adapter's name."""
    import threading

    firsts: list[tuple[float, float]] = []
    ends: list[tuple[float, float]] = []
    counts: list[int] = []
    lock = threading.Lock()
    names = adapters or [None] * len(prompts)
    streams = [llm._engine.stream(p, params, 0, a) for p, a in zip(prompts, names)]

    def clocks() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def drain(stream: object) -> None:
        first, count = None, 0
        for delta in stream:  # type: ignore[attr-defined]
            count += len(delta[1])
            if first is None:
                first = clocks()
        with lock:
            firsts.append(first or clocks())
            ends.append(clocks())
            counts.append(count)

    threads = [threading.Thread(target=drain, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = params.max_tokens
    assert all(c == expected for c in counts), f"bench outputs ended early ({counts}): this is a bug"
    (wall0, cpu0), (wall1, cpu1) = min(firsts), max(ends)
    tokens = sum(c - 1 for c in counts)
    return tokens / max(wall1 - wall0, 1e-9), 1e3 * (cpu1 - cpu0) / max(tokens, 1)


def bench_structured(llm: LLM, batch: int, decode_tokens: int, repeat: int) -> dict[str, float]:
    """Median decode tok/s of `batch` chat prompts with and without `BENCH_SCHEMA`, runs alternating."""
    import json
    import statistics

    from .structured_outputs import StructuredOutputsParams

    prompts = [
        llm.encode(
            llm.apply_chat_template([{"role": "user", "content": f"List {100 + i} people as JSON, with name, age, "
                                      "email and role."}]),
            add_special_tokens=False,
        )
        for i in range(batch)
    ]
    common = {"temperature": 0.0, "max_tokens": decode_tokens, "ignore_eos": True}
    plain = SamplingParams(**common)
    constrained = SamplingParams(**common, structured_outputs=StructuredOutputsParams(json=json.dumps(BENCH_SCHEMA)))
    # One unmeasured run of each: the first constrained request compiles the grammar.
    _decode_speed(llm, prompts[:1], plain)
    _decode_speed(llm, prompts[:1], constrained)
    runs: dict[str, list[tuple[float, float]]] = {"unconstrained": [], "json_schema": []}
    for _ in range(repeat):
        runs["unconstrained"].append(_decode_speed(llm, prompts, plain))
        runs["json_schema"].append(_decode_speed(llm, prompts, constrained))
    out: dict[str, float] = {}
    for name, results in runs.items():
        out[name] = statistics.median(r[0] for r in results)
        out[f"{name}_cpu_ms"] = statistics.median(r[1] for r in results)
    return out


#: Each mode of `novainfer bench`, with the line `--help` shows for it.
MODES: dict[str, str] = {
    "latency": "one stream: prefill tok/s over --prompt-tokens, then decode tok/s (the default)",
    "batched": "--num-seqs streams decoding together, as llama-batched-bench: aggregate tok/s",
    "throughput": "--num-requests mixed requests at once (continuous batching) vs one after another",
    "prefix": "conversations sharing a system prompt, prefix cache on vs off",
    "kv-layout": "the throughput load on the block and the slot KV layout",
    "structured": "decode speed with a JSON Schema constraint vs none, batch 1 and batched",
    "speculative": "n-gram (and --draft-model) speculative decoding vs plain, on two workloads",
    "serve": "the HTTP server under a bounded streaming chat load (latency percentiles)",
    "soak": "the server under aborts, bad requests and faults for --duration s, then a leak check",
    "llama-cpp": "NovaInfer beside llama.cpp's bench tools (--llama-cpp BIN_DIR) on one GGUF",
    "lora": "decode with LoRA adapters vs the base model: batch 1, and --num-requests over --lora-adapters",
}


def modes_help() -> str:
    """The modes, one line each: the bench parser's description."""
    width = max(map(len, MODES))
    return "modes:\n" + "\n".join(f"  {name:<{width}}  {line}" for name, line in MODES.items())


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The `novainfer bench` options (the model options are added by the CLI), grouped by the modes they
    apply to so that `--help` shows each mode's own options under its name."""
    p.add_argument("mode", nargs="?", choices=list(MODES), default="latency", help="what to measure (see modes)")
    one = p.add_argument_group("latency and batched (--repeat also structured, llama-cpp)")
    one.add_argument("--prompt-tokens", type=int, default=512, help="latency, batched: prompt length")
    one.add_argument("--decode-tokens", type=int, default=128, help="latency, batched: tokens to decode")
    one.add_argument("--repeat", type=int, default=3, help="latency, batched: runs; the best is reported")
    one.add_argument("--num-seqs", type=int, default=8, help="batched: sequences decoded together")
    one.add_argument("--no-warmup", dest="warmup", action="store_false",
                     help="latency: skip the untimed warm-up run of the same prompt (llama-bench warms up so too)")
    many = p.add_argument_group("throughput, kv-layout, structured (and serve's workload)")
    many.add_argument("--num-requests", type=int, default=16, help="throughput, structured, serve: requests")
    many.add_argument("--prompt-range", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                      help="throughput, serve: prompt lengths drawn from this range")
    many.add_argument("--output-range", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"),
                      help="throughput, serve: output lengths drawn from this range")
    many.add_argument("--bench-seed", type=int, default=0, help="throughput: workload seed")
    prefix = p.add_argument_group("prefix")
    prefix.add_argument("--shared-tokens", type=int, default=512, help="prefix: shared system-prompt length")
    prefix.add_argument("--own-tokens", type=int, default=32, help="prefix: each request's own suffix length")
    prefix.add_argument("--output-tokens", type=int, default=16, help="prefix: tokens generated per request")
    p.add_argument("--requantize-q5-0", action="store_true", help="re-encode Q5_0 GGUF tensors as Q8_0")
    from .bench_llama_cpp import add_llama_cpp_args
    from .bench_lora import add_lora_args
    from .bench_serve import add_serve_args
    from .bench_soak import add_soak_args
    from .bench_speculative import add_speculative_args

    add_serve_args(p.add_argument_group("serve and soak"))
    add_soak_args(p.add_argument_group("soak"))
    add_speculative_args(p.add_argument_group("speculative (--llama-cpp also compares llama.cpp's lookup)"))
    add_llama_cpp_args(p.add_argument_group("llama-cpp"))
    add_lora_args(p.add_argument_group("lora (also --num-requests, --prompt-tokens, --decode-tokens, --repeat)"))


def run_bench(llm: LLM, args: argparse.Namespace, make_llm: Callable[..., LLM] | None = None) -> int:
    """Runs the benchmark the CLI describes and prints one summary line. `make_llm(**engine_args)` builds
    the second engine the prefix (caching off) and kv-layout (the other layout) benchmarks need."""
    threads = os.environ.get("RAYON_NUM_THREADS", str(os.cpu_count()))
    head = f"model={llm.model_path.name} threads={threads}"
    # Which CPU code the figures below come from (on stderr: stdout is the one summary line).
    for line in _native.kernel_selections():
        print(f"kernel {line}", file=sys.stderr)
    if args.mode == "latency":
        if args.warmup:
            # Untimed, as llama-bench's warm-up run of the whole prompt: first touches of the KV pool and
            # the step's buffers (the kernel zeroing their pages) are not what a serving engine pays.
            bench_latency(llm, args.prompt_tokens, 2)
        results = [bench_latency(llm, args.prompt_tokens, args.decode_tokens) for _ in range(args.repeat)]
        prefill = max(r[0] for r in results)
        decode = max(r[1] for r in results)
        print(
            f"{head} prompt={args.prompt_tokens} prefill={prefill:.1f} tok/s "
            f"decode={decode:.1f} tok/s (best of {args.repeat})"
        )
        return 0
    if args.mode == "structured":
        parts = []
        for batch in (1, args.num_requests):
            r = bench_structured(llm, batch, args.decode_tokens, args.repeat)
            overhead = 100 * (1 - r["json_schema"] / r["unconstrained"])
            cpu_overhead = 100 * (r["json_schema_cpu_ms"] / r["unconstrained_cpu_ms"] - 1)
            parts.append(
                f"batch {batch}: unconstrained={r['unconstrained']:.1f} json_schema={r['json_schema']:.1f} tok/s "
                f"(overhead {overhead:.1f}%), CPU per token {r['unconstrained_cpu_ms']:.1f} vs "
                f"{r['json_schema_cpu_ms']:.1f} ms ({cpu_overhead:+.1f}%)"
            )
        print(f"{head} decode={args.decode_tokens} (median of {args.repeat}) | " + " | ".join(parts))
        return 0
    if args.mode == "batched":
        results = [
            bench_batched(llm, args.num_seqs, args.prompt_tokens, args.decode_tokens) for _ in range(args.repeat)
        ]
        print(
            f"{head} seqs={args.num_seqs} prompt={args.prompt_tokens} decode={args.decode_tokens} "
            f"prefill={max(r[0] for r in results):.1f} tok/s "
            f"decode={max(r[1] for r in results):.1f} tok/s aggregate (best of {args.repeat})"
        )
        return 0
    if args.mode == "prefix":
        engines = {"on": llm, "off": make_llm(enable_prefix_caching=False) if make_llm else None}
        parts = []
        for name, engine in engines.items():
            if engine is None:
                continue
            r = bench_prefix(engine, args.num_requests, args.shared_tokens, args.own_tokens, args.output_tokens)
            parts.append(
                f"cache {name}: {r['seconds']:.1f}s, computed {r['computed_prompt_tokens']:.0f}/"
                f"{r['prompt_tokens']:.0f} prompt tokens, hits {r['hit_tokens']:.0f}"
            )
        print(f"{head} requests={args.num_requests} shared={args.shared_tokens} own={args.own_tokens} | " + " | ".join(parts))
        return 0
    if args.mode == "kv-layout":
        if make_llm is None:
            raise ValueError("bench kv-layout needs make_llm to build the second engine")
        engines = {
            "block": llm if llm.kv_layout == "block" else make_llm(kv_layout="block"),
            "slot": llm if llm.kv_layout == "slot" else make_llm(kv_layout="slot"),
        }
        parts, tokens = [], []
        for name, engine in engines.items():
            r, t = bench_kv_layout(
                engine, args.num_requests, tuple(args.prompt_range), tuple(args.output_range), args.bench_seed
            )
            tokens.append(t)
            parts.append(
                f"{name}: output={r['output_tok_s']:.1f} total={r['total_tok_s']:.1f} tok/s, "
                f"pool={r['pool_bytes'] / 2**20:.0f} MiB, watermark={r['watermark_blocks']:.0f} "
                f"{'blocks' if name == 'block' else 'cells'} = {r['watermark_bytes'] / 2**20:.2f} MiB"
            )
        same = "yes" if tokens[0] == tokens[1] else "NO"
        print(
            f"{head} requests={args.num_requests} prompts={args.prompt_range} outputs={args.output_range} | "
            + " | ".join(parts)
            + f" | identical outputs: {same}"
        )
        return 0
    r = bench_throughput(llm, args.num_requests, tuple(args.prompt_range), tuple(args.output_range), args.bench_seed)
    print(
        f"{head} requests={args.num_requests} prompts={args.prompt_range} outputs={args.output_range} "
        f"batched: output={r['batched_output_tok_s']:.1f} total={r['batched_total_tok_s']:.1f} tok/s | "
        f"one-by-one: output={r['serial_output_tok_s']:.1f} total={r['serial_total_tok_s']:.1f} tok/s | "
        f"speed-up {r['speedup']:.2f}x"
    )
    return 0
