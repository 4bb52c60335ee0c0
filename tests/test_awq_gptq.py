"""AWQ and GPTQ checkpoints of the tiny model, written here with NumPy, against the float64 reference run
on the weights the files hold.

Nothing here calls the engine's code to write or read the formats. The quantizer is round-to-nearest on
each format's grid (AutoAWQ's `pseudo_quantize_tensor`, GPTQ's `Quantizer`: the Hessian updates of real
GPTQ change which integers are stored, not how), and packing follows the formats' documentation:

- AWQ (AutoAWQ `WQLinear_GEMM`, version "gemm", 4-bit): qweight int32 [in, out/8], qzeros int32
  [in/group, out/8], scales f16 [in/group, out]; word c holds output columns 8c + ORDER[k] in bits 4k.
- GPTQ (AutoGPTQ `QuantLinear`): qweight int32 [in*bits/32, out] packed along the input dimension,
  qzeros int32 [groups, out*bits/32] packed along the output dimension, scales f16 [groups, out], g_idx
  int32 [in] (the group of each input channel; permuted under desc_act). checkpoint_format "gptq" stores
  zero points minus 1 (readers add it back), "gptq_v2" stores them as they are.

The reference dequantizes the files (w = s * (q - z)) with its own reader. Layers the engine keeps as int4
groups of 128 (group size 128 or per channel) or repacks into Q5_0/Q8_0 blocks keep those weights exactly but multiply them with int8-quantized activations, as every
quantized format does on the CPU, so their logits are close, not equal; layers it dequantizes (GPTQ
act-order, asymmetric 8-bit) run dense f32 and must match to 1e-4.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPT, logits_of
from gguf_to_hf import TensorEntry, write_safetensors
from novainfer import LLM, InvalidParameterError, ModelLoadError, SamplingParams
from numpy_qwen2 import Qwen2Reference, greedy_generate, load_safetensors
from tiny_qwen2 import special_token_ids, write_tiny_model

HEAD_DIM = 64  # hidden 256, intermediate 512: every group size below divides every layer's inputs
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# --------------------------------------------------------------------------- quantizer


def quantize(w: np.ndarray, g_idx: np.ndarray, bits: int, sym: bool):
    """Round-to-nearest per (group, output row). Returns q [out, in] (uint32), z [groups, out] (int64),
    s [groups, out] (float16). Asymmetric: s = (max - min) / maxq over the group (min <= 0 <= max),
    z = round(-min / s); symmetric: s = 2 max|w| / maxq, z = (maxq + 1) / 2."""
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    out = w.shape[0]
    z = np.zeros((groups, out), dtype=np.int64)
    s = np.zeros((groups, out), dtype=np.float16)
    q = np.zeros(w.shape, dtype=np.uint32)
    for g in range(groups):
        cols = np.flatnonzero(g_idx == g)
        block = w[:, cols].astype(np.float64)
        lo, hi = np.minimum(block.min(axis=1), 0), np.maximum(block.max(axis=1), 0)
        if sym:
            hi = np.maximum(np.abs(lo), hi)
            scale = np.float16(np.maximum(2 * hi / maxq, 1e-5)).astype(np.float64)
            zero = np.full(out, (maxq + 1) // 2)
        else:
            scale = np.float16(np.maximum((hi - lo) / maxq, 1e-5)).astype(np.float64)
            zero = np.clip(np.round(-lo / scale), 0, maxq).astype(np.int64)
        q[:, cols] = np.clip(np.round(block / scale[:, None]) + zero[:, None], 0, maxq).astype(np.uint32)
        z[g], s[g] = zero, scale.astype(np.float16)
    return q, z, s


def pack_rows(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Pack the last axis into uint32 words, value k of a word in bits [bits*k, bits*(k+1)); with `order`,
    bit field k holds value order[k] of the word's run (AWQ)."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(*values.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    return np.bitwise_or.reduce(v << shifts, axis=-1).astype(np.uint32)


def awq_tensors(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    inp = w.shape[1]
    size = inp if group == -1 else group
    q, z, s = quantize(w, np.arange(inp) // size, 4, sym=False)
    return {
        "qweight": pack_rows(q.T, 4, AWQ_ORDER).view(np.int32),  # [in, out/8]
        "qzeros": pack_rows(z, 4, AWQ_ORDER).view(np.int32),  # [groups, out/8]
        "scales": s,
    }


def gptq_tensors(w, group: int, bits: int, sym: bool, desc_act: bool, v2: bool, rng,
                 order: np.ndarray | None = None) -> dict[str, np.ndarray]:
    inp, per = w.shape[1], 32 // bits
    size = inp if group == -1 else group
    if desc_act:
        # Act-order quantizes channels in decreasing Hessian diagonal; any permutation has the same layout.
        order = rng.permutation(inp) if order is None else order
        g_idx = np.empty(inp, dtype=np.int64)
        g_idx[order] = np.arange(inp) // size
    else:
        g_idx = np.arange(inp) // size
    q, z, s = quantize(w, g_idx, bits, sym)
    stored = z if v2 else (z - 1) & (2**bits - 1)  # v1 wraps z = 0 to all ones, as AutoGPTQ's packer does
    return {
        # [in/p, out]: word (r, o) holds input channels p*r .. p*r+p-1 of output o, lowest bits first.
        "qweight": pack_rows(q.T.reshape(inp // per, per, -1).transpose(0, 2, 1).reshape(inp // per, -1), bits)
        .view(np.int32),
        "qzeros": pack_rows(stored, bits).view(np.int32),  # [groups, out/p]
        "scales": s,
        "g_idx": g_idx.astype(np.int32),
    }


# --------------------------------------------------------------------------- reader (the reference's side)


def read_raw_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file with its stored dtype (I32 included; FP8 as its uint8 codes)."""
    dtypes = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "F8_E4M3": "u1"}
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + begin : 8 + n + end], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def unpack_rows(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    per = 32 // bits
    u = words.view(np.uint32)[..., None] >> (np.arange(per, dtype=np.uint32) * bits)
    fields = u & np.uint32(2**bits - 1)
    if order is not None:
        fields = fields[..., np.argsort(order)]  # field k holds value order[k]
    return fields.reshape(*words.shape[:-1], -1).astype(np.int64)


def dequantize(tensors: dict[str, np.ndarray], prefix: str, qcfg: dict) -> np.ndarray:
    scales = tensors[f"{prefix}.scales"].astype(np.float64)
    if qcfg["quant_method"] == "awq":
        q = unpack_rows(tensors[f"{prefix}.qweight"], 4, AWQ_ORDER).T  # [out, in]
        z = unpack_rows(tensors[f"{prefix}.qzeros"], 4, AWQ_ORDER)
        g_idx = np.arange(q.shape[1]) // (q.shape[1] // scales.shape[0])
    else:
        bits = qcfg["bits"]
        per = 32 // bits
        qw = tensors[f"{prefix}.qweight"]  # [in/p, out]
        q = unpack_rows(qw.T.copy(), bits).reshape(qw.shape[1], qw.shape[0] * per)  # [out, in]
        z = unpack_rows(tensors[f"{prefix}.qzeros"], bits)
        if qcfg.get("checkpoint_format", "gptq") == "gptq":
            z = z + 1
        g_idx = tensors[f"{prefix}.g_idx"].astype(np.int64)
    return scales[g_idx].T * (q - z[g_idx].T)


# --------------------------------------------------------------------------- checkpoints


VARIANTS = {
    # name: (quantization_config, how the engine holds the layers)
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}, "blocks"),
    "awq-g128": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, "blocks"),
    "awq-per-channel": ({"quant_method": "awq", "bits": 4, "group_size": -1, "version": "GEMM"}, "blocks"),
    "gptq4-sym-g128": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}, "blocks"),
    "gptq4-asym-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
                        "checkpoint_format": "gptq"}, "blocks"),
    "gptq4-asym-g64-v2": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False, "desc_act": False,
                           "checkpoint_format": "gptq_v2"}, "blocks"),
    "gptq4-sym-per-channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True}, "blocks"),
    "gptq8-sym-g128": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True, "desc_act": False}, "blocks"),
    # Act-order with groups of 128: int4 with the columns sorted by group and the input permuted to match
    # (this variant's layers each draw their own order, so Q, K and V run as separate products; in the "-shared" one
    # the layers of one input share theirs, as in real checkpoints, and run as one product: SHARED_ORDERS).
    "gptq4-desc-act-g128": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": True},
                            "blocks"),
    "gptq4-desc-act-g128-shared": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                                    "desc_act": True}, "blocks"),
    "gptq4-desc-act-g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": True}, "dense"),
    "gptq8-asym-g64-v2": ({"quant_method": "gptq", "bits": 8, "group_size": 64, "sym": False,
                           "checkpoint_format": "gptq_v2"}, "dense"),
}
# Variants whose act-order layers of one input share their channel order (write_quantized's `shared_orders`).
SHARED_ORDERS = {"gptq4-desc-act-g128-shared"}


