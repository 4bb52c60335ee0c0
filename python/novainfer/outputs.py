"""Result types returned by `LLM.generate`, `LLM.chat` and the streaming methods.

They mirror vLLM's `RequestOutput` / `CompletionOutput` so code written for vLLM reads the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "StreamDelta"]

#: What ended a completion besides EOS and length: the stop string, or the stop token id.
StopReason = Union[int, str, None]


class Logprob(float):
    """The log-probability of one token, shaped like vLLM's `Logprob`: `logprob`, `rank` (1 = the most likely
    token of the raw distribution; the chosen token's rank counts every token at least as likely) and
    `decoded_token` (its text, special tokens spelled out).

    Unlike vLLM's, it is also the float itself, so code that reads ``logprobs[i][token_id]`` as a number (NovaInfer's
    earlier ``dict[int, float]``) keeps working.
    """

    __slots__ = ("rank", "decoded_token")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        """The log-probability as a plain float."""
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self) -> tuple[type[Logprob], tuple[float, int | None, str | None]]:
        return (Logprob, (float(self), self.rank, self.decoded_token))


def _logprobs(raw: list[dict[int, tuple[float, int, str]]] | None) -> list[dict[int, Logprob]] | None:
    """The engine's per-token `{id: (logprob, rank, text)}` as `Logprob` objects."""
    if raw is None:
        return None
    return [{tid: Logprob(lp, rank, text) for tid, (lp, rank, text) in entry.items()} for entry in raw]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated completion.

    `logprobs`, when requested, has one dict per generated token mapping token id to `Logprob`: the
    chosen token and the top `SamplingParams.logprobs` alternatives, from the model's raw distribution.
    `finish_reason` is ``"stop"`` (EOS, stop token or stop string), ``"length"`` (`max_tokens` or the
    context limit) or ``"abort"``; `stop_reason` is the stop string (str) or stop token id (int) that ended
    it, and None for EOS, length and abort (as in vLLM, except that vLLM also reports the ids of
    ``generation_config.json``'s extra EOS tokens there).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: StopReason = None

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
    `finish_reason` (with `stop_reason`, see `CompletionOutput`). `index` says which of the request's
    `SamplingParams.n` completions it extends; the stream ends once every completion has finished."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    index: int = 0
    stop_reason: StopReason = None
