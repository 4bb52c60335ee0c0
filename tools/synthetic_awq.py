#!/usr/bin/env python3
"""Write a random-weight AWQ (GEMM, 4-bit, group 128) checkpoint in a real Qwen2 model's shape, for speed
measurements of the AWQ load path without downloading an AWQ model.

    python tools/synthetic_awq.py OUT_DIR [--shape 1.5b|0.5b] [--seed N] [--vocab N]

Decoder linear layers are AWQ-packed (qweight/qzeros int32, scales f16) with uniformly random integers and
small scales; embeddings (tied, as in Qwen2.5-0.5B/1.5B), norms and biases are f16, as in the published
Qwen2.5-*-AWQ checkpoints. The tokenizer is the test suite's tiny one (448 ids, all below the model's
vocabulary), which is all `novainfer bench latency` needs. The values are meaningless; the shapes, dtypes and
layout are those of the real checkpoint, so load time, memory and step speed are. `--vocab 448` shrinks the
(tied, dense) embedding to the tokenizer's size, leaving the decoder layers' cost alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gguf_to_hf import TensorEntry, write_safetensors  # noqa: E402
from tiny_qwen2 import _write_tokenizer, special_token_ids  # noqa: E402

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab (Qwen2.5-*-Instruct's config.json)
    "0.5b": (896, 4864, 24, 14, 2, 151936),
    "1.5b": (1536, 8960, 28, 12, 2, 151936),
}
GROUP = 128


def write(out: Path, shape: str, seed: int, vocab: int | None = None) -> Path:
    hidden, inter, layers, heads, kv_heads, full_vocab = SHAPES[shape]
    vocab = vocab or full_vocab
    kv = hidden // heads * kv_heads
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)

    def f16(*dims: int, std: float) -> TensorEntry:
        return TensorEntry("F16", dims, lambda: (rng.standard_normal(dims) * std).astype(np.float16))

    def words(*dims: int) -> TensorEntry:
        return TensorEntry("I32", dims, lambda: rng.integers(-(2**31), 2**31, size=dims, dtype=np.int64).astype(np.int32))

    def awq(prefix: str, out_dim: int, in_dim: int) -> dict[str, TensorEntry]:
        return {
            f"{prefix}.qweight": words(in_dim, out_dim // 8),
            f"{prefix}.qzeros": words(in_dim // GROUP, out_dim // 8),
            f"{prefix}.scales": TensorEntry(
                "F16", (in_dim // GROUP, out_dim),
                lambda: (rng.random((in_dim // GROUP, out_dim)) * 2e-3 / np.sqrt(in_dim)).astype(np.float16)),
        }

    entries = {"model.embed_tokens.weight": f16(vocab, hidden, std=0.02)}
    for i in range(layers):
        p = f"model.layers.{i}"
        entries[f"{p}.input_layernorm.weight"] = f16(hidden, std=0.1)
        for name, dim in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            entries.update(awq(f"{p}.self_attn.{name}", dim, hidden))
            entries[f"{p}.self_attn.{name}.bias"] = f16(dim, std=0.1)
        entries.update(awq(f"{p}.self_attn.o_proj", hidden, hidden))
        entries[f"{p}.post_attention_layernorm.weight"] = f16(hidden, std=0.1)
        entries.update(awq(f"{p}.mlp.gate_proj", inter, hidden))
        entries.update(awq(f"{p}.mlp.up_proj", inter, hidden))
        entries.update(awq(f"{p}.mlp.down_proj", hidden, inter))
    entries["model.norm.weight"] = f16(hidden, std=0.1)
    write_safetensors(out / "model.safetensors", entries)

    specials = special_token_ids()
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 32768,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "float16",
        "bos_token_id": specials["<|endoftext|>"], "eos_token_id": specials["<|im_end|>"], "hidden_act": "silu",
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                                "zero_point": True, "modules_to_not_convert": None},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=None, help="embedding rows (default: the real model's)")
    args = parser.parse_args(argv)
    print(write(args.out_dir, args.shape, args.seed, args.vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