SAFETENSORS_KIND = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int32"): "I32",
                    np.dtype("uint8"): "F8_E4M3"}


def write_with_quantized_linears(out: Path, qcfg: dict, torch_dtype: str, parts_of, seed: int = 0) -> Path:
    """The tiny model (head_dim 64) with each decoder linear layer's weight replaced by the tensors
    `parts_of(prefix, weight)` returns (suffix → array; uint8 arrays are FP8 codes); embeddings, norms,
    biases and lm_head stay f32, as quantizers leave them. config.json gets `qcfg` and `torch_dtype`."""
    write_tiny_model(out, head_dim=HEAD_DIM, seed=seed)
    dense = load_safetensors(out / "model.safetensors")
    entries = {}
    for name, array in dense.items():
        prefix = name.removesuffix(".weight")
        if not any(prefix.endswith(layer) for layer in LINEARS) or not name.endswith(".weight"):
            entries[name] = TensorEntry("F32", array.shape, lambda a=array: a)
            continue
        for part, value in parts_of(prefix, array).items():
            entries[f"{prefix}.{part}"] = TensorEntry(SAFETENSORS_KIND[value.dtype], value.shape, lambda v=value: v)
    write_safetensors(out / "model.safetensors", entries)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = qcfg
    config["torch_dtype"] = torch_dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_quantized(out: Path, qcfg: dict, seed: int = 0, shared_orders: bool = False) -> Path:
    """The tiny model with every decoder linear layer in `qcfg`'s format (AWQ or GPTQ). Under act-order each layer
    draws its own channel order, unless `shared_orders`: then the layers that read the same input share one (Q, K
    and V; gate and up), as GPTQ's orders do in real checkpoints (they sort by the input's statistics)."""
    rng = np.random.default_rng(seed + 1)
    orders: dict[str, np.ndarray] = {}

    def order_for(prefix: str, inp: int) -> np.ndarray | None:
        if not shared_orders:
            return None
        key = prefix.rsplit(".", 1)[0] + {"q_proj": ":in", "k_proj": ":in", "v_proj": ":in", "gate_proj": ":in",
                                          "up_proj": ":in"}.get(prefix.rsplit(".", 1)[1], ":" + prefix)
        if key not in orders:
            orders[key] = rng.permutation(inp)
        return orders[key]

    def parts_of(prefix: str, array: np.ndarray) -> dict[str, np.ndarray]:
        if qcfg["quant_method"] == "awq":
            return awq_tensors(array, qcfg["group_size"])
        return gptq_tensors(array, qcfg["group_size"], qcfg["bits"], qcfg.get("sym", True),
                            qcfg.get("desc_act", False), qcfg.get("checkpoint_format") == "gptq_v2", rng,
                            order_for(prefix, array.shape[1]))

    return write_with_quantized_linears(out, qcfg, "float16", parts_of, seed)


