"""The APIs agents speak: OpenAI's Responses (`/v1/responses`) and Anthropic's Messages (`/v1/messages`), driven by
the official `openai` and `anthropic` clients.

On the 0.5B demo model (slow): text, a function-call round trip, a `previous_response_id` follow-up served from the
prefix cache, the typed stream events in order, Anthropic's create / stream / tool-use round trip / count_tokens,
and a client that disconnects freeing its KV blocks on both routes. On the tiny model with API keys: `x-api-key`,
Anthropic's error shape, and stored responses scoped to their key. Kept few and short: CI runs them on 2 cores.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from server_process import ServerProcess

MODEL = "qwen2.5-coder-0.5b"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
# Greedy, the 0.5B coder model repeats its call after a bare tool result, so the user asks for the answer in words.
FOLLOW_UP = "So, what is the weather in Paris? Answer in words."


@pytest.fixture(scope="module")
def server():
    from novainfer.fetch import fetch_model

    fetch_model(MODEL, progress=False)
    with ServerProcess(["--model", MODEL, "--device", "cpu", "--kv-cache-bytes", str(256 << 20)]) as s:
        yield s


@pytest.fixture(scope="module")
def anthropic_client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def function_tool() -> dict:
    return {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": WEATHER, "strict": None}


@pytest.mark.slow
def test_responses_text_then_a_follow_up_served_from_the_cache(server):
    client = server.client()
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert first.id.startswith("resp_") and first.status == "completed"
    assert "Paris" in first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Italy?",
                                     max_output_tokens=24, temperature=0)
    assert "Rome" in second.output_text
    assert second.previous_response_id == first.id
    # The second prompt repeats the first turn: its tokens come from the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    # Stored: retrievable, then deleted.
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    import openai

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="x", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.slow
def test_responses_function_call_round_trip(server):
    client = server.client()
    question = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    first = client.responses.create(model=MODEL, input=question, tools=[function_tool()], tool_choice="required",
                                    temperature=0, max_output_tokens=40)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert "Paris" in json.loads(call.arguments)["city"]
    # The client sends the conversation back with the call's output, as the Agents SDK does.
    follow_up = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees Celsius, sunny"},
        {"role": "user", "content": FOLLOW_UP},
    ]
    second = client.responses.create(model=MODEL, input=follow_up, tools=[function_tool()], temperature=0,
                                     max_output_tokens=40)
    assert not [item for item in second.output if item.type == "function_call"]
    assert "22" in second.output_text and "sunny" in second.output_text
    # As Codex sends it: only the call's output (and the question), the rest kept by the server, whose prompt then
    # starts with the first turn's tokens.
    third = client.responses.create(model=MODEL, previous_response_id=first.id, input=follow_up[-2:],
                                    tools=[function_tool()], temperature=0, max_output_tokens=40)
    assert "22" in third.output_text and "sunny" in third.output_text
    assert third.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16, third.usage


@pytest.mark.slow
def test_responses_stream_sends_the_typed_events_in_order(server):
    client = server.client()
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in text and final.output_text == text and final.status == "completed"
    # A forced call streams as a function_call item with its arguments.
    with client.responses.stream(model=MODEL, input="What's the weather like in Paris right now?",
                                 tools=[function_tool()], tool_choice="required", temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = final.output
    assert call.arguments == arguments and "Paris" in json.loads(arguments)["city"]


@pytest.mark.slow
def test_structured_outputs_parse_into_pydantic_objects(server, anthropic_client):
    """`text.format` (Responses) and `output_config.format` (Messages) go through the structured-output path: the
    clients' `parse` helpers get valid objects."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    ask = "Give the capital of France as JSON."
    r = server.client().responses.parse(model=MODEL, input=ask, text_format=City, temperature=0, max_output_tokens=40)
    assert r.status == "completed" and r.output_parsed.name == "Paris"
    m = anthropic_client.messages.parse(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": ask}],
                                        output_format=City, extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn" and m.parsed_output.name == "Paris"


@pytest.mark.slow
def test_messages_create_stop_sequences_and_count_tokens(anthropic_client):
    messages = [{"role": "user", "content": QUESTION}]
    r = anthropic_client.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body={"temperature": 0})
    assert r.type == "message" and r.role == "assistant" and r.stop_reason == "end_turn"
    assert "Paris" in r.content[0].text
    prompt_tokens = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    assert anthropic_client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == prompt_tokens
    r = anthropic_client.messages.create(model=MODEL, max_tokens=24, messages=messages, stop_sequences=["Paris"],
                                         extra_body={"temperature": 0})
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in r.content[0].text


