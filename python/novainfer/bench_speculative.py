"""`novainfer bench speculative`: decode speed with speculative decoding against without, side by side.

Two workloads of chat prompts, greedy:

- ``code-edit``: a source file of 300 to 1,000 tokens (slices of NovaInfer's own Python modules, so every
  install has the same files) and an instruction to rename one function, the model rewriting the whole file.
  Prompt lookup finds most of the answer in the prompt.
- ``free-form``: questions whose answers repeat little of the prompt: the case where speculation must not
  slow decoding down.

Each workload runs at batch 1 (a few prompts one after another, streamed; decode speed is the tokens after
the first over the time after the first) and at batch ``--num-requests`` (all submitted at once; output
tokens over the wall time, prefill included, the same for every engine; the median of ``--repeat`` rounds). Engines: no speculation, n-gram
(``--speculative-config``, default 4 tokens, n-grams of 2 to 5), and a draft model when ``--draft-model`` is
given; ``--speculative-config`` replaces the n-gram engine's config. With ``--llama-cpp BIN_DIR`` the batch-1
prompts also run through llama.cpp's ``llama-lookup`` (and ``llama-speculative-simple`` with the draft model),
greedy, on the same thread count: its decode speed (tokens after the prompt over their time) and acceptance. Runs alternate between engines prompt by prompt, so a busy machine slows them alike; each line also
says whether the outputs were identical to the plain engine's (they must be: greedy).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ._native import SamplingParams
from .llm import LLM

__all__ = ["add_speculative_args", "code_edit_prompts", "free_form_prompts", "run_bench_speculative"]

DEFAULT_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

FREE_FORM = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, in plain words, for a beginner.",
    "What are the trade-offs between microservices and a monolith?",
    "Describe the water cycle.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence on each.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Write a poem about autumn in a city.",
    "What should I consider when choosing a database for a new web application?",
    "Explain the difference between concurrency and parallelism.",
    "Summarise the causes of the French Revolution.",
    "How do vaccines train the immune system?",
    "Write a product description for a reusable water bottle.",
    "What makes a good code review?",
    "Describe how a compiler turns source code into machine code.",
    "Plan a three-course vegetarian dinner and explain the choices.",
    "What is the halting problem and why does it matter?",
]


def _count(text: str) -> int:
    """A non-negative integer option."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_speculative_args(p: argparse._ActionsContainer) -> None:
    """The options of `novainfer bench speculative`."""
    p.add_argument("--draft-model", help="speculative: also run a draft-model engine with this model")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="speculative: draft model's tokens")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=["code-edit", "free-form"],
        default=["code-edit", "free-form"],
        help="speculative: which workloads",
    )
    p.add_argument(
        "--batch1-prompts",
        type=_count,
        default=4,
        help="speculative: prompts run one by one (0: batch 1 is skipped)",
    )
    p.add_argument(
        "--llama-cpp",
        metavar="BIN_DIR",
        help="llama.cpp's binaries: speculative also runs llama-lookup (and llama-speculative-simple with "
        "--draft-model) on the batch-1 prompts; serve runs the same load against llama-server; llama-cpp needs "
        "llama-bench and llama-batched-bench (GGUF models)",
    )