def q8_0_activations(x: np.ndarray) -> np.ndarray:
    """x as the CPU's int8-activation kernels see it (ggml's Q8_0 activation blocks, in f32): per 32 values,
    scale = amax / 127, q = round(x * (1 / scale)) ties away from zero, value = f16(scale) * q."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    v = blocks * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    return (scale.astype(np.float16).astype(np.float64) * q).reshape(x.shape)


class Int8ActivationReference(Qwen2Reference):
    """The reference with every packed layer's input rounded as the CPU kernels round it: what is left
    between it and the engine is f32 summation, if the repacked weights are exact. A GPTQ layer's input is
    rounded in its channels' group order (the stable sort of g_idx: the identity unless act-order
    scattered the groups), as the engine permutes it before quantizing."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray], packed: dict[str, np.ndarray | None]):
        super().__init__(config, weights)
        self.packed = packed

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if name not in self.packed:
            return super()._linear(x, name)
        order = self.packed[name]
        if order is None:
            return super()._linear(q8_0_activations(x), name)
        rounded = np.empty_like(x, dtype=np.float64)
        rounded[:, order] = q8_0_activations(x[:, order])
        return super()._linear(rounded, name)


def reference_for(path: Path, *, int8_activations: bool = False) -> Qwen2Reference:
    """The reference model on the weights the quantized files hold, dequantized here."""
    config = json.loads((path / "config.json").read_text())
    tensors = read_raw_safetensors(path / "model.safetensors")
    weights, packed = {}, {}
    for name, array in tensors.items():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            weights[f"{prefix}.weight"] = dequantize(tensors, prefix, config["quantization_config"])
            g_idx = tensors.get(f"{prefix}.g_idx")
            packed[prefix] = None if g_idx is None else np.argsort(g_idx, kind="stable")
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            weights[name] = array.astype(np.float32)
    if int8_activations:
        return Int8ActivationReference(config, weights, packed)
    return Qwen2Reference(config, weights)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {name: write_quantized(root / name, qcfg, shared_orders=name in SHARED_ORDERS)
            for name, (qcfg, _) in VARIANTS.items()}


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max())


