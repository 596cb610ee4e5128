"""Eviction order: intrusive doubly-linked lists and the pluggable policies built on them.

Every component keeps one ordering per tier over the nodes that hold its data there. The
ordering is an ``EvictionPolicy``: O(1) ``add`` / ``remove`` / ``touch`` and iteration from
the coldest entry. The tree only asks for candidates in order; it decides itself whether a
candidate can go (a leaf, unlocked, no transfer in flight).

Policies:

* ``lru`` (default) -- one list; a touch moves the node to the MRU end.
* ``slru`` -- segmented LRU: new entries start in a probation segment; a touch of a node
  that a match has hit before (``hit_count >= 1``: it was re-used) promotes it to the
  protected segment (capped at ``protected_fraction`` of the entries; the overflow is
  demoted to the MRU end of probation). Candidates come from probation first.
* ``lfu`` -- LFU with dynamic aging (GreedyDual-Size-Frequency with cost = size): a node's
  priority is ``L + 1 + hit_count``, set when it is added or touched, where ``L`` is the
  highest priority removed so far (so old frequency fades); lowest priority first, ties
  in touch order. A binary heap with lazy deletion: O(log n) add / touch / remove.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from hicache.tree.node import LruLink, TreeNode


class LruList:
    """A sentinel-based intrusive list of ``LruLink``; head side = coldest."""

    __slots__ = ("_head", "_tail", "size")

    def __init__(self) -> None:
        self._head = LruLink(None)
        self._tail = LruLink(None)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0

    def push_mru(self, link: LruLink) -> None:
        tail = self._tail
        prev = tail.prev
        link.prev = prev
        link.next = tail
        prev.next = link  # type: ignore[union-attr]
        tail.prev = link
        self.size += 1

    def unlink(self, link: LruLink) -> None:
        prev, nxt = link.prev, link.next
        prev.next = nxt  # type: ignore[union-attr]
        nxt.prev = prev  # type: ignore[union-attr]
        link.prev = link.next = None
        self.size -= 1

    def move_to_mru(self, link: LruLink) -> None:
        tail = self._tail
        if tail.prev is link:
            return
        prev, nxt = link.prev, link.next
        prev.next = nxt  # type: ignore[union-attr]
        nxt.prev = prev  # type: ignore[union-attr]
        last = tail.prev
        link.prev = last
        link.next = tail
        last.next = link  # type: ignore[union-attr]
        tail.prev = link

    def coldest(self) -> LruLink | None:
        first = self._head.next
        return None if first is self._tail else first

    def iter_cold(self) -> Iterator[TreeNode]:
        """Owners from coldest to hottest. Survives removal of the yielded entry; if the
        entry after it is removed meanwhile, it restarts from the coldest end."""
        link = self._head.next
        tail = self._tail
        while link is not tail and link is not None:
            nxt = link.next
            yield link.owner  # type: ignore[misc]
            if nxt is not tail and nxt.prev is None:  # type: ignore[union-attr]
                nxt = self._head.next
            link = nxt

    def links(self) -> Iterator[LruLink]:
        link = self._head.next
        while link is not self._tail:
            yield link  # type: ignore[misc]
            link = link.next  # type: ignore[union-attr]

    def check(self) -> None:
        n = 0
        link = self._head
        while link.next is not None:
            if link.next.prev is not link:
                raise AssertionError("LRU list: broken back link")
            link = link.next
            n += 1
        if link is not self._tail or n - 1 != self.size:
            raise AssertionError(f"LRU list: size {self.size} but {n - 1} entries")


class EvictionPolicy:
    """The order in which one component's nodes in one tier are offered for eviction."""

    name = "base"

    def add(self, link: LruLink) -> None:
        raise NotImplementedError

    def remove(self, link: LruLink) -> None:
        raise NotImplementedError

    def touch(self, link: LruLink) -> None:
        raise NotImplementedError

    def candidates(self) -> Iterator[TreeNode]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def links(self) -> Iterator[LruLink]:
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._list = LruList()
        # bound methods of the list: no extra Python frame on the hot path
        self.add = self._list.push_mru  # type: ignore[method-assign]
        self.remove = self._list.unlink  # type: ignore[method-assign]
        self.touch = self._list.move_to_mru  # type: ignore[method-assign]

    def candidates(self) -> Iterator[TreeNode]:
        return self._list.iter_cold()

    def __len__(self) -> int:
        return self._list.size

    def links(self) -> Iterator[LruLink]:
        return self._list.links()

    def check(self) -> None:
        self._list.check()


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU (probation + protected)."""

    name = "slru"
    PROBATION, PROTECTED = 0, 1

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError("protected_fraction must be in (0, 1)")
        self.protected_fraction = protected_fraction
        self._prob = LruList()
        self._prot = LruList()

    def add(self, link: LruLink) -> None:
        link.segment = self.PROBATION
        self._prob.push_mru(link)

    def remove(self, link: LruLink) -> None:
        (self._prot if link.segment == self.PROTECTED else self._prob).unlink(link)

    def touch(self, link: LruLink) -> None:
        if link.segment == self.PROTECTED:
            self._prot.move_to_mru(link)
            return
        if link.owner.hit_count < 1:  # type: ignore[union-attr]
            self._prob.move_to_mru(link)
            return
        self._prob.unlink(link)
        link.segment = self.PROTECTED
        self._prot.push_mru(link)
        limit = max(1, int(self.protected_fraction * (self._prob.size + self._prot.size)))
        while self._prot.size > limit:
            cold = self._prot.coldest()
            self._prot.unlink(cold)  # type: ignore[arg-type]
            cold.segment = self.PROBATION  # type: ignore[union-attr]
            self._prob.push_mru(cold)  # type: ignore[arg-type]

    def candidates(self) -> Iterator[TreeNode]:
        yield from self._prob.iter_cold()
        yield from self._prot.iter_cold()

    def __len__(self) -> int:
        return self._prob.size + self._prot.size

    def links(self) -> Iterator[LruLink]:
        yield from self._prob.links()
        yield from self._prot.links()

    def check(self) -> None:
        self._prob.check()
        self._prot.check()
        for link in self._prob.links():
            if link.segment != self.PROBATION:
                raise AssertionError("SLRU: probation entry marked protected")
        for link in self._prot.links():
            if link.segment != self.PROTECTED:
                raise AssertionError("SLRU: protected entry marked probation")


class LFUPolicy(EvictionPolicy):
    """LFU with dynamic aging over a lazy-deletion heap.

    Entries are ``[priority, seq, link]``; touching or removing a link voids its entry
    (``link`` slot set to None) and touching pushes a fresh one. ``candidates`` pops entries
    in order and pushes back, when the iteration ends or is abandoned, every entry whose
    link is still present (a candidate the tree skipped: internal, locked, in flight).
    """

    name = "lfu"

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._entry: dict[LruLink, list[Any]] = {}
        self._seq = itertools.count()
        self.age = 0  # L: the highest priority removed so far

    def _push(self, link: LruLink) -> None:
        e = [self.age + 1 + link.owner.hit_count, next(self._seq), link]  # type: ignore[union-attr]
        self._entry[link] = e
        heapq.heappush(self._heap, e)
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = [x for x in self._heap if x[2] is not None]
            heapq.heapify(self._heap)

    def add(self, link: LruLink) -> None:
        if link in self._entry:
            raise ValueError("LFU: link added twice")
        self._push(link)

    def touch(self, link: LruLink) -> None:
        old = self._entry.get(link)
        if old is None:
            raise ValueError("LFU: touch of a link that was never added")
        old[2] = None
        self._push(link)

    def remove(self, link: LruLink) -> None:
        e = self._entry.pop(link)
        e[2] = None
        if e[0] > self.age:
            self.age = e[0]

    def candidates(self) -> Iterator[TreeNode]:
        heap = self._heap
        taken: list[list[Any]] = []
        try:
            while heap:
                e = heapq.heappop(heap)
                if e[2] is None:
                    continue
                taken.append(e)
                yield e[2].owner
        finally:
            for e in taken:
                if e[2] is not None:
                    heapq.heappush(heap, e)

    def __len__(self) -> int:
        return len(self._entry)

    def links(self) -> Iterator[LruLink]:
        return iter(list(self._entry))

    def check(self) -> None:
        live = [e for e in self._heap if e[2] is not None]
        if len(live) != len(self._entry) or any(self._entry.get(e[2]) is not e for e in live):
            raise AssertionError("LFU: heap entries and the link table disagree")


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "slru": SLRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
