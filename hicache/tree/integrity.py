"""``check_integrity``: a cheap, complete consistency check of a UnifiedRadixCache.

Tests call it after every step; the scheduler calls it when idle. It raises
``IntegrityError`` naming the first violated invariant:

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

if TYPE_CHECKING:
    from hicache.tree.cache import UnifiedRadixCache


class IntegrityError(AssertionError):
    """The cache's bookkeeping is inconsistent."""


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


def check_integrity(cache: UnifiedRadixCache, exact: bool = False) -> None:
    """Raise ``IntegrityError`` on the first violated invariant. ``exact=True`` (for an idle
    cache: no request holds pages, no transfer is pending) also requires the used pages of
    every checked allocator to be exactly the pages the tree holds: no leak."""
    core = cache.core
    if exact and cache.tiers.open_transfers:
        _fail("exact check with transfers pending")
    ps = cache.page_size
    comps = cache.components
    nodes = core.iter_nodes()
    n_comp = len(comps)
    dev_total = [0] * n_comp
    dev_prot = [0] * n_comp
    host_total = [0] * n_comp
    host_prot = [0] * n_comp
    dev_pages: list[list[int]] = [[] for _ in comps]
    host_pages: list[list[int]] = [[] for _ in comps]
    in_dev: list[set[int]] = [set() for _ in comps]
    in_host: list[set[int]] = [set() for _ in comps]
    count = 0
    host_by_root: dict[int, int] = {}
    for node in nodes:
        if node.parent is None:
            if core.roots.get(node.salt or "") is not node:
                _fail("a parentless node is not a registered root")
            if node.root is not node:
                _fail(f"{node!r}: a root whose root is another node")
        else:
            count += 1
            if node.root is not node.parent.root:
                _fail(f"{node!r}: not in its parent's namespace root")
            if node.data[0].host_value is not None:
                host_by_root[id(node.root)] = host_by_root.get(id(node.root), 0) + len(node.data[0].host_value)
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
            if node.hash_value is not None and len(node.hash_value) != len(k) // ps:
                _fail(f"{node!r}: hash_value has the wrong length")
            if node.in_flight < 0:
                _fail(f"{node!r}: negative in_flight")
        for ch in node.children.values():
            if ch.parent is not node:
                _fail(f"{ch!r}: wrong parent link")
        if node.parent is None:
            continue
        npages = len(node.key) // ps
        for c in comps:
            i = c.slot
            cd = node.data[i]
            if cd.lock_ref < 0 or cd.host_lock_ref < 0:
                _fail(f"{node!r}: negative lock count in {c.name}")
            for val, tier_pages, total, prot, locked, member in (
                (cd.value, dev_pages, dev_total, dev_prot, cd.lock_ref, in_dev),
                (cd.host_value, host_pages, host_total, host_prot, cd.host_lock_ref, in_host),
            ):
                if val is None:
                    continue
                p = c.as_pages(val)
                if c.paged and len(p) != npages:
                    _fail(f"{node!r}: {c.name} holds {len(p)} pages for {npages} pages of key")
                tier_pages[i].extend(p)
                u = c.units(val)
                total[i] += u
                if locked:
                    prot[i] += u
                member[i].add(id(node))
    if count != core.node_count:
        _fail(f"node_count {core.node_count} but {count} nodes in the tree")
    counted = {id(r): n for r, n in core.host_by_root.items() if n}
    if counted != host_by_root:
        _fail(f"L2 pages per namespace root {counted} but the tree sums to {host_by_root}")
    for c in comps:
        i = c.slot
        for name, got, want in (
            ("L1 total", core.dev_total[i], dev_total[i]),
            ("L1 protected", core.dev_prot[i], dev_prot[i]),
            ("L2 total", core.host_total[i], host_total[i]),
            ("L2 protected", core.host_prot[i], host_prot[i]),
        ):
            if got != want:
                _fail(f"{c.name}: {name} counter {got} but the tree sums to {want}")
        for tier, policy, holders in (("L1", core.dev_lru[i], in_dev[i]), ("L2", core.host_lru[i], in_host[i])):
            try:
                policy.check()
            except AssertionError as exc:
                raise IntegrityError(f"{c.name} {tier} order: {exc}") from exc
            ids = [id(link.owner) for link in policy.links()]
            if len(ids) != len(holders) or set(ids) != holders:
                _fail(f"{c.name}: the {tier} order does not hold exactly the nodes with {tier} data")
        if i == 0:
            want_unwritten = {id(n) for n in core.iter_nodes() if n.parent is not None and core.is_unwritten(n)}
            if {id(n) for n in core.unwritten} != want_unwritten or len(core.unwritten) != len(want_unwritten):
                _fail(f"{c.name}: the set of L1 nodes without an L2 copy is out of date")
        for tier, alloc, pages in (("L1", c.allocator, dev_pages[i]), ("L2", c.host_allocator, host_pages[i])):
            if alloc is None:
                if pages:
                    _fail(f"{c.name}: {tier} data without an {tier} allocator")
                continue
            alloc.check()
            if alloc.free_count + alloc.used != alloc.capacity:
                _fail(f"{c.name} {tier}: free + used != capacity")
            if len(set(pages)) != len(pages):
                _fail(f"{c.name} {tier}: a page is held by two nodes")
            for page in pages if alloc.checked else ():
                if alloc.is_free(page):
                    _fail(f"{c.name} {tier}: page {page} is held by the tree but free")
            if len(pages) > alloc.used:
                _fail(f"{c.name} {tier}: the tree holds more pages than are used")
            if exact and len(pages) != alloc.used:
                _fail(f"{c.name} {tier}: {alloc.used - len(pages)} used pages are not in the tree (leak)")
