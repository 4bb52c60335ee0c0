"""FP8 (e4m3) checkpoints of the tiny model, written here with NumPy, against the float64 reference run on
the weights the files define.

`quant_method: fp8` as vLLM serializes it (an f32 `weight_scale` per tensor, or per output channel) and as
transformers' FineGrainedFP8 and the DeepSeek/Qwen3 FP8 releases do (`weight_block_size: [bo, bi]`, one
`weight_scale_inv` per block, multiplied despite its name). Weights are stored as e4m3fn codes (sign, 4
exponent bits biased by 7, 3 mantissa bits; no infinities, S.1111.111 is NaN; largest value 448). The
reference decodes the codes with its own table and multiplies by the scale in float32, as the engine does at
load, so the engine's dense f32 layers must match it as an f32 checkpoint does (1e-4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPT, logits_of
from gguf_to_hf import TensorEntry, write_safetensors
from novainfer import LLM, ModelLoadError, SamplingParams
from numpy_qwen2 import Qwen2Reference, greedy_generate, load_safetensors
from test_awq_gptq import SAFETENSORS_KIND, read_raw_safetensors, write_with_quantized_linears
from tiny_qwen2 import special_token_ids, write_tiny_model

HEAD_DIM = 64  # hidden 256, intermediate 512


def e4m3_table() -> np.ndarray:
    """The value of every e4m3fn code, float64 (NaN for the two NaN codes)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, (codes & 7).astype(np.float64)
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    value[(exp == 15) & ((codes & 7) == 7)] = np.nan
    return sign * value


TABLE = e4m3_table()
FINITE = np.flatnonzero(~np.isnan(TABLE))


def encode(x: np.ndarray) -> np.ndarray:
    """The nearest e4m3 code of each value (|x| <= 448 expected), a tie going to the even code (the cast's
    rounding)."""
    values = TABLE[FINITE]
    order = np.argsort(values)
    sorted_values, sorted_codes = values[order], FINITE[order]
    i = np.clip(np.searchsorted(sorted_values, x), 1, len(sorted_values) - 1)
    left, right = sorted_values[i - 1], sorted_values[i]
    below, above = np.abs(x - left), np.abs(right - x)
    even_left = (sorted_codes[i - 1] & 1) == 0
    pick = np.where(below < above, i - 1, np.where(below > above, i, np.where(even_left, i - 1, i)))
    return sorted_codes[pick].astype(np.uint8)


def fp8_tensors(w: np.ndarray, qcfg: dict, granularity: str) -> dict[str, np.ndarray]:
    out, inp = w.shape
    w = w.astype(np.float64)
    if "weight_block_size" in qcfg:
        bo, bi = qcfg["weight_block_size"]
        rows, cols = -(-out // bo), -(-inp // bi)
        scale = np.zeros((rows, cols), dtype=np.float32)
        for r in range(rows):
            for c in range(cols):
                scale[r, c] = max(np.abs(w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi]).max() / 448, 1e-8)
        full = np.repeat(np.repeat(scale.astype(np.float64), bo, axis=0), bi, axis=1)[:out, :inp]
        return {"weight": encode(w / full), "weight_scale_inv": scale}
    if granularity == "channel":
        scale = np.maximum(np.abs(w).max(axis=1, keepdims=True) / 448, 1e-8).astype(np.float32)  # [out, 1]
        return {"weight": encode(w / scale), "weight_scale": scale}
    scale = np.float32(max(np.abs(w).max() / 448, 1e-8))
    return {"weight": encode(w / scale), "weight_scale": np.array(scale, dtype=np.float32)}  # shape []


VARIANTS = {
    # name: (quantization_config, scale granularity without blocks)
    "per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor"),
    "per-channel": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "channel"),
    "blocks-128": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}, None),
    # Blocks that do not divide the layers: the last row and column of blocks are partial.
    "blocks-96x80": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [96, 80]}, None),
    # Static activation scales and FP8 KV-cache scales are accepted and not used (activations and the KV
    # cache stay in their own dtypes here).
    "static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor"),
}


