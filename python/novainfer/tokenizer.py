"""`Tokenizer`: the model's tokenizer as `LLM.get_tokenizer()` returns it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from . import _native
from .errors import InvalidParameterError

__all__ = ["Tokenizer"]


def _as_list(value: object, what: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidParameterError(f"{what} must be a list, got {type(value).__name__}", what)
    return list(value)


def _text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidParameterError(
            f"messages[{i}].content must be a string or a list of text parts, got {content!r}", "messages"
        )
    return content


def _tool_call(call: object, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidParameterError(f"{where} must be {{'function': {{'name': ..., 'arguments': ...}}}}", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # The template prints arguments as JSON: a string would reach the model quoted (vLLM parses it too).
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise InvalidParameterError(f"{where}.function.arguments is not valid JSON: {e}", "messages") from e
    out: dict[str, Any] = {"name": function["name"], "arguments": {} if arguments is None else arguments}
    if call.get("id") is not None:  # type: ignore[union-attr]
        out["id"] = str(call["id"])  # type: ignore[index]
    return out


def messages_json(messages: object) -> str:
    """`messages` as the engine takes them: OpenAI-style dicts (`role`, `content` as a string or a list of
    ``{"type": "text"}`` parts joined with newlines as vLLM joins them, and tool calling's `name`,
    `tool_calls`, `tool_call_id`), as JSON."""
    out = []
    for i, message in enumerate(_as_list(messages, "messages")):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidParameterError(f"messages[{i}] must be a dict with a string 'role'", "messages")
        if "content" not in message and not message.get("tool_calls"):
            raise InvalidParameterError(f"messages[{i}] needs 'content', got {dict(message)!r}", "messages")
        m: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"), i)}
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                m[key] = str(message[key])
        calls = message.get("tool_calls") or []
        m["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(m)
    try:
        return json.dumps(out)
    except (TypeError, ValueError) as e:
        raise InvalidParameterError(f"messages must hold JSON values: {e}", "messages") from e


def render_chat(
    engine: _native.Engine,
    messages: object,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation, with vLLM's chat options (see `LLM.chat`)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidParameterError(
            "continue_final_message needs add_generation_prompt=False", "continue_final_message"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise InvalidParameterError("chat_template_kwargs must be a dict", "chat_template_kwargs")
    variables: dict[str, Any] = {}
    if tools is not None:
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise InvalidParameterError("tools must be a list of tool dicts", "tools")
        variables["tools"] = [dict(t) for t in tools]
    variables.update(chat_template_kwargs or {})
    kwargs = None
    if variables:
        try:
            kwargs = json.dumps(variables)
        except (TypeError, ValueError) as e:
            raise InvalidParameterError(f"chat_template_kwargs must be JSON values: {e}", "chat_template_kwargs") from e
    return engine.apply_chat_template(messages_json(messages), add_generation_prompt, continue_final_message, kwargs)


class Tokenizer:
    """The model's tokenizer (the Rust `tokenizers` library the engine itself uses).

    vLLM's `LLM.get_tokenizer()` returns a Hugging Face tokenizer; this one offers the calls code written for
    vLLM uses most — `encode`, `decode`, `apply_chat_template`, `eos_token_id`, `vocab_size`, ``len()`` — with
    the same meanings, and no others.
    """

    def __init__(self, engine: _native.Engine) -> None:
        self._engine = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return self._engine.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        return self._engine.decode(list(token_ids), skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **chat_template_kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the model's chat template, as text or (with `tokenize`) token ids;
        extra keyword arguments are template variables (``enable_thinking=False``), as in transformers."""
        text = render_chat(
            self._engine,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs or None,
        )
        return self._engine.encode(text, False) if tokenize else text

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS id (the first of `eos_token_ids`)."""
        ids = self._engine.eos_token_ids
        return ids[0] if ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (the tokenizer's EOS and `generation_config.json`'s)."""
        return self._engine.eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._engine.vocab_size

    def __len__(self) -> int:
        return self._engine.vocab_size
