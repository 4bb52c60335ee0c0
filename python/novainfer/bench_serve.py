"""`novainfer bench serve`: a bounded load generator against the OpenAI-compatible server.

It starts ``novainfer-server`` on 127.0.0.1 (or targets ``--url``), builds a fixed, seeded workload of chat
requests — prompt lengths drawn uniformly from ``--prompt-range`` (whole chat prompt, template included),
output lengths from ``--output-range`` (EOS ignored so every request generates exactly that many), and an
optional shared prefix of ``--shared-prefix-tokens`` in the system message — then keeps ``--concurrency``
streaming requests in flight until ``--num-requests`` have finished. It reports output and total tokens/s
over the wall time, and TTFT, TPOT (per request: time after the first token over the remaining tokens) and
ITL (time between successive streamed tokens) at p50/p95/p99.

A mixed workload (``--long-prompts N``) adds N long requests (``--long-prompt-tokens`` each, 8 output tokens)
sent at the start, beside the short ones and outside ``--concurrency``: the report then gives the short
requests' latencies (what the long ones cost them) and the long ones' own TTFT and end-to-end time. Compare
the default scheduling with plain FCFS by passing ``--server-arg=--long-prefill-token-threshold=1000000``.

With ``--llama-cpp BIN_DIR`` the same payloads then go to llama.cpp's ``llama-server`` from that folder, started
on the same GGUF with the same threads, one slot per request in flight and an f16 KV cache (``--kv-cache-dtype``
maps as in ``bench llama-cpp``), and a last line compares the two: output tokens/s and TTFT. The workload is
built with NovaInfer's tokenizer, so both servers see the same messages; each reports its own token counts.

Only the standard library is used: one thread per in-flight request, ``http.client`` for SSE.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["add_serve_args", "run_bench_serve", "RequestResult", "percentile"]

_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or an have not which but they "
    "code function value return list string number model server request token cache memory thread python "
    "rust vector matrix layer batch stream prefix block queue engine sample greedy output input prompt data"
).split()


@dataclass
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def add_serve_args(p: argparse._ActionsContainer) -> None:
    p.add_argument("--concurrency", type=int, default=16, help="serve: requests in flight")
    p.add_argument("--url", default=None, help="serve: target a running server instead of starting one")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, help="serve: shared system-prompt tokens")
    p.add_argument("--server-arg", action="append", default=[], help="serve: extra novainfer-server argument")
    p.add_argument("--long-prompts", type=int, default=0, help="serve: long requests mixed in (sent at the start)")
    p.add_argument("--long-prompt-tokens", type=int, default=4096, help="serve: prompt tokens of each long request")


class _Client:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def post(self, path: str, payload: dict) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stream_chat(self, payload: dict) -> RequestResult:
        res = RequestResult()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        start = time.perf_counter()
        last = None
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(payload), {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                res.error = f"HTTP {r.status}: {r.read()[:200]!r}"
                return res
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
            res.e2e = time.perf_counter() - start
        finally:
            conn.close()
        return res


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _sized(client: _Client, model: str | None, rng: random.Random, tokens: int) -> str:
    """Random text of exactly `tokens` tokens (cut at the token level, then detokenized)."""
    ids = client.post("/tokenize", {"model": model, "prompt": _text(rng, tokens * 2), "add_special_tokens": False})["tokens"]
    return client.post("/detokenize", {"model": model, "tokens": ids[:max(tokens, 1)]})["prompt"]


def build_workload(client: _Client, model: str | None, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.bench_seed)
    # Template overhead of a conversation, so `--prompt-range` counts whole prompts.
    probe = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}]
    overhead = client.post("/tokenize", {"model": model, "messages": probe})["count"] - 2
    shared = _sized(client, model, rng, args.shared_prefix_tokens) if args.shared_prefix_tokens else "You are a helpful assistant."
    shared_len = args.shared_prefix_tokens or 6
    payloads = []
    for _ in range(args.num_requests):
        own = max(rng.randint(*args.prompt_range) - overhead - shared_len, 1)
        payloads.append({
            "model": model,
            "messages": [{"role": "system", "content": shared}, {"role": "user", "content": _sized(client, model, rng, own)}],
            "max_tokens": rng.randint(*args.output_range),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        })
    return payloads


def build_long_requests(client: _Client, model: str | None, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.bench_seed + 1)
    return [{
        "model": model,
        "messages": [{"role": "user", "content": _sized(client, model, rng, args.long_prompt_tokens)}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    } for _ in range(args.long_prompts)]


def start_server(
    args: argparse.Namespace,
    *,
    program: list[str] | None = None,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Starts `novainfer-server` (or `program`) on a free port with the benchmark's engine options plus
    `extra`; returns the process and its URL once it listens."""
    program = program or [sys.executable, "-m", "novainfer.server"]
    cmd = [*program, "--host", "127.0.0.1", "--port", "0", "--model", args.model,
           "--max-num-seqs", str(max(args.concurrency + getattr(args, "long_prompts", 0), 1)), "--kv-layout", args.kv_layout,
           "--kv-cache-dtype", args.kv_cache_dtype, *(extra or [])]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        if m:
            return proc, m.group(0)
    raise RuntimeError(f"novainfer-server exited with status {proc.wait()} before listening")