def _source_slices(count_tokens: Callable[[str], int], count: int, longest: int) -> list[tuple[str, str]]:
    """Up to `count` (source, function name) pairs: runs of whole lines of NovaInfer's own modules, 300 to
    1,000 tokens long (shorter where the model's context is: at most `longest`), each defining a function."""
    longest = min(longest, 1000)
    shortest = min(300, longest * 3 // 4)
    out: list[tuple[str, str]] = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        start = 0
        while start < len(lines) and len(out) < count:
            end, text = start, ""
            while end < len(lines) and count_tokens(text) < (shortest + longest) // 2:
                text += lines[end]
                end += 1
            n = count_tokens(text)
            names = [n for n in re.findall(r"^\s*def (\w+)\(", text, flags=re.M) if not n.startswith("__")]
            if shortest <= n <= longest and names:
                out.append((text, names[0]))
            start = end
        if len(out) >= count:
            break
    return out


def _rename_ask(source: str, name: str) -> str:
    return (
        f"Rename the function `{name}` to `{name}_v2` everywhere in this file, and change nothing else. "
        f"Output the whole updated file, and nothing else.\n\n```python\n{source}```"
    )


def code_edit_prompts(llm: LLM, count: int, max_tokens: int) -> list[list[dict[str, str]]]:
    """Chats asking to rename a function in a source file and output the whole file; each fits the model's
    context with `max_tokens` to generate."""
    tok = llm.get_tokenizer()

    def tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    # What the instruction and the chat template (a default system prompt, say) add around the file.
    wrapper = tokens(llm.apply_chat_template([{"role": "user", "content": _rename_ask("", "f")}]))
    slices = _source_slices(tokens, count, llm.max_model_len - max_tokens - wrapper - 8)
    return [[{"role": "user", "content": _rename_ask(source, name)}] for source, name in slices]


def free_form_prompts(count: int) -> list[list[dict[str, str]]]:
    """Chats with free-form answers (little to look up)."""
    return [[{"role": "user", "content": FREE_FORM[i % len(FREE_FORM)]}] for i in range(count)]


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")


def _llama_cpp_run(cmd: list[str], prompt: str) -> tuple[int, float, int, int]:
    """(tokens decoded, seconds, drafted, accepted) of one llama.cpp speculative example run on `prompt`
    (the chat-template-rendered text, special tokens spelled out)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        out = subprocess.run([*cmd, "-f", f.name], capture_output=True, text=True, timeout=3600)
    finally:
        os.unlink(f.name)
    log = out.stdout + out.stderr
    decoded = _DECODED.search(log)
    if out.returncode != 0 or decoded is None:
        raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {log[-2000:]}")
    drafted, accepted = _DRAFTED.search(log), _ACCEPTED.search(log)
    return (
        int(decoded.group(1)),
        float(decoded.group(2)),
        int(drafted.group(1)) if drafted else 0,
        int(accepted.group(1)) if accepted else 0,
    )


def _llama_cpp_commands(llm: LLM, args: argparse.Namespace) -> dict[str, list[str]]:
    """llama.cpp's prompt lookup and (with a draft model) draft-model decoding, greedy, on the same
    thread count and with the same draft lengths as our engines."""
    bin_dir = Path(args.llama_cpp)
    threads = os.environ.get("RAYON_NUM_THREADS", str(os.cpu_count()))
    common = ["-n", str(args.decode_tokens), "-t", threads, "--temp", "0", "-c", str(llm.max_model_len)]
    ngram_k = (args.speculative_config or DEFAULT_NGRAM)["num_speculative_tokens"]
    cmds = {"llama.cpp lookup": [str(bin_dir / "llama-lookup"), "-m", str(llm.model_path), *common,
                                 "--spec-draft-n-max", str(ngram_k)]}
    if args.draft_model:
        cmds["llama.cpp draft"] = [
            str(bin_dir / "llama-speculative-simple"), "-m", str(llm.model_path), "-md", args.draft_model,
            "--spec-type", "draft-simple", *common, "--spec-draft-n-max", str(args.num_speculative_tokens),
        ]
    return cmds


def _stream_one(llm: LLM, chat: list[dict[str, str]], params: SamplingParams) -> tuple[list[int], int, float]:
    """(tokens, tokens after the first, seconds after the first) of one streamed chat."""
    tokens: list[int] = []
    first = None
    for delta in llm.chat_stream(chat, params):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        tokens.extend(delta.token_ids)
    end = time.perf_counter()
    return tokens, max(len(tokens) - 1, 0), end - (first or end)


def _batch_one_line(llm: LLM, engines: dict[str, LLM], chats: list[list[dict]], params: SamplingParams,
                    args: argparse.Namespace, head: str, workload: str) -> str:
    """Batch 1 of one workload: its first `--batch1-prompts` chats one after another on every engine."""
    # Each prompt on every engine in turn, so a busy machine slows them alike.
    decoded = {name: 0 for name in engines}
    seconds = {name: 0.0 for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for chat in chats[: args.batch1_prompts]:
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            tokens, n, s = _stream_one(engine, chat, params)
            decoded[name] += n
            seconds[name] += s
            outputs[name].append(tokens)
    line = [f"{head} {workload} batch=1 ({min(len(chats), args.batch1_prompts)} prompts)"]
    base = decoded["plain"] / max(seconds["plain"], 1e-9)
    for name in engines:
        speed = decoded[name] / max(seconds[name], 1e-9)
        same = "" if name == "plain" else f" {speed / base:.2f}x identical={outputs[name] == outputs['plain']}"
        line.append(f"{name} {speed:.1f} tok/s{same}")
    if args.llama_cpp:
        for name, cmd in _llama_cpp_commands(llm, args).items():
            try:
                runs = [_llama_cpp_run(cmd, llm.apply_chat_template(c)) for c in chats[: args.batch1_prompts]]
            except RuntimeError as e:
                line.append(f"{name} failed: {str(e).splitlines()[-1]}")
                continue
            n, s = sum(r[0] for r in runs), sum(r[1] for r in runs)
            drafted, accepted = sum(r[2] for r in runs), sum(r[3] for r in runs)
            line.append(f"{name} {n / max(s, 1e-9):.1f} tok/s accepted {accepted}/{drafted}")
    return " | ".join(line)


def run_bench_speculative(llm: LLM, args: argparse.Namespace, make_llm: Callable[..., LLM]) -> int:
    """Runs each workload at batch 1 and batch `--num-requests` on every engine; prints a line each."""
    engines: dict[str, LLM] = {"plain": llm, "ngram": make_llm(speculative_config=args.speculative_config or DEFAULT_NGRAM)}
    if args.draft_model:
        engines["draft"] = make_llm(
            speculative_config={
                "method": "draft_model",
                "model": args.draft_model,
                "num_speculative_tokens": args.num_speculative_tokens,
            }
        )
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens)
    batch = args.num_requests
    head = f"model={llm.model_path.name} decode<={args.decode_tokens}"
    for workload in args.workloads:
        chats = code_edit_prompts(llm, batch, args.decode_tokens) if workload == "code-edit" else free_form_prompts(batch)
        if args.batch1_prompts > 0:
            print(_batch_one_line(llm, engines, chats, params, args, head, workload), flush=True)
        # Batch N: all at once, `--repeat` rounds alternating engines; the median round is reported.
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        counts: dict[str, tuple[float, float, float]] = {}
        for _ in range(args.repeat):
            for name, engine in engines.items():
                engine.reset_prefix_cache()
                before = engine.stats()
                start = time.perf_counter()
                outs = engine.chat(chats, params, use_tqdm=False)
                wall = time.perf_counter() - start
                after = engine.stats()
                tokens[name] = [o.outputs[0].token_ids for o in outs]
                speeds[name].append(sum(len(t) for t in tokens[name]) / wall)
                counts[name] = (
                    after["num_draft_tokens"] - before["num_draft_tokens"],
                    after["num_accepted_tokens"] - before["num_accepted_tokens"],
                    after["num_drafts"] - before["num_drafts"],
                )
        line = [f"{head} {workload} batch={len(chats)} (median of {args.repeat})"]
        base = statistics.median(speeds["plain"])
        for name in engines:
            speed = statistics.median(speeds[name])
            drafted, accepted, drafts = counts[name]
            rate = f" accepted {accepted:.0f}/{drafted:.0f}, {1 + accepted / drafts:.2f} tokens/verify" if drafts else ""
            rel = "" if name == "plain" else f" {speed / base:.2f}x identical={tokens[name] == tokens['plain']}"
            line.append(f"{name} {speed:.1f} tok/s{rel}{rate}")
        print(" | ".join(line), flush=True)
    return 0
