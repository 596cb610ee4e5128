"""Eviction order: intrusive doubly-linked lists and the pluggable policies built on them.

Every component keeps one ordering per tier over the nodes that hold its data there. The
ordering is an ``EvictionPolicy``: O(1) ``add`` / ``remove`` / ``touch``, ``touch_all`` of a
path (for LRU, a splice per run of it that is already in order) and iteration from the
coldest entry. The tree only asks for candidates in order; it decides itself whether a
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
* ``sieve`` -- SIEVE (Zhang et al., NSDI'24), a scan-resistant FIFO: one insertion-ordered
  list and a visited bit per entry; a touch only sets the bit (no move). A hand walks
  from the oldest entry towards the newest, wrapping around: a visited entry has its bit
  cleared and is passed over (it stays where it is), an unvisited one is offered. The hand
  stays where the last scan stopped. O(1) add / touch / remove, amortised O(1) per offer.
* ``arc`` -- ARC (Megiddo and Modha, FAST'03) over node counts: T1 holds entries not yet
  re-used, T2 those a match has hit (``hit_count >= 1``), each an LRU list; B1 / B2 remember
  (bounded, by a fingerprint of the node's position: its parent and first page) entries
  that left T1 / T2. An entry added whose fingerprint is in B1 raises the target size
  ``p`` of T1, one in B2 lowers it; either goes straight to T2. Candidates come from T1
  while ``|T1| > p`` and from T2 otherwise (then from the other list), re-decided after
  each offer. O(1) add / touch / remove.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
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

    def push_lru(self, link: LruLink) -> None:
        head = self._head
        nxt = head.next
        link.prev = head
        link.next = nxt
        nxt.prev = link  # type: ignore[union-attr]
        head.next = link
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

    def move_all_to_mru(self, links: list[LruLink]) -> None:
        """``move_to_mru`` of each of ``links`` (listed, distinct), in order, with each run of
        them that already follows one another in the list moved as one piece: a path the
        tree touched before, whose nodes nothing moved since, costs one splice plus a
        comparison per node."""
        tail = self._tail
        i, n = 0, len(links)
        while i < n:
            first = last = links[i]
            i += 1
            while i < n and last.next is links[i]:
                last = links[i]
                i += 1
            if tail.prev is last:  # the run ends the list already
                continue
            prev, nxt = first.prev, last.next
            prev.next = nxt  # type: ignore[union-attr]
            nxt.prev = prev  # type: ignore[union-attr]
            end = tail.prev
            end.next = first  # type: ignore[union-attr]
            first.prev = end
            last.next = tail
            tail.prev = last

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

    def touch_all(self, links: list[LruLink]) -> None:
        """``touch`` of each of ``links``, in order (a policy may do it in fewer steps)."""
        touch = self.touch
        for link in links:
            touch(link)

    def candidates(self) -> Iterator[TreeNode]:
        raise NotImplementedError

    def demote(self, link: LruLink) -> None:
        """Make a listed entry the next one offered (cold admission to a tier)."""
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
        self.touch_all = self._list.move_all_to_mru  # type: ignore[method-assign]

    def candidates(self) -> Iterator[TreeNode]:
        return self._list.iter_cold()

    def demote(self, link: LruLink) -> None:
        self._list.unlink(link)
        self._list.push_lru(link)

    def __len__(self) -> int:
        return self._list.size

    def links(self) -> Iterator[LruLink]:
        return self._list.links()

    def check(self) -> None:
        self._list.check()


class TwoSegmentPolicy(EvictionPolicy):
    """A policy over two ``LruList`` segments (``_first``, ``_second``); each link's
    ``segment`` names the one it is in (``FIRST``, ``SECOND``)."""

    FIRST, SECOND = 0, 1

    def __init__(self) -> None:
        self._first = LruList()
        self._second = LruList()

    def __len__(self) -> int:
        return self._first.size + self._second.size

    def links(self) -> Iterator[LruLink]:
        yield from self._first.links()
        yield from self._second.links()

    def check(self) -> None:
        for seg, lst in ((self.FIRST, self._first), (self.SECOND, self._second)):
            lst.check()
            for link in lst.links():
                if link.segment != seg:
                    raise AssertionError(f"{self.name}: an entry's segment disagrees with its list")


class SLRUPolicy(TwoSegmentPolicy):
    """Segmented LRU (probation + protected)."""

    name = "slru"
    PROBATION, PROTECTED = TwoSegmentPolicy.FIRST, TwoSegmentPolicy.SECOND

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError("protected_fraction must be in (0, 1)")
        self.protected_fraction = protected_fraction
        super().__init__()
        self._prob, self._prot = self._first, self._second

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

    def demote(self, link: LruLink) -> None:
        self.remove(link)
        link.segment = self.PROBATION
        self._prob.push_lru(link)



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

    def demote(self, link: LruLink) -> None:
        self._entry[link][2] = None
        low = self._heap[0][0] if self._heap else self.age  # the heap's top: no live entry below it
        e = [low - 1, next(self._seq), link]
        self._entry[link] = e
        heapq.heappush(self._heap, e)

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


class SIEVEPolicy(EvictionPolicy):
    """SIEVE: insertion-ordered list, visited bit (``link.segment``), a persistent hand.

    ``_list`` is the insertion order (a split's upper part takes its lower part's place,
    ``TreeCore._insert_before``). ``_hand`` is the next entry the scan examines (None: the
    oldest). ``candidates`` walks at most two laps from the last entry taken: after one,
    every bit it met is clear, so every entry present has been offered once the second
    lap ends (a parent that became a leaf behind the hand included).
    """

    name = "sieve"

    def __init__(self) -> None:
        self._list = LruList()
        self._hand: LruLink | None = None

    def add(self, link: LruLink) -> None:
        link.segment = 0
        self._list.push_mru(link)

    def remove(self, link: LruLink) -> None:
        if link is self._hand:
            nxt = link.next
            self._hand = None if nxt is None or nxt.owner is None else nxt
        self._list.unlink(link)

    def touch(self, link: LruLink) -> None:
        link.segment = 1

    def demote(self, link: LruLink) -> None:
        """Unvisited, and moved to just before the hand (the oldest end without one)."""
        self.remove(link)
        link.segment = 0
        hand = self._hand
        if hand is None:
            self._list.push_lru(link)
            self._hand = link
            return
        prev = hand.prev
        link.prev, link.next = prev, hand
        prev.next = link  # type: ignore[union-attr]
        hand.prev = link
        self._list.size += 1
        self._hand = link

    def candidates(self) -> Iterator[TreeNode]:
        lst = self._list
        steps = 2 * lst.size
        while steps > 0 and lst.size:
            steps -= 1
            link = self._hand
            if link is None or link.prev is None:
                link = lst.coldest()
                if link is None:
                    return
            nxt = link.next
            self._hand = None if nxt is None or nxt.owner is None else nxt
            if link.segment:
                link.segment = 0
                continue
            yield link.owner  # type: ignore[misc]
            if link.prev is None:  # taken: its parent may be a leaf now, behind the hand
                steps = 2 * lst.size

    def __len__(self) -> int:
        return self._list.size

    def links(self) -> Iterator[LruLink]:
        return self._list.links()

    def check(self) -> None:
        self._list.check()
        if self._hand is not None and self._hand.prev is None:
            raise AssertionError("SIEVE: the hand points at an entry no longer listed")


def _fingerprint(link: LruLink) -> int:
    """Where ``link``'s node sits: its parent and its key's first tokens. A node evicted and
    later re-inserted below the same parent gets the same one (a collision only skews ARC's
    adaptation, never what is cached)."""
    node = link.owner
    parent = node.parent if node is not None else None
    key = node.key if node is not None else ()
    return hash((parent.id if parent is not None else 0, tuple(key[:8])))


class ARCPolicy(TwoSegmentPolicy):
    """ARC over node counts (T1 / T2 lists, B1 / B2 ghost fingerprints, adaptive ``p``).

    ``link.segment``: 0 in T1, 1 in T2. The ghosts hold at most ``max(len(self), 64)``
    fingerprints each (ARC's bound ``c``, with ``c`` the entries held now).
    """

    name = "arc"
    T1, T2 = TwoSegmentPolicy.FIRST, TwoSegmentPolicy.SECOND

    def __init__(self) -> None:
        super().__init__()
        self._t1, self._t2 = self._first, self._second
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0  # target size of T1, in entries
        self._removed = 0  # removals so far (``candidates`` passes again after one)

    def add(self, link: LruLink) -> None:
        fp = _fingerprint(link)
        b1, b2 = self._b1, self._b2
        if fp in b1:
            c = self._t1.size + self._t2.size + 1
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[fp]
        elif fp in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[fp]
        else:
            link.segment = self.T1
            self._t1.push_mru(link)
            return
        link.segment = self.T2
        self._t2.push_mru(link)

    def remove(self, link: LruLink) -> None:
        self._removed += 1
        if link.segment == self.T2:
            self._t2.unlink(link)
            ghosts = self._b2
        else:
            self._t1.unlink(link)
            ghosts = self._b1
        fp = _fingerprint(link)
        ghosts[fp] = None
        ghosts.move_to_end(fp)
        cap = max(self._t1.size + self._t2.size, 64)
        while len(ghosts) > cap:
            ghosts.popitem(last=False)

    def touch(self, link: LruLink) -> None:
        if link.segment == self.T2:
            self._t2.move_to_mru(link)
        elif link.owner.hit_count < 1:  # type: ignore[union-attr]
            self._t1.move_to_mru(link)
        else:
            self._t1.unlink(link)
            link.segment = self.T2
            self._t2.push_mru(link)

    def demote(self, link: LruLink) -> None:
        """To T1's cold end (no ghost: it did not leave)."""
        (self._t2 if link.segment == self.T2 else self._t1).unlink(link)
        link.segment = self.T1
        self._t1.push_lru(link)

    def candidates(self) -> Iterator[TreeNode]:
        """Passes over both lists, preferring T1 while ``|T1| > p``; another pass while the
        last one took something (a parent it passed may be a leaf now)."""
        while True:
            removed = self._removed
            it1, it2 = self._t1.iter_cold(), self._t2.iter_cold()
            done1 = done2 = False
            while not (done1 and done2):
                first = not done1 and (done2 or self._t1.size > self.p)
                try:
                    node = next(it1) if first else next(it2)
                except StopIteration:
                    if first:
                        done1 = True
                    else:
                        done2 = True
                    continue
                yield node
            if self._removed == removed:
                return

    def check(self) -> None:
        super().check()
        if self.p < 0.0:
            raise AssertionError(f"ARC: target p={self.p} below zero")


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy, "slru": SLRUPolicy, "lfu": LFUPolicy, "sieve": SIEVEPolicy, "arc": ARCPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
