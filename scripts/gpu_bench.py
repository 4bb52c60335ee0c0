"""GPU benchmarks for docs/benchmarks.md, run by `scripts/gpu-test run` on a machine with an NVIDIA GPU.

For each demo model cached under $NOVAINFER_HOME (the 0.5B one is staged by `scripts/gpu-test stage-model`):
- batch-1 decode tokens/s through NovaInfer on ``device="cuda"``, next to the bandwidth limit: the bytes of
  weights one decoded token reads (bf16, as the CUDA executor holds them; the embedding table contributes one
  row) divided into the GPU's measured device-to-device copy rate;
- nano-vllm's workload: 256 requests with prompt and output lengths uniform in [100, 1024] (seed 0, EOS
  ignored), all submitted at once; output tokens/s;
- the same two workloads through HF transformers (bf16, eager attention's default, static batches of 64 with
  left padding) on the same GPU, from the f32 checkpoint tools/gguf_to_hf.py writes.

Timings are wall-clock around whole generate calls after one warm-up (the figures are rates over seconds of
work, far above launch jitter); the copy bandwidth uses CUDA events. Prints one block per model.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

DEMOS = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}
WORKLOAD = {"num_requests": 256, "lengths": (100, 1024), "seed": 0}


def copy_bandwidth() -> float:
    """Bytes moved per second (read + written) by a 1 GiB device-to-device copy, best of 10."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = max(best, 2 * n / (start.elapsed_time(end) / 1e3))
    return best


def weight_bytes_per_token(config: dict) -> int:
    """bf16 bytes of the weights one decode step reads (every matrix once; one embedding row)."""
    h, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    d = h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * f
    return 2 * (layers * per_layer + vocab * h + h)


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(WORKLOAD["seed"])
    lo, hi = WORKLOAD["lengths"]
    prompts = [[rng.randrange(1000, min(vocab, 150_000)) for _ in range(rng.randint(lo, hi))]
               for _ in range(WORKLOAD["num_requests"])]
    outputs = [rng.randint(lo, hi) for _ in prompts]
    return prompts, outputs


def novainfer_figures(gguf: Path) -> dict[str, float]:
    from novainfer import LLM, SamplingParams
    from novainfer.bench import bench_latency

    llm = LLM(gguf, device="cuda", max_num_seqs=256, max_num_batched_tokens=8192)
    assert llm.device.startswith("cuda"), llm.device
    bench_latency(llm, 128, 16)  # warm-up: kernels loaded, pool touched
    _, decode = max(bench_latency(llm, 128, 256) for _ in range(3))
    prompts, outputs = workload(llm._engine.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"decode_b1_tok_s": decode, "workload_output_tok_s": sum(outputs) / seconds,
            "workload_seconds": seconds}


def hf_figures(hf_dir: Path) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to("cuda").eval()
    vocab = model.config.vocab_size

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate([list(range(1000, 1128))], 16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate([list(range(1000, 1128))], 256)
        torch.cuda.synchronize()
        decode = 255 / (time.perf_counter() - start)
        prompts, outputs = workload(vocab)
        start = time.perf_counter()
        for i in range(0, len(prompts), 64):
            generate(prompts[i:i + 64], max(outputs[i:i + 64]))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"decode_b1_tok_s": decode, "workload_output_tok_s": sum(outputs) / seconds, "workload_seconds": seconds}


def main() -> int:
    from gguf_to_hf import convert
    from novainfer.fetch import cache_dir, models_dir

    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)")
    ran = 0
    for name, file in DEMOS.items():
        gguf = models_dir() / file
        if not gguf.is_file():
            print(f"{name}: not cached, skipped")
            continue
        ran += 1
        hf_dir = cache_dir() / "test-artifacts" / f"{name}-f32"
        if not (hf_dir / "model.safetensors").exists():
            convert(gguf, hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        limit = bandwidth / weight_bytes_per_token(config)
        ours = novainfer_figures(gguf)
        theirs = hf_figures(hf_dir)  # its model is freed on return; the next model starts clean
        import torch

        torch.cuda.empty_cache()
        print(f"{name}: weight bytes/token {weight_bytes_per_token(config) / 2**20:.0f} MiB (bf16), "
              f"bandwidth limit {limit:.0f} tok/s")
        print(f"  batch-1 decode: novainfer {ours['decode_b1_tok_s']:.1f} tok/s "
              f"({100 * ours['decode_b1_tok_s'] / limit:.0f}% of the limit), "
              f"transformers {theirs['decode_b1_tok_s']:.1f} tok/s")
        print(f"  256 requests, lengths U[100, 1024]: novainfer {ours['workload_output_tok_s']:.0f} output tok/s "
              f"({ours['workload_seconds']:.1f} s), transformers (static batches of 64) "
              f"{theirs['workload_output_tok_s']:.0f} output tok/s ({theirs['workload_seconds']:.1f} s)")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
