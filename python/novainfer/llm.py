"""`LLM`: the offline entry point, modelled on vLLM's `LLM` class.

Python only shapes arguments and results here; tokenizing, templating and generation run in Rust with the
GIL released.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

from . import _native
from .errors import InvalidParameterError
from .cuda_libs import find_cuda_libraries
from .fetch import resolve_model
from .lora import LoRARequest
from .outputs import CompletionOutput, RequestOutput, StreamDelta, _logprobs
from .tokenizer import Tokenizer, render_chat

__all__ = ["LLM", "ChatMessage", "PromptInput"]

SamplingParams = _native.SamplingParams

#: A chat message: ``{"role": "user", "content": "..."}`` (content may also be a list of text parts).
ChatMessage = Mapping[str, Any]
#: A prompt: text, token ids the model consumes as they are, or vLLM's dict forms ``{"prompt": text}`` and
#: ``{"prompt_token_ids": [...]}``.
PromptInput = Union[str, Sequence[int], Mapping[str, Any]]

_request_ids = itertools.count()
_log = logging.getLogger("novainfer")


def _as_list(value: object, what: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidParameterError(f"{what} must be a list, got {type(value).__name__}", what)
    return list(value)


def _priority(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -(2**31) <= value < 2**31:
        raise InvalidParameterError(f"priority must be a 32-bit int, got {value!r}", "priority")
    return value


def _completions(raw: list[tuple[str, list[int], str, Any, Any]]) -> list[CompletionOutput]:
    return [
        CompletionOutput(i, text, ids, reason, _logprobs(logprobs), stop_reason)
        for i, (text, ids, reason, logprobs, stop_reason) in enumerate(raw)
    ]


def _prompt_text(prompt: object) -> str | None:
    """The text of a prompt, when it has one."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


