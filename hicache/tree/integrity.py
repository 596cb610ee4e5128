"""``check_integrity``: a complete consistency check of a UnifiedRadixCache, and
``IntegrityWalker``, the same check a bounded slice at a time.

Tests call ``check_integrity`` after every step, and an operator may ask for it; it walks
the whole tree. The loops' idle check calls ``UnifiedRadixCache.check_integrity_slice``
instead: each call checks at most ``SLICE_UNITS`` (a node counts one, and one more per page
it holds) and resumes where the last one stopped, so no call between two engine steps walks
millions of pages. Every node a slice visits gets the node checks below; when a round (a
walk of every node) ends and the tree did not change since it began (``TreeCore.version``),
the totals are compared too. A round the traffic changed keeps its node checks and starts
again. What a round does not do is walk the LRU lists themselves (``EvictionPolicy.check``,
the exact membership of each order): it compares their sizes.

Both raise ``IntegrityError`` naming the first violated invariant:

* every allocator: ``free + used == capacity``; the pages the tree holds are used, never
  free, never held twice (and, with ``exact=True`` on an idle cache, are all the used ones);
* per component and tier: the counters equal the sums over the tree, evictable + protected
  == total, and the LRU order holds exactly the nodes with data in that tier;
* structure: parent/child links, page-aligned keys indexed by their first page, per-page
  fields one per page, FULL data on every non-root node (L1 or L2), L1 data closed under
  prefixes (a node with L1 FULL data has a parent with L1 FULL data).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.hashing import HASH_BYTES

if TYPE_CHECKING:
    from hicache.tree.cache import UnifiedRadixCache
    from hicache.tree.node import LruLink, TreeNode


class IntegrityError(AssertionError):
    """The cache's bookkeeping is inconsistent."""


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


SLICE_UNITS = 16384
"""What one ``check_integrity_slice`` call checks at most: nodes plus the pages they hold."""


class _Tally:
    """One walk's node checks and its sums, per component and tier (see the module doc)."""

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self.cache = cache
        self.core = cache.core
        n = len(cache.components)
        self.dev_total = [0] * n
        self.dev_prot = [0] * n
        self.host_total = [0] * n
        self.host_prot = [0] * n
        self.pages = [[0, 0] for _ in range(n)]  # pages held, per tier
        self.seen: list[tuple[set[int], set[int]]] = [(set(), set()) for _ in range(n)]
        self.members = [[0, 0] for _ in range(n)]  # nodes with data, per tier
        self.count = 0
        self.unwritten = 0
        self.host_by_root: dict[int, int] = {}

    def live(self, node: TreeNode) -> bool:
        """Whether ``node`` is still in the tree (a walk may hold a node removed since)."""
        if node.parent is not None:
            return True
        return self.core.roots.get(node.salt or "") is node

    def visit(self, node: TreeNode) -> int:
        """Check ``node`` and add it to the sums; returns the units it cost (1 + pages)."""
        core = self.core
        ps = self.cache.page_size
        if node.parent is None:
            if core.roots.get(node.salt or "") is not node:
                _fail("a parentless node is not a registered root")
            if node.root is not node:
                _fail(f"{node!r}: a root whose root is another node")
        else:
            self.count += 1
            if node.root is not node.parent.root:
                _fail(f"{node!r}: not in its parent's namespace root")
            if node.data[0].host_value is not None:
                self.host_by_root[id(node.root)] = (self.host_by_root.get(id(node.root), 0)
                                                    + len(node.data[0].host_value))
            k = node.key
            if not k or len(k) % ps:
                _fail(f"{node!r}: key is empty or not page-aligned")
            if node.parent.children.get(core.first_page(k, 0)) is not node:
                _fail(f"{node!r}: not indexed by its first page in its parent")
            full = node.data[0]
            if full.value is None and full.host_value is None:
                _fail(f"{node!r}: no FULL data on L1 or L2")
            if full.value is not None and node.parent.parent is not None and node.parent.data[0].value is None:
                _fail(f"{node!r}: L1 data under an L2-only parent")
            if node.hash_value is not None and len(node.hash_value) != len(k) // ps * HASH_BYTES:
                _fail(f"{node!r}: hash_value has the wrong length")
            if node.in_flight < 0:
                _fail(f"{node!r}: negative in_flight")
            if core.is_unwritten(node):
                if node not in core.unwritten:
                    _fail("FULL: the set of L1 nodes without an L2 copy is out of date")
                self.unwritten += 1
        for ch in node.children.values():
            if ch.parent is not node:
                _fail(f"{ch!r}: wrong parent link")
        if node.parent is None:
            return 1
        npages = len(node.key) // ps
        for c in self.cache.components:
            i = c.slot
            cd = node.data[i]
            if cd.lock_ref < 0 or cd.host_lock_ref < 0:
                _fail(f"{node!r}: negative lock count in {c.name}")
            for tier, val, total, prot, locked, alloc in (
                (0, cd.value, self.dev_total, self.dev_prot, cd.lock_ref, c.allocator),
                (1, cd.host_value, self.host_total, self.host_prot, cd.host_lock_ref, c.host_allocator),
            ):
                if val is None:
                    continue
                name = "L1" if tier == 0 else "L2"
                p = c.as_pages(val)
                if c.paged and len(p) != npages:
                    _fail(f"{node!r}: {c.name} holds {len(p)} pages for {npages} pages of key")
                if alloc is None:
                    _fail(f"{c.name}: {name} data without an {name} allocator")
                for page in p if alloc.checked else ():  # type: ignore[union-attr]
                    if alloc.is_free(page):  # type: ignore[union-attr]
                        _fail(f"{c.name} {name}: page {page} is held by the tree but free")
                self.pages[i][tier] += len(p)
                self.seen[i][tier].update(p)
                u = c.units(val)
                total[i] += u
                if locked:
                    prot[i] += u
                self.members[i][tier] += 1
        return 1 + npages

    def finish(self, exact: bool, walk_orders: bool) -> None:
        """The totals: counters, LRU orders, allocators (``exact``: no leak). ``walk_orders``:
        also walk each LRU order (its structure and exact membership)."""
        core = self.core
        if self.count != core.node_count:
            _fail(f"node_count {core.node_count} but {self.count} nodes in the tree")
        counted = {id(r): n for r, n in core.host_by_root.items() if n}
        if counted != self.host_by_root:
            _fail(f"L2 pages per namespace root {counted} but the tree sums to {self.host_by_root}")
        if self.unwritten != len(core.unwritten):
            _fail("FULL: the set of L1 nodes without an L2 copy is out of date")
        for c in self.cache.components:
            i = c.slot
            for name, got, want in (
                ("L1 total", core.dev_total[i], self.dev_total[i]),
                ("L1 protected", core.dev_prot[i], self.dev_prot[i]),
                ("L2 total", core.host_total[i], self.host_total[i]),
                ("L2 protected", core.host_prot[i], self.host_prot[i]),
            ):
                if got != want:
                    _fail(f"{c.name}: {name} counter {got} but the tree sums to {want}")
            for tier, policy in ((0, core.dev_lru[i]), (1, core.host_lru[i])):
                name = "L1" if tier == 0 else "L2"
                if walk_orders:
                    try:
                        policy.check()
                    except AssertionError as exc:
                        raise IntegrityError(f"{c.name} {name} order: {exc}") from exc
                    for link in policy.links():
                        if not self._holds(link, i, tier):
                            _fail(f"{c.name}: the {name} order does not hold exactly the nodes with {name} data")
                if len(policy) != self.members[i][tier]:
                    _fail(f"{c.name}: the {name} order does not hold exactly the nodes with {name} data")
            for tier, alloc in ((0, c.allocator), (1, c.host_allocator)):
                if alloc is None:
                    continue
                name = "L1" if tier == 0 else "L2"
                alloc.check()
                if alloc.free_count + alloc.used != alloc.capacity:
                    _fail(f"{c.name} {name}: free + used != capacity")
                npages = self.pages[i][tier]
                if len(self.seen[i][tier]) != npages:
                    _fail(f"{c.name} {name}: a page is held by two nodes")
                if npages > alloc.used:
                    _fail(f"{c.name} {name}: the tree holds more pages than are used")
                if exact and npages != alloc.used:
                    _fail(f"{c.name} {name}: {alloc.used - npages} used pages are not in the tree (leak)")

    def _holds(self, link: LruLink, i: int, tier: int) -> bool:
        """Whether ``link`` is the tier-``tier`` link of a live node with component ``i``'s data there."""
        owner = link.owner
        if owner is None or not self.live(owner):
            return False
        cd = owner.data[i]
        if tier == 0:
            return cd.value is not None and cd.dlink is link
        return cd.host_value is not None and cd.hlink is link


