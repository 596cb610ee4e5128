"""Randomised operation sequences on hybrid caches (FULL+SWA, FULL+MAMBA) with L2 on.

No reference model here (the differential test covers FULL); these check that every
sequence of match / insert / lock / unlock / evict (per component) / write / L2 evict /
load back keeps ``check_integrity()`` true, that locked data is never evicted, and that
every allocator returns to empty once the cache is unlocked and flushed.
"""

from __future__ import annotations

from array import array

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.memory.allocator import PageAllocator
from hicache.tree import (
    ComponentType,
    FullComponent,
    InsertParams,
    MambaComponent,
    PagedInsert,
    SWAComponent,
    UnifiedRadixCache,
)

keys = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class HybridMachine(RuleBasedStateMachine):
    kind = "swa"
    page_size = 1

    @initialize()
    def setup(self):
        self.dev = PageAllocator(2000, "full")
        self.host = PageAllocator(2000, "full-l2")
        self.aux = PageAllocator(2000, self.kind)
        self.aux_host = PageAllocator(2000, self.kind + "-l2")
        if self.kind == "swa":
            extra = SWAComponent(self.aux, sliding_window=3, host_allocator=self.aux_host)
        else:
            extra = MambaComponent(self.aux, host_allocator=self.aux_host)
        self.cache = UnifiedRadixCache([FullComponent(self.dev, self.host), extra], self.page_size)
        self.locks = []
        self.writes = []
        self.loads = []

    @rule(key=keys, computed=st.integers(0, 12), swa_start=st.integers(0, 6))
    def insert(self, key, computed, swa_start):
        ps = self.page_size
        key = array("I", key)
        m = self.cache.match_prefix(key)
        if "mamba" in m.copies:
            self.aux.free([m.copies["mamba"]])
        npages = len(key) // ps
        have = len(m.device_indices)
        pages = m.device_indices + self.dev.alloc(npages - have)
        kw = {}
        if self.kind == "swa":
            start = min(swa_start, npages)
            own_from = max(start, have)
            kw["swa"] = PagedInsert([0] * (own_from - start) + self.aux.alloc(npages - own_from), start,
                                    m.device_len)
            # pages below ``have`` are the tree's own and are never read
        elif npages:
            kw["mamba"] = self.aux.alloc(1)[0]
        r = self.cache.insert_with(InsertParams(key, pages, prev_prefix_len=m.device_len, aux=kw))
        self.dev.free(pages[have:r.prefix_len // ps])

    @rule(key=keys)
    def match(self, key):
        m = self.cache.match_prefix(array("I", key))
        if "mamba" in m.copies:
            self.aux.free([m.copies["mamba"]])

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

    @rule(full=st.integers(0, 8), aux=st.integers(0, 8))
    def evict(self, full, aux):
        if self.kind == "swa":
            self.cache.evict(full, swa_tokens=aux)
        else:
            self.cache.evict(full, mamba_states=aux)

    @rule(i=st.integers(0, 50), ok=st.booleans(), finish=st.booleans())
    def write(self, i, ok, finish):
        cands = self.cache.nodes_to_write_to_host()
        if cands:
            op = self.cache.start_write(cands[i % len(cands)])
            if op is not None:
                self.writes.append(op)
        if finish and self.writes:
            self.cache.finish_write(self.writes.pop(0), ok)

    @rule(tokens=st.integers(1, 8))
    def evict_host(self, tokens):
        self.cache.evict_host(tokens)

    @rule(key=keys, ok=st.booleans(), finish=st.booleans())
    def load_back(self, key, ok, finish):
        m = self.cache.match_prefix(array("I", key), copy_on_match=False)
        op = self.cache.start_load_back(m)
        if op is not None:
            self.loads.append(op)
        if finish and self.loads:
            self.cache.finish_load_back(self.loads.pop(0), ok)

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
        assert self.cache.open_transfers == len(self.writes) + len(self.loads)
        for op in self.writes:  # what a lost controller does: every op failed, once
            self.cache.finish_write(op, False)
        for op in self.loads:
            self.cache.finish_load_back(op, False)
        assert self.cache.open_transfers == 0
        for token, _node, _pages in self.locks:
            self.cache.dec_lock_ref(token)
        self.cache.flush()
        self.cache.check_integrity()
        assert self.dev.used == 0 and self.host.used == 0
        assert self.aux.used == 0 and self.aux_host.used == 0
        assert self.cache.total_size(ComponentType.FULL) == 0


class MambaMachine(HybridMachine):
    kind = "mamba"


class SWAMachinePage2(HybridMachine):
    page_size = 2


# fewer examples than the differential test: these only guard the hybrid code paths
_few = settings(max_examples=max(10, settings.default.max_examples // 3))
HybridMachine.TestCase.settings = _few
MambaMachine.TestCase.settings = _few
SWAMachinePage2.TestCase.settings = _few

TestHybridSWA = HybridMachine.TestCase
TestHybridMamba = MambaMachine.TestCase
TestHybridSWAPage2 = SWAMachinePage2.TestCase
