"""The OpenAI-compatible server against the official `openai` client, on the tiny model.

One server process serves the tiny model twice (as HF safetensors "tiny" and as GGUF "tiny-gguf") for most
tests; tests that need other flags (limits, API key, budget, reasoning) start their own. Outputs are checked
against the offline engine (`LLM`) running the same weights greedily.
"""

from __future__ import annotations

import http.client as http_client
import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from conftest import PROMPT, logits_of
from novainfer import LLM, SamplingParams
from server_process import ServerProcess

KV = ["--kv-cache-bytes", str(8 << 20)]


@pytest.fixture(scope="module")
def server(tiny_models):
    with ServerProcess(
        ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny",
         "--model", str(tiny_models["gguf"]), "--served-model-name", "tiny-gguf", *KV, "--keep-alive", "0.2"]
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def http(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of a raw request; error statuses do not raise."""
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def post_json(server, path: str, payload, headers: dict | None = None):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return http(server, "POST", path, body, {"Content-Type": "application/json", **(headers or {})})


def assert_openai_error(status: int, body: bytes, expected_status: int, param: str | None = None) -> dict:
    assert status == expected_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def greedy(llm: LLM, prompt, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text


# --------------------------------------------------------------------------- models, health, misc


def test_models_lists_every_served_model(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-gguf"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


def test_server_info_describes_each_model(client, server):
    """GET /server_info: context length (the same as /v1/models and /tokenize), device, KV layout
    and live use, the prefix cache's hit rate, optional features."""
    long_prompt = "the same long prompt " * 20  # several full KV blocks
    client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)  # a prefix-cache hit
    status, _, body = http(server, "GET", "/server_info")
    assert status == 200
    info = json.loads(body)
    assert [m["id"] for m in info["models"]] == ["tiny", "tiny-gguf"]
    tiny = info["models"][0]
    cards = {m.id: m for m in client.models.list().data}
    assert tiny["max_model_len"] == cards["tiny"].max_model_len == 512
    assert tiny["device"] == "cpu" and tiny["device_reason"]
    kv = tiny["kv_cache"]
    assert (kv["layout"], kv["block_size"], kv["dtype"], kv["prefix_caching"]) == ("block", 16, "f16", True)
    assert kv["num_blocks"] * kv["bytes_per_block"] <= kv["bytes"] <= 8 << 20
    assert 0 <= kv["num_used_blocks"] <= kv["num_blocks"]
    pc = tiny["prefix_cache"]
    assert 0 < pc["hit_tokens"] <= pc["query_tokens"] and pc["hit_rate"] == pc["hit_tokens"] / pc["query_tokens"]
    assert tiny["features"] == {"json_schema": True, "tool_calls": True, "speculative_decoding": False}
    assert info["version"] == json.loads(http(server, "GET", "/version")[2])["version"]


def test_health_version_and_request_ids(server):
    status, headers, body = http(server, "GET", "/health")
    assert status == 200 and headers["X-Request-Id"]
    status, _, body = http(server, "GET", "/version")
    assert status == 200 and json.loads(body)["version"]
    # A client's own id is echoed; errors carry one too.
    _, headers, _ = http(server, "GET", "/health", headers={"X-Request-Id": "my-id-1"})
    assert headers["X-Request-Id"] == "my-id-1"
    status, headers, body = http(server, "GET", "/no/such/path")
    assert_openai_error(status, body, 404)
    assert headers["X-Request-Id"]
    status, _, body = post_json(server, "/v1/no-such-endpoint", {})
    assert_openai_error(status, body, 404)
    status, _, body = http(server, "GET", "/v1/completions")
    assert_openai_error(status, body, 405)