def write_fp8(out: Path, qcfg: dict, granularity: str | None, seed: int = 0) -> Path:
    """The tiny model with every decoder linear layer in FP8; embeddings, norms, biases, lm_head stay f32."""

    def parts_of(prefix: str, array: np.ndarray) -> dict[str, np.ndarray]:
        parts = fp8_tensors(array, qcfg, granularity)
        if qcfg["activation_scheme"] == "static":
            parts["input_scale"] = np.array(0.01, dtype=np.float32)
        return parts

    path = write_with_quantized_linears(out, qcfg, "bfloat16", parts_of, seed)
    if qcfg["activation_scheme"] == "static":
        # An FP8 KV cache's scales, as vLLM writes them beside the attention's projections.
        tensors = read_raw_safetensors(path / "model.safetensors")
        for layer in range(json.loads((path / "config.json").read_text())["num_hidden_layers"]):
            for kv in ("k_scale", "v_scale"):
                tensors[f"model.layers.{layer}.self_attn.{kv}"] = np.array(0.5, dtype=np.float32)
        entries = {n: TensorEntry(SAFETENSORS_KIND[a.dtype], a.shape, lambda a=a: a) for n, a in tensors.items()}
        write_safetensors(path / "model.safetensors", entries)
    return path


def reference_for(path: Path) -> Qwen2Reference:
    config = json.loads((path / "config.json").read_text())
    qcfg = config["quantization_config"]
    tensors = read_raw_safetensors(path / "model.safetensors")
    weights = {}
    for name, array in tensors.items():
        if array.dtype == np.uint8:
            prefix = name.removesuffix(".weight")
            q = TABLE[array].astype(np.float32)
            out, inp = q.shape
            if "weight_block_size" in qcfg:
                bo, bi = qcfg["weight_block_size"]
                s = tensors[f"{prefix}.weight_scale_inv"]
                s = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inp]
            else:
                s = tensors[f"{prefix}.weight_scale"]
                s = s.reshape(-1, 1) if s.size == out else s.reshape(1, 1)
            weights[name] = q * s.astype(np.float32)  # one float32 rounding, as the engine's
        elif not name.endswith(("weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale")):
            weights[name] = array.astype(np.float32)
    return Qwen2Reference(config, weights)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {name: write_fp8(root / name, qcfg, g) for name, (qcfg, g) in VARIANTS.items()}


def test_the_writer_and_reader_hold_the_model_in_fp8(fp8_models, tmp_path):
    # A broken encoder or scale layout would be far off; e4m3 keeps about 3 significant bits.
    original = load_safetensors(write_tiny_model(tmp_path / "f32", head_dim=HEAD_DIM) / "model.safetensors")
    for name in VARIANTS:
        ref = reference_for(fp8_models[name])
        for layer in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
            w = original[layer].astype(np.float64)
            rel = np.linalg.norm(ref.w[layer] - w) / np.linalg.norm(w)
            assert 0.005 < rel < 0.08, (name, layer, rel)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_the_reference_on_the_dequantized_weights(fp8_models, variant):
    ref = reference_for(fp8_models[variant]).forward(PROMPT)
    assert ref.std() > 0.5, "degenerate logits would make the comparison meaningless"
    got = logits_of(LLM(fp8_models[variant], kv_cache_dtype="f32"), PROMPT)
    assert float(np.abs(got.astype(np.float64) - ref).max()) <= 1e-4


