"""UnifiedRadixCache: the layer the scheduler calls (docs/architecture.md §4, node state of §5).

The tree decides; this class executes the decisions against the index allocators it was
given (one L1 allocator per component, plus one L2 allocator per component when L2 is on).
It never touches KV bytes: the tier-facing calls return *which* pages to copy, and the
cache controller (another process) copies them and acknowledges.

This module holds the tree semantics: match, insert, locks, sizes, requests, flush and the
integrity check; L1 eviction is ``L1Eviction``'s (``hicache.tree.eviction``), which this
class derives from. It holds the tier-facing parts: the transfers between tiers
(``TierCalls``, ``hicache.tree.tiering``) as ``tiers``, the L2-only calls with L2 eviction
(``HostCalls``, ``hicache.tree.host``) as ``host``, the page hashes (``PageHashes``,
``hicache.tree.hashes``) as ``hashes``; the state, the result types and the helpers they all
use are ``CacheBase``'s, in ``hicache.tree.base``, under ``L1Eviction``.

Ownership of page indices in the tree's calls (Full component; SWA behaves alike, Mamba with
one slot; L1 eviction's row is in ``hicache.tree.eviction``'s table, the transfers' in
``hicache.tree.tiering``'s, the L2-only calls' in ``hicache.tree.host``'s):

| step                                   | freed                         | kept / taken by the tree      | locked meanwhile                |
|----------------------------------------|-------------------------------|-------------------------------|---------------------------------|
| ``match_prefix``                       | -                             | -                             | - (caller locks what it uses)   |
| ``insert(key, value, prev_prefix_len)``| nothing; caller frees         | ``value[prefix_len:]`` pages; | -                               |
|                                        | ``value[prev:prefix_len]``    | pages re-filling L2-only nodes|                                 |
| ``insert_with`` SWA/Mamba values       | duplicates freed here         | the rest                      | -                               |

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

from hicache.hashing import HashNamespace, PageHasher
from hicache.tree.base import WRITE_POLICIES, EvictResult, InsertResult, MatchResult
from hicache.tree.components import (
    RELEASED,
    MambaComponent,
    NoRoom,
    SWAComponent,
    TreeComponent,
    Validator,
)
from hicache.tree.eviction import L1Eviction, NodeFilter
from hicache.tree.hashes import PageHashes
from hicache.tree.host import HostCalls
from hicache.tree.integrity import SLICE_UNITS, IntegrityWalker, check_integrity
from hicache.tree.node import KEY_ITEMSIZE, ComponentData, ComponentType, LockToken, TreeNode
from hicache.tree.request_state import RequestState
from hicache.tree.tiering import TierCalls, TierOp

__all__ = [
    "WRITE_POLICIES", "EvictResult", "InsertParams", "InsertResult", "LockToken", "MatchResult", "RequestState",
    "TierOp", "UnifiedRadixCache",
]

_NO_VALIDATORS: list[Validator] = []


@dataclass(frozen=True)
class InsertParams:
    """Everything ``UnifiedRadixCache.insert_with`` takes (see there for who owns what).

    ``key``: token ids (page-aligned part used); ``value``: FULL L1 pages, one per page of
    the key; ``prev_prefix_len``: the first tokens whose pages are already the tree's (the
    request's match); ``aux``: per component name, that component's payload (SWA: a
    ``PagedInsert``; Mamba: the state slot after the key's last token), taken over entirely.
    ``owner``: the node the inserting request's own lock ends at, if it holds one: a leaf
    that no other lock holds may then grow in place (``extend_leaves``).
    """

    key: Sequence[int]
    value: Sequence[int]
    cache_salt: str = ""
    prev_prefix_len: int = 0
    aux: Mapping[str, Any] = field(default_factory=dict)
    owner: TreeNode | None = None


class UnifiedRadixCache(L1Eviction):
    """One radix tree over FULL plus any auxiliary components, with L1 and optional L2 state.

    ``components``: a ``FullComponent`` first (the primary: its data decides whether a node
    lives), then any auxiliary components with distinct names (SWA, Mamba, or another
    ``TreeComponent``); the tree handles them only through their hooks. A component built
    with a ``host_allocator`` has L2 state (L2 is on when FULL has one).
    ``hasher``: a ``PageHasher`` or ``HashNamespace`` for page hashes (computed lazily, on
    the tier path only; other salts derive from it with ``with_salt``).
    ``eviction_policy``: a name in ``hicache.tree.policy.POLICIES`` (default ``lru``). ``write_policy``: ``write_through``,
    ``write_through_selective`` (``hit_count >= write_through_threshold``) or ``write_back``.

    Scheduler calls: ``match_prefix`` (a peek) and ``record_hit``, ``inc_lock_ref`` / ``dec_lock_ref``, ``insert`` /
    ``insert_with``, ``evict`` / ``evict_units``, ``cache_finished_req``,
    ``cache_unfinished_req``, ``evictable_size`` / ``protected_size`` / ``total_size``,
    ``flush``, ``check_integrity``.
    Tier calls: on ``tiers``, ``host`` and ``hashes`` (the module docstring names them).
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
        super().__init__(components, page_size, eviction_policy=eviction_policy, write_policy=write_policy,
                         write_through_threshold=write_through_threshold)
        self.hashes = PageHashes(self, hasher)
        """The page hashes (L3 names of the nodes' pages)."""
        self.host = HostCalls(self)
        """The L2-only calls (host locks, prefetched inserts, L2 eviction)."""
        self.tiers = TierCalls(self, self, self.host, self.hashes)
        """The transfers (L2 writes, load-backs, L3 backups)."""
        self._integrity_walker: IntegrityWalker | None = None

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

    # ================================================================== match
    def match_prefix(self, key: Sequence[int], cache_salt: str = "", *, copy_on_match: bool = True) -> MatchResult:
        """Longest cached prefix of ``key`` valid for every component.

        A peek: it changes no access time, LRU order or ``hit_count`` (a request waiting in
        a queue is matched on every scheduling pass, an engine's request on every ask);
        ``record_hit`` counts the hit once, when the request is admitted or its lease taken.
        It only splits a node where the key forks inside it (and stops there), which changes
        the tree's shape, never what it holds. The L2-only part after a fully
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
        if best == 0:
            indices = self._empty()
        else:
            indices = path[0].data[0].value[:]  # a copy, of the allocator's index kind
            for j in range(1, best):
                indices.extend(path[j].data[0].value)
        last_dev = path[best - 1] if best else root
        res = MatchResult(indices, last_dev, last_dev, 0, len(indices) * self.page_size, walked_node=path[-1],
                          path=path, shape_version=core.shape_version)
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

    def record_hit(self, res: MatchResult) -> None:
        """Count one hit for the request that made the match ``res``: ``hit_count + 1`` on
        every node of its matched path (root side first) and each of them refreshed as just
        used (access times, every LRU order). Call it once per request, when it is admitted
        or its lease taken. If the tree removed a node of the path since the match (a
        removed node has no parent: it no longer leads to its root), nothing is counted.
        While the tree's shape is as the match saw it, the match's own path is used."""
        if res.path is not None and res.shape_version == self.core.shape_version:
            path = res.path
        else:  # split or removed since: walk up from the deepest node, as the tree is now
            node = res.walked_node
            path = []
            while node is not None and node.parent is not None:
                path.append(node)
                node = node.parent
            if node is None or node.salt is None or self.core.root(node.salt) is not node:
                return
            path.reverse()
        for n in path:
            n.hit_count += 1
        self.core.touch(path)

    def _copy_on_match(self, res: MatchResult) -> None:
        node = res.last_device_node
        for c in self.aux:
            try:
                v = c.copy_on_match(self.core, node, partial(self._evict_component, c, 1))
            except NoRoom:
                for name, got in res.copies.items():  # give back the copies made so far
                    done = self._by_name[name]
                    self._free(done, done.as_pages(got))
                root = self.core.root(self.salt_of(node)) or self._void_root
                res.device_indices, res.last_device_node, res.last_host_node = self._empty(), root, root
                res.device_len = res.host_hit_length = 0
                res.copies = {}
                return
            if v is not None:
                res.copies[c.name] = v

    # ================================================================== insert
    def insert(self, key: Sequence[int], value: Sequence[int], cache_salt: str = "", *,
               prev_prefix_len: int = 0) -> InsertResult:
        """Insert ``key`` with FULL L1 pages ``value`` only: ``insert_with`` of
        ``InsertParams(key, value, cache_salt, prev_prefix_len)`` (same contract), without
        building the parameter object."""
        return self._insert(key, value, cache_salt, prev_prefix_len, None, None)

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
        return self._insert(p.key, p.value, p.cache_salt, p.prev_prefix_len, p.aux or None, p.owner)

    def _insert(self, key: Sequence[int], value: Sequence[int], cache_salt: str, prev_prefix_len: int,
                aux: Mapping[str, Any] | None, owner: TreeNode | None) -> InsertResult:
        """The body of ``insert`` / ``insert_with``; ``aux`` None: no auxiliary payloads;
        ``owner``: ``InsertParams.owner``."""
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
        kb = key.tobytes()  # edges compared in place, as in ``TreeCore.walk``
        page_bytes = ps * KEY_ITEMSIZE
        while off < n:
            at = off * KEY_ITEMSIZE
            child = node.children.get(key[off] if ps == 1 else kb[at:at + page_bytes])
            if child is None:
                break
            ckey = child.key
            kl = len(ckey)
            if off + kl > n or not kb.startswith(ckey, at):
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
        if off < n and not payloads and self._extendable(node, owner):
            core.extend(node, key[off:n], value[off // ps:npages])
            off = n
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

    def _extendable(self, node: TreeNode, owner: TreeNode | None) -> bool:
        """Whether an insert may append its new pages to ``node`` in place rather than hang a
        child under it (``extend_leaves``): a FULL-only leaf on L1 that no lock holds but the
        inserting request's own (``owner is node``: pages appended under another holder's
        lock would stay unevictable until that holder lets go), with no L2 copy, no page
        hashes (so no content observer has named its pages), no transfer, no write queued,
        and no auxiliary component's data or lock, so every component's boundaries stay
        where they were."""
        if not self.extend_leaves or node.children or node.parent is None or node.loading or node.in_flight:
            return False
        full = node.data[0]
        if (full.value is None or full.host_value is not None or full.lock_ref > (owner is node)
                or full.host_lock_ref
                or node.hash_value is not None or self.core.observer is not None):
            return False
        for cd in node.data[1:]:
            if cd.value is not None or cd.host_value is not None or cd.lock_ref or cd.host_lock_ref:
                return False
        return node not in self._write_back_queue

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
            if p is not RELEASED:  # given back early by ``release_part``
                c.unlock(self.core, node, p)

    def lock_cost(self, node: TreeNode) -> dict[str, int]:
        """What ``inc_lock_ref(node)`` would take out of what eviction can free now, per
        component name, in the component's units (pages, or states; a component it leaves
        alone is absent): the data on its span that no lock protects yet. Measured by taking the lock
        and giving it back, so it is exactly what each component's own lock does; nothing
        changes but where an SWA lock marks its boundary."""
        before = list(self.core.dev_prot)
        token = self.inc_lock_ref(node)
        after = list(self.core.dev_prot)
        self.dec_lock_ref(token)
        return {c.name: after[c.slot] - before[c.slot] for c in self.components if after[c.slot] != before[c.slot]}

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
                                                prev_prefix_len=req.prefix_len, aux=aux,
                                                owner=None if req.lock is None else req.lock.node))
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
        ``req.aux["mamba"]``, holding the state after exactly the committed tokens, which
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
                                            prev_prefix_len=req.prefix_len, aux={c.name: pl for c, pl in given},
                                            owner=None if req.lock is None else req.lock.node))
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

    # ================================================================== misc
    def flush(self, may_evict: NodeFilter | None = None) -> None:
        """Drop every unlocked node with no transfer in flight (L1 and L2), under
        ``write_back`` too (a flush discards; it does not write first). ``may_evict``: only
        the nodes it accepts (one tenant's namespaces)."""
        write_back, self._write_back = self._write_back, False
        try:
            while True:
                before = (self.core.node_count, self.core.dev_total[0], self.core.host_total[0])
                self.evict((self.core.dev_total[0] + 1) * self.page_size, may_evict)
                if self.hicache:
                    self.host.evict_host((self.core.host_total[0] + 1) * self.page_size, may_evict)
                if (self.core.node_count, self.core.dev_total[0], self.core.host_total[0]) == before:
                    return
        finally:
            self._write_back = write_back

    def check_integrity(self, exact: bool = False) -> None:
        """The whole check at once (tests, an operator's request): see
        ``hicache.tree.integrity.check_integrity``; ``exact`` also proves no leak."""
        check_integrity(self, exact)

    def check_integrity_slice(self, exact: bool = False, budget: int | None = None) -> bool:
        """The idle check: one bounded slice of the same check (``budget`` nodes plus pages,
        default ``hicache.tree.integrity.SLICE_UNITS``), resuming where the last call
        stopped; True when this call ended a round whose totals were compared (see
        ``IntegrityWalker.step``). Raises ``IntegrityError`` like ``check_integrity``."""
        if self._integrity_walker is None:
            self._integrity_walker = IntegrityWalker(self)
        return self._integrity_walker.step(SLICE_UNITS if budget is None else budget, exact)
