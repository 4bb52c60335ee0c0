"""Speculative decoding (n-gram prompt lookup): outputs equal decoding without it, token for token, greedy
and seeded; drafts are verified in the engine's forward pass. Tiny random models (their greedy outputs fall
into loops, which prompt lookup predicts)."""

from __future__ import annotations

import pytest

from conftest import PROMPT
from novainfer import LLM, InvalidParameterError, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def prompts() -> list[list[int]]:
    # Repetitive prompts give the lookup something to find from the first decode on.
    return [PROMPT * 3, PROMPT[:5] * 4, PROMPT[::-1] * 2, [300, 301, 302] * 5, PROMPT, PROMPT[3:] + PROMPT]


@pytest.mark.parametrize("layout", ["block", "slot"])
def test_ngram_speculation_gives_the_same_tokens_greedy_and_seeded(tiny_models, layout):
    common = {"kv_cache_bytes": 8 << 20, "kv_layout": layout, "kv_cache_dtype": "f32"}
    plain = LLM(tiny_models["f32"], **common)
    spec = LLM(tiny_models["f32"], speculative_config=NGRAM, **common)
    for params in (
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=23, n=2, ignore_eos=True, repetition_penalty=1.1),
    ):
        want = plain.generate(prompts(), params)
        got = spec.generate(prompts(), params)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
            assert [c.logprobs for c in g.outputs] == [c.logprobs for c in w.outputs]
    stats = spec.stats()
    assert stats["num_draft_tokens"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    # Fewer forward passes than tokens: accepted drafts saved steps.
    assert stats["num_steps"] < plain.stats()["num_steps"]
    assert stats["kv_used_blocks"] == 0


def test_speculation_streams_and_stops_on_stop_tokens(tiny_models):
    spec = LLM(tiny_models["f32"], kv_cache_bytes=8 << 20, speculative_config=NGRAM)
    plain = LLM(tiny_models["f32"], kv_cache_bytes=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = plain.generate([PROMPT * 3], params)[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[out[12]])
    streamed = [t for d in spec.generate_stream(PROMPT * 3, stop) for t in d.token_ids]
    assert streamed == plain.generate([PROMPT * 3], stop)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ],
)
def test_a_bad_speculative_config_names_its_field(tiny_models, config, field):
    with pytest.raises(InvalidParameterError) as e:
        LLM(tiny_models["f32"], kv_cache_bytes=8 << 20, speculative_config=config)
    assert e.value.param == "speculative_config" and field in str(e.value)
