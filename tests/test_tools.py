"""Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) on the tiny random model.

A random model at temperature 1 calls tools only as the grammar makes it: every `required` or named call must parse
and validate against its tool's schema, for every seed, streamed or not. The real model's behaviour (`auto`, a tool
result turned into an answer) is checked in test_server_real.py.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from novainfer import SamplingParams
from server_process import ServerProcess
from test_server import assert_openai_error, post_json

SEEDS = range(4)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

# Bounded, so a random model's calls end well within max_tokens.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "seconds": {"type": "boolean"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def long_tiny(tiny_models, tmp_path_factory):
    """The tiny model with room for the tools' system prompt (about 750 of its tokens: its vocabulary is small)."""
    out = tmp_path_factory.mktemp("tiny-tools") / "tiny"
    shutil.copytree(tiny_models["f32"], out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(long_tiny):
    with ServerProcess(["--model", str(long_tiny), "--served-model-name", "tiny", "--kv-cache-bytes", str(16 << 20)]) as s:
        yield s


@pytest.fixture(scope="module")
def long_llm(long_tiny):
    from novainfer import LLM

    return LLM(str(long_tiny), kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def reassemble(chunks) -> tuple[str, list[dict], str | None]:
    """A stream's content, its tool calls (by index) and finish reason, as OpenAI clients rebuild them."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    # The first piece of a call names it.
                    assert call.id and call.id.startswith("call_") and call.type == "function", call
                    assert call.function.name, call
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None, call
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def validate(calls: list[dict], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in allowed, call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_validate_streamed_and_not(client, choice):
    allowed = {"get_time"} if isinstance(choice, dict) else set(SCHEMAS)
    for seed in SEEDS:
        args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                    temperature=1.0, seed=seed, max_tokens=80)
        r = client.chat.completions.create(**args)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert finish == "tool_calls", r
        assert not message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        assert len(calls) == 1, "parallel_tool_calls: false allows one call"
        assert calls[0]["id"].startswith("call_") and message.tool_calls[0].type == "function"
        validate(calls, allowed)
        content, streamed, stream_finish = reassemble(client.chat.completions.create(**args, stream=True))
        assert (content, stream_finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]


def test_parallel_calls_each_validate(client):
    finished = 0
    for seed in SEEDS:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=160)
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
        if r.choices[0].finish_reason == "length":
            calls = calls[:-1]  # the last call may be cut short
        else:
            finished += 1
            assert r.choices[0].finish_reason == "tool_calls"
        if calls:
            validate(calls, set(SCHEMAS))
    assert finished > 0


def test_tool_choice_none_shows_tools_but_reads_no_calls(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    none = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens + 50, "the template describes the tools"
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


def reference_render(template: str, messages: list, tools: list) -> str:
    """What vLLM renders: its message preparation parses each call's `arguments` string (the template prints them
    with `tojson`, so a string would reach the model quoted), then jinja2 configured as transformers'
    `apply_chat_template` configures it. llama.cpp's `/apply-template` gives the same for Qwen2.5-Coder's template."""
    import copy

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True)


def test_calls_and_results_are_rendered_by_the_template(server, client, long_llm, long_tiny):
    """The prompt of a tool round trip is, byte for byte, vLLM's (and transformers' given parsed arguments): the
    call's arguments an object in their order, each result in its own `<tool_response>` of one user turn."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"days": 1, "city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22C and sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]
    template = json.loads((long_tiny / "tokenizer_config.json").read_text())["chat_template"]
    expected = reference_render(template, history, TOOLS)
    assert '"arguments": {"days": 1, "city": "Paris"}}\n</tool_call>' in expected
    assert "<tool_response>\n22C and sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>" in expected
    prompt = long_llm.apply_chat_template(history, tools=TOOLS)
    assert prompt == expected
    expected_ids = long_llm.encode(expected, add_special_tokens=False)
    status, _, body = post_json(server, "/tokenize", {"model": "tiny", "messages": history, "tools": TOOLS})
    assert status == 200 and json.loads(body)["tokens"] == expected_ids, "the server renders it the same"
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == len(expected_ids)
    out = long_llm.chat(history, SamplingParams(max_tokens=1), tools=TOOLS)[0]
    assert out.prompt == prompt


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_takes_back_its_tool_call_turn_resent_as_tool_calls(server, client, long_llm, stream):
    """A client that resends the conversation with the assistant's `tool_calls` (as OpenAI clients and the Web
    UI do) continues its session: the prompt is the conversation, not the stored one with the request appended."""
    session = {"session_id": f"tools-{stream}"}
    first = MESSAGES
    if stream:
        chunks = list(client.chat.completions.create(
            model="tiny", messages=first, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200,
            stream=True, extra_body=session))
        _, calls, _ = reassemble(chunks)
    else:
        r = client.chat.completions.create(model="tiny", messages=first, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200, extra_body=session)
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls]
    assert calls
    history = first + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "22C and sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=4, extra_body=session)
    prompt = long_llm.apply_chat_template(history, tools=TOOLS)
    assert r.usage.prompt_tokens == len(long_llm.encode(prompt, add_special_tokens=False))


def test_tokenize_takes_tools_only_with_messages(server):
    """`tools` and `chat_template_kwargs` are template variables: with a raw prompt, or invalid, they are a 400."""
    for body, param in [({"prompt": "hi", "tools": TOOLS}, "tools"),
                        ({"prompt": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
                        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools")]:
        status, _, raw = post_json(server, "/tokenize", {"model": "tiny", **body})
        assert_openai_error(status, raw, 400, param)


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"tools": {"type": "function"}}, "tools", "list"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0]"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "get_weather"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]},
     "tools", "no-such-type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "arguments"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", ""),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param, needle):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    status, _, raw = post_json(server, "/v1/chat/completions", body)
    err = assert_openai_error(status, raw, 400, param)
    assert needle in err["message"], err
    status, _, raw = post_json(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "tools": TOOLS})
    assert_openai_error(status, raw, 400, "tools")
