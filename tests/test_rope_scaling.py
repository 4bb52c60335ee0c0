"""RoPE scaling (config.json's `rope_scaling`, GGUF's `rope.scaling.*`): the engine's logits against the
independent NumPy reference (tests/numpy_qwen2.py `rope_frequencies`) at positions past the original window.

Each tiny model keeps the tiny weights but states `max_position_embeddings` 16 with a scaling, so a prompt
of 56 tokens runs far past the window the scaling extends (Qwen2.5's 128k YaRN setup, 8192 times smaller).
The context the engine serves is vLLM's: the window times the factor (YaRN: original_max_position_embeddings
times the factor)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import logits_of
from novainfer import LLM
from novainfer.errors import InvalidParameterError, ModelLoadError
from numpy_qwen2 import Qwen2Reference, load_checkpoint
from tiny_qwen2 import write_tiny_gguf, write_tiny_model

WINDOW = 16
# Ordinary ids of the tiny vocabulary (special tokens start at 445), positions 0..55.
PROMPT = [(7 * i + 3) % 440 for i in range(56)]

SCALINGS = {
    # Qwen2.5's documented form: defaults for the betas (32/1) and the attention factor.
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW},
    # Betas that put the ramp inside the tiny head (dims 0..3 of 8), untruncated: fractional blends.
    "yarn_ramp": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": WINDOW,
        "beta_fast": 4,
        "beta_slow": 0.25,
        "truncate": False,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": WINDOW,
        "beta_fast": 4,
        "beta_slow": 0.25,
        "mscale": 0.707,
        "mscale_all_dim": 0.5,
    },
    # No original_max_position_embeddings: max_position_embeddings is the original window.
    "yarn_attention": {"type": "yarn", "factor": 4.0, "attention_factor": 1.25, "beta_fast": 4, "beta_slow": 0.25},
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}
GGUF_SCALINGS = ["yarn", "yarn_attention", "linear"]  # what llama.cpp's converter can write


def _context(spec: dict) -> int:
    return int(WINDOW * spec["factor"])


@pytest.fixture(scope="module")
def scaled_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("rope-scaling")
    models = {
        name: write_tiny_model(root / name, rope_scaling=spec, max_position_embeddings=WINDOW)
        for name, spec in SCALINGS.items()
    }
    models["plain"] = write_tiny_model(root / "plain", max_position_embeddings=WINDOW)
    return models


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.mark.parametrize("variant", list(SCALINGS))
def test_scaled_prompt_logits_match_the_reference_past_the_window(scaled_models, variant):
    ref_model = Qwen2Reference.from_hf_dir(scaled_models[variant])
    ref = ref_model.forward(PROMPT)
    llm = LLM(scaled_models[variant], kv_cache_dtype="f32")
    assert llm.max_model_len == _context(SCALINGS[variant])
    got = logits_of(llm, PROMPT)
    assert _max_diff(got, ref) <= 1e-4
    # Token by token: every key rotated when it was written, read back by later queries.
    stepped = logits_of(llm, PROMPT, step_by_step=True)
    assert _max_diff(stepped, ref) <= 1e-4
    # Not vacuous: the scaling changes the logits past the window by far more than the tolerance.
    plain = Qwen2Reference(
        {k: v for k, v in ref_model.config.items() if k != "rope_scaling"}, load_checkpoint(scaled_models[variant])
    ).forward(PROMPT)
    assert _max_diff(got[WINDOW:], plain[WINDOW:]) > 1e-2


@pytest.mark.parametrize("variant", GGUF_SCALINGS)
def test_gguf_rope_scaling_keys_match_the_reference(scaled_models, tmp_path, variant):
    gguf = write_tiny_gguf(tmp_path / f"{variant}.gguf", hf_dir=scaled_models[variant])
    ref = Qwen2Reference.from_hf_dir(scaled_models[variant]).forward(PROMPT)
    llm = LLM(gguf, kv_cache_dtype="f32")
    assert llm.max_model_len == _context(SCALINGS[variant])
    assert _max_diff(logits_of(llm, PROMPT), ref) <= 1e-4


def test_the_scaled_context_bounds_max_model_len(scaled_models):
    context = _context(SCALINGS["yarn"])
    assert LLM(scaled_models["yarn"], max_model_len=context).max_model_len == context
    with pytest.raises(InvalidParameterError) as err:
        LLM(scaled_models["yarn"], max_model_len=context + 1)
    assert err.value.param == "max_model_len"
    assert str(context) in str(err.value) and "rope_scaling" in str(err.value)
    # Without scaling the window itself is the limit.
    assert LLM(scaled_models["plain"]).max_model_len == WINDOW


def test_unscaled_spellings_change_no_bit(scaled_models, tmp_path):
    plain = logits_of(LLM(scaled_models["plain"], kv_cache_dtype="f32"), PROMPT[:WINDOW])
    for i, spec in enumerate([None, {"rope_type": "default"}, {"type": "linear", "factor": 1.0}]):
        path = write_tiny_model(tmp_path / f"m{i}", max_position_embeddings=WINDOW)
        config = json.loads((path / "config.json").read_text())
        config["rope_scaling"] = spec
        (path / "config.json").write_text(json.dumps(config))
        # (Linear by 1 divides every frequency by 1.0: the same angles, the same bits.)
        assert np.array_equal(logits_of(LLM(path, kv_cache_dtype="f32"), PROMPT[:WINDOW]), plain), spec


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"type": "longrope", "factor": 4.0}, "rope_scaling.type"),
        ({"rope_type": "yarn"}, "rope_scaling.factor"),
        ({"type": "linear", "factor": -2.0}, "rope_scaling.factor"),
        ({"factor": 4.0}, "rope_scaling.type"),
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "rope_scaling.original_max_position_embeddings"),
    ],
)
def test_a_bad_rope_scaling_fails_the_load_naming_the_field(tmp_path, spec, field):
    path = write_tiny_model(tmp_path / "bad", rope_scaling=spec, max_position_embeddings=WINDOW)
    with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
        LLM(path)
