"""Differential, stateful property test of UnifiedRadixCache (FULL, with L2) against a
deliberately naive reference: a dict of cached page prefixes with explicit LRU order.

The reference knows nothing of nodes. Every cached page is keyed by the whole token prefix
it ends; it holds L1/L2 flags, a lock count and access "ticks". Eviction picks, page by
page, the unlocked page with no L1 child that was touched longest ago. After every step the
full set of cached pages (with their tiers) must agree, match results must agree, and
``check_integrity()`` must hold.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.memory.allocator import PageAllocator
from hicache.tree import FullComponent, UnifiedRadixCache

VOCAB = 3
MAX_TOKENS = 12


class Page:
    __slots__ = ("device", "host", "tick", "htick", "lock", "host_lock")

    def __init__(self) -> None:
        self.device = self.host = False
        self.tick = self.htick = 0
        self.lock = self.host_lock = 0


class Reference:
    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.pages: dict[tuple[int, ...], Page] = {}
        self.clock = itertools.count(1)

    def prefixes(self, key: list[int]) -> list[tuple[int, ...]]:
        n = len(key) - len(key) % self.ps
        return [tuple(key[:i]) for i in range(self.ps, n + 1, self.ps)]

    def touch(self, prefixes) -> None:
        for p in prefixes:
            t = next(self.clock)
            pg = self.pages[p]
            pg.tick = t
            pg.htick = t

    def match(self, key: list[int], record: bool = False) -> tuple[int, int, list[tuple[int, ...]]]:
        """A peek; with ``record``, the request's hit is counted: every matched page touched."""
        path = []
        for p in self.prefixes(key):
            if p not in self.pages:
                break
            path.append(p)
        ndev = 0
        while ndev < len(path) and self.pages[path[ndev]].device:
            ndev += 1
        nhost = len(path) - ndev
        if record:
            self.touch(path)
        return ndev * self.ps, nhost * self.ps, path[:ndev]

    def insert(self, key: list[int]) -> int:
        prefix = 0
        device_run = True
        ps = self.prefixes(key)
        for p in ps:
            pg = self.pages.get(p)
            if pg is None:
                pg = self.pages[p] = Page()
                pg.device = True
                device_run = False
            elif not pg.device:
                pg.device = True
                device_run = False
            elif device_run:
                prefix += self.ps
        self.touch(ps)
        return prefix

    def children(self, p: tuple[int, ...]) -> list[Page]:
        n = len(p) + self.ps
        return [pg for q, pg in self.pages.items() if len(q) == n and q[:len(p)] == p]

    def descendants(self, p: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [q for q in self.pages if len(q) > len(p) and q[:len(p)] == p]

    def evict(self, k: int) -> None:
        """A page without an L2 copy goes with the (L2-only) pages below it, which must
        then all be unlocked."""
        for _ in range(k):
            cands = [(pg.tick, p) for p, pg in self.pages.items()
                     if pg.device and pg.lock == 0 and not any(c.device for c in self.children(p))
                     and (pg.host or all(self.pages[q].host_lock == 0 and self.pages[q].lock == 0
                                         for q in self.descendants(p)))]
            if not cands:
                raise AssertionError("reference: nothing left to evict")
            _, p = min(cands)
            pg = self.pages[p]
            pg.device = False
            if not pg.host:
                for q in self.descendants(p):
                    del self.pages[q]
                del self.pages[p]

    def evict_host(self, k: int) -> None:
        for _ in range(k):
            cands = [(pg.htick, p) for p, pg in self.pages.items()
                     if pg.host and not pg.device and pg.host_lock == 0 and pg.lock == 0
                     and not self.children(p)]
            if not cands:
                raise AssertionError("reference: nothing left to evict from L2")
            _, p = min(cands)
            del self.pages[p]

    def _l1_candidate(self, p: tuple[int, ...]) -> bool:
        pg = self.pages[p]
        return (pg.device and pg.lock == 0 and not any(c.device for c in self.children(p))
                and (pg.host or all(self.pages[q].host_lock == 0 and self.pages[q].lock == 0
                                    for q in self.descendants(p))))

    def adopt_evict(self, gone: set[tuple[int, ...]]) -> None:
        """Any-policy eviction: the tree chose ``gone`` (the pages that left L1). They must
        leave one at a time, each an L1 candidate when it goes (unlocked, no L1 page below
        it: whole prefixes only). Raises ``AssertionError`` otherwise."""
        left = set(gone)
        while left:
            p = next((q for q in sorted(left, key=len, reverse=True) if self._l1_candidate(q)), None)
            if p is None:
                raise AssertionError(f"evicted pages that were not candidates: {sorted(left)}")
            left.discard(p)
            pg = self.pages[p]
            pg.device = False
            if not pg.host:
                for q in self.descendants(p):
                    del self.pages[q]
                    left.discard(q)
                del self.pages[p]

    def adopt_evict_host(self, gone: set[tuple[int, ...]]) -> None:
        """Any-policy L2 eviction: each page in ``gone`` L2-only, unlocked and childless when it goes."""
        left = set(gone)
        while left:
            p = next((q for q in sorted(left, key=len, reverse=True)
                      if not self.pages[q].device and self.pages[q].host_lock == 0 and self.pages[q].lock == 0
                      and not self.children(q)), None)
            if p is None:
                raise AssertionError(f"L2-evicted pages that were not candidates: {sorted(left)}")
            left.discard(p)
            del self.pages[p]

    def snapshot(self) -> dict[tuple[int, ...], tuple[bool, bool]]:
        return {p: (pg.device, pg.host) for p, pg in self.pages.items()}


def tree_snapshot(cache: UnifiedRadixCache) -> dict[tuple[int, ...], tuple[bool, bool]]:
    ps = cache.page_size
    out = {}
    stack = [(r, ()) for r in cache.core.roots.values()]
    while stack:
        node, prefix = stack.pop()
        if node.parent is not None:
            full = prefix + tuple(node.key)
            for i in range(len(prefix) + ps, len(full) + 1, ps):
                out[full[:i]] = (node.value is not None, node.host_value is not None)
            prefix = full
        stack.extend((c, prefix) for c in node.children.values())
    return out


def node_prefixes(node, ps: int) -> list[tuple[int, ...]]:
    keys = []
    n = node
    while n.parent is not None:
        keys.append(n.key)
        n = n.parent
    full: list[int] = []
    for k in reversed(keys):
        full.extend(k)
    start = len(full) - len(node.key)
    return [tuple(full[:i]) for i in range(start + ps, len(full) + 1, ps)]


keys = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_TOKENS)


