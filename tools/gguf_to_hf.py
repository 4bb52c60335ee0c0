#!/usr/bin/env python3
"""Dequantize a Qwen2 GGUF file into an f32 Hugging Face checkpoint directory.

    python tools/gguf_to_hf.py model.gguf OUT_DIR

The output (config.json, generation_config.json, model.safetensors in f32, tokenizer.json,
tokenizer_config.json) is what the NumPy reference (tests/numpy_qwen2.py) reads, so a quantized
demo model can be checked against an independent forward pass.

Invariants:
- Tensors are written as PyTorch-layout `[out, in]` f32 arrays under their HF names; GGUF stores
  dimensions innermost-first, so every shape is reversed once, here, and checked against the
  dequantized array.
- model.safetensors is written tensor by tensor: peak memory is one dequantized tensor.
- The HF files use the same layout as the tiny test model (tests/tiny_qwen2.py imports
  `write_safetensors` and `tokenizer_json` from here), so one loader serves both.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp token types (gguf.TokenType) that change how a token is exported; the rest are NORMAL.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5

SAFETENSORS_DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "F8_E4M3": 1}


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: `load()` returns an array whose raw bytes are the payload
    (bf16 is passed as uint16 bit patterns, since NumPy has no bfloat16)."""

    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * SAFETENSORS_DTYPE_SIZE[self.dtype]


def write_safetensors(path: Path, entries: Mapping[str, TensorEntry]) -> int:
    """Write a safetensors file: u64-LE header length, JSON header, then the raw little-endian
    tensor bytes in header order. Returns the payload size in bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry in entries.items():
        header[name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # The payload must start 8-byte aligned so readers can view it in place.
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, entry in entries.items():
            # np.require keeps a scalar's shape () (ascontiguousarray would make it (1,)).
            array = np.require(entry.load(), requirements="C")
            if tuple(array.shape) != entry.shape or array.nbytes != entry.nbytes:
                raise ValueError(
                    f"{name}: produced shape {array.shape} ({array.dtype}), "
                    f"declared {entry.shape} ({entry.dtype})"
                )
            f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    return offset


# --------------------------------------------------------------------------- tokenizer files


def tokenizer_json(
    vocab: Mapping[str, int], merges: Iterable[str], added_tokens: Iterable[tuple[int, str, bool]]
) -> dict:
    """A byte-level BPE tokenizer.json in Qwen2's shape. `vocab` holds the BPE tokens only;
    `added_tokens` are (id, content, special) and live outside the BPE vocab, as in Qwen2.5."""
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": tid,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for tid, content, special in added_tokens
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_SPLIT_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(vocab),
            "merges": list(merges),
        },
    }


def tokenizer_config_json(
    added_tokens: Iterable[tuple[int, str, bool]],
    *,
    eos_token: str,
    pad_token: str | None,
    bos_token: str | None,
    chat_template: str | None,
    model_max_length: int,
) -> dict:
    config: dict[str, object] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for tid, content, special in added_tokens
        },
        "bos_token": bos_token,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- GGUF → HF


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face Qwen2 name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unknown GGUF tensor name {gguf_name!r} for architecture qwen2")


def gguf_tensor_name(hf_name: str) -> str:
    """Inverse of `hf_tensor_name`."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        for gguf_suffix, hf_suffix in _LAYER_NAMES.items():
            if hf_suffix == parts[3]:
                return f"blk.{parts[2]}.{gguf_suffix}"
    raise ValueError(f"no GGUF name for Qwen2 tensor {hf_name!r}")


