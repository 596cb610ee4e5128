"""Tiered replay through the real ``UnifiedRadixCache`` and its tier calls (docs/architecture.md §5).

No processes and no KV bytes: every copy the tree asks for is acknowledged at once
(``start_* -> finish_*(ok=True)``), and what it would have moved is counted.

Per request, in the order the scheduler and ``ControllerDriver`` act:

1. ``match_prefix``: the L1 prefix (``device_len``) and the L2-only run after it.
2. L3 prefetch (L3 on): page hashes after the L1+L2 match are looked up in the L3 store;
   if the consecutive run found is at least ``prefetch_threshold`` tokens, L2 pages are
   reserved (``evict_host`` if needed, with the matched L2 run protected) and the run is
   inserted as L2-only nodes (``insert_host``; s2h), then the request is matched again.
3. Load back (``start_load_back`` / ``finish_load_back``; h2d) of the L2-only run when it
   is at least ``load_back_threshold`` tokens; otherwise it is recomputed.
4. ``insert`` of the whole request (new L1 pages for the part that missed).
5. Writes by the write policy (``start_write`` / ``finish_write``; d2h) and, with L3 on,
   backups of what landed in L2 (``start_backup`` / ``finish_backup``; h2s for pages the
   store did not hold). ``write_through`` writes every L1 node of the request's path that
   has no L2 copy (``write_through_filtered`` too, putting what its filter refuses at L2's
   cold end), ``write_through_selective`` those with ``hit_count`` at the threshold;
   ``write_back`` writes what L1 eviction queued (step 6). ``backup_policy``
   ``filtered`` backs up only what ``_backs_up`` admits.
6. L1 eviction back to its capacity (``evict``; the request's own pages are working
   space until then, as in a server, so L1 holds up to ``l1`` tokens between requests).

Hits: a request's tokens served by L1 (matched on device), L2 (loaded back), L3
(prefetched, then loaded back); the rest is computed. The L3 store is an LRU over page
hashes (or unbounded), as a file store or Redis with ``allkeys-lru`` behaves.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.tree.node import KEY_TYPECODE

if TYPE_CHECKING:
    from hicache.memory.allocator import PageIndices
    from hicache.tree.cache import MatchResult
    from hicache.tree.node import TreeNode

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
BACKUP_POLICIES = ("all", "filtered")


@dataclass(frozen=True)
class SimConfig:
    """One tiered configuration, capacities in *pages* of ``page_tokens`` tokens.

    ``l2_pages`` 0: no L2 (single tier). ``l3_pages`` 0: no L3; None: unbounded L3 (L3
    needs L2, as in the daemon). Thresholds are in tokens.
    """

    l1_pages: int
    l2_pages: int = 0
    l3_pages: int | None = 0
    page_tokens: int = 1
    eviction: str = "lru"
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    load_back_threshold: int = 0
    prefetch_threshold: int = 0
    bytes_per_token: int = 0
    backup_policy: str = "all"

    def validate(self) -> None:
        """``ValueError`` naming the first impossible setting."""
        if self.l1_pages < 1:
            raise ValueError("L1 capacity must be at least one page")
        if self.l2_pages < 0:
            raise ValueError("L2 capacity must be >= 0")
        if self.l3_pages is not None and self.l3_pages < 0:
            raise ValueError("L3 capacity must be >= 0 (or unbounded)")
        if self.l3_enabled and not self.l2_pages:
            raise ValueError("L3 needs L2 (L3 is read into and written from L2)")
        if self.page_tokens < 1 or self.bytes_per_token < 0:
            raise ValueError("page_tokens must be >= 1 and bytes_per_token >= 0")
        if self.backup_policy not in BACKUP_POLICIES:
            raise ValueError(f"backup_policy must be one of {BACKUP_POLICIES}")
        if self.load_back_threshold < 0 or self.prefetch_threshold < 0:
            raise ValueError("thresholds must be >= 0")

    @property
    def l3_enabled(self) -> bool:
        return self.l3_pages is None or self.l3_pages > 0


@dataclass
class TierReport:
    """One tier's figures, in tokens. ``capacity_tokens`` None: unbounded."""

    tier: str
    capacity_tokens: int | None
    hit_tokens: int = 0
    hit_rate: float = 0.0
    evicted_tokens: int = 0


