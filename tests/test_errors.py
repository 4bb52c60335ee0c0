"""Every bad input gets a typed exception whose message names the culprit, and the engine survives it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import novainfer
from conftest import PROMPT
from novainfer import (
    LLM,
    ChatTemplateError,
    InvalidParameterError,
    ModelLoadError,
    ModelNotFoundError,
    NovaInferError,
    PromptTooLongError,
    SamplingParams,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gguf_to_hf import TensorEntry, write_safetensors  # noqa: E402
from numpy_qwen2 import load_safetensors  # noqa: E402


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"stop": [""]}, "stop", "empty"),
        ({"stop": 5}, "stop", "string"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param, needle):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value) and needle in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, NovaInferError)


def test_missing_model_path_lists_demo_names(tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        LLM(tmp_path / "nope")
    assert "qwen2.5-coder-0.5b" in str(info.value)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_models, tmp_path):
    model = _copy(tiny_models["f32"], tmp_path / "llama")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM"):
        LLM(model)


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(tmp_path / "empty")


def test_truncated_gguf_is_reported(tiny_models, tmp_path):
    data = tiny_models["gguf"].read_bytes()
    for cut in (len(data) // 2, 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            LLM(path)


def test_truncated_safetensors_is_reported(tiny_models, tmp_path):
    model = _copy(tiny_models["f32"], tmp_path / "cut")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(model)


def _rewrite_weights(model: Path, edit) -> None:
    tensors = load_safetensors(model / "model.safetensors")
    edit(tensors)
    entries = {k: TensorEntry("F32", v.shape, lambda v=v: v) for k, v in tensors.items()}
    write_safetensors(model / "model.safetensors", entries)


def test_missing_tensor_is_named(tiny_models, tmp_path):
    model = _copy(tiny_models["f32"], tmp_path / "missing")
    _rewrite_weights(model, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(model)


def test_misshaped_tensor_names_both_shapes(tiny_models, tmp_path):
    model = _copy(tiny_models["f32"], tmp_path / "shape")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(model, lambda t: t.__setitem__(name, t[name][:16]))
    with pytest.raises(ModelLoadError) as info:
        LLM(model)
    assert name in str(info.value) and "[16, 64]" in str(info.value) and "[32, 64]" in str(info.value)


def test_unexpected_tensor_is_named(tiny_models, tmp_path):
    model = _copy(tiny_models["f32"], tmp_path / "extra")
    _rewrite_weights(model, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", t["model.norm.weight"]))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        LLM(model)


def test_prompt_too_long_names_both_numbers(tiny_models):
    llm = LLM(tiny_models["f32"], max_model_len=32)
    with pytest.raises(PromptTooLongError) as info:
        llm.generate(PROMPT, SamplingParams(max_tokens=30))
    message = str(info.value)
    assert info.value.param == "max_tokens"
    assert "32" in message and str(len(PROMPT)) in message and "30" in message
    # The engine is still usable afterwards.
    assert llm.generate(PROMPT, SamplingParams(max_tokens=3))[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [("", "empty"), ([10_000], "10000"), (3.5, "float"), ([1, -2], "non-negative"), ([[1, "a"]], "list")],
)
def test_bad_prompts_are_rejected(tiny_llm, prompt, needle):
    with pytest.raises(InvalidParameterError, match=needle) as info:
        tiny_llm.generate(prompt)
    assert info.value.param in ("prompt", "prompts")


def test_sampling_params_count_must_match(tiny_llm):
    with pytest.raises(InvalidParameterError) as info:
        tiny_llm.generate([PROMPT, PROMPT], [SamplingParams()])
    assert info.value.param == "sampling_params"


@pytest.mark.parametrize("messages", ["hi", [{"role": "user"}], [{"role": "user", "content": 3}], [["user", "hi"]]])
def test_malformed_messages_are_rejected(tiny_llm, messages):
    with pytest.raises(InvalidParameterError) as info:
        tiny_llm.chat(messages)
    assert info.value.param == "messages"


def _with_template(src: Path, dst: Path, template: str | None) -> Path:
    model = _copy(src, dst)
    config = json.loads((model / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_template_raise_exception_becomes_chat_template_error(tiny_models, tmp_path):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('a system turn must come first') }}{% endif %}"
    llm = LLM(_with_template(tiny_models["f32"], tmp_path / "strict", template))
    with pytest.raises(ChatTemplateError, match="a system turn must come first"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_missing_chat_template_is_a_chat_template_error(tiny_models, tmp_path):
    llm = LLM(_with_template(tiny_models["f32"], tmp_path / "plain", None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"max_model_len": 100_000}, "max_model_len"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"seed": -1}, "seed"),
        ({"kv_cache_bytes": 4 * 4096, "max_model_len": 128}, "kv_cache_bytes"),  # 4 f16 blocks: 64 tokens
        ({"kv_cache_fraction": 1.5}, "kv_cache_fraction"),
        ({"kv_cache_fraction": 0.5, "kv_cache_bytes": 1 << 20}, "kv_cache_fraction"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_engine_arguments_name_the_parameter(tiny_models, kwargs, param):
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], **kwargs)
    assert info.value.param == param and param in str(info.value)


def test_error_classes_are_exported():
    for name in ("NovaInferError", "InvalidParameterError", "PromptTooLongError", "ModelLoadError", "EngineError"):
        assert issubclass(getattr(novainfer, name), NovaInferError)
