"""vLLM-shaped Python inputs and outputs: prompt dicts, `use_tqdm`, `get_tokenizer()`, `stop_reason`, `Logprob`
objects, and the sampling fields vLLM's `SamplingParams` has (min_tokens, logit_bias, include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from conftest import PROMPT
from novainfer import AsyncLLM, InvalidParameterError, Logprob, SamplingParams, Tokenizer
from tiny_qwen2 import special_token_ids

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
IM_START, IM_END = special_token_ids()["<|im_start|>"], special_token_ids()["<|im_end|>"]
ORDINARY = 300


def test_prompt_dicts_and_use_tqdm(tiny_llm):
    params = SamplingParams(**GREEDY)
    text = "hello the capital"
    plain = tiny_llm.generate([text, PROMPT], params)
    dicts = tiny_llm.generate([{"prompt": text}, {"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == text and dicts[1].prompt is None and dicts[1].prompt_token_ids == PROMPT
    (one,) = tiny_llm.generate({"prompt": text}, params)
    assert one.outputs[0].token_ids == plain[0].outputs[0].token_ids
    for bad in ({"text": "x"}, {"prompt": 3}, {"prompt": "x", "multi_modal_data": {}}):
        with pytest.raises(InvalidParameterError):
            tiny_llm.generate(bad, params)
    with pytest.raises(InvalidParameterError):
        tiny_llm.generate(text, params, use_tqdm="yes")


def test_get_tokenizer(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("hello there")
    assert tok.decode(ids) == "hello there" and ids == tiny_llm.encode("hello there")
    assert tok.eos_token_id == IM_END and len(tok) == tok.vocab_size == 448
    convo = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(convo)
    assert text == tiny_llm.apply_chat_template(convo)
    assert tok.apply_chat_template(convo, tokenize=True) == tok.encode(text, add_special_tokens=False)
    # Template variables as keyword arguments, as in transformers.
    assert tok.apply_chat_template(convo, add_generation_prompt=True, tools=None) == text


def test_stop_reason_and_include_stop_str(tiny_llm):
    free = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY))[0].outputs[0]
    assert free.stop_reason is None
    stop = free.text[2:4]
    cut = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY, stop=stop))[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (free.text[: free.text.index(stop)], "stop", stop)
    kept = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY, stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == free.text[: free.text.index(stop) + len(stop)]
    by_token = SamplingParams(max_tokens=6, stop_token_ids=[ORDINARY], logit_bias={ORDINARY: 100})
    out = tiny_llm.generate(PROMPT, by_token)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([ORDINARY], "stop", ORDINARY)
    deltas = list(tiny_llm.generate_stream(PROMPT, by_token))
    assert deltas[-1].stop_reason == ORDINARY


def test_min_tokens_and_logit_bias(tiny_llm):
    eos_first = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={IM_END: 100})
    out = tiny_llm.generate(PROMPT, eos_first)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == IM_END and IM_END not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason is None
    p = SamplingParams(min_tokens=2, logit_bias={5: -1.5, 9: 100.0})
    assert (p.min_tokens, p.logit_bias) == (2, {5: -1.5, 9: 100.0})
    assert "min_tokens=2" in repr(p)
    for kwargs, param in (({"logit_bias": {1: 101}}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
                          ({"max_tokens": 2, "min_tokens": 3}, "min_tokens")):
        with pytest.raises(InvalidParameterError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
    with pytest.raises(InvalidParameterError) as e:
        tiny_llm.generate(PROMPT, SamplingParams(logit_bias={99999: 1.0}))
    assert e.value.param == "logit_bias"


def test_special_token_text_switches(tiny_llm):
    forced = dict(max_tokens=2, logit_bias={IM_START: 100})
    assert tiny_llm.generate(PROMPT, SamplingParams(**forced))[0].outputs[0].text == ""
    kept = SamplingParams(**forced, skip_special_tokens=False)
    assert kept.skip_special_tokens is False and kept.spaces_between_special_tokens is True
    assert tiny_llm.generate(PROMPT, kept)[0].outputs[0].text == "<|im_start|> <|im_start|>"
    tight = SamplingParams(**forced, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert tiny_llm.generate(PROMPT, tight)[0].outputs[0].text == "<|im_start|><|im_start|>"


def test_logprobs_are_vllm_logprob_objects(tiny_llm):
    out = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY, logprobs=3))[0].outputs[0]
    for step, token in zip(out.logprobs, out.token_ids):
        assert all(isinstance(v, Logprob) for v in step.values())
        chosen = step[token]
        assert chosen.rank == 1, "greedy picks the most likely token"
        assert chosen.decoded_token == tiny_llm.decode([token], skip_special_tokens=False)
        ranked = sorted((lp for tid, lp in step.items() if tid != token or lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked][:3] == [1, 2, 3]
        assert [lp.logprob for lp in ranked] == sorted((lp.logprob for lp in ranked), reverse=True)
    # Still floats, so sums and comparisons written for dict[int, float] keep working.
    assert out.cumulative_logprob == pytest.approx(sum(step[t].logprob for step, t in zip(out.logprobs, out.token_ids)))
    lp = Logprob(-0.25, 2, "a")
    assert lp == -0.25 and lp.logprob == -0.25 and pickle.loads(pickle.dumps(lp)).rank == 2
    sampled = tiny_llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=0))
    for step, token in zip(sampled[0].outputs[0].logprobs, sampled[0].outputs[0].token_ids):
        assert list(step) == [token] and step[token].rank >= 1


def test_async_outputs_carry_stop_reason_and_logprobs(tiny_models):
    async def run():
        engine = AsyncLLM(tiny_models["f32"])
        params = SamplingParams(max_tokens=6, stop_token_ids=[ORDINARY], logit_bias={ORDINARY: 100}, logprobs=1)
        return await engine.generate(PROMPT, params)

    out = asyncio.run(run()).outputs[0]
    assert out.stop_reason == ORDINARY and isinstance(out.logprobs[0][ORDINARY], Logprob)


def test_chat_options(tiny_llm):
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cap"}]
    text = tiny_llm.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nthe cap")
    out = tiny_llm.chat(convo, SamplingParams(**GREEDY), add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt == text
    with pytest.raises(InvalidParameterError) as e:
        tiny_llm.chat(convo, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tiny_llm.apply_chat_template(parts) == tiny_llm.apply_chat_template([{"role": "user", "content": "a\nb"}])
    kw = tiny_llm.apply_chat_template(convo[:1], chat_template_kwargs={"add_generation_prompt": False})
    assert kw == tiny_llm.apply_chat_template(convo[:1], add_generation_prompt=False)