@dataclass
class SimReport:
    """What one replay found. ``bytes_moved`` per direction (d2h, h2d, h2s, s2h)."""

    config: SimConfig
    requests: int
    total_tokens: int
    hit_tokens: int
    tiers: list[TierReport]
    tokens_moved: dict[str, int]
    bytes_moved: dict[str, int]
    seconds: float
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


class _L3Store:
    """Page hashes held by L3: an LRU of ``capacity`` pages (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._pages: OrderedDict[str, None] = OrderedDict()
        self.evicted = 0

    def consecutive(self, hashes: Sequence[str]) -> int:
        n = 0
        for h in hashes:
            if h not in self._pages:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._pages)

    def touch(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            self._pages.move_to_end(h)

    def put(self, hashes: Sequence[str]) -> int:
        """Store pages; returns how many were new (the ones that move)."""
        new = 0
        pages = self._pages
        for h in hashes:
            if h in pages:
                pages.move_to_end(h)
            else:
                pages[h] = None
                new += 1
        if self.capacity is not None:
            while len(pages) > self.capacity:
                pages.popitem(last=False)
                self.evicted += 1
        return new


def _page_list(run: PageIndices) -> list[int]:
    """``run`` as the list it is: the simulator's allocators hand out lists (``array_indices`` off)."""
    if not isinstance(run, list):
        raise TypeError(f"replay: expected a list of page indices, got {type(run).__name__}")
    return run


