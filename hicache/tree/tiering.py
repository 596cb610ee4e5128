"""TierCalls: the transfers between tiers and how the tree's node state follows them
(docs/architecture.md §4 and §5).

Owns which nodes to write to L2 (``nodes_to_write_to_host``, the write policy's admission),
the transfers (``start_write`` / ``finish_write``, ``start_load_back`` /
``finish_load_back``, ``start_backup`` / ``finish_backup``) and the ``TierOp`` each returns,
their costs (``load_back_cost``, ``write_cost``), the count of ops in flight
(``open_transfers``) and the tenants' L2 quotas (``quotas``). Like the rest of the cache it
never touches KV bytes: the calls return *which* pages to copy, and the cache controller
(another process) copies them and acknowledges.

What it needs from the rest of the cache, its written interface: the state and shared
helpers of ``CacheBase`` (``hicache.tree.base``; ``TierCalls.tree``), three calls of the
tree half (``TreeLocks``; ``TierCalls.locks``: a load-back locks its path with
``inc_lock_ref`` / ``dec_lock_ref`` while it evicts L1 for room with ``evict``), L2 eviction
(``HostCalls``, ``hicache.tree.host``; ``TierCalls.host``: a write evicts L2 for room) and
the page hashes (``PageHashes``, ``hicache.tree.hashes``; ``TierCalls.hashes``).
``UnifiedRadixCache`` (``hicache.tree.cache``) is the tree half and holds its ``TierCalls``
as ``tiers``; this module does not import ``hicache.tree.cache``.

Ownership of page indices in the transfers (Full component; SWA behaves alike, Mamba with
one slot; the L2-only calls, ``evict_host`` to ``insert_host``, are in ``hicache.tree.host``'s
table, the tree's own calls in ``hicache.tree.cache``'s):

| step                                   | freed                         | kept / taken by the tree      | locked meanwhile                |
|----------------------------------------|-------------------------------|-------------------------------|---------------------------------|
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

from dataclasses import dataclass, field
from typing import Protocol

from hicache.hashing import component_keys
from hicache.memory.allocator import PageIndices
from hicache.tree.admission import Doorkeeper
from hicache.tree.base import CacheBase, EvictResult, MatchResult
from hicache.tree.content import Tier
from hicache.tree.hashes import PageHashes
from hicache.tree.host import HostCalls
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
    """The transfers of a ``UnifiedRadixCache`` (see the module docstring): the cache holds
    one as ``cache.tiers``.

    It holds the tree (``tree``: the state and helpers of ``CacheBase``, read and changed
    here as the table above says), the three tree calls a load-back needs (``locks``:
    ``TreeLocks``), the cache's L2 calls (``host``) and page hashes (``hashes``); it keeps
    the count of ops in flight itself."""

    def __init__(self, tree: CacheBase, locks: TreeLocks, host: HostCalls, hashes: PageHashes) -> None:
        self.tree = tree
        self.locks = locks
        self.host = host
        self.hashes = hashes
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
        if self.hashes.hasher is not None:
            return self.hashes.node_hashes(node)[0]
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
            if quotas.make_room(self.host.evict_host, self.tree.page_size, tenant, npages) < npages:
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
                    self.host.evict_host((len(src) - host.free_count) * self.tree.page_size,
                                    None if quotas is None else quotas.evictable_for(tenant))
                else:
                    self.host.evict_host_aux(c, len(src) - host.free_count)
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
        hashes = self.hashes.node_hashes(node)
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