def test_tokenize_detokenize_roundtrip(server, tiny_llm):
    status, _, body = post_json(server, "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200
    out = json.loads(body)
    assert out["tokens"] == tiny_llm.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == tiny_llm.max_model_len
    status, _, body = post_json(server, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == "Hello world"
    messages = [{"role": "user", "content": "hi"}]
    status, _, body = post_json(server, "/tokenize", {"model": "tiny", "messages": messages})
    assert json.loads(body)["tokens"] == tiny_llm.encode(tiny_llm.apply_chat_template(messages), add_special_tokens=False)
    status, _, body = post_json(server, "/detokenize", {"model": "tiny", "tokens": [100000]})
    assert_openai_error(status, body, 400, "tokens")


# --------------------------------------------------------------------------- completions


def test_completion_matches_offline_engine(client, tiny_llm):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.system_fingerprint
    assert out.choices[0].text == greedy(tiny_llm, PROMPT, 8)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(PROMPT), 8, len(PROMPT) + 8)
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    # The GGUF copy of the same weights answers the same.
    gguf = client.completions.create(model="tiny-gguf", prompt=PROMPT, max_tokens=8, temperature=0)
    assert gguf.choices[0].text == out.choices[0].text


def test_completion_prompt_list_and_text(client, tiny_llm):
    prompts = ["Hello there", "The cat"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [greedy(tiny_llm, p, 5) for p in prompts]


def _engine_steps(server, model: str) -> float:
    """`novainfer:engine_steps_total` of `model` from one `/metrics` scrape."""
    _, _, body = http(server, "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith("novainfer:engine_steps_total{") and f'model_name="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no novainfer:engine_steps_total for {model}")


def test_a_requests_prompts_enter_the_engine_in_one_step(client, server):
    # A list of prompts reaches the engine as one submission, so its first step prefills all of them (one step
    # for one token each). Submitted one by one, the engine started on the first prompt before the others arrived.
    for _ in range(3):
        before = _engine_steps(server, "tiny")
        out = client.completions.create(model="tiny", prompt=[f"prompt number {i}" for i in range(12)],
                                        max_tokens=1, temperature=0)
        assert len(out.choices) == 12
        assert _engine_steps(server, "tiny") - before == 1


def test_completion_stream_equals_whole(client):
    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_sse_framing_and_done(server):
    status, headers, body = post_json(server, "/v1/completions",
                                      {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") or e.startswith(":") for e in events)
    for e in events[:-1]:
        if e.startswith("data: "):
            assert json.loads(e[6:])["object"] == "text_completion"


def test_echo_and_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Hello")
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and abs(chosen - max(top.values())) < 1e-5


def test_echo_with_logprobs_scores_the_prompt(client, tiny_llm):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = logits_of(tiny_llm, PROMPT).astype(np.float64)
    log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    expected = [log_softmax[i, PROMPT[i + 1]] for i in range(len(PROMPT) - 1)]
    np.testing.assert_allclose(lp.token_logprobs[1:len(PROMPT)], expected, atol=1e-4)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    streamed = [c.choices[0] for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                                                echo=True, logprobs=1, stream=True) if c.choices]
    assert streamed[0].logprobs.token_logprobs == lp.token_logprobs[: len(PROMPT)]


def test_stop_string_ends_text_and_never_leaks(client, tiny_llm):
    full = greedy(tiny_llm, PROMPT, 24)
    stop = full[6:9]
    assert stop.strip(), full
    expected = full[: full.index(stop)]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_n_completions(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    single = client.completions.create(model="tiny", prompt="Hello", max_tokens=1)
    assert out.usage.completion_tokens == 18 and out.usage.prompt_tokens == single.usage.prompt_tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, n=2, seed=1, stream=True)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chat if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


# --------------------------------------------------------------------------- chat


def test_chat_matches_offline_engine(client, tiny_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    expected = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(bytes(t.bytes) == t.token.encode() for t in content)


def test_embeddings(client):
    one = client.embeddings.create(model="tiny", input="Hello world", encoding_format="float")
    v = np.array(one.data[0].embedding)
    assert abs(np.linalg.norm(v) - 1) < 1e-4
    # The openai client's default is base64; the same vector comes back.
    many = client.embeddings.create(model="tiny", input=["Hello world", "Other text"])
    assert [d.index for d in many.data] == [0, 1]
    np.testing.assert_allclose(np.array(many.data[0].embedding), v, atol=1e-6)
    assert not np.allclose(np.array(many.data[1].embedding), v)
    assert many.usage.prompt_tokens > one.usage.prompt_tokens > 0
    ids = client.embeddings.create(model="tiny", input=[PROMPT], encoding_format="float")
    assert len(ids.data[0].embedding) == len(v)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": "tiny", "prompt": "x", "max_tokens": "five"}, "max_tokens"),
        ({"model": "tiny", "prompt": 5}, "prompt"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 2}, "top_p"),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
        ({"model": "tiny", "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "seed": -1}, "seed"),
        ({"model": "tiny", "prompt": "x", "stop": [1]}, "stop"),
        ({"model": "tiny", "prompt": "x", "max_tokenz": 3}, "max_tokenz"),
        ({"model": "tiny", "prompt": [], "max_tokens": 3}, "prompt"),
        ({"model": "tiny", "prompt": [100000]}, "prompt"),
        ({"model": "tiny", "prompt": "x", "best_of": 2}, "best_of"),
    ],
)
def test_bad_completion_requests_are_400(server, payload, param):
    status, headers, body = post_json(server, "/v1/completions", payload)
    assert_openai_error(status, body, 400, param)
    assert headers["X-Request-Id"]


def test_bad_chat_requests_are_400(server):
    for payload, param in [
        ({"model": "tiny", "messages": "hi"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "function", "content": "x"}]}, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ]:
        status, _, body = post_json(server, "/v1/chat/completions", payload)
        assert_openai_error(status, body, 400, param)


def test_malformed_bodies_are_400(server):
    for body in [b"{", b"", b"[1, 2]", b"null", b"\xff\xfe"]:
        status, _, out = post_json(server, "/v1/chat/completions", body)
        assert_openai_error(status, out, 400)


def test_prompt_too_long_names_both_numbers(client, tiny_llm):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=tiny_llm.max_model_len)
    msg = e.value.body["message"]
    assert str(tiny_llm.max_model_len) in msg and str(len(PROMPT)) in msg
    assert e.value.body["code"] == "context_length_exceeded"


def test_body_over_limit_is_413(server):
    # The server answers from Content-Length alone, before reading the body.
    conn = http_client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(5 << 20))
    conn.endheaders(b'{"prompt": "')
    r = conn.getresponse()
    assert_openai_error(r.status, r.read(), 413)
    conn.close()


def test_cors_is_off_by_default(server):
    _, headers, _ = http(server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers


# --------------------------------------------------------------------------- concurrency, cancellation


def test_32_concurrent_streams_equal_offline_and_free_the_pool(server, tiny_llm):
    prompts = [PROMPT[: 3 + i % 9] + [40 + i] for i in range(32)]
    expected = [greedy(tiny_llm, p, 16) for p in prompts]
    client = server.client()
    got: list[str | None] = [None] * 32

    def run(i: int) -> None:
        stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    server.wait_idle("tiny", timeout=5)


# Long enough to still run when the test acts on it: 16 completions of 450 tokens (the tiny model is fast).
LONG = {"max_tokens": 450, "n": 16, "ignore_eos": True}


def long_stream_request(server, **extra):
    payload = {"model": "tiny", "prompt": "Hello", "temperature": 0, "stream": True, **LONG, **extra}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(req, timeout=60)


def first_data(response) -> dict:
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("stream ended without data")


def aborted(server) -> float:
    return server.metrics()['novainfer:request_success_total{model_name="tiny",finished_reason="abort"}']


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    response = long_stream_request(server)
    first_data(response)
    assert not server.engine_idle("tiny")
    response.close()
    server.wait_idle("tiny", timeout=5)
    assert aborted(server) == before + 1


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "Hello", **LONG}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 10
    while server.engine_idle("tiny"):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    sock.close()
    server.wait_idle("tiny", timeout=5)
    assert aborted(server) == before + 1


def test_cancel_endpoint_aborts_and_frees_blocks(server):
    response = long_stream_request(server)
    chunk = first_data(response)
    status, _, body = http(server, "POST", f"/v1/requests/{chunk['id']}/cancel")
    assert status == 200 and json.loads(body)["cancelled"] is True
    reasons = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    assert reasons[-1] == "abort"
    server.wait_idle("tiny", timeout=5)
    status, _, body = http(server, "POST", f"/v1/requests/{chunk['id']}/cancel")
    assert_openai_error(status, body, 404)


def test_cancel_by_request_id_of_a_non_streaming_request(server, client):
    result = {}

    def run() -> None:
        result["out"] = client.completions.create(model="tiny", prompt="Hello", temperature=0, extra_body=LONG,
                                                  extra_headers={"X-Request-Id": "mine-42"})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while http(server, "POST", "/v1/requests/mine-42/cancel")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t.join(30)
    assert {c.finish_reason for c in result["out"].choices} == {"abort"}
    assert result["out"].usage.completion_tokens < 16 * 450
    server.wait_idle("tiny", timeout=5)


def test_request_timeout_aborts_and_frees_blocks(server, client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="Hello", extra_body={**LONG, "timeout": 0.001})
    assert e.value.status_code == 408
    server.wait_idle("tiny", timeout=5)
    # Streaming: an error event, then [DONE].
    events = [line.decode().strip() for line in long_stream_request(server, timeout=0.001) if line.strip()]
    assert events[-1] == "data: [DONE]" and '"timeout"' in events[-2]
    server.wait_idle("tiny", timeout=5)


def test_keep_alive_comments_while_waiting(tiny_models):
    # One request at a time: the second waits in the queue, receiving keep-alives.
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV,
                        "--max-concurrent-requests", "1", "--keep-alive", "0.05"]) as s:
        first = long_stream_request(s)
        first_data(first)
        second = long_stream_request(s, max_tokens=2, n=1)
        assert second.readline().decode().startswith(":")
        first.close()
        lines = [line.decode().strip() for line in second if line.strip()]
        assert lines[-1] == "data: [DONE]"


