#!/usr/bin/env python3
"""GGUF fidelity score: how close novainfer's quantized forward stays to the exact model.

    python tools/fidelity.py                       # score the demo GGUF (default KV dtype, and f32)
    python tools/fidelity.py --kv f16 --kv f32     # the KV cache dtypes to score
    python tools/fidelity.py --teacher-forced      # also per-position logit error (needs the logit cache)
    python tools/fidelity.py --make-reference      # recompute tests/fidelity_reference.json (~3 min, 2 cores)
    python tools/fidelity.py --model DIR_OR_GGUF   # score another checkpoint of the same model

The score (issue 30): 24 fixed chat prompts (coding, math, factual, short and long), 48 greedy tokens each;
how many outputs are identical to the exact reference's, and the mean common prefix (tokens, out of 48). The
reference is the suite's float64 NumPy forward (tests/numpy_qwen2.py) on the f32 HF directory that
tools/gguf_to_hf.py dequantizes from the same GGUF: the same weights with no rounding of activations, so
what it measures is the engine's arithmetic (int8 activations, kernel sums, KV storage), not the
quantization of the weights themselves. Sanity check: `--model <that f32 dir> --kv f32` must give 24/24.

Why greedy agreement is a noisy measure: every token after the first disagreement is conditioned on a
different text, and a near-tie (top-2 logits within ~0.05) can flip on any change of rounding, good or bad.
`--teacher-forced` is the steadier one: it feeds the reference's own tokens and compares the engine's
next-token distribution at each of those positions with the reference's (KL divergence, top-1 agreement,
RMS error of the mean-centred logits, as llama.cpp's perplexity tool reports KLD), so every prompt
contributes all its positions rather than one yes/no.

Reference JSON (committed, small): prompts, their chat-template token ids, the reference's greedy tokens
(ending at the first EOS if one comes within 48) and the top-1/top-2 logit margin at each generated
position. The reference's logits along those tokens (~700 MB of f32) live in the novainfer cache
directory (`test-artifacts/fidelity-ref-logits.npy`), made by `--make-reference`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

REFERENCE_JSON = ROOT / "tests" / "fidelity_reference.json"
MODEL_NAME = "qwen2.5-coder-0.5b"
MAX_TOKENS = 48
TOP_K = 8

# Varied on purpose: code, arithmetic, facts, definitions, one-word and long answers, a system prompt and a
# multi-turn conversation, so the score is not dominated by one kind of continuation.
PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "Explain what a hash map is in one sentence."}],
    [{"role": "user", "content": "Write a SQL query that counts the rows of a table named users."}],
    [{"role": "user", "content": "Name three prime numbers."}],
    [{"role": "user", "content": "What does HTTP stand for?"}],
    [{"role": "user", "content": "Write a bash one-liner that counts the lines of every .py file in a directory."}],
    [{"role": "user", "content": "Write a C function that returns the length of a null-terminated string."}],
    [{"role": "user", "content": "Solve for x: 3x + 7 = 22. Show your steps."}],
    [{"role": "user", "content": "Who wrote the novel Pride and Prejudice?"}],
    [{"role": "user", "content": "What is the difference between a list and a tuple in Python?"}],
    [{"role": "user", "content": "Write a JavaScript function that checks whether a number is even."}],
    [{"role": "user", "content": "How many bytes are in a kilobyte?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Write a Rust function that sums a slice of i32 values."}],
    [{"role": "user", "content": "What is the time complexity of binary search, and why?"}],
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "List the planets of the solar system in order from the Sun."}],
    [
        {
            "role": "user",
            "content": "Here is a function:\n\ndef f(n):\n    if n < 2:\n        return n\n    return f(n - 1) + f(n - 2)\n\n"
            "What does it compute, and how can it be made faster?",
        }
    ],
    [{"role": "user", "content": "Explain recursion to a ten-year-old."}],
    [{"role": "user", "content": "What is the square root of 144?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in as few words as possible."},
        {"role": "user", "content": "Which data structure gives O(1) average lookup by key?"},
    ],
    [
        {"role": "user", "content": "Write a Go function that returns the maximum of two ints."},
        {"role": "assistant", "content": "func max(a, b int) int {\n\tif a > b {\n\t\treturn a\n\t}\n\treturn b\n}"},
        {"role": "user", "content": "Now make it generic."},
    ],
]


def stop_ids_of(reference: dict) -> set[int]:
    return set(reference["stop_ids"])


def normalize(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """Tokens up to (not including) the first stop token: engines differ in whether they report the EOS."""
    out = []
    for t in tokens[:MAX_TOKENS]:
        if t in stop_ids:
            break
        out.append(t)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens the two outputs share from the start, counting a shared early stop as agreeing to the end."""
    if a == b:
        return MAX_TOKENS
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def score(outputs: list[list[int]], reference: dict) -> tuple[int, float, list[int]]:
    """(identical outputs, mean common prefix, per-prompt prefix) against the reference's greedy tokens."""
    stop = stop_ids_of(reference)
    prefixes = []
    same = 0
    for got, entry in zip(outputs, reference["items"]):
        a, b = normalize(got, stop), normalize(entry["tokens"], stop)
        same += a == b
        prefixes.append(common_prefix(a, b))
    return same, float(np.mean(prefixes)), prefixes


