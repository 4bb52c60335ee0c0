"""The Rust forward pass against the independent NumPy reference (tests/numpy_qwen2.py).

The exact comparisons pin kv_cache_dtype="f32" (the CPU's default, f16, rounds every cached key and value);
the last tests bound what each 16- and 8-bit cache costs against it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PROMPT, logits_of
from novainfer import LLM, SamplingParams
from numpy_qwen2 import Qwen2Reference, greedy_generate
from tiny_qwen2 import special_token_ids


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.mark.parametrize("variant", ["f32", "bf16", "f16", "sharded", "tied"])
def test_prefill_logits_match_reference(tiny_models, variant):
    ref = Qwen2Reference.from_hf_dir(tiny_models[variant]).forward(PROMPT)
    assert ref.std() > 0.5, "degenerate logits would make the comparison meaningless"
    got = logits_of(LLM(tiny_models[variant], kv_cache_dtype="f32"), PROMPT)
    assert _max_diff(got, ref) <= 1e-4


@pytest.mark.parametrize("variant", ["f32", "tied"])
def test_step_by_step_decode_matches_reference(tiny_models, variant):
    ref_model = Qwen2Reference.from_hf_dir(tiny_models[variant])
    cache = ref_model.new_cache()
    ref = np.concatenate([ref_model.forward([t], cache) for t in PROMPT])
    got = logits_of(LLM(tiny_models[variant], kv_cache_dtype="f32"), PROMPT, step_by_step=True)
    assert _max_diff(got, ref) <= 1e-4


def test_gguf_f32_matches_reference(tiny_models):
    ref = Qwen2Reference.from_hf_dir(tiny_models["f32"]).forward(PROMPT)
    got = logits_of(LLM(tiny_models["gguf"], kv_cache_dtype="f32"), PROMPT)
    assert _max_diff(got, ref) <= 1e-4


def test_gguf_q8_0_stays_close_to_reference(tiny_models):
    # Quantized weights and Q8_0 activations cannot be exact; they must stay close and agree on argmax.
    ref = Qwen2Reference.from_hf_dir(tiny_models["f32"]).forward(PROMPT)
    got = logits_of(LLM(tiny_models["gguf_q8_0"], kv_cache_dtype="f32"), PROMPT)
    assert _max_diff(got, ref) <= 0.25
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.9


def test_greedy_generation_matches_reference(tiny_models):
    eos = set(special_token_ids().values())
    expected = greedy_generate(Qwen2Reference.from_hf_dir(tiny_models["f32"]), PROMPT, 24, stop_ids=eos)
    out = LLM(tiny_models["f32"], kv_cache_dtype="f32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == expected


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_dtype_override_runs_in_that_precision(tiny_models, dtype):
    # Weights (and matmul inputs) held in 16 bits: close to the f32 reference, but not equal to it.
    ref = Qwen2Reference.from_hf_dir(tiny_models["f32"]).forward(PROMPT)
    got = logits_of(LLM(tiny_models["f32"], kv_cache_dtype="f32", dtype=dtype), PROMPT)
    assert 1e-4 < _max_diff(got, ref) <= 0.1
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.9
    exact = logits_of(LLM(tiny_models["f32"], kv_cache_dtype="f32", dtype="f32"), PROMPT)
    assert _max_diff(exact, ref) <= 1e-4


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_16_bit_checkpoint_keeps_its_dtype_with_the_f32_bits_at_half_the_bytes(tiny_models, dtype):
    # dtype="auto" holds a bf16/f16 checkpoint as stored; the CPU kernel widens each weight exactly to the
    # f32 it equals and sums in the f32 path's order, so the logits are dtype="f32"'s bit for bit (prefill,
    # several rows, and decode, one row), while a decode step reads half the weight bytes.
    held = LLM(tiny_models[dtype], kv_cache_dtype="f32")
    widened = LLM(tiny_models[dtype], kv_cache_dtype="f32", dtype="f32")
    assert np.array_equal(logits_of(held, PROMPT), logits_of(widened, PROMPT))
    assert np.array_equal(logits_of(held, PROMPT, step_by_step=True), logits_of(widened, PROMPT, step_by_step=True))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    a, b = held.generate(PROMPT, params)[0].outputs[0], widened.generate(PROMPT, params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    half_bytes, full_bytes = held.stats()["weight_bytes_per_token"], widened.stats()["weight_bytes_per_token"]
    assert 0.45 < half_bytes / full_bytes < 0.55, (half_bytes, full_bytes)


# Measured on the tiny model's prompt (max |Δlogit| against the f32 cache, logits of std ~1): f16 6.2e-4,
# bf16 5.2e-3, q8_0 1.6e-2, argmax equal everywhere. The bounds leave about 5x.
@pytest.mark.parametrize(("kv_cache_dtype", "bound"), [("f16", 3e-3), ("bf16", 0.025), ("q8_0", 0.08)])
def test_reduced_precision_kv_caches_stay_close_to_the_f32_one(tiny_models, kv_cache_dtype, bound):
    exact = logits_of(LLM(tiny_models["f32"], kv_cache_dtype="f32"), PROMPT)
    got = logits_of(LLM(tiny_models["f32"], kv_cache_dtype=kv_cache_dtype), PROMPT)
    assert 0 < _max_diff(got, exact) <= bound, "a rounded cache must differ from f32, but only a little"
    assert (got.argmax(axis=1) == exact.argmax(axis=1)).mean() >= 0.9


def test_auto_kv_cache_is_f16_on_the_cpu(tiny_models):
    auto = logits_of(LLM(tiny_models["f32"]), PROMPT)
    f16 = logits_of(LLM(tiny_models["f32"], kv_cache_dtype="f16"), PROMPT)
    assert np.array_equal(auto, f16)
