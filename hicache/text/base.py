"""The tokenizer interface every tokenizer implements, and streaming detokenization."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

ChatMessage = Mapping[str, str]
"""``{"role": "system" | "user" | "assistant", "content": str}``."""


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed, or a chat template cannot be rendered."""


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. Implementations are immutable after construction (thread-safe reads)."""

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``."""
        ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation by default."""
        ...

    @property
    def pad_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens`` prepends the BOS token where the tokenizer defines one."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation rendered with the tokenizer's chat template."""
        ...


class DecodeStream:
    """Incremental detokenization for streaming: ``push(id)`` returns the newly complete text.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD), so a multi-byte
    character split across tokens is emitted once, whole.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        new = text[len(self._emitted) :]
        self._emitted = text
        return new

    def flush(self) -> str:
        """Whatever remains (including a trailing replacement character) at the end."""
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        new = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return new
