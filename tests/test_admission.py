"""Admission before costly work (issue 14, point 3), against the real server on the tiny model.

Rendering/tokenizing, prompt scoring (echo + logprobs) and embeddings each have a pool of their own
(`--max-concurrent-tokenize/-scoring/-embeddings`), admitted before the work runs: past the pool's queue
(`--max-queued-requests`) the answer is 429 with Retry-After. Each embedding input is a prefill-only engine
request, scheduled in chunks inside the step's token budget, so a large embedding batch delays a running
stream by at most one step's budget of work per token, never by the whole batch.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from server_process import ServerProcess
from test_server import KV, assert_openai_error, post_json

#: A running stream's largest inter-token gap while embedding batches run beside it may be at most this many
#: single-input embedding requests (each timed alone first, HTTP round trip included) plus GAP_SLACK_S: with
#: a step budget of STEP_BUDGET tokens (about one input), a step holds the stream's token and at most one
#: input's worth of embedding work. The large batches take far longer than that bound (checked), so running them
#: in one go, or all queued inputs between two steps, would fail the test.
GAP_FORWARDS = 4
STEP_BUDGET = "512"
GAP_SLACK_S = 0.1
LARGE_BATCH = 128
#: Large batches sent at once: one alone (158 ms on a 2-core Zen 4 since the dense matmul runs 8 lanes wide)
#: no longer takes twice the bound, and a request may hold at most 128 inputs.
LARGE_REQUESTS = 4
EMBEDDERS = 4

#: A long ordinary-token text for the tiny byte-level vocabulary (about 500 tokens).
LONG_TEXT = "hello world " * 42


def tiny(tiny_models, *extra: str) -> list[str]:
    return ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV, *extra]


def stream_gaps(server, max_tokens: int) -> list[float]:
    """Seconds between the SSE chunks of one greedy completion stream."""
    payload = {"model": "tiny", "prompt": "Hello", "temperature": 0, "stream": True,
               "max_tokens": max_tokens, "ignore_eos": True}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    times = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            if raw.startswith(b"data: {"):
                times.append(time.monotonic())
    return [b - a for a, b in zip(times, times[1:])]


_unique = iter(range(10**9))


def distinct(n: int) -> list[str]:
    """`n` long inputs no earlier request shares a prefix with (so none is served from the prefix cache)."""
    return [f"{next(_unique)} {LONG_TEXT}" for _ in range(n)]


def embed(server, inputs: list[str]):
    status, headers, body = post_json(server, "/v1/embeddings", {"model": "tiny", "input": inputs})
    return status, headers, body


def test_embeddings_beside_a_stream_do_not_stall_it(tiny_models):
    pool = str(EMBEDDERS + LARGE_REQUESTS)
    args = tiny(tiny_models, "--max-concurrent-embeddings", pool, "--max-num-batched-tokens", STEP_BUDGET)
    with ServerProcess(args) as server:
        embed(server, distinct(1))  # warm up
        started = time.monotonic()
        for _ in range(5):
            assert embed(server, distinct(1))[0] == 200
        one_forward = (time.monotonic() - started) / 5
        results: list[int] = []
        large: list[float] = []
        stop = threading.Event()

        def large_batch() -> None:
            results.append(embed(server, distinct(LARGE_BATCH))[0])
            large.append(time.monotonic())

        def embedder() -> None:
            while not stop.is_set():
                results.append(embed(server, distinct(4))[0])

        threads = [threading.Thread(target=large_batch) for _ in range(LARGE_REQUESTS)]
        threads += [threading.Thread(target=embedder) for _ in range(EMBEDDERS)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        try:
            time.sleep(0.1)
            gaps = stream_gaps(server, 60)
        finally:
            stop.set()
            for t in threads:
                t.join()
        bound = GAP_FORWARDS * one_forward + GAP_SLACK_S
        large_s = max(large) - t0
        print(f"one embedding request of one input {one_forward * 1e3:.1f} ms; {LARGE_REQUESTS} batches of "
              f"{LARGE_BATCH} inputs {large_s * 1e3:.0f} ms; stream gaps beside: median "
              f"{statistics.median(gaps) * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms (bound {bound * 1e3:.0f} ms); "
              f"{len(results)} batches")
        assert max(gaps) < bound
        assert large_s > 2 * bound, "the large batches are too quick to tell interleaving from not"
        assert results and set(results) == {200}
        server.wait_idle("tiny")


def test_each_costly_pool_refuses_past_its_queue(tiny_models):
    args = tiny(tiny_models, "--max-concurrent-embeddings", "1", "--max-queued-requests", "0")
    with ServerProcess(args) as server:
        statuses: list = []

        def big() -> None:
            statuses.append(embed(server, [LONG_TEXT] * 64))

        threads = [threading.Thread(target=big) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(s for s, _, _ in statuses)
        assert codes[0] == 200 and codes[-1] == 429, codes
        status, headers, body = next(s for s in statuses if s[0] == 429)
        err = assert_openai_error(status, body, 429)
        assert err["code"] == "server_overloaded"
        assert "--max-concurrent-embeddings 1" in err["message"]
        assert headers.get("Retry-After") == "1"
        # Other work has pools of its own: tokenizing still runs.
        status, _, body = post_json(server, "/tokenize", {"model": "tiny", "prompt": "hello"})
        assert status == 200, body


def test_pool_flags_are_range_checked(tiny_models):
    for flag in ("--max-concurrent-tokenize", "--max-concurrent-scoring", "--max-concurrent-embeddings"):
        proc = subprocess.run([sys.executable, "-m", "novainfer.server", *tiny(tiny_models, flag, "0")],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert flag.lstrip("-") in proc.stderr, proc.stderr


def test_a_long_embedding_runs_in_chunks_with_the_same_result(tiny_models):
    """With a step budget of 32 tokens, a ~500-token input is computed in chunks of 32, one between two engine
    steps; its vector equals the one computed in one pass (budget 2048, more than the input)."""
    inputs = [LONG_TEXT, "hello"]
    vectors = []
    for budget in ("2048", "32"):
        with ServerProcess(tiny(tiny_models, "--max-num-batched-tokens", budget)) as server:
            status, _, body = embed(server, inputs)
            assert status == 200, body
            vectors.append([d["embedding"] for d in json.loads(body)["data"]])
    for whole, chunked in zip(*vectors):
        assert max(abs(a - b) for a, b in zip(whole, chunked)) < 1e-6
