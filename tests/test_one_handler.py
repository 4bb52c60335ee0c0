"""One handler behind the five generation APIs: a limit broken through any of them is refused by the same check, so
the same status and the same message (under each API's own field name) come back from chat completions,
completions, `/infill`, Responses and Anthropic Messages. Each API's body is only parsed its own way; the checks are
shared (`routes/generate.rs` in the server)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from server_process import ServerProcess
from tiny_qwen2 import write_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # FIM tokens, so /infill serves it too; a short context, so a long max_tokens overflows it.
    model = write_tiny_model(tmp_path_factory.mktemp("one-handler") / "fim", fim=True)
    with ServerProcess(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256"]) as s:
        yield s


# Each API's body with `tokens` as its maximum output and `extra` sampling fields (in chat's names, renamed below).
def bodies(tokens: int | None, **extra) -> dict[str, tuple[str, dict]]:
    def named(renames: dict[str, str]) -> dict:
        out = {renames.get(k, k): v for k, v in extra.items()}
        if tokens is not None:
            out[renames.get("max_tokens", "max_tokens")] = tokens
        return out

    chat = [{"role": "user", "content": "Hello"}]
    return {
        "chat": ("/v1/chat/completions", {"model": "tiny", "messages": chat, **named({})}),
        "completions": ("/v1/completions", {"model": "tiny", "prompt": "Hello", **named({})}),
        "infill": ("/infill", {"input_prefix": "def f(", "input_suffix": ")\n",
                               **named({"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"})}),
        "responses": ("/v1/responses", {"model": "tiny", "input": "Hello",
                                        **named({"max_tokens": "max_output_tokens"})}),
        "messages": ("/v1/messages", {"model": "tiny", "messages": chat,
                                      **named({"max_tokens": "max_tokens"})}),
    }


# The field each API names in its errors, for chat's name.
FIELD = {
    "infill": {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"},
    "responses": {"max_tokens": "max_output_tokens"},
}


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refusal(server, api: str, path: str, body: dict, field: str) -> tuple[int, str | None, str]:
    """Status, error code and message, with the API's name for `field` put back to chat's and numbers masked (the
    prompts differ in length), so the five can be compared."""
    status, out = post(server, path, body)
    error = out["error"]
    name = FIELD.get(api, {}).get(field, field)
    message = error["message"]
    if api == "messages":
        # Anthropic's shape: {type: "error", error: {type, message}}, the field named first in the message.
        assert out["type"] == "error" and error["type"] == "invalid_request_error", out
        message = message.removeprefix(f"{name}: ")
        code = None
    else:
        assert error["type"] == "invalid_request_error", out
        assert error["param"] == name, out
        code = error.get("code")
    # The message names the field as this API does: put chat's name back to compare.
    assert name in message, out
    message = re.sub(rf"\b{name}\b", field, message)
    return status, code, re.sub(r"\d+(\.\d+)?", "N", message)


@pytest.mark.parametrize("field, tokens, extra", [
    ("max_tokens", 100_000, {}),  # more than the context holds
    ("temperature", 8, {"temperature": -1.0}),
    ("top_p", 8, {"top_p": 1.5}),
    ("repetition_penalty", 8, {"repetition_penalty": 0.0}),
])
def test_a_limit_broken_through_any_api_gets_the_same_answer(server, field, tokens, extra):
    apis = bodies(tokens, **extra)
    if field == "repetition_penalty":
        # Only chat, completions and /infill carry it (Responses and Messages have no such field).
        apis = {k: v for k, v in apis.items() if k in ("chat", "completions", "infill")}
    answers = {api: refusal(server, api, path, body, field) for api, (path, body) in apis.items()}
    statuses = {a[0] for a in answers.values()}
    assert statuses == {400}, answers
    openai_codes = {a[1] for api, a in answers.items() if api != "messages"}
    assert len(openai_codes) == 1, answers
    messages = {a[2] for a in answers.values()}
    assert len(messages) == 1, answers
    assert field in messages.pop()


def test_every_api_still_generates(server):
    for api, (path, body) in bodies(4).items():
        status, out = post(server, path, body)
        assert status == 200, (api, out)
