#!/usr/bin/env python3
"""Write real-shape Qwen2 Hugging Face checkpoints with random bf16 weights, for speed measurements.

    python tools/synthetic_checkpoint.py tokenizer MODEL.gguf TOKENIZER_DIR
    python tools/synthetic_checkpoint.py write {0.5b,1.5b,7b,'{"hidden_size": ...}'} OUT_DIR --tokenizer TOKENIZER_DIR

A GPU machine that cannot fetch anything still needs a 7B model to measure decode speed; its weights' values do
not change the speed, only their shapes and dtype do. `write` makes such a checkpoint in seconds: config.json,
model.safetensors (bf16, Qwen2's tensor names), and the tokenizer files copied from a directory that `tokenizer`
extracts from a GGUF file's metadata (a few MiB, so it travels where a model cannot).

Invariants:
- Every value comes from one pool of random bf16 values (normal, std 0.02, rounded to nearest even from f32):
  each tensor is a slice of it at a per-tensor offset, wrapping around. Drawing 7.6 billion values would take
  minutes; slicing takes the time of a copy. Norm weights are ones; biases are pool values (std 0.02).
- Everything is a pure function of (shape, seed, pool size): same arguments, same bytes.
- Peak memory is the pool plus one tensor per writing thread (`write_safetensors` streams tensor by tensor).
- Checkpoints over 2 GiB are sharded as HF shards large models (an index file maps tensors to files), and the
  shards are written by parallel threads. Each file is written under a temporary name and renamed; synthetic.json,
  written last, records what was written, and `ensure_checkpoint` rewrites a directory only when it does not match.
- The config's vocab_size is the shape's: the tokenizer may hold fewer tokens than embedding rows, as in the
  real models (ids without a token decode to nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_to_hf import TensorEntry, write_json, write_safetensors  # noqa: E402

# The three shapes benchmarked on a GPU: Qwen2.5-0.5B, DeepSeek-R1-Distill-Qwen-1.5B, Qwen2.5-7B.
SHAPES: dict[str, dict[str, int | bool]] = {
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
REQUIRED_KEYS = tuple(SHAPES["0.5b"])
# Keys a custom shape may set besides the required ones, with the values every named shape uses.
OPTIONAL_DEFAULTS: dict[str, float | int] = {
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
WEIGHT_STD = 0.02
# 64 Mi values (128 MiB of bf16): larger than most single matrices, so few tensors wrap; drawn in ~1 s.
DEFAULT_POOL_VALUES = 64 * 1024 * 1024
# Shards are written in parallel: one thread's writes into the page cache ran at 0.4-0.7 GB/s on a VM here,
# two threads' at twice that. 2 GiB gives the 7B eight shards (the real one has four of ~4 GiB).
DEFAULT_SHARD_BYTES = 2 << 30
BF16_ONE = 0x3F80


# --------------------------------------------------------------------------- tokenizer directory


def write_tokenizer_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json of a Qwen2 GGUF file's tokenizer
    (as tools/gguf_to_hf.py exports them) into `out_dir`; returns `out_dir`. Reads metadata only."""
    from gguf import GGUFReader

    from gguf_to_hf import _field, _hf_tokenizer_files

    reader = GGUFReader(Path(gguf_path))
    max_len = int(_field(reader, "qwen2.context_length"))
    tok_json, tok_cfg, gen_cfg = _hf_tokenizer_files(reader, max_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "tokenizer.json", tok_json)
    write_json(out / "tokenizer_config.json", tok_cfg)
    write_json(out / "generation_config.json", gen_cfg)
    return out


# --------------------------------------------------------------------------- shapes and config


def resolve_shape(shape: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, full shape dict) of a named shape or a custom dict (which needs every key of a named shape and may
    set max_position_embeddings, rope_theta, rms_norm_eps). Raises ValueError naming what is wrong."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; named shapes are {sorted(SHAPES)} (or pass a dict)")
        name, spec = shape, dict(SHAPES[shape])
    else:
        spec = dict(shape)
        name = str(spec.pop("name", "custom"))
    missing = [k for k in REQUIRED_KEYS if k not in spec]
    unknown = sorted(set(spec) - set(REQUIRED_KEYS) - set(OPTIONAL_DEFAULTS))
    if missing or unknown:
        raise ValueError(f"shape {name!r}: missing keys {missing}, unknown keys {unknown}")
    for key in REQUIRED_KEYS:
        if key == "tie_word_embeddings":
            if not isinstance(spec[key], bool):
                raise ValueError(f"shape {name!r}: tie_word_embeddings must be a bool")
        elif not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1:
            raise ValueError(f"shape {name!r}: {key} must be a positive int, got {spec[key]!r}")
    if spec["hidden_size"] % spec["num_attention_heads"]:
        raise ValueError(f"shape {name!r}: hidden_size is not a multiple of num_attention_heads")
    if spec["num_attention_heads"] % spec["num_key_value_heads"]:
        raise ValueError(f"shape {name!r}: num_attention_heads is not a multiple of num_key_value_heads")
    return name, {**OPTIONAL_DEFAULTS, **spec}


