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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from hicache.hashing import HashNamespace, PageHasher, component_keys
from hicache.memory.allocator import PageIndices
from hicache.tree.components import (
    RELEASED,
    FullComponent,
    MambaComponent,
    NoRoom,
    SWAComponent,
    TreeComponent,
    Validator,
)
from hicache.tree.core import TreeCore
from hicache.tree.node import KEY_TYPECODE, ComponentData, ComponentType, Key, TreeNode
from hicache.tree.policy import make_policy

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_NO_VALIDATORS: list[Validator] = []


@dataclass
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices``: FULL L1 pages of the valid device prefix (``device_len`` tokens).
    ``last_device_node``: the node ending that prefix (a root when nothing matched).
    ``host_hit_length``: tokens after it that are L2-only, ending at ``last_host_node``
    (a boundary valid for every component once loaded back).
    ``copies``: per component name, the request's private copy of the matched node's data
    (``TreeComponent.copy_on_match``: Mamba's state); the request owns and frees it.
    ``walked_len``: with auxiliary components, the tokens of the key the tree holds on
    the matched path in any tier, before the validators cut it (where the key forks from
    the tree or ends): a branch point whose state a request computing through it may add.
    """

    device_indices: PageIndices
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int = 0
    device_len: int = 0
    copies: dict[str, Any] = field(default_factory=dict)
    walked_len: int = 0


@dataclass
class InsertResult:
    """``prefix_len``: tokens already on L1 before the insert (the caller frees its pages
    ``[prev_prefix_len, prefix_len)``); ``node``: the node ending the key; ``already_held``:
    the components whose end-node data the tree had already (the payload's was freed)."""

    prefix_len: int
    node: TreeNode
    already_held: frozenset[str] = frozenset()
    host_pages_taken: int = 0


@dataclass
class EvictResult:
    """What ``evict`` freed, per component name, in tokens (paged components) or states."""

    freed: dict[str, int] = field(default_factory=dict)

    @property
    def full_tokens(self) -> int:
        return self.freed.get("full", 0)

    @property
    def swa_tokens(self) -> int:
        return self.freed.get("swa", 0)

    @property
    def mamba_states(self) -> int:
        return self.freed.get("mamba", 0)


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
    request's match); ``aux``: per component name, that component's payload (SWA: a
    ``PagedInsert``; Mamba: the state slot after the key's last token), taken over entirely.
    """

    key: Sequence[int]
    value: Sequence[int]
    cache_salt: str = ""
    prev_prefix_len: int = 0
    aux: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TierOp:
    """An in-flight transfer, from its ``start_*`` to its ``finish_*`` (exactly once).

    ``kind``: ``write``, ``load`` or ``backup``; ``node`` / ``npages``: the lowest node it
    covers and its page count (the span survives splits);
    ``transfers[component] = (src_pages, dst_pages)``; ``hashes``: a backup's page hashes;
    ``aux_keys[component]``: a backup's L3 keys of each auxiliary component in
    ``transfers`` (one per L2 unit: ``hicache.hashing.component_key``);
    ``done``: finished. It has no id: the tier layer files it under its controller op id.
    """

    kind: str
    node: TreeNode
    npages: int
    transfers: dict[str, tuple[list[int], PageIndices]]
    hashes: list[str] = field(default_factory=list)
    done: bool = False
    aux_keys: dict[str, list[str]] = field(default_factory=dict)

    @property
    def src_pages(self) -> list[int]:
        return self.transfers["full"][0]

    @property
    def dst_pages(self) -> PageIndices:
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

    token_ids: Sequence[int]
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
    """One radix tree over FULL plus any auxiliary components, with L1 and optional L2 state.

    ``components``: a ``FullComponent`` first (the primary: its data decides whether a node
    lives), then any auxiliary components with distinct names (SWA, Mamba, or another
    ``TreeComponent``); the tree handles them only through their hooks. A component built
    with a ``host_allocator`` has L2 state (L2 is on when FULL has one).
    ``hasher``: a ``PageHasher`` or ``HashNamespace`` for page hashes (computed lazily, on
    the tier path only; other salts derive from it with ``with_salt``).
    ``eviction_policy``: ``lru`` (default) or ``slru``. ``write_policy``: ``write_through``,
    ``write_through_selective`` (``hit_count >= write_through_threshold``) or ``write_back``.

    Scheduler calls: ``match_prefix``, ``inc_lock_ref`` / ``dec_lock_ref``, ``insert`` /
    ``insert_with``, ``evict`` / ``evict_units``, ``cache_finished_req``,
    ``cache_unfinished_req``, ``evictable_size`` / ``protected_size`` / ``total_size``,
    ``flush``, ``check_integrity``.
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
        if any(isinstance(c, FullComponent) for c in comps[1:]):
            raise ValueError("only the first component may be a FullComponent")
        if len({c.name for c in comps}) != len(comps):
            raise ValueError("each component name may appear once")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        for i, c in enumerate(comps):
            if c.slot not in (-1, i):
                raise ValueError("a component instance can serve only one cache")
            c.slot = i
        self.components = comps
        self.page_size = page_size
        self.full: FullComponent = comps[0]
        self.aux = comps[1:]
        self._by_name = {c.name: c for c in comps}
        self._lock_needs_token = any(c.lock_needs_token for c in comps)
        self.eviction_policy = eviction_policy
        make_policy(eviction_policy)  # validate the name now
        hicache = comps[0].host_allocator is not None
        self.core = TreeCore(page_size, len(comps), [c.units for c in comps], [c.split for c in comps],
                             lambda: make_policy(eviction_policy),
                             written=[i == 0 or (hicache and c.host_allocator is not None)
                                      for i, c in enumerate(comps)])
        if isinstance(hasher, HashNamespace):
            hasher = PageHasher(hasher)
        if hasher is not None and hasher.page_size != page_size:
            raise ValueError("the hasher's page size differs from the cache's")
        self._hasher = hasher
        self._hashers: dict[str, PageHasher] = {}
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.hicache = hicache
        self._write_back = self.hicache and write_policy == "write_back"
        self._write_back_queue: dict[TreeNode, None] = {}
        self._open_transfers = 0  # TierOps started and not finished (their owner keeps them)
        self.evicted_device_tokens = 0  # monotonic: FULL tokens freed from L1 / L2 by eviction
        self.evicted_host_tokens = 0
        self._empty = self.full.allocator.empty
        # what a match under an unknown salt returns as its node: locking it is a no-op
        self._void_root = TreeNode(None, array(KEY_TYPECODE), len(comps))

    # ---- component lookup (for callers that serve a given model; the tree never needs it)
    def component(self, kind: ComponentType | str) -> TreeComponent:
        """The component named ``kind`` (a ``ComponentType`` or a name); KeyError if absent."""
        return self._by_name[kind.wire_name if isinstance(kind, ComponentType) else kind]

    @property
    def swa(self) -> SWAComponent | None:
        c = self._by_name.get("swa")
        return c if isinstance(c, SWAComponent) else None

    @property
    def mamba(self) -> MambaComponent | None:
        c = self._by_name.get("mamba")
        return c if isinstance(c, MambaComponent) else None

    # ================================================================== helpers
    def _aligned(self, key: Sequence[int]) -> tuple[Key, int]:
        """The key as ``array('I')`` (not copied when it already is one) and its
        page-aligned length. Token ids outside ``[0, 2**32)`` are refused."""
        if type(key) is not array or key.typecode != KEY_TYPECODE:
            try:
                key = array(KEY_TYPECODE, key)
            except (OverflowError, TypeError) as exc:
                raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
        n = len(key)
        return key, n - n % self.page_size

    def _npages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_size

    def _op_nodes(self, node: TreeNode, npages: int) -> list[TreeNode]:
        """Nodes from ``node`` upward spanning exactly ``npages`` pages (lowest first)."""
        out = []
        n: TreeNode | None = node
        while npages > 0:
            if n is None or n.parent is None:
                raise RuntimeError("in-flight operation lost its nodes")
            out.append(n)
            npages -= self._npages(n)
            n = n.parent
        if npages:
            raise RuntimeError("in-flight operation does not end on a node boundary")
        return out

    def _free(self, c: TreeComponent, units: Sequence[int], host: bool = False) -> None:
        if units:
            alloc = c.host_allocator if host else c.allocator
            if alloc is None:
                raise RuntimeError(f"{c.name} has no {'L2' if host else 'L1'} allocator")
            alloc.free(units)

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
    def match_prefix(self, key: Sequence[int], cache_salt: str = "", *, copy_on_match: bool = True) -> MatchResult:
        """Longest cached prefix of ``key`` valid for every component.

        Splits a node where the key forks inside it and stops there. Refreshes the matched
        path (access times, every LRU order, ``hit_count``). The L2-only part after a fully
        valid device prefix (``host_hit_length``) ends at the last boundary that every
        component's validator accepts with the L2 data counted. With ``copy_on_match``,
        each component that asks for it (``TreeComponent.copy_on_match``: Mamba) gives the
        request a private copy of the matched node's data (``MatchResult.copies``); if one
        cannot, the match is empty.
        """
        core = self.core
        root = core.root(cache_salt)
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
        validators = [v for v in (c.new_validator() for c in self.aux) if v is not None] if self.aux else _NO_VALIDATORS
        if validators and ndev:
            best = 0
            for j in range(ndev):
                node = path[j]
                ok = True
                for v in validators:  # every validator sees every node
                    if not v(node, False):
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
        if validators:
            res.walked_len = sum(len(x.key) for x in path)
        if best == ndev and ndev < len(path):
            run = host_len = 0
            last_host = last_dev
            for node in path[ndev:]:
                if node.loading or node.data[0].host_value is None:
                    break
                run += len(node.key)
                ok = True
                for v in validators:
                    if not v(node, True):
                        ok = False
                if ok:
                    host_len, last_host = run, node
            res.host_hit_length, res.last_host_node = host_len, last_host
        if copy_on_match and best and self.aux:
            self._copy_on_match(res)
        return res

    def _copy_on_match(self, res: MatchResult) -> None:
        node = res.last_device_node
        for c in self.aux:
            try:
                v = c.copy_on_match(self.core, node, partial(self._evict_component, c, 1))
            except NoRoom:
                for name, got in res.copies.items():  # give back the copies made so far
                    done = self._by_name[name]
                    self._free(done, done.as_pages(got))
                root = self.core.root(self._salt_of(node)) or self._void_root
                res.device_indices, res.last_device_node, res.last_host_node = self._empty(), root, root
                res.device_len = res.host_hit_length = 0
                res.copies = {}
                return
            if v is not None:
                res.copies[c.name] = v

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
        nodes. Every ``p.aux`` payload is taken over entirely by its component's insert
        hooks: kept, or freed here when the tree already holds it (an SWA tombstone covered
        by the request's pages is recovered, split where the request's own pages start).
        """
        return self._insert(p.key, p.value, p.cache_salt, p.prev_prefix_len, p.aux or None)

    def _insert(self, key: Sequence[int], value: Sequence[int], cache_salt: str, prev_prefix_len: int,
                aux: Mapping[str, Any] | None) -> InsertResult:
        """The body of ``insert`` / ``insert_with``; ``aux`` None: no auxiliary payloads."""
        core = self.core
        ps = self.page_size
        key, n = self._aligned(key)
        npages = n // ps
        if len(value) < npages:
            raise ValueError(f"insert: {len(value)} pages given for {npages} pages of key")
        if prev_prefix_len % ps or prev_prefix_len > n:
            raise ValueError("prev_prefix_len must be page-aligned and within the key")
        payloads: list[tuple[TreeComponent, Any]] = []
        if aux:
            unknown = set(aux) - {c.name for c in self.aux}
            if unknown:
                raise ValueError(f"insert: no auxiliary component named {sorted(unknown)}")
            payloads = [(c, aux[c.name]) for c in self.aux if aux.get(c.name) is not None]
            for c, pl in payloads:
                c.check_insert(pl, npages)
        root = core.ensure_root(cache_salt)
        if not isinstance(value, (list, array)):
            value = list(value)
        node = root
        off = 0
        prefix = 0
        device_run = True
        path: list[TreeNode] = []
        spare: list[list[int]] = [[] for _ in payloads]
        while off < n:
            child = node.children.get(key[off] if ps == 1 else key[off:off + ps].tobytes())
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
            if payloads:
                for piece, first in self._cut(child, off // ps, payloads):
                    for j, (c, pl) in enumerate(payloads):
                        c.insert_overlap(core, piece, first, pl, spare[j])
                    path.append(piece)
            else:
                path.append(child)
            node = child
            off += kl
        if off < n:
            ends = [npages]
            if payloads:
                ends[:0] = sorted({cut for c, pl in payloads for cut in c.insert_cuts(pl, off // ps, npages)})
            for end in ends:
                leaf = core.new_child(node, key[off:end * ps])
                core.set_value(leaf, 0, value[off // ps:end])
                for c, pl in payloads:
                    c.insert_new(core, leaf, off // ps, pl)
                path.append(leaf)
                node, off = leaf, end * ps
        core.touch(path)
        if not payloads:
            return InsertResult(prefix, node)
        held = []
        for j, (c, pl) in enumerate(payloads):
            if c.insert_end(core, node, pl, spare[j]):
                held.append(c.name)
            self._free(c, spare[j])
        return InsertResult(prefix, node, frozenset(held))

    def _cut(self, node: TreeNode, first: int, payloads: list[tuple[TreeComponent, Any]]
             ) -> list[tuple[TreeNode, int]]:
        """Split ``node`` (starting at page ``first``) at every component's ``overlap_cuts``;
        returns the pieces with their first pages, upper first (``node`` is the last)."""
        cuts = sorted({x for c, pl in payloads for x in c.overlap_cuts(self.core, node, first, pl)})
        pieces = []
        cur = first
        for x in cuts:
            pieces.append((self.core.split(node, (x - cur) * self.page_size), cur))
            cur = x
        pieces.append((node, cur))
        return pieces

    # ================================================================== locks
    def inc_lock_ref(self, node: TreeNode) -> LockToken:
        """Protect ``node``'s path from L1 eviction, each component its own way (FULL: to
        the root; SWA: until the window is covered; MAMBA: the node). Returns the token
        ``dec_lock_ref`` needs."""
        core = self.core
        if not self.aux:
            self.full.lock(core, node)
            return LockToken(node, (None,))
        return LockToken(node, tuple([c.lock(core, node) for c in self.components]))

    def dec_lock_ref(self, node: TreeNode | LockToken, token: LockToken | None = None) -> None:
        """Release a lock taken by ``inc_lock_ref``; refuses to go below zero."""
        if isinstance(node, LockToken):
            token, node = node, node.node
        if token is None:
            if self._lock_needs_token:
                raise ValueError("dec_lock_ref needs the LockToken with these components")
            parts: tuple[Any, ...] = (None,) * len(self.components)
        else:
            if token.node is not node:
                raise ValueError("dec_lock_ref: token belongs to another node")
            parts = token.parts
        for c, p in zip(self.components, parts, strict=True):
            c.unlock(self.core, node, p)

    def release_part(self, token: LockToken, component: str) -> LockToken:
        """Give back ``component``'s part of the lock ``token`` stands for, early (e.g. an
        SWA window a request will never read again), keeping the other parts. Returns the
        token to pass to ``dec_lock_ref`` from now on (``token`` itself must not be used
        again); releasing a part already released changes nothing."""
        c = self.component(component)
        parts = list(token.parts)
        if len(parts) != len(self.components):
            raise ValueError("release_part: the token does not belong to this cache's components")
        i = self.components.index(c)
        if parts[i] is RELEASED:
            return token
        c.unlock(self.core, token.node, parts[i])
        parts[i] = RELEASED
        return LockToken(token.node, tuple(parts))

    def data(self, node: TreeNode, kind: ComponentType | str) -> ComponentData:
        """``node``'s data for component ``kind`` (``node.data`` is indexed by slot)."""
        return node.data[self.component(kind).slot]

    # ================================================================== sizes
    def evictable_size(self, kind: ComponentType | str = ComponentType.FULL) -> int:
        """L1 tokens (paged components) or states of ``kind`` that no lock and no transfer
        in flight protects: what ``evict`` frees when asked for everything, except data
        waiting for its L2 write under ``write_back`` and the L1 data above an L2-only node
        that is host-locked."""
        c = self.component(kind)
        return (self.core.dev_total[c.slot] - self.core.dev_prot[c.slot]) * c.unit_tokens(self.page_size)

    def protected_size(self, kind: ComponentType | str = ComponentType.FULL) -> int:
        c = self.component(kind)
        return self.core.dev_prot[c.slot] * c.unit_tokens(self.page_size)

    def total_size(self, kind: ComponentType | str = ComponentType.FULL) -> int:
        c = self.component(kind)
        return self.core.dev_total[c.slot] * c.unit_tokens(self.page_size)

    def host_evictable_size(self) -> int:
        return (self.core.host_total[0] - self.core.host_prot[0]) * self.page_size

    def host_protected_size(self) -> int:
        return self.core.host_prot[0] * self.page_size

    # ================================================================== eviction
    def evict(self, full_tokens: int = 0, *, swa_tokens: int = 0, mamba_states: int = 0) -> EvictResult:
        """``evict_units`` with the amounts of the three known components by keyword (an
        amount for a component this cache lacks is ignored)."""
        return self.evict_units({"full": full_tokens, "swa": swa_tokens, "mamba": mamba_states})

    def evict_units(self, amounts: Mapping[str, int]) -> EvictResult:
        """Free at least the requested L1 amounts (per component name: tokens for a paged
        component, states otherwise) if unlocked data allows, LRU first.

        FULL: device leaves (no child with L1 data). A node with an L2 copy stays as an
        L2-only node; one without is deleted (with the L2-only nodes below it). Under
        ``write_back`` with L2 on, a node with L1 data not in L2 (any component's) is
        queued for writing instead, whichever component's eviction reached it.
        Auxiliary components: internal nodes become tombstones (cascading to the other
        components of lower-or-equal priority there); a leaf whose FULL data can go goes
        wholly, by the same rules as a FULL eviction.
        """
        res = EvictResult()
        ps = self.page_size
        if not self.aux:  # FULL only: the common case, without the per-component loop
            want = amounts.get("full", 0)
            if want > 0:
                res.freed["full"] = self._evict_full(-(-want // ps)) * ps
                self.evicted_device_tokens += res.freed["full"]
            return res
        for c in self.components:
            want = amounts.get(c.name, 0)
            if want > 0:
                unit = c.unit_tokens(ps)
                got = self._evict_component(c, -(-want // unit))
                res.freed[c.name] = got * unit
        self.evicted_device_tokens += res.full_tokens
        return res

    def _evict_component(self, c: TreeComponent, need: int) -> int:
        return self._evict_full(need) if c is self.full else self._evict_aux(c, need)

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

    def _evict_full(self, need: int) -> int:
        freed = 0
        for node in self.core.dev_lru[0].candidates():
            if freed >= need:
                break
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
        if self._write_back and node in self.core.unwritten:
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

    def _delete(self, node: TreeNode, cascade: bool = True) -> None:
        core = self.core
        for c in self.components:
            v = core.clear_value(node, c.slot)
            if v is not None:
                self._free(c, c.as_pages(v))
            hv = core.clear_host(node, c.slot)
            if hv is not None:
                self._free(c, c.as_pages(hv), host=True)
        self._write_back_queue.pop(node, None)
        parent = node.parent
        core.detach(node)
        # tombstone chain: a parent left with no FULL data anywhere and no child goes too
        while (cascade and parent is not None and parent.parent is not None and not parent.children
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
            if cd.lock_ref or node.loading or cd.value is None:
                continue
            if self._write_back and node in core.unwritten:  # written first, evicted after
                self._write_back_queue[node] = None
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
                assert parent is not None  # _host_evictable refuses roots
                t = node.host_time
                freed += len(node.data[0].host_value)
                self._delete(node)
                if parent.host_time > t:
                    break  # newer: still ahead in the scan
                node = parent
        self.evicted_host_tokens += freed * self.page_size
        return freed * self.page_size

    def _evict_host_aux(self, c: TreeComponent, need: int) -> int:
        """L2 eviction of one auxiliary component's data (``need`` units): the node keeps
        its FULL copy and becomes an L2 tombstone of ``c``. Only L2-only data goes (as for
        FULL: a copy of data still in L1 stays, or the node would want writing again);
        host-locked data and data of a node with a transfer in flight stay."""
        core = self.core
        freed = 0
        for node in core.host_lru[c.slot].candidates():
            if freed >= need:
                break
            cd = node.data[c.slot]
            if cd.host_lock_ref or node.in_flight or cd.host_value is None or cd.value is not None:
                continue
            hv = core.clear_host(node, c.slot)
            freed += core.units[c.slot](hv)
            self._free(c, c.as_pages(hv), host=True)
        return freed

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        if node.parent is None or node.children or node.in_flight or node.data[0].value is not None:
            return False
        return not any(cd.host_lock_ref or cd.lock_ref for cd in node.data)

    # ================================================================== requests
    def cache_finished_req(self, req: RequestState, committed_len: int | None = None) -> InsertResult | None:
        """Insert a finished request's computed tokens, free its duplicate and unaligned
        pages, and release its lock. ``committed_len``: tokens whose KV exists (default:
        ``len(req.kv_pages) * page_size`` capped at the token count). Each auxiliary
        component takes its part of ``req`` (``request_payload``) and gives up the rest
        (``release_request``)."""
        ps = self.page_size
        n = self._committed(req, committed_len)
        aligned = n - n % ps
        npages = aligned // ps
        pages = req.kv_pages
        res = None
        if npages > 0:
            aux = {c.name: c.request_payload(req, npages) for c in self.aux}
            res = self.insert_with(InsertParams(req.token_ids[:aligned], pages[:npages], req.cache_salt,
                                                prev_prefix_len=req.prefix_len, aux=aux))
            self._free(self.full, pages[req.prefix_len // ps:res.prefix_len // ps])
        self._free(self.full, pages[npages:])
        for c in self.aux:
            spare: list[int] = []
            c.release_request(req, npages, npages > 0, spare)
            self._free(c, spare)
        if req.lock is not None:
            self.dec_lock_ref(req.lock)
        req.lock = None
        req.kv_pages = []
        return res

    def cache_unfinished_req(self, req: RequestState, committed_len: int | None = None, *,
                             aux: Mapping[str, Any] | None = None) -> None:
        """Chunked prefill: insert what is computed so far (FULL pages, plus the ``aux``
        payloads given), replace the request's duplicate pages by the tree's, and move its
        lock to the new deepest node.

        The request keeps every page of its own auxiliary components meanwhile (an SWA
        node inserted here is a tombstone until ``cache_finished_req`` recovers it from the
        request's pages). ``aux`` (e.g. ``{"mamba": slot}``: a snapshot slot, not
        ``req.mamba_slot``, holding the state after exactly the committed tokens, which
        must then be page-aligned) is taken over: kept on the end node, or freed here when
        that node already has it or nothing new is inserted.
        """
        ps = self.page_size
        n = self._committed(req, committed_len)
        aligned = n - n % ps
        npages = aligned // ps
        given = [(self._by_name[name], pl) for name, pl in (aux or {}).items() if pl is not None]
        for name in aux or {}:
            if name not in self._by_name or name == self.full.name:
                raise ValueError(f"cache_unfinished_req: no auxiliary component named {name!r}")
        if given and aligned != n:
            raise ValueError(f"cache_unfinished_req: auxiliary data needs a page-aligned committed_len, got {n}")
        if npages == 0 or aligned <= req.prefix_len:
            for c, pl in given:
                spare: list[int] = []
                c.discard(self.core, pl, spare)
                self._free(c, spare)
            return
        res = self.insert_with(InsertParams(req.token_ids[:aligned], req.kv_pages[:npages], req.cache_salt,
                                            prev_prefix_len=req.prefix_len, aux={c.name: pl for c, pl in given}))
        self._free(self.full, req.kv_pages[req.prefix_len // ps:res.prefix_len // ps])
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

    # ================================================================== tiers (§5)
    def nodes_to_write_to_host(self, limit: int | None = None) -> list[TreeNode]:
        """Nodes the write policy wants copied to L2 now, parents before children.

        ``write_through``: every node with L1 data without an L2 copy (FULL's, or an
        auxiliary component's on a node whose FULL pages are in L2 already: an SWA window
        recovered on a tombstone, a Mamba state added later); ``write_through_selective``:
        those with ``hit_count >= write_through_threshold``; ``write_back``: those L1
        eviction queued. Nodes with a transfer in flight are left out. The write-through
        policies look only at the nodes not yet in L2 (``TreeCore.unwritten``), not at all
        of L1.
        """
        if not self.hicache:
            return []
        if self.write_policy == "write_back":
            unwritten = self.core.unwritten
            cands = [n for n in self._write_back_queue
                     if n.parent is not None and n in unwritten and n.data[0].value is not None
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
        """Reserve L2 pages for ``node``'s L1 data that has no L2 copy yet (evicting L2 if
        needed: FULL's by ``evict_host``, an auxiliary component's by tombstoning its own
        L2-only data) and lock the node in L1 until ``finish_write``. A node whose FULL
        pages are in L2 already gets an auxiliary-only write (``transfers`` without
        ``full``). Returns None (nothing changed) if L2 has no room for the FULL pages, or
        nothing is left to write, or the node is not writable (no L1 data, transfer in
        flight); an auxiliary component without room is left out of the write."""
        if not self.hicache:
            raise RuntimeError("start_write needs an L2 allocator")
        core = self.core
        if node.parent is None or node.in_flight or node.loading or node.data[0].value is None:
            return None
        transfers: dict[str, tuple[list[int], PageIndices]] = {}
        for c in self.components:
            cd = node.data[c.slot]
            host = c.host_allocator
            if host is None or cd.value is None or cd.host_value is not None:
                continue
            src = c.as_pages(cd.value)
            dst = host.alloc(len(src))
            if dst is None:
                if c is self.full:
                    self.evict_host((len(src) - host.free_count) * self.page_size)
                else:
                    self._evict_host_aux(c, len(src) - host.free_count)
                dst = host.alloc(len(src))
            if dst is None:
                if c is self.full:
                    for name, (_s, d) in transfers.items():
                        self._free(self._by_name[name], d, host=True)
                    return None
                continue
            transfers[c.name] = (list(src), dst)
        if not transfers:
            return None
        op = TierOp("write", node, self._npages(node), transfers)
        self.full.lock(core, node)
        for c in self.aux:
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
        core = self.core
        nodes = self._op_nodes(op.node, op.npages)
        for n in nodes:
            n.in_flight -= 1
        for c in self.aux:
            for n in c.op_span(nodes):
                core.unlock(n, c.slot)
        self.full.unlock(core, op.node)
        for name, (_src, dst) in op.transfers.items():
            c = self._by_name[name]
            if not ok:
                self._free(c, dst, host=True)
                continue
            span = c.op_span(nodes)
            if len(span) == 1:
                core.set_host(span[0], c.slot, c.from_pages(dst))
                continue
            start = 0
            for n in reversed(span):  # upper first: parents older than children in L2 order
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
        nodes get their L1 ``value`` (FULL, and each auxiliary component's that has L2
        data and finds room) now but stay unreadable (``loading``) until
        ``finish_load_back``; meanwhile the path is L1-locked, the new auxiliary data
        locked, and the nodes host-locked. None (nothing changed) when there is nothing to
        load or no room."""
        core = self.core
        if match.host_hit_length <= 0:
            return None
        top = match.last_device_node
        nodes = []
        n: TreeNode | None = match.last_host_node
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
            src_all.extend(x.data[0].host_value)
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
                core.lock(x, c.slot)  # not evictable until the load finishes
                aux_src.setdefault(c.name, []).extend(pages)
                aux_dst.setdefault(c.name, []).extend(d)
        transfers = {self.full.name: (src_all, dev)}
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
        loaded = {name: set(dst) for name, (_src, dst) in op.transfers.items() if name != self.full.name}
        dev = op.transfers[self.full.name][1]
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
            for c in self.aux:  # the lock start_load_back took on the data it placed here
                cd = x.data[c.slot]
                if cd.value is not None and c.name in loaded and set(c.as_pages(cd.value)) <= loaded[c.name]:
                    core.unlock(x, c.slot)
            if not x.loading:
                # an insert re-filled it with a request's own pages meanwhile: ours are spare
                self._free(self.full, mine)
            elif not ok:
                pages = core.clear_value(x, 0)
                self._free(self.full, pages)
            x.loading = False
            if not ok:
                for c in self.aux:  # what the failed load put there is not valid data
                    cd = x.data[c.slot]
                    if cd.value is not None and c.name in loaded and set(c.as_pages(cd.value)) <= loaded[c.name]:
                        v = core.clear_value(x, c.slot)
                        self._free(c, c.as_pages(v))

    def start_backup(self, node: TreeNode) -> TierOp | None:
        """L3 backup of ``node``'s L2 data: returns its FULL L2 pages and page hashes and,
        for each auxiliary component with L2 data on the node, its L2 units
        (``transfers[name]``) and their L3 keys (``aux_keys[name]``: an SWA page per page, a
        Mamba state for the node's last page), with the node and that data host-locked
        until ``finish_backup``. None if the node has no L2 copy."""
        if node.parent is None or node.data[0].host_value is None:
            return None
        hashes = self.node_hashes(node)
        op = TierOp("backup", node, self._npages(node), {"full": (list(node.data[0].host_value), [])}, hashes)
        for c in self.aux:
            hv = node.data[c.slot].host_value
            if hv is None or c.host_allocator is None:
                continue
            units = list(c.as_pages(hv))
            keys = component_keys(c.name, hashes if c.paged else hashes[-1:])
            if len(keys) != len(units):
                continue
            op.transfers[c.name] = (units, [])
            op.aux_keys[c.name] = keys
            self.core.host_lock(node, c.slot)
        self.core.host_lock(node, 0)
        node.in_flight += 1
        self._open_transfers += 1
        return op

    def finish_backup(self, op: TierOp, ok: bool) -> None:
        """Release the node of a ``start_backup`` (either way; L3 residency is not stored)."""
        self._close(op, "backup")
        nodes = self._op_nodes(op.node, op.npages)
        for n in nodes:
            n.in_flight -= 1
            self.core.host_unlock(n, 0)
        for name in op.aux_keys:
            c = self._by_name[name]
            for n in c.op_span(nodes):
                self.core.host_unlock(n, c.slot)

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
                    *, start_page: int = 0, aux: Mapping[str, Mapping[int, int]] | None = None) -> InsertResult:
        """Insert prefetched pages as L2-only nodes: ``host_pages`` are the FULL L2 pages of
        the key's pages from ``start_page`` on. Pages the tree already holds are freed here,
        as are all of them when the tree no longer holds the key's first ``start_page``
        pages. ``host_pages_taken`` says how many the tree kept.

        ``aux[name]`` maps a page ``j`` of the key (counted from 0, ``j >= start_page``) to an
        auxiliary component's L2 unit: for a paged one (SWA) its page ``j``, for a state
        (Mamba) the state after page ``j``. The new nodes are cut so that a paged
        component's run of pages and a state's boundary fall on node edges; an existing
        node with a FULL L2 copy, no transfer and no such data gets it where it covers the
        node whole (a state: where it ends the node). Every unit the tree does not keep is
        freed here."""
        if not self.hicache:
            raise RuntimeError("insert_host needs an L2 allocator")
        core = self.core
        ps = self.page_size
        key, n = self._aligned(key)
        npages = n // ps
        hp = list(host_pages)
        if len(hp) != npages - start_page:
            raise ValueError("insert_host: host_pages must cover the key from start_page on")
        units: dict[str, dict[int, int]] = {}
        for name, m in (aux or {}).items():
            c = self._by_name.get(name)
            if c is None or c is self.full or c.host_allocator is None:
                raise ValueError(f"insert_host: no auxiliary L2 component {name!r}")
            if any(not start_page <= j < npages for j in m):
                raise ValueError(f"insert_host: {name} pages outside the inserted part of the key")
            units[name] = dict(m)
        root = core.ensure_root(cache_salt)
        path = core.walk(root, key, n)
        have = sum(len(x.key) for x in path)
        node = path[-1] if path else root
        res = InsertResult(have, node)
        if have < start_page * ps:
            self.full.host_allocator.free(hp)  # type: ignore[union-attr]
            self._free_aux_units(units)
            return res
        dup = hp[:have // ps - start_page]
        if dup:
            self.full.host_allocator.free(dup)  # type: ignore[union-attr]
        if units:  # existing nodes past start_page: take what they lack and is given whole
            first = 0
            for x in path:
                k = self._npages(x)
                if first + k > start_page and x.data[0].host_value is not None and not x.in_flight \
                        and not x.loading:
                    self._take_aux(x, first, units)
                first += k
        if have < n:
            cuts = {have // ps, npages}
            for name, m in units.items():
                c = self._by_name[name]
                for j in m:
                    if j >= have // ps:
                        if c.paged:
                            cuts.update((j, j + 1))
                        else:
                            cuts.add(j + 1)
            edges = sorted(cuts)
            if any(not self._by_name[name].paged for name in units) or len(edges) > 2:
                edges = self._merge_edges(edges, units, have // ps)
            parent, made = node, []
            for a, b in zip(edges, edges[1:], strict=False):
                leaf = core.new_child(parent, key[a * ps:b * ps])
                core.set_host(leaf, 0, hp[a - start_page:b - start_page])
                self._take_aux(leaf, a, units)
                made.append(leaf)
                parent = leaf
            core.touch(path + made)
            res.node = made[-1]
            res.host_pages_taken = npages - have // ps
        self._free_aux_units(units)
        return res

    def _merge_edges(self, edges: list[int], units: dict[str, dict[int, int]], lo: int) -> list[int]:
        """Keep only the cuts where a paged component's presence changes or a state
        boundary is: fewer, longer nodes."""
        keep = [edges[0]]
        for e in edges[1:-1]:
            state_edge = any(not self._by_name[name].paged and (e - 1) in m for name, m in units.items())
            change = any(self._by_name[name].paged and ((e - 1) in m) != (e in m) for name, m in units.items())
            if state_edge or change:
                keep.append(e)
        keep.append(edges[-1])
        return keep

    def _take_aux(self, node: TreeNode, first: int, units: dict[str, dict[int, int]]) -> None:
        """Give ``node`` (its key starts at page ``first``) the auxiliary L2 units of
        ``units`` that cover it whole, removing them from ``units``."""
        k = self._npages(node)
        for name, m in units.items():
            c = self._by_name[name]
            if node.data[c.slot].host_value is not None:
                continue
            if c.paged:
                if all(j in m for j in range(first, first + k)):
                    self.core.set_host(node, c.slot, [m.pop(j) for j in range(first, first + k)])
            elif first + k - 1 in m:
                self.core.set_host(node, c.slot, c.from_pages([m.pop(first + k - 1)]))

    def _free_aux_units(self, units: dict[str, dict[int, int]]) -> None:
        for name, m in units.items():
            if m:
                self._free(self._by_name[name], list(m.values()), host=True)
            m.clear()

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
        """Drop every unlocked node with no transfer in flight (L1 and L2), under
        ``write_back`` too (a flush discards; it does not write first)."""
        write_back, self._write_back = self._write_back, False
        try:
            while True:
                before = (self.core.node_count, self.core.dev_total[0], self.core.host_total[0])
                self.evict(full_tokens=(self.core.dev_total[0] + 1) * self.page_size)
                if self.hicache:
                    self.evict_host((self.core.host_total[0] + 1) * self.page_size)
                if (self.core.node_count, self.core.dev_total[0], self.core.host_total[0]) == before:
                    return
        finally:
            self._write_back = write_back

    def check_integrity(self, exact: bool = False) -> None:
        """See ``hicache.tree.integrity.check_integrity``; ``exact`` also proves no leak."""
        from hicache.tree.integrity import check_integrity

        check_integrity(self, exact)
