#!/usr/bin/env python3
"""Write real-shape Qwen2 GGUF files in llama.cpp's Q4_K_M layout with random blocks, for speed measurements.

    python tools/synthetic_gguf.py {0.5b,1.5b,7b} OUT.gguf --tokenizer TOKENIZER_DIR [--seed N]

The packed-weight paths on a GPU (gpu_weight_dtype="native", the packed GEMV and the tiled GEMM) are measured on the
shapes the issue names (the 1.5B) without moving a model to the GPU machine: a block's values do not change how long
it takes to read and multiply, only its type and the matrix's shape do. The tensors are typed as llama.cpp's
Q4_K_M quantization types Qwen2 (as the 1.5B demo file is): Q4_K for every matrix, Q6_K for attn_v and ffn_down in the
layers llama.cpp's `use_more_bits` picks (the first and last eighth, and every third between) and for the untied
output; norms and biases f32.

Invariants:
- Block bytes are random except each block's f16 scales, drawn from ranges that keep every weight within about
  ±0.03 (the bf16 synthetic checkpoints' std is 0.02): no inf or NaN reaches an activation.
- A pure function of (shape, seed): same arguments, same bytes. `ensure_gguf` rewrites a file only when its
  sidecar record (OUT.gguf.json, written last) does not match.
- The tokenizer is the one of a directory `synthetic_checkpoint.py tokenizer` made (tokenizer.json,
  tokenizer_config.json, generation_config.json), written as GGUF metadata the way llama.cpp's converter does
  (`add_tokenizer`), so a GPU machine with the few-MiB tokenizer directory needs nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_to_hf import gguf_tensor_name  # noqa: E402
from synthetic_checkpoint import resolve_shape, synthetic_config, tensor_shapes  # noqa: E402

# Bytes and values of a block, and the offsets and ranges of its f16 scales: Q4_K's d (×6-bit scale × 4-bit q ≤ 945)
# and dmin (× 6-bit min ≤ 63); Q6_K's d (× int8 scale × (q − 32) ≤ 4096).
BLOCKS: dict[str, dict[str, Any]] = {
    "Q4_K": {"bytes": 144, "values": 256, "scales": ((0, 1e-5, 3e-5), (2, 0.0, 1e-5))},
    "Q6_K": {"bytes": 210, "values": 256, "scales": ((208, 2e-6, 6e-6),)},
}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(spec: Mapping[str, Any]) -> dict[str, str]:
    """HF name → GGUF type ("Q4_K", "Q6_K" or "F32") of every tensor, as Q4_K_M stores Qwen2."""
    layers = int(spec["num_hidden_layers"])
    types = {}
    for name, (_, kind) in tensor_shapes(spec).items():
        if kind != "matrix":
            types[name] = "F32"
        elif name == "lm_head.weight":
            types[name] = "Q6_K"
        elif name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight")):
            layer = int(name.split(".")[2])
            types[name] = "Q6_K" if more_bits(layer, layers) else "Q4_K"
        else:
            types[name] = "Q4_K"
    return types


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / values · bytes] random blocks of `kind`, their f16 scales within BLOCKS' ranges."""
    spec = BLOCKS[kind]
    if cols % spec["values"]:
        raise ValueError(f"{cols} columns are not whole {kind} blocks of {spec['values']}")
    n = rows * cols // spec["values"]
    blocks = rng.integers(0, 256, size=(n, spec["bytes"]), dtype=np.uint8)
    for offset, lo, hi in spec["scales"]:
        scale = rng.uniform(lo, hi, size=n).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def add_hparams(writer, name: str, config: Mapping) -> None:  # noqa: ANN001
    """A Qwen2 config.json's hyperparameters as GGUF metadata, as llama.cpp's converter writes them."""
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def add_tokenizer(writer, tokenizer: Mapping, tokenizer_config: Mapping, vocab_size: int,  # noqa: ANN001
                  bos_id: int | None, eos_id: int) -> None:
    """A HF byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) as GGUF metadata, as llama.cpp's
    converter writes Qwen2's: every id up to `vocab_size` named ("[PAD{id}]", unused, past the tokenizer's),
    added tokens typed control (special) or user-defined."""
    import gguf

    tokens: list[str | None] = [None] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, tid in tokenizer["model"]["vocab"].items():
        tokens[tid], types[tid] = token, gguf.TokenType.NORMAL
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    token_id = {t: i for i, t in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = tokenizer["model"]["merges"]
    # tokenizer.json writes a merge as "a b" or, in newer files, as ["a", "b"].
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(eos_id)
    pad = tokenizer_config.get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    if pad in token_id:
        writer.add_pad_token_id(token_id[pad])
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    writer.add_add_bos_token(False)
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def _record(name: str, spec: Mapping[str, Any], seed: int) -> dict:
    return {"shape": name, "spec": dict(spec), "seed": seed, "layout": "Q4_K_M"}


def write_gguf(out_path: str | Path, shape: str | Mapping[str, Any], tokenizer_dir: str | Path, *,
               seed: int = 0) -> Path:
    """Write the synthetic Q4_K_M GGUF of `shape` (a name of synthetic_checkpoint.SHAPES or a spec) to
    `out_path`, with the tokenizer of `tokenizer_dir`; returns `out_path`."""
    import gguf

    name, spec = resolve_shape(shape)
    out, tokenizer_dir = Path(out_path), Path(tokenizer_dir)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    generation = json.loads((tokenizer_dir / "generation_config.json").read_text(encoding="utf-8"))
    config = synthetic_config(spec, generation)
    out.parent.mkdir(parents=True, exist_ok=True)
    sidecar = out.with_name(out.name + ".json")
    sidecar.unlink(missing_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "qwen2")
    add_hparams(writer, f"synthetic-qwen2-{name}", config)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, tokenizer, tokenizer_config, config["vocab_size"], config["bos_token_id"],
                  config["eos_token_id"])
    rng = np.random.default_rng(seed)
    types = tensor_types(spec)
    for hf_name, (tensor_shape, kind) in tensor_shapes(spec).items():
        gguf_name = gguf_tensor_name(hf_name)
        if types[hf_name] == "F32":
            values = np.ones(tensor_shape, np.float32) if kind == "norm" else (
                rng.standard_normal(tensor_shape).astype(np.float32) * 0.02)
            writer.add_tensor(gguf_name, values)
            continue
        rows, cols = tensor_shape
        qtype = getattr(gguf.GGMLQuantizationType, types[hf_name])
        writer.add_tensor(gguf_name, random_blocks(types[hf_name], rows, cols, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    sidecar.write_text(json.dumps(_record(name, spec, seed), indent=1))
    return out


def ensure_gguf(out_path: str | Path, shape: str | Mapping[str, Any], tokenizer_dir: str | Path, *,
                seed: int = 0) -> tuple[Path, bool]:
    """(out_path, written): writes the file unless its sidecar record says it is already this one."""
    out = Path(out_path)
    name, spec = resolve_shape(shape)
    sidecar = out.with_name(out.name + ".json")
    if out.is_file() and sidecar.is_file():
        try:
            if json.loads(sidecar.read_text()) == _record(name, spec, seed):
                return out, False
        except ValueError:
            pass
    return write_gguf(out, shape, tokenizer_dir, seed=seed), True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", help="0.5b, 1.5b, 7b, or a JSON object of the shape's keys")
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="a directory made by `synthetic_checkpoint.py tokenizer`")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = json.loads(args.shape) if args.shape.lstrip().startswith("{") else args.shape
    path, written = ensure_gguf(args.out, shape, args.tokenizer, seed=args.seed)
    print(f"{path}: {'written' if written else 'already there'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
