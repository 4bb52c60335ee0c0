"""`LoRARequest`: which LoRA adapter a request runs with, in vLLM's shape (``vllm.lora.request``).

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) or a llama.cpp GGUF
adapter file. `LLM(..., enable_lora=True)` loads each adapter the first time a request names it; requests on
different adapters (and on the base model) are batched together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import InvalidParameterError

__all__ = ["LoRARequest"]


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: `lora_name` names it, `lora_int_id` (a positive int) identifies it as
    in vLLM, `lora_path` is where it is loaded from the first time it is used.

    Two requests with the same name must give the same id and path: a different adapter needs another name.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameterError(f"lora_name must be a non-empty string, got {self.lora_name!r}", "lora_name")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidParameterError(
                f"lora_int_id must be a positive int, got {self.lora_int_id!r}", "lora_int_id"
            )
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise InvalidParameterError(f"lora_path must be a path, got {self.lora_path!r}", "lora_path")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
