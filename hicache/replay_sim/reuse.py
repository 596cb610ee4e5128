"""LRU hit rate at every capacity at once, from one pass of reuse (stack) distances.

Mattson's observation: LRU is a stack algorithm, so a cache of ``C`` pages holds exactly the
``C`` most recently used pages, and a reference hits at capacity ``C`` exactly when its
*reuse distance* (the number of distinct pages used since its page's last use, itself
included) is at most ``C``. One pass that computes every distance gives the hit count for
every capacity: ``hits(C) = #{distances <= C}``.

A prefix cache asks for more: a request's hits are the longest cached *prefix* of its pages.
It comes out the same here because of the order in which a request touches its pages, the
order a radix tree's LRU sees (leaves before parents, as in the traces' reference LRU):

- every request that uses page ``i`` of a path also uses page ``i - 1`` (chained ids), and
  touches it after page ``i``;
- so page ``i - 1`` is always more recent than page ``i``, its distance is smaller, and the
  pages within capacity form a prefix of the request.

The distance of the reference at position ``t`` of request ``r`` (which starts at position
``T``), whose page was last used at position ``s``, is the number of pages whose last use
before ``T`` is at or after ``s``::

    distance = distinct(T) - #{j < s : next[j] >= T}

``distinct(T)`` counts first uses before ``T``; the second term is a 2-D dominance count,
answered for all references at once with a merge-sort tree in numpy (one sorted level per
bit of the position, each level searched in one vectorised call): O(N log N) time, O(N)
memory per level, N = page references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReuseProfile:
    """The reuse distances of one trace. ``distances``: sorted, one per reference to a page
    used before (first uses never hit and are not in it); ``total``: every page reference."""

    distances: np.ndarray
    total: int
    unique: int

    def hits(self, capacity_pages: int | None) -> int:
        """Page hits of an LRU cache of ``capacity_pages`` (None: unbounded)."""
        if capacity_pages is None:
            return int(self.distances.size)
        return int(np.searchsorted(self.distances, capacity_pages, side="right"))

    def hit_rate(self, capacity_pages: int | None) -> float:
        return self.hits(capacity_pages) / self.total if self.total else 0.0

    @property
    def ceiling(self) -> float:
        """The hit rate of an unbounded cache."""
        return self.hit_rate(None)

    def smallest_reaching(self, rate: float) -> int:
        """The fewest pages whose hit rate is at least ``rate`` (1 for a rate of 0 or less;
        ``ValueError`` above the ceiling)."""
        need = int(np.ceil(rate * self.total - 1e-9))
        if need <= 0:
            return 1
        if need > self.distances.size:
            raise ValueError(f"no capacity reaches a hit rate of {rate:.4f} (ceiling {self.ceiling:.4f})")
        return max(1, int(self.distances[need - 1]))


def _touch_order(requests: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The pages in the order they are used (each request's pages deepest first) and, per
    position, the start position of its request."""
    lengths = np.fromiter((len(r) for r in requests), dtype=np.int64, count=len(requests))
    n = int(lengths.sum())
    seq = np.empty(n, dtype=np.int64)
    pos = 0
    for r in requests:
        k = len(r)
        if k:
            seq[pos:pos + k] = np.asarray(r, dtype=np.int64)[::-1]
            pos += k
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return seq, starts


def _neighbours(seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``prev[t]`` / ``next[t]``: the previous / next position of ``seq[t]``'s page (-1 /
    ``len(seq)`` when there is none)."""
    n = seq.size
    order = np.argsort(seq, kind="stable")
    same = seq[order[1:]] == seq[order[:-1]]
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, n, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    return prev, nxt


def _dominance_counts(nxt: np.ndarray, before: np.ndarray, at_least: np.ndarray) -> np.ndarray:
    """For every query ``q``: ``#{j < before[q] : nxt[j] >= at_least[q]}``.

    Level ``k`` of the merge-sort tree sorts ``nxt`` within blocks of ``2**k`` positions
    (keys ``block * M + value`` make the whole level one sorted array). The prefix
    ``[0, before)`` is the union of one block per set bit of ``before``.
    """
    n = nxt.size
    out = np.zeros(before.size, dtype=np.int64)
    if n == 0 or before.size == 0:
        return out
    m = n + 1  # every value of nxt is <= n
    positions = np.arange(n, dtype=np.int64)
    k = 0
    while (1 << k) <= n:
        has_bit = (before >> k) & 1 == 1
        if has_bit.any():
            block = (before[has_bit] >> k) - 1
            keys = np.sort((positions >> k) * m + nxt)
            block_end = np.minimum((block + 1) << k, n)
            out[has_bit] += block_end - np.searchsorted(keys, block * m + at_least[has_bit], side="left")
        k += 1
    return out


def reuse_profile(requests: Sequence[Sequence[int]]) -> ReuseProfile:
    """The reuse distances of ``requests`` (each a request's page ids, root first, with the
    prefix property of chained ids). O(N log N), N = total page references."""
    seq, starts = _touch_order(requests)
    n = seq.size
    if n == 0:
        return ReuseProfile(np.zeros(0, dtype=np.int64), 0, 0)
    prev, nxt = _neighbours(seq)
    first = prev < 0
    distinct_before = np.concatenate(([0], np.cumsum(first)))  # [T]: first uses before T
    reused = np.flatnonzero(~first)
    s, start = prev[reused], starts[reused]
    distances = distinct_before[start] - _dominance_counts(nxt, s, start)
    distances.sort()
    return ReuseProfile(distances, int(n), int(first.sum()))
