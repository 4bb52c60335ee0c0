"""The CUDA executor end to end: the tiny random model against the NumPy float64 reference, the demo model
against the CPU engine, the server on ``--device cuda``, 64 concurrent requests, batch invariance.

These need an NVIDIA GPU. Without one they skip, except under ``NOVAINFER_REQUIRE_GPU=1`` (set by
``scripts/gpu-test run``), where a GPU that cannot be opened fails every test instead: a green GPU run means
they all ran. The demo-model tests likewise fail under ``NOVAINFER_REQUIRE_DEMO=1`` when the model is not
cached (``scripts/gpu-test stage-model`` moves it to a machine that cannot fetch). Figures that are measured
rather than asserted (batch invariance, agreement counts) are appended as JSON lines to
``$NOVAINFER_GPU_REPORT`` when it is set.

The tiny model here is the suite's tiny Qwen2 widened to head_dim 64 (the GPU's attention kernels exist for
64, 128 and 256): hidden 256, 4 heads, 2 KV heads, 2 layers. Tolerances: the GPU holds weights and activations
in bf16 (8 significant bits, each rounding worth up to 2^-9 relative, about ten roundings deep), the references
stay in f32/f64, so logits are compared per row relative to the row's largest magnitude: within 4%. A layout
or indexing bug is off by ~100%. The demo model's CPU path multiplies int8-quantized activations with the GGUF
blocks while the GPU multiplies bf16 activations with bf16-expanded weights, so the two differ by the
activation quantization as well: logits within twice the tiny model's tolerance, and greedy
tokens by agreement counts with each disagreement at a near-tie of the CPU's own distribution.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPT, logits_of
from novainfer import LLM, SamplingParams, _native
from numpy_qwen2 import Qwen2Reference
from server_process import ServerProcess
from tiny_qwen2 import write_tiny_gguf, write_tiny_model

pytestmark = pytest.mark.cuda

DEMO_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# Greedy disagreements count as near-ties when the CPU put both tokens within this many nats.
NEAR_TIE_NATS = 0.5
# Per-row max |gpu - reference| over the row's max |reference| (see the module docstring).
REL_TOL = 0.04


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)).max())


def _assert_follows(want: list, got: list, what: str, gap: float = 0.1) -> None:
    """Greedy outputs `got` follow `want` token for token, except that a sequence may part at a near-tie.

    Two paths that sum in another order may round one activation differently; where `want`'s top two are within
    `gap` logprob the other may pick the second, and from there on the sequences are free to differ. `want` must
    carry at least two logprobs a token, so that the other path's pick has its logprob there.
    """
    for n, (w, g) in enumerate(zip(want, got)):
        for i, (wt, gt) in enumerate(zip(w.token_ids, g.token_ids)):
            if wt != gt:
                margin = w.logprobs[i][wt] - w.logprobs[i].get(gt, -np.inf)
                assert margin < gap, f"{what}: sequence {n} parts at token {i} with a margin of {margin}"
                break


def _common(a: list[int], b: list[int]) -> list[int]:
    """The longest common prefix of two token lists."""
    return [x for x, _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, b))]


def _report(**figures: object) -> None:
    path = os.environ.get("NOVAINFER_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


@pytest.fixture(scope="module")
def gpu() -> str:
    """The device string of a usable GPU; skips (or fails under NOVAINFER_REQUIRE_GPU=1) without one."""
    why = _native.cuda_unavailable_reason()
    if why is not None:
        if os.environ.get("NOVAINFER_REQUIRE_GPU") == "1":
            pytest.fail(f"NOVAINFER_REQUIRE_GPU=1 but no GPU is usable: {why}")
        pytest.skip(f"no CUDA device ({why})")
    return "cuda:0"


@pytest.fixture(scope="module")
def demo_gguf(gpu) -> Path:
    from novainfer.fetch import models_dir

    path = models_dir() / DEMO_FILE
    if not path.is_file():
        if os.environ.get("NOVAINFER_REQUIRE_DEMO") == "1":
            pytest.fail(f"NOVAINFER_REQUIRE_DEMO=1 but {path} is missing")
        pytest.skip("the demo model is not cached (scripts/gpu-test stage-model)")
    return path


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model at head_dim 64, in the on-disk forms the GPU loads."""
    root = tmp_path_factory.mktemp("tiny-gpu-models")
    f32 = write_tiny_model(root / "f32", head_dim=64)
    tied = write_tiny_model(root / "tied", tie_word_embeddings=True, head_dim=64)
    return {
        "f32": f32,
        "bf16": write_tiny_model(root / "bf16", dtype="bf16", head_dim=64),
        "tied": tied,
        "gguf_q8_0": write_tiny_gguf(root / "tiny-q8_0.gguf", hf_dir=f32, qtype="q8_0"),
        "gguf_q8_0_tied": write_tiny_gguf(root / "tiny-tied-q8_0.gguf", hf_dir=tied, qtype="q8_0"),
    }


