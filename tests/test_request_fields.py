"""What real clients send to the OpenAI endpoints, field by field (docs/api.md has the table), and the
llama.cpp-compatible `/infill`: implemented fields change the output as documented, true no-ops are accepted
and change nothing, anything else is a 400 naming the field. Tiny random models: outputs are nonsense but exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import PROMPT
from server_process import ServerProcess
from test_server import assert_openai_error, http, post_json
from tiny_qwen2 import fim_token_ids, special_token_ids, write_tiny_model

KV = ["--kv-cache-bytes", str(8 << 20)]
IM_START, IM_END = special_token_ids()["<|im_start|>"], special_token_ids()["<|im_end|>"]
FIM = fim_token_ids()
ORDINARY = 300  # a BPE token of the tiny vocabulary


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-fim") / "fim", fim=True)


@pytest.fixture(scope="module")
def server(tiny_models, fim_model):
    with ServerProcess(
        ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny",
         "--model", str(fim_model), "--served-model-name", "tiny-fim", *KV]
    ) as s:
        yield s


def complete(server, status: int = 200, **fields) -> dict:
    code, _, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, **fields})
    assert code == status, body
    return json.loads(body)


def chat(server, status: int = 200, **fields) -> dict:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **fields}
    code, _, body = post_json(server, "/v1/chat/completions", payload)
    assert code == status, body
    return json.loads(body)


def sse_events(body: bytes) -> list[dict]:
    lines = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
    return [json.loads(line) for line in lines if line != b"[DONE]"]


# --------------------------------------------------------------------------- sampling fields


def test_logit_bias_forces_and_bans_tokens(server, tiny_llm):
    forced = complete(server, temperature=1.0, max_tokens=5, logit_bias={str(ORDINARY): 100}, seed=1)
    assert forced["choices"][0]["text"] == tiny_llm.decode([ORDINARY] * 5)
    plain = complete(server, temperature=0, max_tokens=1, logprobs=0)
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    first_id = tiny_llm.encode(first, add_special_tokens=False)[0]
    banned = complete(server, temperature=0, max_tokens=1, logprobs=0, logit_bias={str(first_id): -100})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    for bias in ({"x": 1}, {"5": 101}, {"99999": 1}, [1]):  # not an id, out of range, not in vocabulary, shape
        code, _, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "logit_bias": bias})
        assert_openai_error(code, body, 400, "logit_bias")


def test_min_tokens_keeps_eos_and_stop_tokens_away(server):
    # EOS forced at once: min_tokens holds it back for exactly that many tokens.
    eos_first = {str(IM_END): 100}
    assert complete(server, max_tokens=8, logit_bias=eos_first)["usage"]["completion_tokens"] == 1
    out = complete(server, max_tokens=8, min_tokens=3, logit_bias=eos_first, temperature=0)
    assert out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["stop_reason"] is None
    stop_first = {str(ORDINARY): 100}
    out = complete(server, max_tokens=8, min_tokens=2, stop_token_ids=[ORDINARY], logit_bias=stop_first)
    assert out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["stop_reason"] == ORDINARY
    code, _, body = post_json(server, "/v1/completions",
                              {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "min_tokens": 3})
    assert_openai_error(code, body, 400, "min_tokens")


def test_stop_reason_and_include_stop_str_in_output(server):
    text = complete(server, temperature=0, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    stop = text[3:5]
    cut = complete(server, temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])["choices"][0]
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"]) == (text[: text.index(stop)], "stop", stop)
    kept = complete(server, temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                    include_stop_str_in_output=True)["choices"][0]
    assert (kept["text"], kept["stop_reason"]) == (text[: text.index(stop) + len(stop)], stop)
    length = complete(server, temperature=0, max_tokens=3)["choices"][0]
    assert length["finish_reason"] == "length" and length["stop_reason"] is None
    # Streams carry it on the choice's last chunk, chat too.
    code, _, body = post_json(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 8,
        "logit_bias": {str(ORDINARY): 100}, "stop_token_ids": [ORDINARY]})
    assert code == 200
    last = [e for e in sse_events(body) if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert last["choices"][0]["stop_reason"] == ORDINARY


def test_special_tokens_in_the_text_when_asked(server):
    forced = {"max_tokens": 2, "logit_bias": {str(IM_START): 100}}
    assert complete(server, **forced)["choices"][0]["text"] == ""
    assert complete(server, skip_special_tokens=False, **forced)["choices"][0]["text"] == (
        "<|im_start|> <|im_start|>")
    assert complete(server, skip_special_tokens=False, spaces_between_special_tokens=False,
                    **forced)["choices"][0]["text"] == "<|im_start|><|im_start|>"


# --------------------------------------------------------------------------- chat fields


def test_chat_template_options(server, tiny_llm):
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cap"}]
    continued = tiny_llm.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nthe cap")
    out = chat(server, messages=convo, add_generation_prompt=False, continue_final_message=True, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(tiny_llm.encode(continued, add_special_tokens=False))
    no_gen = tiny_llm.apply_chat_template(convo[:1], add_generation_prompt=False)
    out = chat(server, messages=convo[:1], add_generation_prompt=False, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(tiny_llm.encode(no_gen, add_special_tokens=False))
    chat(server, 400, messages=convo, continue_final_message=True)  # needs add_generation_prompt: false
    # Template variables reach the template (this one overrides the template's own switch).
    out = chat(server, messages=convo[:1], chat_template_kwargs={"add_generation_prompt": False}, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(tiny_llm.encode(no_gen, add_special_tokens=False))
    chat(server, 400, chat_template_kwargs=[1])


def test_text_parts_are_joined_with_newlines(server, tiny_llm):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    out = chat(server, messages=[{"role": "user", "content": parts}], max_tokens=1)
    want = tiny_llm.apply_chat_template([{"role": "user", "content": "a\nb"}])
    assert out["usage"]["prompt_tokens"] == len(tiny_llm.encode(want, add_special_tokens=False))


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(server, tiny_llm):
    first, _ = tiny_llm.encode("ž", add_special_tokens=False)  # one byte token each: 0xC5, 0xBE
    out = chat(server, max_tokens=1, logprobs=True, top_logprobs=1, logit_bias={str(first): 100})
    (entry,) = out["choices"][0]["logprobs"]["content"]
    assert entry["bytes"] == [0xC5], "half a character: its byte, not U+FFFD's"
    assert entry["token"] == "\ufffd"


# --------------------------------------------------------------------------- accepted, refused


def test_true_no_ops_are_accepted_and_change_nothing(server):
    base = complete(server, temperature=0, max_tokens=6)["choices"][0]["text"]
    noops = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u"}
    assert complete(server, temperature=0, max_tokens=6, **noops)["choices"][0]["text"] == base
    base_chat = chat(server, temperature=0, max_tokens=6)["choices"][0]["message"]["content"]
    out = chat(server, temperature=0, max_tokens=6, tools=[], tool_choice="none", **noops)
    assert out["choices"][0]["message"]["content"] == base_chat


@pytest.mark.parametrize("field,value", [
    ("bogus_field", 1), ("use_beam_search", True), ("best_of", 2), ("prompt_logprobs", 1),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
def test_other_fields_are_refused_by_name(server, field, value):
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": PROMPT}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})):
        code, _, resp = post_json(server, path, {**body, field: value})
        assert_openai_error(code, resp, 400, field)


# --------------------------------------------------------------------------- fill in the middle


def test_suffix_builds_the_models_fim_prompt(server):
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    raw = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    args = {"model": "tiny-fim", "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    via_suffix = complete(server, prompt=prefix, suffix=suffix, **args)
    via_raw = complete(server, prompt=raw, **args)
    assert via_suffix["choices"][0]["text"] == via_raw["choices"][0]["text"]
    assert via_suffix["usage"]["prompt_tokens"] == via_raw["usage"]["prompt_tokens"]
    for body, why in (({"model": "tiny", "prompt": "x", "suffix": "y"}, "no FIM tokens"),
                      ({"model": "tiny-fim", "prompt": [1, 2], "suffix": "y"}, "token-id prompt"),
                      ({"model": "tiny-fim", "prompt": "x", "suffix": "y", "echo": True}, "echo")):
        code, _, resp = post_json(server, "/v1/completions", body)
        err = assert_openai_error(code, resp, 400, "suffix")
        assert why != "no FIM tokens" or "fim_prefix" in err["message"]


def infill(server, status: int = 200, **fields):
    code, headers, body = post_json(server, "/infill", {"model": "tiny-fim", **fields})
    assert code == status, body
    return headers, body


def test_infill_answers_like_llama_cpp(server):
    extra = [{"filename": "util.py", "text": "def two():\n    return 2\n"}]
    request = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "input_extra": extra, "prompt": "ret",
               "n_predict": 6, "temperature": 0, "ignore_eos": True, "cache_prompt": True, "samplers": ["top_k"],
               "t_max_prompt_ms": 500, "return_tokens": True}
    _, body = infill(server, **request)
    out = json.loads(body)
    raw = ("<|repo_name|>myproject\n<|file_sep|>util.py\ndef two():\n    return 2\n"
           "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n<|fim_middle|>ret")
    same = complete(server, model="tiny-fim", prompt=raw, temperature=0, max_tokens=6, ignore_eos=True,
                    top_k=40, top_p=0.95, min_p=0.05, stop_token_ids=list(FIM.values()))
    assert out["content"] == same["choices"][0]["text"]
    assert out["stop"] is True and out["stop_type"] in ("limit", "eos")
    assert out["tokens_predicted"] == len(out["tokens"]) == same["usage"]["completion_tokens"]
    assert out["tokens_evaluated"] == same["usage"]["prompt_tokens"]
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_per_second"} <= set(out["timings"])
    assert out["truncated"] is False and out["generation_settings"]["n_predict"] == 6

    # Streamed: chunks with `stop: false`, then the final object; no [DONE], as llama.cpp sends none.
    headers, body = infill(server, **request, stream=True)
    assert headers["content-type"].startswith("text/event-stream") and b"[DONE]" not in body
    events = sse_events(body)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == out["content"]

    # llama.vim's response_fields: nested ones flattened under their path.
    _, body = infill(server, **request, response_fields=["content", "timings/predicted_n", "nope"])
    assert json.loads(body) == {"content": out["content"], "timings/predicted_n": out["timings"]["predicted_n"]}


def indent_cut(text: str, n: int) -> str:
    """llama.cpp's n_indent on a finished text: cut before the first character (not space or tab) of a line
    after the first whose indentation is under `n`."""
    at_line_start, indent = False, 0
    for i, c in enumerate(text):
        if at_line_start:
            if c in " \t":
                indent += 1
                continue
            if indent < n:
                return text[:i]
            at_line_start = False
        if c == "\n":
            at_line_start, indent = True, 0
    return text


def test_infill_limits_and_refusals(server):
    common = {"input_prefix": "a", "input_suffix": "b", "temperature": 0, "ignore_eos": True}
    free = json.loads(infill(server, **common, n_predict=40)[1])["content"]
    limited = json.loads(infill(server, **common, n_predict=40, n_indent=4)[1])
    assert limited["content"] == indent_cut(free, 4)
    assert limited["stop_type"] == ("limit" if limited["content"] != free else json.loads(
        infill(server, **common, n_predict=40)[1])["stop_type"])
    for field, value in (("n_probs", 3), ("mirostat", 2), ("n_predict", 0), ("n_indent", -1)):
        _, body = infill(server, 400, **common, **{field: value})
        assert json.loads(body)["error"]["param"] == field
    code, _, body = post_json(server, "/infill", {"model": "tiny", **common})
    assert_openai_error(code, body, 400)
    code, _, _ = http(server, "GET", "/infill")
    assert code == 405


# --------------------------------------------------------------------------- the table in docs/api.md

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"
#: A value each no-op field is sent with.
NO_OP_VALUES = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto",
                # Sent by vllm-router on every request, at the one value that changes nothing.
                "include_reasoning": True, "no_stop_trim": False, "return_hidden_states": False,
                "separate_reasoning": True, "stream_reasoning": True}


def field_table() -> list[tuple[str, str, str]]:
    """(field, where, what NovaInfer does) for each field of the 'Every request field' table."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("### Every request field", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        for field in re.findall(r"`([a-z_]+)`", cells[0]):
            rows.append((field, cells[1], cells[3]))
    return rows


def test_the_field_table_is_what_the_server_does(server):
    rows = field_table()
    assert len(rows) > 80 and {w for _, w, _ in rows} == {"both", "chat", "completions"}
    bodies = {"completions": ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}),
              "chat": ("/v1/chat/completions",
                       {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})}
    checked = 0
    for field, where, does in rows:
        endpoints = ["completions", "chat"] if where == "both" else [where]
        for endpoint in endpoints:
            path, body = bodies[endpoint]
            if does.startswith("400"):
                code, _, resp = post_json(server, path, {**body, field: True})
                assert_openai_error(code, resp, 400, field)
                checked += 1
            elif does.startswith("no-op"):
                code, _, resp = post_json(server, path, {**body, field: NO_OP_VALUES[field]})
                assert code == 200, (field, resp)
                checked += 1
            else:
                assert does.startswith("implemented"), (field, does)
    assert checked > 50
