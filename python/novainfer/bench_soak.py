"""`novainfer bench soak`: a fault-injecting load on the OpenAI-compatible server, then a leak check.

It starts ``novainfer-server`` on 127.0.0.1 (or targets ``--url``) and keeps ``--concurrency`` clients busy
for ``--duration`` seconds. For each request a client draws, from a generator seeded with ``--bench-seed``:

- with probability ``--abort-fraction``, a stream it abandons after a few chunks: half of them by closing
  the connection (``disconnected``), half by ``POST /v1/requests/{X-Request-Id}/cancel`` and reading on
  until the stream ends with ``finish_reason: abort`` (``cancelled``);
- with probability ``--bad-fraction``, a bad request, in turn: malformed JSON (400), a body over the
  server's ``--max-body-bytes`` (413), or a connection that sends half its headers and stalls until the
  server closes it (``--header-read-timeout``);
- otherwise a streaming chat or text completion read to its end (``ok``), whose time to first token (the
  first chunk with text) is recorded.

A 429 (queue full) is an accepted outcome; anything else unexpected (a 500, a stream without ``[DONE]``, a
hang) fails the run. At the end it waits for the engine to settle and reads ``/metrics``: no KV block in
use, no request running or waiting, nothing in flight in the server.

``--fault-after-steps N`` (needs a server built with the ``failpoints`` feature, ``--server-executable``)
makes the engine panic after N steps: streams then in flight must end with a server-error event and later
requests get 503 — none may hang — and ``/health`` must turn 503; the leak check is skipped (the engine is
gone).

Only the standard library is used: one thread per client, ``http.client`` and raw sockets.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .bench_serve import percentile, start_server

__all__ = ["add_soak_args", "run_bench_soak"]

_WORDS = "the code function value return list string model server token cache thread stream prefix block".split()

#: Server settings the soak relies on when it starts the server itself.
_MAX_BODY_BYTES = 256 << 10
_HEADER_READ_TIMEOUT_S = 1.0

#: Engine series that must all read 0 once the load has stopped.
_IDLE_SERIES = ("novainfer:kv_cache_used_blocks", "novainfer:num_requests_running", "novainfer:num_requests_waiting")


def add_soak_args(p: argparse._ActionsContainer) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="soak: seconds of load")
    p.add_argument("--abort-fraction", type=float, default=0.10, help="soak: share of streams abandoned")
    p.add_argument("--bad-fraction", type=float, default=0.05, help="soak: share of bad requests")
    p.add_argument("--fault-after-steps", type=int, default=None,
                   help="soak: make the engine panic after N steps (a server built with feature failpoints)")
    p.add_argument("--server-executable", default=None,
                   help="soak: run this novainfer-server binary instead of the installed one")


@dataclass
class Tally:
    """Outcomes by name, and the TTFTs of the streams read to their end."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    ttfts: list[float] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, *, ttft: float | None = None, detail: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if ttft is not None:
                self.ttfts.append(ttft)
            if detail is not None and len(self.unexpected) < 20:
                self.unexpected.append(detail)


