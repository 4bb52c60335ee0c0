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
