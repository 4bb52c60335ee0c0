"""The `novainfer` command line, run as a user would."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("novainfer")
    cmd = [exe] if exe else [sys.executable, "-m", "novainfer.cli"]
    return subprocess.run([*cmd, *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_generate_streams_a_completion(tiny_models, tiny_llm):
    res = _cli("generate", "--model", str(tiny_models["f32"]), "--max-tokens", "8", "hello")
    assert res.returncode == 0, res.stderr
    expected = tiny_llm.generate("hello", _greedy(8))[0].outputs[0].text
    assert res.stdout == expected + "\n"


def _greedy(n: int):
    from novainfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n)


def test_chat_keeps_the_conversation(tiny_models):
    res = _cli(
        "chat", "--model", str(tiny_models["f32"]), "--temperature", "0", "--max-tokens", "4",
        stdin="hello\nand again\n/reset\nhi\n/exit\n",
    )
    assert res.returncode == 0, res.stderr
    assert "conversation cleared" in res.stdout
    assert res.stdout.count("> ") >= 4


def test_fetch_lists_demo_models():
    res = _cli("fetch", "--list")
    assert res.returncode == 0, res.stderr
    assert "qwen2.5-coder-0.5b" in res.stdout and "qwen2.5-coder-1.5b" in res.stdout


def test_version_names_the_installed_package():
    import novainfer

    res = _cli("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"novainfer {novainfer.__version__}"


def test_fetch_passes_the_quiet_flag_its_help_offers(monkeypatch):
    from novainfer import cli, fetch

    seen = []
    monkeypatch.setattr(fetch, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["fetch", "-q", "qwen2.5-coder-0.5b"]) == 0
    assert seen == [["qwen2.5-coder-0.5b", "--quiet"]]


@pytest.mark.parametrize("args", [("generate", "--model", "/no/such/model", "hi"), ("generate", "--model", "qwen9", "hi")])
def test_errors_are_one_line_and_exit_1(args):
    res = _cli(*args)
    assert res.returncode == 1
    assert res.stderr.startswith("error:") and "Traceback" not in res.stderr


def test_bench_help_lists_every_mode_with_its_options():
    from novainfer.bench import MODES

    res = _cli("bench", "--help")
    assert res.returncode == 0, res.stderr
    for mode, line in MODES.items():
        assert re.search(rf"^  {re.escape(mode)} +{re.escape(line)}$", res.stdout, re.M), mode
    # Each mode's options sit under a heading that names it.
    for heading, option in [("latency and batched", "--num-seqs"), ("serve and soak", "--concurrency"),
                            ("speculative", "--draft-model"), ("llama-cpp", "--prompt-lengths")]:
        section = re.search(rf"^{re.escape(heading)}[^\n]*:\n((?:  [^\n]*\n)+)", res.stdout, re.M)
        assert section and option in section.group(1), heading


def test_bench_reports_prefill_and_decode(tiny_models):
    res = _cli("bench", "--model", str(tiny_models["f32"]), "--prompt-tokens", "32", "--decode-tokens", "8", "--repeat", "1")
    assert res.returncode == 0, res.stderr
    assert "prefill=" in res.stdout and "decode=" in res.stdout
    # Which attention code the figures come from, on stderr.
    assert "kernel attention (head_dim 16" in res.stderr, res.stderr


def test_bench_batched_reports_aggregate_decode(tiny_models):
    res = _cli(
        "bench", "batched", "--model", str(tiny_models["f32"]), "--num-seqs", "3",
        "--prompt-tokens", "8", "--decode-tokens", "4", "--repeat", "1",
    )
    assert res.returncode == 0, res.stderr
    assert "seqs=3" in res.stdout and "prefill=" in res.stdout and "aggregate" in res.stdout


def test_bench_throughput_compares_batched_and_serial(tiny_models):
    res = _cli(
        "bench", "throughput", "--model", str(tiny_models["f32"]), "--num-requests", "4",
        "--prompt-range", "4", "8", "--output-range", "2", "4",
    )
    assert res.returncode == 0, res.stderr
    assert "batched: output=" in res.stdout and "one-by-one" in res.stdout and "speed-up" in res.stdout


def test_bench_prefix_shows_the_cache_saving_work(tiny_models):
    res = _cli(
        "bench", "prefix", "--model", str(tiny_models["f32"]), "--num-requests", "3",
        "--shared-tokens", "64", "--own-tokens", "4", "--output-tokens", "2",
    )
    assert res.returncode == 0, res.stderr
    # With the cache, the 2nd and 3rd requests reuse the 64 shared tokens (4 full blocks); without, nothing.
    assert "cache on: " in res.stdout and "computed 76/204 prompt tokens, hits 128" in res.stdout
    assert "cache off: " in res.stdout and "computed 204/204 prompt tokens, hits 0" in res.stdout


def test_bench_kv_layout_runs_both_layouts_with_the_same_outputs(tiny_models):
    res = _cli(
        "bench", "kv-layout", "--model", str(tiny_models["f32"]), "--num-requests", "4",
        "--prompt-range", "4", "8", "--output-range", "2", "4",
    )
    assert res.returncode == 0, res.stderr
    assert "block: output=" in res.stdout and "slot: output=" in res.stdout, res.stdout
    assert "blocks = " in res.stdout and "cells = " in res.stdout, res.stdout
    assert "identical outputs: yes" in res.stdout, res.stdout


def test_bench_speculative_runs_every_engine_with_identical_outputs(tiny_models):
    res = _cli(
        "bench", "speculative", "--model", str(tiny_models["f32"]), "--draft-model", str(tiny_models["gguf"]),
        "--num-requests", "2", "--batch1-prompts", "1", "--decode-tokens", "8", "--repeat", "1",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    # Two workloads, each at batch 1 and batch 2.
    assert len(lines) == 4, res.stdout
    for line in lines:
        assert "plain " in line and "ngram " in line and "draft " in line, line
        assert line.count("identical=True") == 2, line


def test_bench_speculative_can_skip_batch_one_and_rejects_a_negative_count(tiny_models):
    common = ("bench", "speculative", "--model", str(tiny_models["f32"]), "--num-requests", "2",
              "--decode-tokens", "4", "--repeat", "1", "--workloads", "free-form")
    res = _cli(*common, "--batch1-prompts", "0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and " free-form batch=2 " in lines[0], res.stdout
    res = _cli(*common, "--batch1-prompts", "-1")
    assert res.returncode == 2 and "--batch1-prompts" in res.stderr and "0 or more" in res.stderr


def test_generate_takes_a_speculative_config(tiny_models, tiny_llm):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    res = _cli("generate", "--model", str(tiny_models["f32"]), "--max-tokens", "8", "--speculative-config", spec, "hello")
    assert res.returncode == 0, res.stderr
    assert res.stdout == tiny_llm.generate("hello", _greedy(8))[0].outputs[0].text + "\n"
    res = _cli("generate", "--model", str(tiny_models["f32"]), "--speculative-config", "{bad", "hello")
    assert res.returncode == 2 and "speculative-config" in res.stderr


def test_generate_takes_a_quantization(tiny_models):
    # The tiny model's down_proj (128 inputs) is FP8 with --quantization fp8: the same text as the library gives.
    from novainfer import LLM

    res = _cli("generate", "--model", str(tiny_models["f32"]), "--max-tokens", "8", "--quantization", "fp8", "hello")
    assert res.returncode == 0, res.stderr
    expected = LLM(tiny_models["f32"], quantization="fp8").generate("hello", _greedy(8))[0].outputs[0].text
    assert res.stdout == expected + "\n"
    res = _cli("generate", "--model", str(tiny_models["f32"]), "--quantization", "int3", "hello")
    assert res.returncode == 2 and "quantization" in res.stderr


def test_bench_llama_cpp_puts_both_engines_side_by_side(tiny_models, tmp_path):
    """Stand-ins for llama.cpp's bench tools print its JSONL at fixed speeds: the table holds NovaInfer's own
    measurement beside them, their ratio and each process's peak RSS; a failing tool is a failed cell and exit 1."""
    bench = tmp_path / "llama-bench"
    bench.write_text('#!/bin/sh\necho \'{"n_prompt": 1, "avg_ts": 10.0}\'\n')
    batched = tmp_path / "llama-batched-bench"
    batched.write_text('#!/bin/sh\necho \'{"pl": 1, "speed_tg": 5.0}\'\necho \'{"pl": 2, "speed_tg": 8.0}\'\n')
    for tool in (bench, batched):
        tool.chmod(0o755)
    args = ("bench", "llama-cpp", "--model", str(tiny_models["gguf"]), "--llama-cpp", str(tmp_path), "--threads", "1",
            "--repeat", "1", "--prompt-lengths", "32", "--depths", "0", "--batch-sizes", "1", "2")
    res = _cli(*args)
    assert res.returncode == 0, res.stderr
    table, roofs = res.stdout.split("| point | MB read per token")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"point", "prefill 32", "decode at depth 0", "batched decode, 1 seqs (aggregate)",
                         "batched decode, 2 seqs (aggregate)"}, res.stdout
    for name, (ours, theirs, ratio, rss) in rows.items():
        if name == "point":
            continue
        want = {"batched decode, 1 seqs (aggregate)": 5.0, "batched decode, 2 seqs (aggregate)": 8.0}.get(name, 10.0)
        assert float(theirs) == want and abs(float(ratio.rstrip("×")) - float(ours) / want) < 0.01, (name, ratio)
        assert all(float(v) > 0 for v in rss.split(" / ")), rss
    assert "KV-cache bytes per token: f32" in res.stdout
    # The decode point against the memory roof: the tiny model's weights over the measured bandwidth.
    assert re.search(r"Memory read bandwidth with 1 threads: [\d.]+–[\d.]+ GB/s", table), table
    (roof_row,) = [line for line in roofs.splitlines() if line.startswith("| decode at depth 0 |")]
    mb, roof, _, theirs_share = [c.strip() for c in roof_row.split("|")[2:-1]]
    assert float(mb.replace(",", "")) > 0 and float(roof) > 0
    assert theirs_share == f"{10.0 / float(roof):.0%}", roof_row
    bench.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    res = _cli(*args)
    assert res.returncode == 1 and "failed (exit 3: boom)" in res.stdout, res.stdout
    # A tool the points need but the directory lacks stops the run before the first point, with its name.
    batched.unlink()
    res = _cli(*args)
    assert res.returncode == 1 and "lacks llama-batched-bench" in res.stderr and "Traceback" not in res.stderr
    assert "prefill" not in res.stderr, res.stderr
    bench.write_text('#!/bin/sh\necho \'{"n_prompt": 1, "avg_ts": 10.0}\'\n')
    res = _cli(*args[:-2])  # `--batch-sizes` with none: llama-bench alone suffices
    assert res.returncode == 0, res.stderr
