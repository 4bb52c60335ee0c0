"""`novainfer bench`: single-stream prefill and decode speed.

Prefill speed is the prompt length over the time to the first token; decode speed is the remaining tokens
over the time after it. The prompt is fixed pseudo-random token ids, so runs are comparable; EOS is ignored
so every run decodes the same number of tokens. The best of `--repeat` runs is reported.
"""

from __future__ import annotations

import argparse
import os
import time

from ._native import SamplingParams
from .llm import LLM

__all__ = ["run_bench", "bench_once"]


def _prompt(n: int, vocab: int) -> list[int]:
    # A fixed LCG keeps the prompt identical across runs and machines.
    state, ids = 12345, []
    for _ in range(n):
        state = (state * 1103515245 + 12345) % 2**31
        ids.append(state % vocab)
    return ids


def bench_once(llm: LLM, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """Returns (prefill tok/s, decode tok/s) for one run."""
    prompt = _prompt(prompt_tokens, min(llm._engine.vocab_size, 150_000))
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
    return prompt_tokens / (first - start), (count - 1) / (end - first)


def run_bench(llm: LLM, args: argparse.Namespace) -> int:
    """Runs the benchmark the CLI describes and prints one summary line."""
    results = [bench_once(llm, args.prompt_tokens, args.decode_tokens) for _ in range(args.repeat)]
    prefill = max(r[0] for r in results)
    decode = max(r[1] for r in results)
    threads = os.environ.get("RAYON_NUM_THREADS", str(os.cpu_count()))
    print(
        f"model={llm.model_path.name} threads={threads} prompt={args.prompt_tokens} "
        f"prefill={prefill:.1f} tok/s decode={decode:.1f} tok/s (best of {args.repeat})"
    )
    return 0
