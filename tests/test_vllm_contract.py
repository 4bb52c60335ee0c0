"""vLLM's serving contract (issue 15, part 1), against the real server on the tiny model.

Routers and autoscalers built for vLLM (the Gateway API Inference Extension / llm-d, vLLM's production
stack, vllm-router, KEDA/HPA rules) read `vllm:*` series, `/v1/models` and a readiness probe. This file
scrapes `/metrics` while requests run and checks each vLLM series' name, type, labels and value range, and
the counters' monotonicity between scrapes.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

from server_process import ServerProcess
from test_server import KV, http

LABELS = {"model_name": "tiny", "engine": "0"}

# name -> type, as vLLM's prometheus_client exposition writes them (counters with `_total`).
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:gpu_prefix_cache_queries_total": "counter",
    "vllm:gpu_prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
}

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(server) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(family -> type, [(sample name, labels, value)]) of one `/metrics` scrape, strictly parsed."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    types: dict[str, str] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"{name} declared twice"
            types[name] = kind
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a Prometheus sample: {line!r}"
            labels = dict(LABEL.findall(m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return types, samples


def family(sample: str, types: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample.removesuffix(suffix)
        if base != sample and types.get(base) == "histogram":
            return base
    return sample


def check_scrape(types, samples) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Checks names, types, labels and ranges; returns vLLM samples by name."""
    for name, kind in VLLM_SERIES.items():
        assert types.get(name) == kind, f"{name}: type {types.get(name)!r}, want {kind}"
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in samples:
        if not name.startswith("vllm:"):
            continue
        fam = family(name, types)
        assert fam in types, f"{name} has no TYPE line"
        for key, want in LABELS.items():
            assert labels.get(key) == want, f"{name}{labels}: {key} should be {want!r}"
        assert value >= 0 and value == value, f"{name}{labels} = {value}"
        by_name.setdefault(name, []).append((labels, value))
    one = {name: vals[0][1] for name, vals in by_name.items() if len(vals) == 1}
    assert 0 <= one["vllm:kv_cache_usage_perc"] <= 1
    assert one["vllm:gpu_cache_usage_perc"] == one["vllm:kv_cache_usage_perc"]
    assert one["vllm:prefix_cache_hits_total"] <= one["vllm:prefix_cache_queries_total"]
    for name in ("num_requests_running", "num_requests_waiting", "num_preemptions_total"):
        assert one[f"vllm:{name}"] == int(one[f"vllm:{name}"])
    (info_labels, info_value), = by_name["vllm:cache_config_info"]
    assert info_value == 1
    assert info_labels["block_size"] == "16" and int(info_labels["num_gpu_blocks"]) > 0
    reasons = {labels["finished_reason"] for labels, _ in by_name["vllm:request_success_total"]}
    assert reasons == {"stop", "length", "abort", "error"}
    for fam, kind in VLLM_SERIES.items():
        if kind != "histogram":
            continue
        buckets = by_name[f"{fam}_bucket"]
        bounds = [float(labels["le"]) for labels, _ in buckets]
        counts = [v for _, v in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == float("inf"), fam
        assert counts == sorted(counts), f"{fam}: buckets must be cumulative"
        assert counts[-1] == one[f"{fam}_count"], fam
    return by_name


def test_vllm_metrics_during_load_and_model_card(tiny_models):
    args = ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV, "--max-num-seqs", "2"]
    with ServerProcess(args) as server:
        assert http(server, "GET", "/ready")[0] == 200
        status, _, body = http(server, "GET", "/v1/models")
        card = json.loads(body)["data"][0]
        assert status == 200 and card["id"] == "tiny" and card["max_model_len"] > 0

        prompt = "The same long system prompt for every session. " * 6

        def one(i: int) -> None:
            payload = {"model": "tiny", "prompt": prompt + f"user {i}", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True}
            req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=120) as r:
                for _ in r:
                    pass

        workers = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for w in workers:
            w.start()
        previous: dict[str, float] = {}
        seen_running = seen_waiting = False
        scrapes = 0
        try:
            while any(w.is_alive() for w in workers) or scrapes < 2:
                types, samples = scrape(server)
                by_name = check_scrape(types, samples)
                scrapes += 1
                seen_running |= by_name["vllm:num_requests_running"][0][1] > 0
                seen_waiting |= by_name["vllm:num_requests_waiting"][0][1] > 0
                for name, vals in by_name.items():
                    if types.get(family(name, types)) in ("counter", "histogram"):
                        for labels, value in vals:
                            key = name + json.dumps(labels, sort_keys=True)
                            assert value >= previous.get(key, 0), f"{key} went down"
                            previous[key] = value
                time.sleep(0.01)
        finally:
            for w in workers:
                w.join(120)
        assert seen_running and seen_waiting, "the scrapes never saw the batch running and a queue"
        _, samples = scrape(server)
        final = {(n, labels.get("finished_reason")): v for n, labels, v in samples if n.startswith("vllm:")}
        assert final[("vllm:request_success_total", "length")] == 6
        assert final[("vllm:e2e_request_latency_seconds_count", None)] == 6
        assert final[("vllm:time_to_first_token_seconds_count", None)] == 6
        assert final[("vllm:generation_tokens_total", None)] == 6 * 200
        # Six sessions share the long prompt: the later ones hit the prefix cache.
        assert final[("vllm:prefix_cache_hits_total", None)] > 0
        server.wait_idle("tiny")
        _, samples = scrape(server)
        idle = {n: v for n, labels, v in samples if n.startswith("vllm:") and "le" not in labels}
        assert idle["vllm:num_requests_running"] == idle["vllm:num_requests_waiting"] == 0
        assert idle["vllm:kv_cache_usage_perc"] == 0
