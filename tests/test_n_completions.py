"""`SamplingParams.n`: several completions of one prompt, sharing the prompt's KV.

Completion ``i`` uses seed ``seed + i``, so it must equal a lone ``n=1`` request with that seed; the prompt is
computed once (checked with the prefix cache off, so the sharing is the fork's, not the cache's).
"""

from __future__ import annotations

import pytest

from novainfer import LLM, SamplingParams
from novainfer.errors import InvalidParameterError

PROMPT = [7, 42, 3, 99, 15, 8, 250, 31, 4, 17, 60, 61, 62, 5, 9, 11, 13, 200, 201]  # 19 tokens: a partial block


def _sampled(seed: int, n: int = 1, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed, n=n, **kw)


@pytest.mark.parametrize("engine_args", [{"enable_prefix_caching": False}, {"kv_layout": "slot"}, {"block_size": 1}])
def test_each_completion_equals_a_lone_request_with_its_seed(tiny_models, engine_args):
    llm = LLM(tiny_models["f32"], **engine_args)
    computed = llm.stats()["num_prompt_tokens_computed"]
    (out,) = llm.generate(PROMPT, _sampled(seed=5, n=4))
    assert llm.stats()["num_prompt_tokens_computed"] - computed == len(PROMPT), "the prompt was computed once"
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    lone = LLM(tiny_models["f32"], enable_prefix_caching=False)
    for i, c in enumerate(out.outputs):
        assert c.token_ids == lone.generate(PROMPT, _sampled(seed=5 + i))[0].outputs[0].token_ids
        assert c.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeds seed+i should give different samples"
    assert llm.stats()["kv_used_blocks"] == 0


def test_greedy_completions_are_identical_and_batch_invariant(tiny_models):
    llm = LLM(tiny_models["f32"], max_num_batched_tokens=7)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPT, greedy)[0].outputs[0].token_ids
    outs = llm.generate([PROMPT, PROMPT[:5]], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3), greedy])
    assert [c.token_ids for c in outs[0].outputs] == [alone] * 3


def test_forks_survive_preemption_under_a_tiny_pool(tiny_models):
    prompts = [PROMPT, PROMPT[3:], PROMPT[::-1]]
    params = [_sampled(seed=s, n=3, max_tokens=40) for s in (1, 2, 3)]
    ample = LLM(tiny_models["f32"]).generate(prompts, params)
    tight = LLM(tiny_models["f32"], kv_cache_bytes=8 * 4096, max_model_len=128)  # 8 f16 blocks
    got = tight.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ample]
    assert tight.stats()["num_preemptions"] > 0
    assert tight.stats()["kv_used_blocks"] == 0


def test_a_stream_tags_deltas_with_their_completion_and_ends_after_all(tiny_models):
    llm = LLM(tiny_models["f32"])
    deltas = list(llm.generate_stream(PROMPT, _sampled(seed=0, n=3, max_tokens=5)))
    by_index = {i: [d for d in deltas if d.index == i] for i in range(3)}
    assert all(len(ds) == 5 for ds in by_index.values())
    assert all(ds[-1].finish_reason == "length" for ds in by_index.values())
    assert sum(d.finish_reason is not None for d in deltas) == 3


def test_closing_an_n_stream_aborts_every_completion(tiny_models):
    llm = LLM(tiny_models["f32"])
    stream = llm.generate_stream(PROMPT, _sampled(seed=0, n=4, max_tokens=300))
    for _ in range(8):
        next(stream)
    assert llm.stats()["num_running"] == 4
    stream.close()
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["kv_used_blocks"] == 0


def test_stop_strings_end_each_completion_and_free_it_before_the_last_delta(tiny_models):
    llm = LLM(tiny_models["f32"])
    free = llm.generate(PROMPT, _sampled(seed=3, n=3, max_tokens=30))[0]
    # A stop string taken from inside completion 1's text: it must stop there, and not leak.
    text = free.outputs[1].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"completion text too short for the test: {text!r}"
    stopped = llm.generate(PROMPT, _sampled(seed=3, n=3, max_tokens=30, stop=[stop]))[0]
    assert stopped.outputs[1].finish_reason == "stop"
    assert stopped.outputs[1].text == text[: text.index(stop)]
    # Stop strings are found on the output thread; the engine hears first, so stats are already clean.
    assert llm.stats()["num_running"] == 0 and llm.stats()["kv_used_blocks"] == 0


@pytest.mark.parametrize("bad", [0, -1, 129])
def test_a_bad_n_names_the_parameter(bad):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(n=bad)
    assert info.value.param == "n"
