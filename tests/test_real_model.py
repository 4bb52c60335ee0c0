"""The 0.5B demo model (Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M mix), fetched and cached by novainfer.fetch.

Kept few and short: CI runs them on 2 cores. The f32 checkpoint is made by tools/gguf_to_hf.py, which
dequantizes with the `gguf` package (independently of our Rust loader), and cached between runs.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import logits_of
from novainfer import LLM, SamplingParams
from novainfer.fetch import cache_dir, fetch_model
from numpy_qwen2 import Qwen2Reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gguf_to_hf import convert  # noqa: E402

pytestmark = pytest.mark.slow

# These check the CPU engine against exact references (1e-3, with an f32 KV cache: the default f16 one is
# measured against it at the end); tests/test_cuda.py holds the GPU's own, looser
# checks. Pinned so that `auto` on a GPU machine does not put bf16 logits under an f32 tolerance.

QUESTION = "What is the capital of France?"

# Chat prompts on which the f16 (default) and q8_0 KV caches are measured against the f32 one.
AGREEMENT_PROMPTS = [
    QUESTION,
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
    "Explain what a hash map is in one sentence.",
    "Write a SQL query that counts the rows of a table named users.",
    "Name three prime numbers.",
    "What does HTTP stand for?",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
]


@pytest.fixture(scope="module")
def demo_gguf() -> Path:
    return fetch_model("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="module")
def demo_llm(demo_gguf: Path) -> LLM:
    return LLM(demo_gguf, device="cpu")


@pytest.fixture(scope="module")
def demo_f32_dir(demo_gguf: Path) -> Path:
    out = cache_dir() / "test-artifacts" / "qwen2.5-coder-0.5b-f32"
    if not (out / "model.safetensors").exists():
        partial = out.with_name(out.name + f".partial-{os.getpid()}")
        convert(demo_gguf, partial)
        partial.rename(out)
    return out


def test_chat_answers_paris(demo_llm):
    out = demo_llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_multi_turn_template_text(demo_llm):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one?"},
    ]
    assert demo_llm.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nName a prime.<|im_end|>\n"
        "<|im_start|>assistant\n7<|im_end|>\n"
        "<|im_start|>user\nAnother one?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert demo_llm.encode("Hello world") == [9707, 1879]


def test_f32_logits_match_numpy_reference(demo_llm, demo_f32_dir):
    prompt = demo_llm.encode(QUESTION)
    got = logits_of(LLM(demo_f32_dir, device="cpu", kv_cache_dtype="f32"), prompt)
    gc.collect()
    ref = Qwen2Reference.from_hf_dir(demo_f32_dir).forward(prompt)
    assert got.shape == ref.shape
    assert float(np.abs(got - ref).max()) <= 1e-3


def test_gguf_and_f32_greedy_tokens_agree(demo_llm, demo_f32_dir):
    params = SamplingParams(temperature=0, max_tokens=8)
    quantized = demo_llm.generate(QUESTION, params)[0].outputs[0].token_ids
    exact = LLM(demo_f32_dir, device="cpu", kv_cache_dtype="f32").generate(QUESTION, params)[0].outputs[0].token_ids
    assert quantized[:6] == exact[:6]
    assert "Paris" in demo_llm.decode(quantized)


def test_f16_kv_cache_logits_stay_close_to_the_f32_cache(demo_llm, demo_f32_dir):
    # On the dense f32 checkpoint (no int8 activations that would amplify any perturbation), the default f16
    # cache moves the prompt's logits (std ~2.5) by at most 0.034 (measured); the f32 cache is exact.
    prompt = demo_llm.encode(demo_llm.apply_chat_template([{"role": "user", "content": QUESTION}]))
    exact = logits_of(LLM(demo_f32_dir, device="cpu", kv_cache_dtype="f32"), prompt)
    gc.collect()
    f16 = logits_of(LLM(demo_f32_dir, device="cpu", kv_cache_dtype="f16"), prompt)
    gc.collect()
    assert 0 < float(np.abs(f16.astype(np.float64) - exact).max()) <= 0.1
    assert (f16.argmax(axis=1) == exact.argmax(axis=1)).all()


@pytest.fixture(scope="module")
def f32_kv_greedy(demo_llm, demo_gguf) -> tuple[list[str], list[list[int]]]:
    """The agreement prompts' chat texts, and their greedy outputs with an f32 KV cache (the exact one)."""
    texts = [demo_llm.apply_chat_template([{"role": "user", "content": p}]) for p in AGREEMENT_PROMPTS]
    exact = [o.outputs[0].token_ids for o in LLM(demo_gguf, device="cpu", kv_cache_dtype="f32").generate(texts, GREEDY_48)]
    gc.collect()
    return texts, exact


GREEDY_48 = SamplingParams(temperature=0, max_tokens=48)


