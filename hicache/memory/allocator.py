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
always holds. ``checked=False`` drops that ownership tracking (a bare free list, for
benchmarks of the tree alone); production code keeps the default.

``array_indices=True`` makes ``alloc`` return ``array('q')`` instead of ``list[int]`` (and
``empty()`` an empty one); ``free`` accepts either. Every allocator of one cache must use the
same kind, since the cache concatenates what they hand out.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import TypeAlias

PageIndices: TypeAlias = "list[int] | array[int]"  # a string: array is not subscriptable before 3.12
"""A run of page indices: a ``list[int]``, or an ``array('q')`` from an allocator built with
``array_indices=True`` (C-level slices and concatenations: no per-index Python objects)."""


class AllocatorError(ValueError):
    """A free() that would corrupt the allocator (double free, out-of-range index)."""


class PageAllocator:
    """A LIFO stack of free page indices ``0 .. capacity-1`` with double-free detection.

    The stack is a fixed-size buffer with a top pointer (it never shrinks or grows, so no
    call reallocates it); allocation and free are C-level slice copies and set operations,
    with no per-index Python loop, even for thousands of pages.
    """

    __slots__ = ("_capacity", "_stack", "_top", "_used", "name", "checked", "array_indices")

    def __init__(self, capacity: int, name: str = "pages", *, checked: bool = True,
                 array_indices: bool = False) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        self.name = name
        self._capacity = capacity
        self.array_indices = array_indices
        self.checked = checked
        self._stack: PageIndices = self._fresh()
        self._top = capacity  # _stack[:_top] are the free indices; allocation takes the top
        self._used: set[int] = set()

    def _fresh(self) -> PageIndices:
        order = range(self._capacity - 1, -1, -1)  # the lowest indices go out first
        return array("q", order) if self.array_indices else list(order)

    def empty(self) -> PageIndices:
        """An empty run of indices of the kind ``alloc`` returns."""
        return array("q") if self.array_indices else []

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self._capacity - self._top

    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed now. No side effect."""
        return 0 <= n <= self._top

    def alloc(self, n: int) -> PageIndices | None:
        """``n`` distinct free indices, or ``None`` (and no change) when fewer are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        top = self._top
        if n > top:
            return None
        if n == 0:
            return self.empty()
        out = self._stack[top - n:top]
        self._top = top - n
        if self.checked:
            self._used.update(out)
        return out

    def free(self, indices: Iterable[int]) -> None:
        """Return ``indices`` to the pool; raises ``AllocatorError`` and changes nothing if
        any index is out of range, already free, or listed twice."""
        idx: Sequence[int] = indices if isinstance(indices, (list, array)) else list(indices)
        k = len(idx)
        if not k:
            return
        top = self._top
        if self.checked:
            used = self._used
            # Only allocated indices are in ``used``: one C-level pass rejects out-of-range
            # indices and double frees alike (the slow path below says which it was).
            if not used.issuperset(idx):
                self._raise_bad(idx)
            before = len(used)
            used.difference_update(idx)
            if before - len(used) != k:
                used.update(idx)  # undo: nothing changes on failure
                raise AllocatorError(f"{self.name}: an index is listed twice in one free()")
        elif top + k > self._capacity:
            raise AllocatorError(f"{self.name}: more pages freed than were allocated")
        if self.array_indices and not isinstance(idx, array):
            idx = array("q", idx)
        elif not self.array_indices and not isinstance(idx, list):
            idx = list(idx)
        self._stack[top:top + k] = idx  # type: ignore[call-overload]  # list or array, as _stack is
        self._top = top + k

    def _raise_bad(self, idx: Sequence[int]) -> None:
        for i in idx:
            if not isinstance(i, int) or isinstance(i, bool):
                raise AllocatorError(f"{self.name}: page indices must be integers, got {i!r}")
            if not 0 <= i < self._capacity:
                raise AllocatorError(f"{self.name}: index {i} is outside [0, {self._capacity})")
            if i not in self._used:
                raise AllocatorError(f"{self.name}: double free of index {i}")
        raise AllocatorError(f"{self.name}: invalid free()")  # pragma: no cover

    def is_free(self, index: int) -> bool:
        if not self.checked:
            raise RuntimeError(f"{self.name}: is_free needs a checked allocator")
        return 0 <= index < self._capacity and index not in self._used

    def check(self) -> None:
        """Raise ``AllocatorError`` if the free stack and the used set disagree."""
        free = self._stack[:self._top]
        if len(set(free)) != len(free):
            raise AllocatorError(f"{self.name}: the free stack holds duplicates")
        if not self.checked:
            return
        if len(free) + len(self._used) != self._capacity:
            raise AllocatorError(f"{self.name}: free + used != capacity")
        if not self._used.isdisjoint(free):
            raise AllocatorError(f"{self.name}: an index is both free and used")

    def reset(self) -> None:
        """Mark every page free (used when the whole cache is flushed)."""
        self._stack = self._fresh()
        self._top = self._capacity
        self._used = set()

    def __repr__(self) -> str:
        return f"PageAllocator({self.name!r}, capacity={self._capacity}, free={self._top})"
