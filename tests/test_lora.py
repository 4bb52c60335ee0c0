"""LoRA adapters against the NumPy reference run on merged weights (W + scale · B · A).

Adapters are written by tests/tiny_lora.py the way PEFT and llama.cpp write them; the reference never sees
an adapter, only the merged checkpoint, so the engine's unmerged low-rank path is checked against the
definition. Logits compare with kv_cache_dtype="f32" (exact), as in test_model_reference.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import PROMPT, logits_of
from novainfer import LLM, InvalidParameterError, LoRARequest, ModelLoadError, SamplingParams
from gguf_to_hf import TensorEntry, write_safetensors
from numpy_qwen2 import Qwen2Reference, greedy_generate, load_checkpoint, load_safetensors
from tiny_lora import TARGETS, merged, write_gguf_adapter, write_peft_adapter
from tiny_qwen2 import special_token_ids

# Longer than two KV blocks of 16, so a second request with it hits the prefix cache.
LONG_PROMPT = PROMPT * 3


def _rewrite(path, change) -> None:
    """Rewrites a safetensors file's f32 tensors through `change` (name → array to name → array)."""
    tensors = change(load_safetensors(path))
    write_safetensors(path, {k: TensorEntry("F32", v.shape, lambda x=v: x.astype(np.float32)) for k, v in tensors.items()})


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.fixture(scope="module")
def base(tiny_models):
    path = tiny_models["f32"]
    return path, json.loads((path / "config.json").read_text()), load_checkpoint(path)


@pytest.fixture(scope="module")
def lora_llm(base):
    return LLM(base[0], kv_cache_dtype="f32", enable_lora=True, max_loras=4)


def _reference(base, delta) -> Qwen2Reference:
    _, config, weights = base
    return Qwen2Reference(config, merged(weights, delta))


def _logits(llm, request, prompt=PROMPT) -> np.ndarray:
    raw, rows, vocab = llm.prompt_logits(prompt, lora_request=request)
    return np.frombuffer(raw, dtype="<f4").reshape(rows, vocab)


_ids = iter(range(1, 1_000_000))


def _request(path) -> LoRARequest:
    n = next(_ids)
    return LoRARequest(f"adapter-{n}", n, str(path))


@pytest.mark.parametrize("module", list(TARGETS))
def test_each_target_module_matches_the_merged_reference(tmp_path, base, lora_llm, module):
    path, delta = write_peft_adapter(tmp_path / module, targets=(module,), rank=4, alpha=8, seed=3)
    ref = _reference(base, delta).forward(PROMPT)
    plain = Qwen2Reference(base[1], base[2]).forward(PROMPT)
    assert _max_diff(ref, plain) > 0.05, "the adapter must change the logits, or the check means nothing"
    assert _max_diff(_logits(lora_llm, _request(path)), ref) <= 1e-4


@pytest.mark.parametrize(("rank", "rslora"), [(1, False), (8, False), (16, False), (8, True)])
def test_ranks_and_rslora_on_all_projections(tmp_path, base, lora_llm, rank, rslora):
    path, delta = write_peft_adapter(tmp_path / "a", rank=rank, alpha=16, rslora=rslora, seed=rank)
    ref = _reference(base, delta).forward(PROMPT)
    assert _max_diff(_logits(lora_llm, _request(path)), ref) <= 1e-4


def test_bf16_adapter_and_older_peft_names_load(tmp_path, base, lora_llm):
    path, delta = write_peft_adapter(tmp_path / "bf16", dtype="bf16", seed=5)
    assert _max_diff(_logits(lora_llm, _request(path)), _reference(base, delta).forward(PROMPT)) <= 1e-4
    # Older PEFT saves put the adapter's name before `.weight`.
    _rewrite(path / "adapter_model.safetensors", lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()})
    assert _max_diff(_logits(lora_llm, _request(path)), _reference(base, delta).forward(PROMPT)) <= 1e-4


def test_gguf_adapter_equals_the_peft_adapter(tmp_path, base, lora_llm):
    gguf_path, gguf_delta = write_gguf_adapter(tmp_path / "a.gguf", rank=4, alpha=8, seed=9)
    peft_path, peft_delta = write_peft_adapter(tmp_path / "peft", rank=4, alpha=8, seed=9)
    assert all(np.array_equal(gguf_delta[k], peft_delta[k]) for k in peft_delta)
    ref = _reference(base, peft_delta).forward(PROMPT)
    assert _max_diff(_logits(lora_llm, _request(gguf_path)), ref) <= 1e-4
    assert _max_diff(_logits(lora_llm, _request(peft_path)), ref) <= 1e-4