def test_greedy_generation_matches_the_reference(fp8_models):
    eos = set(special_token_ids().values())
    path = fp8_models["blocks-96x80"]
    expected = greedy_generate(reference_for(path), PROMPT, 16, stop_ids=eos)
    out = LLM(path, kv_cache_dtype="f32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))
    assert out[0].outputs[0].token_ids == expected


def _edit(src: Path, dst: Path, *, config=None, drop: str | None = None, reshape: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop or reshape:
        tensors = read_raw_safetensors(dst / "model.safetensors")
        if drop:
            del tensors[drop]
        if reshape:
            tensors[reshape] = tensors[reshape][:-1].copy()
        entries = {n: TensorEntry(SAFETENSORS_KIND[a.dtype], a.shape, lambda a=a: a) for n, a in tensors.items()}
        write_safetensors(dst / "model.safetensors", entries)
    return dst


def test_bad_fp8_checkpoints_are_load_errors_naming_what(fp8_models, tmp_path):
    layer = "model.layers.1.mlp.up_proj"
    no_config = _edit(fp8_models["per-tensor"], tmp_path / "no-config",
                      config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight|FP8|F8E4M3"):
        LLM(no_config)
    e5m2 = _edit(fp8_models["per-tensor"], tmp_path / "e5m2",
                 config=lambda c: c["quantization_config"].update(fmt="e5m2"))
    with pytest.raises(ModelLoadError, match="e5m2"):
        LLM(e5m2)
    no_scale = _edit(fp8_models["per-channel"], tmp_path / "no-scale", drop=f"{layer}.weight_scale")
    with pytest.raises(ModelLoadError, match=rf"{layer}\.weight_scale"):
        LLM(no_scale)
    torn = _edit(fp8_models["blocks-128"], tmp_path / "torn", reshape=f"{layer}.weight_scale_inv")
    with pytest.raises(ModelLoadError, match=rf"{layer}.*block scales"):
        LLM(torn)


# quantization="fp8": a dense checkpoint's decoder layers quantized at load, as vLLM's dynamic FP8 does.

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def online_fp8_reference(path: Path) -> Qwen2Reference:
    """The float64 reference on `path`'s weights with every decoder projection quantized in float32 as vLLM's
    dynamic FP8 does: s = amax / 448 per output channel, q = e4m3(w / s) saturated at ±448, w' = q · s. A
    projection whose rows are not whole groups of 128 inputs (the engine's FP8 blocks) stays as it is."""
    config = json.loads((path / "config.json").read_text())
    weights = load_safetensors(path / "model.safetensors")
    for layer in range(config["num_hidden_layers"]):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}.weight"
            w = weights[name].astype(np.float32)
            if w.shape[1] % 128:
                continue
            amax = np.abs(w).max(axis=1, keepdims=True)
            s = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
            q = TABLE[encode(np.clip(w / s, -448, 448))].astype(np.float32)
            weights[name] = q * s
    return Qwen2Reference(config, weights)


@pytest.fixture(scope="module")
def dense_256(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dense-256") / "m", dtype="bf16", head_dim=HEAD_DIM)


def test_online_fp8_matches_the_reference_on_its_quantized_weights(dense_256):
    ref_model = online_fp8_reference(dense_256)
    plain = Qwen2Reference(json.loads((dense_256 / "config.json").read_text()),
                           load_safetensors(dense_256 / "model.safetensors"))
    # The quantization is real: e4m3 moves each weight by up to 1/16 of its binade.
    w = "model.layers.1.mlp.up_proj.weight"
    rel = np.linalg.norm(ref_model.w[w] - plain.w[w]) / np.linalg.norm(plain.w[w])
    assert 0.005 < rel < 0.08, rel
    ref = ref_model.forward(PROMPT)
    got = logits_of(LLM(dense_256, quantization="fp8", kv_cache_dtype="f32"), PROMPT)
    assert float(np.abs(got.astype(np.float64) - ref).max()) <= 1e-4
    unquantized = logits_of(LLM(dense_256, kv_cache_dtype="f32"), PROMPT)
    assert float(np.abs(unquantized - got).max()) > 1e-3, "quantization=fp8 changed nothing"
    eos = set(special_token_ids().values())
    expected = greedy_generate(ref_model, PROMPT, 16, stop_ids=eos)
    out = LLM(dense_256, quantization="fp8", kv_cache_dtype="f32").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16))
    assert out[0].outputs[0].token_ids == expected


def test_online_fp8_keeps_an_fp8_checkpoint_and_layers_it_cannot_group(fp8_models, tmp_path):
    # An FP8 checkpoint is kept as it is. In the 64-wide tiny model only down_proj (128 inputs) has rows of whole
    # groups: it is quantized, the other projections stay dense.
    path = fp8_models["per-channel"]
    assert np.array_equal(logits_of(LLM(path, quantization="fp8"), PROMPT), logits_of(LLM(path), PROMPT))
    narrow = write_tiny_model(tmp_path / "narrow")
    ref = online_fp8_reference(narrow).forward(PROMPT)
    got = logits_of(LLM(narrow, quantization="fp8", kv_cache_dtype="f32"), PROMPT)
    assert float(np.abs(got.astype(np.float64) - ref).max()) <= 1e-4
    assert float(np.abs(got - logits_of(LLM(narrow, kv_cache_dtype="f32"), PROMPT)).max()) > 1e-3


def test_online_fp8_refuses_quantized_checkpoints_and_unknown_methods(tmp_path):
    from tiny_qwen2 import write_tiny_gguf

    from novainfer import InvalidParameterError

    hf = write_tiny_model(tmp_path / "hf")
    gguf = write_tiny_gguf(tmp_path / "q8.gguf", hf_dir=hf, qtype="q8_0")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*already Q8_0"):
        LLM(gguf, quantization="fp8")
    with pytest.raises(InvalidParameterError, match="quantization"):
        LLM(hf, quantization="int8")
    from test_awq_gptq import VARIANTS as INT_VARIANTS
    from test_awq_gptq import write_quantized

    awq = write_quantized(tmp_path / "awq", INT_VARIANTS["awq-g128"][0])
    with pytest.raises(ModelLoadError, match="quant_method awq"):
        LLM(awq, quantization="fp8")
