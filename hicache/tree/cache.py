"""UnifiedRadixCache: the layer the scheduler calls (docs/architecture.md §4, node state of §5).

The tree decides; this class executes the decisions against the index allocators it was
given (one L1 allocator per component, plus one L2 allocator per component when L2 is on).
It never touches KV bytes: the tier-facing calls return *which* pages to copy, and the
cache controller (another process) copies them and acknowledges.

Ownership of page indices (Full component; SWA behaves alike, Mamba with one slot):

| step                                   | freed                         | kept / taken by the tree      | locked meanwhile                |
|----------------------------------------|-------------------------------|-------------------------------|---------------------------------|
| ``match_prefix``                       | -                             | -                             | - (caller locks what it uses)   |
| ``insert(key, value, prev_prefix_len)``| nothing; caller frees         | ``value[prefix_len:]`` pages; | -                               |
|                                        | ``value[prev:prefix_len]``    | pages re-filling L2-only nodes|                                 |
| ``insert_with`` SWA/Mamba values       | duplicates freed here         | the rest                      | -                               |
| ``evict`` (L1)                         | L1 pages of evicted nodes     | L2 copies (node -> L2-only)   | locked / in-flight nodes skipped|
| ``evict_host`` (L2)                    | L2 pages of L2-only leaves    | -                             | host-locked nodes skipped       |
| ``start_write`` -> write ``TierOp``    | L2 evicted if needed          | new L2 pages reserved         | node L1-locked (path), in flight|
| ``finish_write(op, ok=True)``          | -                             | L2 pages become ``host_value``| released                        |
| ``finish_write(op, ok=False)``         | the reserved L2 pages         | node exactly as before        | released                        |
| ``start_load_back`` -> load ``TierOp`` | L1 evicted if needed          | new L1 pages set as ``value``,| path L1-locked, nodes host-     |
|                                        |                               | nodes marked ``loading``      | locked, in flight               |
| ``finish_load_back(op, ok=True)``      | -                             | L1 pages now readable         | released                        |
| ``finish_load_back(op, ok=False)``     | the new L1 pages              | nodes L2-only as before       | released                        |
| ``insert`` through a loading node      | the op's pages, at its finish | the request's own pages       | (the op's locks stay)           |
| ``start_backup`` -> backup ``TierOp``  | -                             | -                             | node host-locked, in flight     |
| ``finish_backup(op, ok)``              | -                             | - (L3 residency is not stored)| released                        |
| ``insert_host`` (prefetched pages)     | duplicate L2 pages            | the rest, as L2-only nodes    | -                               |

``TierOp.transfers[component] = (src_pages, dst_pages)`` in key order: device -> host for a
write, host -> device for a load; a backup carries the host pages and ``hashes``.

In-flight transfers: the tree owns what a ``TierOp`` holds (its reserved pages, its locks,
the nodes' ``in_flight`` / ``loading`` marks) and releases it in ``finish_*``; it keeps no
table of ops and gives them no id. Whoever starts an op keeps it and must hand it to its
``finish_*`` exactly once (a second finish raises ``ValueError``); with a controller that is
``hicache.tier_manager.TierManager``, whose registry holds every op in flight under the one
op id the controller sees, and which fails them all when the controller is lost. The tree
only counts them (``open_transfers``), so that the exact integrity check can refuse to run
while pages are reserved for a transfer. An operation records its last node and its page
count; if a node is split while an op is in flight, the op's pages span the lower node and
its new parent(s), and ``finish_*`` walks up from the recorded node over exactly that many
pages, so splitting never strands a lock.

Keys: a key is a sequence of token ids, best an ``array('I')`` (any other sequence is
converted, which costs a C-level pass over it); a tail shorter than a page is ignored.
The key space is per ``cache_salt``: every salt has its own root (created by its first
insert) and its own page-hash chain, so tenants never share a node or an L3 page. Page
indices are of the kind the allocators hand out (``list[int]`` by default, ``array('q')``
with ``array_indices=True``); all allocators of one cache must agree.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.hashing import HashNamespace, PageHasher
from hicache.memory.allocator import PageIndices
from hicache.tree.components import FullComponent, MambaComponent, SWAComponent, TreeComponent
from hicache.tree.core import TreeCore
from hicache.tree.node import KEY_TYPECODE, ComponentData, ComponentType, Key, TreeNode
from hicache.tree.policy import make_policy

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices``: FULL L1 pages of the valid device prefix (``device_len`` tokens).
    ``last_device_node``: the node ending that prefix (a root when nothing matched).
    ``host_hit_length``: tokens after it that are L2-only, ending at ``last_host_node``.
    ``mamba_slot``: the request's own state slot (copy-on-write of ``mamba_cow_src``).
    """

    device_indices: PageIndices
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int = 0
    device_len: int = 0
    mamba_slot: int | None = None
    mamba_cow_src: int | None = None


@dataclass
class InsertResult:
    """``prefix_len``: tokens already on L1 before the insert (the caller frees its pages
    ``[prev_prefix_len, prefix_len)``); ``node``: the node ending the key;
    ``mamba_exist``: the end node already had a state (the given one was freed)."""

    prefix_len: int
    node: TreeNode
    mamba_exist: bool = False
    host_pages_taken: int = 0


@dataclass
class EvictResult:
    full_tokens: int = 0
    swa_tokens: int = 0
    mamba_states: int = 0
    host_tokens: int = 0


@dataclass
class LockToken:
    """Returned by ``inc_lock_ref``; pass it back to ``dec_lock_ref``."""

    node: TreeNode
    parts: tuple[Any, ...]