def test_cancel_while_queued(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV,
                        "--max-concurrent-requests", "1", "--keep-alive", "0.05"]) as s:
        running = long_stream_request(s)
        first_data(running)
        queued = long_stream_request(s, n=2)
        assert queued.readline().decode().startswith(":")  # waiting for a permit
        request_id = queued.headers["X-Request-Id"]
        status, _, _ = http(s, "POST", f"/v1/requests/{request_id}/cancel")
        assert status == 200
        chunks = [json.loads(line[6:]) for line in (raw.decode().strip() for raw in queued) if line.startswith("data: {")]
        assert sorted((c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks) == [(0, "abort"), (1, "abort")]
        assert chunks[0]["id"] == f"cmpl-{request_id}"
        running.close()
        s.wait_idle("tiny")


def test_queue_overflow_is_429_with_retry_after(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV,
                        "--max-concurrent-requests", "1", "--max-queued-requests", "1"]) as s:
        running = long_stream_request(s)
        first_data(running)
        queued = threading.Thread(target=lambda: s.client().completions.create(model="tiny", prompt="x", max_tokens=2))
        queued.start()
        deadline = time.monotonic() + 10
        while s.metrics()["novainfer:server_requests_queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, headers, body = post_json(s, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        err = assert_openai_error(status, body, 429)
        assert headers["Retry-After"] == "1" and err["code"] == "server_overloaded"
        running.close()
        queued.join(30)
        assert s.metrics()['novainfer:request_rejections_total{reason="server_overloaded"}'] == 1
        s.wait_idle("tiny")


# --------------------------------------------------------------------------- sessions


def test_session_second_turn_reports_cached_tokens(client):
    system = {"role": "system", "content": "You answer questions about the cat and the dog. " * 6}
    first = client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "Hello"}],
                                           max_tokens=8, temperature=0, extra_body={"session_id": "s-1"})
    assert first.usage.prompt_tokens > 32
    second = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "And then?"}],
                                            max_tokens=8, temperature=0, extra_body={"session_id": "s-1"})
    # The stored history (system, user, assistant reply) precedes the new turn ...
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # ... and its KV comes from the prefix cache.
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    # A client that resends the whole history (the Web UI) gets the same prompt, via the header.
    history = [system, {"role": "user", "content": "Hello"},
               {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And then?"}]
    resent = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                            extra_headers={"X-Session-Id": "s-2"})
    assert resent.usage.prompt_tokens == second.usage.prompt_tokens
    assert resent.choices[0].message.content == second.choices[0].message.content


def test_streaming_session_turns(client):
    def turn(text: str):
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"session_id": "stream-1"}))
        return chunks[-1].usage

    first = turn("Tell me about the cat and the dog and the bird and the fish, please, in detail.")
    second = turn("More")
    assert second.prompt_tokens > first.prompt_tokens + first.completion_tokens
    assert second.prompt_tokens_details.cached_tokens > 0