def test_f16_kv_cache_greedy_outputs_mostly_equal_the_f32_caches(demo_llm, f32_kv_greedy):
    # The GGUF model quantizes activations to int8, so a rounding anywhere can flip a later token. Measured with
    # the attention kernel's former score order (8 lane-wise partial sums per score): 6 of the 8 outputs (48
    # tokens each) identical, the others diverging after 3 and 25 tokens. Since scores are one fused multiply-add
    # chain over the transposed keys (issue 16, prefill at long context; docs/benchmarks.md): 5 of 8, the others
    # diverging after 0, 25 and 33 tokens (one prompt's first token is a near-tie that the f16 cache's rounding
    # flips). "Most" is what the issue asks for.
    texts, exact = f32_kv_greedy
    f16 = [o.outputs[0].token_ids for o in demo_llm.generate(texts, GREEDY_48)]
    same = sum(a == b for a, b in zip(f16, exact))
    print(f"f16 vs f32 KV cache: {same}/{len(texts)} greedy outputs identical")
    assert same >= len(texts) - 3
    assert sum(a[:3] == b[:3] for a, b in zip(f16, exact)) >= len(texts) - 1


def test_q8_0_kv_cache_costs_what_llama_cpps_does(demo_gguf, demo_f32_dir, f32_kv_greedy):
    """The 8-bit cache's fidelity cost on this model (docs/benchmarks.md): Qwen2.5's keys carry a few channels
    far larger than the rest, and one scale per 32 values spends most of its 8 bits on them. Measured: 4 of the 8
    outputs identical to the f32 cache's since the attention scores are one fused multiply-add chain over
    transposed keys (5 of 8 before, the others diverging after 0, 3 and 33 tokens; llama.cpp's q8_0 cache
    against its f16 one on the same prompts: 5 of 8, after 3, 21 and 31); on the dense checkpoint the prompt's
    logits move by up to 5.0 (f16: 0.034) and 92% of the positions keep their argmax."""
    texts, exact = f32_kv_greedy
    q8 = [o.outputs[0].token_ids for o in LLM(demo_gguf, device="cpu", kv_cache_dtype="q8_0").generate(texts, GREEDY_48)]
    gc.collect()
    same = sum(a == b for a, b in zip(q8, exact))
    print(f"q8_0 vs f32 KV cache: {same}/{len(texts)} greedy outputs identical")
    assert same >= len(texts) - 4
    llm = LLM(demo_f32_dir, device="cpu", kv_cache_dtype="f32")
    prompt = llm.encode(llm.apply_chat_template([{"role": "user", "content": QUESTION}]))
    f32 = logits_of(llm, prompt)
    del llm
    gc.collect()
    got = logits_of(LLM(demo_f32_dir, device="cpu", kv_cache_dtype="q8_0"), prompt)
    gc.collect()
    assert 0.1 < float(np.abs(got.astype(np.float64) - f32).max()) <= 8.0
    assert (got.argmax(axis=1) == f32.argmax(axis=1)).mean() >= 0.85



# Teacher-forced limit: mean |error| of the logits' differences to the top token, over the reference's top 8
# tokens at each of the 744 positions. Measured 0.0618 at f3a66a3 (f32 cache, the only one then), 0.0627 (f16
# cache) and 0.0609 (f32 cache) at c7bb2c2; the margin above that is for ISA-dependent rounding, while a
# real loss of precision (a coarser activation scale, a dropped bias, a lossy cache) moves it by far more.
TOPK_ERROR_LIMIT = 0.075


def test_gguf_fidelity_against_the_exact_reference(demo_llm):
    """Issue 30 point 5: the GGUF engine with its default settings stays as close to the exact model as it
    did at f3a66a3. The reference (tests/fidelity_reference.json, made by `tools/fidelity.py
    --make-reference`) is the float64 NumPy forward on the f32 dequantization of this same GGUF, so only the
    engine's own arithmetic is measured: int8 activations, kernel sums, the KV cache's storage.

    Two measures. Greedy agreement (24 chat prompts x 48 tokens) is what a user sees, but it is noisy: each
    run measured (f3a66a3; c7bb2c2 with the f16 and the f32 cache) gave 20/24, but a different four prompts
    diverged each time, always at a near-tie (the reference's top-2 margin there 0.006 to 0.16 logits, under
    the ~0.065 RMS logit error that int8 activations cost at every position). The teacher-forced error (the
    engine fed the reference's own tokens, compared at every position) is steady, and is what catches a real
    loss of precision long before the greedy count can tell it from noise. The f32 HF directory itself
    scores 24/24 (tools/fidelity.py --model <dir> --kv f32), which checks the tool."""
    from fidelity import MAX_TOKENS, engine_forced_logits, engine_greedy, load_reference, score, top_k_error

    reference = load_reference()
    if demo_llm.model_path.stat().st_size != reference["gguf_size"]:
        pytest.skip("the demo GGUF is not the file the fidelity reference was made from")
    outs = engine_greedy(demo_llm, reference)
    same, mean_prefix, prefixes = score(outs, reference)
    print(f"fidelity: {same}/{len(outs)} identical, mean common prefix {mean_prefix:.1f}/{MAX_TOKENS}: {prefixes}")
    errors, top1 = [], []
    for item in reference["items"]:
        got = engine_forced_logits(demo_llm, item, step_by_step=False)
        errors.append(top_k_error(got, item).ravel())
        top1.append(got.argmax(axis=-1) == np.asarray(item["top_ids"])[:, 0])
    error, agree = float(np.concatenate(errors).mean()), float(np.concatenate(top1).mean())
    print(f"fidelity teacher-forced: top-8 logit-difference error {error:.4f}, top-1 agreement {100 * agree:.2f}%")
    assert same >= 19
    assert error <= TOPK_ERROR_LIMIT
    assert agree >= 0.985  # measured 99.33% (f3a66a3) and 99.46% (c7bb2c2): 5 and 4 of 744 positions
