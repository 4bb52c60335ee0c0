"""`AsyncLLM`: the engine for asyncio programs with many concurrent callers.

Every request is a native stream on the shared engine thread (continuous batching); waiting for its next delta
happens in an executor thread with the GIL released, so the event loop never blocks. Leaving an
``async for`` early (break, an exception, task cancellation) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence

from . import _native
from .llm import LLM, ChatMessage, PromptInput
from .outputs import CompletionOutput, RequestOutput, StreamDelta

__all__ = ["AsyncLLM"]


class AsyncLLM:
    """An `LLM` with coroutine methods; takes the same arguments as `LLM`."""

    def __init__(self, model: str | os.PathLike[str], **engine_args: object) -> None:
        self.llm = LLM(model, **engine_args)  # type: ignore[arg-type]

    @property
    def device(self) -> str:
        """The device the model runs on: ``"cpu"`` or ``"cuda:N"``."""
        return self.llm.device

    async def generate_stream(
        self, prompt: PromptInput, sampling_params: _native.SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Yields `StreamDelta`s for one prompt as tokens are generated."""
        (params,) = self.llm._params_for(1, sampling_params)
        stream = self.llm._engine.stream(self.llm._token_ids(prompt), params)
        async for delta in _deltas(stream):
            yield delta

    async def chat_stream(
        self, messages: Sequence[ChatMessage], sampling_params: _native.SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Like `generate_stream` for one conversation rendered with the chat template."""
        prompt = self.llm.apply_chat_template(messages)
        (params,) = self.llm._params_for(1, sampling_params)
        stream = self.llm._engine.stream(self.llm.encode(prompt, add_special_tokens=False), params)
        async for delta in _deltas(stream):
            yield delta

    async def generate(
        self, prompt: PromptInput, sampling_params: _native.SamplingParams | None = None
    ) -> RequestOutput:
        """Completes one prompt; concurrent calls are batched together by the engine."""
        token_ids = self.llm._token_ids(prompt)
        (params,) = self.llm._params_for(1, sampling_params)
        texts: list[list[str]] = [[] for _ in range(params.n)]
        ids: list[list[int]] = [[] for _ in range(params.n)]
        reasons = ["abort"] * params.n
        logprobs: list[list[dict[int, float]] | None] = [None] * params.n
        async for d in self.generate_stream(token_ids, params):
            texts[d.index].append(d.text)
            ids[d.index].extend(d.token_ids)
            if d.logprobs is not None:
                logprobs[d.index] = (logprobs[d.index] or []) + d.logprobs
            reasons[d.index] = d.finish_reason or reasons[d.index]
        return RequestOutput(
            request_id="async",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            outputs=[
                CompletionOutput(i, "".join(texts[i]), ids[i], reasons[i], logprobs[i]) for i in range(params.n)
            ],
        )


async def _deltas(stream: _native.TokenStream) -> AsyncIterator[StreamDelta]:
    loop = asyncio.get_running_loop()
    try:
        while True:
            item = await loop.run_in_executor(None, next, stream, None)
            if item is None:
                return
            text, ids, reason, logprobs, _cached, index = item
            yield StreamDelta(text, ids, reason, logprobs, index)
    finally:
        stream.close()