@pytest.fixture(scope="module")
def tiny_gpu(gpu, gpu_models) -> LLM:
    return LLM(gpu_models["f32"], device=gpu, kv_cache_bytes=64 << 20)


def test_auto_picks_the_gpu_for_a_model_it_can_run(gpu, gpu_models):
    assert LLM(gpu_models["f32"], kv_cache_bytes=16 << 20).device == gpu


def test_tiny_model_matches_the_float64_reference(tiny_gpu, gpu_models):
    assert tiny_gpu.device == "cuda:0"
    ref = Qwen2Reference.from_hf_dir(gpu_models["f32"]).forward(PROMPT)
    got = logits_of(tiny_gpu, PROMPT)
    assert got.shape == ref.shape
    err = _rel_err(got, ref)
    _report(test="tiny_vs_float64", max_rel_err=err)
    assert err < REL_TOL, f"max |cuda - float64| / max |float64| = {err}"


@pytest.mark.parametrize("variant", ["bf16", "gguf_q8_0", "tied"])
def test_tiny_variants_match_the_cpu_engine(gpu, gpu_models, variant):
    cpu = logits_of(LLM(gpu_models[variant], device="cpu", kv_cache_bytes=16 << 20), PROMPT)
    got = logits_of(LLM(gpu_models[variant], device=gpu, kv_cache_bytes=16 << 20), PROMPT)
    assert _rel_err(got, cpu) < REL_TOL


