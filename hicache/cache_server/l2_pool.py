"""The shared L2 pool as the cache server's tree holds it: the full parts of the engines'
pages, and a model's window parts (SWA) and states (Mamba) beside them
(docs/architecture.md §13).

Owns the model's shape in the tree (``window``, ``state``: checked against the engines'
geometry once, at construction), the auxiliary L2 allocators, taking auxiliary units for a
save (``alloc_aux``, evicting unlocked ones for room) and giving back what an open lease
holds (``end``: the last column of ``hicache.cache_server.leases``' table, and a lease's
window parts and state alike).
"""

from __future__ import annotations

from typing import Any

import protos
from hicache.cache_server.counters import EngineCounters
from hicache.cache_server.leases import Lease, LeaseKind, LeaseTable
from hicache.tree.cache import UnifiedRadixCache

WINDOW = "swa"
"""The tree component that holds the pages' window parts."""

STATE = "mamba"
"""The tree component that holds the states after pages (models with state layers)."""


class L2Pool:
    """The tree's L2 (``cache``, with L2 only) as the engines' pages of ``geometry`` use it."""

    def __init__(self, cache: UnifiedRadixCache, geometry: protos.EngineKVGeometry, pool: protos.L2PoolInfo,
                 counters: EngineCounters) -> None:
        self.cache = cache
        self.pool = pool
        self.counters = counters
        swa = next((c for c in cache.aux if c.name == WINDOW), None)
        self.window: int = getattr(swa, "sliding_window", 0)
        """Tokens of the window before a hit whose window parts it needs (0: no window layers)."""
        self.window_pages_per_hit = -(-self.window // cache.page_size)
        """Pages whose window parts a hit reads (the window, page-aligned)."""
        if bool(self.window) != bool(geometry.window_layers) or (swa is not None and swa.host_allocator is None):
            raise ValueError("a model with window layers needs a tree with an L2 SWA component, and only it")
        mamba = next((c for c in cache.aux if c.name == STATE), None)
        self.state = mamba is not None
        """The model has state layers: a hit ends only where the tree holds the state after it."""
        if self.state != bool(geometry.state_layers) or (mamba is not None and mamba.host_allocator is None):
            raise ValueError("a model with state layers needs a tree with an L2 Mamba component, and only it")

    @property
    def host(self) -> Any:
        """The L2 allocator of full pages."""
        return self.cache.full.host_allocator

    @property
    def window_alloc(self) -> Any:
        """The L2 allocator of window parts (only with window layers: the constructor checked it)."""
        return self.cache.component(WINDOW).host_allocator

    @property
    def state_alloc(self) -> Any:
        """The L2 allocator of states (only with state layers: the constructor checked it)."""
        return self.cache.component(STATE).host_allocator

    @property
    def window_free(self) -> int:
        """Free window parts in L2 (0 without window layers)."""
        return self.window_alloc.free_count if self.window else 0

    def alloc_aux(self, name: str, want: int) -> list[int]:
        """``want`` L2 units of auxiliary component ``name`` (window parts, states), evicting
        unlocked ones if needed; none when there is no room for all of them (those pages are
        then kept without, and no hit ends where they were wanted until a later save brings
        them)."""
        if not want:
            return []
        alloc = self.cache.component(name).host_allocator
        assert alloc is not None  # the constructor checked that the component has L2
        if alloc.free_count < want:
            self.cache.host.evict_host_units(name, want - alloc.free_count)
        got = alloc.alloc(want) if alloc.free_count >= want else None
        return list(got) if got is not None else []

    def end(self, lease: Lease) -> None:
        """Undo what an open lease holds (release its lock or free its reserved pages)."""
        if lease.kind is LeaseKind.LOOKUP:
            assert lease.node is not None
            self.cache.host.release_host(lease.node, lease.npages)
            if lease.window_npages:
                self.cache.host.release_host_window(lease.node, WINDOW, lease.window_npages)
            if lease.state_locked:
                self.cache.host.release_host_state(lease.node, STATE)
        else:
            self.host.free(lease.pages)
            if lease.window_pages:
                self.window_alloc.free(lease.window_pages)
            if lease.state_slots:
                self.state_alloc.free(lease.state_slots)

    def end_orphan(self, orphan: Lease) -> None:
        """An expired session's lease whose every rank reported late: the engine is done
        with its pages, which are unlocked or freed now (a late commit's pages are never
        inserted)."""
        self.end(orphan)
        self.counters.orphans_ended_late += 1

    def stats(self, leases: LeaseTable) -> dict[str, Any]:
        """``stats()["l2"]``: each pool's use, with what ``leases``' open reservations hold."""
        ps = self.cache.page_size
        host = self.host
        reserved = sum(len(x.pages) for x in leases.leases.values() if x.kind is LeaseKind.RESERVE)
        return {"full": {"used_tokens": host.used * ps, "capacity_tokens": host.capacity * ps,
                         "reserved_tokens": reserved * ps, "locked_tokens": self.cache.host_protected_size(),
                         "page_bytes": self.pool.page_bytes},
                **self._window_stats(leases), **self._state_stats(leases)}

    def _window_stats(self, leases: LeaseTable) -> dict[str, Any]:
        """``stats()["l2"]["swa"]``: the window parts' pool (models with window layers)."""
        if not self.window:
            return {}
        ps = self.cache.page_size
        alloc = self.window_alloc
        reserved = sum(len(x.window_pages) for x in leases.leases.values() if x.kind is LeaseKind.RESERVE)
        return {WINDOW: {"used_tokens": alloc.used * ps, "capacity_tokens": alloc.capacity * ps,
                         "reserved_tokens": reserved * ps, "window_tokens": self.window,
                         "page_bytes": self.pool.window_page_bytes}}

    def _state_stats(self, leases: LeaseTable) -> dict[str, Any]:
        """``stats()["l2"]["mamba"]``: the states' pool (models with state layers)."""
        if not self.state:
            return {}
        alloc = self.state_alloc
        reserved = sum(len(x.state_slots) for x in leases.leases.values() if x.kind is LeaseKind.RESERVE)
        return {STATE: {"used_slots": alloc.used, "capacity_slots": alloc.capacity, "reserved_slots": reserved,
                        "slot_bytes": self.pool.state_bytes}}
