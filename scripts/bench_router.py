#!/usr/bin/env python3
"""Prefix-cache hit rate and TTFT of NovaInfer replicas behind vllm-router, per routing policy.

    python scripts/bench_router.py --model qwen2.5-coder-0.5b --replicas 2 --sessions 5 --turns 4 \
        --policy round_robin --policy cache_aware --policy kv_aware -- --threads 1

Starts the replicas (`python -m novainfer.server`, extra server flags after `--`) and the router for each
policy (with `kv_aware`, the replicas publish KV-cache events and the router subscribes), runs a multi-session
workload whose sessions each extend their own long prefix turn by turn, and
prints the replicas' summed vllm:prefix_cache_* counters and mean vllm:time_to_first_token_seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from server_process import ServerProcess  # noqa: E402
from test_vllm_router import Router, engine_totals, kv_event_ports, kv_events_args  # noqa: E402


def run(args: argparse.Namespace, policy: str) -> None:
    ports = kv_event_ports(args.replicas) if policy == "kv_aware" else [None] * args.replicas
    servers = [ServerProcess(["--model", args.model, "--served-model-name", "tiny", *args.server_args,
                              *(kv_events_args(*p) if p else [])], timeout=600) for p in ports]
    try:
        extra = []
        for s, p in zip(servers, ports):
            if p:
                extra += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{p[0]}",
                          "--kv-event-replay-source", f"{s.url}=tcp://127.0.0.1:{p[1]}"]
        if policy == "kv_aware":
            extra += ["--kv-event-block-size", "16", "--kv-event-model", "tiny"]
        router = Router([s.url for s in servers], policy, *extra)
        try:
            before = engine_totals(servers)
            history = [f"Session {i}: you are assistant number {i} with a long, distinct set of instructions. "
                       * args.prefix_repeats for i in range(args.sessions)]
            for turn in range(args.turns):
                for i in range(args.sessions):
                    history[i] += f"\nUser turn {turn}: tell me about topic {i * 10 + turn}.\nAssistant:"
                    history[i] += router.complete(history[i], args.max_tokens)["choices"][0]["text"]
            after = engine_totals(servers)
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    hits, queries = d["vllm:prefix_cache_hits_total"], d["vllm:prefix_cache_queries_total"]
    n = d["vllm:time_to_first_token_seconds_count"]
    print(f"{policy:12s} hit rate {hits / queries:.3f} ({hits:.0f}/{queries:.0f} prompt tokens)  "
          f"mean TTFT {d['vllm:time_to_first_token_seconds_sum'] / n * 1e3:.0f} ms  requests {n:.0f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=5)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-repeats", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--policy", action="append", default=[])
    p.add_argument("server_args", nargs="*")
    args = p.parse_args()
    for policy in args.policy or ["round_robin", "cache_aware", "kv_aware"]:
        run(args, policy)


if __name__ == "__main__":
    main()