def test_paged_decode_equals_prefill_logits(tiny_gpu):
    """Generation goes through the paged pool (chunks, decodes); its logprobs must match one prefill's."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    out = tiny_gpu.generate(PROMPT, params)[0].outputs[0]
    full = logits_of(tiny_gpu, PROMPT + out.token_ids[:-1])
    log_softmax = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = log_softmax[len(PROMPT) - 1 + i]
        assert int(np.argmax(row)) == token or row.max() - row[token] < 0.1
        assert abs(lp[token] - row[token]) < 0.1


def test_n_completions_fork_the_prompt_on_the_gpu(tiny_gpu):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=10)
    outs = tiny_gpu.generate(PROMPT, params)[0].outputs
    alone = [tiny_gpu.generate(PROMPT, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10))[0].outputs[0]
             for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]


def test_seeded_draws_on_the_gpu_are_the_same_alone_and_batched(tiny_gpu):
    """Rows drawn on the device (greedy, top-k/top-p/min-p, penalties, bias, min_tokens) depend on
    their own seed and token count only: each request alone gives what it gave in a batch of 16."""
    variants = [
        dict(temperature=0.8, top_k=20),
        dict(temperature=1.2, top_p=0.9),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.7, presence_penalty=0.8, frequency_penalty=0.3),
        dict(temperature=0.9, repetition_penalty=1.3),
        dict(temperature=1.0, logit_bias={300: 4.0, 301: -100.0}),
        dict(temperature=1.0, min_tokens=6),
        dict(temperature=0.0, presence_penalty=1.0),
    ]
    params = [SamplingParams(seed=100 + i, max_tokens=16, **variants[i % len(variants)]) for i in range(16)]
    prompts = [PROMPT[: 3 + i % 8] for i in range(16)]
    together = [o.outputs[0].token_ids for o in tiny_gpu.generate(prompts, params)]
    alone = [tiny_gpu.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    assert all(301 not in t for t in together[5::8]), "a -100 bias keeps its token out"


def test_async_scheduling_on_the_gpu_streams_what_steps_in_order_stream(gpu, gpu_models, tiny_gpu):
    """Steps scheduled ahead (fed the tokens the step before drew) give every request the tokens and logprobs it gets
    in order, within what another number of rows a step may round differently: greedy, seeded draws, min_tokens, a
    stop token met mid-stream (its extra row is dropped), with a penalised request and late arrivals running beside
    them in order; no block is left held."""
    ahead = LLM(gpu_models["f32"], device=gpu, kv_cache_bytes=64 << 20, async_scheduling=True)
    walk = tiny_gpu.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    variants = [
        dict(temperature=0, max_tokens=24),
        dict(temperature=0.8, top_k=20, seed=3, max_tokens=24),
        dict(temperature=1.0, top_p=0.9, seed=4, min_tokens=5, max_tokens=20),
        dict(temperature=0, max_tokens=12, stop_token_ids=[walk[5]]),
        dict(temperature=0.7, presence_penalty=0.5, seed=5, max_tokens=6),
    ]
    prompts = [PROMPT] + [PROMPT[: 3 + i] + [40 + i] for i in range(11)]
    # Two logprobs a token everywhere: a greedy parting is then checked to be a near-tie.
    params = [SamplingParams(ignore_eos=True, logprobs=2, **variants[i % len(variants)]) for i in range(len(prompts))]
    params[0] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[walk[5]], logprobs=2)
    want = tiny_gpu.generate(prompts, params)
    got = ahead.generate(prompts, params)
    # A step ahead may hold one more row than its twin in order (a stopped request's dropped row), and cuBLAS may
    # round another number of rows differently: equal tokens and logprobs within bf16 noise, a greedy parting only
    # at a near-tie, a seeded one rarely (a draw moves only if its uniform sits at a shifted boundary).
    parted = 0
    for w, g, p in zip(want, got, params):
        wo, go = w.outputs[0], g.outputs[0]
        common = _common(wo.token_ids, go.token_ids)
        for token, a, b in zip(common, go.logprobs, wo.logprobs):
            assert abs(a[token] - b[token]) < 2e-2
        if len(common) == len(wo.token_ids) == len(go.token_ids):
            assert go.finish_reason == wo.finish_reason
        elif p.temperature == 0:
            _assert_follows([wo], [go], "greedy ahead")
        else:
            parted += 1
    assert parted <= 1, f"{parted} seeded requests parted"
    # Request 0 meets its stop token mid-stream in order (its greedy walk is `walk`); ahead, the same unless it
    # parted at a near-tie before it (checked above).
    assert want[0].outputs[0].finish_reason == "stop" and len(want[0].outputs[0].token_ids) <= 6
    stats = ahead.stats()
    assert stats["num_steps_ahead"] > 0 and stats["kv_used_blocks"] == 0 and stats["num_running"] == 0
    _report(test="async_scheduling_tiny", steps=stats["num_steps"], steps_ahead=stats["num_steps_ahead"],
            seeded_parted=parted)


def test_ngram_speculation_on_the_gpu_gives_the_tokens_plain_decoding_gives(gpu, gpu_models, tiny_gpu):
    """Drafts verified on the device (every request's rows in one pass, each row drawn by its own rule; a grammar's
    rows sampled on the host by the device's rule) give what decoding without drafts gives: greedy, seeded, with a
    penalty, with a grammar; within what a pass of more rows may round differently (a greedy parting only at a
    near-tie, a seeded one rarely). Drafts are accepted, save steps, and leave no block held."""
    from novainfer import StructuredOutputsParams

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "draft_policy": "always"}
    spec = LLM(gpu_models["f32"], device=gpu, kv_cache_bytes=64 << 20, speculative_config=ngram)
    # Repetitive prompts give the lookup something to find from the first decode on.
    prompts = [PROMPT * 3, PROMPT[:5] * 4, PROMPT[::-1] * 2, [300, 301, 302] * 5, PROMPT, PROMPT[3:] + PROMPT]
    grammar = StructuredOutputsParams(regex="(ab|cd){3,12}x")
    variants = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.1, logprobs=2),
        SamplingParams(temperature=0.7, seed=3, max_tokens=40, structured_outputs=grammar, logprobs=2),
    ]
    parted = 0
    for params in variants:
        want = tiny_gpu.generate(prompts, params)
        got = spec.generate(prompts, params)
        for w, g in zip(want, got):
            wo, go = w.outputs[0], g.outputs[0]
            common = _common(wo.token_ids, go.token_ids)
            for token, a, b in zip(common, go.logprobs, wo.logprobs):
                assert abs(a[token] - b[token]) < 2e-2, params
            if len(common) == len(wo.token_ids) == len(go.token_ids):
                assert go.finish_reason == wo.finish_reason, params
            elif params.temperature == 0:
                _assert_follows([wo], [go], f"greedy with drafts ({params})")
            else:
                parted += 1
    assert parted <= 1, f"{parted} seeded requests parted"
    stats = spec.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0
    one = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    steps = []
    for llm in (tiny_gpu, spec):
        before = llm.stats()["num_steps"]
        llm.generate([PROMPT * 3], one)
        steps.append(llm.stats()["num_steps"] - before)
    assert steps[1] < steps[0], steps
    _report(test="speculation_tiny", seeded_parted=parted, acceptance=stats["spec_acceptance_rate"], steps=steps)


def test_64_concurrent_requests_leak_no_blocks_and_batch_invariance_is_measured(tiny_gpu):
    prompts = [PROMPT[: 2 + i % 10] + [40 + i] for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in tiny_gpu.generate(prompts, [params] * 64)]
    alone = [tiny_gpu.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    stats = tiny_gpu.stats()
    assert stats["kv_used_blocks"] == 0 and stats["num_running"] == 0
    assert all(len(t) == 24 for t in together)
    differ = sum(a != t for a, t in zip(alone, together))
    _report(test="batch_invariance_tiny", requests=64, differing=differ)


def test_server_on_cuda_streams_forks_and_frees_cancelled_blocks(gpu, gpu_models, tiny_gpu):
    with ServerProcess(["--model", str(gpu_models["f32"]), "--served-model-name", "tiny", "--device", gpu,
                        "--kv-cache-bytes", str(64 << 20)]) as server:
        client = server.client()
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        expected = tiny_gpu.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
        assert text == expected
        two = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, n=2)
        assert sorted(c.index for c in two.choices) == [0, 1]
        # The tiny model's context is 512 tokens: a stream long enough to be cancelled mid-way must fit in it.
        long = client.completions.create(model="tiny", prompt="Hello", max_tokens=480, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))
        assert not server.engine_idle("tiny")
        long.response.close()
        server.wait_idle("tiny", timeout=10)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                client.completions.create(model="tiny", prompt=PROMPT[: 3 + i % 9], max_tokens=16, temperature=0)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        server.wait_idle("tiny", timeout=10)


# --------------------------------------------------------------------------- the demo model

CHAT_PROMPTS = [
    "What is the capital of France?", "Write a Python function that reverses a string.",
    "Explain what a mutex is in one sentence.", "What does HTTP 404 mean?", "Name three sorting algorithms.",
    "Write a SQL query that counts rows in a table named users.", "What is 17 times 23?",
    "How do I create a virtual environment in Python?", "What is the difference between a list and a tuple?",
    "Write a haiku about compilers.", "What is Rust's borrow checker?", "Convert 100 Fahrenheit to Celsius.",
    "Write a bash one-liner that counts lines in all .py files.", "What is a closure in JavaScript?",
    "Give an example of a regular expression that matches an email address.", "What is Big-O notation?",
    "Write a C function that returns the maximum of two ints.", "What is the capital of Japan?",
    "Explain recursion to a child.", "What is a hash map?", "Write a Go hello world program.",
    "What does git rebase do?", "List the planets of the solar system.", "What is a race condition?",
]


def test_demo_logits_match_the_cpu_engine(gpu, demo_gguf):
    prompt = list(range(1000, 1040))
    cpu = logits_of(LLM(demo_gguf, device="cpu", kv_cache_bytes=64 << 20), prompt)
    got = logits_of(LLM(demo_gguf, device=gpu, kv_cache_bytes=256 << 20), prompt)
    err = _rel_err(got, cpu)
    top1 = float(np.mean(got.argmax(-1) == cpu.argmax(-1)))
    _report(test="demo_logits_vs_cpu", max_rel_err=err, top1_agreement=top1)
    # The CPU quantizes activations to int8 for its GGUF matmuls, the GPU does not: twice the tiny tolerance.
    assert err < 2 * REL_TOL, f"max |cuda - cpu| / max |cpu| = {err}"


def test_demo_greedy_chat_agrees_with_the_cpu_engine(gpu, demo_gguf):
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    messages = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    cpu = [o.outputs[0] for o in LLM(demo_gguf, device="cpu", kv_cache_bytes=256 << 20).chat(messages, params)]
    got = [o.outputs[0] for o in LLM(demo_gguf, device=gpu, kv_cache_bytes=256 << 20).chat(messages, params)]
    disagreements = []
    for prompt, c, g in zip(CHAT_PROMPTS, cpu, got):
        if c.token_ids == g.token_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(c.token_ids, g.token_ids)) if a != b)
        cpu_lp = c.logprobs[i]
        gap = cpu_lp[c.token_ids[i]] - cpu_lp.get(g.token_ids[i], -np.inf)
        disagreements.append({"prompt": prompt, "position": i, "cpu_margin_nats": float(gap)})
    _report(test="demo_greedy_chat", prompts=len(CHAT_PROMPTS), agree=len(CHAT_PROMPTS) - len(disagreements),
            disagreements=disagreements)
    # bf16 activations against the CPU's int8-quantized ones part a few greedy chats at near-ties (the
    # CPU emulator's fake CUDA, bf16 like a GPU, agreed on 19 of 24, each parting under 0.15 nats); a
    # wrong kernel parts them at large margins, or most of them.
    assert len(disagreements) <= 6, disagreements
    assert all(d["cpu_margin_nats"] < NEAR_TIE_NATS for d in disagreements), disagreements


def _greedy(llm: LLM, n: int = 12):
    # Two logprobs a token: where another path's pick parts from this one, its logprob is there (_assert_follows).
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True)
    return llm.generate(PROMPT, params)[0].outputs[0]


@pytest.mark.parametrize("variant", ["gguf_q8_0", "gguf_q8_0_tied"])
def test_native_gguf_weights_follow_the_bf16_expansion(gpu, gpu_models, variant):
    # gpu_weight_dtype="native" keeps the Q8_0 blocks on the device: the prompt (more than 8 rows, every row's
    # logits) expands them into a scratch for cuBLAS, each decode step (1 row) runs the packed GEMV
    # (kernels/gemv_quant.cu), whose f32 sums are closer to exact than the bf16 matrix's; the embedding rows
    # come from the packed table, which is also the tied head. Both must follow the CPU.
    path = gpu_models[variant]
    bf16 = LLM(path, device=gpu, kv_cache_bytes=16 << 20)
    native = LLM(path, device=gpu, kv_cache_bytes=16 << 20, gpu_weight_dtype="native")
    cpu = LLM(path, device="cpu", kv_cache_bytes=16 << 20)
    ref = logits_of(cpu, PROMPT)
    err = _rel_err(logits_of(native, PROMPT), ref)
    a, b, c = _greedy(bf16), _greedy(native), _greedy(cpu)
    agree = len(_common(b.token_ids, c.token_ids))
    # Over the common prefix: past a parting the sequences are free to differ.
    lp_err = max((abs(b.logprobs[i][t] - c.logprobs[i][t]) for i, t in enumerate(_common(b.token_ids, c.token_ids))),
                 default=0.0)
    bytes_bf16 = bf16.stats()["weight_bytes_per_token"]
    bytes_native = native.stats()["weight_bytes_per_token"]
    _report(test=f"native_tiny_{variant}", prefill_rel_err=err, decode_agree=agree, decode_logprob_err=lp_err,
            bytes_bf16=bytes_bf16, bytes_native=bytes_native, bf16_agree=sum(x == y for x, y in zip(a.token_ids, c.token_ids)))
    assert err < REL_TOL, err
    # The random tiny model has near-ties (top two 0.017 apart after this prompt, where the GGUF paths' logits sit
    # 0.06 from the f32 ones on either device): decoding may part there, nowhere else.
    _assert_follows([c], [b], f"native {variant}")
    assert lp_err < 0.1, lp_err
    # Q8_0 is 34 bytes per 32 weights against bf16's 64; the vectors are the same.
    assert bytes_native < 0.6 * bytes_bf16, (bytes_native, bytes_bf16)
    # Every matrix stays packed (the table too, and it is the tied head): the device holds the file's tensors' bytes.
    import gguf

    assert native.stats()["weight_bytes"] == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def test_the_tiled_packed_gemm_follows_the_expansion(gpu, gpu_models, tmp_path, monkeypatch):
    # NOVAINFER_CUDA_PACKED_GEMM=tile: steps of more than 8 rows over packed matrices (gpu_weight_dtype="native")
    # run gemv_quant.cu's tiled tensor-core GEMM, each block decoding its weight tile into shared memory, instead of
    # expanding the matrix for cuBLAS. The same bf16 weights summed in another order: the prompt's logits (12 rows)
    # and 16 sequences decoding together (16 rows a step) follow the expansion's within bf16 noise, on a Q8_0 GGUF and
    # on quantization="fp8" (FP8 blocks).
    from tiny_qwen2 import write_tiny_model

    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    models = {"q8_0": (gpu_models["gguf_q8_0"], {"gpu_weight_dtype": "native"}),
              "fp8": (write_tiny_model(tmp_path / "dense", dtype="bf16", head_dim=64), {"quantization": "fp8"})}
    figures, sequences = {}, {}
    for name, (path, kw) in models.items():
        outs, logits = {}, {}
        for mode in ("expand", "tile"):
            monkeypatch.setenv("NOVAINFER_CUDA_PACKED_GEMM", mode)
            llm = LLM(path, device=gpu, kv_cache_bytes=16 << 20, **kw)
            logits[mode] = logits_of(llm, PROMPT)
            outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
        agree = sum(a == b for e, t in zip(outs["expand"], outs["tile"]) for a, b in zip(e.token_ids, t.token_ids))
        figures[name] = {"prefill_rel_err": _rel_err(logits["tile"], logits["expand"]), "decode_agree": agree,
                         "tokens": sum(len(e.token_ids) for e in outs["expand"])}
        sequences[name] = (outs["expand"], outs["tile"])
    _report(test="packed_gemm_tile", **figures)
    for name, f in figures.items():
        assert f["prefill_rel_err"] < REL_TOL, (name, f)
    for name, (expand, tile) in sequences.items():
        _assert_follows(expand, tile, name)


def test_fused_decode_linears_follow_the_separate_ones(gpu, gpu_models, monkeypatch):
    # NOVAINFER_CUDA_DECODE_LINEAR=fused: steps of up to 8 rows run every linear layer through the GEMV
    # (kernels/gemv_quant.cu), the QKV bias, RoPE and cache write and the gate/up SiLU·mul in its epilogue. With
    # packed weights the separate path runs the same GEMV and the epilogue rounds as its stores do: the same
    # tokens and logprobs exactly. With bf16 weights the GEMV replaces cuBLAS (another order of summation):
    # tokens follow within near-ties. Decode graphs capture the fused path too (buckets up to 8 rows).
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:] + [7, 8, 9], [11, 12, 13, 14, 15]]

    def run(path: Path, **kw):
        llm = LLM(path, device=gpu, kv_cache_bytes=16 << 20, **kw)
        return [o.outputs[0] for o in llm.generate(prompts, params)]

    outs = {}
    for linear in ("separate", "fused"):
        monkeypatch.setenv("NOVAINFER_CUDA_DECODE_LINEAR", linear)
        outs[linear] = {"native": run(gpu_models["gguf_q8_0"], gpu_weight_dtype="native"),
                        "bf16": run(gpu_models["f32"])}
    monkeypatch.setenv("NOVAINFER_CUDA_GRAPHS", "1")
    graphed = run(gpu_models["f32"])
    sep, fus = outs["separate"], outs["fused"]
    bf16_agree = sum(a == b for s, f in zip(sep["bf16"], fus["bf16"]) for a, b in zip(s.token_ids, f.token_ids))
    # Over each pair's common prefix (after a near-tie parting the contexts differ).
    bf16_lp_err = max(abs(ls[t] - lf[t]) for s, f in zip(sep["bf16"], fus["bf16"])
                      for t, ls, lf in zip(_common(s.token_ids, f.token_ids), s.logprobs, f.logprobs))
    _report(test="fused_decode_linears", bf16_agree=bf16_agree, bf16_tokens=sum(len(s.token_ids) for s in sep["bf16"]),
            bf16_logprob_err=bf16_lp_err,
            native_same=all(s.token_ids == f.token_ids for s, f in zip(sep["native"], fus["native"])))
    for s, f in zip(sep["native"], fus["native"]):
        assert f.token_ids == s.token_ids
        assert [lp[t] for t, lp in zip(f.token_ids, f.logprobs)] == [lp[t] for t, lp in zip(s.token_ids, s.logprobs)]
    _assert_follows(sep["bf16"], fus["bf16"], "bf16 fused")
    assert bf16_lp_err < 0.1, bf16_lp_err
    assert [g.token_ids for g in graphed] == [f.token_ids for f in fus["bf16"]]


def test_native_awq_int4_weights_follow_the_cpu(gpu, tmp_path):
    # An AWQ checkpoint (groups of 128) keeps its int4 blocks on the device with gpu_weight_dtype="native"
    # (dequant.cu's and gemv_quant.cu's int4 paths); by default they are expanded there, not on the host.
    from test_awq_gptq import VARIANTS, write_quantized

    path = write_quantized(tmp_path / "awq", VARIANTS["awq-g128"][0])
    cpu = LLM(path, device="cpu", kv_cache_dtype="f32", kv_cache_bytes=16 << 20)
    ref = logits_of(cpu, PROMPT)
    c = _greedy(cpu)
    figures = {}
    for mode in ("bf16", "native"):
        llm = LLM(path, device=gpu, kv_cache_bytes=16 << 20, gpu_weight_dtype=mode)
        g = _greedy(llm)
        figures[mode] = {"prefill_rel_err": _rel_err(logits_of(llm, PROMPT), ref),
                         "decode_agree": sum(x == y for x, y in zip(g.token_ids, c.token_ids)),
                         "bytes": llm.stats()["weight_bytes_per_token"]}
    _report(test="native_awq_int4", **figures)
    for mode, f in figures.items():
        assert f["prefill_rel_err"] < 2 * REL_TOL, (mode, f)
        assert f["decode_agree"] >= len(c.token_ids) - 2, (mode, f)
    assert figures["native"]["bytes"] < 0.75 * figures["bf16"]["bytes"], figures


def test_native_gptq_act_order_follows_the_cpu(gpu, tmp_path, monkeypatch):
    # GPTQ act-order int4 (desc_act, groups of 128) kept packed with gpu_weight_dtype="native": the sorted columns
    # stay int4 on the device and each product takes its input permuted first (gather.cu's gather_columns), as
    # the CPU does. With orders shared by Q, K and V and by gate and up (as real checkpoints have) every matrix is
    # packed; with an order per layer, the fused QKV and gate|up matrices mix orders and are expanded with their
    # columns in place, o_proj and down_proj stay packed. Prefill (expanded for cuBLAS) and decode (the GEMV) both
    # follow the CPU, and through the tiled GEMM too (NOVAINFER_CUDA_PACKED_GEMM=tile).
    from test_awq_gptq import VARIANTS, write_quantized

    qcfg = VARIANTS["gptq4-desc-act-g128"][0]
    models = {"shared": write_quantized(tmp_path / "shared", qcfg, shared_orders=True),
              "per_layer": write_quantized(tmp_path / "per_layer", qcfg)}
    figures = {}
    for name, path in models.items():
        cpu = LLM(path, device="cpu", kv_cache_dtype="f32", kv_cache_bytes=16 << 20)
        ref = logits_of(cpu, PROMPT)
        c = _greedy(cpu)
        for mode, env in (("bf16", "expand"), ("native", "expand"), ("native_tile", "tile")):
            monkeypatch.setenv("NOVAINFER_CUDA_PACKED_GEMM", env)
            llm = LLM(path, device=gpu, kv_cache_bytes=16 << 20, gpu_weight_dtype=mode.removesuffix("_tile"))
            g = _greedy(llm)
            figures[f"{name}_{mode}"] = {"prefill_rel_err": _rel_err(logits_of(llm, PROMPT), ref),
                                         "decode_agree": sum(x == y for x, y in zip(g.token_ids, c.token_ids)),
                                         "bytes": llm.stats()["weight_bytes_per_token"]}
    _report(test="native_gptq_act_order", **figures)
    for key, f in figures.items():
        assert f["prefill_rel_err"] < 2 * REL_TOL, (key, f)
        assert f["decode_agree"] >= len(c.token_ids) - 2, (key, f)
    assert figures["shared_native"]["bytes"] < 0.75 * figures["shared_bf16"]["bytes"], figures
    # Per-layer orders: only o_proj and down_proj packed, so fewer bytes saved, but some.
    assert figures["per_layer_native"]["bytes"] < figures["per_layer_bf16"]["bytes"], figures


def test_fp8_weights_stay_fp8_on_the_device_and_follow_the_cpu(gpu, tmp_path):
    # An FP8 checkpoint (per-channel scales) and quantization="fp8" of a bf16 one: by default (gpu_weight_dtype
    # "auto") their decoder layers stay FP8 on the device (dequant.cu's and gemv_quant.cu's FP8 paths: the prompt
    # expands them for cuBLAS, each decode step multiplies the codes in place), at about half the bytes a token of
    # gpu_weight_dtype="bf16", which expands them at load. Both follow the CPU, which runs the same weights densely.
    from test_fp8 import VARIANTS, write_fp8
    from tiny_qwen2 import write_tiny_model

    models = {"checkpoint": (write_fp8(tmp_path / "fp8", *VARIANTS["per-channel"]), {}),
              "online": (write_tiny_model(tmp_path / "dense", dtype="bf16", head_dim=64), {"quantization": "fp8"})}
    figures = {}
    for name, (path, kw) in models.items():
        cpu = LLM(path, device="cpu", kv_cache_dtype="f32", kv_cache_bytes=16 << 20, **kw)
        ref = logits_of(cpu, PROMPT)
        c = _greedy(cpu)
        for mode in ("auto", "bf16"):
            llm = LLM(path, device=gpu, kv_cache_bytes=16 << 20, gpu_weight_dtype=mode, **kw)
            g = _greedy(llm)
            figures[f"{name}_{mode}"] = {
                "prefill_rel_err": _rel_err(logits_of(llm, PROMPT), ref),
                "decode_agree": sum(x == y for x, y in zip(g.token_ids, c.token_ids)),
                "decode_logprob_err": max(abs(lg[t] - lc[t]) for t, lg, lc in zip(g.token_ids, g.logprobs, c.logprobs)
                                          if t in lc),
                "bytes": llm.stats()["weight_bytes_per_token"]}
    _report(test="fp8_weights", **figures)
    for key, f in figures.items():
        assert f["prefill_rel_err"] < REL_TOL, (key, f)
        assert f["decode_agree"] >= len(c.token_ids) - 2, (key, f)
        assert f["decode_logprob_err"] < 0.1, (key, f)
    for name in models:
        assert figures[f"{name}_auto"]["bytes"] < 0.65 * figures[f"{name}_bf16"]["bytes"], figures


def test_native_demo_weights_follow_the_cpu_engine(gpu, demo_gguf):
    # The demo file's Q4_K/Q5_0/Q6_K/Q8_0 blocks, kept packed: logits (prefill: expanded) and greedy chat
    # (decode: the packed GEMV) against the CPU engine, as the bf16 path is held to.
    prompt = list(range(1000, 1040))
    cpu_llm = LLM(demo_gguf, device="cpu", kv_cache_bytes=64 << 20)
    native = LLM(demo_gguf, device=gpu, kv_cache_bytes=256 << 20, gpu_weight_dtype="native")
    err = _rel_err(logits_of(native, prompt), logits_of(cpu_llm, prompt))
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    messages = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:8]]
    cpu = [o.outputs[0] for o in cpu_llm.chat(messages, params)]
    got = [o.outputs[0] for o in native.chat(messages, params)]
    same = sum(c.token_ids == g.token_ids for c, g in zip(cpu, got))
    file_bytes = Path(demo_gguf).stat().st_size
    _report(test="native_demo", max_rel_err=err, greedy_same=same, prompts=len(messages),
            weight_bytes_per_token=native.stats()["weight_bytes_per_token"],
            weight_bytes=native.stats()["weight_bytes"], file_bytes=file_bytes)
    assert err < 2 * REL_TOL, err
    assert same >= len(messages) - 2, same
    # The memory target: the weights on the device about the file's size (its tensors and metadata).
    assert native.stats()["weight_bytes"] <= 1.15 * file_bytes, (native.stats()["weight_bytes"], file_bytes)


def test_lora_on_the_gpu_follows_the_cpu_and_moves_the_output(gpu, gpu_models, tmp_path):
    # Two adapters and the base model in one engine on the GPU (kernels/lora.cu): each request's greedy
    # tokens and logprobs follow the CPU engine's on the same adapter (bf16 against f32: a token may differ
    # only at a near-tie), and an adapter's output is not the base model's.
    from tiny_lora import write_peft_adapter
    from tiny_qwen2 import tiny_config

    from novainfer import LoRARequest

    cfg = tiny_config(head_dim=64)
    a, _ = write_peft_adapter(tmp_path / "a", seed=3, rank=8, alpha=32.0, model_config=cfg)
    b, _ = write_peft_adapter(tmp_path / "b", seed=4, rank=16, alpha=64.0, targets=("q_proj", "v_proj", "down_proj"),
                              model_config=cfg)
    requests = [LoRARequest("a", 1, str(a)), None, LoRARequest("b", 2, str(b))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    on_gpu = LLM(gpu_models["f32"], enable_lora=True, max_loras=2, kv_cache_bytes=16 << 20)
    assert on_gpu.device == gpu
    on_cpu = LLM(gpu_models["f32"], device="cpu", enable_lora=True, max_loras=2, kv_cache_bytes=16 << 20)
    got = [on_gpu.generate(PROMPT, params, lora_request=r)[0].outputs[0] for r in requests]
    want = [on_cpu.generate(PROMPT, params, lora_request=r)[0].outputs[0] for r in requests]
    for name, g, c in zip(("a", "base", "b"), got, want):
        for i, (gt, ct) in enumerate(zip(g.token_ids, c.token_ids)):
            if gt != ct:
                margin = c.logprobs[i][ct] - c.logprobs[i].get(gt, -np.inf)
                assert margin < 0.1, (name, i, margin)
                break
            assert abs(g.logprobs[i][gt] - c.logprobs[i][ct]) < 0.1, (name, i)
    # The adapters change what the model says (a missing update would leave the base model's output).
    base_first = got[1].logprobs[0]
    for name, g in (("a", got[0]), ("b", got[2])):
        assert g.token_ids != got[1].token_ids or g.logprobs[0] != base_first, name
    # All three in one batch: every step mixes both adapters and the base model (the segmented product's
    # row groups), and each request says what it said alone (a GEMM of three rows may round differently
    # from one of one: a token may differ only at a near-tie, as above).
    batched = [o.outputs[0] for o in on_gpu.generate([PROMPT] * 3, params, lora_request=requests)]
    for name, g, b_ in zip(("a", "base", "b"), got, batched):
        for i, (gt, bt) in enumerate(zip(g.token_ids, b_.token_ids)):
            if gt != bt:
                margin = g.logprobs[i][gt] - g.logprobs[i].get(bt, -np.inf)
                assert margin < 0.1, (name, i, margin)
                break
            assert abs(g.logprobs[i][gt] - b_.logprobs[i][bt]) < 0.05, (name, i)
