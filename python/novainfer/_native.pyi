"""Type stubs for the Rust extension `novainfer._native` (checked by mypy stubtest in the test suite)."""

from collections.abc import Iterator
from os import PathLike
from typing import final

from .structured_outputs import StructuredOutputsParams

__all__ = ["Engine", "SamplingParams", "TokenStream", "__version__", "cuda_unavailable_reason", "kernel_selections", "read_bandwidth", "serve"]
__version__: str

@final
class SamplingParams:
    """Parameters that control how tokens are picked and when generation stops.

    Invalid values raise ``InvalidParameterError`` naming the parameter.
    """

    def __new__(
        cls,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        max_tokens: int | None = 16,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        n: int = 1,
        min_tokens: int = 0,
        logit_bias: dict[int, float] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def stop(self) -> list[str]: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def n(self) -> int: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def logit_bias(self) -> dict[int, float]: ...
    @property
    def include_stop_str_in_output(self) -> bool: ...
    @property
    def skip_special_tokens(self) -> bool: ...
    @property
    def spaces_between_special_tokens(self) -> bool: ...
    @property
    def structured_outputs(self) -> StructuredOutputsParams | None: ...

#: Per token: id → (logprob, rank, decoded token).
_Logprobs = list[dict[int, tuple[float, int, str]]]
#: The stop string or stop token id that ended a completion.
_StopReason = int | str | None
_Delta = tuple[str, list[int], str | None, _Logprobs | None, int, int, _StopReason]

@final
class Engine:
    """A loaded model running on its own engine thread."""

    def __new__(
        cls,
        model: str | PathLike[str],
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
        speculative_config: str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
    ) -> Engine: ...
    def stats(self) -> dict[str, int | float]: ...
    def reset_prefix_cache(self) -> bool: ...
    @property
    def device(self) -> str: ...
    @property
    def device_reason(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self,
        messages: str,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: str | None = None,
    ) -> str: ...
    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        priority: list[int] | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[tuple[list[tuple[str, list[int], str, _Logprobs | None, _StopReason]], int]]: ...
    def stream(
        self, prompt: list[int], params: SamplingParams, priority: int = 0, adapter: str | None = None
    ) -> TokenStream: ...
    def prompt_logits(
        self, prompt: list[int], step_by_step: bool = False, adapter: str | None = None
    ) -> tuple[bytes, int, int]: ...
    def load_lora(self, name: str, path: str | PathLike[str], replace: bool = False) -> int: ...
    def unload_lora(self, name: str) -> None: ...
    @property
    def model_config(self) -> dict[str, int]: ...
    def list_loras(self) -> list[tuple[str, str, int]]: ...

@final
class TokenStream(Iterator[_Delta]):
    """The deltas of one streaming request; closing or dropping it aborts the request."""

    def __iter__(self) -> TokenStream: ...
    def __next__(self) -> _Delta: ...
    def close(self) -> None: ...

def serve(argv: list[str]) -> None:
    """Run the OpenAI-compatible HTTP server with `novainfer-server` arguments (without the program name)
    until SIGINT/SIGTERM, with the GIL released. Bad arguments raise ``InvalidParameterError``."""

def cuda_unavailable_reason(ordinal: int = 0) -> str | None:
    """None when CUDA GPU `ordinal` can run a model here, else what is missing."""

def kernel_selections() -> list[str]:
    """The CPU kernel choices this process has made so far (made when a model loads), one line each
    as logged: the kernel family and its timing problem, the implementation chosen, and how (the
    fastest of the bit-identical candidates on this CPU and by how much, forced by a
    ``NOVAINFER_*_ISA`` variable, or the only candidate)."""

def read_bandwidth(mib: int = 512, passes: int = 5) -> float:
    """This machine's memory read bandwidth in bytes per second: the fastest of `passes` reads of a
    `mib`-MiB buffer by the engine's CPU thread pool (``RAYON_NUM_THREADS`` threads) in each of two
    ways of prefetching (into L1 10 KiB ahead, and as the decode kernels do on this CPU). It bounds
    single-stream decode from above: see ``LLM.stats()["weight_bytes_per_token"]``. A bad size or
    pass count raises ``InvalidParameterError``."""
