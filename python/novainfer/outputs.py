"""Result types returned by `LLM.generate`, `LLM.chat` and the streaming methods.

They mirror vLLM's `RequestOutput` / `CompletionOutput` so code written for vLLM reads the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestOutput", "StreamDelta"]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated completion.

    `logprobs`, when requested, has one dict per generated token mapping token id to log-probability: the
    chosen token and the top `SamplingParams.logprobs` alternatives, from the model's raw distribution.
    `finish_reason` is ``"stop"`` (EOS, stop token or stop string), ``"length"`` (`max_tokens` or the
    context limit) or ``"abort"``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the chosen tokens' log-probabilities, when logprobs were requested."""
        if self.logprobs is None:
            return None
        return sum(lp[tok] for lp, tok in zip(self.logprobs, self.token_ids))


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt: the prompt as the model saw it, its completion(s), and how many prompt
    tokens were served from the prefix cache instead of being computed (`num_cached_tokens`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class StreamDelta:
    """What one generation step added to one completion: new text (whole characters, never part of a stop
    string), the new token ids, their logprobs if requested, and on the completion's last delta the
    `finish_reason`. `index` says which of the request's `SamplingParams.n` completions it extends; the
    stream ends once every completion has finished."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
