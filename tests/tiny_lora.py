"""LoRA adapters for the tiny Qwen2 model, written the way PEFT and llama.cpp write them, from a seed.

`write_peft_adapter` writes a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, tensors
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``, A ``[r, in]``, B ``[out, r]``);
`write_gguf_adapter` writes the same update as llama.cpp's ``convert_lora_to_gguf.py`` does (``general.type =
adapter``, ``adapter.lora.alpha``, ``blk.{i}.{attn_q|...}.weight.lora_{a|b}``). Each returns the update it
wrote as the dense deltas ``scale · B · A`` by weight name, following each format's documentation on its own:
``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` — so `merged` gives the
weights a correct engine must behave like, for the NumPy reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gguf_to_hf import TensorEntry, gguf_tensor_name, write_safetensors
from tiny_qwen2 import NUM_LAYERS, tiny_config

#: Every projection a LoRA may adapt, with its block in the layer.
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def _shape(module: str, config: dict) -> tuple[int, int]:
    """(out, in) of a projection."""
    h, ffn = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return {
        "q_proj": (h, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, h),
        "gate_proj": (ffn, h),
        "up_proj": (ffn, h),
        "down_proj": (h, ffn),
    }[module]


def lora_weights(
    *, targets: tuple[str, ...], rank: int, seed: int, config: dict | None = None, layers: tuple[int, ...] | None = None
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) → (A [r, in], B [out, r]) in f32. Unlike a freshly initialised PEFT adapter (B = 0),
    B is random: a trained adapter's update is not zero, and a zero one would test nothing."""
    config = config or tiny_config()
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers if layers is not None else range(NUM_LAYERS):
        for module in targets:
            o, i = _shape(module, config)
            a = (rng.standard_normal((rank, i)) / np.sqrt(i)).astype(np.float32)
            b = (rng.standard_normal((o, rank)) * 0.5 / np.sqrt(rank)).astype(np.float32)
            out[(layer, module)] = (a, b)
    return out


def deltas(
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]], *, alpha: float, rslora: bool = False
) -> dict[str, np.ndarray]:
    """HF weight name → scale · B · A in float64, as PEFT merges an adapter."""
    out = {}
    for (layer, module), (a, b) in weights.items():
        r = a.shape[0]
        scale = alpha / np.sqrt(r) if rslora else alpha / r
        name = f"model.layers.{layer}.{TARGETS[module]}.{module}.weight"
        out[name] = scale * (b.astype(np.float64) @ a.astype(np.float64))
    return out


def merged(base: dict[str, np.ndarray], delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`base` with each delta added to its weight (W + scale · B · A), in float64."""
    out = {name: w.astype(np.float64) for name, w in base.items()}
    for name, d in delta.items():
        out[name] = out[name] + d
    return out


def write_peft_adapter(
    out_dir: str | Path,
    *,
    targets: tuple[str, ...] = tuple(TARGETS),
    rank: int = 4,
    alpha: float = 8.0,
    rslora: bool = False,
    seed: int = 1,
    dtype: str = "f32",
    config_extra: dict | None = None,
    layers: tuple[int, ...] | None = None,
    model_config: dict | None = None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """A PEFT adapter directory and the deltas it applies, for a model of `model_config` (default the tiny
    model's). `dtype` "bf16" stores the tensors as bf16 (the deltas are then those of the rounded values)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = lora_weights(targets=targets, rank=rank, seed=seed, layers=layers, config=model_config)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny-qwen2",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.05,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": rslora,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        **(config_extra or {}),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    entries = {}
    stored = {}
    for (layer, module), (a, b) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
        if dtype == "bf16":
            from tiny_qwen2 import f32_to_bf16_bits

            a_bits, b_bits = f32_to_bf16_bits(a), f32_to_bf16_bits(b)
            entries[f"{prefix}.lora_A.weight"] = TensorEntry("BF16", a.shape, lambda x=a_bits: x)
            entries[f"{prefix}.lora_B.weight"] = TensorEntry("BF16", b.shape, lambda x=b_bits: x)
            widen = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
            stored[(layer, module)] = (widen(a_bits), widen(b_bits))
        else:
            entries[f"{prefix}.lora_A.weight"] = TensorEntry("F32", a.shape, lambda x=a: x)
            entries[f"{prefix}.lora_B.weight"] = TensorEntry("F32", b.shape, lambda x=b: x)
            stored[(layer, module)] = (a, b)
    write_safetensors(out / "adapter_model.safetensors", entries)
    return out, deltas(stored, alpha=alpha, rslora=rslora)


def write_gguf_adapter(
    out_path: str | Path,
    *,
    targets: tuple[str, ...] = tuple(TARGETS),
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 1,
    architecture: str = "qwen2",
) -> tuple[Path, dict[str, np.ndarray]]:
    """The same update as `write_peft_adapter` with the same arguments, as a llama.cpp GGUF adapter."""
    import gguf

    out_path = Path(out_path)
    weights = lora_weights(targets=targets, rank=rank, seed=seed)
    writer = gguf.GGUFWriter(str(out_path), architecture)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for (layer, module), (a, b) in weights.items():
        base = gguf_tensor_name(f"model.layers.{layer}.{TARGETS[module]}.{module}.weight")
        # numpy (r, in) is GGML ne [in, r], as llama.cpp expects lora_a; (out, r) is ne [r, out] for lora_b.
        writer.add_tensor(f"{base}.lora_a", a)
        writer.add_tensor(f"{base}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path, deltas(weights, alpha=alpha)