def synthetic_config(spec: Mapping[str, Any], generation_config: Mapping[str, Any]) -> dict:
    """config.json of a Qwen2ForCausalLM of shape `spec` (a `resolve_shape` dict) in bf16, with the bos and
    eos ids of the tokenizer's generation config."""
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "max_position_embeddings": spec["max_position_embeddings"],
        "rope_theta": float(spec["rope_theta"]),
        "rms_norm_eps": float(spec["rms_norm_eps"]),
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "torch_dtype": "bfloat16",
        "bos_token_id": generation_config.get("bos_token_id"),
        "eos_token_id": eos,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": spec["max_position_embeddings"],
        "max_window_layers": spec["num_hidden_layers"],
        "attention_dropout": 0.0,
        "initializer_range": WEIGHT_STD,
        "use_cache": True,
    }


def tensor_shapes(spec: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name → (PyTorch [out, in] shape, kind) in checkpoint order; kind is "matrix", "bias" or "norm"."""
    h, f = int(spec["hidden_size"]), int(spec["intermediate_size"])
    heads, kv_heads = int(spec["num_attention_heads"]), int(spec["num_key_value_heads"])
    kv = kv_heads * (h // heads)
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((int(spec["vocab_size"]), h), "matrix")
    }
    for i in range(int(spec["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = ((h,), "norm")
        for proj, out in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{proj}.weight"] = ((out, h), "matrix")
            shapes[p + f"self_attn.{proj}.bias"] = ((out,), "bias")
        shapes[p + "self_attn.o_proj.weight"] = ((h, h), "matrix")
        shapes[p + "post_attention_layernorm.weight"] = ((h,), "norm")
        shapes[p + "mlp.gate_proj.weight"] = ((f, h), "matrix")
        shapes[p + "mlp.up_proj.weight"] = ((f, h), "matrix")
        shapes[p + "mlp.down_proj.weight"] = ((h, f), "matrix")
    shapes["model.norm.weight"] = ((h,), "norm")
    if not spec["tie_word_embeddings"]:
        shapes["lm_head.weight"] = ((int(spec["vocab_size"]), h), "matrix")
    return shapes


# --------------------------------------------------------------------------- values


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of finite f32 values, rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # uint32 suffices: only NaN bit patterns (>= 0xFFFF8000 with the sign set) could carry past 32 bits.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """The f32 values of bf16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def value_pool(seed: int, size: int = DEFAULT_POOL_VALUES) -> np.ndarray:
    """`size` bf16 bit patterns of normal values with std WEIGHT_STD, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    pool = np.empty(size, dtype=np.uint16)
    chunk = 1 << 22  # bounded f32 scratch: 16 MiB at a time instead of the whole pool's 256 MiB
    for start in range(0, size, chunk):
        values = rng.standard_normal(min(chunk, size - start), dtype=np.float32)
        values *= np.float32(WEIGHT_STD)
        pool[start : start + values.size] = f32_to_bf16_bits(values)
    return pool


def pool_slice(pool: np.ndarray, offset: int, count: int) -> np.ndarray:
    """`count` values of `pool` from `offset`, wrapping around: a view when they do not wrap, else one copy."""
    size = pool.size
    offset %= size
    if offset + count <= size:
        return pool[offset : offset + count]
    pieces = [pool[offset:]]
    left = count - (size - offset)
    pieces += [pool] * (left // size)
    pieces.append(pool[: left % size])
    return np.concatenate(pieces)


def tensor_entries(
    spec: Mapping[str, Any], seed: int, pool: np.ndarray
) -> dict[str, TensorEntry]:
    """BF16 `TensorEntry`s of every tensor of shape `spec`, their values sliced from `pool` at offsets drawn
    from `seed` (loaded lazily, one tensor at a time, by `write_safetensors`)."""
    shapes = tensor_shapes(spec)
    offsets = np.random.default_rng([seed, 1]).integers(0, pool.size, size=len(shapes))
    entries: dict[str, TensorEntry] = {}
    for (name, (shape, kind)), offset in zip(shapes.items(), offsets.tolist(), strict=True):
        count = int(np.prod(shape, dtype=np.int64))

        def load(shape=shape, kind=kind, offset=offset, count=count) -> np.ndarray:
            if kind == "norm":
                return np.full(shape, BF16_ONE, dtype=np.uint16)
            return pool_slice(pool, offset, count).reshape(shape)

        entries[name] = TensorEntry("BF16", shape, load)
    return entries


# --------------------------------------------------------------------------- checkpoint


def shard_plan(entries: Mapping[str, TensorEntry], shard_bytes: int) -> list[list[str]]:
    """Tensor names split, in order, into consecutive shards of at most `shard_bytes` each (a tensor larger than
    that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, entry in entries.items():
        if shards[-1] and size + entry.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += entry.nbytes
    return shards


def _record(name: str, spec: Mapping[str, Any], seed: int, pool_values: int, shard_bytes: int) -> dict:
    return {"shape": name, "spec": dict(spec), "seed": seed, "pool_values": pool_values, "shard_bytes": shard_bytes}


def _weight_files(out: Path) -> list[Path]:
    partial = out.glob("model*.safetensors.partial")
    return [*out.glob("model*.safetensors"), *partial, out / "model.safetensors.index.json"]


def write_checkpoint(
    out_dir: str | Path,
    shape: str | Mapping[str, Any],
    tokenizer_dir: str | Path,
    *,
    seed: int = 0,
    pool_values: int = DEFAULT_POOL_VALUES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a synthetic Qwen2 checkpoint of `shape` (a name in SHAPES or a custom dict, see `resolve_shape`)
    into `out_dir`, with the tokenizer files of `tokenizer_dir` (see `write_tokenizer_dir`); returns `out_dir`.

    Weights over `shard_bytes` are split into shards (model-0000i-of-0000n.safetensors with
    model.safetensors.index.json, as HF saves large models), written by parallel threads."""
    name, spec = resolve_shape(shape)
    tokenizer_dir, out = Path(tokenizer_dir), Path(out_dir)
    missing = [f for f in TOKENIZER_FILES if not (tokenizer_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{tokenizer_dir} lacks tokenizer files {missing} (see the `tokenizer` command)")
    out.mkdir(parents=True, exist_ok=True)
    # A directory being rewritten is incomplete until synthetic.json is written: drop it and every weight file
    # first (a loader would otherwise mix an old single file with new shards).
    (out / "synthetic.json").unlink(missing_ok=True)
    for stale in _weight_files(out):
        stale.unlink(missing_ok=True)
    for file in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / file, out / file)
    generation_config = json.loads((tokenizer_dir / "generation_config.json").read_text(encoding="utf-8"))
    write_json(out / "config.json", synthetic_config(spec, generation_config))
    entries = tensor_entries(spec, seed, value_pool(seed, pool_values))
    shards = shard_plan(entries, shard_bytes)
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    def write(i: int) -> int:
        partial = out / (files[i] + ".partial")
        size = write_safetensors(partial, {n: entries[n] for n in shards[i]})
        partial.replace(out / files[i])
        return size

    threads = max(1, min(len(shards), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(write, range(len(shards))))
    if len(shards) > 1:
        weight_map = {n: files[i] for i, names in enumerate(shards) for n in names}
        write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(out / "synthetic.json", _record(name, spec, seed, pool_values, shard_bytes))
    return out


def is_complete(
    out_dir: str | Path,
    shape: str | Mapping[str, Any],
    *,
    seed: int = 0,
    pool_values: int = DEFAULT_POOL_VALUES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> bool:
    """Whether `out_dir` holds a finished checkpoint written by `write_checkpoint` with these arguments."""
    out = Path(out_dir)
    name, spec = resolve_shape(shape)
    try:
        record = json.loads((out / "synthetic.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    # Through JSON, as it was stored: tuples and floats compare as they read back.
    wanted = json.loads(json.dumps(_record(name, spec, seed, pool_values, shard_bytes)))
    if record != wanted or not all((out / f).is_file() for f in ("config.json", *TOKENIZER_FILES)):
        return False
    index = out / "model.safetensors.index.json"
    if not index.is_file():
        return (out / "model.safetensors").is_file()
    try:
        shard_files = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return False
    return all((out / f).is_file() for f in shard_files)


def ensure_checkpoint(
    out_dir: str | Path,
    shape: str | Mapping[str, Any],
    tokenizer_dir: str | Path,
    *,
    seed: int = 0,
    pool_values: int = DEFAULT_POOL_VALUES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[Path, bool]:
    """(out_dir, written): writes the checkpoint unless `out_dir` already holds it (see `is_complete`)."""
    kwargs = {"seed": seed, "pool_values": pool_values, "shard_bytes": shard_bytes}
    if is_complete(out_dir, shape, **kwargs):
        return Path(out_dir), False
    return write_checkpoint(out_dir, shape, tokenizer_dir, **kwargs), True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer", help="extract a GGUF file's tokenizer as HF tokenizer files")
    tok.add_argument("gguf", type=Path)
    tok.add_argument("out_dir", type=Path)
    write = sub.add_parser("write", help="write a synthetic checkpoint (skipped when already there)")
    write.add_argument("shape", help=f"{', '.join(SHAPES)} or a JSON object with the keys {', '.join(REQUIRED_KEYS)}")
    write.add_argument("out_dir", type=Path)
    write.add_argument("--tokenizer", type=Path, required=True, help="a directory made by the tokenizer command")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--force", action="store_true", help="rewrite even when the directory holds it already")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.command == "tokenizer":
        write_tokenizer_dir(args.gguf, args.out_dir)
        print(f"wrote {args.out_dir} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        return 0
    shape = json.loads(args.shape) if args.shape.lstrip().startswith("{") else args.shape
    if args.force:
        write_checkpoint(args.out_dir, shape, args.tokenizer, seed=args.seed)
        written = True
    else:
        _, written = ensure_checkpoint(args.out_dir, shape, args.tokenizer, seed=args.seed)
    what = "wrote" if written else "already there:"
    print(f"{what} {args.out_dir} ({time.perf_counter() - start:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