class TieredSimulator:
    """Replays keys through a fresh cache built for one ``SimConfig``.

    ``tree_page_size``: the cache's page size in key units (1 when keys are page ids,
    ``page_tokens`` when keys are real tokens). ``longest_pages``: the longest request, for
    the L1 working space. Not reusable: one simulator, one replay.
    """

    def __init__(self, cfg: SimConfig, tree_page_size: int, longest_pages: int) -> None:
        from hicache.hashing import HashNamespace, PageHasher
        from hicache.memory.allocator import PageAllocator
        from hicache.tree.admission import Doorkeeper
        from hicache.tree.cache import UnifiedRadixCache
        from hicache.tree.components import FullComponent

        cfg.validate()
        self.cfg = cfg
        self.ps = tree_page_size
        self.l1 = PageAllocator(cfg.l1_pages + longest_pages + 1, "replay-l1", checked=False)
        self.l2 = PageAllocator(cfg.l2_pages, "replay-l2", checked=False) if cfg.l2_pages else None
        ns = HashNamespace("replay", "none", tree_page_size)
        self.cache = UnifiedRadixCache(
            [FullComponent(self.l1, self.l2)], tree_page_size, hasher=PageHasher(ns),
            eviction_policy=cfg.eviction, write_policy=cfg.write_policy,
            write_through_threshold=cfg.write_through_threshold)
        self.l3 = _L3Store(cfg.l3_pages) if cfg.l3_enabled else None
        self.l3_doorkeeper = Doorkeeper()
        self.pages = {d: 0 for d in DIRECTIONS}
        self.hits = [0, 0, 0]  # pages served by L1, L2, L3
        self.total = 0
        self.l1_evicted = 0
        self.l2_taken = 0  # L2 pages the tree took (written or prefetched)

    # ------------------------------------------------------------------ one request
    def step(self, key: array[int]) -> None:
        cache, cfg, ps = self.cache, self.cfg, self.ps
        npages = len(key) // ps
        self.total += npages
        m = cache.match_prefix(key)
        dev = m.device_len // ps
        host = m.host_hit_length // ps
        storage = 0
        if self.l3 is not None:
            got = self._prefetch(key, m, npages)
            if got:
                storage = got
                m = cache.match_prefix(key)
                host = min(host, m.host_hit_length // ps)
        cache.record_hit(m)  # the request is served now: one hit counted
        loaded = 0
        pages = _page_list(m.device_indices)
        last = m.last_device_node
        have = m.device_len // ps
        if m.host_hit_length > 0 and m.host_hit_length * self._unit >= cfg.load_back_threshold:
            op = cache.tiers.start_load_back(m)
            if op is not None:
                cache.tiers.finish_load_back(op, True)
                loaded = op.npages
                self.pages["h2d"] += loaded
                pages = pages + _page_list(op.dst_pages)
                last = m.last_host_node
                have += loaded
        from_l2 = min(host, loaded)
        self.hits[0] += dev
        self.hits[1] += from_l2
        self.hits[2] += min(storage, loaded - from_l2)
        fresh = self.l1.alloc(npages - have)
        if fresh is None:  # pragma: no cover - the pool keeps room for the longest request
            raise RuntimeError("replay: L1 working space exhausted")
        new = _page_list(fresh)
        lock = cache.inc_lock_ref(last) if last.parent is not None else None
        res = cache.insert(key, pages + new, prev_prefix_len=have * ps)
        dup = (pages + new)[have:res.prefix_len // ps]
        if dup:
            self.l1.free(dup)
        if lock is not None:
            cache.dec_lock_ref(lock)
        if self.l2 is not None and cfg.write_policy != "write_back":
            self._write_path(res.node)
        self._evict_l1()

    @property
    def _unit(self) -> int:
        """Tokens per key unit."""
        return self.cfg.page_tokens // self.ps if self.ps > 1 else self.cfg.page_tokens

    # ------------------------------------------------------------------ tiers
    def _prefetch(self, key: array[int], m: MatchResult, npages: int) -> int:
        cache, ps, l3 = self.cache, self.ps, self.l3
        assert l3 is not None  # step prefetches only with L3 on
        start = (m.device_len + m.host_hit_length) // ps
        rest = npages - start
        if rest <= 0 or rest * self.cfg.page_tokens < max(self.cfg.prefetch_threshold, 1):
            return 0
        node = m.last_host_node
        parent = cache.hashes.last_page_hash(node) if node.parent is not None else None
        hashes = cache.hashes.hasher_for("").hash_pages(key[start * ps:npages * ps], parent)
        n = l3.consecutive(hashes)
        if n == 0 or n * self.cfg.page_tokens < max(self.cfg.prefetch_threshold, 1):
            return 0
        l2 = self.l2
        assert l2 is not None  # L3 implies L2 (SimConfig.validate)
        if l2.free_count < n:
            guard = cache.host.protect_host(node) if node.parent is not None and node.host_value is not None else None
            cache.host.evict_host((n - l2.free_count) * ps)
            if guard is not None:
                cache.host.release_host(node, guard)
        n = min(n, l2.free_count)
        got = l2.alloc(n) if n else None
        if not got:
            return 0
        l3.touch(hashes[:n])
        self.pages["s2h"] += n
        res = cache.host.insert_host(key[:(start + n) * ps], got, start_page=start)
        self.l2_taken += res.host_pages_taken
        return res.host_pages_taken

    def _write_node(self, node: TreeNode) -> None:
        cache = self.cache
        op = cache.tiers.start_write(node)
        if op is None:
            return
        cache.tiers.finish_write(op, True)
        self.pages["d2h"] += op.npages
        self.l2_taken += op.npages
        if self.l3 is not None and self._backs_up(op.node):
            bop = cache.tiers.start_backup(op.node)
            if bop is not None:
                self.pages["h2s"] += self.l3.put(bop.hashes)
                cache.tiers.finish_backup(bop, True)

    def _backs_up(self, node: TreeNode) -> bool:
        """``backup_policy``: ``all`` backs up every L2 write; ``filtered`` only while the L3
        store has room (unbounded: always), a node a match has hit, or one whose first page
        hash came back in another node (the L3 doorkeeper)."""
        l3 = self.l3
        if self.cfg.backup_policy == "all" or l3 is None or l3.capacity is None:
            return True
        if node.hit_count >= 1 or len(l3) + len(node.data[0].host_value or ()) <= l3.capacity:
            return True
        return self.l3_doorkeeper.seen_before(self.cache.hashes.node_hashes(node)[0], node.id)

    def _write_path(self, node: TreeNode) -> None:
        admits = self.cache.tiers.admits
        path: list[TreeNode] = []
        n = node
        while n.parent is not None:
            d = n.data[0]
            if d.host_value is not None:
                break  # written parents first: everything above already has its copy
            if d.value is not None and admits(n):
                path.append(n)
            n = n.parent
        for n in reversed(path):
            self._write_node(n)

    def _evict_l1(self) -> None:
        cache, core = self.cache, self.cache.core
        write_back = self.l2 is not None and self.cfg.write_policy == "write_back"
        over = core.dev_total[0] - self.cfg.l1_pages
        while over > 0:
            freed = cache.evict(over * self.ps).full_tokens // self.ps
            self.l1_evicted += freed
            wrote = 0
            if write_back:
                for n in cache.tiers.nodes_to_write_to_host():
                    self._write_node(n)
                    wrote += 1
            if not freed and not wrote:
                break
            over = core.dev_total[0] - self.cfg.l1_pages

    # ------------------------------------------------------------------ result
    def report(self, seconds: float) -> SimReport:
        cfg, u = self.cfg, self.cfg.page_tokens
        total = self.total * u
        l2_total = self.cache.core.host_total[0]

        def tier(name: str, cap: int | None, hits: int, evicted: int) -> TierReport:
            return TierReport(name, cap, hits * u, hits / self.total if self.total else 0.0, evicted * u)

        tiers = [tier("L1", cfg.l1_pages * u, self.hits[0], self.l1_evicted)]
        if self.l2 is not None:
            tiers.append(tier("L2", cfg.l2_pages * u, self.hits[1], self.l2_taken - l2_total))
        if self.l3 is not None:
            cap = None if cfg.l3_pages is None else cfg.l3_pages * u
            tiers.append(tier("L3", cap, self.hits[2], self.l3.evicted))
        moved = {d: p * u for d, p in self.pages.items()}
        return SimReport(cfg, 0, total, sum(self.hits) * u, tiers, moved,
                         {d: t * cfg.bytes_per_token for d, t in moved.items()}, seconds)


def simulate(keys: Sequence[Sequence[int]], cfg: SimConfig, tree_page_size: int = 1,
             progress: Callable[[int], None] | None = None,
             longest_pages: int | None = None) -> SimReport:
    """Replay ``keys`` (one per request, in key units of the tree) under ``cfg``.

    ``progress(n)`` is called every few hundred requests with the number done since the
    last call; ``longest_pages`` (the longest request) is computed from ``keys`` when not
    given. Raises ``ValueError`` for an impossible ``cfg``.
    """
    longest = (max((len(k) for k in keys), default=0) // tree_page_size
               if longest_pages is None else longest_pages)
    sim = TieredSimulator(cfg, tree_page_size, longest)
    t0 = time.perf_counter()
    step = sim.step
    done = 0
    for i, key in enumerate(keys):
        if type(key) is not array:
            key = array(KEY_TYPECODE, key)
        step(key)
        if progress is not None and i - done >= 255:
            progress(i + 1 - done)
            done = i + 1
    if progress is not None and len(keys) > done:
        progress(len(keys) - done)
    rep = sim.report(time.perf_counter() - t0)
    rep.requests = len(keys)
    return rep
