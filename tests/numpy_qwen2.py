"""An independent NumPy reference forward for Qwen2: the oracle the Rust model is checked against.

Written from the model's math, not from any engine's code:

    x = embed[ids]
    per layer:  h = rms_norm(x) * w_in
                q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv          (split into heads)
                q, k = rope_neox(q, pos), rope_neox(k, pos)               (absolute positions)
                       (frequencies and a cos/sin factor from `rope_scaling`: see `rope_frequencies`)
                a = softmax(q k^T / sqrt(head_dim) + causal_mask) v   (kv head = q head // group)
                x = x + a Wo^T
                h = rms_norm(x) * w_post
                x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T
    logits = (rms_norm(x) * w_final) W_lm^T                             (W_lm = embed when tied)

Invariants:
- All math is float64 by default (`dtype=` to change): weights are widened once at load, so the
  reference's own rounding error (~1e-13) is far below any tolerance a test uses.
- `forward(ids, cache)` appends `ids` after the cache's tokens; prefill in one call and decode one
  token at a time give the same logits.
- `load_safetensors` returns float32 arrays for F32/F16/BF16 files (every F16/BF16 value is exact in
  f32); bf16 is widened by placing its 16 bits in the top of an f32.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

_NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as a float32 array, in file order."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8 : 8 + header_len].tobytes())
    data_start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _NUMPY_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        values = raw[data_start + begin : data_start + end].view(_NUMPY_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = values.astype(np.float32).reshape(info["shape"])
    return tensors


def load_checkpoint(hf_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF directory, single-file or sharded (model.safetensors.index.json)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if not index.exists():
        return load_safetensors(hf_dir / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for file in dict.fromkeys(weight_map.values()):  # each shard once, in first-use order
        tensors.update(load_safetensors(hf_dir / file))
    missing = set(weight_map) - set(tensors)
    if missing:
        raise ValueError(f"{hf_dir}: index names tensors absent from the shards: {sorted(missing)}")
    return tensors


def rope_frequencies(config: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """The rotary inverse frequencies [head_dim/2] and the factor cos and sin are multiplied by.

    Written from transformers' definitions (modeling_rope_utils.py), not from the engine:

    - no scaling (`rope_scaling` absent/null, type "default"):  1 / theta^(2i/d)
    - "linear":   the plain frequencies / factor
    - "dynamic":  theta' = theta * (factor * L / M - (factor - 1)) ** (d / (d - 2)), M =
      max_position_embeddings; transformers uses L = the current length, the engine (like vLLM)
      the longest one, L = M * factor, so that is the reference too
    - "yarn":     `_compute_yarn_parameters`: a ramp between the correction dimensions of beta_fast
      and beta_slow blends theta's frequencies (kept) with them divided by factor; attention factor
      `attention_factor`, else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both
      are non-zero, else get_mscale(factor) = 0.1 ln(factor) + 1 (1 when factor <= 1)

    The scaling is `rope_scaling` when not null, else transformers 5's `rope_parameters`; its type is
    `rope_type`, else `type`.
    """
    theta = config.get("rope_theta") or config.get("rope_parameters", {})["rope_theta"]
    spec = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = spec.get("rope_type", spec.get("type")) or "default"
    d = head_dim
    exponents = np.arange(0, d, 2, dtype=np.float64) / d  # 2i/d
    if kind == "default":
        return 1.0 / theta**exponents, 1.0
    factor = float(spec["factor"])
    if kind == "linear":
        return 1.0 / theta**exponents / factor, 1.0
    if kind == "dynamic":
        m = config["max_position_embeddings"]
        longest = m * factor
        base = theta * ((factor * longest / m) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / base**exponents, 1.0
    if kind != "yarn":
        raise ValueError(f"no reference for rope type {kind!r}")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = spec.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = spec.get("mscale"), spec.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    beta_fast = spec.get("beta_fast") or 32
    beta_slow = spec.get("beta_slow") or 1
    original = spec.get("original_max_position_embeddings") or config["max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 / theta**exponents
    interpolation = extrapolation / factor
    keep = 1.0 - ramp  # share of the unscaled frequency
    return interpolation * (1.0 - keep) + extrapolation * keep, float(attention)


class KVCache:
    """Per-layer keys and values of the tokens so far, each [num_kv_heads, num_tokens, head_dim]."""

    def __init__(self, num_layers: int):
        self.keys: list[np.ndarray | None] = [None] * num_layers
        self.values: list[np.ndarray | None] = [None] * num_layers

    @property
    def num_tokens(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.keys[layer] is not None:
            k = np.concatenate([self.keys[layer], k], axis=1)
            v = np.concatenate([self.values[layer], v], axis=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Qwen2Reference:
    def __init__(self, config: dict, weights: dict[str, np.ndarray], dtype=np.float64):
        self.config = config
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.num_heads
        self.eps = config["rms_norm_eps"]
        self.inv_freq, self.rope_attention_factor = rope_frequencies(config, self.head_dim)
        self.w = {name: w.astype(dtype) for name, w in weights.items()}
        if config.get("tie_word_embeddings", False):
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        elif "lm_head.weight" not in self.w:
            raise ValueError("lm_head.weight is missing and tie_word_embeddings is false")

    @classmethod
    def from_hf_dir(cls, path: str | Path, dtype=np.float64) -> Qwen2Reference:
        config = json.loads((Path(path) / "config.json").read_text())
        return cls(config, load_checkpoint(path), dtype)

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers)

    def forward(self, token_ids: list[int], cache: KVCache | None = None) -> np.ndarray:
        """Logits [len(token_ids), vocab] for `token_ids` placed after the tokens in `cache`."""
        cache = cache if cache is not None else self.new_cache()
        start = cache.num_tokens
        positions = np.arange(start, start + len(token_ids))
        x = self.w["model.embed_tokens.weight"][np.asarray(token_ids)]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            h = self._rms_norm(x, self.w[p + "input_layernorm.weight"])
            x = x + self._attention(h, p + "self_attn.", positions, cache, i)
            h = self._rms_norm(x, self.w[p + "post_attention_layernorm.weight"])
            x = x + self._mlp(h, p + "mlp.")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        return x @ self.w["lm_head.weight"].T

    def _rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _heads(self, x: np.ndarray, num_heads: int) -> np.ndarray:
        """[n, num_heads*head_dim] -> [num_heads, n, head_dim]"""
        return x.reshape(x.shape[0], num_heads, self.head_dim).transpose(1, 0, 2)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """NeoX-style rotary embedding: dimension j pairs with j + head_dim/2 (rotate halves)."""
        half = self.head_dim // 2
        angles = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # [n, half]
        scale = self.rope_attention_factor  # YaRN's; 1 otherwise
        cos, sin = (np.cos(angles) * scale).astype(x.dtype), (np.sin(angles) * scale).astype(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _attention(
        self, h: np.ndarray, prefix: str, positions: np.ndarray, cache: KVCache, layer: int
    ) -> np.ndarray:
        q = self._rope(self._heads(self._linear(h, prefix + "q_proj"), self.num_heads), positions)
        k = self._rope(
            self._heads(self._linear(h, prefix + "k_proj"), self.num_kv_heads), positions
        )
        v = self._heads(self._linear(h, prefix + "v_proj"), self.num_kv_heads)
        k, v = cache.append(layer, k, v)  # now every token so far: [num_kv_heads, total, head_dim]
        group = self.num_heads // self.num_kv_heads
        kv_head = np.arange(self.num_heads) // group
        k, v = k[kv_head], v[kv_head]  # [num_heads, total, head_dim]
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(self.head_dim)  # [num_heads, n, total]
        key_positions = np.arange(k.shape[1])
        scores = np.where(key_positions[None, :] <= positions[:, None], scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = (probs @ v).transpose(1, 0, 2).reshape(h.shape[0], -1)  # [n, num_heads*head_dim]
        return self._linear(out, prefix + "o_proj")

    def _mlp(self, h: np.ndarray, prefix: str) -> np.ndarray:
        gate = self._linear(h, prefix + "gate_proj")
        silu = gate / (1.0 + np.exp(-gate))
        return self._linear(silu * self._linear(h, prefix + "up_proj"), prefix + "down_proj")


def greedy_generate(
    model: Qwen2Reference,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int] = frozenset(),
) -> list[int]:
    """Greedy continuation of `prompt_ids` using the KV cache (one forward per new token)."""
    cache = model.new_cache()
    logits = model.forward(prompt_ids, cache)[-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(logits))
        out.append(token)
        if token in stop_ids:
            break
        logits = model.forward([token], cache)[-1]
    return out
