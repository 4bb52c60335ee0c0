"""The `novainfer` command: fetch, generate, chat, serve and bench.

Each subcommand is a thin layer over the Python API; errors from the library are printed as one line and
give exit status 1 (2 for bad command-line usage, as argparse does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .errors import NovaInferError

__all__ = ["main"]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="qwen2.5-coder-0.5b",
                   help="HF directory, .gguf file or demo-model name (default: %(default)s)")
    p.add_argument("--device", default="auto",
                   help='auto (the first usable CUDA GPU, else the CPU), cpu, cuda or cuda:N (default: %(default)s)')
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on a GPU, the share of its memory the engine may use; the KV cache gets what the "
                        "weights leave (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="weight dtype for safetensors models: auto, f32, bf16, f16")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-layout", choices=["block", "slot"], default="block",
                   help="KV cache layout: paged blocks with prefix caching, or llama.cpp-style cells (CPU)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "f32", "f16", "bf16", "q8_0"], default="auto",
                   help="how the KV cache stores keys and values: auto (f16 on the CPU, bf16 on a GPU), f32, f16, "
                        "bf16, or q8_0 (8-bit blocks with an f16 scale, as llama.cpp) (default: %(default)s)")
    p.add_argument("--lm-head-dtype", choices=["auto", "q8_0"], default="auto",
                   help="how the lm_head is stored: auto (as the checkpoint has it) or q8_0 (a dense head quantized "
                        "to 8-bit blocks at load: lossy, less to read per token; CPU only) (default: %(default)s)")
    p.add_argument("--gpu-weight-dtype", choices=["auto", "bf16", "native"], default="auto",
                   help="how a GPU holds quantized matrices (GGUF, AWQ/GPTQ int4, FP8): auto (FP8 as FP8, the rest as "
                        "bf16), bf16 (expanded at load) or native (the file's blocks, multiplied in place by decode "
                        "steps; unverified on a GPU) (default: %(default)s)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="quantize a dense checkpoint's decoder layers at load: fp8 (e4m3, a scale per output "
                        "channel; FP8 on a GPU, its dense values on the CPU)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule each step while the one before it runs (its decodes fed the tokens drawn on the "
                        "device; greedy output unchanged; not with --speculative-config)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' (bench speculative: '
                        "the n-gram engine's config)")


def _add_sampling_args(p: argparse.ArgumentParser, *, temperature: float, max_tokens: int) -> None:
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _version() -> str:
    # The installed distribution's metadata: no need to load the native module for --version.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("novainfer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from ._native import __version__

        return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="novainfer", description="Fast, exact inference for Qwen2-family LLMs.")
    parser.add_argument("--version", action="version", version=f"novainfer {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch", help="download, verify and cache a demo model")
    fetch.add_argument("names", nargs="*", help="demo-model names (see --list)")
    fetch.add_argument("--verify", action="store_true", help="re-hash a cached file")
    fetch.add_argument("--list", action="store_true", help="list the demo models")
    fetch.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")

    gen = sub.add_parser("generate", help="complete a prompt and stream the text")
    _add_model_args(gen)
    _add_sampling_args(gen, temperature=0.0, max_tokens=256)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_args(chat)
    _add_sampling_args(chat, temperature=0.7, max_tokens=1024)
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")

    # `serve` hands its arguments to the Rust server unparsed (see `main`); this entry is for --help.
    sub.add_parser("serve", add_help=False,
                   help="OpenAI-compatible HTTP server with a Web UI (novainfer serve --help for options)")

    from .bench import add_bench_args, modes_help

    bench = sub.add_parser("bench", help="measure speed: latency (one stream), batched, throughput, ... (see --help)",
                           description=modes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(bench)

    add_bench_args(bench)
    return parser


def _llm(args: argparse.Namespace, **extra: object):  # noqa: ANN202 - returns novainfer.LLM
    if args.threads is not None:
        # candle reads this once, when its thread pool starts: before the model loads.
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    from .llm import LLM

    extra.setdefault("kv_layout", args.kv_layout)
    extra.setdefault("kv_cache_dtype", args.kv_cache_dtype)
    extra.setdefault("lm_head_dtype", args.lm_head_dtype)
    extra.setdefault("gpu_weight_dtype", args.gpu_weight_dtype)
    extra.setdefault("quantization", args.quantization)
    extra.setdefault("speculative_config", args.speculative_config)
    extra.setdefault("async_scheduling", args.async_scheduling)
    return LLM(args.model, device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
               dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed, **extra)


def _sampling(args: argparse.Namespace):  # noqa: ANN202 - returns novainfer.SamplingParams
    from ._native import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, stop=args.stop,
    )


def _generate(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _sampling(args)
    if args.chat:
        deltas = llm.chat_stream([{"role": "user", "content": args.prompt}], params)
    else:
        deltas = llm.generate_stream(args.prompt, params)
    for d in deltas:
        print(d.text, end="", flush=True)
    print()
    return 0


def _chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _sampling(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    print(f"NovaInfer chat with {llm.model_path.name}. /reset clears the conversation, /exit quits.")
    while True:
        try:
            line = input("\n> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": line})
        reply = []
        try:
            for d in llm.chat_stream(system + history, params):
                print(d.text, end="", flush=True)
                reply.append(d.text)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        except NovaInferError as e:
            # The conversation outgrew the context, say: keep the session, drop the turn.
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def _fetch(args: argparse.Namespace) -> int:
    from . import fetch

    flags = {"--verify": args.verify, "--list": args.list, "--quiet": args.quiet}
    argv = list(args.names) + [flag for flag, on in flags.items() if on]
    return fetch.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `novainfer` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # The server's options are the Rust binary's own (clap); argparse would have to copy them.
        from .server import main as serve_main

        return serve_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "fetch":
            return _fetch(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.mode == "serve":
            from .bench_serve import run_bench_serve

            return run_bench_serve(args)
        if args.mode == "llama-cpp":
            from .bench_llama_cpp import run_bench_llama_cpp

            return run_bench_llama_cpp(args)
        if args.mode == "soak":
            from .bench_soak import run_bench_soak

            return run_bench_soak(args)
        if args.mode == "lora":
            from .bench_lora import run_bench_lora

            return run_bench_lora(
                _llm(args, enable_lora=True, max_loras=max(args.lora_adapters, len(args.lora or [])),
                     max_lora_rank=max(args.lora_rank, 64) if args.lora else args.lora_rank),
                args,
            )
        if args.mode == "speculative":
            from .bench_speculative import run_bench_speculative

            return run_bench_speculative(
                _llm(args, speculative_config=None),
                args,
                make_llm=lambda **extra: _llm(args, **extra),
            )
        from .bench import run_bench

        return run_bench(
            _llm(args, requantize_q5_0=args.requantize_q5_0),
            args,
            make_llm=lambda **extra: _llm(args, requantize_q5_0=args.requantize_q5_0, **extra),
        )
    except NovaInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
