"""Speculative decoding (n-gram prompt lookup): outputs equal decoding without it, token for token, greedy
and seeded; drafts are verified in the engine's forward pass. Tiny random models (their greedy outputs fall
into loops, which prompt lookup predicts)."""

from __future__ import annotations

import pytest

from conftest import PROMPT
from novainfer import LLM, InvalidParameterError, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Tests of verification draft whatever drafting costs, so that what they cover does not depend on timing; the
# default (adaptive) policy runs in the stream and grammar tests, whose outputs must be the same either way.
ALWAYS = {**NGRAM, "draft_policy": "always"}


def prompts() -> list[list[int]]:
    # Repetitive prompts give the lookup something to find from the first decode on.
    return [PROMPT * 3, PROMPT[:5] * 4, PROMPT[::-1] * 2, [300, 301, 302] * 5, PROMPT, PROMPT[3:] + PROMPT]


def assert_same_outputs(plain: LLM, spec: LLM) -> None:
    """Greedy, seeded (with logprobs) and n=2 with a penalty: the speculating engine's outputs equal the plain one's."""
    for params in (
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=23, n=2, ignore_eos=True, repetition_penalty=1.1),
    ):
        want = plain.generate(prompts(), params)
        got = spec.generate(prompts(), params)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], params
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs], params
            assert [c.logprobs for c in g.outputs] == [c.logprobs for c in w.outputs], params


@pytest.mark.parametrize("layout", ["block", "slot"])
def test_ngram_speculation_gives_the_same_tokens_greedy_and_seeded(tiny_models, layout):
    common = {"kv_cache_bytes": 8 << 20, "kv_layout": layout, "kv_cache_dtype": "f32"}
    plain = LLM(tiny_models["f32"], **common)
    spec = LLM(tiny_models["f32"], speculative_config=ALWAYS, **common)
    assert_same_outputs(plain, spec)
    stats = spec.stats()
    assert stats["num_draft_tokens"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["spec_acceptance_rate"] == stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    assert 0 < stats["num_drafts"] <= stats["num_draft_tokens"]
    assert stats["spec_mean_acceptance_length"] == 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    assert stats["kv_used_blocks"] == 0
    # Accepted drafts save forward passes. Counted for one request alone: with several, how many arrive
    # before the engine's first step depends on timing, and so does the step count.
    one = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    steps = []
    for llm in (plain, spec):
        before = llm.stats()["num_steps"]
        llm.generate([PROMPT * 3], one)
        steps.append(llm.stats()["num_steps"] - before)
    assert steps[1] < steps[0], steps


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
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "sometimes"}, "draft_policy"),
    ],
)
def test_a_bad_speculative_config_names_its_field(tiny_models, config, field):
    with pytest.raises(InvalidParameterError) as e:
        LLM(tiny_models["f32"], kv_cache_bytes=8 << 20, speculative_config=config)
    assert e.value.param == "speculative_config" and field in str(e.value)


