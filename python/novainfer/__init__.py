"""NovaInfer: fast, exact inference for Qwen2-family LLMs.

    from novainfer import LLM, SamplingParams
    llm = LLM("qwen2.5-coder-0.5b")
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)
"""

from __future__ import annotations

from ._native import SamplingParams, __version__
from .errors import (
    ChatTemplateError,
    ChecksumMismatchError,
    DeviceUnavailableError,
    EngineError,
    FetchError,
    InvalidParameterError,
    ModelLoadError,
    ModelNotFoundError,
    NovaInferError,
    PromptTooLongError,
    TokenizerError,
)
from .async_llm import AsyncLLM
from .llm import LLM
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput, StreamDelta
from .structured_outputs import StructuredOutputsParams
from .tokenizer import Tokenizer

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "LoRARequest",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "StreamDelta",
    "Logprob",
    "Tokenizer",
    "NovaInferError",
    "InvalidParameterError",
    "PromptTooLongError",
    "ModelLoadError",
    "ModelNotFoundError",
    "DeviceUnavailableError",
    "TokenizerError",
    "ChatTemplateError",
    "FetchError",
    "ChecksumMismatchError",
    "EngineError",
    "__version__",
]
