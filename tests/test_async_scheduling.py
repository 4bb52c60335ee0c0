"""`async_scheduling=True` on the CPU: each step is scheduled and launched while the one before it runs (its rows drawn
on the device thread by the device kernel's host twin), and callers see what steps in order give them: tokens, text,
stop strings, finish reasons, cancellation, freed blocks."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PROMPT
from novainfer import LLM, AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def ahead(tiny_models) -> LLM:
    return LLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22, async_scheduling=True)


def test_steps_ahead_stream_what_steps_in_order_stream(tiny_llm, ahead):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    walk = tiny_llm.generate(PROMPT, greedy)[0].outputs[0]
    # A stop string met mid-stream: its request ends on text the output thread finds, while the step after the one
    # that produced it may already run.
    stop = walk.text[4:7]
    assert stop and stop in walk.text
    prompts = [PROMPT[: 3 + i] for i in range(6)] + [PROMPT, PROMPT[::-1]]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(6)]
    params += [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        # Penalties depend on each token: steps with this request run in order.
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, presence_penalty=0.8),
    ]
    want = tiny_llm.generate(prompts, params)
    before = ahead.stats()
    got = ahead.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert got[6].outputs[0].finish_reason == "stop" and stop not in got[6].outputs[0].text
    stats = ahead.stats()
    assert stats["num_steps_ahead"] > before["num_steps_ahead"]
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0


def test_n_completions_and_seeded_draws_run_ahead(tiny_llm, ahead):
    """n > 1 shares its first row (sampled on the host, in order); the completions then run ahead and give the greedy
    tokens steps in order give. Seeded rows are drawn by the device's counter-based generator: the same seed gives
    the same tokens, alone or beside others."""
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    before = ahead.stats()["num_steps_ahead"]
    alone = ahead.generate(PROMPT, seeded)[0].outputs[0].token_ids
    crowd = [PROMPT[: 2 + i] for i in range(5)]
    together = ahead.generate([PROMPT, *crowd], [seeded] + [SamplingParams(temperature=1.0, max_tokens=10)] * 5)
    assert together[0].outputs[0].token_ids == alone
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = tiny_llm.generate(PROMPT, greedy)[0].outputs[0].token_ids
    two = ahead.generate(PROMPT, SamplingParams(temperature=0, n=2, max_tokens=8, ignore_eos=True))[0].outputs
    assert [o.token_ids for o in two] == [want, want]
    stats = ahead.stats()
    assert stats["num_steps_ahead"] > before and stats["kv_used_blocks"] == 0


def test_a_cancelled_stream_frees_its_blocks_while_another_runs_ahead(tiny_models, tiny_llm):
    engine = AsyncLLM(tiny_models["f32"], device="cpu", kv_cache_bytes=1 << 22, async_scheduling=True)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    offline = tiny_llm.generate(PROMPT, long)[0].outputs[0].token_ids

    async def consume(prompt: list[int], tokens: list[int]) -> None:
        async for delta in engine.generate_stream(prompt, long):
            tokens.extend(delta.token_ids)

    async def main() -> list[int]:
        kept: list[int] = []
        victim: list[int] = []
        kept_task = asyncio.create_task(consume(PROMPT, kept))
        victim_task = asyncio.create_task(consume(PROMPT[::-1], victim))
        while len(victim) < 5:
            await asyncio.sleep(0.002)
        victim_task.cancel()
        try:
            await victim_task
        except asyncio.CancelledError:
            pass
        await kept_task
        return kept

    assert asyncio.run(main()) == offline
    stats = engine.llm.stats()
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0
    assert stats["num_steps_ahead"] > 0
