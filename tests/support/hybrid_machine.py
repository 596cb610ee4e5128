"""``HybridMachine``: randomised operation sequences on a hybrid cache with L2 on (FULL with the
components of ``kinds``; ``TagComponent`` is a fourth kind defined here only, so the tree must
work through the component hooks alone), checking after every step that the tree is intact,
locked data is never evicted and everything evictable can be evicted.

tests/tree/test_hybrid_random.py runs it in several shapes; tests/kv_events/test_tracker.py
extends it with the events a tracker must see.
"""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.memory.allocator import PageAllocator
from hicache.tree import (
    ComponentType,
    FullComponent,
    InsertParams,
    MambaComponent,
    PagedAuxComponent,
    PagedInsert,
    SWAComponent,
    TreeComponent,
    UnifiedRadixCache,
)
from hicache.tree.node import TreeNode

keys = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class TagComponent(PagedAuxComponent):
    """A toy kind: one index per page, needed on every node of a match (like FULL), locked
    along the whole path, evicted before FULL and after SWA on internal nodes."""

    ctype = None
    name = "tag"

    def priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 1

    def new_validator(self):
        i = self.slot
        state = [True]  # every node so far has data

        def step(node: TreeNode, from_host: bool) -> bool:
            cd = node.data[i]
            state[0] = state[0] and (cd.host_value if from_host else cd.value) is not None
            return state[0]

        return step

    def lock(self, core, node: TreeNode) -> None:
        while node.parent is not None:
            core.lock(node, self.slot)
            node = node.parent

    def unlock(self, core, node: TreeNode, token: Any = None) -> None:
        n = node
        while n.parent is not None:
            if n.data[self.slot].lock_ref <= 0:
                raise ValueError("tag lock below zero")
            n = n.parent
        while node.parent is not None:
            core.unlock(node, self.slot)
            node = node.parent


def naive_match(cache: UnifiedRadixCache, key: list[int]) -> tuple[int, int]:
    """``(device_len, host_hit_length)`` of a match of ``key``, derived page by page from
    the tree's data without its matching code: a flat map of every cached page prefix to
    what each component holds there, then the rules of docs/architecture.md §4 (a match
    ends at a node end; every component must accept it; the L2-only tail ends at the last
    node end every component accepts with the L2 data counted)."""
    ps = cache.page_size
    pages: dict[tuple[int, ...], tuple[TreeNode, bool]] = {}  # page prefix -> (node, ends the node)
    stack = [(r, ()) for r in cache.core.roots.values() if r.salt == ""]
    while stack:
        node, prefix = stack.pop()
        if node.parent is not None:
            full = prefix + tuple(node.key)
            for i in range(len(prefix) + ps, len(full) + 1, ps):
                pages[full[:i]] = (node, i == len(full))
            prefix = full
        stack.extend((c, prefix) for c in node.children.values())
    walk = []
    for i in range(ps, len(key) - len(key) % ps + 1, ps):
        if tuple(key[:i]) not in pages:
            break
        walk.append(pages[tuple(key[:i])])
    ndev = 0
    while ndev < len(walk) and walk[ndev][0].value is not None and not walk[ndev][0].loading:
        ndev += 1

    def valid(upto: int) -> bool:  # the boundary after ``upto`` pages, pages past ndev from L2
        for c in cache.aux:
            def has(j: int, c: TreeComponent = c) -> bool:
                cd = walk[j][0].data[c.slot]
                return (cd.host_value if j >= ndev else cd.value) is not None
            if isinstance(c, SWAComponent):
                run = 0
                while run < upto and has(upto - 1 - run):
                    run += 1
                if not (run * ps >= c.sliding_window or run == upto):
                    return False
            elif isinstance(c, MambaComponent):
                if not has(upto - 1):
                    return False
            elif not all(has(j) for j in range(upto)):  # the tag kind: every page
                return False
        return True

    ends = [j + 1 for j, (_n, end) in enumerate(walk) if end]
    dev_ok = [b for b in ends if b <= ndev and valid(b)]
    best = max(dev_ok, default=0)
    host = 0
    if best == ndev and ndev < len(walk):
        j = ndev
        while j < len(walk) and not walk[j][0].loading and walk[j][0].host_value is not None:
            j += 1
        host_ok = [b for b in ends if ndev < b <= j and valid(b)]
        host = (max(host_ok) - ndev) * ps if host_ok else 0
    return best * ps, host


