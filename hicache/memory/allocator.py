"""Page-index allocator: which pages of one pool (one tier, one component) are free.

The allocator hands out *indices* only; it never sees the bytes behind them. It is owned by
the scheduler (the only process that decides), one instance per tier and component.

Contract:

| call            | on success                               | on failure                           |
|-----------------|------------------------------------------|--------------------------------------|
| ``can_alloc(n)``| True, nothing changes                    | False, nothing changes               |
| ``alloc(n)``    | ``n`` distinct free indices, now used    | ``None``; nothing changes            |
| ``free(idx)``   | every index becomes free again           | ``AllocatorError``; nothing changes  |

``free`` refuses (before changing anything) indices out of ``[0, capacity)``, indices that
are already free, and an index listed twice in one call. ``free_count + used == capacity``
always holds.
"""

from __future__ import annotations

from collections.abc import Iterable


class AllocatorError(ValueError):
    """A free() that would corrupt the allocator (double free, out-of-range index)."""


class PageAllocator:
    """A LIFO free list of page indices ``0 .. capacity-1`` with double-free detection.

    Allocation and free are C-level list/set operations (no per-index Python loop), so the
    cost per call is small even for thousands of pages.
    """

    __slots__ = ("_capacity", "_free", "_free_set", "name")

    def __init__(self, capacity: int, name: str = "pages") -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        self.name = name
        self._capacity = capacity
        # A stack: the next allocation takes from the end, so fresh pools hand out 0, 1, 2, ...
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._free_set: set[int] = set(self._free)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self._capacity - len(self._free)

    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed now. No side effect."""
        return 0 <= n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` distinct free indices, or ``None`` (and no change) when fewer are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        out = free[-n:]
        del free[-n:]
        out.reverse()
        self._free_set.difference_update(out)
        return out

    def free(self, indices: Iterable[int]) -> None:
        """Return ``indices`` to the pool; raises ``AllocatorError`` and changes nothing if
        any index is out of range, already free, or listed twice."""
        idx = indices if isinstance(indices, list) else list(indices)
        if not idx:
            return
        as_set = set(idx)
        if len(as_set) != len(idx):
            raise AllocatorError(f"{self.name}: an index is listed twice in one free()")
        try:
            lo, hi = min(as_set), max(as_set)
        except TypeError as exc:
            raise AllocatorError(f"{self.name}: page indices must be integers") from exc
        if lo < 0 or hi >= self._capacity:
            bad = lo if lo < 0 else hi
            raise AllocatorError(f"{self.name}: index {bad} is outside [0, {self._capacity})")
        if not self._free_set.isdisjoint(as_set):
            bad = min(self._free_set & as_set)
            raise AllocatorError(f"{self.name}: double free of index {bad}")
        self._free_set |= as_set
        self._free.extend(idx)

    def is_free(self, index: int) -> bool:
        return index in self._free_set

    def check(self) -> None:
        """Raise ``AllocatorError`` if the free list and the free set disagree."""
        if len(self._free) != len(self._free_set):
            raise AllocatorError(f"{self.name}: free list holds duplicates")
        if self._free_set and (min(self._free_set) < 0 or max(self._free_set) >= self._capacity):
            raise AllocatorError(f"{self.name}: free list holds an out-of-range index")

    def reset(self) -> None:
        """Mark every page free (used when the whole cache is flushed)."""
        self._free = list(range(self._capacity - 1, -1, -1))
        self._free_set = set(self._free)

    def __repr__(self) -> str:
        return f"PageAllocator({self.name!r}, capacity={self._capacity}, free={len(self._free)})"
