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


def message_pairs(messages: object) -> list[tuple[str, str]]:
    """`messages` as `(role, content)` pairs; `content` may be a list of ``{"type": "text"}`` parts, joined
    with newlines as vLLM joins them."""
    pairs = []
    for i, message in enumerate(_as_list(messages, "messages")):
        if not isinstance(message, Mapping):
            raise InvalidParameterError(f"messages[{i}] must be a dict with 'role' and 'content'", "messages")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            content = "\n".join(p["text"] for p in content)
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidParameterError(
                f"messages[{i}] needs string 'role' and 'content', got {dict(message)!r}", "messages"
            )
        pairs.append((role, content))
    return pairs


def render_chat(
    engine: _native.Engine,
    messages: object,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, with vLLM's chat options (see `LLM.chat`)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidParameterError(
            "continue_final_message needs add_generation_prompt=False", "continue_final_message"
        )
    kwargs = None
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise InvalidParameterError("chat_template_kwargs must be a dict", "chat_template_kwargs")
        try:
            kwargs = json.dumps(dict(chat_template_kwargs))
        except (TypeError, ValueError) as e:
            raise InvalidParameterError(f"chat_template_kwargs must be JSON values: {e}", "chat_template_kwargs") from e
    return engine.apply_chat_template(message_pairs(messages), add_generation_prompt, continue_final_message, kwargs)


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