class CacheMachine(RuleBasedStateMachine):
    """``eviction_policy``: with ``lru`` the reference predicts every eviction; with any
    other policy it checks the tree's choice (``Reference.adopt_evict``) and adopts it."""

    page_size = 1
    array_indices = False
    eviction_policy = "lru"
    write_policy = "write_through"
    host_pages = 1000

    @property
    def predicts_order(self) -> bool:
        """Whether the reference's LRU predicts evictions (else it checks and adopts them)."""
        return self.eviction_policy == "lru" and self.write_policy == "write_through"

    @initialize()
    def setup(self) -> None:
        self.dev = PageAllocator(1000, "l1", array_indices=self.array_indices)
        self.host = PageAllocator(self.host_pages, "l2", array_indices=self.array_indices)
        self.cache = UnifiedRadixCache([FullComponent(self.dev, self.host)], self.page_size,
                                       eviction_policy=self.eviction_policy, write_policy=self.write_policy)
        self.ref = Reference(self.page_size)
        self.locks: list = []  # (token, prefixes)
        self.writes: list = []  # (op, prefixes)

    # ---------------------------------------------------------------- rules
    @rule(key=keys, record=st.booleans())
    def match(self, key, record):
        """A match is a peek (a waiting request, matched on every pass); ``record``: the
        request is admitted, its hit counted once (``record_hit``)."""
        m = self.cache.match_prefix(key)
        dev_len, host_len, _ = self.ref.match(key, record)
        assert (m.device_len, m.host_hit_length) == (dev_len, host_len)
        assert len(m.device_indices) == dev_len // self.page_size
        if record:
            self.cache.record_hit(m)

    @rule(key=keys)
    def insert(self, key):
        ps = self.page_size
        n = len(key) // ps
        pages = self.dev.alloc(n)
        r = self.cache.insert(key, pages)
        self.dev.free(pages[:r.prefix_len // ps])  # the caller's duplicates
        assert r.prefix_len == self.ref.insert(key)

    @rule(key=keys)
    def lock(self, key):
        """Admission: the match is counted as a hit and locked."""
        m = self.cache.match_prefix(key)
        _, _, dev_path = self.ref.match(key, record=True)
        self.cache.record_hit(m)
        token = self.cache.inc_lock_ref(m.last_device_node)
        for p in dev_path:
            self.ref.pages[p].lock += 1
        self.locks.append((token, dev_path))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        token, path = self.locks.pop(i % len(self.locks))
        for p in path:  # a locked page was never evicted
            assert self.ref.pages[p].device
        self.cache.dec_lock_ref(token)
        for p in path:
            self.ref.pages[p].lock -= 1

    @rule(tokens=st.integers(1, 16))
    def evict(self, tokens):
        ps = self.page_size
        before = tree_snapshot(self.cache)
        res = self.cache.evict(tokens)
        k = res.full_tokens // ps
        if self.predicts_order:
            self.ref.evict(k)
        else:
            gone = {p for p, (dev, _h) in before.items() if dev} - {p for p, (dev, _h) in tree_snapshot(self.cache).items() if dev}
            assert len(gone) == k
            self.ref.adopt_evict(gone)
        if k * ps < tokens:  # stopped short: nothing evictable must remain
            self.ref_nothing_evictable()

    def ref_nothing_evictable(self) -> None:
        try:
            self.ref.evict(1)
        except AssertionError:
            return
        raise AssertionError("the cache stopped evicting while the reference could go on")

    @rule(i=st.integers(0, 100))
    def start_write(self, i):
        cands = self.cache.tiers.nodes_to_write_to_host()
        if not cands:
            return
        node = cands[i % len(cands)]
        prefixes = node_prefixes(node, self.page_size)
        before = set(tree_snapshot(self.cache))
        op = self.cache.tiers.start_write(node)
        gone = before - set(tree_snapshot(self.cache))  # the L2 eviction that made room
        if gone:
            assert not self.predicts_order or self.host_pages < 1000
            self.ref.adopt_evict_host(gone)
        if op is None:  # only a small L2 may lack room (its pages all held in L1 or locked)
            assert self.host_pages < 1000
            return
        _, _, path = self._path_to(prefixes[-1])
        for p in path:
            self.ref.pages[p].lock += 1
        self.writes.append((op, prefixes, path))

    def _path_to(self, last: tuple[int, ...]):
        ps = self.page_size
        return None, None, [last[:i] for i in range(ps, len(last) + 1, ps)]

    @precondition(lambda self: self.writes)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_write(self, i, ok):
        op, prefixes, path = self.writes.pop(i % len(self.writes))
        self.cache.tiers.finish_write(op, ok)
        for p in path:
            self.ref.pages[p].lock -= 1
        if ok:
            for p in prefixes:
                pg = self.ref.pages[p]
                pg.host = True
                pg.htick = next(self.ref.clock)

    @rule(tokens=st.integers(1, 16))
    def evict_host(self, tokens):
        ps = self.page_size
        before = set(tree_snapshot(self.cache))
        k = self.cache.host.evict_host(tokens) // ps
        if self.predicts_order:
            self.ref.evict_host(k)
        else:
            gone = before - set(tree_snapshot(self.cache))
            assert len(gone) == k
            self.ref.adopt_evict_host(gone)

    @rule(key=keys, ok=st.booleans())
    def load_back(self, key, ok):
        m = self.cache.match_prefix(key)
        dev_len, host_len, dev_path = self.ref.match(key)
        op = self.cache.tiers.start_load_back(m)
        if op is None:
            return
        ps = self.page_size
        full = self.ref.prefixes(key)
        loaded = full[dev_len // ps:(dev_len + host_len) // ps]
        assert len(op.dst_pages) == len(loaded)
        for p in loaded:
            pg = self.ref.pages[p]
            pg.device = True
            pg.tick = next(self.ref.clock)
        self.cache.tiers.finish_load_back(op, ok)
        if not ok:
            for p in loaded:
                self.ref.pages[p].device = False

    # ---------------------------------------------------------------- invariants
    @invariant()
    def agrees_with_reference(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity(exact=not self.writes)  # no page leaked
        assert tree_snapshot(self.cache) == self.ref.snapshot()
        for _token, path in self.locks:
            for p in path:
                assert self.ref.pages[p].device


class CacheMachinePage2(CacheMachine):
    page_size = 2


class CacheMachinePage4(CacheMachine):
    page_size = 4


class CacheMachineArrayIndices(CacheMachine):
    page_size = 2
    array_indices = True


class SieveMachinePage2(CacheMachine):
    page_size = 2
    eviction_policy = "sieve"


class ArcMachine(CacheMachine):
    eviction_policy = "arc"


class FilteredWriteMachine(CacheMachine):
    """``write_through_filtered`` with an L2 small enough to fill: cold writes reorder L2."""

    page_size = 2
    write_policy = "write_through_filtered"
    host_pages = 6


TestCachePage1 = CacheMachine.TestCase
TestCacheArrayIndices = CacheMachineArrayIndices.TestCase
TestCachePage2 = CacheMachinePage2.TestCase
TestCachePage4 = CacheMachinePage4.TestCase
TestSievePage2 = SieveMachinePage2.TestCase
TestArcPage1 = ArcMachine.TestCase
TestFilteredWritePage2 = FilteredWriteMachine.TestCase
