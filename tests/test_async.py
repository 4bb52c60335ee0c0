"""`AsyncLLM`: many concurrent asyncio callers share one continuously batching engine."""

from __future__ import annotations

import asyncio

from conftest import PROMPT
from novainfer import AsyncLLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_concurrent_callers_get_their_offline_results(tiny_models):
    engine = AsyncLLM(tiny_models["f32"])
    prompts = [PROMPT[: 3 + i] for i in range(8)]
    offline = [o.outputs[0].token_ids for o in engine.llm.generate(prompts, GREEDY)]

    async def main() -> list[list[int]]:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(main()) == offline


def test_leaving_a_stream_early_aborts_the_request(tiny_models):
    engine = AsyncLLM(tiny_models["f32"])

    async def main() -> str:
        async for delta in engine.generate_stream(PROMPT, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)):
            assert delta.token_ids
            break
        await asyncio.sleep(0)
        return "done"

    asyncio.run(main())
    stats = engine.llm.stats()
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0


def test_chat_stream_yields_the_chat_reply(tiny_models):
    engine = AsyncLLM(tiny_models["f32"])
    messages = [{"role": "user", "content": "hello"}]
    expected = engine.llm.chat(messages, GREEDY)[0].outputs[0].text

    async def main() -> str:
        return "".join([d.text async for d in engine.chat_stream(messages, GREEDY)])

    assert asyncio.run(main()) == expected
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    expected = engine.llm.chat(messages, GREEDY, tools=tools)[0].outputs[0].text

    async def with_tools() -> str:
        return "".join([d.text async for d in engine.chat_stream(messages, GREEDY, tools=tools, priority=1)])

    assert asyncio.run(with_tools()) == expected


def test_a_cancelled_task_frees_its_blocks_while_another_streams(tiny_models):
    """Cancelling a task blocked on its next token aborts its request at once (blocks back by the
    next step) without blocking the event loop, and the other stream keeps going."""
    engine = AsyncLLM(tiny_models["f32"])
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def consume(prompt: list[int], seen: list[float]) -> None:
        async for _ in engine.generate_stream(prompt, long):
            seen.append(asyncio.get_running_loop().time())

    async def main() -> None:
        kept_times: list[float] = []
        victim_times: list[float] = []
        kept = asyncio.create_task(consume(PROMPT, kept_times))
        victim = asyncio.create_task(consume(PROMPT[::-1], victim_times))
        while len(victim_times) < 5:
            await asyncio.sleep(0.005)
        started = asyncio.get_running_loop().time()
        victim.cancel()
        try:
            await victim
        except asyncio.CancelledError:
            pass
        cancelled_at = asyncio.get_running_loop().time()
        # Cancelling waited for nothing: not for the native stream, not for an executor thread.
        assert cancelled_at - started < 0.2
        before = len(kept_times)
        await asyncio.sleep(0.1)
        stats = engine.llm.stats()
        assert stats["num_running"] <= 1  # only the kept stream (0 if it already finished)
        await kept
        assert len(kept_times) > before or before == 400  # it streamed on after the cancel
        assert len(kept_times) == 400

    asyncio.run(main())
    stats = engine.llm.stats()
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0
