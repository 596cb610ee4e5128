"""L1Eviction: which nodes lose their L1 data when L1 needs room (docs/architecture.md §4, §5).

The layer of ``UnifiedRadixCache`` between ``CacheBase`` (the state it reads and changes) and
the tree semantics (``hicache.tree.cache``, which derives from it): ``evict`` /
``evict_units``, LRU first by each component's L1 order, with the write-back queue
(``write_back``: a node whose L1 data L2 lacks is queued for writing, not dropped). L2
eviction is ``HostCalls.evict_host``'s (``hicache.tree.host``).

Ownership of page indices (the tree's other calls are in ``hicache.tree.cache``'s table):

| step                                   | freed                         | kept / taken by the tree      | locked meanwhile                |
|----------------------------------------|-------------------------------|-------------------------------|---------------------------------|
| ``evict`` (L1)                         | L1 pages of evicted nodes     | L2 copies (node -> L2-only)   | locked / in-flight nodes skipped|
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hicache.tree.base import CacheBase, EvictResult
from hicache.tree.components import TreeComponent
from hicache.tree.node import TreeNode

NodeFilter = Callable[[TreeNode], bool]
"""Which nodes an eviction or a flush may take (``may_evict``)."""


class L1Eviction(CacheBase):
    """L1 eviction over ``CacheBase``'s state (see the module docstring); ``UnifiedRadixCache``
    derives from it."""

    def evict(self, full_tokens: int, may_evict: NodeFilter | None = None) -> EvictResult:
        """``evict_units`` of FULL alone (the primary component every cache has)."""
        return self.evict_units({self.full.name: full_tokens}, may_evict)

    def evict_units(self, amounts: Mapping[str, int], may_evict: NodeFilter | None = None) -> EvictResult:
        """Free at least the requested L1 amounts (per component name: tokens for a paged
        component, states otherwise) if unlocked data allows, LRU first.

        FULL: device leaves (no child with L1 data). A node with an L2 copy stays as an
        L2-only node; one without is deleted (with the L2-only nodes below it). Under
        ``write_back`` with L2 on, a node with L1 data not in L2 (any component's) is
        queued for writing instead, whichever component's eviction reached it.
        Auxiliary components: internal nodes become tombstones (cascading to the other
        components of lower-or-equal priority there); a leaf whose FULL data can go goes
        wholly, by the same rules as a FULL eviction. ``may_evict``: only nodes it accepts
        (a node's ancestors are in its namespace, so it judges them alike: a flush of one
        tenant's namespaces).
        """
        res = EvictResult()
        ps = self.page_size
        if not self.aux:  # FULL only: the common case, without the per-component loop
            want = amounts.get("full", 0)
            if want > 0:
                res.freed["full"] = self._evict_full(-(-want // ps), may_evict) * ps
                self.evicted_device_tokens += res.freed["full"]
            return res
        for c in self.components:
            want = amounts.get(c.name, 0)
            if want > 0:
                unit = c.unit_tokens(ps)
                got = self._evict_component(c, -(-want // unit), may_evict)
                res.freed[c.name] = got * unit
        self.evicted_device_tokens += res.full_tokens
        return res

    def _evict_component(self, c: TreeComponent, need: int, may_evict: NodeFilter | None = None) -> int:
        return self._evict_full(need, may_evict) if c is self.full else self._evict_aux(c, need, may_evict)

    def _full_evictable(self, node: TreeNode) -> bool:
        """No lock (of any component) and no child with L1 data. Transfers in flight hold
        locks on what they need in L1 (a backup reads L2 only); ``loading`` is kept as a
        guard."""
        if node.loading:
            return False
        for cd in node.data:
            if cd.lock_ref:
                return False
        for ch in node.children.values():
            if ch.data[0].value is not None:
                return False
        return True

    def _evict_full(self, need: int, may_evict: NodeFilter | None = None) -> int:
        freed = 0
        for node in self.core.dev_lru[0].candidates():
            if freed >= need:
                break
            if may_evict is not None and not may_evict(node):
                continue
            while freed < need and node.parent is not None and self._full_evictable(node):
                if not self._can_drop_device(node):
                    break
                parent = node.parent
                t = node.last_access_time
                freed += self._evict_node_device(node)
                # a parent that just became a leaf and is older than this node is now the
                # least recently used candidate (the scan has passed it); a newer one is
                # still ahead in the scan
                if parent.last_access_time > t:
                    break
                node = parent
        return freed

    def _can_drop_device(self, node: TreeNode) -> bool:
        """Whether ``node``'s L1 data may go now (it passed ``_full_evictable``). Under
        ``write_back``, a node with L1 data not yet in L2 (any component's) is queued for
        writing instead. Otherwise yes with a FULL L2 copy; without one, the L2-only nodes
        below it must be deletable (they go with it)."""
        if self._write_back and node in self.core.unwritten and node not in self._write_back_released:
            self._write_back_queue[node] = None
            return False
        return node.data[0].host_value is not None or self._l2_subtree_deletable(node)

    def _l2_subtree_deletable(self, node: TreeNode) -> bool:
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            if x.in_flight or any(cd.host_lock_ref or cd.lock_ref for cd in x.data):
                return False
            stack.extend(x.children.values())
        return True

    def _evict_node_device(self, node: TreeNode) -> int:
        """Free every component's L1 data on ``node``; keep it L2-only or delete it (with
        the L2-only nodes below it). Returns the FULL pages freed."""
        core = self.core
        for c in self.aux:
            v = core.clear_value(node, c.slot)
            if v is not None:
                self._free(c, c.as_pages(v))
        pages = core.clear_value(node, 0)
        self.full.allocator.free(pages)
        self._write_back_queue.pop(node, None)
        self._write_back_released.pop(node, None)
        if node.data[0].host_value is None:
            if node.children:  # L2-only nodes below (``_can_drop_device`` allowed it)
                for ch in list(node.children.values()):
                    self._delete_subtree(ch)
            self._delete(node)
        return len(pages)

    def _delete_subtree(self, node: TreeNode) -> None:
        """Delete an L2-only node and everything below it (``_l2_subtree_deletable`` said yes)."""
        for ch in list(node.children.values()):
            self._delete_subtree(ch)
        hv = node.data[0].host_value
        self.evicted_host_tokens += len(hv) * self.page_size if hv is not None else 0
        self._delete(node, cascade=False)

    def _evict_aux(self, c: TreeComponent, need: int, may_evict: NodeFilter | None = None) -> int:
        core = self.core
        i = c.slot
        freed = 0
        for node in core.dev_lru[i].candidates():
            if freed >= need:
                break
            if may_evict is not None and not may_evict(node):
                continue
            cd = node.data[i]
            if cd.lock_ref or node.loading or cd.value is None:
                continue
            if self._write_back and node in core.unwritten and node not in self._write_back_released:
                self._write_back_queue[node] = None  # written first, evicted after
                continue
            is_leaf = not node.children
            prio = c.priority(is_leaf)
            before = core.units[i](cd.value)
            if is_leaf and self._full_evictable(node) and self._can_drop_device(node):
                self._evict_node_device(node)
                freed += before
                continue
            for other in self.aux:  # cascade to lower-or-equal priority, unlocked data
                ocd = node.data[other.slot]
                if other is c or (ocd.value is not None and ocd.lock_ref == 0
                                  and other.priority(is_leaf) <= prio):
                    v = core.clear_value(node, other.slot)
                    if v is not None:
                        self._free(other, other.as_pages(v))
            freed += before
        return freed