def test_an_adapter_over_a_quantized_gguf_base(tmp_path, tiny_models):
    # The update adds to the packed kernels' output: the Q8_0 base's own error, nothing more.
    path, _ = write_peft_adapter(tmp_path / "a", seed=4)
    request = LoRARequest("a", 1, str(path))
    hf = LLM(tiny_models["f32"], kv_cache_dtype="f32", enable_lora=True)
    q8 = LLM(tiny_models["gguf_q8_0"], kv_cache_dtype="f32", enable_lora=True)
    exact, quantized = _logits(hf, request), _logits(q8, request)
    assert _max_diff(quantized, exact) <= 0.25
    assert (quantized.argmax(axis=1) == exact.argmax(axis=1)).mean() >= 0.9
    base_q8 = logits_of(q8, PROMPT)
    assert _max_diff(quantized, base_q8) > 0.05


def test_a_batch_mixing_three_adapters_and_the_base_model(tmp_path, base, lora_llm):
    eos = set(special_token_ids().values())
    requests, refs = [], []
    for seed, targets in ((11, tuple(TARGETS)), (12, ("q_proj", "v_proj")), (13, ("gate_proj", "down_proj"))):
        path, delta = write_peft_adapter(tmp_path / str(seed), targets=targets, rank=8, alpha=16, seed=seed)
        requests.append(_request(path))
        refs.append(_reference(base, delta))
    requests.append(None)
    refs.append(Qwen2Reference(base[1], base[2]))
    params = SamplingParams(temperature=0, max_tokens=12)
    # Interleaved, twice each: rows of one adapter are not contiguous in the batch.
    prompts = [PROMPT, PROMPT[:7]] * 4
    order = [requests[i % 4] for i in range(8)]
    together = lora_llm.generate(prompts, params, lora_request=order)
    for i, out in enumerate(together):
        want = greedy_generate(refs[i % 4], prompts[i], 12, stop_ids=eos)
        assert out.outputs[0].token_ids == want, f"prompt {i} (adapter {i % 4})"
        alone = lora_llm.generate(prompts[i], params, lora_request=order[i])[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in together[:4]}) == 4, "each adapter answers differently"


def test_adapters_never_share_kv_through_the_prefix_cache(tmp_path, base, lora_llm):
    a_path, a_delta = write_peft_adapter(tmp_path / "a", seed=21)
    b_path, b_delta = write_peft_adapter(tmp_path / "b", seed=22)
    a, b = _request(a_path), _request(b_path)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = lora_llm.generate(LONG_PROMPT, params, lora_request=a)[0]
    again = lora_llm.generate(LONG_PROMPT, params, lora_request=a)[0]
    assert again.num_cached_tokens >= 32, "the same adapter reuses its own prefix"
    other = lora_llm.generate(LONG_PROMPT, params, lora_request=b)[0]
    plain = lora_llm.generate(LONG_PROMPT, params)[0]
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    eos = set(special_token_ids().values())
    for out, delta in ((first, a_delta), (again, a_delta), (other, b_delta)):
        assert out.outputs[0].token_ids == greedy_generate(_reference(base, delta), LONG_PROMPT, 4, stop_ids=eos)


def test_max_loras_one_still_serves_every_adapter(tmp_path, base):
    llm = LLM(base[0], kv_cache_dtype="f32", enable_lora=True, max_loras=1)
    eos = set(special_token_ids().values())
    requests, refs = [], []
    for seed in (31, 32, 33):
        path, delta = write_peft_adapter(tmp_path / str(seed), seed=seed)
        requests.append(LoRARequest(f"a{seed}", seed, str(path)))
        refs.append(_reference(base, delta))
    outs = llm.generate([PROMPT] * 6, SamplingParams(temperature=0, max_tokens=6), lora_request=requests * 2)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == greedy_generate(refs[i % 3], PROMPT, 6, stop_ids=eos)


