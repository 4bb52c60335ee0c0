"""The same-run GPU peer of issue 31: Hugging Face transformers with a static KV cache and
`torch.compile(mode="reduce-overhead")` (CUDA graphs), the "gpt-fast" recipe as transformers ships it, on the same
checkpoint as NovaInfer.

transformers (5.x) compiles a model's decoding forward by itself when `generate` runs with a compileable cache: a
`StaticCache` passed in (the same one for every call, reset between them, so that its shapes and the compiled graphs
are reused) and a `CompileConfig` with mode "reduce-overhead". A decode rate is measured as the difference of two
generations of different lengths from the same prompt, so the prompt's prefill cancels out:
`batch · (n2 − n1) / (t(n2) − t(n1))`, each time the best of a few runs after warm-up runs that compile and record.

Used by scripts/gpu_bench.py's `_peer` variant (`GPU_BENCH_VARIANTS=peer scripts/gpu-test bench`); on the CPU
(`device="cpu"`, compiled too) only for testing it, on a tiny model.
"""

from __future__ import annotations

import time
from pathlib import Path


class HfStaticPeer:
    """A bf16 transformers model on `device` with one static cache per (batch, cache length)."""

    def __init__(self, model_dir: Path, device: str = "cuda") -> None:
        import torch
        from transformers import AutoModelForCausalLM, CompileConfig

        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
        self.compile_config = CompileConfig(mode="reduce-overhead")
        if not device.startswith("cuda"):
            # transformers compiles on GPUs only unless told (its flag for testing on other devices).
            self.compile_config._compile_all_devices = True
        self.vocab = self.model.config.vocab_size
        self._caches: dict[tuple[int, int], object] = {}

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def _generate(self, ids, cache, new_tokens: int) -> float:  # noqa: ANN001
        """Seconds for one greedy generation of exactly `new_tokens` tokens after `ids` into `cache` (reset)."""
        torch = self.torch
        with torch.inference_mode():
            # Inside inference mode: the cache's tensors were made there (a reset outside it is refused).
            cache.reset()
            self._sync()
            start = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0, compile_config=self.compile_config)
        self._sync()
        seconds = time.perf_counter() - start
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
        return seconds

    def decode_rate(self, batch: int, prompt_tokens: int, n1: int, n2: int, repeats: int = 2,
                    warmups: int = 2) -> float:
        """Aggregate decode tok/s of `batch` sequences after `prompt_tokens`-token prompts (see the module doc)."""
        from transformers import StaticCache

        torch = self.torch
        key = (batch, prompt_tokens + n2)
        if key not in self._caches:
            self._caches[key] = StaticCache(config=self.model.config, max_cache_len=prompt_tokens + n2)
        cache = self._caches[key]
        g = torch.Generator().manual_seed(batch * 7919 + prompt_tokens)
        ids = torch.randint(100, self.vocab - 100, (batch, prompt_tokens), generator=g).to(self.device)
        for _ in range(warmups):
            self._generate(ids, cache, n1)
        short = min(self._generate(ids, cache, n1) for _ in range(repeats))
        long = min(self._generate(ids, cache, n2) for _ in range(repeats))
        if long <= short:
            raise RuntimeError(f"{n2} tokens took {long:.3f} s, no longer than {n1} tokens' {short:.3f} s")
        return batch * (n2 - n1) / (long - short)
