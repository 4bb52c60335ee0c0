"""`AsyncLLM`: the engine for asyncio programs with many concurrent callers.

Every request is a native stream on the shared engine thread (continuous batching). A small pump thread per
stream waits for its deltas with the GIL released and hands each to the event loop
(``call_soon_threadsafe``), so the event loop never blocks, and many streams do not queue behind the default
executor's few threads. Leaving an ``async for`` early (break, an exception, task cancellation) closes the
stream without waiting: the request is aborted and its KV blocks are freed before the engine's next step, and
the pump thread notices the close within the native poll interval (50 ms) and exits.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from . import _native
from .llm import LLM, ChatMessage, PromptInput, _priority
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput, StopReason, StreamDelta, _logprobs

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
        self,
        prompt: PromptInput,
        sampling_params: _native.SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Yields `StreamDelta`s for one prompt as tokens are generated; `priority` and `lora_request` as in
        `LLM.generate`."""
        (params,) = self.llm._params_for(1, sampling_params)
        adapters = self.llm._adapters(1, lora_request)
        adapter = None if adapters is None else adapters[0]
        stream = self.llm._engine.stream(self.llm._token_ids(prompt), params, _priority(priority), adapter)
        async for delta in _deltas(stream):
            yield delta

    async def chat_stream(
        self,
        messages: Sequence[ChatMessage],
        sampling_params: _native.SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Like `generate_stream` for one conversation rendered with the chat template (`tools` shown to
        the model as in `LLM.chat`)."""
        prompt = self.llm.apply_chat_template(messages, tools=tools)
        (params,) = self.llm._params_for(1, sampling_params)
        token_ids = self.llm.encode(prompt, add_special_tokens=False)
        stream = self.llm._engine.stream(token_ids, params, _priority(priority))
        async for delta in _deltas(stream):
            yield delta

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: _native.SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Completes one prompt; concurrent calls are batched together by the engine (in `priority` order
        under ``scheduling_policy="priority"``), also across LoRA adapters (`lora_request`)."""
        token_ids = self.llm._token_ids(prompt)
        (params,) = self.llm._params_for(1, sampling_params)
        texts: list[list[str]] = [[] for _ in range(params.n)]
        ids: list[list[int]] = [[] for _ in range(params.n)]
        reasons = ["abort"] * params.n
        stop_reasons: list[StopReason] = [None] * params.n
        logprobs: list[list[dict[int, Logprob]] | None] = [None] * params.n
        async for d in self.generate_stream(token_ids, params, priority, lora_request):
            texts[d.index].append(d.text)
            ids[d.index].extend(d.token_ids)
            if d.logprobs is not None:
                logprobs[d.index] = (logprobs[d.index] or []) + d.logprobs
            reasons[d.index] = d.finish_reason or reasons[d.index]
            if d.finish_reason is not None:
                stop_reasons[d.index] = d.stop_reason
        return RequestOutput(
            request_id="async",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            outputs=[
                CompletionOutput(i, "".join(texts[i]), ids[i], reasons[i], logprobs[i], stop_reasons[i])
                for i in range(params.n)
            ],
        )


#: Marks the end of a pump thread's deliveries.
_END = object()


def _pump(stream: _native.TokenStream, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[object]) -> None:
    """Runs on its own thread: every item of `stream` (or the exception that ended it), then `_END`."""

    def deliver(item: object) -> bool:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
            return True
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            stream.close()
            return False

    try:
        for item in stream:
            if not deliver(item):
                return
    except Exception as e:  # an engine error, re-raised in the awaiting task
        if not deliver(e):
            return
    deliver(_END)


async def _deltas(stream: _native.TokenStream) -> AsyncIterator[StreamDelta]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    threading.Thread(target=_pump, args=(stream, loop, queue), name="novainfer-stream", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            text, ids, reason, logprobs, _cached, index, stop_reason = item  # type: ignore[misc]
            yield StreamDelta(text, ids, reason, _logprobs(logprobs), index, stop_reason)
    finally:
        # Never blocks: aborts the request at once; the pump thread ends on its own.
        stream.close()
