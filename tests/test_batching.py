"""Continuous batching on the tiny model: outputs independent of the batch and of the KV layout, preemption,
prefix cache, abort.

Block arithmetic of the tiny model (2 layers, 2 KV heads of 16, the CPU's default f16 cache): one 16-token block
of K and V takes 2 · 2 · 16 · 2 · 16 · 2 = 4096 bytes; one SLOT cell (one token) takes 256. An f32 cache takes
twice that; q8_0 stores a head of 16 as one block of 16 int8 and an f16 scale (18 bytes instead of 32).
"""

from __future__ import annotations

import random

import gguf
import pytest
from numpy_qwen2 import load_checkpoint

from novainfer import LLM, SamplingParams, _native
from novainfer.errors import InvalidParameterError

BLOCK_BYTES = 4096
CELL_BYTES = BLOCK_BYTES // 16
KV_DTYPES = ["f32", "f16", "bf16", "q8_0"]
BLOCK_BYTES_OF = {"f32": 8192, "f16": 4096, "bf16": 4096, "q8_0": 2 * 2 * 16 * 2 * 18}


def _prompts(n: int = 32, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 445) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_models) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    llm = LLM(tiny_models["f32"], enable_prefix_caching=False)
    return [_tokens(llm, [p], GREEDY)[0] for p in _prompts()]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 64, "max_num_seqs": 5},
        {"enable_prefix_caching": False},
        {"block_size": 1},
    ],
)
def test_greedy_outputs_do_not_depend_on_the_batch(tiny_models, alone, engine_args):
    llm = LLM(tiny_models["f32"], **engine_args)
    assert _tokens(llm, _prompts(), GREEDY) == alone


def test_a_generate_calls_prompts_enter_the_same_first_step(tiny_models):
    # `generate` hands its whole batch to the engine at once, so the first step prefills every prompt
    # however fast the calling thread is. Submitted one by one, the engine started stepping the first
    # prompt before the others arrived: which rows shared a step varied from run to run, and with it the
    # kernel a row ran through (a GPU decode row takes the GEMV in a small step, the GEMM in a large one).
    llm = LLM(tiny_models["f32"], enable_prefix_caching=False, max_num_batched_tokens=2048)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(5):
        before = llm.stats()["num_steps"]
        outs = llm.generate(_prompts(16, seed=5), one)
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        assert llm.stats()["num_steps"] - before == 1