# --------------------------------------------------------------------------- tests


def test_the_quantizer_and_reader_agree_with_the_float_weights(tmp_path):
    # The files hold the model, quantized: a broken packer or reader would be far off, not ~10 % off.
    for name in ("awq-g32", "gptq4-asym-g32", "gptq4-desc-act-g64", "gptq8-sym-g128"):
        qcfg = VARIANTS[name][0]
        tensors = read_raw_safetensors(write_quantized(tmp_path / name, qcfg) / "model.safetensors")
        original = load_safetensors(write_tiny_model(tmp_path / f"{name}-f32", head_dim=HEAD_DIM) / "model.safetensors")
        for layer in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
            w = original[f"{layer}.weight"].astype(np.float64)
            got = dequantize(tensors, layer, qcfg)
            rel = np.linalg.norm(got - w) / np.linalg.norm(w)
            assert rel < (0.02 if qcfg["bits"] == 8 else 0.2), (name, layer, rel)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_the_reference_on_the_dequantized_weights(quantized, variant):
    ref = reference_for(quantized[variant]).forward(PROMPT)
    assert ref.std() > 0.5, "degenerate logits would make the comparison meaningless"
    got = logits_of(LLM(quantized[variant], kv_cache_dtype="f32"), PROMPT)
    if VARIANTS[variant][1] == "dense":
        # Dequantized at load (exactly): the dense f32 path, as exact as an f32 checkpoint.
        assert _max_diff(got, ref) <= 1e-4
    else:
        # Int4 groups or Q5_0/Q8_0 blocks: exact weights times int8 activations, whose rounding shows here
        # (measured 0.05-0.065 on logits of std ~1); the next test takes it out.
        assert _max_diff(got, ref) <= 0.15


