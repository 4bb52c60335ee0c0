"""Embeddings and prompt scoring run through the scheduler (issue 14, point 3), on the tiny model.

Each embedding input and each scored prompt (`echo` with `logprobs`) is a prefill-only engine request:
chunked by the step's token budget, inside the KV pool, preemptible, and aborted when its client goes
away. Their results must equal the same computation done in one piece, apart from the scheduler.
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np

from conftest import PROMPT, logits_of
from server_process import ServerProcess
from test_server import KV, post_json

#: Ordinary tokens of the tiny vocabulary, 300 of them: ten chunks under a 32-token step budget, and more
#: than one step's worth of scored rows (64).
LONG_PROMPT = (PROMPT * 25)[:300]


def tiny(tiny_models, *extra: str) -> list[str]:
    return ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV, *extra]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))


def embedding(server, inputs) -> list[list[float]]:
    status, _, body = post_json(server, "/v1/embeddings",
                                {"model": "tiny", "input": inputs, "encoding_format": "float"})
    assert status == 200, body
    return [d["embedding"] for d in json.loads(body)["data"]]


def test_a_long_prompt_is_scored_in_chunks_and_equals_token_by_token_logits(tiny_models, tiny_llm):
    with ServerProcess(tiny(tiny_models, "--max-num-batched-tokens", "32")) as server:
        status, _, body = post_json(server, "/v1/completions", {
            "model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 1, "echo": True, "logprobs": 2})
        assert status == 200, body
        lp = json.loads(body)["choices"][0]["logprobs"]
        server.wait_idle("tiny")
    # Reference: token by token apart from the pool, a different path from the scheduled chunks.
    expected = log_softmax(logits_of(tiny_llm, LONG_PROMPT, step_by_step=True))
    got = lp["token_logprobs"][: len(LONG_PROMPT)]
    assert got[0] is None
    np.testing.assert_allclose(got[1:], [expected[i, LONG_PROMPT[i + 1]] for i in range(len(LONG_PROMPT) - 1)],
                               atol=1e-4)
    # Two alternatives each (fewer keys when both decode to the same text: the field is a dict by text).
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1: len(LONG_PROMPT)])
    assert sum(len(top) == 2 for top in lp["top_logprobs"][1: len(LONG_PROMPT)]) > len(LONG_PROMPT) // 2


def test_offline_prompt_logits_equal_token_by_token(tiny_llm):
    # `LLM.prompt_logits` is a scheduled scored prompt too (several chunks for this length).
    one = logits_of(tiny_llm, LONG_PROMPT)
    steps = logits_of(tiny_llm, LONG_PROMPT, step_by_step=True)
    assert one.shape == steps.shape == (len(LONG_PROMPT), one.shape[1])
    np.testing.assert_allclose(one, steps, atol=1e-4)


def test_an_embedding_is_the_same_whatever_the_chunking_and_batching(tiny_models):
    texts = ["hello world " * 40, "short", "hello world " * 3]
    results = []
    for budget in ("2048", "16"):
        with ServerProcess(tiny(tiny_models, "--max-num-batched-tokens", budget)) as server:
            results.append(embedding(server, texts))
            # Alone (no batching with the others): the same vector.
            results.append(embedding(server, texts[:1]) + embedding(server, texts[1:]))
            server.wait_idle("tiny")
    for other in results[1:]:
        np.testing.assert_allclose(np.array(other), np.array(results[0]), atol=1e-5)
    v = np.array(results[0])
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)


def test_an_input_longer_than_max_model_len_is_a_400(tiny_models):
    with ServerProcess(tiny(tiny_models, "--max-model-len", "64")) as server:
        status, _, body = post_json(server, "/v1/embeddings", {"model": "tiny", "input": [PROMPT * 6]})
        err = json.loads(body)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded", body
        # Exactly max_model_len fits an embedding (no room for an output token is needed).
        assert len(embedding(server, [(PROMPT * 6)[:64]])) == 1


def test_a_client_that_leaves_aborts_its_embeddings(tiny_models):
    with ServerProcess(tiny(tiny_models, "--max-num-batched-tokens", "64")) as server:
        # Distinct inputs (no shared prefix to serve from the cache), 256 of them (the most one request takes).
        inputs = [f"{i} " + "hello world " * 60 for i in range(256)]
        status, _, body = post_json(server, "/tokenize", {"model": "tiny", "prompt": inputs[0]})
        assert status == 200, body
        total = 256 * json.loads(body)["count"]
        computed = "novainfer:prompt_tokens_computed_total{model_name=\"tiny\"}"
        before = server.metrics()[computed]
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "tiny", "input": inputs}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while server.engine_idle("tiny"):
            assert time.monotonic() < deadline, "the embeddings never started"
            time.sleep(0.005)
        sock.close()
        server.wait_idle("tiny", timeout=5)
        done = server.metrics()[computed] - before
        assert 0 < done < total / 2, f"{done} of {total} input tokens computed: the rest should have been aborted"
        # The engine goes on serving.
        assert len(embedding(server, ["after"])) == 1