def divergence_margins(prefixes: list[int], reference: dict) -> list[tuple[int, int, float]]:
    """(prompt, token, reference top-1/top-2 logit margin there) for each output that diverged: a margin well
    under the engine's per-position logit error (teacher-forced RMS, ~0.065 on the demo model) is a near-tie
    that any rounding change may flip either way, not evidence of a worse engine."""
    out = []
    for i, (p, item) in enumerate(zip(prefixes, reference["items"])):
        if p < MAX_TOKENS:
            out.append((i, p, item["margins"][p]))
    return out


# --------------------------------------------------------------------------- engine side


def make_llm(model: str | Path, kv: str | None):
    from novainfer import LLM

    kwargs = {} if kv is None else {"kv_cache_dtype": kv}
    return LLM(model, **kwargs)


def engine_greedy(llm, reference: dict) -> list[list[int]]:
    from novainfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [list(item["prompt_ids"]) for item in reference["items"]]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def engine_forced_logits(llm, item: dict, step_by_step: bool) -> np.ndarray:
    """The engine's logits at the positions that predicted the reference's tokens: [len(tokens), vocab]."""
    ids = list(item["prompt_ids"]) + list(item["tokens"][:-1])
    raw, rows, vocab = llm.prompt_logits(ids, step_by_step=step_by_step)
    logits = np.frombuffer(raw, dtype="<f4").reshape(rows, vocab)
    return logits[len(item["prompt_ids"]) - 1 :]


