"""The public Python API: shapes of results, batching, streaming, chat, and the GIL being released."""

from __future__ import annotations

import threading
import time

import novainfer
from conftest import PROMPT
from novainfer import LLM, CompletionOutput, RequestOutput, SamplingParams, StreamDelta

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_public_names():
    for name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta", "NovaInferError"):
        assert name in novainfer.__all__ and getattr(novainfer, name).__doc__


def test_generate_mixes_text_and_token_prompts_in_order(tiny_llm):
    text = "hello the capital"
    outs = tiny_llm.generate([text, PROMPT], [GREEDY, SamplingParams(temperature=0, max_tokens=5)])
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    assert outs[0].prompt == text and outs[0].prompt_token_ids == tiny_llm.encode(text)
    assert outs[1].prompt is None and outs[1].prompt_token_ids == PROMPT
    assert isinstance(outs[0].outputs[0], CompletionOutput)
    assert len(outs[0].outputs[0].token_ids) == 12 and len(outs[1].outputs[0].token_ids) == 5
    alone = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert alone.token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text == tiny_llm.decode(outs[0].outputs[0].token_ids)


def test_stream_equals_generate(tiny_llm):
    full = tiny_llm.generate(PROMPT, GREEDY)[0].outputs[0]
    deltas = list(tiny_llm.generate_stream(PROMPT, GREEDY))
    assert all(isinstance(d, StreamDelta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_breaking_out_of_a_stream_aborts_it_and_the_engine_goes_on(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = tiny_llm.generate_stream(PROMPT, params)
    first = next(stream)
    assert first.token_ids
    stream.close()
    assert list(stream) == [], "a closed stream yields nothing more"
    after = tiny_llm.generate(PROMPT, GREEDY)[0].outputs[0]
    assert len(after.token_ids) == 12 and after.finish_reason == "length"


def test_chat_uses_the_template_and_accepts_several_conversations(tiny_llm):
    conversation = [{"role": "user", "content": "hello"}]
    prompt = tiny_llm.apply_chat_template(conversation)
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    one = tiny_llm.chat(conversation, GREEDY)
    assert one[0].prompt == prompt
    assert one[0].prompt_token_ids == tiny_llm.encode(prompt, add_special_tokens=False)
    two = tiny_llm.chat([conversation, conversation + [{"role": "assistant", "content": "hi"}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    streamed = "".join(d.text for d in tiny_llm.chat_stream(conversation, GREEDY))
    assert streamed == one[0].outputs[0].text
    # Tools reach the template when streaming too.
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools = tiny_llm.chat(conversation, GREEDY, tools=tools)[0]
    assert "lookup" in with_tools.prompt and with_tools.prompt != prompt
    streamed = "".join(d.text for d in tiny_llm.chat_stream(conversation, GREEDY, tools=tools))
    assert streamed == with_tools.outputs[0].text


def test_encode_decode_round_trip(tiny_llm):
    text = "Paris is the capital of France. 123 héllo"
    ids = tiny_llm.encode(text)
    assert tiny_llm.decode(ids) == text
    assert tiny_llm.encode("<|im_end|>", add_special_tokens=False) == [447]


def test_generate_releases_the_gil(tiny_llm):
    ticks = 0
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        start = time.perf_counter()
        tiny_llm.generate([PROMPT] * 4, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        elapsed = time.perf_counter() - start
    finally:
        done.set()
        counter.join()
    # A Python thread starved by a held GIL would tick only at the 5 ms switch interval.
    assert ticks > 20_000 * max(elapsed, 0.01), (ticks, elapsed)
