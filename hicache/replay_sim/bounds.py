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
from collections.abc import Callable, Container, Sequence

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
    # largest next use first; ties to the deeper item
    return _hits_keeping_smallest(requests, capacity, nxt, lambda r, depth, nu: (-nu, -depth))


def returning_lru_hits(requests: Sequence[Sequence[int]], capacity: int,
                       nxt: list[list[int]] | None = None) -> int:
    """Hit items of LRU told which items return (module doc), ``capacity`` items.

    The order keeps prefixes whole: an item's parent is used whenever it is, so it returns
    if the item does and was used last no earlier. ``nxt`` and errors as ``belady_hits``.
    """
    # never used again first, then least recently used; ties to the deeper item
    return _hits_keeping_smallest(requests, capacity, nxt,
                                  lambda r, depth, nu: (0 if nu == NEVER else 1, r, -depth))


def _hits_keeping_smallest(requests: Sequence[Sequence[int]], capacity: int, nxt: list[list[int]] | None,
                           key: Callable[[int, int, int], tuple[int, ...]]) -> int:
    """Hit items of a cache that, after each request, keeps the ``capacity`` items with the
    smallest ``key(request, depth, next use)``, each item keyed at its last use (ties to
    the smaller item)."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    if nxt is None:
        nxt = next_uses(requests)
    cached: dict[int, tuple[int, ...]] = {}  # item -> its key as pushed
    heap: list[tuple[tuple[int, ...], int]] = []  # (key, item): smallest first
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for r, ids in enumerate(requests):
        hits += _cached_prefix(ids, cached)
        for depth, (x, nu) in enumerate(zip(ids, nxt[r], strict=True)):
            k = key(r, depth, nu)
            cached[x] = k
            push(heap, (k, x))
        while len(cached) > capacity:
            k, x = pop(heap)
            if cached.get(x) == k:
                del cached[x]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries
            heap = [e for e in heap if cached.get(e[1]) == e[0]]
            heapq.heapify(heap)
    return hits


def _cached_prefix(ids: Sequence[int], cached: Container[int]) -> int:
    """How many of ``ids``, from the first, are in ``cached``."""
    h = 0
    for x in ids:
        if x not in cached:
            break
        h += 1
    return h


def infinite_hits(requests: Sequence[Sequence[int]]) -> int:
    """Hit items of an unbounded cache: every item after its first reference."""
    seen: set[int] = set()
    hits = 0
    for ids in requests:
        hits += _cached_prefix(ids, seen)
        seen.update(ids)
    return hits