class HybridMachine(RuleBasedStateMachine):
    kinds: tuple[str, ...] = ("swa",)
    page_size = 1
    write_policy = "write_through"

    @initialize()
    def setup(self):
        self.dev = PageAllocator(2000, "full")
        self.host = PageAllocator(2000, "full-l2")
        self.allocs: dict[str, tuple[PageAllocator, PageAllocator]] = {}
        comps: list[TreeComponent] = [FullComponent(self.dev, self.host)]
        for kind in self.kinds:
            # small L2 pools for the auxiliary kinds: their own L2 eviction runs too
            a, h = PageAllocator(2000, kind), PageAllocator(12, kind + "-l2")
            self.allocs[kind] = (a, h)
            if kind == "swa":
                comps.append(SWAComponent(a, sliding_window=3, host_allocator=h))
            elif kind == "mamba":
                comps.append(MambaComponent(a, host_allocator=h))
            else:
                comps.append(TagComponent(a, host_allocator=h))
        self.cache = UnifiedRadixCache(comps, self.page_size, write_policy=self.write_policy)
        self.locks = []
        self.writes = []
        self.loads = []

    def other_ops_in_flight(self) -> bool:
        """Ops a subclass's rules keep in flight (an L3 backup holds its nodes in L2 and
        keeps an L1-only parent of them from being dropped)."""
        return False

    def _free_copies(self, m) -> None:
        for name, v in m.copies.items():
            self.allocs[name][0].free([v])

    @rule(key=keys, computed=st.integers(0, 12), swa_start=st.integers(0, 6))
    def insert(self, key, computed, swa_start):
        ps = self.page_size
        key = array("I", key)
        m = self.cache.match_prefix(key)
        self._free_copies(m)
        npages = len(key) // ps
        have = len(m.device_indices)
        pages = m.device_indices + self.dev.alloc(npages - have)
        aux: dict[str, Any] = {}
        for kind, (a, _h) in self.allocs.items():
            # pages below the match are the tree's own and are never read: placeholders
            if kind == "mamba":
                if npages:
                    aux[kind] = a.alloc(1)[0]
                continue
            start = min(swa_start, npages) if kind == "swa" else 0
            own_from = max(start, have)
            aux[kind] = PagedInsert([0] * (own_from - start) + a.alloc(npages - own_from), start, m.device_len)
        r = self.cache.insert_with(InsertParams(key, pages, prev_prefix_len=m.device_len, aux=aux))
        self.dev.free(pages[have:r.prefix_len // ps])

    @rule(key=keys)
    def match(self, key):
        m = self.cache.match_prefix(array("I", key))
        self._free_copies(m)
        # the match splits at most at the fork and changes no data: the tree as it is now
        # is what it matched against
        want = naive_match(self.cache, key)
        assert (m.device_len, m.host_hit_length) == want, (m.device_len, m.host_hit_length, want)

    @rule(key=keys)
    def lock(self, key):
        m = self.cache.match_prefix(array("I", key), copy_on_match=False)
        node = m.last_device_node
        self.locks.append((self.cache.inc_lock_ref(node), node, list(m.device_indices)))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 50))
    def unlock(self, i):
        token, _node, _pages = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(token)

    @rule(full=st.integers(0, 8), aux=st.integers(0, 8), which=st.integers(0, 3))
    def evict(self, full, aux, which):
        kinds = list(self.allocs)
        self.cache.evict_units({"full": full, kinds[which % len(kinds)]: aux})

    @rule(which=st.integers(0, 3))
    def evict_everything(self, which):
        """Asking one component for more than it holds frees all its evictable data (under
        ``write_back``, all but what waits for its L2 write: ``write_and_evict_everything``)."""
        c = self.cache.components[which % len(self.cache.components)]
        self.cache.evict_units({c.name: self.cache.total_size(c.name) + 1})
        if self.write_policy != "write_back" and not self.other_ops_in_flight():
            assert self.cache.evictable_size(c.name) == 0, c.name

    @rule()
    def write_and_evict_everything(self):
        """With no lock and no op in flight, writing what the policy asks for and evicting
        everything, a few rounds, leaves nothing in L1 and nothing waiting for a write:
        no L1 data is ever stuck unwritten (nor is it dropped under ``write_back``)."""
        cache = self.cache
        if self.locks or self.writes or self.loads or self.other_ops_in_flight():
            return
        for _ in range(20):
            for c in cache.components:
                cache.evict_units({c.name: cache.total_size(c.name) + 1})
            cands = cache.tiers.nodes_to_write_to_host()
            if not cands:
                break
            for n in cands:
                op = cache.tiers.start_write(n)
                if op is not None:
                    cache.tiers.finish_write(op, True)
            cache.check_integrity(exact=True)
        assert cache.tiers.nodes_to_write_to_host() == []
        for c in cache.components:
            assert cache.total_size(c.name) == 0, c.name

    @rule(i=st.integers(0, 50), ok=st.booleans(), finish=st.booleans())
    def write(self, i, ok, finish):
        cands = self.cache.tiers.nodes_to_write_to_host()
        if cands:
            op = self.cache.tiers.start_write(cands[i % len(cands)])
            if op is not None:
                self.writes.append(op)
        if finish and self.writes:
            self.cache.tiers.finish_write(self.writes.pop(0), ok)

    @rule(tokens=st.integers(1, 8))
    def evict_host(self, tokens):
        self.cache.host.evict_host(tokens)

    @rule(key=keys, ok=st.booleans(), finish=st.booleans())
    def load_back(self, key, ok, finish):
        m = self.cache.match_prefix(array("I", key), copy_on_match=False)
        op = self.cache.tiers.start_load_back(m)
        if op is not None:
            self.loads.append(op)
        if finish and self.loads:
            self.cache.tiers.finish_load_back(self.loads.pop(0), ok)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity(exact=not (self.writes or self.loads))  # no page leaked
        for _token, node, pages in self.locks:
            walk = []
            n = node
            while n.parent is not None:
                walk.append(n.value)
                n = n.parent
            got = [p for v in reversed(walk) for p in v]
            assert got == pages  # locked FULL pages never move or go

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.tiers.open_transfers == len(self.writes) + len(self.loads)
        for op in self.writes:  # what a lost controller does: every op failed, once
            self.cache.tiers.finish_write(op, False)
        for op in self.loads:
            self.cache.tiers.finish_load_back(op, False)
        assert self.cache.tiers.open_transfers == 0
        for token, _node, _pages in self.locks:
            self.cache.dec_lock_ref(token)
        self.cache.flush()
        self.cache.check_integrity()
        assert self.dev.used == 0 and self.host.used == 0
        for a, h in self.allocs.values():
            assert a.used == 0 and h.used == 0
        assert self.cache.total_size(ComponentType.FULL) == 0