@pytest.fixture(scope="module")
def alone_by_kv_dtype(tiny_models) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens alone, per KV cache dtype (prompts of 3..60 tokens in one chunk)."""
    prompts = _prompts(12, seed=3)
    out = {}
    for dtype in KV_DTYPES:
        llm = LLM(tiny_models["f32"], kv_cache_dtype=dtype, enable_prefix_caching=False)
        out[dtype] = [_tokens(llm, [p], GREEDY)[0] for p in prompts]
    return out


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("chunk", [7, 64, 512])
def test_every_kv_dtype_is_batch_and_chunking_invariant(tiny_models, alone_by_kv_dtype, kv_cache_dtype, chunk):
    # All prompts at once, prefills chunked to `chunk` tokens per step and mixed with decodes.
    llm = LLM(tiny_models["f32"], kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=chunk)
    assert _tokens(llm, _prompts(12, seed=3), GREEDY) == alone_by_kv_dtype[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_kv_block_bytes_follow_the_dtype(tiny_models, kv_cache_dtype):
    per_block = BLOCK_BYTES_OF[kv_cache_dtype]
    llm = LLM(tiny_models["f32"], kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=10 * per_block)
    stats = llm.stats()
    assert stats["kv_bytes_per_block"] == per_block
    assert stats["kv_num_blocks"] == 10 and stats["kv_pool_bytes"] == 10 * per_block
    # Counts are ints (10, not 10.0); only ratios and seconds are floats.
    floats = {"spec_acceptance_rate", "spec_mean_acceptance_length", "busy_seconds"}
    assert all(isinstance(v, int) for k, v in stats.items() if k not in floats), stats
    assert all(isinstance(stats[k], float) for k in floats)
    slot = LLM(tiny_models["f32"], kv_cache_dtype=kv_cache_dtype, kv_layout="slot", kv_cache_bytes=10 * per_block)
    assert slot.stats()["kv_bytes_per_block"] * 16 == per_block, "a SLOT cell is one token of the same dtype"
    assert slot.stats()["kv_num_blocks"] == 160


@pytest.mark.parametrize("model", ["gguf", "tied"])
def test_weight_bytes_per_token_are_the_checkpoint_less_its_embedding_table(tiny_models, model):
    """What `bench llama-cpp` sets decode speed against: a step reads every weight once, except the embedding
    table, of which it looks up a row (tied, the table is the output head and is read whole)."""
    if model == "gguf":
        tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(tiny_models["gguf"]).tensors}
        expected = sum(tensors.values()) - tensors["token_embd.weight"]
    else:
        expected = sum(t.nbytes for t in load_checkpoint(tiny_models["tied"]).values())  # float32 arrays
    assert LLM(tiny_models[model]).stats()["weight_bytes_per_token"] == expected


def test_read_bandwidth_is_a_rate_and_refuses_bad_sizes():
    assert _native.read_bandwidth(mib=8, passes=1) > 0
    for bad in ({"mib": 0}, {"passes": 0}):
        with pytest.raises(InvalidParameterError) as info:
            _native.read_bandwidth(**bad)
        assert info.value.param == next(iter(bad))


def test_the_kernel_choices_are_listed_once_a_model_loads(tiny_models):
    # The tiny model's heads are 16 wide: AVX2 and (where the CPU has it) AVX-512 attention are
    # candidates; its q8_0 GGUF adds the quantized matmuls' four regimes (1 row, 2-8 rows, a batch's
    # 9-48, more).
    LLM(tiny_models["gguf_q8_0"])
    lines = _native.kernel_selections()
    assert any(line.startswith("attention (head_dim 16, 2 query heads per KV head, F16 cache): ") for line in lines), lines
    qmatmul = [line for line in lines if line.startswith("qmatmul Q8_0 ")]
    regimes = ["qmatmul Q8_0 decode", "qmatmul Q8_0 verify", "qmatmul Q8_0 batch", "qmatmul Q8_0 prefill"]
    assert [line.split(" (")[0] for line in qmatmul] == regimes, lines
    # Each says how it was decided (the timing's ratio, a NOVAINFER_*_ISA variable, or a lone candidate).
    assert all(" faster" in line or "forced by NOVAINFER_" in line or "the only candidate" in line for line in lines)


@pytest.mark.parametrize("bad", ["fp8", "F16", "", 3])
def test_a_bad_kv_cache_dtype_names_the_parameter(tiny_models, bad):
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], kv_cache_dtype=bad)
    assert info.value.param == "kv_cache_dtype"


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_models):
    prompts = _prompts(12, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=i) for i in range(12)]
    one_by_one = LLM(tiny_models["f32"])
    alone = [_tokens(one_by_one, [p], [sp])[0] for p, sp in zip(prompts, params)]
    together = _tokens(LLM(tiny_models["f32"], max_num_batched_tokens=13), prompts, params)
    assert together == alone


def test_quantized_model_is_batch_invariant_too(tiny_models):
    llm = LLM(tiny_models["gguf_q8_0"])
    prompts = _prompts(8, seed=2)
    alone = [_tokens(llm, [p], GREEDY)[0] for p in prompts]
    assert _tokens(llm, prompts, GREEDY) == alone


def test_preemption_under_a_tiny_pool_keeps_outputs(tiny_models, alone):
    prompts = _prompts(8)
    tight = LLM(tiny_models["f32"], kv_cache_bytes=12 * BLOCK_BYTES, max_model_len=160)
    assert _tokens(tight, prompts, GREEDY) == alone[:8]
    stats = tight.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for all requests at once"
    assert stats["kv_used_blocks"] == 0 and stats["kv_watermark_blocks"] <= 12


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 7}, {"max_num_seqs": 5}])
def test_slot_layout_gives_the_block_layouts_tokens(tiny_models, alone, engine_args):
    prompts = _prompts(16)
    block = _tokens(LLM(tiny_models["f32"], kv_layout="block", **engine_args), prompts, GREEDY)
    slot_llm = LLM(tiny_models["f32"], kv_layout="slot", **engine_args)
    slot = _tokens(slot_llm, prompts, GREEDY)
    assert slot == block == alone[:16]
    stats = slot_llm.stats()
    assert stats["kv_bytes_per_block"] == CELL_BYTES, "a SLOT pool entry is one token's cell"
    assert stats["kv_used_blocks"] == 0 and stats["kv_watermark_blocks"] > 0
    assert stats["prefix_cache_hit_tokens"] == 0, "the SLOT layout has no prefix cache"


def test_slot_layout_preempts_under_a_tiny_pool_and_keeps_outputs(tiny_models, alone):
    prompts = _prompts(12)
    cells = 192  # the 12 blocks of 16 the BLOCK preemption test uses, as cells
    tight = LLM(tiny_models["f32"], kv_layout="slot", kv_cache_bytes=cells * CELL_BYTES, max_model_len=160)
    assert _tokens(tight, prompts, GREEDY) == alone[:12]
    stats = tight.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for all requests at once"
    assert stats["kv_num_blocks"] == cells and stats["kv_pool_bytes"] == cells * CELL_BYTES
    assert stats["kv_used_blocks"] == 0 and stats["kv_watermark_blocks"] <= cells


@pytest.mark.parametrize("bad", ["paged", "SLOT", "", 3])
def test_a_bad_kv_layout_names_the_parameter(tiny_models, bad):
    with pytest.raises(InvalidParameterError) as info:
        LLM(tiny_models["f32"], kv_layout=bad)
    assert info.value.param == "kv_layout"


def test_a_shared_prefix_is_served_from_the_cache(tiny_models):
    llm = LLM(tiny_models["f32"])
    prefix = _prompts(1, seed=3)[0] * 3  # long enough for several full blocks
    prefix = (prefix + prefix)[:80]
    first = llm.generate(prefix + [5, 6, 7], GREEDY)[0]
    computed_before = llm.stats()["num_prompt_tokens_computed"]
    second = llm.generate(prefix + [9, 10], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 80  # five full 16-token blocks of the shared prefix
    assert llm.stats()["num_prompt_tokens_computed"] - computed_before == len(prefix) + 2 - 80
    assert llm.stats()["prefix_cache_hit_tokens"] >= 80
    # Cached or not, the answer is the same.
    cold = LLM(tiny_models["f32"], enable_prefix_caching=False).generate(prefix + [9, 10], GREEDY)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == second.outputs[0].token_ids


def test_reset_prefix_cache_forgets_cached_blocks(tiny_models):
    llm = LLM(tiny_models["f32"])
    prompt = _prompts(1, seed=4)[0] * 4
    llm.generate(prompt, GREEDY)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0


def test_closing_a_stream_frees_its_blocks_at_once(tiny_models):
    llm = LLM(tiny_models["f32"])
    stream = llm.generate_stream(_prompts(1)[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    next(stream)
    assert llm.stats()["kv_used_blocks"] > 0
    stream.close()
    stats = llm.stats()  # handled after the abort: commands reach the engine in order
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0


def test_many_requests_with_different_lengths_all_finish(tiny_models):
    llm = LLM(tiny_models["f32"], max_num_seqs=4, max_num_batched_tokens=32)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, 21)]
    outs = llm.generate(_prompts(20, seed=5), params)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 21))
    assert llm.stats()["kv_used_blocks"] == 0


def test_kv_budget_as_a_fraction_of_available_memory(tiny_models):
    llm = LLM(tiny_models["f32"], kv_cache_fraction=0.001)
    blocks = llm.stats()["kv_num_blocks"]
    assert blocks > 0 and llm.max_model_len == min(512, blocks * 16)
    assert llm.generate([1, 2, 3], GREEDY)[0].outputs[0].finish_reason == "length"
