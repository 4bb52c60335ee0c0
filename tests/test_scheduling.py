"""Fair scheduling (docs/scheduling.md) end to end: priorities, tenant shares, the CPU defaults, and the
queue/prefill metrics. Tiny random models, except one short mixed-load check on the 0.5B demo model.

The ordering guarantees themselves are proven on random workloads by the scheduler's property tests; these
tests check that the knobs reach the scheduler and that a server under mixed load behaves as the rules say.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from conftest import PROMPT
from novainfer import LLM, InvalidParameterError, SamplingParams
from server_process import ServerProcess
from test_server import KV, assert_openai_error, post_json


def tiny(tiny_models, *extra: str) -> list[str]:
    return ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV, *extra]


def test_priorities_change_the_order_of_work_never_the_outputs(tiny_models):
    prompts = [PROMPT[: 4 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # One seat: the policy decides who runs first.
    common = {"kv_cache_bytes": 8 << 20, "max_num_seqs": 1}
    fcfs = LLM(tiny_models["f32"], **common).generate(prompts, params)
    ranked = LLM(tiny_models["f32"], scheduling_policy="priority", **common)
    out = ranked.generate(prompts, params, priority=[3, -1, 0, 2, -5, 1])
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in fcfs]
    with pytest.raises(InvalidParameterError) as e:
        ranked.generate(prompts, params, priority=[1])
    assert e.value.param == "priority"
    with pytest.raises(InvalidParameterError) as e:
        LLM(tiny_models["f32"], scheduling_policy="lifo", **common)
    assert e.value.param == "scheduling_policy"
    with pytest.raises(InvalidParameterError) as e:
        LLM(tiny_models["f32"], long_prefill_token_threshold=0, **common)
    assert e.value.param == "long_prefill_token_threshold"


def complete(server, prompt=PROMPT, key: str | None = None, **fields) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": 4, **fields}
    code, _, body = post_json(server, "/v1/completions", payload, headers)
    return code, json.loads(body)


def test_priority_field_and_queue_and_prefill_metrics(tiny_models):
    with ServerProcess(tiny(tiny_models, "--scheduling-policy", "priority")) as server:
        code, body = complete(server, priority=5)
        assert code == 200, body
        for bad in ("high", 1.5, 2**31):
            code, _, resp = post_json(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "priority": bad})
            assert_openai_error(code, resp, 400, "priority")
        m = server.metrics()
        label = '{model_name="tiny"}'
        for name in ("request_queue_time_seconds", "request_prefill_time_seconds"):
            assert m[f"novainfer:{name}_count{label}"] == 1, name
            assert m[f'vllm:{name}_count{{model_name="tiny",engine="0"}}'] == 1, name
        logs = server.logs()
        line = next(ln for ln in logs.splitlines() if "novainfer::request" in ln and "completions" in ln)
        assert "priority=5" in line and "queue_ms=" in line and "prefill_ms=" in line, line
    with pytest.raises(RuntimeError, match="scheduling_policy"):
        ServerProcess(tiny(tiny_models, "--scheduling-policy", "lifo"), timeout=30)


def test_the_cpu_defaults_are_chosen_and_logged_and_explicit_values_win(tiny_models):
    with ServerProcess(tiny(tiny_models), env={"RAYON_NUM_THREADS": "2"}) as server:
        logs = server.logs()
        assert "long_prefill_token_threshold=256" in logs and "max_long_partial_prefills=1" in logs, logs
        # The step budget: 256 per thread (512 at 2), not the GPU's 2048 that made one step of a chat burst.
        assert "max_num_batched_tokens=512" in logs, logs
    args = tiny(tiny_models, "--long-prefill-token-threshold", "300", "--max-num-batched-tokens", "4096")
    with ServerProcess(args, env={"RAYON_NUM_THREADS": "2"}) as server:
        logs = server.logs()
        assert "long_prefill_token_threshold=300" in logs and "max_num_batched_tokens=4096" in logs, logs


def stream_forever(server, key: str, done: list, stop: threading.Event) -> None:
    """A closed-loop client: one request at a time until `stop`; appends its key per completion."""
    while not stop.is_set():
        code, _ = complete(server, key=key, max_tokens=48, ignore_eos=True, temperature=0)
        if code == 200:
            done.append(key)


def test_a_flooding_key_leaves_the_other_its_share_and_hits_its_queue_cap(tiny_models):
    args = tiny(tiny_models, "--api-key", "flood,calm", "--max-concurrent-requests", "2",
                "--max-queued-requests-per-tenant", "8")
    with ServerProcess(args) as server:
        done: list[str] = []
        stop = threading.Event()
        # 8 clients on one key against 2 on the other, 2 slots: first come, first served would give the calm
        # key about 2/10 of the completions; fair slots give each key half while both have work queued.
        clients = [threading.Thread(target=stream_forever, args=(server, "flood", done, stop)) for _ in range(8)]
        clients += [threading.Thread(target=stream_forever, args=(server, "calm", done, stop)) for _ in range(2)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 120
        while len(done) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        # 12 more of the flooding key at once: with its 8 clients' requests, more than 8 of its own wait, so
        # its cap (not the shared queue) answers 429, naming the flag.
        refused: list[dict] = []

        def burst() -> None:
            code, body = complete(server, key="flood", max_tokens=1)
            if code == 429:
                refused.append(body)

        bursts = [threading.Thread(target=burst) for _ in range(12)]
        for b in bursts:
            b.start()
        for b in bursts:
            b.join(120)
        stop.set()
        for c in clients:
            c.join(60)
        window = done[:60]
        calm_share = window.count("calm") / len(window)
        print(f"completions: calm {window.count('calm')}, flood {window.count('flood')} (calm share {calm_share:.2f})")
        assert calm_share >= 0.35, window
    # The cap: 8 waiting + up to 12 more of the same key while 2 run must have met it.
    assert refused, "no request of the flooding key hit --max-queued-requests-per-tenant"
    err = refused[0]["error"]
    assert err["code"] == "tenant_queue_full" and "--max-queued-requests-per-tenant 8" in err["message"], err


LONG_SENTENCE = "The quick brown fox jumps over the lazy dog while the cat watches from the old stone wall. "


@pytest.mark.slow
def test_short_chats_finish_while_a_long_prompt_prefills_on_the_cpu_defaults():
    from novainfer.fetch import fetch_model

    fetch_model("qwen2.5-coder-0.5b", progress=False)
    # Two threads: the CPU rule then gives a 256-token threshold, so the long prompt (~3,000 tokens) takes about
    # 12 steps to prefill, while each short chat is admitted beside it and decodes a token in every step.
    args = ["--model", "qwen2.5-coder-0.5b", "--device", "cpu", "--kv-cache-bytes", str(256 << 20)]
    with ServerProcess(args, env={"RAYON_NUM_THREADS": "2"}) as server:
        finished: dict[str, float] = {}
        first_token: dict[str, float] = {}

        def chat(name: str, content: str, max_tokens: int) -> None:
            payload = {"model": "qwen2.5-coder-0.5b", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True}
            req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=300) as r:
                for raw in r:
                    if not raw.startswith(b"data: {"):
                        continue
                    choices = json.loads(raw[len(b"data: "):])["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        first_token.setdefault(name, time.monotonic())
            finished[name] = time.monotonic()

        long = threading.Thread(target=chat, args=("long", LONG_SENTENCE * 150 + "Summarize.", 2))
        long.start()
        time.sleep(0.5)  # the long prompt is admitted and prefilling
        shorts = [threading.Thread(target=chat, args=(f"short{i}", f"Say the number {i}.", 6)) for i in range(8)]
        for t in shorts:
            t.start()
        for t in shorts:
            t.join(300)
        long.join(300)
        assert "long" in finished, "the long prompt did not complete"
        start = min(first_token.values())
        print({k: round(v - start, 2) for k, v in sorted(finished.items())})
        for i in range(8):
            assert finished[f"short{i}"] < first_token["long"], (finished, first_token)


def test_streams_take_a_priority_too(tiny_models):
    llm = LLM(tiny_models["f32"], kv_cache_bytes=8 << 20, scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    streamed = [t for d in llm.generate_stream(PROMPT, params, priority=-3) for t in d.token_ids]
    assert streamed == llm.generate([PROMPT], params)[0].outputs[0].token_ids
    with pytest.raises(InvalidParameterError) as e:
        llm.generate_stream(PROMPT, params, priority="high")
    assert e.value.param == "priority"
