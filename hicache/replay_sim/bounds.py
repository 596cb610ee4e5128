"""Offline bounds of a single-tier prefix cache: Belady's optimum, the infinite ceiling, and
LRU told which items return.

The metric is the block-level prefix hit rate of the traces' README: a request's hits are
the longest cached prefix of its items (blocks, or pages of blocks), and after a request
every one of its items is offered to the cache.

``belady_hits`` is MIN with bypass: after each request the cache keeps, among what it held
and the request's items, the ``capacity`` whose next use is soonest; an item never used
again goes first; ties go to the deeper item (so a kept item's parent is always kept: a
parent's next use is never later than its child's). No online policy can beat it on this
metric, which makes it the reference every policy is shown against.

``returning_lru_hits`` is LRU told, for each item, whether it is ever used again (not
when): items with no next use go first, the others in LRU order (ties to the deeper item).
It is not a bound, only a yardstick of how much of Belady's edge is knowing what returns
at all: an online policy can only approach it as far as it predicts that.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

NEVER = 1 << 62


def next_uses(requests: Sequence[Sequence[int]]) -> list[list[int]]:
    """``out[r][i]``: index of the next request after ``r`` holding ``requests[r][i]``
    (``NEVER`` if none). One backward pass, O(total items)."""
    out: list[list[int]] = [[]] * len(requests)
    last: dict[int, int] = {}
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r]
        get = last.get
        out[r] = [get(x, NEVER) for x in ids]
        for x in ids:
            last[x] = r
    return out


def belady_hits(requests: Sequence[Sequence[int]], capacity: int,
                nxt: list[list[int]] | None = None) -> int:
    """Hit items of Belady MIN with bypass for a cache of ``capacity`` items.

    ``nxt``: ``next_uses(requests)``, when the caller evaluates several capacities.
    Raises ``ValueError`` for a capacity below 1. O(total items x log capacity).
    """
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    if nxt is None:
        nxt = next_uses(requests)
    cached: dict[int, int] = {}  # item -> its next use as pushed (the heap entry's key)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, item): largest next use first
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for r, ids in enumerate(requests):
        h = 0
        for x in ids:
            if x not in cached:
                break
            h += 1
        hits += h
        for depth, (x, nu) in enumerate(zip(ids, nxt[r], strict=True)):
            cached[x] = nu
            push(heap, (-nu, -depth, x))
        while len(cached) > capacity:
            neg_nu, _d, x = pop(heap)
            if cached.get(x) == -neg_nu:
                del cached[x]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries
            heap = [e for e in heap if cached.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return hits


def returning_lru_hits(requests: Sequence[Sequence[int]], capacity: int,
                       nxt: list[list[int]] | None = None) -> int:
    """Hit items of LRU told which items return (module doc), ``capacity`` items.

    The order keeps prefixes whole: an item's parent is used whenever it is, so it returns
    if the item does and was used last no earlier. ``nxt`` and errors as ``belady_hits``.
    """
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    if nxt is None:
        nxt = next_uses(requests)
    cached: dict[int, tuple[int, int, int]] = {}  # item -> its heap key as pushed
    heap: list[tuple[int, int, int, int]] = []  # (returns, last use, -depth, item): smallest first
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for r, ids in enumerate(requests):
        h = 0
        for x in ids:
            if x not in cached:
                break
            h += 1
        hits += h
        for depth, (x, nu) in enumerate(zip(ids, nxt[r], strict=True)):
            key = (0 if nu == NEVER else 1, r, -depth)
            cached[x] = key
            push(heap, (*key, x))
        while len(cached) > capacity:
            entry = pop(heap)
            if cached.get(entry[3]) == entry[:3]:
                del cached[entry[3]]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries
            heap = [e for e in heap if cached.get(e[3]) == e[:3]]
            heapq.heapify(heap)
    return hits


def infinite_hits(requests: Sequence[Sequence[int]]) -> int:
    """Hit items of an unbounded cache: every item after its first reference."""
    seen: set[int] = set()
    hits = 0
    for ids in requests:
        h = 0
        for x in ids:
            if x not in seen:
                break
            h += 1
        hits += h
        seen.update(ids)
    return hits