def test_the_server_streams_with_speculation_and_a_client_gone_mid_verification_frees_every_block(tiny_models):
    import json
    import urllib.request

    from server_process import ServerProcess
    from test_server import KV, post_json

    args = ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", *KV, "--kv-cache-dtype", "f32"]
    plain = LLM(tiny_models["f32"], kv_cache_bytes=8 << 20, kv_cache_dtype="f32")
    want = plain.generate([PROMPT * 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    with ServerProcess([*args, "--speculative-config", json.dumps(ALWAYS)]) as server:
        payload = {"model": "tiny", "prompt": PROMPT * 3, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        code, _, body = post_json(server, "/v1/completions", payload)
        assert code == 200 and json.loads(body)["choices"][0]["text"] == want.outputs[0].text
        # The reply says what speculation did for it (the Web UI shows the acceptance).
        spec_usage = json.loads(body)["usage"]["speculative_decoding"]
        assert 0 < spec_usage["num_accepted_tokens"] <= spec_usage["num_draft_tokens"]
        req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({**payload, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        text = ""
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                if raw.startswith(b"data: {"):
                    text += json.loads(raw[6:])["choices"][0]["text"]
        assert text == want.outputs[0].text
        m = server.metrics()
        vllm = '{model_name="tiny",engine="0"}'
        assert m["vllm:spec_decode_num_draft_tokens_total" + vllm] > 0
        assert 0 < m["vllm:spec_decode_num_drafts_total" + vllm] <= m["vllm:spec_decode_num_draft_tokens_total" + vllm]
        assert 0 < m['novainfer:spec_decode_num_accepted_tokens_total{model_name="tiny"}']
        # A long stream abandoned after a few chunks: its blocks (drafts' included) all come back.
        long = {**payload, "max_tokens": 400, "stream": True}
        req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(long).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        r = urllib.request.urlopen(req, timeout=60)
        for _ in range(6):
            r.readline()
        r.close()
        server.wait_idle("tiny", timeout=20)
    with pytest.raises(RuntimeError, match="speculative_config"):
        ServerProcess([*args, "--speculative-config", '{"method": "ngram"}'], timeout=30)


CODE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''


def chat_prompts() -> list[list[dict]]:
    """24 chats; most ask the model to repeat text it was given, where prompt lookup pays."""
    asks = [f"Rewrite this code with `{a}` renamed to `{b}`:\n{CODE}" for a, b in
            [("width", "w"), ("height", "h"), ("area", "surface"), ("perimeter", "border")]]
    asks += [f"Copy this list exactly, then add one item: {', '.join(str(i) for i in range(n, n + 12))}"
             for n in range(0, 80, 10)]
    asks += ["What is the capital of France?", "Write a haiku about rust.", "Explain a mutex in one sentence.",
             "Name three sorting algorithms.", "What does HTTP stand for?", "Say hello in Spanish.",
             "Give a Python one-liner to reverse a string.", "What is 17 * 23?",
             "Translate 'good morning' to German.", "What is a prime number?", "Describe a cat.",
             "List the planets."]
    return [[{"role": "user", "content": a}] for a in asks]


@pytest.mark.slow
def test_greedy_with_each_method_equals_plain_on_the_real_model_batched_chunked_and_preempted():
    from novainfer.fetch import fetch_model

    path = fetch_model("qwen2.5-coder-0.5b", progress=False)
    # 16 at a time, prompts chunked (128 tokens a step) and a pool small enough to preempt.
    common = {"device": "cpu", "max_num_seqs": 16, "max_num_batched_tokens": 128, "kv_cache_bytes": 12 << 20}
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(path, **common)
    want = plain.chat(chat_prompts(), params)
    base = plain.stats()
    assert base["num_preemptions"] > 0, "the pool was meant to be tight enough to preempt"
    # The draft model is the target itself: the only other Qwen2.5 tokenizer model at hand is larger. Its
    # pool halves the target's, so preemption only grows.
    for config in ({"method": "ngram", "num_speculative_tokens": 4, "draft_policy": "always"},
                   {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3,
                    "draft_policy": "always"}):
        spec = LLM(path, speculative_config=config, **common)
        got = spec.chat(chat_prompts(), params)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, (config, w.outputs[0].text, g.outputs[0].text)
        # And alone: a few of them one at a time (no other request to share steps with).
        for chat, w in list(zip(chat_prompts(), want))[::8]:
            alone = spec.chat([chat], params)[0]
            assert alone.outputs[0].token_ids == w.outputs[0].token_ids, (config, w.outputs[0].text)
        stats = spec.stats()
        print(f"{config['method']}: steps {base['num_steps']:.0f} -> {stats['num_steps']:.0f}; accepted "
              f"{stats['num_accepted_tokens']:.0f}/{stats['num_draft_tokens']:.0f} drafts; preemptions "
              f"{base['num_preemptions']:.0f}/{stats['num_preemptions']:.0f}")
        assert stats["num_accepted_tokens"] > 0 and stats["kv_used_blocks"] == 0
        del spec


def test_constrained_outputs_are_the_same_with_speculation(tiny_models):
    from novainfer import StructuredOutputsParams

    common = {"kv_cache_bytes": 8 << 20}
    plain = LLM(tiny_models["f32"], **common)
    spec = LLM(tiny_models["f32"], speculative_config=NGRAM, **common)
    for constraint in (StructuredOutputsParams(regex="(ab|cd){3,12}x"), StructuredOutputsParams(choice=["yes", "no"])):
        params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, structured_outputs=constraint)
        want = plain.generate(prompts(), params)
        got = spec.generate(prompts(), params)
        assert [g.outputs[0].text for g in got] == [w.outputs[0].text for w in want]
        assert [g.outputs[0].finish_reason for g in got] == [w.outputs[0].finish_reason for w in want]


def test_a_draft_model_gives_the_same_tokens_and_leaks_no_blocks(tiny_models, tmp_path):
    from tiny_qwen2 import write_tiny_model

    other = write_tiny_model(tmp_path / "seed1", seed=1)
    common = {"kv_cache_bytes": 8 << 20, "kv_cache_dtype": "f32"}
    plain = LLM(tiny_models["f32"], **common)
    for draft, layout in ((tiny_models["f32"], "block"), (other, "slot"), (tiny_models["gguf"], "block")):
        spec = LLM(tiny_models["f32"], kv_layout=layout, **common,
                   speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                                       "draft_policy": "always"})
        assert_same_outputs(plain, spec)
        stats = spec.stats()
        assert stats["num_draft_tokens"] > 0 and stats["kv_used_blocks"] == 0
        if draft != other:
            # The target drafting for itself (the same weights, f32 or GGUF): every greedy draft is the
            # target's own argmax, so all are accepted. Counted over greedy requests alone: drafts are greedy,
            # so a sampled request accepts one with the target's probability of it, and how many drafts each
            # kind of request gets in a batch depends on timing.
            greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            before = spec.stats()
            spec.generate(prompts(), greedy)
            after = spec.stats()
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            assert drafted > 0 and after["num_accepted_tokens"] - before["num_accepted_tokens"] == drafted, after


def test_a_draft_model_must_share_the_targets_tokenizer(tiny_models, tmp_path):
    from tiny_qwen2 import write_tiny_model

    fim = write_tiny_model(tmp_path / "fim", fim=True)  # four more tokens
    with pytest.raises(InvalidParameterError) as e:
        LLM(tiny_models["f32"], kv_cache_bytes=8 << 20,
            speculative_config={"method": "draft_model", "model": str(fim), "num_speculative_tokens": 2})
    assert e.value.param == "speculative_config" and "tokenizer" in str(e.value)
    with pytest.raises(InvalidParameterError, match="model"):
        LLM(tiny_models["f32"], kv_cache_bytes=8 << 20,
            speculative_config={"method": "draft_model", "model": str(tmp_path / "absent"), "num_speculative_tokens": 2})
