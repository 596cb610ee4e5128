"""TierCalls: the tier-facing half of ``UnifiedRadixCache`` (docs/architecture.md §4 and §5).

What moves between tiers and how the tree's node state follows: which nodes to write to L2
(``nodes_to_write_to_host``), the transfers (``start_write`` / ``finish_write``,
``start_load_back`` / ``finish_load_back``, ``start_backup`` / ``finish_backup``) and the
``TierOp`` each returns, host locks (``protect_host`` / ``release_host``), prefetched pages
(``insert_host``, ``host_prefix_pages``), page hashes (``hasher_for``, ``node_hashes``,
``last_page_hash``), the count of ops in flight (``open_transfers``), and L2 eviction
(``evict_host``; the write path evicts L2 for room). Like the rest of the cache it never
touches KV bytes: the calls return *which* pages to copy, and the cache controller (another
process) copies them and acknowledges.

What it needs from the rest of the cache, its written interface: the state and shared
helpers of ``CacheBase`` (``hicache.tree.base``; ``TierCalls.tree``) and three calls of the
tree half (``TreeLocks``; ``TierCalls.locks``): a load-back locks its path with
``inc_lock_ref`` / ``dec_lock_ref`` while it evicts L1 for room with ``evict``.
``UnifiedRadixCache`` (``hicache.tree.cache``) is both and holds its ``TierCalls`` as
``tiers``; this module does not import ``hicache.tree.cache``.

Ownership of page indices in the tier calls (Full component; SWA behaves alike, Mamba with
one slot; the tree's own calls are in ``hicache.tree.cache``'s table):

| step                                   | freed                         | kept / taken by the tree      | locked meanwhile                |
|----------------------------------------|-------------------------------|-------------------------------|---------------------------------|
| ``evict_host`` (L2)                    | L2 pages of L2-only leaves    | -                             | host-locked nodes skipped       |
| ``start_write`` -> write ``TierOp``    | L2 evicted if needed          | new L2 pages reserved         | node L1-locked (path), in flight|
| ``finish_write(op, ok=True)``          | -                             | L2 pages become ``host_value``| released                        |
| ``finish_write(op, ok=False)``         | the reserved L2 pages         | node exactly as before        | released                        |
| ``start_load_back`` -> load ``TierOp`` | L1 evicted if needed          | new FULL pages set as         | path L1-locked, nodes host-     |
|                                        |                               | ``value``, nodes ``loading``; | locked, in flight               |
|                                        |                               | aux units held by the op only |                                 |
| ``finish_load_back(op, ok=True)``      | aux units of re-filled nodes  | loading nodes readable, their | released                        |
|                                        |                               | aux units placed now          |                                 |
| ``finish_load_back(op, ok=False)``     | the new pages and aux units   | nodes L2-only as before       | released                        |
| ``insert`` through a loading node      | the op's pages, at its finish | the request's own data (every | (the op's locks stay)           |
|                                        |                               | component): never the op's    |                                 |
| ``start_backup`` -> backup ``TierOp``  | -                             | -                             | node host-locked, in flight     |
| ``finish_backup(op, ok)``              | -                             | - (L3 residency is not stored)| released                        |
| ``insert_host`` (prefetched pages)     | duplicate L2 pages and units  | the rest, as L2-only nodes;   | -                               |
|                                        |                               | aux units on held nodes (split|                                 |
|                                        |                               | at the run's edges)           |                                 |
| ``protect_host_window`` (engine lease) | -                             | -                             | the window's nodes host-locked  |
| ``evict_host_units`` (aux L2)          | aux L2 units of L2-only nodes | the nodes' FULL copies        | host-locked data skipped        |

``TierOp.transfers[component] = (src_pages, dst_pages)`` in key order: device -> host for a
write, host -> device for a load; a backup carries the host pages and ``hashes``.

In-flight transfers: the tree owns what a ``TierOp`` holds (its reserved pages, its locks,
the nodes' ``in_flight`` / ``loading`` marks) and releases it in ``finish_*``; it keeps no
table of ops and gives them no id. Whoever starts an op keeps it and must hand it to its
``finish_*`` exactly once (a second finish raises ``ValueError``); with a controller that is
``hicache.scheduler.controller_driver.ControllerDriver``, whose registry holds every op in flight under the one
op id the controller sees, and which fails them all when the controller is lost. The tree
only counts them (``open_transfers``), so that the exact integrity check can refuse to run
while pages are reserved for a transfer. An operation records its last node and its page
count; if a node is split while an op is in flight, the op's pages span the lower node and
its new parent(s), and ``finish_*`` walks up from the recorded node over exactly that many
pages, so splitting never strands a lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hicache.hashing import HASH_BYTES, HashNamespace, PageHasher, component_keys
from hicache.memory.allocator import PageIndices
from hicache.tree.admission import Doorkeeper
from hicache.tree.base import CacheBase, EvictResult, InsertResult, MatchResult
from hicache.tree.components import TreeComponent
from hicache.tree.content import Tier
from hicache.tree.node import LockToken, TreeNode
from hicache.tree.quotas import TenantQuotas


class TreeLocks(Protocol):
    """The tree calls the tier half makes (``UnifiedRadixCache`` defines them): a load-back
    locks its path while it evicts L1 for room."""

    def inc_lock_ref(self, node: TreeNode) -> LockToken: ...

    def dec_lock_ref(self, node: TreeNode | LockToken, token: LockToken | None = None) -> None: ...

    def evict(self, full_tokens: int) -> EvictResult: ...


@dataclass
class TierOp:
    """An in-flight transfer, from its ``start_*`` to its ``finish_*`` (exactly once).

    ``kind``: ``write``, ``load`` or ``backup``; ``node`` / ``npages``: the lowest node it
    covers and its page count (the span survives splits);
    ``transfers[component] = (src_pages, dst_pages)``; ``hashes``: a backup's page hashes;
    ``aux_keys[component]``: a backup's L3 keys of each auxiliary component in
    ``transfers`` (one per L2 unit: ``hicache.hashing.component_key``);
    ``done``: finished. It has no id: the tier layer files it under its controller op id.
    ``quota_tenant``: a write's tenant, whose quota counts its L2 pages while in flight.
    """

    kind: str
    node: TreeNode
    npages: int
    transfers: dict[str, tuple[list[int], PageIndices]]
    hashes: list[str] = field(default_factory=list)
    done: bool = False
    aux_keys: dict[str, list[str]] = field(default_factory=dict)
    quota_tenant: str | None = None
    cold: bool = False
    """A write whose L2 copy enters L2's eviction order at the cold end (``writes_cold``)."""
    pending: dict[str, dict[int, int]] = field(default_factory=dict)
    """A load's auxiliary L1 units, held by the op (not by the nodes, so nothing reads them)
    until ``finish_load_back`` places or frees them: per component name, the op's page
    offset (counted from its first page; a state at its node's last page) -> unit."""

    @property
    def src_pages(self) -> list[int]:
        return self.transfers["full"][0]

    @property
    def dst_pages(self) -> PageIndices:
        return self.transfers["full"][1]


