"""HostCalls: what the tree holds in L2, outside transfers (docs/architecture.md §5).

Owns the L2-only operations on the tree: host locks (``protect_host`` / ``release_host``,
the window and state variants an engine lease takes), reads of a path's L2 data
(``host_prefix_pages``, ``host_page_flags``, ``host_state_pages``), prefetched or engine-saved
pages inserted as L2-only nodes (``insert_host``), auxiliary L2 data dropped
(``drop_host_units``) and L2 eviction (``evict_host``, ``evict_host_units``). The transfers
between tiers are ``TierCalls``' (``hicache.tree.tiering``), which evicts L2 through this
class to make room for a write. It reads and changes ``CacheBase``'s state (``tree``) and
never touches KV bytes. ``UnifiedRadixCache`` holds one as ``host``.

Ownership of page indices in these calls (Full component; SWA behaves alike, Mamba with one
slot; the transfers' rows are in ``hicache.tree.tiering``'s table, the tree's own calls in
``hicache.tree.cache``'s):

| step                                   | freed                         | kept / taken by the tree      | locked meanwhile                |
|----------------------------------------|-------------------------------|-------------------------------|---------------------------------|
| ``evict_host`` (L2)                    | L2 pages of L2-only leaves    | -                             | host-locked nodes skipped       |
| ``insert_host`` (prefetched pages)     | duplicate L2 pages and units  | the rest, as L2-only nodes;   | -                               |
|                                        |                               | aux units on held nodes (split|                                 |
|                                        |                               | at the run's edges)           |                                 |
| ``protect_host_window`` (engine lease) | -                             | -                             | the window's nodes host-locked  |
| ``evict_host_units`` (aux L2)          | aux L2 units of L2-only nodes | the nodes' FULL copies        | host-locked data skipped        |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hicache.tree.base import CacheBase, InsertResult
from hicache.tree.components import TreeComponent
from hicache.tree.node import TreeNode


class HostCalls:
    """The L2 calls of a ``UnifiedRadixCache`` (see the module docstring): the cache holds
    one as ``cache.host``. ``tree``: the state and helpers of ``CacheBase``."""

    def __init__(self, tree: CacheBase) -> None:
        self.tree = tree

    # ================================================================== host locks and reads
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

    # ================================================================== L2-only inserts
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
        FULL copy and become L2 tombstones of it; see ``evict_host_aux``); returns units freed."""
        c = self.tree._by_name.get(name)
        if c is None or c is self.tree.full:
            raise ValueError(f"evict_host_units: no auxiliary component {name!r}")
        return self.evict_host_aux(c, need)

    def evict_host_aux(self, c: TreeComponent, need: int) -> int:
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