def _field(reader, key: str, default: object = ...) -> object:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise KeyError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _hf_tokenizer_files(reader, max_len: int) -> tuple[dict, dict, dict]:
    """tokenizer.json, tokenizer_config.json and generation_config.json from GGUF metadata."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges")
    vocab, added = {}, []
    for tid, (token, ttype) in enumerate(zip(tokens, types, strict=True)):
        if ttype == TOKEN_TYPE_UNUSED:
            continue  # llama.cpp's "[PAD{id}]" fillers up to the embedding rows: not HF tokens
        if ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):  # HF "added tokens"
            added.append((tid, token, ttype == TOKEN_TYPE_CONTROL))
        else:
            vocab[token] = tid
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id", None)
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id", None)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    template = _field(reader, "tokenizer.chat_template", None)
    tok_cfg = tokenizer_config_json(
        added,
        eos_token=tokens[eos_id],
        pad_token=None if pad_id is None else tokens[int(pad_id)],
        bos_token=tokens[int(bos_id)] if add_bos and bos_id is not None else None,
        chat_template=template,
        model_max_length=max_len,
    )
    tok_cfg["add_bos_token"] = add_bos
    # GGUF names one eos; like llama.cpp's end-of-generation set, <|endoftext|> also ends a turn.
    eos_ids = [eos_id]
    end_of_text = next((tid for tid, t, special in added if special and t == "<|endoftext|>"), None)
    if end_of_text is not None and end_of_text != eos_id:
        eos_ids.append(end_of_text)
    gen_cfg = {
        "bos_token_id": None if bos_id is None else int(bos_id),
        "eos_token_id": eos_ids,
        "pad_token_id": None if pad_id is None else int(pad_id),
    }
    return tokenizer_json(vocab, merges, added), tok_cfg, gen_cfg


def _f32_to_float(value: float) -> float:
    """GGUF stores these as f32: 1e-6 reads back as 9.99999997e-07. The shortest decimal that
    rounds to the same f32 is what the HF config held."""
    return float(str(np.float32(value)))


def _rope_scaling(reader) -> dict | None:
    """GGUF's `qwen2.rope.scaling.*` keys as config.json's `rope_scaling` (what llama.cpp's converter wrote from
    it: yarn with its factor, original context and betas; linear with its factor); None when there is none."""
    kind = _field(reader, "qwen2.rope.scaling.type", None)
    factor = _field(reader, "qwen2.rope.scaling.factor", None)
    if factor is None:
        factor = _field(reader, "qwen2.rope.scale_linear", None)
    if kind == "none" or not factor:
        return None
    if kind in (None, "linear"):
        return None if factor == 1.0 else {"type": "linear", "factor": _f32_to_float(factor)}
    if kind != "yarn":
        raise ValueError(f"qwen2.rope.scaling.type is {kind!r}; only none, linear and yarn are supported")
    spec = {"type": "yarn", "factor": _f32_to_float(factor)}
    original = _field(reader, "qwen2.rope.scaling.original_context_length", None)
    if original is not None:
        spec["original_max_position_embeddings"] = int(original)
    for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                      ("yarn_beta_slow", "beta_slow")):
        value = _field(reader, f"qwen2.rope.scaling.{key}", None)
        if value is not None:
            spec[name] = _f32_to_float(value)
    return spec


def _hf_config(reader, vocab_size: int, tied: bool, gen_cfg: dict) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise ValueError(f"general.architecture is {arch!r}; only 'qwen2' is supported")
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": int(_field(reader, "qwen2.embedding_length")),
        "intermediate_size": int(_field(reader, "qwen2.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "qwen2.block_count")),
        "num_attention_heads": int(_field(reader, "qwen2.attention.head_count")),
        "num_key_value_heads": int(_field(reader, "qwen2.attention.head_count_kv")),
        "max_position_embeddings": int(_field(reader, "qwen2.context_length")),
        "rope_theta": _f32_to_float(_field(reader, "qwen2.rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32_to_float(_field(reader, "qwen2.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": gen_cfg["bos_token_id"],
        "eos_token_id": gen_cfg["eos_token_id"][0],
        "hidden_act": "silu",
        "use_sliding_window": False,
    } | ({"rope_scaling": scaling} if (scaling := _rope_scaling(reader)) else {})


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the f32 HF directory for `gguf_path` into `out_dir` and return `out_dir`."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: dict[str, TensorEntry] = {}
    for tensor in reader.tensors:
        # GGUF lists ne[0] (the contiguous, input dimension) first; PyTorch puts it last.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))

        def load(tensor=tensor, shape=shape) -> np.ndarray:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if array.shape != shape:
                array = array.reshape(shape)  # 1-D tensors come back flat; same element order
            return array

        entries[hf_tensor_name(tensor.name)] = TensorEntry("F32", shape, load)
    if "model.embed_tokens.weight" not in entries:
        raise ValueError("GGUF has no token_embd.weight")
    tied = "lm_head.weight" not in entries
    vocab_size = entries["model.embed_tokens.weight"].shape[0]

    max_len = int(_field(reader, "qwen2.context_length"))
    tok_json, tok_cfg, gen_cfg = _hf_tokenizer_files(reader, max_len)
    write_json(out_dir / "config.json", _hf_config(reader, vocab_size, tied, gen_cfg))
    write_json(out_dir / "generation_config.json", gen_cfg)
    write_json(out_dir / "tokenizer.json", tok_json)
    write_json(out_dir / "tokenizer_config.json", tok_cfg)
    write_safetensors(out_dir / "model.safetensors", entries)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    convert(args.gguf, args.out_dir)
    print(f"wrote {args.out_dir} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