class LLM:
    """A Qwen2-family model loaded for offline generation.

    `model` is a local HF directory, a local ``.gguf`` file, or a demo-model name such as
    ``"qwen2.5-coder-0.5b"`` (fetched and cached on first use). `dtype` chooses how safetensors weights are
    held (``"auto"`` keeps each tensor's stored f32/bf16/f16, which on the CPU gives the f32 path's bits at half
    the bytes for a 16-bit checkpoint; GGUF tensors keep their own types). `max_model_len` caps prompt +
    output tokens (default: the model's context length, or what the KV cache holds if that is less). `seed` is
    the base seed: a request without its own seed samples with `seed` + its request number, so repeated
    requests differ while a fresh `LLM` replays the same sequence of requests exactly.

    Requests are served by continuous batching: the KV cache — `kv_cache_bytes` (default 2 GiB), or
    `kv_cache_fraction` of the memory available once the model is loaded — is split into blocks of
    `block_size` tokens; each step runs at most `max_num_seqs` requests and `max_num_batched_tokens` tokens
    (decodes plus chunks of prompts); with `enable_prefix_caching`, prompts that share a prefix with earlier
    ones reuse its KV instead of recomputing it. A request's output never depends on what else is batched.
    `kv_layout` is ``"block"`` (the above) or ``"slot"``: llama.cpp-style cells of one token each (CPU only;
    `block_size` is ignored and there is no prefix caching), giving the same outputs.
    `kv_cache_dtype` (vLLM's name) is how the cache stores keys and values: ``"auto"`` (f16 on the CPU, half the
    bytes of f32; bf16 on a GPU), ``"f32"`` (exact), ``"f16"``, ``"bf16"`` or ``"q8_0"`` (llama.cpp's 8-bit
    blocks of 32 with an f16 scale; a quarter of f32). All but ``"auto"`` and ``"bf16"`` run on the CPU only.
    The KV budget holds tokens in proportion: `stats()`'s ``kv_bytes_per_block`` follows the dtype.
    `lm_head_dtype` is ``"auto"`` (the output projection exactly as the checkpoint stores it) or ``"q8_0"``: a
    dense one is quantized to llama.cpp's 8-bit blocks at load (lossy; CPU only). A decode step reads the whole
    head, which AWQ and GPTQ checkpoints keep in f16: for the 1.5B shape that is 467 MB of the ~1.2 GB an int4
    checkpoint reads per token, 262 MB in q8_0.

    Scheduling (vLLM's names): `scheduling_policy` is ``"fcfs"`` or ``"priority"`` (each request's
    `priority`, lower first; a waiting request gains one level per `priority_aging_steps` engine steps, so
    nothing waits forever). A prompt longer than `long_prefill_token_threshold` is computed at most that many
    tokens per step, at most `max_long_partial_prefills` such prompts at once (shorter ones overtake them), at
    most `max_num_partial_prefills` prompts of any length at once; running requests decode first in every
    step. Left unset on the CPU, `max_model_len` defaults to at most 8192, the threshold to 128 tokens per
    thread (256 to 2048) with one long prompt at a time, and `max_num_batched_tokens` to 256 per thread (512
    to 2048), so no single request holds the engine for minutes and no step for more than a few seconds
    (docs/scheduling.md states the rule); `max_num_seqs` to 64. On a GPU, as vLLM's defaults for GPUs, the
    long-prompt limits are off, `max_num_seqs` is 256 and `max_num_batched_tokens` 8192 (the server's: 2048).

    `speculative_config` turns on speculative decoding, in vLLM's shape: ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}`` drafts tokens by prompt
    lookup; ``{"method": "draft_model", "model": "<path>", "num_speculative_tokens": 4}`` drafts with a
    smaller model that has the same tokenizer (its KV pool takes a share of the KV budget, so both hold as
    many tokens). Drafts are verified in the next forward pass. Outputs are the same token for token as
    without it (greedy or sampled with a seed); `stats()` counts ``num_draft_tokens`` and
    ``num_accepted_tokens``. Unlike vLLM, each step drafts only as many tokens as measured costs and recent
    acceptance say will pay (none when drafting would be slower); ``"draft_policy": "always"`` in the config
    drafts ``num_speculative_tokens`` every step instead.

    `enable_lora` serves LoRA adapters (vLLM's names): a request given a `LoRARequest` runs with that adapter
    (a PEFT directory or a GGUF adapter file, loaded the first time it is named; at most `max_lora_rank`);
    requests on different adapters and on the base model share batches, and at most `max_loras` distinct
    adapters run at once (requests on others wait). KV computed under an adapter is only reused by requests on
    the same adapter. On a GPU adapters are copied to the device on first use.

    `device` is ``"auto"`` (the first usable NVIDIA GPU when its executor can run the model, else the CPU —
    the SLOT layout and head sizes without GPU kernels run on the CPU; the choice and its reason are logged
    on the ``novainfer`` logger and kept in `device`), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. An explicit GPU
    that cannot be used raises `DeviceUnavailableError` naming what is missing; it never runs on the CPU
    instead. On a GPU the KV cache is sized as in vLLM: the engine may use `gpu_memory_utilization` of the
    GPU's memory, and the cache gets what the weights leave of it (unless `kv_cache_bytes` is given;
    `kv_cache_fraction` is for host memory and is refused on a GPU). `gpu_memory_utilization` is ignored on
    the CPU.

    `gpu_weight_dtype` is how a GPU holds quantized matrices: ``"auto"`` (the default: FP8 ones kept as FP8, the
    rest as ``"bf16"``), ``"bf16"`` (expanded at load) or ``"native"`` (GGUF Q4_K/Q5_0/Q6_K/Q8_0, AWQ/GPTQ int4 and
    FP8 kept as the file's blocks, which decode steps of up to 8 rows multiply in place, reading a third of the bytes;
    larger steps expand them first; a request's tokens can then differ between a small and a large batch; not yet
    verified on a GPU). Ignored on the CPU.

    `quantization="fp8"` quantizes a dense checkpoint's decoder linear layers at load to FP8 (e4m3, a scale per
    output channel, as vLLM's option): a GPU keeps them as FP8 (half the bytes of bf16); the CPU, which has no FP8
    arithmetic, runs their dense f32 values, so both compute with the same weights (on the CPU for the numbers, not
    speed: twice a bf16 checkpoint's bytes). Embeddings, norms and the lm_head
    stay as they are. An already quantized checkpoint (GGUF blocks, AWQ, GPTQ) is a `ModelLoadError`; an FP8 one is
    kept as it is.

    `enforce_eager=True` never replays CUDA graphs (vLLM's option). Graphs are captured per decode batch
    size at start-up and replayed for plain decode steps; until a GPU run has verified them they are off
    unless the environment sets ``NOVAINFER_CUDA_GRAPHS=1``, which `enforce_eager` overrides. Ignored on
    the CPU. Likewise ``NOVAINFER_CUDA_DECODE_LINEAR=fused`` runs decode steps' linear layers through one
    GEMV kernel each with the next kernel fused in (QKV with bias, RoPE and the cache write; gate/up with
    SiLU·mul); read when the engine loads, any other value than ``separate`` or ``fused`` is an
    `InvalidParameterError`.

    `async_scheduling=True` schedules each step while the step before it runs, its decodes fed the tokens that
    step draws on the device (vLLM's option), so the host's work overlaps the GPU's: on a GPU each step is
    enqueued before the one before it is read back, its tokens taken from that step's draws on the device
    (not yet verified on a GPU). Outputs are the same; a
    request that stops may compute one extra token, which is dropped. A step whose sampled rows need the host
    (penalties, grammars, ``n > 1``'s shared first row) is followed in order. On the CPU, which samples nothing
    itself, rows are then drawn on the executor's thread by the GPU kernel's host twin: greedy tokens are the same,
    seeded random ones another (equally seeded) stream. Refused with `speculative_config`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        requantize_q5_0: bool = False,
        lm_head_dtype: str = "auto",
        gpu_weight_dtype: str = "auto",
        quantization: str | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool = False,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        kv_cache_fraction: float | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        kv_layout: str = "block",
        kv_cache_dtype: str = "auto",
        scheduling_policy: str = "fcfs",
        priority_aging_steps: int = 256,
        long_prefill_token_threshold: int | None = None,
        max_num_partial_prefills: int | None = None,
        max_long_partial_prefills: int | None = None,
        speculative_config: Mapping[str, Any] | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", 1 if max_num_seqs is None else max_num_seqs),
            ("max_num_batched_tokens", 1 if max_num_batched_tokens is None else max_num_batched_tokens),
            ("kv_cache_bytes", 1 if kv_cache_bytes is None else kv_cache_bytes),
            ("priority_aging_steps", priority_aging_steps),
            ("long_prefill_token_threshold", 1 if long_prefill_token_threshold is None else long_prefill_token_threshold),
            ("max_num_partial_prefills", 1 if max_num_partial_prefills is None else max_num_partial_prefills),
            ("max_long_partial_prefills", 1 if max_long_partial_prefills is None else max_long_partial_prefills),
            ("max_loras", max_loras),
            ("max_lora_rank", max_lora_rank),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive int, got {value!r}", name)
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise InvalidParameterError(f"max_model_len must be a positive int, got {max_model_len!r}", "max_model_len")
        if not isinstance(seed, int) or seed < 0:
            raise InvalidParameterError(f"seed must be a non-negative int, got {seed!r}", "seed")
        if not isinstance(kv_layout, str):
            raise InvalidParameterError(f'kv_layout must be "block" or "slot", got {kv_layout!r}', "kv_layout")
        if not isinstance(kv_cache_dtype, str):
            raise InvalidParameterError(
                f'kv_cache_dtype must be one of "auto", "f32", "f16", "bf16", "q8_0", got {kv_cache_dtype!r}',
                "kv_cache_dtype",
            )
        if lm_head_dtype not in ("auto", "q8_0"):
            raise InvalidParameterError(f'lm_head_dtype must be "auto" or "q8_0", got {lm_head_dtype!r}', "lm_head_dtype")
        if gpu_weight_dtype not in ("auto", "bf16", "native"):
            raise InvalidParameterError(
                f'gpu_weight_dtype must be "auto", "bf16" or "native", got {gpu_weight_dtype!r}', "gpu_weight_dtype"
            )
        if quantization not in (None, "fp8"):
            raise InvalidParameterError(f'quantization must be "fp8" or None, got {quantization!r}', "quantization")
        if speculative_config is not None and not isinstance(speculative_config, Mapping):
            raise InvalidParameterError(
                f"speculative_config must be a dict, got {type(speculative_config).__name__}", "speculative_config"
            )
        if scheduling_policy not in ("fcfs", "priority"):
            raise InvalidParameterError(
                f'scheduling_policy must be "fcfs" or "priority", got {scheduling_policy!r}', "scheduling_policy"
            )
        if not isinstance(device, str):
            raise InvalidParameterError(f'device must be a string such as "cuda:0", got {device!r}', "device")
        if (
            not isinstance(gpu_memory_utilization, (int, float))
            or isinstance(gpu_memory_utilization, bool)
            or not 0 < gpu_memory_utilization <= 1
        ):
            raise InvalidParameterError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}", "gpu_memory_utilization"
            )
        self.kv_layout = kv_layout
        self.kv_cache_dtype = kv_cache_dtype
        self.model_path = resolve_model(model)
        find_cuda_libraries()
        self._engine = _native.Engine(
            str(self.model_path),
            device=device,
            gpu_memory_utilization=float(gpu_memory_utilization),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            requantize_q5_0=requantize_q5_0,
            lm_head_dtype=lm_head_dtype,
            gpu_weight_dtype=gpu_weight_dtype,
            quantization=quantization,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            block_size=block_size,
            kv_cache_bytes=kv_cache_bytes,
            kv_cache_fraction=kv_cache_fraction,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            kv_layout=kv_layout,
            kv_cache_dtype=kv_cache_dtype,
            scheduling_policy=scheduling_policy,
            priority_aging_steps=priority_aging_steps,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_num_partial_prefills=max_num_partial_prefills,
            max_long_partial_prefills=max_long_partial_prefills,
            speculative_config=None if speculative_config is None else json.dumps(dict(speculative_config)),
            enable_lora=bool(enable_lora),
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )
        # Adapters loaded through a LoRARequest: name → (lora_int_id, lora_path).
        self._loras: dict[str, tuple[int, str]] = {}

        _log.info("novainfer: %s runs on %s (%s)", self.model_path, self.device, self._engine.device_reason)

    @property
    def device(self) -> str:
        """The device the model runs on: ``"cpu"`` or ``"cuda:N"``."""
        return self._engine.device

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output, in tokens."""
        return self._engine.max_model_len

    def stats(self) -> dict[str, int | float]:
        """Engine counters: running/waiting requests, preemptions, KV blocks used/free and their high-water
        mark, the pool's size in bytes (`kv_pool_bytes`, `kv_bytes_per_block`; with a draft model both models' KV, which
        share the blocks), prefix-cache queries and hit
        tokens, prompt tokens computed, tokens generated, steps (`num_steps_ahead` of them scheduled ahead by
        `async_scheduling`), and seconds spent stepping. With speculative
        decoding: drafts verified (`num_drafts`), their tokens (`num_draft_tokens`), those confirmed
        (`num_accepted_tokens`), `spec_acceptance_rate` (confirmed / drafted) and `spec_mean_acceptance_length`
        (tokens per verified step: 1 + confirmed / drafts, as vLLM reports it).
        `weight_bytes_per_token`: the weight bytes one decode step reads, which with
        `novainfer._native.read_bandwidth()` bounds single-stream decode speed (on the CPU and a GPU); on a GPU
        also `weight_bytes`, the bytes the weights occupy in its memory (as `gpu_weight_dtype` holds them)."""
        return self._engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; returns False (and changes nothing) while requests are running."""
        return self._engine.reset_prefix_cache()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return self._engine.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        return self._engine.decode(list(token_ids), skip_special_tokens)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (NovaInfer's `Tokenizer`, not a Hugging Face one: see its docstring)."""
        return Tokenizer(self._engine)

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of `messages` (as transformers renders it); see
        `chat` for the options."""
        return render_chat(
            self._engine,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def _token_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown:
                raise InvalidParameterError(
                    f"a prompt dict may have 'prompt' or 'prompt_token_ids', not {unknown[0]!r}", "prompts"
                )
            if "prompt_token_ids" in prompt:
                return self._token_ids(list(prompt["prompt_token_ids"]))
            if isinstance(prompt.get("prompt"), str):
                return self._engine.encode(prompt["prompt"], True)
            raise InvalidParameterError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'", "prompts")
        if isinstance(prompt, str):
            return self._engine.encode(prompt, True)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):
                raise InvalidParameterError("prompt token ids must be non-negative", "prompt")
            return list(prompt)
        raise InvalidParameterError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads `lora_request`'s adapter now (requests naming it load it anyway); False if it was loaded.

        Raises `ModelLoadError` naming the field or tensor when the adapter does not fit the model, and
        `InvalidParameterError` when LoRA is off or the name is taken by another adapter.
        """
        if not isinstance(lora_request, LoRARequest):
            raise InvalidParameterError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}", "lora_request"
            )
        known = self._loras.get(lora_request.lora_name)
        wanted = (lora_request.lora_int_id, lora_request.lora_path)
        if known is not None:
            if known != wanted:
                raise InvalidParameterError(
                    f"LoRA adapter {lora_request.lora_name!r} is loaded with id {known[0]} from {known[1]!r}; "
                    "give another adapter another name",
                    "lora_request",
                )
            return False
        if any(i == lora_request.lora_int_id for i, _ in self._loras.values()):
            raise InvalidParameterError(
                f"lora_int_id {lora_request.lora_int_id} already identifies another adapter", "lora_request"
            )
        self._engine.load_lora(lora_request.lora_name, lora_request.lora_path)
        self._loras[lora_request.lora_name] = wanted
        return True

    def remove_lora(self, lora_name: str) -> None:
        """Unloads an adapter; requests running on it finish with it, later ones naming it load it again."""
        self._engine.unload_lora(lora_name)
        self._loras.pop(lora_name, None)

    def list_loras(self) -> list[str]:
        """Names of the loaded adapters."""
        return [name for name, _path, _rank in self._engine.list_loras()]

    def _adapters(self, n: int, lora_request: object) -> list[str | None] | None:
        """Per prompt, the adapter to run with (loaded on first use); None when no prompt has one."""
        if lora_request is None:
            return None
        requests = [lora_request] * n if isinstance(lora_request, LoRARequest) else _as_list(lora_request, "lora_request")
        if len(requests) != n:
            raise InvalidParameterError(
                f"lora_request must be one LoRARequest or a list of {n} (None for the base model)", "lora_request"
            )
        names: list[str | None] = []
        for r in requests:
            if r is None:
                names.append(None)
                continue
            self.add_lora(r)
            names.append(r.lora_name)
        return names

    def _params_for(self, n: int, sampling_params: object) -> list[_native.SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = _as_list(sampling_params, "sampling_params")
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidParameterError(
                f"sampling_params must be one SamplingParams or a list of {n} of them", "sampling_params"
            )
        return params

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: _native.SamplingParams | Sequence[_native.SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completes each prompt; returns one `RequestOutput` per prompt, in order.

        `prompts` is one prompt or a list of them; a prompt is text, a list of token ids, or vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": [...]}``. `sampling_params` is one `SamplingParams` for
        all prompts or a list with one per prompt (default: `SamplingParams()`). `use_tqdm` is accepted for
        vLLM compatibility and shows nothing: the whole batch runs in one call into the engine.
        `priority` (vLLM's) gives one int per prompt; under ``scheduling_policy="priority"`` lower values are
        scheduled first (it changes the order of work, never a request's output).
        `lora_request` (vLLM's) runs every prompt with one LoRA adapter, or gives one per prompt (None: the base
        model); see `LLM`'s `enable_lora`.
        Ctrl-C (SIGINT) while it runs raises `KeyboardInterrupt` within about 50 ms plus the engine step in
        progress, and aborts every prompt of the batch (their KV blocks are freed).
        """
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise InvalidParameterError(f"use_tqdm must be a bool or a callable, got {use_tqdm!r}", "use_tqdm")
        if (
            isinstance(prompts, (str, Mapping))
            or (isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int))
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = _as_list(prompts, "prompts")
        token_ids = [self._token_ids(p) for p in prompt_list]
        params = self._params_for(len(token_ids), sampling_params)
        priorities = None
        if priority is not None:
            priorities = _as_list(priority, "priority")
            if len(priorities) != len(token_ids):
                raise InvalidParameterError(
                    f"priority must be one 32-bit int per prompt ({len(token_ids)}), got {priority!r}", "priority"
                )
            priorities = [_priority(p) for p in priorities]
        adapters = self._adapters(len(token_ids), lora_request)
        results = self._engine.generate(token_ids, params, priorities, adapters)
        return [
            RequestOutput(
                request_id=str(next(_request_ids)),
                prompt=_prompt_text(p),
                prompt_token_ids=ids,
                outputs=_completions(completions),
                num_cached_tokens=cached,
            )
            for p, ids, (completions, cached) in zip(prompt_list, token_ids, results)
        ]

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: _native.SamplingParams | Sequence[_native.SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of messages) or to several (a list of such lists).

        Each conversation is rendered with the model's chat template, ending with the assistant's turn
        (`add_generation_prompt`); with `continue_final_message` (and ``add_generation_prompt=False``) the
        model continues the last message instead. `chat_template_kwargs` are extra template variables
        (``{"enable_thinking": False}``). `use_tqdm` is accepted and shows nothing, as in `generate`.

        `tools` (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``)
        are shown to the model by its chat template, as in vLLM; messages may carry tool calling's fields
        (an assistant's ``tool_calls``, whose ``arguments`` may be a JSON string, and a ``tool`` message's
        ``tool_call_id``). As in vLLM, the output is the model's text: calls appear in it in the model's own
        format (``<tool_call>{...}</tool_call>`` for Qwen2.5), neither parsed nor constrained; the server's
        chat endpoint does both. `lora_request` as in `generate`.
        """
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise InvalidParameterError(f"use_tqdm must be a bool or a callable, got {use_tqdm!r}", "use_tqdm")
        conversations = _as_list(messages, "messages")
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        prompts = [
            self.apply_chat_template(
                c,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for c in conversations
        ]
        # The template already wrote the special tokens; encoding must not add more.
        token_ids = [self._engine.encode(p, False) for p in prompts]
        params = self._params_for(len(token_ids), sampling_params)
        adapters = self._adapters(len(token_ids), lora_request)
        results = self._engine.generate(token_ids, params, None, adapters)
        return [
            RequestOutput(
                request_id=str(next(_request_ids)),
                prompt=prompt,
                prompt_token_ids=ids,
                outputs=_completions(completions),
                num_cached_tokens=cached,
            )
            for prompt, ids, (completions, cached) in zip(prompts, token_ids, results)
        ]

    def generate_stream(
        self,
        prompt: PromptInput,
        sampling_params: _native.SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[StreamDelta]:
        """Yields `StreamDelta`s for one prompt as tokens are generated; `priority` and `lora_request` as in
        `generate`.

        Stopping the iteration early (``break``, or closing the generator) aborts the request.
        """
        return self._stream(self._token_ids(prompt), sampling_params, priority, lora_request)

    def chat_stream(
        self,
        messages: Sequence[ChatMessage],
        sampling_params: _native.SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[StreamDelta]:
        """Like `chat` for one conversation (`tools` as there), yielding `StreamDelta`s as tokens are
        generated; `priority` and `lora_request` as in `generate`."""
        prompt = self.apply_chat_template(messages, tools=tools)
        return self._stream(self._engine.encode(prompt, False), sampling_params, priority, lora_request)

    def _stream(
        self,
        token_ids: list[int],
        sampling_params: _native.SamplingParams | None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[StreamDelta]:
        (params,) = self._params_for(1, sampling_params)
        adapters = self._adapters(1, lora_request)
        adapter = None if adapters is None else adapters[0]
        stream = self._engine.stream(token_ids, params, _priority(priority), adapter)

        def deltas() -> Iterator[StreamDelta]:
            try:
                for text, ids, reason, logprobs, _cached, index, stop_reason in stream:
                    yield StreamDelta(text, ids, reason, _logprobs(logprobs), index, stop_reason)
            finally:
                stream.close()

        return deltas()

    def prompt_logits(
        self, token_ids: Sequence[int], *, step_by_step: bool = False, lora_request: LoRARequest | None = None
    ) -> tuple[bytes, int, int]:
        """Next-token logits at every position of `token_ids`: little-endian f32 bytes, rows, vocab size.

        With `step_by_step` the tokens go through the KV cache one at a time, as in decoding (base model
        only); otherwise in one prefill, with `lora_request`'s adapter if given. Meant for checking the model
        against a reference (``numpy.frombuffer(b, "<f4").reshape(rows, vocab)``).
        """
        adapters = self._adapters(1, lora_request)
        adapter = None if adapters is None else adapters[0]
        return self._engine.prompt_logits(self._token_ids(token_ids), step_by_step, adapter)