def run_load(client: _Client, payloads: list[dict], concurrency: int) -> tuple[list[RequestResult], float]:
    todo: queue.Queue[dict] = queue.Queue()
    for p in payloads:
        todo.put(p)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                payload = todo.get_nowait()
            except queue.Empty:
                return
            r = client.stream_chat(payload)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itls]
    summary = {
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "seconds": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + prompt_tokens) / wall,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", itls)):
        for p in (50, 95, 99):
            summary[f"{name}_p{p}_ms"] = percentile(values, p) * 1e3
    return summary


@dataclass
class LoadResult:
    """One server's run of the workload: the short requests (timed alone) and the long ones sent beside them."""

    results: list[RequestResult]
    wall: float
    long_results: list[RequestResult]
    overall: float


def measure(client: _Client, payloads: list[dict], long_payloads: list[dict], concurrency: int) -> LoadResult:
    """Warms the server up, then runs the long requests and the bounded short load at once."""
    # Warm-up outside the clock (thread pools, allocator), with a prompt no request shares.
    client.stream_chat({**payloads[0], "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
    long_results: list[RequestResult] = []
    long_threads = [
        threading.Thread(target=lambda p=p: long_results.append(client.stream_chat(p))) for p in long_payloads
    ]
    started = time.perf_counter()
    for t in long_threads:
        t.start()
    results, wall = run_load(client, payloads, concurrency)
    for t in long_threads:
        t.join()
    return LoadResult(results, wall, long_results, time.perf_counter() - started)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(args: argparse.Namespace, gguf: str) -> tuple[subprocess.Popen, str]:
    """Starts llama.cpp's `llama-server` on the same GGUF and load shape; returns it and its URL once healthy."""
    from .bench_llama_cpp import llama_kv_type

    slots = max(args.concurrency + args.long_prompts, 1)
    longest = max(args.prompt_range[1], args.long_prompt_tokens if args.long_prompts else 0)
    # Each slot gets ctx / slots: room for the longest prompt, its output and the template.
    per_slot = args.max_model_len or longest + args.output_range[1] + 64
    kv = llama_kv_type(args)
    port = _free_port()
    cmd = [str(Path(args.llama_cpp) / "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * per_slot), "-ctk", kv, "-ctv", kv, "--no-webui"]
    if args.threads:
        cmd += ["-t", str(args.threads), "-tb", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            ready = conn.getresponse().status == 200
            conn.close()
            if ready:
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server was not ready after 300 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _report(label: str, load: LoadResult, long_prompt_tokens: int) -> dict[str, float]:
    """Prints one server's figures; returns the short requests' summary."""
    s = summarize(load.results, load.wall)
    print(
        f"  {label}: wall {s['seconds']:.1f} s | output {s['output_tok_s']:.1f} tok/s | total {s['total_tok_s']:.1f} tok/s "
        f"| {s['requests']} requests (errors {s['errors']}) | {s['prompt_tokens']} prompt + {s['output_tokens']} output tokens\n"
        f"    TTFT p50/p95/p99 {s['ttft_p50_ms']:.0f}/{s['ttft_p95_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms | "
        f"TPOT {s['tpot_p50_ms']:.0f}/{s['tpot_p95_ms']:.0f}/{s['tpot_p99_ms']:.0f} ms | "
        f"ITL {s['itl_p50_ms']:.0f}/{s['itl_p95_ms']:.0f}/{s['itl_p99_ms']:.0f} ms"
    )
    if load.long_results:
        ok = [r for r in load.long_results if r.error is None]
        print(
            f"    long prompts: {len(ok)} of {len(load.long_results)} x {long_prompt_tokens} tokens | "
            f"TTFT p50/max {percentile([r.ttft for r in ok], 50):.1f}/{max((r.ttft for r in ok), default=0):.1f} s | "
            f"e2e max {max((r.e2e for r in ok), default=0):.1f} s (the short requests' figures are above)"
        )
        every = summarize(load.results + load.long_results, load.overall)
        print(f"    all requests: {every['total_tok_s']:.1f} tok/s total (prompt + output) over {load.overall:.1f} s")
    failed = [r.error for r in load.results + load.long_results if r.error is not None]
    if failed:
        print(f"    first error: {failed[0]}")
    return s


def _without_nulls(payload: dict) -> dict:
    """The payload without `model: null` (llama-server wants a string or nothing); the rest is the same."""
    return {k: v for k, v in payload.items() if v is not None}


def _errors(load: LoadResult) -> int:
    return sum(r.error is not None for r in load.results + load.long_results)


def run_bench_serve(args: argparse.Namespace) -> int:
    gguf = None
    if args.llama_cpp:
        from .fetch import resolve_model

        gguf = str(resolve_model(args.model, progress=False))
        if not gguf.endswith(".gguf"):
            raise SystemExit("bench serve --llama-cpp needs a GGUF model (llama-server reads GGUF only)")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        client = _Client(url)
        model = None  # `model` omitted: a server with one model serves it
        payloads = build_workload(client, model, args)
        long_payloads = build_long_requests(client, model, args)
        ours = measure(client, payloads, long_payloads, args.concurrency)
    finally:
        if proc is not None:
            _stop(proc)
    threads = args.threads or os.environ.get("RAYON_NUM_THREADS") or os.cpu_count()
    print(
        f"bench serve: model={args.model} threads={threads} requests={len(payloads)} "
        f"concurrency={args.concurrency} prompt={args.prompt_range[0]}-{args.prompt_range[1]} "
        f"output={args.output_range[0]}-{args.output_range[1]} shared_prefix={args.shared_prefix_tokens} "
        f"seed={args.bench_seed}"
    )
    s = _report("NovaInfer", ours, args.long_prompt_tokens)
    errors = _errors(ours)
    if gguf is not None:
        proc, url = start_llama_server(args, gguf)
        try:
            theirs = measure(_Client(url), [_without_nulls(p) for p in payloads],
                             [_without_nulls(p) for p in long_payloads], args.concurrency)
        finally:
            _stop(proc)
        t = _report("llama-server", theirs, args.long_prompt_tokens)
        errors += _errors(theirs)
        ratio = f"{s['output_tok_s'] / t['output_tok_s']:.2f}×" if t["output_tok_s"] else "—"
        print(
            f"  NovaInfer / llama-server: output tok/s {ratio} | "
            f"TTFT p50 {s['ttft_p50_ms'] / 1e3:.2f} s vs {t['ttft_p50_ms'] / 1e3:.2f} s, "
            f"p95 {s['ttft_p95_ms'] / 1e3:.2f} s vs {t['ttft_p95_ms'] / 1e3:.2f} s"
        )
    return 0 if errors == 0 else 1