class TierCalls:
    """The tier calls of a ``UnifiedRadixCache`` (see the module docstring): the cache holds
    one as ``cache.tiers``.

    It holds the tree (``tree``: the state and helpers of ``CacheBase``, read and changed
    here as the tables above say) and the three tree calls a load-back needs (``locks``:
    ``TreeLocks``); it keeps the count of ops in flight and the page hashers itself."""

    def __init__(self, tree: CacheBase, locks: TreeLocks, hasher: PageHasher | HashNamespace | None = None) -> None:
        if isinstance(hasher, HashNamespace):
            hasher = PageHasher(hasher)
        if hasher is not None and hasher.page_size != tree.page_size:
            raise ValueError("the hasher's page size differs from the cache's")
        self.tree = tree
        self.locks = locks
        self._hasher = hasher
        self._hashers: dict[str, PageHasher] = {}
        self._open_transfers = 0  # TierOps started and not finished (their owner keeps them)
        self.quotas: TenantQuotas | None = None  # per-tenant L2 quotas, when configured
        self.doorkeeper = Doorkeeper()  # ``write_through_filtered``'s memory of page hashes

    # ================================================================== tiers (§5)
    def nodes_to_write_to_host(self, limit: int | None = None) -> list[TreeNode]:
        """Nodes the write policy wants copied to L2 now, parents before children.

        ``write_through``: every node with L1 data without an L2 copy (FULL's, or an
        auxiliary component's on a node whose FULL pages are in L2 already: an SWA window
        recovered on a tombstone, a Mamba state added later), under ``write_through_filtered``
        too (``writes_cold`` decides where in L2 they go); ``write_through_selective``:
        those with ``hit_count >= write_through_threshold``; ``write_back``: those L1
        eviction queued. Nodes with a transfer in flight are left out. The write-through
        policies look only at the nodes not yet in L2 (``TreeCore.unwritten``), not at all
        of L1.
        """
        if not self.tree.hicache:
            return []
        if self.tree.write_policy == "write_back":
            unwritten = self.tree.core.unwritten
            cands = [n for n in self.tree._write_back_queue
                     if n.parent is not None and n in unwritten and n.data[0].value is not None
                     and not n.in_flight and not n.loading]
        else:  # unwritten: in L1, not in L2 (by construction)
            admits = self.admits
            cands = [n for n in self.tree.core.unwritten if not n.in_flight and not n.loading and admits(n)]
        cands.sort(key=self._depth)
        return cands if limit is None else cands[:limit]

    def admits(self, node: TreeNode) -> bool:
        """Whether the write-through policy copies ``node`` (in L1, not yet in L2) to L2:
        ``write_through`` and ``write_through_filtered`` always, ``write_through_selective``
        once ``hit_count >= write_through_threshold``; ``write_back``: False (L1 eviction
        decides)."""
        policy = self.tree.write_policy
        if policy == "write_through_selective":
            return node.hit_count >= self.tree.write_through_threshold
        return policy != "write_back"

    def writes_cold(self, node: TreeNode) -> bool:
        """``write_through_filtered``'s admission filter: True when ``node``'s L2 copy should
        enter L2's eviction order at the cold end (it leaves L2 first, after an L3 backup
        has read it, and displaces nothing admitted). A node goes in hot while L2 has free
        pages for it, once a match has hit it (``hit_count >= 1``), or when the doorkeeper
        (``hicache.tree.admission``) saw its first page's hash in another node before (it
        was dropped and came back). Always False under the other policies."""
        if self.tree.write_policy != "write_through_filtered" or node.hit_count >= 1:
            return False
        value = node.data[0].value
        host = self.tree.full.host_allocator
        if value is not None and host is not None and host.free_count >= len(value):
            return False
        return not self.doorkeeper.seen_before(self._admission_key(node), node.id)

    def _admission_key(self, node: TreeNode) -> object:
        """The node's first page hash; without a hasher, its parent and first page."""
        if self._hasher is not None:
            return self.node_hashes(node)[0]
        parent = node.parent
        return (parent.id if parent is not None else 0, tuple(node.key[:self.tree.page_size]))

    @staticmethod
    def _depth(node: TreeNode) -> int:
        d = 0
        while node.parent is not None:
            d += 1
            node = node.parent
        return d

    def start_write(self, node: TreeNode) -> TierOp | None:
        """Reserve L2 pages for ``node``'s L1 data that has no L2 copy yet (evicting L2 if
        needed: FULL's by ``evict_host``, an auxiliary component's by tombstoning its own
        L2-only data) and lock the node in L1 until ``finish_write``. A node whose FULL
        pages are in L2 already gets an auxiliary-only write (``transfers`` without
        ``full``). Returns None (nothing changed) if L2 has no room for the FULL pages, or
        nothing is left to write, or the node is not writable (no L1 data, transfer in
        flight); an auxiliary component without room is left out of the write."""
        if not self.tree.hicache:
            raise RuntimeError("start_write needs an L2 allocator")
        core = self.tree.core
        if node.parent is None or node.in_flight or node.loading or node.data[0].value is None:
            return None
        quotas, tenant = self.quotas, None
        if quotas is not None and node.data[0].host_value is None:
            tenant = quotas.tenant(node)
            npages = len(node.data[0].value)
            if quotas.make_room(self.evict_host, self.tree.page_size, tenant, npages) < npages:
                return None  # past its tenant's quota even after evicting that tenant's own pages
        cold = node.data[0].host_value is None and self.writes_cold(node)  # before L2 pages are taken
        transfers: dict[str, tuple[list[int], PageIndices]] = {}
        for c in self.tree.components:
            cd = node.data[c.slot]
            host = c.host_allocator
            if host is None or cd.value is None or cd.host_value is not None:
                continue
            src = c.as_pages(cd.value)
            dst = host.alloc(len(src))
            if dst is None:
                if c is self.tree.full:
                    self.evict_host((len(src) - host.free_count) * self.tree.page_size,
                                    None if quotas is None else quotas.evictable_for(tenant))
                else:
                    self._evict_host_aux(c, len(src) - host.free_count)
                dst = host.alloc(len(src))
            if dst is None:
                if c is self.tree.full:
                    for name, (_s, d) in transfers.items():
                        self.tree._free(self.tree._by_name[name], d, host=True)
                    return None
                continue
            transfers[c.name] = (list(src), dst)
        if not transfers:
            return None
        op = TierOp("write", node, self.tree._npages(node), transfers)
        op.cold = cold and "full" in transfers
        if quotas is not None and "full" in transfers:
            op.quota_tenant = tenant
            quotas.reserve(tenant, len(transfers["full"][1]))
        self.tree.full.lock(core, node)
        for c in self.tree.aux:
            core.lock(node, c.slot)
        node.in_flight += 1
        self._open_transfers += 1
        return op

    def _close(self, op: TierOp, kind: str) -> None:
        """Mark ``op`` finished; refuses one finished before or of another kind."""
        if op.done:
            raise ValueError(f"the {op.kind} of {op.node!r} is not in flight (finished already)")
        if op.kind != kind:
            raise ValueError(f"the operation on {op.node!r} is a {op.kind}, not a {kind}")
        op.done = True
        self._open_transfers -= 1

    @property
    def open_transfers(self) -> int:
        """How many ``TierOp`` were started and not yet finished."""
        return self._open_transfers

    def finish_write(self, op: TierOp, ok: bool) -> list[TreeNode]:
        """Apply the controller's acknowledgement of a ``start_write``. Returns the nodes that
        now hold the written pages in L2, upper first (more than ``op.node`` when a split
        happened while the write was in flight); empty when ``ok`` is False."""
        self._close(op, "write")
        core = self.tree.core
        if self.quotas is not None and "full" in op.transfers:
            self.quotas.settle(op.quota_tenant, len(op.transfers["full"][1]))
        nodes = self.tree._op_nodes(op.node, op.npages)
        for n in nodes:
            n.in_flight -= 1
        for c in self.tree.aux:
            for n in c.op_span(nodes):
                core.unlock(n, c.slot)
        self.tree.full.unlock(core, op.node)
        for name, (_src, dst) in op.transfers.items():
            c = self.tree._by_name[name]
            if not ok:
                self.tree._free(c, dst, host=True)
                continue
            span = c.op_span(nodes)
            if len(span) == 1:
                core.set_host(span[0], c.slot, c.from_pages(dst))
                continue
            start = 0
            for n in reversed(span):  # upper first: parents older than children in L2 order
                k = self.tree._npages(n)
                core.set_host(n, c.slot, dst[start:start + k])
                start += k
        if not ok:
            return []
        for n in nodes:
            self.tree._write_back_queue.pop(n, None)
            self.tree._write_back_released.pop(n, None)
        if op.cold:
            order = core.host_lru[0]
            for n in nodes:  # coldest and oldest: evicting it never takes an older parent along
                if n.data[0].host_value is not None:
                    n.host_time = 0
                    order.demote(n.data[0].hlink)
        return list(reversed(nodes))

    def _load_nodes(self, match: MatchResult) -> list[TreeNode]:
        """The L2-only nodes ``start_load_back(match)`` would load, root side first; empty
        when there is nothing it can load."""
        if match.host_hit_length <= 0:
            return []
        nodes = []
        n: TreeNode | None = match.last_host_node
        while n is not match.last_device_node:
            if n is None or n.parent is None or n.data[0].value is not None or n.in_flight or n.loading:
                return []
            nodes.append(n)
            n = n.parent
        nodes.reverse()
        return nodes

    def _unlocked_path_pages(self, node: TreeNode) -> int:
        """FULL L1 pages from ``node`` up to its root that no lock protects (what a FULL
        path lock on ``node`` makes unevictable)."""
        pages = 0
        while node.parent is not None:
            cd = node.data[0]
            if cd.lock_ref == 0 and cd.value is not None:
                pages += len(cd.value)
            node = node.parent
        return pages

    def load_back_cost(self, match: MatchResult) -> dict[str, int]:
        """What ``start_load_back(match)`` takes out of L1's free and evictable units, per
        component name, in the component's units: the fresh FULL pages of the L2-only tail
        and the pages of the L1 prefix its lock makes unevictable, and each auxiliary
        component's units for the data it has in L2 there. Empty when it would load nothing.
        Changes nothing (the scheduler checks it against its L1 budget first)."""
        nodes = self._load_nodes(match)
        if not nodes:
            return {}
        cost = {self.tree.full.name: sum(self.tree._npages(x) for x in nodes)
                + self._unlocked_path_pages(match.last_device_node)}
        for c in self.tree.aux:
            units = sum(self.tree.core.units[c.slot](x.data[c.slot].host_value)
                        for x in nodes if x.data[c.slot].host_value is not None)
            if units:
                cost[c.name] = units
        return cost

    def write_cost(self, node: TreeNode) -> dict[str, int]:
        """What ``start_write(node)`` makes unevictable in L1 until it finishes, per
        component name, in the component's units: the FULL pages of its path that no lock
        protects yet, and the node's own auxiliary data not locked yet. Changes nothing."""
        cost = {self.tree.full.name: self._unlocked_path_pages(node)}
        for c in self.tree.aux:
            cd = node.data[c.slot]
            if cd.value is not None and cd.lock_ref == 0:
                cost[c.name] = self.tree.core.units[c.slot](cd.value)
        return cost

    def writable(self, node: TreeNode) -> bool:
        """Whether ``start_write(node)`` has something to write and nothing in its way but
        room: L1 data without an L2 copy, no transfer in flight."""
        return (node.parent is not None and not node.in_flight and not node.loading
                and node.data[0].value is not None and node in self.tree.core.unwritten)

    def release_write_back(self, node: TreeNode) -> None:
        """Under ``write_back``: the L2 write that L1 eviction queued for ``node`` cannot
        start (no L2 room, past its tenant's quota, or no L1 room to lock it while it
        copies). Its L1 data is no longer kept for it: the next eviction that reaches the
        node drops what L2 lacks, as ``write_through`` would, so that no request waits for a
        write that may never start."""
        if not self.tree._write_back:
            return
        self.tree._write_back_queue.pop(node, None)
        self.tree._write_back_released[node] = None

    def start_load_back(self, match: MatchResult) -> TierOp | None:
        """Allocate L1 pages for the L2-only tail of ``match`` (evicting L1 if needed) and
        return what to copy (``src_pages`` = L2, ``dst_pages`` = L1, in key order). The
        nodes get their FULL L1 ``value`` now but stay unreadable (``loading``) until
        ``finish_load_back``; each auxiliary component that has L2 data there and finds
        room gets fresh units that the op holds (``TierOp.pending``), not the nodes, so
        that no node shows data whose copy has not landed, whatever happens to it meanwhile
        (a request's insert re-filling it, a failed load). Meanwhile the path is L1-locked
        and the nodes host-locked. None (nothing changed) when there is nothing to load or
        no room. ``load_back_cost`` says beforehand what it takes from L1."""
        core = self.tree.core
        nodes = self._load_nodes(match)
        if not nodes:
            return None
        top = match.last_device_node
        need = sum(self.tree._npages(x) for x in nodes)
        for x in nodes:
            for c in self.tree.components:
                if x.data[c.slot].host_value is not None:
                    core.host_lock(x, c.slot)
        lock = self.locks.inc_lock_ref(top) if top.parent is not None else None
        try:
            dev = self.tree.full.allocator.alloc(need)
            if dev is None:
                self.locks.evict((need - self.tree.full.allocator.free_count) * self.tree.page_size)
                dev = self.tree.full.allocator.alloc(need)
        finally:
            if lock is not None:
                self.locks.dec_lock_ref(lock)
        if dev is None:
            for x in nodes:
                for c in self.tree.components:
                    if x.data[c.slot].host_value is not None:
                        core.host_unlock(x, c.slot)
            return None
        src_all: list[int] = []
        off = 0
        aux_src: dict[str, list[int]] = {}
        aux_dst: dict[str, list[int]] = {}
        pending: dict[str, dict[int, int]] = {}
        for x in nodes:
            k = self.tree._npages(x)
            src_all.extend(x.data[0].host_value)
            x.loading = True  # first: the observer hears of these pages once they land
            core.set_value(x, 0, dev[off:off + k])
            x.in_flight += 1
            for c in self.tree.aux:
                hv = x.data[c.slot].host_value
                if hv is None:
                    continue
                pages = c.as_pages(hv)
                d = c.allocator.alloc(len(pages))
                if d is None:
                    continue
                aux_src.setdefault(c.name, []).extend(pages)
                aux_dst.setdefault(c.name, []).extend(d)
                at = range(off, off + k) if c.paged else (off + k - 1,)  # a state belongs to the node's end
                pending.setdefault(c.name, {}).update(zip(at, d, strict=True))
            off += k
        transfers = {self.tree.full.name: (src_all, dev)}
        for name in aux_src:
            transfers[name] = (aux_src[name], aux_dst[name])
        op = TierOp("load", match.last_host_node, need, transfers, pending=pending)
        self.tree.full.lock(core, op.node)
        self._open_transfers += 1
        return op

    def finish_load_back(self, op: TierOp, ok: bool) -> None:
        """Apply the acknowledgement of a ``start_load_back``. On success the nodes still
        loading become readable, each auxiliary component's units placed on them now;
        on failure they are L2-only again. Units a node no longer wants (its own pages
        came from a request's insert meanwhile) and every unit of a failed load are freed
        here: none was ever readable, so nothing else refers to them."""
        self._close(op, "load")
        core = self.tree.core
        nodes = self.tree._op_nodes(op.node, op.npages)
        self.tree.full.unlock(core, op.node)
        dev = op.transfers[self.tree.full.name][1]
        end = len(dev)
        landed: list[TreeNode] = []  # now readable: the observer is told, upper first, below
        for x in nodes:  # lowest first: its pages are the last ones
            k = self.tree._npages(x)
            lo = end - k
            x.in_flight -= 1
            for c in self.tree.components:
                cd = x.data[c.slot]
                if cd.host_value is not None and cd.host_lock_ref > 0:
                    core.host_unlock(x, c.slot)
            place = ok and x.loading  # else an insert re-filled it with a request's own data, or the load failed
            for c in self.tree.aux:
                units = op.pending.get(c.name)
                if not units:
                    continue
                at = range(lo, end) if c.paged else (end - 1,)
                got = [units.pop(j) for j in at if j in units]
                if not got:
                    continue
                if place and len(got) == len(at) and x.data[c.slot].value is None:
                    core.set_value(x, c.slot, c.from_pages(got))
                else:
                    self.tree._free(c, got)
            if place:
                landed.append(x)
            if not x.loading:
                self.tree._free(self.tree.full, dev[lo:end])  # the request's pages replaced ours
            elif not ok:
                self.tree._free(self.tree.full, core.clear_value(x, 0))
            x.loading = False
            end = lo
        for name, units in op.pending.items():  # none is left unless the span changed shape
            self.tree._free(self.tree._by_name[name], list(units.values()))
            units.clear()
        if core.observer is not None:
            for x in reversed(landed):
                core.observer.pages_added(x, Tier.DEVICE)

    def start_backup(self, node: TreeNode) -> TierOp | None:
        """L3 backup of ``node``'s L2 data: returns its FULL L2 pages and page hashes and,
        for each auxiliary component with L2 data on the node, its L2 units
        (``transfers[name]``) and their L3 keys (``aux_keys[name]``: an SWA page per page, a
        Mamba state for the node's last page), with the node and that data host-locked
        until ``finish_backup``. None if the node has no L2 copy."""
        if node.parent is None or node.data[0].host_value is None:
            return None
        hashes = self.node_hashes(node)
        op = TierOp("backup", node, self.tree._npages(node), {"full": (list(node.data[0].host_value), [])}, hashes)
        for c in self.tree.aux:
            hv = node.data[c.slot].host_value
            if hv is None or c.host_allocator is None:
                continue
            units = list(c.as_pages(hv))
            keys = component_keys(c.name, hashes if c.paged else hashes[-1:])
            if len(keys) != len(units):
                continue
            op.transfers[c.name] = (units, [])
            op.aux_keys[c.name] = keys
            self.tree.core.host_lock(node, c.slot)
        self.tree.core.host_lock(node, 0)
        node.in_flight += 1
        self._open_transfers += 1
        return op

    def finish_backup(self, op: TierOp, ok: bool) -> None:
        """Release the node of a ``start_backup`` (either way; L3 residency is not stored)."""
        self._close(op, "backup")
        nodes = self.tree._op_nodes(op.node, op.npages)
        observer = self.tree.core.observer
        for n in nodes:
            n.in_flight -= 1
            self.tree.core.host_unlock(n, 0)
            if ok and observer is not None:
                observer.pages_added(n, Tier.STORAGE)
        for name in op.aux_keys:
            c = self.tree._by_name[name]
            for n in c.op_span(nodes):
                self.tree.core.host_unlock(n, c.slot)

    def protect_host(self, node: TreeNode) -> int:
        """Host-lock ``node`` (its FULL L2 copy); returns the page count to pass back to
        ``release_host`` (the node may be split meanwhile)."""
        if node.parent is None or node.data[0].host_value is None:
            raise ValueError("protect_host: the node has no L2 copy")
        self.tree.core.host_lock(node, 0)
        return self.tree._npages(node)

    def protect_host_path(self, node: TreeNode) -> list[tuple[TreeNode, int]]:
        """Host-lock every node from ``node``'s root down to it (each has an L2 copy);
        returns the ``(node, npages)`` pairs to give back, each with ``release_host``."""
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return [(n, self.protect_host(n)) for n in reversed(path)]

    def release_host(self, node: TreeNode, npages: int | None = None) -> None:
        nodes = self.tree._op_nodes(node, self.tree._npages(node) if npages is None else npages)
        for n in nodes:
            if n.data[0].host_lock_ref <= 0:
                raise ValueError(f"release_host: host_lock_ref of {n!r} would go below zero")
        for n in nodes:
            self.tree.core.host_unlock(n, 0)

    def protect_host_window(self, node: TreeNode, name: str, tokens: int) -> tuple[list[int], int]:
        """Host-lock the L2 data of paged auxiliary component ``name`` (SWA) on the nodes
        that cover the last ``tokens`` tokens before ``node``'s end (or the whole path, when
        shorter); returns its L2 pages of the last ``ceil(tokens / page_size)`` pages of the
        key, in key order, and the page count to pass back to ``release_host_window``.
        Raises ValueError where a node on the way has no such data (``match_prefix`` never
        ends a host hit there)."""
        c = self.tree._by_name.get(name)
        if c is None or not c.paged or c is self.tree.full:
            raise ValueError(f"protect_host_window: no paged auxiliary component {name!r}")
        span: list[TreeNode] = []
        covered = 0
        n = node
        while n.parent is not None and covered < tokens:
            if n.data[c.slot].host_value is None:
                raise ValueError(f"protect_host_window: {n!r} has no {name} L2 data")
            span.append(n)
            covered += len(n.key)
            n = n.parent
        for x in span:
            self.tree.core.host_lock(x, c.slot)
        units = [p for x in reversed(span) for p in c.as_pages(x.data[c.slot].host_value)]
        keep = -(-tokens // self.tree.page_size)
        return units[-keep:] if keep else [], sum(self.tree._npages(x) for x in span)

    def release_host_window(self, node: TreeNode, name: str, npages: int) -> None:
        """Undo ``protect_host_window(node, name, ...)`` that returned ``npages``."""
        c = self.tree._by_name[name]
        nodes = self.tree._op_nodes(node, npages) if npages else []
        for n in nodes:
            if n.data[c.slot].host_lock_ref <= 0:
                raise ValueError(f"release_host_window: host_lock_ref of {n!r} would go below zero")
        for n in nodes:
            self.tree.core.host_unlock(n, c.slot)

    def protect_host_state(self, node: TreeNode, name: str) -> int:
        """Host-lock the L2 state of state component ``name`` (Mamba) at ``node``'s end and
        return its unit; ValueError where ``node`` has none (``match_prefix`` never ends a
        host hit there). ``release_host_state`` undoes it."""
        c = self.tree._by_name.get(name)
        if c is None or c.paged:
            raise ValueError(f"protect_host_state: no state component {name!r}")
        hv = node.data[c.slot].host_value
        if hv is None:
            raise ValueError(f"protect_host_state: {node!r} has no {name} L2 state")
        self.tree.core.host_lock(node, c.slot)
        return int(c.as_pages(hv)[0])

    def release_host_state(self, node: TreeNode, name: str) -> None:
        """Undo ``protect_host_state(node, name)``."""
        c = self.tree._by_name[name]
        if node.data[c.slot].host_lock_ref <= 0:
            raise ValueError(f"release_host_state: host_lock_ref of {node!r} would go below zero")
        self.tree.core.host_unlock(node, c.slot)

    def host_state_pages(self, node: TreeNode, name: str) -> set[int]:
        """The pages ``j`` of the key from its root down to ``node`` after which state
        component ``name`` has an L2 state (a state sits at a node's end)."""
        slot = self.tree._by_name[name].slot
        ends: list[tuple[TreeNode, bool]] = []
        while node.parent is not None:
            ends.append((node, node.data[slot].host_value is not None))
            node = node.parent
        out: set[int] = set()
        at = 0
        for x, held in reversed(ends):
            at += self.tree._npages(x)
            if held:
                out.add(at - 1)
        return out

    def host_page_flags(self, node: TreeNode, name: str) -> list[bool]:
        """Per page of the key from its root down to ``node``: whether component ``name``
        has L2 data there."""
        slot = self.tree._by_name[name].slot
        runs: list[list[bool]] = []
        while node.parent is not None:
            runs.append([node.data[slot].host_value is not None] * self.tree._npages(node))
            node = node.parent
        return [f for run in reversed(runs) for f in run]

    def drop_host_units(self, node: TreeNode, name: str, first: int, last: int) -> int:
        """Clear paged auxiliary component ``name``'s L2 data of pages ``[first, last)`` of
        the key from its root down to ``node`` (the nodes keep their FULL copies: SWA
        tombstones), splitting a node that the range starts or ends inside; data that is
        host-locked or in a transfer stays. Returns the units freed."""
        c = self.tree._by_name.get(name)
        if c is None or not c.paged or c is self.tree.full:
            raise ValueError(f"drop_host_units: no paged auxiliary component {name!r}")
        path: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        core, ps = self.tree.core, self.tree.page_size
        freed = 0
        at = 0
        for x in reversed(path):
            k = self.tree._npages(x)
            lo, hi = max(first, at), min(last, at + k)
            cd = x.data[c.slot]
            if lo < hi and cd.host_value is not None and not cd.host_lock_ref and not x.in_flight:
                part = x
                if hi < at + k:  # the part after the range keeps its data (x stays the lower part)
                    part = core.split(x, (hi - at) * ps)
                if lo > at:  # and so does the part before it
                    core.split(part, (lo - at) * ps)
                hv = core.clear_host(part, c.slot)
                freed += core.units[c.slot](hv)
                self.tree._free(c, c.as_pages(hv), host=True)
            at += k
        return freed

    def host_prefix_pages(self, node: TreeNode) -> list[int]:
        """The FULL L2 pages of the key from its root down to ``node``, in key order; every
        node on the way must have an L2 copy (as ``match_prefix``'s ``last_host_node`` path has)."""
        runs = []
        while node.parent is not None:
            hv = node.data[0].host_value
            if hv is None:
                raise ValueError(f"host_prefix_pages: {node!r} has no L2 copy")
            runs.append(hv)
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    def insert_host(self, key: Sequence[int], host_pages: Sequence[int], cache_salt: str = "",
                    *, start_page: int = 0, aux: Mapping[str, Mapping[int, int]] | None = None,
                    length: int | None = None, start_node: TreeNode | None = None,
                    start_tokens: int = 0) -> InsertResult:
        """Insert prefetched pages as L2-only nodes: ``host_pages`` are the FULL L2 pages of
        the key's pages from ``start_page`` on. Pages the tree already holds are freed here,
        as are all of them when the tree no longer holds the key's first ``start_page``
        pages. ``host_pages_taken`` says how many the tree kept.

        ``aux[name]`` maps a page ``j`` of the key (counted from 0) to an auxiliary
        component's L2 unit: for a paged one (SWA) its page ``j``, for a state (Mamba) the
        state after page ``j``. The new nodes are cut so that a paged component's run of
        pages and a state's boundary fall on node edges. An existing node with a FULL L2
        copy, no transfer and no such data gets a paged component's pages where they cover
        it whole, after it is split at the edges of their run (which may lie before
        ``start_page``: an engine adding the window of a prefix the tree holds), and a state
        where it ends the node; those nodes are ``aux_nodes`` of the result. Every unit the
        tree does not keep is freed here.

        ``length``: insert ``key[:length]`` only (a caller whose array grows past it).
        ``start_node``: a node in this tree, under ``cache_salt``'s root, whose path from the
        root the caller knows spells ``key[:start_tokens]`` (``start_tokens`` page-aligned, at
        most ``start_page`` pages): the key is compared from there on only, so an engine's save
        costs its new pages, not its context. Without ``aux`` only (window and state rules
        look at the whole path)."""
        if not self.tree.hicache:
            raise RuntimeError("insert_host needs an L2 allocator")
        core = self.tree.core
        ps = self.tree.page_size
        key, n = self.tree._aligned(key)
        if length is not None:
            if not 0 <= length <= len(key):
                raise ValueError(f"insert_host: length {length} outside the key's {len(key)} tokens")
            n = min(n, length - length % ps)
        npages = n // ps
        hp = list(host_pages)
        if len(hp) != npages - start_page:
            raise ValueError("insert_host: host_pages must cover the key from start_page on")
        units: dict[str, dict[int, int]] = {}
        for name, m in (aux or {}).items():
            c = self.tree._by_name.get(name)
            if c is None or c is self.tree.full or c.host_allocator is None:
                raise ValueError(f"insert_host: no auxiliary L2 component {name!r}")
            if any(not 0 <= j < npages for j in m):
                raise ValueError(f"insert_host: {name} pages outside the key")
            units[name] = dict(m)
        root = core.ensure_root(cache_salt)
        if start_node is not None and start_node is not root and not units:
            if start_tokens % ps or start_tokens > start_page * ps or start_node.root is not root:
                raise ValueError("insert_host: start_node must end a page-aligned prefix under the key's root")
            above: list[TreeNode] = []
            x: TreeNode | None = start_node
            while x is not None and x is not root:
                above.append(x)
                x = x.parent
            above.reverse()
            path = above + core.walk(start_node, key[start_tokens:n], n - start_tokens)
            have = start_tokens + sum(len(x.key) for x in path[len(above):])
        else:
            path = core.walk(root, key, n)
            have = sum(len(x.key) for x in path)
        node = path[-1] if path else root
        res = InsertResult(have, node)
        if have < start_page * ps:
            self.tree.full.host_allocator.free(hp)  # type: ignore[union-attr]
            self._free_aux_units(units)
            return res
        dup = hp[:have // ps - start_page]
        if dup:
            self.tree.full.host_allocator.free(dup)  # type: ignore[union-attr]
        if units:  # existing nodes: take what they lack, split so that it covers them whole
            path = self._split_for_aux(path, units)
            first = 0
            for x in path:
                k = self.tree._npages(x)
                if x.data[0].host_value is not None and not x.in_flight and not x.loading \
                        and self._take_aux(x, first, units):
                    res.aux_nodes.append(x)
                    res.kept_end = (first + k) * ps
                first += k
        if have < n:
            cuts = {have // ps, npages}
            for name, m in units.items():
                c = self.tree._by_name[name]
                for j in m:
                    if j >= have // ps:
                        if c.paged:
                            cuts.update((j, j + 1))
                        else:
                            cuts.add(j + 1)
            edges = sorted(cuts)
            if any(not self.tree._by_name[name].paged for name in units) or len(edges) > 2:
                edges = self._merge_edges(edges, units)
            parent, made = node, res.new_nodes
            for a, b in zip(edges, edges[1:], strict=False):
                leaf = core.new_child(parent, key[a * ps:b * ps])
                core.set_host(leaf, 0, hp[a - start_page:b - start_page])
                self._take_aux(leaf, a, units)
                made.append(leaf)
                parent = leaf
            core.touch(path + made)
            res.node = made[-1]
            res.host_pages_taken = npages - have // ps
            res.kept_end = n
        self._free_aux_units(units)
        return res

    def _merge_edges(self, edges: list[int], units: dict[str, dict[int, int]]) -> list[int]:
        """Keep only the cuts where a paged component's presence changes or a state
        boundary is: fewer, longer nodes."""
        keep = [edges[0]]
        for e in edges[1:-1]:
            state_edge = any(not self.tree._by_name[name].paged and (e - 1) in m for name, m in units.items())
            change = any(self.tree._by_name[name].paged and ((e - 1) in m) != (e in m) for name, m in units.items())
            if state_edge or change:
                keep.append(e)
        keep.append(edges[-1])
        return keep

    def _split_for_aux(self, path: list[TreeNode], units: dict[str, dict[int, int]]) -> list[TreeNode]:
        """``path`` with its nodes that can take auxiliary data (a FULL L2 copy, no transfer)
        split where a paged component's run of ``units`` starts or ends inside them, and after
        a page inside them that a state of ``units`` follows."""
        out: list[TreeNode] = []
        first = 0
        for x in path:
            k = self.tree._npages(x)
            cuts: set[int] = set()
            if x.data[0].host_value is not None and not x.in_flight and not x.loading:
                for name, m in units.items():
                    c = self.tree._by_name[name]
                    if c.paged and x.data[c.slot].host_value is None:
                        cuts.update(j for j in range(first + 1, first + k) if (j - 1 in m) != (j in m))
                    elif not c.paged:  # a state after a page inside the node: cut there (it ends the upper part)
                        cuts.update(j + 1 for j in m if first <= j < first + k - 1)
            at = first
            for cut in sorted(cuts):
                out.append(self.tree.core.split(x, (cut - at) * self.tree.page_size))
                at = cut
            out.append(x)
            first += k
        return out

    def _take_aux(self, node: TreeNode, first: int, units: dict[str, dict[int, int]]) -> bool:
        """Give ``node`` (its key starts at page ``first``) the auxiliary L2 units of
        ``units`` that cover it whole, removing them from ``units``; whether it took any."""
        k = self.tree._npages(node)
        took = False
        for name, m in units.items():
            c = self.tree._by_name[name]
            if node.data[c.slot].host_value is not None:
                continue
            if c.paged:
                if all(j in m for j in range(first, first + k)):
                    self.tree.core.set_host(node, c.slot, [m.pop(j) for j in range(first, first + k)])
                    took = True
            elif first + k - 1 in m:
                self.tree.core.set_host(node, c.slot, c.from_pages([m.pop(first + k - 1)]))
                took = True
        return took

    def _free_aux_units(self, units: dict[str, dict[int, int]]) -> None:
        for name, m in units.items():
            if m:
                self.tree._free(self.tree._by_name[name], list(m.values()), host=True)
            m.clear()

    # ================================================================== L2 eviction
    def evict_host(self, tokens: int, may_evict: Callable[[TreeNode], bool] | None = None) -> int:
        """L2 eviction: delete L2-only leaves with ``host_lock_ref == 0`` (LRU first) until
        ``tokens`` worth of FULL L2 pages are free. ``may_evict``: only nodes it accepts (a
        node's ancestors are in its namespace, so it judges them alike; per-tenant quotas,
        ``hicache.tree.quotas``). Returns tokens freed."""
        need = -(-tokens // self.tree.page_size)
        freed = 0
        for node in self.tree.core.host_lru[0].candidates():
            if freed >= need:
                break
            if may_evict is not None and not may_evict(node):
                continue
            while freed < need and self._host_evictable(node):
                parent = node.parent
                assert parent is not None  # _host_evictable refuses roots
                t = node.host_time
                freed += len(node.data[0].host_value)
                self.tree._delete(node)
                if parent.host_time > t:
                    break  # newer: still ahead in the scan
                node = parent
        self.tree.evicted_host_tokens += freed * self.tree.page_size
        return freed * self.tree.page_size

    def evict_host_units(self, name: str, need: int) -> int:
        """L2 eviction of ``need`` units of auxiliary component ``name`` (the nodes keep their
        FULL copy and become L2 tombstones of it; see ``_evict_host_aux``); returns units freed."""
        c = self.tree._by_name.get(name)
        if c is None or c is self.tree.full:
            raise ValueError(f"evict_host_units: no auxiliary component {name!r}")
        return self._evict_host_aux(c, need)

    def _evict_host_aux(self, c: TreeComponent, need: int) -> int:
        """L2 eviction of one auxiliary component's data (``need`` units): the node keeps
        its FULL copy and becomes an L2 tombstone of ``c``. Only L2-only data goes (as for
        FULL: a copy of data still in L1 stays, or the node would want writing again);
        host-locked data and data of a node with a transfer in flight stay."""
        core = self.tree.core
        freed = 0
        for node in core.host_lru[c.slot].candidates():
            if freed >= need:
                break
            cd = node.data[c.slot]
            if cd.host_lock_ref or node.in_flight or cd.host_value is None or cd.value is not None:
                continue
            hv = core.clear_host(node, c.slot)
            freed += core.units[c.slot](hv)
            self.tree._free(c, c.as_pages(hv), host=True)
        return freed

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        if node.parent is None or node.children or node.in_flight or node.data[0].value is not None:
            return False
        return not any(cd.host_lock_ref or cd.lock_ref for cd in node.data)

    # ================================================================== hashes
    def hasher_for(self, salt: str) -> PageHasher:
        """The page hasher of ``salt``'s namespace (the chain of docs/architecture.md §6); one per
        salt, kept."""
        if self._hasher is None:
            raise RuntimeError("page hashes need a hasher (pass hasher= to UnifiedRadixCache)")
        h = self._hashers.get(salt)
        if h is None:
            h = self._hasher if salt == self._hasher.namespace.cache_salt else PageHasher(
                self._hasher.namespace.with_salt(salt))
            self._hashers[salt] = h
        return h

    def node_digests(self, node: TreeNode) -> bytes:
        """The node's page hashes as the node keeps them: raw digests, ``HASH_BYTES`` a page,
        in one buffer (computed now if needed, with its missing ancestors')."""
        if node.parent is None:
            return b""
        chain = []
        n = node
        while n.parent is not None and n.hash_value is None:
            chain.append(n)
            n = n.parent
        parent = n.hash_value[-HASH_BYTES:] if n.parent is not None and n.hash_value else None
        hasher = self.hasher_for(self.tree.salt_of(node))
        for x in reversed(chain):
            x.hash_value = hasher.digest_pages(x.key, parent)
            parent = x.hash_value[-HASH_BYTES:]
        return node.hash_value  # type: ignore[return-value]

    def node_hashes(self, node: TreeNode) -> list[str]:
        """The node's page hashes, one hex string a page (a new list: ``node_digests``, decoded)."""
        d = self.node_digests(node)
        return [d[i:i + HASH_BYTES].hex() for i in range(0, len(d), HASH_BYTES)]

    def last_page_hash(self, node: TreeNode) -> str | None:
        """The hash of the node's last page (None for a root): continue the chain into L3."""
        d = self.node_digests(node)
        return d[-HASH_BYTES:].hex() if d else None