def forced_metrics(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """KL(ref || got) per position, top-1 agreement, RMS of the mean-centred logit error."""
    got = got.astype(np.float64)
    ref = ref.astype(np.float64)

    def log_softmax(z):
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    lp_ref, lp_got = log_softmax(ref), log_softmax(got)
    kld = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(axis=-1)
    err = (got - got.mean(axis=-1, keepdims=True)) - (ref - ref.mean(axis=-1, keepdims=True))
    return {
        "kld": kld,
        "top1": (got.argmax(axis=-1) == ref.argmax(axis=-1)),
        "rms": np.sqrt((err * err).mean(axis=-1)),
        "maxabs": np.abs(err).max(axis=-1),
    }


def reference_logits_path() -> Path:
    from novainfer.fetch import cache_dir

    return cache_dir() / "test-artifacts" / "fidelity-ref-logits.npy"


def run_teacher_forced(llm, reference: dict, step_by_step: bool) -> dict[str, float]:
    path = reference_logits_path()
    if not path.exists():
        raise SystemExit(f"{path} is missing: run tools/fidelity.py --make-reference first")
    ref_all = np.load(path, mmap_mode="r")
    offsets = np.cumsum([0] + [len(it["tokens"]) for it in reference["items"]])
    parts = {"kld": [], "top1": [], "rms": [], "maxabs": [], "topk": []}
    for i, item in enumerate(reference["items"]):
        got = engine_forced_logits(llm, item, step_by_step)
        m = forced_metrics(got, np.asarray(ref_all[offsets[i] : offsets[i + 1]]))
        m["topk"] = top_k_error(got, item).ravel()
        for k in parts:
            parts[k].append(m[k])
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    return {
        "positions": int(cat["kld"].size),
        "mean_kld": float(cat["kld"].mean()),
        "p99_kld": float(np.quantile(cat["kld"], 0.99)),
        "top1": float(cat["top1"].mean()),
        "rms": float(cat["rms"].mean()),
        "maxabs": float(cat["maxabs"].max()),
        "topk_mean": float(cat["topk"].mean()),
    }


# --------------------------------------------------------------------------- reference side


def f32_dir_for(gguf: Path) -> Path:
    from gguf_to_hf import convert
    from novainfer.fetch import cache_dir

    out = cache_dir() / "test-artifacts" / "qwen2.5-coder-0.5b-f32"
    if not (out / "model.safetensors").exists():
        partial = out.with_name(out.name + f".partial-{os.getpid()}")
        convert(gguf, partial)
        partial.rename(out)
    return out


def batched_decode(model, tokens: list[int], caches: list) -> np.ndarray:
    """One decode token for each of several sequences at once (their own caches and positions): the same
    math as Qwen2Reference.forward one token at a time, with the weight products batched so that the
    float64 weights (4 GB for the 0.5B) are read once per step rather than once per sequence."""
    positions = [cache.num_tokens for cache in caches]
    x = model.w["model.embed_tokens.weight"][np.asarray(tokens)]
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        h = model._rms_norm(x, model.w[p + "input_layernorm.weight"])
        a = p + "self_attn."
        q_all = model._linear(h, a + "q_proj")
        k_all = model._linear(h, a + "k_proj")
        v_all = model._linear(h, a + "v_proj")
        outs = []
        for b, cache in enumerate(caches):
            pos = np.array([positions[b]])
            q = model._rope(model._heads(q_all[b : b + 1], model.num_heads), pos)
            k = model._rope(model._heads(k_all[b : b + 1], model.num_kv_heads), pos)
            v = model._heads(v_all[b : b + 1], model.num_kv_heads)
            k, v = cache.append(i, k, v)
            group = model.num_heads // model.num_kv_heads
            kv_head = np.arange(model.num_heads) // group
            k, v = k[kv_head], v[kv_head]
            s = q @ k.transpose(0, 2, 1) / np.sqrt(model.head_dim)
            s = s - s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(axis=-1, keepdims=True)
            outs.append((pr @ v).transpose(1, 0, 2).reshape(1, -1))
        x = x + model._linear(np.concatenate(outs), a + "o_proj")
        h = model._rms_norm(x, model.w[p + "post_attention_layernorm.weight"])
        x = x + model._mlp(h, p + "mlp.")
    x = model._rms_norm(x, model.w["model.norm.weight"])
    return x @ model.w["lm_head.weight"].T


def make_reference(gguf: Path) -> None:
    from novainfer import LLM
    from numpy_qwen2 import Qwen2Reference

    f32_dir = f32_dir_for(gguf)
    llm = LLM(gguf, max_model_len=512)
    prompt_ids = [llm.encode(llm.apply_chat_template(m)) for m in PROMPTS]
    # The chat model's end-of-turn and end-of-text tokens, whatever the configs list.
    eos = {llm.encode(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|endoftext|>")}
    del llm
    gc.collect()
    gen_cfg = json.loads((f32_dir / "generation_config.json").read_text())
    stop = gen_cfg.get("eos_token_id", [])
    stop_ids = sorted(set(stop if isinstance(stop, list) else [stop]) | eos)

    t0 = time.time()
    model = Qwen2Reference.from_hf_dir(f32_dir, dtype=np.float64)
    caches = [model.new_cache() for _ in PROMPTS]
    last = []
    for ids, cache in zip(prompt_ids, caches):
        last.append(model.forward(ids, cache)[-1])
    print(f"prefill of {len(PROMPTS)} prompts: {time.time() - t0:.0f} s", flush=True)
    logits_steps = [[l] for l in last]
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    done = [False] * len(PROMPTS)
    for step in range(MAX_TOKENS):
        active = []
        for b in range(len(PROMPTS)):
            if done[b]:
                continue
            t = int(np.argmax(logits_steps[b][-1]))
            tokens[b].append(t)
            if t in stop_ids or len(tokens[b]) == MAX_TOKENS:
                done[b] = True
            else:
                active.append(b)
        if not active:
            break
        out = batched_decode(model, [tokens[b][-1] for b in active], [caches[b] for b in active])
        for row, b in enumerate(active):
            logits_steps[b].append(out[row])
        print(f"step {step + 1}: {len(active)} sequences, {time.time() - t0:.0f} s", flush=True)

    items = []
    all_logits = []
    for b, m in enumerate(PROMPTS):
        ls = np.stack(logits_steps[b][: len(tokens[b])])  # logits that chose each token
        items.append({"messages": m, "prompt_ids": prompt_ids[b], "tokens": tokens[b], **top_k_summary(ls)})
        all_logits.append(ls.astype(np.float32))
    ref = {
        "model": MODEL_NAME,
        "gguf": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "reference": "tests/numpy_qwen2.py float64 on tools/gguf_to_hf.py's f32 directory",
        "max_tokens": MAX_TOKENS,
        "stop_ids": stop_ids,
        "items": items,
    }
    write_reference(ref)
    path = reference_logits_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npy")
    np.save(tmp, np.concatenate(all_logits))
    tmp.rename(path)
    print(f"wrote {REFERENCE_JSON} and {path} in {time.time() - t0:.0f} s")


def top_k_summary(logits: np.ndarray) -> dict:
    """Per position: the top-1/top-2 margin, and the TOP_K best token ids with their logits minus the best
    one's. Enough for a small teacher-forced check (tests/test_real_model.py) without the 700 MB logit file:
    logit differences are what softmax and argmax see, so the engine's error is measured on them."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]
    top = np.take_along_axis(logits, order, axis=-1)
    rel = top - top[:, :1]
    return {
        "margins": [round(float(v), 4) for v in top[:, 0] - top[:, 1]],
        "top_ids": order.tolist(),
        "top_rel": [[round(float(v), 4) for v in row] for row in rel],
    }


def top_k_error(got: np.ndarray, item: dict) -> np.ndarray:
    """|(got[t] - got[best]) - (ref[t] - ref[best])| over the reference's top tokens t: [positions, TOP_K]."""
    ids = np.asarray(item["top_ids"])
    g = np.take_along_axis(got.astype(np.float64), ids, axis=-1)
    return np.abs((g - g[:, :1]) - np.asarray(item["top_rel"]))


def write_reference(ref: dict) -> None:
    """One line per prompt, so that a changed reference reads as a per-prompt diff."""
    head = {k: v for k, v in ref.items() if k != "items"}
    lines = [json.dumps(head)[:-1] + ', "items": [']
    lines += [json.dumps(item) + ("," if i + 1 < len(ref["items"]) else "") for i, item in enumerate(ref["items"])]
    lines.append("]}")
    REFERENCE_JSON.write_text("\n".join(lines) + "\n")


def load_reference() -> dict:
    return json.loads(REFERENCE_JSON.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF directory (default: the demo GGUF)")
    ap.add_argument(
        "--kv",
        action="append",
        help="KV cache dtype to score (repeatable; 'default' = the engine's own default). Default: default, f32",
    )
    ap.add_argument("--make-reference", action="store_true", help="recompute the reference (slow)")
    ap.add_argument("--teacher-forced", action="store_true", help="also per-position logit error")
    # At f3a66a3 this gave the prefill's numbers exactly (rows are computed independently); at c7bb2c2 the
    # engine's stepwise path took over 15 minutes for the 24 prompts (not investigated), so it is opt-in.
    ap.add_argument("--step-by-step", action="store_true", help="teacher-forced tokens one decode step at a time")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy score")
    ap.add_argument("--refresh-summary", action="store_true", help="redo the JSON's top-k from the logit cache")
    ap.add_argument("--json", help="append results as one JSON line to this file")
    args = ap.parse_args(argv)

    from novainfer.fetch import fetch_model

    gguf = fetch_model(MODEL_NAME, progress=False)
    if args.make_reference:
        make_reference(gguf)
    reference = load_reference()
    if args.refresh_summary:
        ref_all = np.load(reference_logits_path(), mmap_mode="r")
        offsets = np.cumsum([0] + [len(it["tokens"]) for it in reference["items"]])
        for i, item in enumerate(reference["items"]):
            item.update(top_k_summary(np.asarray(ref_all[offsets[i] : offsets[i + 1]], dtype=np.float64)))
        write_reference(reference)
    model = Path(args.model) if args.model else gguf
    kvs = args.kv or ["default", "f32"]
    for kv in kvs:
        llm = make_llm(model, None if kv == "default" else kv)
        result: dict[str, object] = {"model": str(model), "kv": kv}
        if not args.no_greedy:
            t0 = time.time()
            outs = engine_greedy(llm, reference)
            same, mean_prefix, prefixes = score(outs, reference)
            result.update(identical=same, of=len(outs), mean_prefix=round(mean_prefix, 2), prefixes=prefixes)
            print(
                f"kv={kv}: {same}/{len(outs)} identical, mean common prefix {mean_prefix:.1f}/{MAX_TOKENS} "
                f"({time.time() - t0:.0f} s)\n  prefixes {prefixes}",
                flush=True,
            )
            for i, p, m in divergence_margins(prefixes, reference):
                print(f"  prompt {i} diverged at token {p}, reference top-2 margin there {m:.3f}")
        if args.teacher_forced:
            tf = run_teacher_forced(llm, reference, args.step_by_step)
            result["teacher_forced"] = tf
            print(
                f"kv={kv} teacher-forced over {tf['positions']} positions: mean KLD {tf['mean_kld']:.6f}, "
                f"p99 KLD {tf['p99_kld']:.5f}, top-1 {100 * tf['top1']:.2f}%, centred RMS {tf['rms']:.4f}, "
                f"max {tf['maxabs']:.3f}, top-{TOP_K} logit-difference error {tf['topk_mean']:.4f}",
                flush=True,
            )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
        del llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
