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
    character split across tokens is emitted once, whole. Each push decodes only a short
    window (the tokens since the last emitted piece, plus the piece before them for context:
    decoders that drop or add a space at the start of a text do so in both decodes that are
    compared), so a long output costs linear, not quadratic, time. The pieces joined, plus
    ``flush()``, equal ``decode(all ids)`` for tokenizers whose decoding of a longer run
    extends that of a shorter one (byte-level BPE, WordPiece, SentencePiece).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the first id of the last emitted piece
        self._read = 0  # ids before this were emitted

    def _window(self) -> tuple[str, str]:
        ids = self._ids
        before = self._tok.decode(ids[self._prefix : self._read], skip_special_tokens=self._skip)
        now = self._tok.decode(ids[self._prefix :], skip_special_tokens=self._skip)
        return before, now

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before, now = self._window()
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever remains (including a trailing replacement character) at the end."""
        before, now = self._window()
        self._prefix = self._read = len(self._ids)
        return now[len(before) :] if now.startswith(before) else ""
