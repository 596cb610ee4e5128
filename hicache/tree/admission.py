"""Tier admission filters: which data a lower tier takes (``write_through_filtered``).

A ``Doorkeeper`` remembers, in bounded memory, which keys (page hashes) it has been shown
and by whom, as TinyLFU's doorkeeper does: two generations of at most ``capacity`` keys
each; when the young one is full it becomes the old one and the old one is dropped, so a
key is remembered for between ``capacity`` and ``2 * capacity`` later insertions.

``seen_before(key, owner)`` records ``key`` for ``owner`` (a node id) and says whether the
key was already recorded for another owner: the same data came back in another node (it
was dropped and recomputed, or a split exposed it as a shared prefix). Asking again for the
same owner changes nothing, so a caller may ask on every pass.
"""

from __future__ import annotations

from collections.abc import Hashable


class Doorkeeper:
    """Two-generation key -> (owner, answer) map; at most ``2 * capacity`` keys held."""

    __slots__ = ("capacity", "_young", "_old", "rotations")

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError("doorkeeper capacity must be >= 1")
        self.capacity = capacity
        self._young: dict[Hashable, int] = {}
        self._old: dict[Hashable, int] = {}
        self.rotations = 0

    def seen_before(self, key: Hashable, owner: int) -> bool:
        """Record ``key`` for ``owner``; True if another owner recorded it before (and it is
        still remembered). The answer for one (key, owner) stays the same while remembered."""
        prev = self._young.get(key)
        if prev is None:
            prev = self._old.get(key)
        if prev is not None and prev >> 1 == owner:
            return bool(prev & 1)
        admitted = prev is not None
        self._put(key, owner << 1 | admitted)
        return admitted

    def _put(self, key: Hashable, owner: int) -> None:
        young = self._young
        if key not in young and len(young) >= self.capacity:
            self._old = young
            self._young = young = {}
            self.rotations += 1
        young[key] = owner

    def __len__(self) -> int:
        return len(self._young) + len(self._old)