class _Soak:
    def __init__(self, url: str, args: argparse.Namespace, tally: Tally) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.args = args
        self.tally = tally
        self.faulty = args.fault_after_steps is not None
        self.serial = iter(range(1 << 62))
        self.serial_lock = threading.Lock()

    def _request_id(self) -> str:
        with self.serial_lock:
            return f"soak-{os.getpid()}-{next(self.serial)}"

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=120)

    def _payload(self, rng: random.Random) -> tuple[str, dict]:
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 64)))
        common = {"max_tokens": rng.randint(*self.args.output_range), "temperature": 0, "ignore_eos": True,
                  "stream": True}
        if rng.random() < 0.5:
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        return "/v1/completions", {**common, "prompt": text}

    def _failed(self, status: int, body: bytes) -> None:
        """A refused request: 429 always allowed; 503/500 only once the engine fault was injected."""
        if status == 429:
            self.tally.add("overloaded_429")
        elif self.faulty and status in (500, 503):
            self.tally.add(f"engine_down_{status}")
        else:
            self.tally.add("unexpected", detail=f"HTTP {status}: {body[:200]!r}")

    def stream(self, rng: random.Random, abandon: str | None) -> None:
        """One streaming request; `abandon`: None (read to the end), "disconnect" or "cancel"."""
        path, payload = self._payload(rng)
        request_id = self._request_id()
        conn = self._conn()
        start = time.perf_counter()
        ttft = None
        finish = None
        error = None
        done = False
        try:
            conn.request("POST", path, json.dumps(payload),
                         {"Content-Type": "application/json", "X-Request-Id": request_id})
            r = conn.getresponse()
            if r.status != 200:
                self._failed(r.status, r.read())
                return
            stop_after = rng.randint(1, 5)
            chunks = 0
            for raw in r:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                    break
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    # Time to the first *token*: a chat stream's first chunk carries only the role.
                    if ttft is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                        ttft = time.perf_counter() - start
                chunks += 1
                if abandon and chunks == stop_after:
                    if abandon == "disconnect":
                        self.tally.add("disconnected")
                        return
                    self.cancel(request_id)
                    abandon = "cancelled"
        except (OSError, http.client.HTTPException) as e:
            self.tally.add("unexpected", detail=f"{path}: {type(e).__name__}: {e}")
            return
        finally:
            conn.close()
        if error is not None:
            if self.faulty:
                self.tally.add("engine_failed_in_stream")
            else:
                self.tally.add("unexpected", detail=f"error event: {error}")
        elif not done:
            self.tally.add("unexpected", detail=f"{path}: stream ended without [DONE]")
        elif abandon == "cancelled":
            # A stream may finish on its own before the cancel lands.
            self.tally.add("cancelled" if finish == "abort" else "cancel_after_finish")
        else:
            self.tally.add("ok", ttft=ttft)

    def cancel(self, request_id: str) -> None:
        conn = self._conn()
        try:
            conn.request("POST", f"/v1/requests/{request_id}/cancel", b"", {"Content-Type": "application/json"})
            conn.getresponse().read()  # 200, or 404 if it just finished
        finally:
            conn.close()

    def malformed_json(self) -> None:
        self._expect_status("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"', 400,
                            "malformed_json_400")

    def oversized_body(self) -> None:
        body = json.dumps({"prompt": "x" * (_MAX_BODY_BYTES + 1024), "max_tokens": 1}).encode()
        self._expect_status("/v1/completions", body, 413, "oversized_413")

    def _expect_status(self, path: str, body: bytes, status: int, outcome: str) -> None:
        conn = self._conn()
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            got = r.status
            r.read()
        except (OSError, http.client.HTTPException) as e:
            # The server may answer 413 and close before the whole body is sent.
            if status == 413 and isinstance(e, (BrokenPipeError, ConnectionResetError)):
                self.tally.add(outcome)
            else:
                self.tally.add("unexpected", detail=f"{outcome}: {type(e).__name__}: {e}")
            return
        finally:
            conn.close()
        if got == status:
            self.tally.add(outcome)
        else:
            self.tally.add("unexpected", detail=f"{outcome}: got HTTP {got}")

    def slow_headers(self) -> None:
        """Half a request's headers, then silence: the server must close the connection."""
        with socket.create_connection((self.host, self.port), timeout=_HEADER_READ_TIMEOUT_S * 10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n")
            try:
                while s.recv(4096):
                    pass  # a 408 may come before the close
                self.tally.add("slow_headers_closed")
            except ConnectionResetError:
                self.tally.add("slow_headers_closed")
            except TimeoutError:
                self.tally.add("unexpected", detail="a connection stalled in its headers was not closed")

    def client(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        bad = [self.malformed_json, self.oversized_body, self.slow_headers]
        while time.monotonic() < deadline:
            draw = rng.random()
            if draw < self.args.bad_fraction:
                rng.choice(bad)()
            elif draw < self.args.bad_fraction + self.args.abort_fraction:
                self.stream(rng, rng.choice(["disconnect", "cancel"]))
            else:
                self.stream(rng, None)


def _metrics(soak: _Soak) -> dict[str, float]:
    conn = soak._conn()
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    sums: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            sums[key.split("{")[0]] += float(value)
    return sums


def _settled(soak: _Soak, timeout: float = 15.0) -> dict[str, float]:
    """The idle series once all read 0, or their last values after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(soak)
        series = {name: m.get(name, 0.0) for name in (*_IDLE_SERIES, "novainfer:server_requests_in_flight")}
        if not any(series.values()) or time.monotonic() > deadline:
            return series
        time.sleep(0.1)


def _health(soak: _Soak) -> int:
    conn = soak._conn()
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    program = [args.server_executable] if args.server_executable else None
    extra = ["--max-body-bytes", str(_MAX_BODY_BYTES), "--header-read-timeout", str(_HEADER_READ_TIMEOUT_S)]
    env = dict(os.environ)
    if args.fault_after_steps is not None:
        extra.append("--no-exit-on-engine-failure")
        env["NOVAINFER_FAILPOINT_ENGINE_PANIC_AFTER"] = str(args.fault_after_steps)
    return start_server(args, program=program, extra=extra, env=env)


def run_bench_soak(args: argparse.Namespace) -> int:
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_server(args)
    tally = Tally()
    try:
        soak = _Soak(url, args, tally)
        started = time.monotonic()
        deadline = started + args.duration
        threads = [threading.Thread(target=soak.client, args=(args.bench_seed * 1000 + i, deadline))
                   for i in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            # A client hung past its deadline by more than any request may take is a failure.
            t.join(max(deadline - time.monotonic(), 0) + 120)
        hung = sum(t.is_alive() for t in threads)
        wall = time.monotonic() - started
        if args.fault_after_steps is None:
            settled = _settled(soak)
            leaked = any(settled.values())
        else:
            settled = {"health_status": float(_health(soak))}
            leaked = settled["health_status"] != 503
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"bench soak: model={args.model} clients={args.concurrency} duration={args.duration:.0f} s "
          f"(wall {wall:.1f} s) abort={args.abort_fraction} bad={args.bad_fraction} "
          f"fault_after_steps={args.fault_after_steps} seed={args.bench_seed}")
    total = sum(tally.outcomes.values())
    print(f"  requests {total}: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    if tally.ttfts:
        print(f"  TTFT of completed streams p50/p99 {percentile(tally.ttfts, 50) * 1e3:.0f}/"
              f"{percentile(tally.ttfts, 99) * 1e3:.0f} ms ({len(tally.ttfts)} streams)")
    print("  after the load: " + ", ".join(f"{k} {v:g}" for k, v in settled.items()))
    for detail in tally.unexpected:
        print(f"  unexpected: {detail}")
    if hung:
        print(f"  {hung} clients still waiting at the end (hung requests)")
    ok = not tally.outcomes["unexpected"] and not hung and not leaked
    print("  PASS" if ok else "  FAIL")
    return 0 if ok else 1
