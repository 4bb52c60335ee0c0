"""Self-consistency of the tiny-model generator, the NumPy reference and the GGUF → HF converter.

These guard the oracles themselves: if the reference or the fixtures drift, every parity test that
leans on them would pass or fail for the wrong reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_qwen2  # noqa: E402
from numpy_qwen2 import (  # noqa: E402
    Qwen2Reference,
    greedy_generate,
    load_checkpoint,
    load_safetensors,
)

PROMPT_IDS = [398, 291, 258, 292, 273, 300, 30, 445, 12, 99]  # mixes merges, bytes and a special


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "f32": tiny_qwen2.write_tiny_model(root / "f32"),
        "bf16": tiny_qwen2.write_tiny_model(root / "bf16", dtype="bf16"),
        "f16": tiny_qwen2.write_tiny_model(root / "f16", dtype="f16"),
        "sharded": tiny_qwen2.write_tiny_model(root / "sharded", sharded=True),
        "tied": tiny_qwen2.write_tiny_model(root / "tied", tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def reference(model_dirs) -> Qwen2Reference:
    return Qwen2Reference.from_hf_dir(model_dirs["f32"])


# --------------------------------------------------------------------------- reference forward


def test_logits_have_unit_scale_and_depend_on_context(reference):
    logits = reference.forward(PROMPT_IDS)
    assert logits.shape == (len(PROMPT_IDS), tiny_qwen2.VOCAB_SIZE)
    assert 0.5 < logits.std() < 2.0, "a 1e-4 tolerance is only meaningful on logits of std ~1"
    # Same tokens in another order: only RoPE tells them apart, so it must be live.
    a, b = reference.forward([5, 6, 258])[-1], reference.forward([6, 5, 258])[-1]
    assert np.abs(a - b).max() > 1e-2


@pytest.mark.parametrize("variant", ["f32", "tied"])
def test_prefill_equals_stepwise_decode(model_dirs, variant):
    model = Qwen2Reference.from_hf_dir(model_dirs[variant])
    prefill = model.forward(PROMPT_IDS)
    cache = model.new_cache()
    for t, token in enumerate(PROMPT_IDS):
        step = model.forward([token], cache)
        assert cache.num_tokens == t + 1
        np.testing.assert_allclose(step[0], prefill[t], atol=1e-5, rtol=0)


def test_chunked_prefill_equals_full_prefill(reference):
    prefill = reference.forward(PROMPT_IDS)
    cache = reference.new_cache()
    chunks = [PROMPT_IDS[:4], PROMPT_IDS[4:7], PROMPT_IDS[7:]]
    got = np.concatenate([reference.forward(chunk, cache) for chunk in chunks])
    np.testing.assert_allclose(got, prefill, atol=1e-5, rtol=0)


def test_causal_mask_hides_future_tokens(reference):
    a = reference.forward(PROMPT_IDS)
    b = reference.forward(PROMPT_IDS[:5] + [7, 8, 9])
    # Not bit-equal: OpenBLAS's AVX-512 kernels (an Emerald Rapids Xeon) block a product by its row count,
    # so a row of this 10-row and of that 8-row product can round differently (2e-15 seen). A leaking mask moves the logits
    # by ~0.1.
    np.testing.assert_allclose(a[:5], b[:5], rtol=0, atol=1e-10)


def test_reference_matches_a_loop_implementation_on_one_layer(model_dirs):
    """Cross-check the vectorised attention/RoPE against a per-head scalar loop for one token."""
    weights = load_checkpoint(model_dirs["f32"])
    config = json.loads((model_dirs["f32"] / "config.json").read_text())
    one_layer = dict(config, num_hidden_layers=1)
    model = Qwen2Reference(one_layer, weights)
    ids = [10, 20, 30]
    got = model.forward(ids)[-1]

    w = {k: v.astype(np.float64) for k, v in weights.items()}
    d, nh, nkv, eps = 16, 4, 2, config["rms_norm_eps"]
    theta = config["rope_theta"]

    def norm(x, g):
        return x / np.sqrt((x**2).mean() + eps) * g

    def rope(vec, pos):
        out = vec.copy()
        for j in range(d // 2):
            angle = pos / theta ** (2 * j / d)
            a, b = vec[j], vec[j + d // 2]
            out[j], out[j + d // 2] = (
                a * np.cos(angle) - b * np.sin(angle),
                b * np.cos(angle) + a * np.sin(angle),
            )
        return out

    p = "model.layers.0.self_attn."
    xs = [w["model.embed_tokens.weight"][i] for i in ids]
    hs = [norm(x, w["model.layers.0.input_layernorm.weight"]) for x in xs]
    qs = [w[p + "q_proj.weight"] @ h + w[p + "q_proj.bias"] for h in hs]
    ks = [w[p + "k_proj.weight"] @ h + w[p + "k_proj.bias"] for h in hs]
    vs = [w[p + "v_proj.weight"] @ h + w[p + "v_proj.bias"] for h in hs]
    last = len(ids) - 1
    heads = []
    for head in range(nh):
        kvh = head // (nh // nkv)
        q = rope(qs[last][head * d : (head + 1) * d], last)
        scores = np.array(
            [rope(ks[j][kvh * d : (kvh + 1) * d], j) @ q / np.sqrt(d) for j in range(len(ids))]
        )
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        heads.append(sum(probs[j] * vs[j][kvh * d : (kvh + 1) * d] for j in range(len(ids))))
    x = xs[last] + w[p + "o_proj.weight"] @ np.concatenate(heads)
    h = norm(x, w["model.layers.0.post_attention_layernorm.weight"])
    gate = w["model.layers.0.mlp.gate_proj.weight"] @ h
    x = x + w["model.layers.0.mlp.down_proj.weight"] @ (
        gate / (1 + np.exp(-gate)) * (w["model.layers.0.mlp.up_proj.weight"] @ h)
    )
    want = w["lm_head.weight"] @ norm(x, w["model.norm.weight"])
    np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)


def test_greedy_generate_uses_the_cache_consistently(reference):
    out = greedy_generate(reference, PROMPT_IDS, 5)
    ids = list(PROMPT_IDS)
    for token in out:  # recompute each step from scratch, no cache
        assert token == int(np.argmax(reference.forward(ids)[-1]))
        ids.append(token)


# --------------------------------------------------------------------------- checkpoint files


def test_generation_is_deterministic_and_seeded(tmp_path, model_dirs):
    again = tiny_qwen2.write_tiny_model(tmp_path / "again")
    other = tiny_qwen2.write_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dirs["f32"] / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_hf_layout_names_shapes_and_config(model_dirs):
    config = json.loads((model_dirs["f32"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["rope_theta"] == 1e4 and config["torch_dtype"] == "float32"
    weights = load_safetensors(model_dirs["f32"] / "model.safetensors")
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)  # [out, in]
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert weights["model.layers.0.self_attn.v_proj.bias"].shape == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    assert len(weights) == 1 + 12 * 2 + 2
    gen = json.loads((model_dirs["f32"] / "generation_config.json").read_text())
    specials = tiny_qwen2.special_token_ids()
    assert gen["eos_token_id"] == [specials["<|im_end|>"], specials["<|endoftext|>"]]


def test_sharded_and_single_checkpoints_agree(model_dirs):
    index = json.loads((model_dirs["sharded"] / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert not (model_dirs["sharded"] / "model.safetensors").exists()
    single = Qwen2Reference.from_hf_dir(model_dirs["f32"]).forward(PROMPT_IDS)
    sharded = Qwen2Reference.from_hf_dir(model_dirs["sharded"]).forward(PROMPT_IDS)
    np.testing.assert_array_equal(single, sharded)


def test_tied_checkpoint_has_no_lm_head_and_uses_the_embedding(model_dirs):
    weights = load_safetensors(model_dirs["tied"] / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert (
        json.loads((model_dirs["tied"] / "config.json").read_text())["tie_word_embeddings"] is True
    )
    model = Qwen2Reference.from_hf_dir(model_dirs["tied"])
    assert model.w["lm_head.weight"] is model.w["model.embed_tokens.weight"]


def _bf16_nearest(x: np.ndarray) -> np.ndarray:
    """Round f32 to bf16 by comparing the two neighbouring bf16 values (independent of the
    generator's add-and-shift trick); ties go to the even mantissa."""
    bits = x.astype(np.float32).view(np.uint32)
    low_bits = bits & np.uint32(0xFFFF0000)
    high_bits = low_bits + np.uint32(0x10000)
    low = low_bits.view(np.float32).astype(np.float64)
    high = high_bits.view(np.float32).astype(np.float64)
    d_low, d_high = np.abs(x - low), np.abs(high - x)
    low_is_even = (low_bits >> 16) % 2 == 0
    take_low = (d_low < d_high) | ((d_low == d_high) & low_is_even)
    return np.where(take_low, low, high).astype(np.float32)


def test_bf16_and_f16_files_hold_rounded_f32_values(model_dirs):
    f32 = load_safetensors(model_dirs["f32"] / "model.safetensors")
    bf16 = load_safetensors(model_dirs["bf16"] / "model.safetensors")
    f16 = load_safetensors(model_dirs["f16"] / "model.safetensors")
    header_len = int.from_bytes(
        (model_dirs["bf16"] / "model.safetensors").read_bytes()[:8], "little"
    )
    header = json.loads((model_dirs["bf16"] / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((model_dirs["bf16"] / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, value in f32.items():
        np.testing.assert_array_equal(bf16[name], _bf16_nearest(value), err_msg=name)
        np.testing.assert_array_equal(
            f16[name], value.astype(np.float16).astype(np.float32), err_msg=name
        )
        assert not np.array_equal(bf16[name], value)


def test_bf16_rounding_ties_to_even():
    # 1 + 2^-8 lies exactly between bf16 1.0 and 1 + 2^-7: the even one (1.0) wins;
    # 1 + 3*2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6: the even one (1 + 2^-6) wins.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=np.float32)
    bits = tiny_qwen2.f32_to_bf16_bits(x).astype(np.uint32) << 16
    np.testing.assert_array_equal(bits.view(np.float32), [1.0, 1 + 2**-6, -1.0])


# --------------------------------------------------------------------------- tokenizer and template


def test_tokenizer_loads_and_round_trips(model_dirs):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(model_dirs["f32"] / "tokenizer.json"))
    config = json.loads((model_dirs["f32"] / "config.json").read_text())
    assert tok.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    for text in [
        "What is the capital of France?",
        "hello  world\n\n  x",
        "héllo 世界 🙂 it's 42",
        "Paris",
    ]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("What is the capital of France?").tokens == [
        "What",
        "Ġis",
        "Ġthe",
        "Ġcapital",
        "Ġof",
        "ĠFrance",
        "?",
    ]
    specials = tiny_qwen2.special_token_ids()
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>").ids
    assert ids[0] == specials["<|im_start|>"] and ids[-1] == specials["<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello"


def test_chat_template_renders_like_qwen25(model_dirs):
    jinja2 = pytest.importorskip("jinja2")
    cfg = json.loads((model_dirs["f32"] / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["bos_token"] is None
    template = jinja2.Environment().from_string(cfg["chat_template"])
    text = template.render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_gguf_reads_back_with_llama_cpp_metadata(tmp_path, model_dirs, qtype):
    gguf = pytest.importorskip("gguf")
    path = tiny_qwen2.write_tiny_gguf(tmp_path / "m.gguf", hf_dir=model_dirs["f32"], qtype=qtype)
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    assert meta["general.architecture"] == "qwen2"
    assert (
        meta["qwen2.block_count"],
        meta["qwen2.embedding_length"],
        meta["qwen2.feed_forward_length"],
        meta["qwen2.attention.head_count"],
        meta["qwen2.attention.head_count_kv"],
        meta["qwen2.context_length"],
    ) == (2, 64, 128, 4, 2, 512)
    assert meta["qwen2.rope.freq_base"] == 1e4
    assert meta["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    specials = tiny_qwen2.special_token_ids()
    assert meta["tokenizer.ggml.eos_token_id"] == specials["<|im_end|>"]
    assert meta["tokenizer.ggml.padding_token_id"] == specials["<|endoftext|>"]
    assert meta["tokenizer.ggml.add_bos_token"] is False
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 448 and tokens[specials["<|im_end|>"]] == "<|im_end|>"
    assert [types[i] for i in specials.values()] == [3, 3, 3] and set(types[:445]) == {1}
    hf_tok = json.loads((model_dirs["f32"] / "tokenizer.json").read_text())
    assert meta["tokenizer.ggml.merges"] == hf_tok["model"]["merges"]
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 27 and "output.weight" in tensors
    assert tensors["blk.0.attn_k.weight"].shape.tolist() == [64, 32]  # GGUF order: [in, out]
    assert tensors["blk.1.ffn_down.weight"].shape.tolist() == [128, 64]
    matmul_type = (
        gguf.GGMLQuantizationType.F32 if qtype == "f32" else gguf.GGMLQuantizationType.Q8_0
    )
    assert tensors["blk.1.ffn_down.weight"].tensor_type == matmul_type
    assert tensors["token_embd.weight"].tensor_type == matmul_type
    assert tensors["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_gguf_to_hf_round_trips_the_tiny_model(tmp_path, model_dirs):
    pytest.importorskip("gguf")
    import gguf_to_hf  # tiny_qwen2 put tools/ on sys.path

    for variant in ("f32", "tied"):
        gguf_path = tiny_qwen2.write_tiny_gguf(
            tmp_path / f"{variant}.gguf", hf_dir=model_dirs[variant]
        )
        back = gguf_to_hf.convert(gguf_path, tmp_path / f"{variant}-back")
        original, converted = load_checkpoint(model_dirs[variant]), load_checkpoint(back)
        assert original.keys() == converted.keys()
        for name in original:
            np.testing.assert_array_equal(converted[name], original[name], err_msg=name)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert json.loads((back / name).read_text()) == json.loads(
                (model_dirs[variant] / name).read_text()
            )
        want = json.loads((model_dirs[variant] / "config.json").read_text())
        got = json.loads((back / "config.json").read_text())
        assert {k: want[k] for k in got if k != "torch_dtype"} == {
            k: v for k, v in got.items() if k != "torch_dtype"
        }


@pytest.mark.parametrize("rope_scaling", [
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0},
    {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    {"type": "linear", "factor": 2.0},
])
def test_gguf_to_hf_keeps_rope_scaling(tmp_path, rope_scaling):
    pytest.importorskip("gguf")
    import gguf_to_hf

    hf = tiny_qwen2.write_tiny_model(tmp_path / "scaled", rope_scaling=rope_scaling)
    back = gguf_to_hf.convert(tiny_qwen2.write_tiny_gguf(tmp_path / "scaled.gguf", hf_dir=hf), tmp_path / "back")
    assert json.loads((back / "config.json").read_text())["rope_scaling"] == rope_scaling


def test_gguf_to_hf_dequantizes_q8_0_close_to_the_original(tmp_path, model_dirs):
    pytest.importorskip("gguf")
    import gguf_to_hf

    gguf_path = tiny_qwen2.write_tiny_gguf(
        tmp_path / "q8.gguf", hf_dir=model_dirs["f32"], qtype="q8_0"
    )
    back = gguf_to_hf.convert(gguf_path, tmp_path / "q8-back")
    original, converted = load_checkpoint(model_dirs["f32"]), load_checkpoint(back)
    for name in original:
        # Q8_0: 8-bit ints with one scale per 32 values, so the error is ≤ half a step of max/127.
        step = np.abs(original[name]).max() / 127
        assert np.abs(converted[name] - original[name]).max() <= step, name
    want = Qwen2Reference.from_hf_dir(model_dirs["f32"]).forward(PROMPT_IDS)
    got = Qwen2Reference.from_hf_dir(back).forward(PROMPT_IDS)
    assert 0 < np.abs(got - want).max() < 0.2