def test_idle_sessions_expire(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV, "--session-ttl", "1"]) as s:
        c = s.client()

        def turn(text: str) -> int:
            out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4,
                                            temperature=0, extra_body={"session_id": "short"})
            return out.usage.prompt_tokens

        alone = turn("Hello")
        assert turn("Hello") > alone  # the first turn is remembered ...
        time.sleep(2.2)
        assert turn("Hello") == alone  # ... until the session has been idle past its TTL


# --------------------------------------------------------------------------- security and budgets


def test_api_key_and_cors_flag(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV,
                        "--api-key", "s3cret", "--cors-allow-origin", "http://ui.example"]) as s:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        status, _, body = http(s, "GET", "/v1/models")
        assert_openai_error(status, body, 401)
        assert [m.id for m in s.client(api_key="s3cret").models.list().data] == ["tiny"]
        assert http(s, "GET", "/health")[0] == 200
        _, headers, _ = http(s, "GET", "/health", headers={"Origin": "http://ui.example"})
        assert headers["Access-Control-Allow-Origin"] == "http://ui.example"


def test_user_token_budget(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV,
                        "--user-token-budget", "30"]) as s:
        c = s.client()
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, user="alice")
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, user="alice")
        assert e.value.body["code"] == "token_budget_exceeded"
        assert int(e.value.response.headers["Retry-After"]) > 0
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, user="bob")


