"""The tokens the cache server holds of each running engine request (the ``base`` of a
``Lookup`` or ``SaveRange``).

A request's tokens are set by its ``Lookup``, replaced by each ``Reserve`` with the longer
prefix, and dropped by ``Finished`` or with their session. ``max_tokens`` bounds them all:
past it the least recently set requests are forgotten first, and their next ``Reserve``
with a ``base`` is answered ``unknown_request`` (the engine then sends all its tokens).
Keys are never changed in place: other holders (a lease, a prefetch) may share them.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Container

Slot = tuple[int, str]
"""(session, request id)."""


class RequestTokens:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._keys: OrderedDict[Slot, array[int]] = OrderedDict()
        self.total = 0  # tokens held, over all requests

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, slot: Slot) -> array[int] | None:
        return self._keys.get(slot)

    def set(self, slot: Slot, key: array[int]) -> None:
        """Hold ``key`` as the tokens of ``slot`` (the most recent)."""
        self.forget(slot)
        self._keys[slot] = key
        self.total += len(key)
        self._trim()

    def grow(self, slot: Slot, more: array[int]) -> array[int]:
        """Append ``more`` to the tokens held for ``slot`` (which must hold some) in place and
        return them (the most recent). In place: whoever shares the array (a lease) keeps its
        own length, and the tokens before it never change."""
        key = self._keys[slot]
        self._keys.move_to_end(slot)
        key.extend(more)
        self.total += len(more)
        self._trim()
        return key

    def _trim(self) -> None:
        while self.total > self.max_tokens and len(self._keys) > 1:
            _, dropped = self._keys.popitem(last=False)
            self.total -= len(dropped)

    def forget(self, slot: Slot) -> None:
        old = self._keys.pop(slot, None)
        if old is not None:
            self.total -= len(old)

    def keep_sessions(self, live: Container[int]) -> None:
        """Forget the requests of every session not in ``live``."""
        for slot in [s for s in self._keys if s[0] not in live]:
            self.forget(slot)