def test_streams_and_async_take_an_adapter(tmp_path, base, lora_llm):
    import asyncio

    from novainfer import AsyncLLM

    path, delta = write_peft_adapter(tmp_path / "s", seed=41)
    request = _request(path)
    params = SamplingParams(temperature=0, max_tokens=6)
    want = lora_llm.generate(PROMPT, params, lora_request=request)[0].outputs[0].token_ids
    streamed = [t for d in lora_llm.generate_stream(PROMPT, params, lora_request=request) for t in d.token_ids]
    assert streamed == want
    async_llm = AsyncLLM(base[0], kv_cache_dtype="f32", enable_lora=True)
    got = asyncio.run(async_llm.generate(PROMPT, params, lora_request=request))
    assert got.outputs[0].token_ids == want


def test_lora_requests_are_checked(tmp_path, base, lora_llm):
    path, _ = write_peft_adapter(tmp_path / "a", seed=51)
    with pytest.raises(InvalidParameterError, match="LoRA is not enabled"):
        LLM(base[0]).generate(PROMPT, lora_request=LoRARequest("a", 1, str(path)))
    lora_llm.add_lora(LoRARequest("named-once", 999, str(path)))
    with pytest.raises(InvalidParameterError, match="another name"):
        lora_llm.add_lora(LoRARequest("named-once", 998, str(path)))
    with pytest.raises(InvalidParameterError):
        LoRARequest("x", 0, str(path))
    with pytest.raises(InvalidParameterError, match="lora_request"):
        lora_llm.generate([PROMPT, PROMPT], lora_request=[None])
    assert "named-once" in lora_llm.list_loras()
    lora_llm.remove_lora("named-once")
    assert "named-once" not in lora_llm.list_loras()


def _load_error(llm, path, n) -> str:
    with pytest.raises(ModelLoadError) as e:
        llm.add_lora(LoRARequest(f"bad-{n}", 10_000 + n, str(path)))
    return str(e.value)


def test_adapters_that_do_not_fit_are_load_errors_naming_the_field(tmp_path, base, tiny_models, lora_llm):
    n = iter(range(100))
    # Another model's shapes: the tiny model with a wider hidden size.
    from tiny_qwen2 import tiny_config

    wide = tiny_config(head_dim=32)
    wrong, _ = write_peft_adapter(tmp_path / "wide", targets=("q_proj",), seed=1)
    from tiny_lora import lora_weights

    entries = {}
    for (layer, module), (a, b) in lora_weights(targets=("q_proj",), rank=4, seed=1, config=wide).items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
        entries[f"{prefix}.lora_A.weight"] = TensorEntry("F32", a.shape, lambda x=a: x)
        entries[f"{prefix}.lora_B.weight"] = TensorEntry("F32", b.shape, lambda x=b: x)
    write_safetensors(wrong / "adapter_model.safetensors", entries)
    assert "lora_A.weight` has shape [4, 128]" in _load_error(lora_llm, wrong, next(n))

    for extra, field in (
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"bias": "lora_only"}, "bias"),
    ):
        p, _ = write_peft_adapter(tmp_path / field, config_extra=extra, seed=2)
        assert f"`{field}`" in _load_error(lora_llm, p, next(n))

    big, _ = write_peft_adapter(tmp_path / "big", rank=32, seed=3)
    assert "`r` rank 32" in _load_error(lora_llm, big, next(n)) and "max_lora_rank = 16" in _load_error(
        lora_llm, big, next(n)
    )

    corrupt, _ = write_peft_adapter(tmp_path / "corrupt", seed=4)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt" in _load_error(lora_llm, corrupt, next(n))

    missing_b, _ = write_peft_adapter(tmp_path / "missing_b", seed=5)
    _rewrite(
        missing_b / "adapter_model.safetensors",
        lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up_proj.lora_B" not in k},
    )
    assert "has no matching lora_B" in _load_error(lora_llm, missing_b, next(n))

    # A model file is not an adapter; an adapter for another architecture is refused.
    assert "`general.type`" in _load_error(lora_llm, tiny_models["gguf"], next(n))
    llama, _ = write_gguf_adapter(tmp_path / "llama.gguf", architecture="llama")
    assert "`general.architecture`" in _load_error(lora_llm, llama, next(n))
    # The engine still serves after every refusal.
    assert lora_llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids
