"""Sampling and stopping behaviour, end to end through `LLM` on the tiny model.

The distribution-level checks (chi-square for temperature / top-k / top-p / min-p) live beside the sampler
in Rust (crates/novainfer-model/src/sampler); these tests check what a user sees.
"""

from __future__ import annotations

import pytest

from conftest import PROMPT
from novainfer import LLM, SamplingParams


def _greedy(llm: LLM, n: int = 40):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0]


def test_top_k_one_equals_greedy(tiny_llm):
    greedy = _greedy(tiny_llm, 30)
    top1 = tiny_llm.generate(PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=30, ignore_eos=True, seed=5))
    assert top1[0].outputs[0].token_ids == greedy.token_ids


def test_same_seed_same_tokens_different_seeds_differ(tiny_llm):
    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=seed)
        return tiny_llm.generate(PROMPT, params)[0].outputs[0].token_ids

    assert sample(11) == sample(11)
    assert len({tuple(sample(s)) for s in (1, 2, 3, 4)}) >= 3


def test_engine_seed_makes_unseeded_requests_reproducible(tiny_models):
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    first = LLM(tiny_models["f32"], seed=7).generate([PROMPT, PROMPT], params)
    second = LLM(tiny_models["f32"], seed=7).generate([PROMPT, PROMPT], params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    # Two requests in one engine get different fallback seeds.
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids


def test_max_tokens_finishes_with_length(tiny_llm):
    out = _greedy(tiny_llm, 7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def _token_texts(llm: LLM, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded output."""
    texts, previous = [], ""
    for i in range(1, len(ids) + 1):
        now = llm.decode(ids[:i])
        texts.append(now[len(previous):])
        previous = now
    return texts


def _spanning_stop(llm: LLM, ids: list[int]) -> tuple[str, str]:
    """A stop string spanning two tokens (first occurrence in the text), and the text before it."""
    texts = _token_texts(llm, ids)
    full = "".join(texts)
    for i in range(1, len(texts) - 1):
        left, right = texts[i], texts[i + 1]
        if left and right:
            stop = left[-1] + right[0]
            start = full.find(stop)
            if start >= sum(len(t) for t in texts[:i]) + len(left) - 1:
                return stop, full[:start]
    pytest.fail("no two-token stop string found in the greedy output")


def test_stop_string_spanning_two_tokens_is_cut_and_never_shown(tiny_llm):
    greedy = _greedy(tiny_llm)
    stop, before = _spanning_stop(tiny_llm, greedy.token_ids)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    out = tiny_llm.generate(PROMPT, params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == before and stop not in out.text
    streamed = [d.text for d in tiny_llm.generate_stream(PROMPT, params)]
    assert "".join(streamed) == before
    assert all(stop not in "".join(streamed[: i + 1]) for i in range(len(streamed)))


def test_stop_string_as_plain_str(tiny_llm):
    greedy = _greedy(tiny_llm)
    stop = greedy.text[5:8]
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop))
    assert out[0].outputs[0].text == greedy.text[: greedy.text.find(stop)]


def test_stop_token_id_ends_generation(tiny_llm):
    greedy = _greedy(tiny_llm)
    stop_id = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_id)
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))
    assert out[0].outputs[0].token_ids == greedy.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text == tiny_llm.decode(greedy.token_ids[:first])


def test_eos_ids_include_the_generation_config_ones(tiny_llm):
    # Stopping on EOS itself is unit-tested on SequenceOutput (crates/novainfer-engine/src/sequence.rs):
    # a random tiny model does not reliably sample EOS.
    ids = {tiny_llm.encode(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|endoftext|>")}
    assert ids <= set(tiny_llm._engine.eos_token_ids)


def test_logprobs_of_chosen_and_top_tokens(tiny_llm):
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    completion = out[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and len(entry) in (3, 4)  # the chosen token may be among the top 3
        assert all(lp <= 0 for lp in entry.values())
        assert entry[token] == max(entry.values()), "greedy picks the most likely token"
    assert completion.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)))


def test_penalties_change_greedy_output(tiny_llm):
    base = _greedy(tiny_llm, 40).token_ids
    penalised = tiny_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0)
    )[0].outputs[0].token_ids
    assert penalised != base
    # The penalty discourages repeats: fewer repeated tokens than without it.
    assert len(penalised) - len(set(penalised)) < len(base) - len(set(base))
