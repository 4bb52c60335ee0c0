"""Property test: malformed and extreme requests never get a 5xx or crash the server, and a well-formed
request still works afterwards."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from server_process import ServerProcess  # noqa: E402

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
FIELDS = ["model", "prompt", "messages", "input", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs", "echo", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "tokens", "session_id", "timeout",
          "encoding_format", "ignore_eos", "stop_token_ids", "user", "dimensions", "bogus"]

extreme_numbers = st.sampled_from([0, -1, 1, 2, 3, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, 0.5, 1e-45])
scalars = st.one_of(st.none(), st.booleans(), extreme_numbers, st.integers(-5, 600), st.floats(allow_nan=False),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]), inner, max_size=3)),
    max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 3]),
                                           "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS), st.one_of(json_values, messages), max_size=6).map(
    lambda d: {**d, "model": d.get("model", "tiny")}
)
raw_bodies = st.one_of(
    bodies.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=60),
    st.sampled_from([b"{", b"[]", b"null", b'{"prompt": "\\ud800"}', b'{"max_tokens": 1e400}', b"\xff"]),
)


@pytest.fixture(scope="module")
def server(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny",
                        "--kv-cache-bytes", str(8 << 20), "--request-timeout", "20"]) as s:
        yield s


def post(server, path: str, body: bytes) -> int:
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ENDPOINTS), body=raw_bodies)
def test_no_request_gets_a_5xx(server, path, body):
    # Keep generations short: huge max_tokens are either rejected or cut by the timeout.
    status = post(server, path, body)
    assert status < 500, (path, body, server.logs()[-2000:])


def test_server_still_works_after_fuzzing(server):
    out = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    server.wait_idle("tiny")