@dataclass(frozen=True)
class InsertParams:
    """Everything ``UnifiedRadixCache.insert_with`` takes (see there for who owns what).

    ``key``: token ids (page-aligned part used); ``value``: FULL L1 pages, one per page of
    the key; ``prev_prefix_len``: the first tokens whose pages are already the tree's (the
    request's match); ``swa_value``: SWA pages from ``swa_start_page`` on; ``swa_prefix_len``:
    the tokens whose SWA pages are the tree's (None: ``prev_prefix_len``); ``mamba_value``:
    the state slot after the key's last token.
    """

    key: Sequence[int]
    value: Sequence[int]
    cache_salt: str = ""
    prev_prefix_len: int = 0
    swa_value: Sequence[int] | None = None
    swa_start_page: int = 0
    swa_prefix_len: int | None = None
    mamba_value: int | None = None


@dataclass
class TierOp:
    """An in-flight transfer, from its ``start_*`` to its ``finish_*`` (exactly once).

    ``kind``: ``write``, ``load`` or ``backup``; ``node`` / ``npages``: the lowest node it
    covers and its page count (the span survives splits);
    ``transfers[component] = (src_pages, dst_pages)``; ``hashes``: a backup's page hashes;
    ``done``: finished. It has no id: the tier layer files it under its controller op id.
    """

    kind: str
    node: TreeNode
    npages: int
    transfers: dict[str, tuple[list[int], list[int]]]
    hashes: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def src_pages(self) -> list[int]:
        return self.transfers["full"][0]

    @property
    def dst_pages(self) -> list[int]:
        return self.transfers["full"][1]


@dataclass
class RequestState:
    """The fields of a request that ``cache_finished_req`` / ``cache_unfinished_req`` use.

    ``kv_pages``: the request's FULL L1 pages, one per (possibly partial) page of its
    computed tokens; the first ``prefix_len // page_size`` are the tree's (from the match).
    ``swa_pages`` covers pages from ``swa_start_page`` on (earlier ones were released); the
    first ``swa_prefix_len`` tokens' SWA pages are the tree's (from the match; chunked
    prefill inserts FULL pages only, so it leaves this unchanged).
    """

    token_ids: list[int]
    kv_pages: list[int]
    cache_salt: str = ""
    prefix_len: int = 0
    last_node: TreeNode | None = None
    lock: LockToken | None = None
    swa_pages: list[int] | None = None
    swa_start_page: int = 0
    swa_prefix_len: int = 0
    mamba_slot: int | None = None


