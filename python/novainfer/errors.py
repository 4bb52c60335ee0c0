"""The typed exceptions NovaInfer raises to Python callers.

Every error the library raises on purpose is a `NovaInferError`, so callers can catch the whole family with
one clause, or one branch of it by class. The Rust extension raises these same classes by name (it imports
this module), which keeps the mapping from Rust errors to Python in exactly one place.

Invariants:
- Classes that also derive from a builtin (`ValueError`, `FileNotFoundError`) do so because callers already
  catch those builtins for the same situation; `except ValueError` keeps working.
- This module imports only the standard library: it must load even when the native module is missing.
"""

from __future__ import annotations

__all__ = [
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
]


class NovaInferError(Exception):
    """Root of every exception NovaInfer raises on purpose."""


class InvalidParameterError(NovaInferError, ValueError):
    """A request or engine argument is outside what is allowed.

    `param` names the culprit parameter (for example ``"temperature"``), or is None when the fault is not
    tied to one parameter. The message states the limit that was broken.
    """

    param: str | None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        # The default reduction replays only `args`, which would drop `param` across pickling
        # (multiprocessing, concurrent.futures).
        return (type(self), (str(self), self.param))


class PromptTooLongError(InvalidParameterError):
    """The prompt, plus the tokens asked for, does not fit the model's context length."""


class ModelLoadError(NovaInferError):
    """Model files are unreadable, truncated, inconsistent or of an unsupported kind."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model is neither an existing local path nor a known demo-model name."""


class DeviceUnavailableError(NovaInferError):
    """The device asked for (``device="cuda"`` or ``"cuda:N"``) cannot be used on this machine.

    The message names what is missing: the NVIDIA driver (libcuda), a driver new enough for CUDA 13,
    NVRTC or cuBLAS, a GPU with that ordinal, or CUDA support in this build. NovaInfer never answers an
    explicit GPU request by running on the CPU instead; ``device="auto"`` is the choice that falls back.
    `param` is ``"device"``.
    """

    param: str | None

    def __init__(self, message: str, param: str | None = "device") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return (type(self), (str(self), self.param))


class TokenizerError(NovaInferError):
    """The tokenizer could not be loaded, or could not encode or decode the given input."""


class ChatTemplateError(NovaInferError):
    """The chat template is missing, does not compile, or failed while rendering the messages."""


class FetchError(NovaInferError):
    """Downloading or assembling a demo model failed."""


class ChecksumMismatchError(FetchError):
    """An assembled or cached file does not have the expected sha256; the message carries both hashes."""


class EngineError(NovaInferError):
    """An internal failure while generating; the engine could not complete the request."""