@pytest.mark.slow
def test_messages_stream_text(anthropic_client):
    messages = [{"role": "user", "content": QUESTION}]
    with anthropic_client.messages.stream(model=MODEL, max_tokens=24, messages=messages,
                                          extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if not e.type.endswith(("text", "input_json"))]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "Paris" in final.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


@pytest.mark.slow
def test_messages_stream_tool_use_round_trip(anthropic_client):
    tools = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER}]
    messages = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    with anthropic_client.messages.stream(model=MODEL, max_tokens=40, messages=messages, tools=tools,
                                          tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and "Paris" in use.input["city"]
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees Celsius, sunny"},
            {"type": "text", "text": FOLLOW_UP},
        ]},
    ]
    with anthropic_client.messages.stream(model=MODEL, max_tokens=40, messages=messages, tools=tools,
                                          extra_body={"temperature": 0}) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason == "end_turn"
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert "22" in text and "sunny" in text


@pytest.mark.slow
def test_messages_errors_have_anthropics_shape(anthropic_client):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, max_tokens=8,
                                         messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages" in e.value.body["error"]["message"]


def aborted(server, endpoint: str) -> float:
    return server.metrics()[f'novainfer:endpoint_requests_total{{endpoint="{endpoint}",finished_reason="abort"}}']


LONG = "Count from 1 to 500, one number per line."
BODIES = {
    "responses": {"model": MODEL, "input": LONG, "max_output_tokens": 400, "temperature": 0},
    "messages": {"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": LONG}],
                 "temperature": 0},
}


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_a_disconnected_stream_frees_its_kv_blocks(server, endpoint):
    before = aborted(server, endpoint)
    req = urllib.request.Request(f"{server.url}/v1/{endpoint}", data=json.dumps({**BODIES[endpoint], "stream": True})
                                 .encode(), headers={"Content-Type": "application/json"}, method="POST")
    response = urllib.request.urlopen(req, timeout=60)
    for raw in response:
        if raw.startswith(b"data: ") and b"delta" in raw:
            break
    assert not server.engine_idle(MODEL)
    response.close()
    server.wait_idle(MODEL, timeout=10)
    assert aborted(server, endpoint) == before + 1


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_a_disconnected_request_frees_its_kv_blocks(server, endpoint):
    before = aborted(server, endpoint)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(BODIES[endpoint]).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/{endpoint} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while server.engine_idle(MODEL):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    server.wait_idle(MODEL, timeout=10)
    assert aborted(server, endpoint) == before + 1


@pytest.fixture(scope="module")
def keyed(tiny_models):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny",
                        "--api-key", "key-a,key-b"]) as s:
        yield s