class UnifiedRadixCache:
    """One radix tree over FULL (+ SWA or MAMBA) data, with L1 and optional L2 state.

    ``components``: FULL first, then optionally one SWAComponent or MambaComponent; a
    component built with a ``host_allocator`` has L2 state (L2 is on when FULL has one).
    ``hasher``: a ``PageHasher`` or ``HashNamespace`` for page hashes (computed lazily, on
    the tier path only; other salts derive from it with ``with_salt``).
    ``eviction_policy``: ``lru`` (default) or ``slru``. ``write_policy``: ``write_through``,
    ``write_through_selective`` (``hit_count >= write_through_threshold``) or ``write_back``.

    Scheduler calls: ``match_prefix``, ``inc_lock_ref`` / ``dec_lock_ref``, ``insert`` /
    ``insert_with``,
    ``evict``, ``cache_finished_req``, ``cache_unfinished_req``, ``evictable_size`` /
    ``protected_size`` / ``total_size``, ``flush``, ``check_integrity``.
    Tier calls (see the module table): ``nodes_to_write_to_host``, ``start_write`` /
    ``finish_write``, ``start_load_back`` / ``finish_load_back``, ``start_backup`` /
    ``finish_backup``, ``evict_host``, ``protect_host`` / ``release_host``, ``insert_host``,
    ``node_hashes`` / ``last_page_hash``, ``open_transfers``.
    Not thread-safe: only the scheduler's loop calls it.
    """

    def __init__(
        self,
        components: Sequence[TreeComponent],
        page_size: int = 1,
        *,
        hasher: PageHasher | HashNamespace | None = None,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
        write_through_threshold: int = 2,
    ) -> None:
        comps = list(components)
        if not comps or not isinstance(comps[0], FullComponent):
            raise ValueError("the first component must be a FullComponent")
        if len({type(c) for c in comps}) != len(comps):
            raise ValueError("each component kind may appear once")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        for i, c in enumerate(comps):
            if c.slot not in (-1, i):
                raise ValueError("a component instance can serve only one cache")
            c.slot = i
        self.components = comps
        self.page_size = page_size
        self.full = comps[0]
        self.aux = comps[1:]
        self._by_type = {c.ctype: c for c in comps}
        self.mamba: MambaComponent | None = next((c for c in comps if isinstance(c, MambaComponent)), None)
        self.swa: SWAComponent | None = next((c for c in comps if isinstance(c, SWAComponent)), None)
        self.eviction_policy = eviction_policy
        make_policy(eviction_policy)  # validate the name now
        self.core = TreeCore(page_size, len(comps), [c.units for c in comps], [c.split for c in comps],
                             lambda: make_policy(eviction_policy))
        if isinstance(hasher, HashNamespace):
            hasher = PageHasher(hasher)
        if hasher is not None and hasher.page_size != page_size:
            raise ValueError("the hasher's page size differs from the cache's")
        self._hasher = hasher
        self._hashers: dict[str, PageHasher] = {}
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.hicache = self.full.host_allocator is not None
        self._write_back_queue: dict[TreeNode, None] = {}
        self._open_transfers = 0  # TierOps started and not finished (their owner keeps them)
        self.evicted_device_tokens = 0  # monotonic: FULL tokens freed from L1 / L2 by eviction
        self.evicted_host_tokens = 0
        self._empty = self.full.allocator.empty
        # what a match under an unknown salt returns as its node: locking it is a no-op
        self._void_root = TreeNode(None, array(KEY_TYPECODE), len(comps))

    # ================================================================== helpers
    def _aligned(self, key: Sequence[int]) -> tuple[Key, int]:
        """The key as ``array('I')`` (not copied when it already is one) and its
        page-aligned length. Token ids outside ``[0, 2**32)`` are refused."""
        if type(key) is not array or key.typecode != KEY_TYPECODE:  # type: ignore[attr-defined]
            try:
                key = array(KEY_TYPECODE, key)
            except (OverflowError, TypeError) as exc:
                raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
        n = len(key)
        return key, n - n % self.page_size  # type: ignore[return-value]

    def _npages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_size

    def _op_nodes(self, node: TreeNode, npages: int) -> list[TreeNode]:
        """Nodes from ``node`` upward spanning exactly ``npages`` pages (lowest first)."""
        out = []
        while npages > 0:
            if node is None or node.parent is None:
                raise RuntimeError("in-flight operation lost its nodes")
            out.append(node)
            npages -= self._npages(node)
            node = node.parent
        if npages:
            raise RuntimeError("in-flight operation does not end on a node boundary")
        return out

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

    # ================================================================== match
    def match_prefix(self, key: Sequence[int], cache_salt: str = "", *, cow_mamba: bool = True) -> MatchResult:
        """Longest cached prefix of ``key`` valid for every component.

        Splits a node where the key forks inside it and stops there. Refreshes the matched
        path (access times, every LRU order, ``hit_count``). With a Mamba component and a
        non-empty match, allocates the request's own state slot and copies the matched
        state into it (copy-on-write); if no slot can be had, the match is empty.
        """
        core = self.core
        root = core.root(cache_salt, create=False)
        if root is None:  # nothing cached under this salt (its root comes with the first insert)
            return MatchResult(self._empty(), self._void_root, self._void_root)
        key, n = self._aligned(key)
        path = core.walk(root, key, n)
        if not path:
            return MatchResult(self._empty(), root, root)
        ndev = 0
        for node in path:
            if node.data[0].value is None or node.loading:
                break
            ndev += 1
        best = ndev
        if self.aux and ndev:
            validators = [c.new_validator() for c in self.aux]
            best = 0
            for j in range(ndev):
                node = path[j]
                ok = True
                for v in validators:
                    if v is not None and not v(node):
                        ok = False
                if ok:
                    best = j + 1
        for node in path:
            node.hit_count += 1
        core.touch(path)
        if best == 0:
            indices = self._empty()
        else:
            indices = path[0].data[0].value[:]  # a copy, of the allocator's index kind
            for j in range(1, best):
                indices.extend(path[j].data[0].value)
        last_dev = path[best - 1] if best else root
        res = MatchResult(indices, last_dev, last_dev, 0, len(indices) * self.page_size)
        if best == ndev and ndev < len(path):
            host_len = 0
            last_host = last_dev
            for node in path[ndev:]:
                if node.loading or node.data[0].host_value is None:
                    break
                host_len += len(node.key)
                last_host = node
            res.host_hit_length, res.last_host_node = host_len, last_host
        if self.mamba is not None and best and cow_mamba:
            self._mamba_cow(res)
        return res

    def _mamba_cow(self, res: MatchResult) -> None:
        m = self.mamba
        node = res.last_device_node
        src = node.data[m.slot].value  # type: ignore[union-attr]
        self.core.lock(node, m.slot)  # type: ignore[union-attr]
        try:
            dst = m.allocator.alloc(1)  # type: ignore[union-attr]
            if dst is None:
                self.evict(mamba_states=1)
                dst = m.allocator.alloc(1)  # type: ignore[union-attr]
        finally:
            self.core.unlock(node, m.slot)  # type: ignore[union-attr]
        if dst is None:
            root = self.core.root(self._salt_of(node), create=False) or self._void_root
            res.device_indices, res.last_device_node, res.last_host_node = self._empty(), root, root
            res.device_len = res.host_hit_length = 0
            return
        if m.copy_state is not None:  # type: ignore[union-attr]
            m.copy_state(src, dst[0])  # type: ignore[union-attr]
        res.mamba_slot, res.mamba_cow_src = dst[0], src

    @staticmethod
    def _salt_of(node: TreeNode) -> str:
        while node.parent is not None:
            node = node.parent
        return node.salt or ""

    # ================================================================== insert
    def insert(self, key: Sequence[int], value: Sequence[int], cache_salt: str = "", *,
               prev_prefix_len: int = 0) -> InsertResult:
        """Insert ``key`` with FULL L1 pages ``value`` only: ``insert_with`` of
        ``InsertParams(key, value, cache_salt, prev_prefix_len)`` (same contract), without
        building the parameter object."""
        return self._insert(key, value, cache_salt, prev_prefix_len, None)

    def insert_with(self, p: InsertParams) -> InsertResult:
        """Insert ``p.key`` (page-aligned part) with FULL L1 pages ``p.value`` (one per page).

        Returns ``prefix_len``, the tokens already on L1: the caller frees its pages
        ``value[prev_prefix_len // page_size : prefix_len // page_size]`` (its first
        ``prev_prefix_len`` tokens are the tree's own pages, from its match). Pages after
        ``prefix_len`` belong to the tree from now on, including those that re-fill L2-only
        nodes. ``swa_value`` (pages from ``swa_start_page`` on) and ``mamba_value`` (the state
        after the key's last token) are taken over entirely: kept, or freed here when the
        tree already holds them. SWA tombstones covered by the request's SWA pages are
        recovered (split at ``swa_start_page`` when it falls inside a node). The request's
        SWA pages before ``swa_prefix_len`` tokens (default ``prev_prefix_len``) are the
        tree's own and are neither stored nor freed.
        """
        return self._insert(p.key, p.value, p.cache_salt, p.prev_prefix_len, p)

    def _insert(self, key: Sequence[int], value: Sequence[int], cache_salt: str, prev_prefix_len: int,
                p: InsertParams | None) -> InsertResult:
        """The body of ``insert`` / ``insert_with``; ``p`` None: no SWA or Mamba values."""
        swa_value, swa_start_page, swa_prefix_len, mamba_value = (
            (None, 0, None, None) if p is None else (p.swa_value, p.swa_start_page, p.swa_prefix_len, p.mamba_value))
        core = self.core
        ps = self.page_size
        key, n = self._aligned(key)
        npages = n // ps
        if len(value) < npages:
            raise ValueError(f"insert: {len(value)} pages given for {npages} pages of key")
        if prev_prefix_len % ps or prev_prefix_len > n:
            raise ValueError("prev_prefix_len must be page-aligned and within the key")
        swa = self.swa
        swa_prev = prev_prefix_len if swa_prefix_len is None else swa_prefix_len
        if swa is not None and swa_value is not None and len(swa_value) < npages - swa_start_page:
            raise ValueError("insert: swa_value is shorter than the key after swa_start_page")
        root = core.root(cache_salt, create=True)
        if not isinstance(value, (list, array)):
            value = list(value)
        if swa_value is not None and not isinstance(swa_value, (list, array)):
            swa_value = list(swa_value)
        node = root
        off = 0
        prefix = 0
        device_run = True
        path: list[TreeNode] = []
        swa_free: list[int] = []
        children_get = None
        while off < n:
            children_get = node.children.get
            child = children_get(key[off] if ps == 1 else key[off:off + ps].tobytes())
            if child is None:
                break
            ckey = child.key
            kl = len(ckey)
            if off + kl > n or key[off:off + kl] != ckey:
                kl = core.common_tokens(key, off, ckey, n)
                child = core.split(child, kl)
            cd = child.data[0]
            if cd.value is None or child.loading:
                # L2-only (or still loading): the request's freshly computed pages fill it;
                # a load in flight keeps its own pages until finish_load_back frees them
                device_run = False
                if child.loading:
                    core.clear_value(child, 0)
                    child.loading = False
                core.set_value(child, 0, value[off // ps:(off + kl) // ps])
            elif device_run:
                prefix = off + kl
            if swa is not None:
                child = self._swa_overlap(child, off, swa_prev, swa_value, swa_start_page, swa_free)
            path.append(child)
            node = child
            off += kl
        if off < n:
            if swa is not None and swa_value is not None and off // ps < swa_start_page < npages:
                cut = swa_start_page * ps
                mid = self._new_leaf(node, key[off:cut], value[off // ps:swa_start_page])
                path.append(mid)
                node, off = mid, cut
            leaf = self._new_leaf(node, key[off:n], value[off // ps:npages])
            if swa is not None and swa_value is not None and off // ps >= swa_start_page:
                lo = off // ps - swa_start_page
                core.set_value(leaf, swa.slot, swa_value[lo:lo + self._npages(leaf)])
            path.append(leaf)
            node = leaf
        core.touch(path)
        if swa is not None and swa_free:
            swa.allocator.free(swa_free)
        res = InsertResult(prefix, node)
        if self.mamba is not None and mamba_value is not None:
            m = self.mamba
            if node.parent is not None and node.data[m.slot].value is None:
                core.set_value(node, m.slot, mamba_value)
            else:
                res.mamba_exist = True
                m.allocator.free([mamba_value])
        return res

    def _new_leaf(self, parent: TreeNode, key: Key, pages: list[int]) -> TreeNode:
        leaf = self.core.new_child(parent, key)
        self.core.set_value(leaf, 0, pages)
        return leaf

    def _swa_overlap(self, node: TreeNode, off: int, prev: int, swa_value: Sequence[int] | None,
                     swa_start: int, swa_free: list[int]) -> TreeNode:
        """SWA on an overlapped node covering tokens [off, off+len): free the request's own
        duplicate SWA pages or recover a tombstone from them."""
        swa = self.swa
        i = swa.slot  # type: ignore[union-attr]
        if swa_value is None:
            return node
        ps = self.page_size
        a, b = off // ps, (off + len(node.key)) // ps
        own_lo = max(swa_start, prev // ps)  # request-owned SWA pages start here
        if b <= own_lo:
            return node
        cd = node.data[i]
        if cd.value is not None:
            lo = max(a, own_lo)
            swa_free.extend(swa_value[lo - swa_start:b - swa_start])
            return node
        if a < own_lo:
            self.core.split(node, (own_lo - a) * ps)  # the upper part stays a tombstone
            a = own_lo
        self.core.set_value(node, i, swa_value[a - swa_start:b - swa_start])
        return node

    # ================================================================== locks
    def inc_lock_ref(self, node: TreeNode) -> LockToken:
        """Protect ``node``'s path from L1 eviction (FULL: to the root; SWA: until the window
        is covered; MAMBA: the node). Returns the token ``dec_lock_ref`` needs."""
        core = self.core
        if not self.aux:
            return LockToken(node, (self.full.lock(core, node),))
        return LockToken(node, tuple([c.lock(core, node) for c in self.components]))

    def dec_lock_ref(self, node: TreeNode | LockToken, token: LockToken | None = None) -> None:
        """Release a lock taken by ``inc_lock_ref``; refuses to go below zero."""
        if isinstance(node, LockToken):
            token, node = node, node.node
        if token is None:
            if self.swa is not None:
                raise ValueError("dec_lock_ref needs the LockToken when an SWA component is present")
            parts: tuple[Any, ...] = (None,) * len(self.components)
        else:
            if token.node is not node:
                raise ValueError("dec_lock_ref: token belongs to another node")
            parts = token.parts
        for c, p in zip(self.components, parts, strict=True):
            c.unlock(self.core, node, p)

    def data(self, node: TreeNode, ctype: ComponentType) -> ComponentData:
        """``node``'s data for component ``ctype`` (``node.data`` is indexed by slot)."""
        return node.data[self._by_type[ctype].slot]

    # ================================================================== sizes
    def evictable_size(self, ctype: ComponentType = ComponentType.FULL) -> int:
        """L1 tokens (FULL/SWA) or states (MAMBA) not protected by a lock."""
        c = self._by_type[ctype]
        u = self.page_size if c.paged else 1
        return (self.core.dev_total[c.slot] - self.core.dev_prot[c.slot]) * u

    def protected_size(self, ctype: ComponentType = ComponentType.FULL) -> int:
        c = self._by_type[ctype]
        u = self.page_size if c.paged else 1
        return self.core.dev_prot[c.slot] * u

    def total_size(self, ctype: ComponentType = ComponentType.FULL) -> int:
        c = self._by_type[ctype]
        return self.core.dev_total[c.slot] * (self.page_size if c.paged else 1)

    def host_evictable_size(self) -> int:
        return (self.core.host_total[0] - self.core.host_prot[0]) * self.page_size

    def host_protected_size(self) -> int:
        return self.core.host_prot[0] * self.page_size

    # ================================================================== eviction
    def evict(self, full_tokens: int = 0, *, swa_tokens: int = 0, mamba_states: int = 0) -> EvictResult:
        """Free at least the requested L1 amounts if unlocked data allows (LRU first).

        FULL: device leaves (no child with L1 data); a node with an L2 copy stays as an
        L2-only node, one without is deleted, except under ``write_back`` with L2 on, where
        it is queued for writing instead. SWA / MAMBA: internal nodes become tombstones
        (cascading to lower-or-equal priority), leaves cascade to every component.
        """
        res = EvictResult()
        ps = self.page_size
        if full_tokens > 0:
            res.full_tokens = self._evict_full(-(-full_tokens // ps)) * ps
        for c in self.aux:
            want = swa_tokens if c.ctype == ComponentType.SWA else mamba_states
            if want > 0:
                got = self._evict_aux(c, -(-want // ps) if c.paged else want)
                if c.paged:
                    res.swa_tokens = got * ps
                else:
                    res.mamba_states = got
        self.evicted_device_tokens += res.full_tokens
        return res

    def _full_evictable(self, node: TreeNode) -> bool:
        if node.in_flight or node.loading:
            return False
        for cd in node.data:
            if cd.lock_ref:
                return False
        for ch in node.children.values():
            if ch.data[0].value is not None:
                return False
        if node.data[0].host_value is None and node.children:
            return False  # L2-only children need this node's L2 copy first
        return True

    def _evict_full(self, need: int) -> int:
        freed = 0
        write_back = self.hicache and self.write_policy == "write_back"
        for node in self.core.dev_lru[0].candidates():
            if freed >= need:
                break
            while freed < need and node.parent is not None and self._full_evictable(node):
                if write_back and node.data[0].host_value is None:
                    self._write_back_queue[node] = None
                    break
                parent = node.parent
                t = node.last_access_time
                freed += self._evict_node_device(node)
                # a parent that just became a leaf and is older than this node is now the
                # least recently used candidate (the scan has passed it); a newer one is
                # still ahead in the scan
                if parent.last_access_time > t:  # type: ignore[union-attr]
                    break
                node = parent  # type: ignore[assignment]
        return freed

    def _evict_node_device(self, node: TreeNode) -> int:
        """Free every component's L1 data on ``node``; keep it L2-only or delete it.
        Returns the FULL pages freed."""
        core = self.core
        for c in self.aux:
            v = core.clear_value(node, c.slot)
            if v is not None:
                c.allocator.free(c.as_pages(v))
        pages = core.clear_value(node, 0)
        self.full.allocator.free(pages)
        self._write_back_queue.pop(node, None)
        if node.data[0].host_value is None:
            self._delete(node)
        return len(pages)

    def _delete(self, node: TreeNode) -> None:
        core = self.core
        for c in self.components:
            v = core.clear_value(node, c.slot)
            if v is not None:
                c.allocator.free(c.as_pages(v))
            hv = core.clear_host(node, c.slot)
            if hv is not None:
                c.host_allocator.free(c.as_pages(hv))  # type: ignore[union-attr]
        parent = node.parent
        core.detach(node)
        # tombstone chain: a parent left with no FULL data anywhere and no child goes too
        while (parent is not None and parent.parent is not None and not parent.children
               and parent.data[0].value is None and parent.data[0].host_value is None):
            nxt = parent.parent
            core.detach(parent)
            parent = nxt

    def _evict_aux(self, c: TreeComponent, need: int) -> int:
        core = self.core
        i = c.slot
        freed = 0
        for node in core.dev_lru[i].candidates():
            if freed >= need:
                break
            cd = node.data[i]
            if cd.lock_ref or node.in_flight or node.loading or cd.value is None:
                continue
            is_leaf = not node.children
            prio = c.priority(is_leaf)
            before = core.units[i](cd.value)
            if is_leaf and self._full_evictable(node):
                self._evict_node_device(node)
                freed += before
                continue
            for other in self.aux:  # cascade to lower-or-equal priority, unlocked data
                ocd = node.data[other.slot]
                if other is c or (ocd.value is not None and ocd.lock_ref == 0
                                  and other.priority(is_leaf) <= prio):
                    v = core.clear_value(node, other.slot)
                    if v is not None:
                        other.allocator.free(other.as_pages(v))
            freed += before
        return freed

    def evict_host(self, tokens: int) -> int:
        """L2 eviction: delete L2-only leaves with ``host_lock_ref == 0`` (LRU first) until
        ``tokens`` worth of FULL L2 pages are free. Returns tokens freed."""
        need = -(-tokens // self.page_size)
        freed = 0
        for node in self.core.host_lru[0].candidates():
            if freed >= need:
                break
            while freed < need and self._host_evictable(node):
                parent = node.parent
                t = node.host_time
                freed += len(node.data[0].host_value)  # type: ignore[arg-type]
                self._delete(node)
                if parent.host_time > t:  # type: ignore[union-attr]
                    break  # newer: still ahead in the scan
                node = parent  # type: ignore[assignment]
        self.evicted_host_tokens += freed * self.page_size
        return freed * self.page_size

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        if node.parent is None or node.children or node.in_flight or node.data[0].value is not None:
            return False
        return not any(cd.host_lock_ref or cd.lock_ref for cd in node.data)

    # ================================================================== requests
    def cache_finished_req(self, req: RequestState, committed_len: int | None = None) -> InsertResult | None:
        """Insert a finished request's computed tokens, free its duplicate and unaligned
        pages, and release its lock. ``committed_len``: tokens whose KV exists (default:
        ``len(req.kv_pages) * page_size`` capped at the token count)."""
        ps = self.page_size
        n = self._committed(req, committed_len)
        aligned = n - n % ps
        npages = aligned // ps
        pages = req.kv_pages
        res = None
        if npages > 0:
            res = self.insert_with(InsertParams(
                req.token_ids[:aligned], pages[:npages], req.cache_salt, prev_prefix_len=req.prefix_len,
                swa_value=self._req_swa(req, npages), swa_start_page=req.swa_start_page,
                swa_prefix_len=req.swa_prefix_len, mamba_value=req.mamba_slot))
            dup = pages[req.prefix_len // ps:res.prefix_len // ps]
            if dup:
                self.full.allocator.free(dup)
        elif self.mamba is not None and req.mamba_slot is not None:
            self.mamba.allocator.free([req.mamba_slot])
        tail = pages[npages:]
        if tail:
            self.full.allocator.free(tail)
        if self.swa is not None and req.swa_pages is not None:
            extra = req.swa_pages[max(0, npages - req.swa_start_page):]
            if extra:
                self.swa.allocator.free(extra)
        if req.lock is not None:
            self.dec_lock_ref(req.lock)
        req.lock = None
        req.kv_pages = []
        req.swa_pages = None
        req.mamba_slot = None
        return res

    def cache_unfinished_req(self, req: RequestState, committed_len: int | None = None, *,
                             mamba_value: int | None = None) -> None:
        """Chunked prefill: insert what is computed so far (FULL pages only), replace the
        request's duplicate pages by the tree's, and move its lock to the new deepest node.

        SWA data is inserted only by ``cache_finished_req`` (the chunk's nodes are SWA
        tombstones until then, which the final insert recovers from the request's own SWA
        pages); the request keeps every SWA page and its state slot meanwhile.
        ``mamba_value``: a snapshot slot (not ``req.mamba_slot``) holding the Mamba state
        after exactly the committed tokens, which must then be page-aligned; it is taken
        over: kept on the end node, or freed here when that node already has a state or
        nothing new is inserted.
        """
        ps = self.page_size
        n = self._committed(req, committed_len)
        aligned = n - n % ps
        npages = aligned // ps
        if mamba_value is not None:
            if self.mamba is None:
                raise ValueError("cache_unfinished_req: mamba_value given, but the cache has no Mamba component")
            if aligned != n:
                raise ValueError(f"cache_unfinished_req: a Mamba state needs a page-aligned committed_len, got {n}")
        if npages == 0 or aligned <= req.prefix_len:
            if mamba_value is not None:
                self.mamba.allocator.free([mamba_value])  # type: ignore[union-attr]
            return
        res = self.insert_with(InsertParams(req.token_ids[:aligned], req.kv_pages[:npages], req.cache_salt,
                                            prev_prefix_len=req.prefix_len, mamba_value=mamba_value))
        dup = req.kv_pages[req.prefix_len // ps:res.prefix_len // ps]
        if dup:
            self.full.allocator.free(dup)
        values = []
        node = res.node
        while node.parent is not None:
            values.append(node.data[0].value)
            node = node.parent
        tree_pages = self._empty()
        for v in reversed(values):
            tree_pages.extend(v)
        if len(tree_pages) != npages:
            raise RuntimeError("cache_unfinished_req: the inserted prefix is not on L1")
        req.kv_pages[:npages] = tree_pages
        new_lock = self.inc_lock_ref(res.node)
        if req.lock is not None:
            self.dec_lock_ref(req.lock)
        req.lock = new_lock
        req.last_node = res.node
        req.prefix_len = aligned

    def _committed(self, req: RequestState, committed_len: int | None) -> int:
        n = len(req.token_ids) if committed_len is None else committed_len
        return min(n, len(req.token_ids), len(req.kv_pages) * self.page_size)

    @staticmethod
    def _req_swa(req: RequestState, npages: int) -> list[int] | None:
        if req.swa_pages is None:
            return None
        return req.swa_pages[:max(0, npages - req.swa_start_page)]

    # ================================================================== tiers (§5)
    def nodes_to_write_to_host(self, limit: int | None = None) -> list[TreeNode]:
        """Nodes the write policy wants copied to L2 now, parents before children.

        ``write_through``: every L1 node without an L2 copy; ``write_through_selective``:
        those with ``hit_count >= write_through_threshold``; ``write_back``: those L1
        eviction queued. Nodes with a transfer in flight are left out. The write-through
        policies look only at the nodes not yet in L2 (``TreeCore.unwritten``), not at all
        of L1.
        """
        if not self.hicache:
            return []
        if self.write_policy == "write_back":
            cands = [n for n in self._write_back_queue
                     if n.parent is not None and n.data[0].host_value is None and n.data[0].value is not None
                     and not n.in_flight and not n.loading]
        else:  # unwritten: in L1, not in L2 (by construction)
            thr = self.write_through_threshold if self.write_policy == "write_through_selective" else 0
            cands = [n for n in self.core.unwritten if not n.in_flight and not n.loading and n.hit_count >= thr]
        cands.sort(key=self._depth)
        return cands if limit is None else cands[:limit]

    @staticmethod
    def _depth(node: TreeNode) -> int:
        d = 0
        while node.parent is not None:
            d += 1
            node = node.parent
        return d

    def start_write(self, node: TreeNode) -> TierOp | None:
        """Reserve L2 pages for ``node``'s L1 data (evicting L2 if needed) and lock it in L1
        until ``finish_write``. Returns None (nothing changed) if L2 has no room or the
        node is not writable (L2 already there, no L1 data, transfer in flight)."""
        if not self.hicache:
            raise RuntimeError("start_write needs an L2 allocator")
        core = self.core
        if (node.parent is None or node.in_flight or node.loading or node.data[0].value is None
                or node.data[0].host_value is not None):
            return None
        transfers: dict[str, tuple[list[int], list[int]]] = {}
        for c in self.components:
            cd = node.data[c.slot]
            if c.host_allocator is None or cd.value is None or cd.host_value is not None:
                continue
            src = c.as_pages(cd.value)
            dst = c.host_allocator.alloc(len(src))
            if dst is None and c is self.full:
                self.evict_host((len(src) - c.host_allocator.free_count) * self.page_size)
                dst = c.host_allocator.alloc(len(src))
            if dst is None:
                if c is self.full:
                    for name, (_s, d) in transfers.items():
                        self._by_name(name).host_allocator.free(d)  # type: ignore[union-attr]
                    return None
                continue
            transfers[c.name] = (list(src), dst)
        op = TierOp("write", node, self._npages(node), transfers)
        self.full.lock(core, node)
        for c in self.aux:
            core.lock(node, c.slot)
        node.in_flight += 1
        self._open_transfers += 1
        return op

    def _by_name(self, name: str) -> TreeComponent:
        return next(c for c in self.components if c.name == name)

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
        core = self.core
        nodes = self._op_nodes(op.node, op.npages)
        for n in nodes:
            n.in_flight -= 1
        for c in self.aux:
            for n in (nodes if c.paged else nodes[:1]):
                core.unlock(n, c.slot)
        self.full.unlock(core, op.node)
        for name, (_src, dst) in op.transfers.items():
            c = self._by_name(name)
            if not ok:
                c.host_allocator.free(dst)  # type: ignore[union-attr]
                continue
            if not c.paged:
                core.set_host(op.node, c.slot, c.from_pages(dst))
                continue
            start = 0
            for n in reversed(nodes):  # upper first: parents older than children in L2 order
                k = self._npages(n)
                core.set_host(n, c.slot, dst[start:start + k])
                start += k
        if not ok:
            return []
        for n in nodes:
            self._write_back_queue.pop(n, None)
        return list(reversed(nodes))

    def start_load_back(self, match: MatchResult) -> TierOp | None:
        """Allocate L1 pages for the L2-only tail of ``match`` (evicting L1 if needed) and
        return what to copy (``src_pages`` = L2, ``dst_pages`` = L1, in key order). The
        nodes get their L1 ``value`` now but stay unreadable (``loading``) until
        ``finish_load_back``; the path is L1-locked and the nodes host-locked meanwhile.
        None (nothing changed) when there is nothing to load or no room."""
        core = self.core
        if match.host_hit_length <= 0:
            return None
        top = match.last_device_node
        nodes = []
        n = match.last_host_node
        while n is not top:
            if n is None or n.parent is None or n.data[0].value is not None or n.in_flight or n.loading:
                return None
            nodes.append(n)
            n = n.parent
        nodes.reverse()
        need = sum(self._npages(x) for x in nodes)
        for x in nodes:
            for c in self.components:
                if x.data[c.slot].host_value is not None:
                    core.host_lock(x, c.slot)
        lock = self.inc_lock_ref(top) if top.parent is not None else None
        try:
            dev = self.full.allocator.alloc(need)
            if dev is None:
                self.evict(full_tokens=(need - self.full.allocator.free_count) * self.page_size)
                dev = self.full.allocator.alloc(need)
        finally:
            if lock is not None:
                self.dec_lock_ref(lock)
        if dev is None:
            for x in nodes:
                for c in self.components:
                    if x.data[c.slot].host_value is not None:
                        core.host_unlock(x, c.slot)
            return None
        src_all: list[int] = []
        off = 0
        aux_src: dict[str, list[int]] = {}
        aux_dst: dict[str, list[int]] = {}
        for x in nodes:
            k = self._npages(x)
            src_all.extend(x.data[0].host_value)  # type: ignore[arg-type]
            core.set_value(x, 0, dev[off:off + k])
            off += k
            x.loading = True
            x.in_flight += 1
            for c in self.aux:
                hv = x.data[c.slot].host_value
                if hv is None:
                    continue
                pages = c.as_pages(hv)
                d = c.allocator.alloc(len(pages))
                if d is None:
                    continue
                core.set_value(x, c.slot, c.from_pages(d))
                aux_src.setdefault(c.name, []).extend(pages)
                aux_dst.setdefault(c.name, []).extend(d)
        transfers = {"full": (src_all, dev)}
        for name in aux_src:
            transfers[name] = (aux_src[name], aux_dst[name])
        op = TierOp("load", match.last_host_node, need, transfers)
        self.full.lock(core, op.node)
        self._open_transfers += 1
        return op

    def finish_load_back(self, op: TierOp, ok: bool) -> None:
        """Apply the acknowledgement of a ``start_load_back``; on failure the nodes are
        L2-only again and their new L1 pages are freed."""
        self._close(op, "load")
        core = self.core
        nodes = self._op_nodes(op.node, op.npages)
        self.full.unlock(core, op.node)
        dev = op.transfers["full"][1]
        end = len(dev)
        for x in nodes:  # lowest first: its pages are the last ones
            k = self._npages(x)
            mine = dev[end - k:end]
            end -= k
            x.in_flight -= 1
            for c in self.components:
                cd = x.data[c.slot]
                if cd.host_value is not None and cd.host_lock_ref > 0:
                    core.host_unlock(x, c.slot)
            if not x.loading:
                # an insert re-filled it with a request's own pages meanwhile: ours are spare
                self.full.allocator.free(mine)
            elif not ok:
                pages = core.clear_value(x, 0)
                self.full.allocator.free(pages)
            x.loading = False
            if not ok:
                for c in self.aux:  # what the failed load put there is not valid data
                    v = core.clear_value(x, c.slot)
                    if v is not None:
                        c.allocator.free(c.as_pages(v))

    def start_backup(self, node: TreeNode) -> TierOp | None:
        """L3 backup of ``node``'s L2 pages: returns their L2 pages and page hashes, with the
        node host-locked until ``finish_backup``. None if the node has no L2 copy."""
        if node.parent is None or node.data[0].host_value is None:
            return None
        hashes = self.node_hashes(node)
        op = TierOp("backup", node, self._npages(node), {"full": (list(node.data[0].host_value), [])}, hashes)
        self.core.host_lock(node, 0)
        node.in_flight += 1
        self._open_transfers += 1
        return op

    def finish_backup(self, op: TierOp, ok: bool) -> None:
        """Release the node of a ``start_backup`` (either way; L3 residency is not stored)."""
        self._close(op, "backup")
        for n in self._op_nodes(op.node, op.npages):
            n.in_flight -= 1
            self.core.host_unlock(n, 0)

    def protect_host(self, node: TreeNode) -> int:
        """Host-lock ``node`` (its FULL L2 copy); returns the page count to pass back to
        ``release_host`` (the node may be split meanwhile)."""
        if node.parent is None or node.data[0].host_value is None:
            raise ValueError("protect_host: the node has no L2 copy")
        self.core.host_lock(node, 0)
        return self._npages(node)

    def release_host(self, node: TreeNode, npages: int | None = None) -> None:
        nodes = self._op_nodes(node, self._npages(node) if npages is None else npages)
        for n in nodes:
            if n.data[0].host_lock_ref <= 0:
                raise ValueError(f"release_host: host_lock_ref of {n!r} would go below zero")
        for n in nodes:
            self.core.host_unlock(n, 0)

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
                    *, start_page: int = 0) -> InsertResult:
        """Insert prefetched pages as L2-only nodes: ``host_pages`` are the FULL L2 pages of
        the key's pages from ``start_page`` on. Pages the tree already holds are freed here,
        as are all of them when the tree no longer holds the key's first ``start_page``
        pages. ``host_pages_taken`` says how many the tree kept."""
        if not self.hicache:
            raise RuntimeError("insert_host needs an L2 allocator")
        core = self.core
        ps = self.page_size
        key, n = self._aligned(key)
        npages = n // ps
        hp = list(host_pages)
        if len(hp) != npages - start_page:
            raise ValueError("insert_host: host_pages must cover the key from start_page on")
        root = core.root(cache_salt, create=True)
        path = core.walk(root, key, n)
        have = sum(len(x.key) for x in path)
        node = path[-1] if path else root
        res = InsertResult(have, node)
        if have < start_page * ps:
            self.full.host_allocator.free(hp)  # type: ignore[union-attr]
            return res
        dup = hp[:have // ps - start_page]
        if dup:
            self.full.host_allocator.free(dup)  # type: ignore[union-attr]
        if have < n:
            leaf = core.new_child(node, key[have:n])
            core.set_host(leaf, 0, hp[have // ps - start_page:])
            core.touch(path + [leaf])
            res.node = leaf
            res.host_pages_taken = npages - have // ps
        return res

    # ================================================================== hashes
    def node_hashes(self, node: TreeNode) -> list[str]:
        """The node's page hashes (computed now if needed, with its missing ancestors')."""
        if node.parent is None:
            return []
        chain = []
        n = node
        while n.parent is not None and n.hash_value is None:
            chain.append(n)
            n = n.parent
        parent_hash = n.hash_value[-1] if n.parent is not None and n.hash_value else None
        hasher = self.hasher_for(self._salt_of(node))
        for x in reversed(chain):
            x.hash_value = hasher.hash_pages(x.key, parent_hash)
            parent_hash = x.hash_value[-1]
        return node.hash_value  # type: ignore[return-value]

    def last_page_hash(self, node: TreeNode) -> str | None:
        """The hash of the node's last page (None for a root): continue the chain into L3."""
        hv = self.node_hashes(node)
        return hv[-1] if hv else None

    # ================================================================== misc
    def flush(self) -> None:
        """Drop every unlocked node with no transfer in flight (L1 and L2)."""
        while True:
            before = (self.core.node_count, self.core.dev_total[0], self.core.host_total[0])
            self.evict(full_tokens=(self.core.dev_total[0] + 1) * self.page_size)
            if self.hicache:
                self.evict_host((self.core.host_total[0] + 1) * self.page_size)
            if (self.core.node_count, self.core.dev_total[0], self.core.host_total[0]) == before:
                return

    def check_integrity(self, exact: bool = False) -> None:
        """See ``hicache.tree.integrity.check_integrity``; ``exact`` also proves no leak."""
        from hicache.tree.integrity import check_integrity

        check_integrity(self, exact)
