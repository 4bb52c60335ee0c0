"""The server on the 0.5B demo model (fetched and cached by novainfer.fetch): a few short end-to-end checks.

Kept few and short: CI runs them on 2 cores.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from novainfer import LLM, SamplingParams
from novainfer.fetch import fetch_model
from server_process import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def demo_gguf():
    return fetch_model("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="module")
def server(demo_gguf):
    # By demo name: the server finds the cached file itself.
    # On the CPU, like the offline engine it is compared with (`auto` would pick a GPU where there is one).
    with ServerProcess(["--model", "qwen2.5-coder-0.5b", "--device", "cpu", "--kv-cache-bytes", str(256 << 20)]) as s:
        yield s


def test_chat_answers_paris_streaming_and_not(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["qwen2.5-coder-0.5b"]
    out = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=QUESTION, max_tokens=24,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content


def test_concurrent_greedy_streams_equal_offline(server, demo_gguf):
    questions = [[{"role": "user", "content": f"Write the number {i} in words."}] for i in range(6)]
    llm = LLM(demo_gguf, device="cpu", kv_cache_bytes=64 << 20)
    expected = [o.outputs[0].text for o in llm.chat(questions, SamplingParams(temperature=0, max_tokens=12))]
    del llm
    client = server.client()
    got: list[str | None] = [None] * len(questions)

    def run(i: int) -> None:
        stream = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=questions[i], max_tokens=12,
                                                temperature=0, stream=True)
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == expected
    server.wait_idle("qwen2.5-coder-0.5b")


def test_session_follow_up_reuses_the_prefix_cache(server):
    client = server.client()
    first = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=QUESTION, max_tokens=16,
                                           temperature=0, extra_body={"session_id": "real-1"})
    second = client.chat.completions.create(model="qwen2.5-coder-0.5b",
                                            messages=[{"role": "user", "content": "And of Italy?"}], max_tokens=16,
                                            temperature=0, extra_body={"session_id": "real-1"})
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert "Rome" in second.choices[0].message.content


def test_fill_in_the_middle_by_suffix_and_by_infill(server):
    """Qwen2.5-Coder's FIM: `suffix` gives what the raw FIM prompt gives, and llama.cpp's `/infill` streams."""
    prefix, suffix = "def fibonacci(n):\n    ", "\n\nprint(fibonacci(10))\n"
    raw = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    client = server.client()
    args = dict(model="qwen2.5-coder-0.5b", max_tokens=24, temperature=0)
    by_suffix = client.completions.create(prompt=prefix, suffix=suffix, **args)
    by_raw = client.completions.create(prompt=raw, **args)
    assert by_suffix.choices[0].text == by_raw.choices[0].text
    assert by_suffix.usage.prompt_tokens == by_raw.usage.prompt_tokens
    assert "fibonacci" in by_suffix.choices[0].text or "return" in by_suffix.choices[0].text

    body = json.dumps({"input_prefix": prefix, "input_suffix": suffix, "n_predict": 24, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(server.url + "/infill", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert len(events) > 2 and all(not e["stop"] for e in events[:-1]) and events[-1]["stop"]
    streamed = "".join(e["content"] for e in events)
    # The greedy middle of llama.cpp's repo-level prompt (which always names the repo), ended where llama.cpp
    # ends it (EOS or a FIM token) or at n_predict.
    repo_level = client.completions.create(prompt="<|repo_name|>myproject\n" + raw, **args).choices[0].text
    assert streamed and repo_level.startswith(streamed)
def test_openai_parse_returns_a_pydantic_object(server):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population_millions: float

    client = server.client()
    r = client.beta.chat.completions.parse(
        model="qwen2.5-coder-0.5b",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert "Paris" in choice.message.parsed.name


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                                   "parameters": WEATHER}}]
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_validate_streamed_and_not(server, choice):
    """The 0.5B model calls the tool (under `auto` it writes the call's JSON without tags, which counts as a call)
    with arguments valid against the schema; the stream reassembles into the same call."""
    import jsonschema

    from test_tools import reassemble

    client = server.client()
    args = dict(model="qwen2.5-coder-0.5b", messages=WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice=choice,
                temperature=0, max_tokens=40)
    r = client.chat.completions.create(**args)
    assert r.choices[0].finish_reason == "tool_calls", r
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "Paris" in arguments["city"]
    content, streamed, finish = reassemble(client.chat.completions.create(**args, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]


# Without it the 0.5B model writes its call again after a result, even with no `tools` (docs/api.md, tool calling).
ANSWER_FROM_RESULTS = ("You are a helpful assistant. When a tool result is given, answer the user's question from it "
                       "in one sentence.")


def test_a_tool_result_gets_a_final_answer(server):
    """The round trip as an OpenAI client makes it: the model calls the tool, the client sends that assistant message
    back as it got it with the tool's result, and the model answers from the result. The follow-up leaves `tools`
    out: with them, the 0.5B coder model calls the tool again after any result, whatever the system prompt, as it
    does on llama.cpp with the same prompt (docs/api.md, tool calling)."""
    client = server.client()
    messages = [{"role": "system", "content": ANSWER_FROM_RESULTS}, *WEATHER_QUESTION]
    first = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, tools=WEATHER_TOOLS,
                                           temperature=0, max_tokens=40)
    assert first.choices[0].finish_reason == "tool_calls", first
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "Paris" in json.loads(call.function.arguments)["city"]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "22 degrees Celsius, sunny"}]
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, r
    assert "22" in choice.message.content and "sunny" in choice.message.content