def post(server, path: str, body: dict, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_x_api_key_and_anthropic_error_shape(keyed):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
    status, out = post(keyed, "/v1/messages", body, {"x-api-key": "key-a"})
    assert status == 200 and out["type"] == "message" and out["usage"]["output_tokens"] > 0
    status, out = post(keyed, "/v1/messages", body, {"x-api-key": "wrong"})
    assert status == 401 and out["type"] == "error" and out["error"]["type"] == "authentication_error"
    status, out = post(keyed, "/v1/messages", {**body, "max_tokens": 0}, {"Authorization": "Bearer key-a"})
    assert status == 400 and out["error"]["type"] == "invalid_request_error" and "max_tokens" in out["error"]["message"]
    # The Responses route keeps OpenAI's shape.
    status, out = post(keyed, "/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 0},
                       {"x-api-key": "key-a"})
    assert status == 400 and out["error"]["param"] == "max_output_tokens"


def test_stored_responses_belong_to_their_key(keyed):
    import openai

    a = openai.OpenAI(base_url=keyed.base_url, api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=keyed.base_url, api_key="key-b", max_retries=0)
    first = a.responses.create(model="tiny", input="Hello", max_output_tokens=4)
    assert a.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        b.responses.create(model="tiny", previous_response_id=first.id, input="more", max_output_tokens=4)
    second = a.responses.create(model="tiny", previous_response_id=first.id, input="more", max_output_tokens=4)
    assert second.usage.input_tokens > first.usage.input_tokens


# --------------------------------------------------------------------------- the tables in docs/api.md

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"
#: A value each no-op field is sent with.
NO_OP_VALUES = {
    "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
    "stream_options": {"include_obfuscation": False}, "prompt_cache_key": "k", "safety_identifier": "s",
    "service_tier": "auto", "thinking": {"type": "enabled", "budget_tokens": 1024},
    "cache_control": {"type": "ephemeral"},
}


def field_table(heading: str) -> dict[str, str]:
    """Field → what NovaInfer does with it, from the table under `heading`."""
    section = DOCS.read_text(encoding="utf-8").split(heading, 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for field in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[field] = cells[1]
    return rows


@pytest.mark.parametrize(("heading", "path", "body", "client_fields"), [
    ("### `POST /v1/responses`", "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 1},
     "openai.types.responses.response_create_params:ResponseCreateParamsBase"),
    ("### `POST /v1/messages`", "/v1/messages",
     {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hello"}]},
     "anthropic.types.message_create_params:MessageCreateParamsBase"),
])
def test_every_field_of_the_client_is_documented_and_does_what_the_table_says(keyed, heading, path, body,
                                                                                client_fields):
    import importlib

    table = field_table(heading)
    module, name = client_fields.split(":")
    params = getattr(importlib.import_module(module), name)
    missing = set(params.__annotations__) - set(table)
    assert not missing, f"{sorted(missing)} of the client's {name} are not in docs/api.md's table"
    for field, what in table.items():
        if what.startswith("400"):
            status, out = post(keyed, path, {**body, field: 1}, {"x-api-key": "key-a"})
            error = out["error"]
            assert status == 400, (field, out)
            assert error.get("param", field) == field or error["message"].startswith(field), (field, out)
        elif what.startswith("no-op"):
            status, out = post(keyed, path, {**body, field: NO_OP_VALUES[field]}, {"x-api-key": "key-a"})
            assert status == 200, (field, out)


def test_reasoning_comes_back_as_reasoning_items_and_thinking_blocks(tiny_models, tmp_path):
    """A copy of the tiny model whose template opens <think> (as R1-distill templates do): with no `</think>` in the
    output, all of it is reasoning, returned as chat's `reasoning_content` says."""
    import shutil

    model = tmp_path / "tiny-r1"
    shutil.copytree(tiny_models["f32"], model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] += "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"
    cfg_path.write_text(json.dumps(cfg))
    with ServerProcess(["--model", str(model), "--served-model-name", "r1", "--reasoning-parser", "deepseek_r1"]) as s:
        c = s.client()
        chat = c.chat.completions.create(model="r1", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                         temperature=0)
        text = chat.choices[0].message.model_extra["reasoning_content"]
        assert text
        r = c.responses.create(model="r1", input="hi", max_output_tokens=12, temperature=0)
        (item,) = r.output
        assert item.type == "reasoning" and item.content[0].text == text and r.status == "incomplete"
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        with c.responses.stream(model="r1", input="hi", max_output_tokens=12, temperature=0) as stream:
            events = list(stream)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
        assert events[-1].type == "response.incomplete"
        status, out = post(s, "/v1/messages", {"model": "r1", "max_tokens": 12, "temperature": 0,
                                               "messages": [{"role": "user", "content": "hi"}]}, {})
        assert status == 200 and out["stop_reason"] == "max_tokens"
        assert out["content"] == [{"type": "thinking", "thinking": text, "signature": ""}]