def check_integrity(cache: UnifiedRadixCache, exact: bool = False) -> None:
    """Raise ``IntegrityError`` on the first violated invariant, walking the whole tree and
    every LRU order. ``exact=True`` (for an idle cache: no request holds pages, no transfer
    is pending) also requires the used pages of every checked allocator to be exactly the
    pages the tree holds: no leak."""
    if exact and cache.tiers.open_transfers:
        _fail("exact check with transfers pending")
    tally = _Tally(cache)
    for node in cache.core.iter_nodes():
        tally.visit(node)
    tally.finish(exact, walk_orders=True)


class IntegrityWalker:
    """``check_integrity`` in bounded slices that resume where the last one stopped (see the
    module doc). One per cache (``UnifiedRadixCache.check_integrity_slice``)."""

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self.cache = cache
        self._stack: list[TreeNode] = []
        self._tally: _Tally | None = None
        self._version = -1
        self.rounds = 0
        """Rounds that ended with the totals compared (the tree unchanged throughout)."""

    def step(self, budget: int = SLICE_UNITS, exact: bool = False) -> bool:
        """Check up to ``budget`` units; True when this call ended a round on an unchanged
        tree and its totals matched (``exact``: no leak either, which needs an idle cache)."""
        core = self.cache.core
        for c in self.cache.components:  # cheap, whole-cache checks on every call
            i = c.slot
            if not 0 <= core.dev_prot[i] <= core.dev_total[i] or not 0 <= core.host_prot[i] <= core.host_total[i]:
                _fail(f"{c.name}: a counter is negative or protects more than its total")
            for alloc in (c.allocator, c.host_allocator):
                if alloc is not None and alloc.free_count + alloc.used != alloc.capacity:
                    _fail(f"{c.name}: free + used != capacity")
        if self._tally is None:
            self._tally = _Tally(self.cache)
            self._stack = list(core.roots.values())
            self._version = core.version
        tally, stack = self._tally, self._stack
        done = 0
        while stack and done < budget:
            node = stack.pop()
            if not tally.live(node):
                continue
            done += tally.visit(node)
            stack.extend(node.children.values())
        if stack:
            return False
        self._tally = None
        if core.version != self._version:
            return False  # the traffic changed the tree meanwhile: its sums mean nothing
        if exact and self.cache.tiers.open_transfers:
            _fail("exact check with transfers pending")
        tally.finish(exact, walk_orders=False)
        self.rounds += 1
        return True
