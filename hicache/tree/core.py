"""TreeCore: the pure radix tree (docs/architecture.md §4). It never touches an allocator or a pool.

It owns the nodes, one root per ``cache_salt`` (the key space is per salt: two tenants never
share a node, and each root starts its own page-hash chain from its salted namespace seed),
matching with the seed's fixed split rule, splitting, node creation and deletion, and for
every component the L1 and L2 eviction orders and size counters.

Counters, per component ``i`` and per tier, in the component's units (pages for FULL/SWA,
states for MAMBA):

| counter          | what it sums                                                  |
|------------------|---------------------------------------------------------------|
| ``dev_total[i]`` | units of every non-None ``value``                             |
| ``dev_prot[i]``  | the same, restricted to nodes with ``lock_ref > 0``           |
| ``host_total[i]``| units of every non-None ``host_value``                        |
| ``host_prot[i]`` | the same, restricted to nodes with ``host_lock_ref > 0``      |

evictable = total - protected, so "evictable + protected = total" holds by construction;
``check_integrity`` recomputes all four from the tree. Every mutation of ``value``,
``host_value``, ``lock_ref`` and ``host_lock_ref`` goes through the methods below, which keep
the counters and the LRU membership (a node is in a component's L1 order iff it has that
component's ``value``, in its L2 order iff it has its ``host_value``) in step.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from hicache.hashing import HASH_BYTES
from hicache.tree.content import ContentObserver, Tier
from hicache.tree.node import KEY_ITEMSIZE, KEY_TYPECODE, ComponentData, Key, LruLink, TreeNode
from hicache.tree.policy import EvictionPolicy


class TreeCore:
    """Nodes, matching, splitting, LRU orders and counters for ``n`` components."""

    def __init__(
        self,
        page_size: int,
        n_components: int,
        unit_counts: Sequence[Callable[[Any], int]],
        split_hooks: Sequence[Callable[[ComponentData, ComponentData, int], None]],
        make_policy: Callable[[], EvictionPolicy],
        written: Sequence[bool] | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.n = n_components
        self.units = list(unit_counts)
        self._split_hooks = list(split_hooks)
        self.roots: dict[str, TreeNode] = {}
        self.dev_lru: list[EvictionPolicy] = [make_policy() for _ in range(n_components)]
        self.host_lru: list[EvictionPolicy] = [make_policy() for _ in range(n_components)]
        self.dev_total = [0] * n_components
        self.dev_prot = [0] * n_components
        self.host_total = [0] * n_components
        self.host_prot = [0] * n_components
        self.tick = 0
        self.node_count = 0
        self.shape_version = 0
        """Counts the changes of the tree's shape (a split, a removed node): a path walked when it
        had this value is still a path of the tree while it has."""
        self.version = 0
        """Counts every change of what the integrity check sums (data, locks, nodes): an
        incremental check whose round saw one value throughout saw one tree."""
        # ``written[i]``: component i has an L2 tier, so its L1-only data waits for a write
        # (default: FULL only)
        self._written = [bool(w) for w in written] if written is not None else [True] + [False] * (n_components - 1)
        if len(self._written) != n_components or not self._written[0]:
            raise ValueError("written: one flag per component, and FULL's must be set")
        self._aux_written = any(self._written[1:])
        # nodes with data in L1 but not in L2 of some ``written`` component (FULL's, or an
        # auxiliary one's on a node whose FULL pages are in L2 already), in the order they
        # got there: what the write-through policies copy to L2 (kept by set/clear_value,
        # set/clear_host and split, so finding them never scans L1)
        self.unwritten: dict[TreeNode, None] = {}
        # told of every change of the Full pages L1 and L2 hold (``hicache.tree.content``)
        self.observer: ContentObserver | None = None
        # Full L2 pages per namespace root (``TreeNode.root``), for per-tenant quotas
        self.host_by_root: dict[TreeNode, int] = {}

    # ------------------------------------------------------------------ structure
    def root(self, salt: str) -> TreeNode | None:
        """``salt``'s root, None when nothing was ever inserted under it."""
        return self.roots.get(salt)

    def ensure_root(self, salt: str) -> TreeNode:
        """``salt``'s root, created (holding every component's data, locked) if needed."""
        r = self.roots.get(salt)
        if r is None:
            r = TreeNode(None, array(KEY_TYPECODE), self.n)
            r.salt = salt
            self.version += 1
            for cd in r.data:  # the root holds "data" for every component and is never evicted
                cd.value = []
                cd.lock_ref = 1
            self.roots[salt] = r
        return r

    def first_page(self, key: Key, off: int) -> Any:
        """The children-dict key of the page at ``off``: the token id itself when pages are
        one token, else the page's raw bytes (C-level slice + copy, hashable)."""
        ps = self.page_size
        return key[off] if ps == 1 else key[off:off + ps].tobytes()

    def common_tokens(self, key: Key, off: int, ckey: Key, n: int) -> int:
        """Tokens (a multiple of the page size) that ``key[off:n]`` shares with ``ckey``,
        knowing the first page is shared and the whole edge is not. Bisection over pages
        with C-level slice comparisons: no per-token Python loop."""
        ps = self.page_size
        lo = 1  # pages known equal
        hi = min(len(ckey), n - off) // ps  # pages that might be equal
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t = mid * ps
            if key[off:off + t] == ckey[:t]:
                lo = mid
            else:
                hi = mid - 1
        return lo * ps

    def walk(self, root: TreeNode, key: Key, n: int) -> list[TreeNode]:
        """The nodes matching ``key[:n]`` (``n`` page-aligned) from ``root``.

        Follows whole edges; where the key forks inside an edge (or ends inside it) the
        node is split at the fork and the walk **stops** there (the seed's fixed rule: it
        never compares the rest of the key against grandchildren past a fork).
        """
        path: list[TreeNode] = []
        node = root
        off = 0
        ps = self.page_size
        kb = key.tobytes()  # one copy; an edge is then compared in place (``startswith``), not sliced
        page_bytes = ps * KEY_ITEMSIZE
        while off < n:
            at = off * KEY_ITEMSIZE
            child = node.children.get(key[off] if ps == 1 else kb[at:at + page_bytes])
            if child is None:
                break
            ckey = child.key
            end = off + len(ckey)
            if end <= n and kb.startswith(ckey, at):
                path.append(child)
                off = end
                node = child
                continue
            path.append(self.split(child, self.common_tokens(key, off, ckey, n)))
            break
        return path

    def split(self, node: TreeNode, ntok: int) -> TreeNode:
        """Split ``node`` after ``ntok`` tokens; returns the new upper node.

        The original object keeps the lower part (so a request holding it as ``last_node``
        still holds the deepest node). Per component, ``split_hooks`` divides the data;
        the core copies ``in_flight``/``loading``, splits ``hash_value`` and keeps
        ``hit_count`` / ``last_access_time``. Counters are unchanged (units only move).
        """
        ps = self.page_size
        if ntok <= 0 or ntok >= len(node.key) or ntok % ps:
            raise ValueError(f"bad split at {ntok} of {len(node.key)} tokens")
        parent = node.parent
        upper = TreeNode(parent, node.key[:ntok], self.n)
        self.version += 1
        self.node_count += 1
        self.shape_version += 1
        pages = ntok // ps
        upper.hit_count = node.hit_count
        upper.last_access_time = node.last_access_time
        upper.host_time = node.host_time
        upper.in_flight = node.in_flight
        upper.loading = node.loading
        if node.hash_value is not None:
            cut = pages * HASH_BYTES
            upper.hash_value = node.hash_value[:cut]
            node.hash_value = node.hash_value[cut:]
        first = self.first_page(node.key, 0)
        node.key = node.key[ntok:]
        upper.children[self.first_page(node.key, 0)] = node
        node.parent = upper
        parent.children[first] = upper  # type: ignore[union-attr]
        for i in range(self.n):
            lower_cd, upper_cd = node.data[i], upper.data[i]
            self._split_hooks[i](upper_cd, lower_cd, pages)
            # the upper part sits just before the lower one in every order (it is older)
            if upper_cd.value is not None:
                self._insert_before(self.dev_lru[i], upper_cd.dlink, lower_cd.dlink)
            if upper_cd.host_value is not None:
                self._insert_before(self.host_lru[i], upper_cd.hlink, lower_cd.hlink)
        if self._aux_written:  # the parts' auxiliary data may differ (e.g. an SWA window)
            self._retrack(upper)
            self._retrack(node)
        elif node in self.unwritten:
            self.unwritten[upper] = None
        return upper

    @staticmethod
    def _insert_before(policy: EvictionPolicy, link: Any, anchor: Any) -> None:
        # policies expose add(); placing before the anchor keeps "parent older than child"
        # for the plain LRU list, and is the same as add() otherwise.
        lst = getattr(policy, "_list", None)
        if lst is not None and anchor.prev is not None:
            prev = anchor.prev
            link.prev, link.next = prev, anchor
            prev.next = link
            anchor.prev = link
            lst.size += 1
        else:
            policy.add(link)

    def new_child(self, parent: TreeNode, key: Key) -> TreeNode:
        node = TreeNode(parent, key, self.n)
        parent.children[self.first_page(key, 0)] = node
        self.version += 1
        self.node_count += 1
        return node

    def extend(self, node: TreeNode, key: Key, pages: Any) -> None:
        """Append ``key`` (page-aligned) and its FULL L1 ``pages`` (one per page, taken over)
        to the leaf ``node`` in place, for a request that grows the only leaf it uses (the
        caller checked that no other component's data, no L2 copy, no page hash, no
        transfer and no other lock is on it). Counters follow; the LRU order is the
        caller's ``touch``."""
        if self.observer is not None:  # its calls name whole nodes (``UnifiedRadixCache._extendable``)
            raise RuntimeError("extend: a content observer is installed")
        self.version += 1
        cd = node.data[0]
        node.key.extend(key)
        cd.value.extend(pages)
        u = len(pages)
        self.dev_total[0] += u
        if cd.lock_ref:
            self.dev_prot[0] += u

    def detach(self, node: TreeNode) -> None:
        """Remove a childless node whose data has all been cleared. It keeps no reference
        cycle (its LRU links forget it), so it needs no garbage collection (``hicache.runtime.gc_guard``)."""
        if node.children:
            raise ValueError("only a leaf can be deleted")
        for cd in node.data:
            if cd.value is not None or cd.host_value is not None:
                raise ValueError("clear a node's data before deleting it")
        del node.parent.children[self.first_page(node.key, 0)]  # type: ignore[union-attr]
        node.parent = None
        self.version += 1
        for cd in node.data:  # no cycle left through its links: reference counting frees it
            cd.dlink.owner = cd.hlink.owner = None
        self.node_count -= 1
        self.shape_version += 1

    # ------------------------------------------------------------------ data
    def set_value(self, node: TreeNode, i: int, value: Any) -> None:
        self.version += 1
        cd = node.data[i]
        if cd.value is not None:
            raise ValueError("component value already set")
        cd.value = value
        u = self.units[i](value)
        self.dev_total[i] += u
        if cd.lock_ref:
            self.dev_prot[i] += u
        self.dev_lru[i].add(cd.dlink)
        if i == 0:
            self.tick += 1
            node.last_access_time = self.tick
        if cd.host_value is None and self._written[i]:
            self.unwritten[node] = None
        if i == 0 and self.observer is not None and not node.loading:  # a load-back: at its finish
            self.observer.pages_added(node, Tier.DEVICE)

    def clear_value(self, node: TreeNode, i: int) -> Any:
        self.version += 1
        cd = node.data[i]
        value = cd.value
        if value is None:
            return None
        if i == 0 and self.observer is not None and not node.loading:  # never announced
            self.observer.pages_dropped(node, Tier.DEVICE)
        u = self.units[i](value)
        self.dev_total[i] -= u
        if cd.lock_ref:
            self.dev_prot[i] -= u
        self.dev_lru[i].remove(cd.dlink)
        cd.value = None
        if self._aux_written:
            self._retrack(node)
        elif i == 0:
            self.unwritten.pop(node, None)
        return value

    def set_host(self, node: TreeNode, i: int, host_value: Any) -> None:
        self.version += 1
        cd = node.data[i]
        if cd.host_value is not None:
            raise ValueError("component host value already set")
        cd.host_value = host_value
        u = self.units[i](host_value)
        self.host_total[i] += u
        if cd.host_lock_ref:
            self.host_prot[i] += u
        self.host_lru[i].add(cd.hlink)
        if i == 0:
            self.tick += 1
            node.host_time = self.tick
            self.host_by_root[node.root] = self.host_by_root.get(node.root, 0) + u
        if self._aux_written:
            self._retrack(node)
        elif i == 0:
            self.unwritten.pop(node, None)
        if i == 0 and self.observer is not None:
            self.observer.pages_added(node, Tier.HOST)

    def clear_host(self, node: TreeNode, i: int) -> Any:
        self.version += 1
        cd = node.data[i]
        hv = cd.host_value
        if hv is None:
            return None
        if i == 0 and self.observer is not None:
            self.observer.pages_dropped(node, Tier.HOST)
        u = self.units[i](hv)
        self.host_total[i] -= u
        if i == 0:
            self.host_by_root[node.root] -= u
        if cd.host_lock_ref:
            self.host_prot[i] -= u
        self.host_lru[i].remove(cd.hlink)
        cd.host_value = None
        if cd.value is not None and self._written[i]:
            self.unwritten[node] = None
        return hv

    def is_unwritten(self, node: TreeNode) -> bool:
        """Whether some ``written`` component of ``node`` has data in L1 but not in L2."""
        return any(w and cd.value is not None and cd.host_value is None
                   for w, cd in zip(self._written, node.data, strict=True))

    def _retrack(self, node: TreeNode) -> None:
        """Put ``node`` in ``unwritten`` or take it out, by ``is_unwritten`` (a node already
        there keeps its place)."""
        if self.is_unwritten(node):
            if node not in self.unwritten:
                self.unwritten[node] = None
        else:
            self.unwritten.pop(node, None)

    def lock(self, node: TreeNode, i: int) -> None:
        self.version += 1
        cd = node.data[i]
        if cd.lock_ref == 0 and cd.value is not None:
            self.dev_prot[i] += self.units[i](cd.value)
        cd.lock_ref += 1

    def unlock(self, node: TreeNode, i: int) -> None:
        self.version += 1
        cd = node.data[i]
        if cd.lock_ref <= 0:
            raise ValueError(f"lock_ref of {node!r} would go below zero")
        cd.lock_ref -= 1
        if cd.lock_ref == 0 and cd.value is not None:
            self.dev_prot[i] -= self.units[i](cd.value)

    def host_lock(self, node: TreeNode, i: int) -> None:
        self.version += 1
        cd = node.data[i]
        if cd.host_lock_ref == 0 and cd.host_value is not None:
            self.host_prot[i] += self.units[i](cd.host_value)
        cd.host_lock_ref += 1

    def host_unlock(self, node: TreeNode, i: int) -> None:
        self.version += 1
        cd = node.data[i]
        if cd.host_lock_ref <= 0:
            raise ValueError(f"host_lock_ref of {node!r} would go below zero")
        cd.host_lock_ref -= 1
        if cd.host_lock_ref == 0 and cd.host_value is not None:
            self.host_prot[i] -= self.units[i](cd.host_value)

    def touch(self, path: Sequence[TreeNode]) -> None:
        """Mark ``path`` (root side first) as just used: increasing access times, so a
        parent is older than its child, and each node to the MRU end of every order that
        holds it. With the LRU policy, the FULL L1 order is therefore sorted by
        ``last_access_time`` and the FULL L2 order by ``host_time`` (ties: a split's upper
        part sits first), which eviction relies on when it follows a parent. Each order is
        touched in one call (``EvictionPolicy.touch_all``), in path order."""
        t = self.tick
        if self.n == 1:  # FULL only: the common case, without the per-component lists
            dlinks: list[LruLink] = []
            hlinks: list[LruLink] = []
            dlink, hlink = dlinks.append, hlinks.append
            for node in path:
                t += 1
                node.last_access_time = node.host_time = t
                cd = node.data[0]
                if cd.value is not None:
                    dlink(cd.dlink)
                if cd.host_value is not None:
                    hlink(cd.hlink)
            self.tick = t
            if dlinks:
                self.dev_lru[0].touch_all(dlinks)
            if hlinks:
                self.host_lru[0].touch_all(hlinks)
            return
        dlists: list[list[LruLink]] = [[] for _ in range(self.n)]
        hlists: list[list[LruLink]] = [[] for _ in range(self.n)]
        for node in path:
            t += 1
            node.last_access_time = node.host_time = t
            for cd, dl, hl in zip(node.data, dlists, hlists, strict=True):
                if cd.value is not None:
                    dl.append(cd.dlink)
                if cd.host_value is not None:
                    hl.append(cd.hlink)
        self.tick = t
        for i in range(self.n):
            if dlists[i]:
                self.dev_lru[i].touch_all(dlists[i])
            if hlists[i]:
                self.host_lru[i].touch_all(hlists[i])

    def iter_nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
