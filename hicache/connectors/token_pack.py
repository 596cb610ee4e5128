"""``PackedTokens``: a request's token ids in the wire's packed form, packed once each.

The connector sends the daemon a request's tokens as packed little-endian uint32
(``protos.pack_tokens``), a span at a time: a lookup the prompt's pages, each later
reserve the tokens after those the daemon holds (``base``), and all of them again when
the daemon forgot the request. Packing a long Python list (slice, then convert) is the
largest part of a lookup's work on the engine's side, so a request's tokens are packed
once, from the list itself (``array.fromlist``: no slice copied first), and every span is
a copy out of that buffer.

Contract: the caller packs only tokens that never change at their positions. vLLM only
appends to a request's prompt, and rewrites its tokens only from its computed tokens on
(a streaming session drops its last sampled token): the connector packs the prompt and,
of the rest, computed tokens only.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import protos

_NATIVE = sys.byteorder == "little" and array(protos.TOKEN_TYPECODE).itemsize == 4


class PackedTokens:
    """The first ``len(self)`` tokens of one request, packed (``protos.pack_tokens``)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids = array(protos.TOKEN_TYPECODE)

    def __len__(self) -> int:
        return len(self._ids)

    def extend(self, tokens: Sequence[int], n: int) -> None:
        """Pack ``tokens[len(self):n]`` (nothing when ``n <= len(self)``); ``tokens[:len(self)]``
        must be the tokens packed so far. OverflowError for an id outside [0, 2**32),
        TypeError for a non-integer id; nothing is packed then."""
        have = len(self._ids)
        if n <= have:
            return
        new: Sequence[int] = tokens  # the whole list: no slice to copy first
        if not (have == 0 and type(tokens) is list and n == len(tokens)):
            new = tokens[have:n]
        more = array(protos.TOKEN_TYPECODE)
        more.fromlist(new if type(new) is list else list(new))  # the list fast path; all or nothing
        if have:
            self._ids.extend(more)
        else:
            self._ids = more

    def span(self, lo: int, hi: int) -> bytes:
        """The packed bytes of tokens ``[lo, hi)``, as ``protos.pack_tokens(tokens[lo:hi])``;
        ValueError when ``hi`` is past what is packed."""
        if hi > len(self._ids):
            raise ValueError(f"tokens up to {hi} asked, {len(self._ids)} packed")
        lo = min(max(lo, 0), hi)
        if not _NATIVE:  # pragma: no cover - big-endian hosts
            return protos.pack_tokens(self._ids[lo:hi])
        return memoryview(self._ids)[lo:hi].tobytes()
