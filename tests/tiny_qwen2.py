#!/usr/bin/env python3
"""Generate a tiny random Qwen2 checkpoint (HF directory, optionally GGUF) from a seed.

    python tests/tiny_qwen2.py OUT_DIR [--dtype f32|bf16|f16] [--sharded] [--tied] [--seed N]
                                       [--gguf PATH [--qtype f32|q8_0]]

The directory looks like a real Qwen2ForCausalLM checkpoint (Qwen2.5-Instruct flavour: ChatML
template, two eos ids) so loaders, tokenizer and template code are exercised exactly as with a
real model, in milliseconds.

Invariants:
- Everything is a pure function of the arguments: same seed and options, same bytes.
- Weights are drawn in f32 in a fixed order and only then cast, so a bf16/f16 checkpoint holds
  exactly the f32 checkpoint's values rounded (round-to-nearest-even) to that dtype.
- vocab_size (448) equals the tokenizer's size: 256 byte tokens, then BPE merges in training
  order, then the three special tokens; no unused ids.
- Scales are chosen so logits have std ~1: a 1e-4 tolerance on them is a real check.
- safetensors files are written by tools/gguf_to_hf.write_safetensors (numpy + json, no
  `safetensors` package); GGUF files by the `gguf` package's GGUFWriter.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gguf_to_hf import (  # noqa: E402
    TensorEntry,
    gguf_tensor_name,
    tokenizer_config_json,
    tokenizer_json,
    write_json,
    write_safetensors,
)

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 512
ROPE_THETA = 1e4  # not transformers' 1e6 Qwen2 default: catches a hard-coded theta
RMS_NORM_EPS = 1e-6
VOCAB_SIZE = 448
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-Coder's fill-in-the-middle and repo-level tokens, added after the vocabulary (ids 448..453) when a
# model is written with fim=True; the first 448 ids and their weights are those of the plain model.
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
NUM_SHARDS = 3

TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}

# Qwen2.5-Instruct's chat template, verbatim: the engine must render it like transformers does.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\n"
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# The BPE training text. Its words become whole tokens, so prompts used in tests stay short.
CORPUS = """\
The capital of France is Paris. Paris is the capital and the largest city of France.
What is the capital of France? The capital of France is Paris, and the capital of Italy is Rome.
Hello, world! hello there. Hello again, hello world. Say hello to the world.
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
system user assistant tool The user asks and the assistant answers the question.
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
Once upon a time there was a little model that could count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
def hello(name):\n    return "Hello, " + name + "!"\n
print(hello("world"))  # prints Hello, world!
It's a test; we're testing the tokenizer, and they'll see what I'd do.
In the beginning the engine reads the weights, then it answers the questions of the users.
Tokens are generated one at a time, and the cache keeps the keys and the values of the past.
"""


# --------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map; its order is the order of ids 0..255."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codepoints, strict=True)}


# The Qwen2 split regex restricted to ASCII (Python's `re` has no \p{L}); CORPUS is ASCII, and on
# ASCII text the two agree, so trained merges line up with how the real pre-tokenizer splits.
_ASCII_SPLIT = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_bpe(corpus: str, num_tokens: int) -> tuple[list[str], list[str]]:
    """Byte-level BPE: returns (vocab tokens in id order, merges as "a b") with
    len(vocab) == num_tokens. Ties between equally frequent pairs go to the smaller pair, so
    training is deterministic."""
    assert corpus.isascii(), "the ASCII split regex only matches Qwen2's on ASCII text"
    byte_map = bytes_to_unicode()
    words = collections.Counter(
        tuple(byte_map[b] for b in piece.encode()) for piece in _ASCII_SPLIT.findall(corpus)
    )
    vocab = list(byte_map.values())
    known = set(vocab)
    merges: list[str] = []
    while len(vocab) < num_tokens:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            raise ValueError(f"corpus too small for {num_tokens} tokens")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        merged = best[0] + best[1]
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
        words = collections.Counter({_merge(word, best, merged): c for word, c in words.items()})
    return vocab, merges


def _merge(word: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def special_token_ids() -> dict[str, int]:
    first = VOCAB_SIZE - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def fim_token_ids() -> dict[str, int]:
    """Ids of the FIM tokens in a model written with fim=True."""
    return {token: VOCAB_SIZE + i for i, token in enumerate(FIM_TOKENS)}


def _write_tokenizer(out_dir: Path, *, fim: bool = False) -> None:
    vocab, merges = train_bpe(CORPUS, VOCAB_SIZE - len(SPECIAL_TOKENS))
    specials = special_token_ids()
    added = [(tid, token, True) for token, tid in specials.items()]
    if fim:
        added += [(tid, token, True) for token, tid in fim_token_ids().items()]
    write_json(
        out_dir / "tokenizer.json",
        tokenizer_json({t: i for i, t in enumerate(vocab)}, merges, added),
    )
    write_json(
        out_dir / "tokenizer_config.json",
        tokenizer_config_json(
            added,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            bos_token=None,
            chat_template=QWEN25_CHAT_TEMPLATE,
            model_max_length=MAX_POSITIONS,
        ),
    )


# --------------------------------------------------------------------------- weights


def _dims(head_dim: int | None) -> tuple[int, int, int]:
    """(hidden_size, intermediate_size, head_dim). None gives the module's sizes, read at call time (the Web
    UI tests patch them to build a wider model); a head size widens the tiny model to it with the same head
    counts and intermediate/hidden ratio (the GPU's attention kernels exist for head_dim 64, 128, 256 only)."""
    if head_dim is None:
        return HIDDEN_SIZE, INTERMEDIATE_SIZE, HIDDEN_SIZE // NUM_HEADS
    hidden = head_dim * NUM_HEADS
    return hidden, INTERMEDIATE_SIZE * hidden // HIDDEN_SIZE, head_dim


def tiny_config(
    *,
    dtype: str = "f32",
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
) -> dict:
    """config.json of the tiny model; `rope_scaling` (written as given) and a smaller
    `max_position_embeddings` make a long-context variant whose positions past the original window
    tests can reach with short prompts."""
    specials = special_token_ids()
    hidden, intermediate, _ = _dims(head_dim)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        # Read at call time, not bound as a default: tests patch MAX_POSITIONS for a longer context.
        "max_position_embeddings": MAX_POSITIONS if max_position_embeddings is None else max_position_embeddings,
        "rope_theta": ROPE_THETA,
        "rms_norm_eps": RMS_NORM_EPS,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": TORCH_DTYPES[dtype],
        "bos_token_id": specials["<|endoftext|>"],
        "eos_token_id": specials["<|im_end|>"],
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": MAX_POSITIONS,
        "max_window_layers": NUM_LAYERS,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def tiny_weights(
    *, seed: int = 0, tie_word_embeddings: bool = False, head_dim: int | None = None, extra_vocab: int = 0
) -> dict[str, np.ndarray]:
    """f32 weights under HF names, PyTorch [out, in] layout, in checkpoint order.

    With RMS-normalised inputs (rms ~1), a [out, in] matrix of std s gives outputs of std
    s*sqrt(in): s = 1/sqrt(in) keeps q, k, v, gate, up and the logits at std ~1, and the two
    residual writers (o_proj, down_proj) are scaled down to the embedding's size so no block
    drowns the residual stream.
    """
    rng = np.random.default_rng(seed)
    HIDDEN_SIZE, INTERMEDIATE_SIZE, head_dim = _dims(head_dim)  # noqa: N806 - the module's names, widened
    kv_dim = NUM_KV_HEADS * head_dim
    embed_std = 1.0 / np.sqrt(HIDDEN_SIZE)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + rng.standard_normal(HIDDEN_SIZE) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal((VOCAB_SIZE, HIDDEN_SIZE), embed_std)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        for name, out_dim in (("q_proj", HIDDEN_SIZE), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            weights[p + f"self_attn.{name}.weight"] = normal((out_dim, HIDDEN_SIZE), embed_std)
            weights[p + f"self_attn.{name}.bias"] = normal((out_dim,), 0.2)
        weights[p + "self_attn.o_proj.weight"] = normal((HIDDEN_SIZE, HIDDEN_SIZE), embed_std / 8)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = normal((INTERMEDIATE_SIZE, HIDDEN_SIZE), embed_std)
        weights[p + "mlp.up_proj.weight"] = normal((INTERMEDIATE_SIZE, HIDDEN_SIZE), embed_std)
        weights[p + "mlp.down_proj.weight"] = normal(
            (HIDDEN_SIZE, INTERMEDIATE_SIZE), 1.0 / np.sqrt(INTERMEDIATE_SIZE) / 8
        )
    weights["model.norm.weight"] = norm_weight()
    if not tie_word_embeddings:
        weights["lm_head.weight"] = normal((VOCAB_SIZE, HIDDEN_SIZE), embed_std)
    if extra_vocab:
        # Drawn last, so every other weight is the plain model's.
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] = np.concatenate([weights[name], normal((extra_vocab, HIDDEN_SIZE), embed_std)])
    return weights


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of f32 values, rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _entry(array: np.ndarray, dtype: str) -> TensorEntry:
    if dtype == "bf16":
        return TensorEntry("BF16", array.shape, lambda: f32_to_bf16_bits(array))
    if dtype == "f16":
        return TensorEntry("F16", array.shape, lambda: array.astype(np.float16))
    return TensorEntry("F32", array.shape, lambda: array)


def write_tiny_model(
    out_dir: str | Path,
    *,
    dtype: str = "f32",
    sharded: bool = False,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    head_dim: int | None = None,
    fim: bool = False,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
) -> Path:
    """Write the tiny Qwen2 HF directory into `out_dir` (created if needed) and return it. With `fim` the
    tokenizer also has Qwen2.5-Coder's FIM tokens (`FIM_TOKENS`, ids from 448) and the vocabulary grows to match.
    `rope_scaling` and `max_position_embeddings` go to config.json as given (the weights do not change)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(
        dtype=dtype,
        tie_word_embeddings=tie_word_embeddings,
        head_dim=head_dim,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    extra_vocab = len(FIM_TOKENS) if fim else 0
    config["vocab_size"] += extra_vocab
    write_json(out / "config.json", config)
    specials = special_token_ids()
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": specials["<|endoftext|>"],
            "eos_token_id": [specials["<|im_end|>"], specials["<|endoftext|>"]],
            "pad_token_id": specials["<|endoftext|>"],
        },
    )
    _write_tokenizer(out, fim=fim)

    weights = tiny_weights(
        seed=seed, tie_word_embeddings=tie_word_embeddings, head_dim=head_dim, extra_vocab=extra_vocab
    )
    entries = {name: _entry(w, dtype) for name, w in weights.items()}
    if not sharded:
        write_safetensors(out / "model.safetensors", entries)
        return out
    # Contiguous chunks: a layer's tensors straddle a shard boundary, as in real checkpoints.
    names = list(entries)
    bounds = np.linspace(0, len(names), NUM_SHARDS + 1).round().astype(int)
    weight_map, total = {}, 0
    for s in range(NUM_SHARDS):
        file = f"model-{s + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        chunk = {n: entries[n] for n in names[bounds[s] : bounds[s + 1]]}
        total += write_safetensors(out / file, chunk)
        weight_map.update({n: file for n in chunk})
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    return out


# --------------------------------------------------------------------------- GGUF


def write_tiny_gguf(out_path: str | Path, *, hf_dir: str | Path, qtype: str = "f32") -> Path:
    """Write the HF checkpoint in `hf_dir` as a GGUF file the way llama.cpp's converter would
    for Qwen2; with qtype "q8_0" the 2-D weights are Q8_0 and norms/biases stay f32. A `rope_scaling`
    in its config.json becomes llama.cpp's `rope.scaling.*` keys as convert_hf_to_gguf.py writes them
    (yarn: type, factor, original context, and beta_fast/beta_slow/attention_factor when given;
    linear: type and factor); GGUF has no dynamic NTK for Qwen2, so that is refused."""
    import gguf
    from numpy_qwen2 import load_checkpoint
    from synthetic_gguf import add_hparams, add_tokenizer

    if qtype not in ("f32", "q8_0"):
        raise ValueError(f"qtype must be 'f32' or 'q8_0', got {qtype!r}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_path), "qwen2")
    add_hparams(writer, "tiny-qwen2", config)
    _add_rope_scaling(writer, config.get("rope_scaling"))
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if qtype == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0
    )
    if qtype != "f32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, tok, tok_cfg, config["vocab_size"], config["bos_token_id"], config["eos_token_id"])

    for hf_name, array in load_checkpoint(hf_dir).items():
        array = array.astype(np.float32)
        if qtype == "q8_0" and array.ndim == 2:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                gguf_tensor_name(hf_name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(gguf_tensor_name(hf_name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_rope_scaling(writer, spec: dict | None) -> None:
    """config.json's rope_scaling as llama.cpp's converter writes it into GGUF metadata."""
    import gguf

    if not spec:
        return
    kind = spec.get("rope_type", spec.get("type"))
    if kind in (None, "default"):
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec["factor"])
        if "original_max_position_embeddings" in spec:
            writer.add_rope_scaling_orig_ctx_len(spec["original_max_position_embeddings"])
        if spec.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(spec["attention_factor"])
        if spec.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(spec["beta_fast"])
        if spec.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(spec["beta_slow"])
    else:
        raise ValueError(f"llama.cpp's GGUF has no Qwen2 rope scaling {kind!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random Qwen2 checkpoint.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="f32")
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--tied", action="store_true", help="tie_word_embeddings (no lm_head)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", type=Path, help="also write the model as a GGUF file here")
    parser.add_argument("--qtype", choices=["f32", "q8_0"], default="f32")
    args = parser.parse_args(argv)
    out = write_tiny_model(
        args.out_dir,
        dtype=args.dtype,
        sharded=args.sharded,
        tie_word_embeddings=args.tied,
        seed=args.seed,
    )
    print(out)
    if args.gguf:
        print(write_tiny_gguf(args.gguf, hf_dir=out, qtype=args.qtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