# --------------------------------------------------------------------------- reasoning


def test_reasoning_content_before_think_end(tiny_models, tmp_path):
    # A copy of the tiny model whose template opens <think> (as R1-distill templates do): with no
    # `</think>` in the output, all of it is reasoning.
    model = tmp_path / "tiny-r1"
    shutil.copytree(tiny_models["f32"], model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] += "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"
    cfg_path.write_text(json.dumps(cfg))
    llm = LLM(model)
    messages = [{"role": "user", "content": "hi"}]
    text = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    del llm
    with ServerProcess(["--model", str(model), "--served-model-name", "r1", *KV, "--reasoning-parser", "deepseek_r1"]) as s:
        c = s.client()
        out = c.chat.completions.create(model="r1", messages=messages, max_tokens=12, temperature=0)
        msg = out.choices[0].message
        assert (msg.model_extra or {}).get("reasoning_content") == text and msg.content == ""
        chunks = list(c.chat.completions.create(model="r1", messages=messages, max_tokens=12, temperature=0, stream=True))
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
        assert reasoning == text
        assert all(not c.choices[0].delta.content for c in chunks if c.choices)


# --------------------------------------------------------------------------- web UI


def test_root_serves_html(server):
    status, headers, body = http(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")


# --------------------------------------------------------------------------- entry points and bench


def test_novainfer_serve_cli_passes_arguments_to_the_server():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "novainfer.cli", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--max-concurrent-requests" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "novainfer.cli", "serve", "--model", "x", "--bogus"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--bogus" in bad.stderr


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_stops_the_in_process_server(tiny_models, sig):
    import signal

    s = ServerProcess(["--model", str(tiny_models["f32"]), *KV])
    s.proc.send_signal(getattr(signal, sig))  # at once: no window where the signal is lost
    assert s.proc.wait(15) == 0
    s.stop()


def test_bench_serve_runs(tiny_models, capsys):
    from novainfer.cli import main

    rc = main(["bench", "serve", "--model", str(tiny_models["f32"]), "--num-requests", "6", "--concurrency", "3",
               "--prompt-range", "60", "80", "--output-range", "5", "5", "--server-arg=--kv-cache-bytes=8388608"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "6 requests (errors 0)" in out and "30 output tokens" in out and "TTFT p50/p95/p99" in out


_FAKE_LLAMA_SERVER = """#!{python}
# Stands in for llama.cpp's llama-server: healthy at once, streams max_tokens one-word deltas and a usage
# chunk; a `model: null` (which the real one rejects) is a 400. Its arguments go to args.json.
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

argv = sys.argv[1:]
Path(__file__).with_name("args.json").write_text(json.dumps(argv))

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "model" in body and body["model"] is None:
            self.send_response(400)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for _ in range(n):
            chunk = {{"choices": [{{"index": 0, "delta": {{"content": "x"}}}}]}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
        usage = {{"choices": [], "usage": {{"prompt_tokens": 50, "completion_tokens": n}}}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\\n\\ndata: [DONE]\\n\\n")

ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_bench_serve_runs_the_same_load_against_llama_server(tiny_models, tmp_path, capsys):
    """`--llama-cpp BIN_DIR`: the same payloads go to a llama-server started on the same GGUF with a slot per
    request in flight, and a last line compares the two."""
    import json
    import sys

    from novainfer.cli import main

    fake = tmp_path / "llama-server"
    fake.write_text(_FAKE_LLAMA_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    rc = main(["bench", "serve", "--model", str(tiny_models["gguf"]), "--num-requests", "6", "--concurrency", "3",
               "--prompt-range", "60", "80", "--output-range", "5", "5", "--threads", "1",
               "--llama-cpp", str(tmp_path), "--server-arg=--kv-cache-bytes=8388608"])
    out = capsys.readouterr().out
    assert rc == 0, out
    ours, theirs = out.split("  NovaInfer:")[1].split("  llama-server:")
    assert "6 requests (errors 0)" in ours and "30 output tokens" in ours, out
    assert "6 requests (errors 0)" in theirs and "300 prompt + 30 output tokens" in theirs, out
    assert "NovaInfer / llama-server: output tok/s" in out, out
    argv = json.loads((tmp_path / "args.json").read_text())
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert flag("-m") == str(tiny_models["gguf"]) and flag("-np") == "3" and flag("-ctk") == "f16", argv
    assert flag("-t") == "1" and int(flag("-c")) >= 3 * (80 + 5), argv