BLOCKS = sorted(name for name, (_, how) in VARIANTS.items() if how == "blocks")


@pytest.mark.parametrize("variant", BLOCKS)
def test_repacked_weights_are_exact_up_to_activation_rounding(quantized, variant):
    # Against the reference that rounds each packed layer's input as the kernels do, only f32 summation is
    # left (measured ~5e-7), except where the engine's f32 activation and the reference's float64 one fall on
    # two sides of a rounding tie: that moves one int8 value and the logits by up to ~0.02 for that token and,
    # through the KV cache, every later one. So each prompt token runs alone: a weight that is off anywhere
    # moves every row, a tie only its own.
    llm = LLM(quantized[variant], kv_cache_dtype="f32")
    reference = reference_for(quantized[variant], int8_activations=True)
    rows = [_max_diff(logits_of(llm, [t])[0], reference.forward([t])[0]) for t in PROMPT]
    assert sorted(rows)[len(rows) * 3 // 4] <= 1e-5, rows


@pytest.mark.parametrize("variant", sorted(name for name, (_, how) in VARIANTS.items() if how == "dense"))
def test_greedy_generation_of_dequantized_layers_matches_the_reference(quantized, variant):
    # Exact layers only: with int8 activations a near-tie in the logits may go either way.
    eos = set(special_token_ids().values())
    expected = greedy_generate(reference_for(quantized[variant]), PROMPT, 16, stop_ids=eos)
    out = LLM(quantized[variant], kv_cache_dtype="f32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({"quant_method": "exl2"}, "exl2"),
        ({"version": "gemv"}, "version"),
        ({"bits": 3}, "bits"),
        ({"zero_point": False}, "zero_point"),
        ({"group_size": 0}, "group_size"),
    ],
)
def test_unsupported_quantization_configs_are_load_errors_naming_the_field(quantized, tmp_path, change, needle):
    path = tmp_path / "bad"
    shutil.copytree(quantized["awq-g128"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=needle):
        LLM(path)


def test_packed_weights_without_a_quantization_config_are_a_load_error(quantized, tmp_path):
    path = tmp_path / "bare"
    shutil.copytree(quantized["gptq4-sym-g128"], path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"qweight.*quantization_config"):
        LLM(path)


def test_a_malformed_packed_layer_is_a_load_error_naming_the_tensor(quantized, tmp_path):
    path = tmp_path / "torn"
    shutil.copytree(quantized["gptq4-sym-g128"], path)
    tensors = read_raw_safetensors(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.qzeros"
    tensors[name] = tensors[name][:, :-1].copy()
    entries = {
        n: TensorEntry(SAFETENSORS_KIND[a.dtype], a.shape, lambda a=a: a)
        for n, a in tensors.items()
    }
    write_safetensors(path / "model.safetensors", entries)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.qzeros"):
        LLM(path)


def test_a_q8_0_lm_head_reads_fewer_bytes_and_keeps_the_logits_close(quantized):
    # AWQ leaves the head dense (f32 in these files, f16 in Qwen's): q8_0 quantizes it at load.
    path = quantized["awq-g128"]
    exact = LLM(path, kv_cache_dtype="f32")
    q8 = LLM(path, kv_cache_dtype="f32", lm_head_dtype="q8_0")
    head_bytes = 4 * json.loads((path / "config.json").read_text())["vocab_size"] * 256
    assert q8.stats()["weight_bytes_per_token"] < exact.stats()["weight_bytes_per_token"] - head_bytes // 2
    a, b = logits_of(exact, PROMPT), logits_of(q8, PROMPT)
    assert 0 < _max_diff(a, b) <= 0.05 * float(a.std()), _max_diff(a, b)
    with pytest.raises(InvalidParameterError, match="lm_head_dtype"):
        LLM(path, lm_head_dtype="q4_k")
