"""NovaInfer replicas behind the real `vllm-router` (issue 15, part 3), on the tiny model.

Two `novainfer serve` replicas on loopback ports, the router in front. A multi-session workload whose
sessions share long prefixes gets a higher prefix-cache hit rate (read from the replicas' `vllm:*` series)
with the router's cache-aware policy than with round robin; killing a replica loses no request the router
can retry, and the survivor keeps serving.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server_process import ServerProcess
from test_server import KV

# Beside this interpreter (a virtual environment's bin/), else on PATH.
_BESIDE = Path(sys.executable).parent / "vllm-router"
ROUTER = str(_BESIDE) if _BESIDE.exists() else shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is in tests/requirements.txt")

# Odd, so round robin sends a session's consecutive turns to different replicas.
SESSIONS = 5
TURNS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    def __init__(self, workers: list[str], policy: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        self.proc = subprocess.Popen(
            [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", self.metrics_url.split(":")[-1].split("/")[0],
             "--policy", policy, "--worker-urls", *workers, "--log-level", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm-router did not start: {self.proc.stderr.read()}")
            time.sleep(0.1)

    def complete(self, prompt: str, max_tokens: int = 4) -> dict:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        """The sum of the router's own Prometheus series `name` (0 if absent)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            lines = r.read().decode().splitlines()
        return sum(float(line.rpartition(" ")[2]) for line in lines if line.startswith(name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def replicas(tiny_models, n: int = 2, extra: list[list[str]] | None = None) -> list[ServerProcess]:
    return [ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV,
                           *(extra[i] if extra else [])]) for i in range(n)]


def kv_event_ports(n: int = 2) -> list[tuple[int, int]]:
    return [(free_port(), free_port()) for _ in range(n)]


def kv_events_args(pub: int, rep: int) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{rep}"}
    return ["--kv-events-config", json.dumps(config)]


def engine_totals(servers) -> dict[str, float]:
    totals: dict[str, float] = {}
    for s in servers:
        for key, value in s.metrics().items():
            if key.startswith("vllm:") and 'engine="0"' in key:
                name = key.split("{")[0]
                totals[name] = totals.get(name, 0.0) + value
    return totals


def sessions_workload(router: Router) -> None:
    """Each session: a long system prompt of its own, then turns that extend its conversation."""
    history = [f"Session {i}: you are assistant number {i} with a long, distinct set of instructions. " * 4
               for i in range(SESSIONS)]
    for turn in range(TURNS):
        for i in range(SESSIONS):
            history[i] += f"\nUser turn {turn}: tell me about topic {i * 10 + turn}.\nAssistant:"
            out = router.complete(history[i])
            history[i] += out["choices"][0]["text"]


def run_policy(tiny_models, policy: str) -> dict[str, float]:
    """`kv_aware` routes by the replicas' KV-cache events (vllm-router subscribes to each replica's ZMQ socket)."""
    ports = kv_event_ports() if policy == "kv_aware" else None
    servers = replicas(tiny_models, extra=[kv_events_args(*p) for p in ports] if ports else None)
    try:
        extra = []
        for s, (pub, rep) in zip(servers, ports or []):
            extra += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{pub}",
                      "--kv-event-replay-source", f"{s.url}=tcp://127.0.0.1:{rep}"]
        if ports:
            extra += ["--kv-event-block-size", "16", "--kv-event-model", "tiny"]
        router = Router([s.url for s in servers], policy, *extra)
        try:
            before = engine_totals(servers)
            sessions_workload(router)
            after = engine_totals(servers)
            kv_hits = router.metric('vllm_router_kv_placement_lookups_total{result="hit"}')
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    hits, queries = delta["vllm:prefix_cache_hits_total"], delta["vllm:prefix_cache_queries_total"]
    ttft = delta["vllm:time_to_first_token_seconds_sum"] / delta["vllm:time_to_first_token_seconds_count"]
    print(f"\n{policy}: prefix-cache hit rate {hits / queries:.3f} ({hits:.0f}/{queries:.0f} tokens), "
          f"mean TTFT {ttft * 1e3:.1f} ms over {delta['vllm:time_to_first_token_seconds_count']:.0f} requests")
    assert delta["vllm:request_success_total"] == SESSIONS * TURNS
    return {"hit_rate": hits / queries, "ttft": ttft, "kv_index_hits": kv_hits}


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(tiny_models):
    round_robin = run_policy(tiny_models, "round_robin")
    cache_aware = run_policy(tiny_models, "cache_aware")
    assert cache_aware["hit_rate"] > round_robin["hit_rate"]


def test_kv_aware_routing_reads_novainfers_kv_events(tiny_models):
    """vllm-router's kv_aware policy knows where prefixes are cached only from the events NovaInfer publishes."""
    round_robin = run_policy(tiny_models, "round_robin")
    kv_aware = run_policy(tiny_models, "kv_aware")
    assert kv_aware["hit_rate"] > round_robin["hit_rate"]
    # The router found the requests' prefixes in the index it built from the events.
    assert kv_aware["kv_index_hits"] > 0


def test_a_killed_replica_loses_no_retryable_request(tiny_models):
    servers = replicas(tiny_models)
    try:
        router = Router([s.url for s in servers], "round_robin")
        try:
            for i in range(6):
                assert router.complete(f"before {i}")["choices"][0]["finish_reason"] == "length"
            # Chat too: the router adds its own fields to the body, which must pass.
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 3, "stream": True}).encode()
            req = urllib.request.Request(router.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=120) as r:
                events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) > 2
            servers[1].proc.kill()
            servers[1].proc.wait()
            # Every request after the kill is answered: sent to the survivor, or retried there.
            for i in range(12):
                assert router.complete(f"after {i}")["choices"][0]["finish_reason"] == "length"
            served = servers[0].metrics()['vllm:request_success_total{model_name="tiny",engine="0",finished_reason="length"}']
            assert served >= 3 + 12
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop()
