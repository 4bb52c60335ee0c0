"""An independent NumPy reference forward for Qwen2: the oracle the Rust model is checked against.

Written from the model's math, not from any engine's code:

    x = embed[ids]
    per layer:  h = rms_norm(x) * w_in
                q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv          (split into heads)
                q, k = rope_neox(q, pos), rope_neox(k, pos)               (absolute positions)
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
        self.rope_theta = (
            config.get("rope_theta") or config.get("rope_parameters", {})["rope_theta"]
        )
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
        inv_freq = self.rope_theta ** (-np.arange(half, dtype=np.float64) * 2 / self.head_dim)
        angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [n, half]
        cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
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
