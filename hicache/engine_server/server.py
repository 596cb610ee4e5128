"""The cache server: the scheduler process's job in engine mode (README "Engine mode").

Engines keep L1 (their own KV blocks and prefix cache); this class keeps the tree of what
L2 and L3 hold for them and answers their connectors: which L2 pages hold a prefix
(``lookup``, locked under a lease), where to save newly computed pages (``reserve``), and
that a save landed (``commit``: inserted in the tree, then backed up to L3 by the tier
manager). Page bytes never pass through here: the engines copy between their KV tensors and
the shared L2 pool themselves.

The tree has no L1 pages (its Full component's L1 allocator is empty): every node is
L2-only, so the tree's L2 eviction (``evict_host``: unlocked leaves, LRU first) is the whole
policy, and ``check_integrity(exact=True)`` holds whenever no lease, reservation or transfer
is open (``check_idle``). Leases: ``hicache.engine_server.leases``.

Not thread-safe: only the process loop calls it. Every handler answers a bad request with an
``EngineError`` (or drops a fire-and-forget one with a warning); none raises for what an
engine sends.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import protos
from hicache.engine_server.geometry import EngineKVGeometry
from hicache.engine_server.leases import Lease, LeaseKind, LeaseTable
from hicache.tier_manager import PrefetchTicket, TierManager
from hicache.tree.cache import MatchResult, UnifiedRadixCache
from hicache.tree.integrity import IntegrityError
from hicache.tree.node import KEY_TYPECODE

log = logging.getLogger("hicache.engine_server")

PREFETCHED_MEMORY = 16384
"""How many (session, request) pairs remember that their prefetch ran, so a request that
vLLM asks about again is not prefetched (and held) a second time."""


@dataclass(frozen=True)
class L2PoolInfo:
    """Where engines map the L2 pool (``EngineRegistered``)."""

    instance: str
    segment: str
    directory: str
    pages: int
    page_bytes: int


@dataclass
class _Query:
    """A lookup whose answer waits for a prefetch: who asked (``peer``, ``req``) and until when."""

    peer: bytes
    req: int
    session: int
    key: array[int]
    cache_salt: str
    deadline: float


@dataclass
class EngineCounters:
    """Monotonic counters for stats and metrics (pages unless the name says otherwise)."""

    lookups: int = 0
    lookup_hit_pages: int = 0
    lookup_storage_pages: int = 0
    loaded_host_pages: int = 0
    loaded_storage_pages: int = 0
    reserved_pages: int = 0
    reserve_short_pages: int = 0
    committed_pages: int = 0
    commit_duplicate_pages: int = 0
    commit_failed_pages: int = 0
    refused: int = 0
    bad_requests: int = 0


class CacheServer:
    """Answers engine connectors over one ``UnifiedRadixCache`` with L2 only.

    ``tier``: the tier manager (L3 backups and prefetches), None without a controller.
    ``defer_s``: how long a lookup's answer may wait for its prefetch (less than the
    engines' lookup timeout). ``clock``: monotonic seconds (tests pass their own).
    """

    def __init__(self, cache: UnifiedRadixCache, tier: TierManager | None, geometry: EngineKVGeometry,
                 pool: L2PoolInfo, lease_ttl_s: float, *, defer_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cache.full.host_allocator is None:
            raise ValueError("the cache server needs a tree with an L2 allocator")
        if cache.page_size != geometry.block_size:
            raise ValueError("the tree's page size must be the engines' block size")
        self.cache = cache
        self.tier = tier
        self.geometry = geometry
        self.pool = pool
        self.leases = LeaseTable(lease_ttl_s)
        self.clock = clock
        self.counters = EngineCounters()
        self._prefetches: dict[tuple[int, str], PrefetchTicket] = {}
        self._prefetched: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._deferred: dict[tuple[int, str], _Query] = {}
        self.defer_s = defer_s
        self.exact_checks = 0
        self.integrity_error: str | None = None
        self._handlers: dict[type, Callable[[Any], protos.Message | None]] = {
            protos.EngineRegister: self.register,
            protos.Reserve: self.reserve,
            protos.Commit: self.commit,
            protos.Release: self.release,
            protos.Heartbeat: self.heartbeat,
        }

    @property
    def host(self) -> Any:
        return self.cache.full.host_allocator

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: protos.Message, peer: bytes = b"") -> protos.Message | None:
        """The answer to one engine message from ``peer``: None for fire-and-forget ones and
        for a deferred lookup (``deliver`` sends its answer later)."""
        if isinstance(msg, protos.Lookup):
            return self.lookup(msg, peer)
        handler = self._handlers.get(type(msg))
        if handler is None:
            return protos.EngineError(getattr(msg, "req", 0), "bad_request",
                                      f"{type(msg).__name__} is not an engine request")
        return handler(msg)

    def _session_error(self, req: int, session: int) -> protos.EngineError:
        return protos.EngineError(req, "unknown_session",
                                  f"session {session} is not open (the daemon restarted or the session expired)")

    def _request_key(self, msg: protos.Lookup | protos.Reserve) -> array[int] | protos.EngineError:
        """Renew the request's session and return its tokens as a key, or the error to answer."""
        if self.leases.touch(msg.session, self.clock()) is None:
            return self._session_error(msg.req, msg.session)
        try:
            return _key(msg.token_ids)
        except ValueError as exc:
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", str(exc))

    # ------------------------------------------------------------------ register
    def register(self, msg: protos.EngineRegister) -> protos.Message:
        theirs = EngineKVGeometry(msg.model_identity, msg.kv_dtype, msg.block_size, msg.num_layers,
                                  msg.num_kv_heads, msg.head_dim, msg.kv_layout)
        problem = self.geometry.mismatch(theirs)
        if problem is None and msg.page_bytes != self.pool.page_bytes:
            problem = f"page_bytes: daemon {self.pool.page_bytes}, engine {msg.page_bytes}"
        if problem is not None:
            self.counters.refused += 1
            log.warning("refused engine %s (pid %d): %s", msg.engine, msg.pid, problem)
            return protos.EngineError(msg.req, "refused", f"this daemon serves other KV pages: {problem}")
        s = self.leases.open_session(msg.engine, msg.pid, self.clock())
        log.info("engine %s (pid %d) registered: session %d", msg.engine, msg.pid, s.session_id)
        p = self.pool
        return protos.EngineRegistered(msg.req, s.session_id, p.instance, p.segment, p.directory, p.pages,
                                       p.page_bytes, self.leases.ttl_s)

    # ------------------------------------------------------------------ lookup
    def lookup(self, msg: protos.Lookup, peer: bytes = b"") -> protos.Message | None:
        """The L2 hit of ``msg.token_ids``, locked under a lease. When L3 may hold the pages
        after it, a prefetch starts and the answer is *deferred* (None here): ``deliver``
        sends it, to ``peer``, once the prefetch is done or ``defer_s`` has passed (then as
        ``pending``: the engine asks again, and that lookup is deferred in turn)."""
        key = self._request_key(msg)
        if isinstance(key, protos.EngineError):
            return key
        self.counters.lookups += 1
        slot = (msg.session, msg.rid)
        query = _Query(peer, msg.req, msg.session, key, msg.cache_salt, self.clock() + self.defer_s)
        if slot in self._prefetches:
            return self._defer(slot, query)
        match = None
        if msg.prefetch and self.tier is not None and self.tier.l3_enabled and slot not in self._prefetched:
            match = self.cache.match_prefix(key, msg.cache_salt)
            if len(key) > match.host_hit_length:
                self._remember_prefetched(slot)
                ticket = self.tier.start_prefetch(msg.rid, key, match, msg.cache_salt)
                if ticket is not None and ticket.policy != "best_effort":
                    self._prefetches[slot] = ticket
                    return self._defer(slot, query)
        return self._answer(query, 0, match)

    def _defer(self, slot: tuple[int, str], query: _Query) -> protos.Message | None:
        ticket = self._prefetches[slot]
        if ticket.ready(self.clock()):
            return self._finish_prefetch(slot, query)
        self._deferred[slot] = query  # a newer ask replaces an older one (its engine gave up)
        return None

    def _finish_prefetch(self, slot: tuple[int, str], query: _Query) -> protos.Message:
        ticket = self._prefetches.pop(slot)
        self._cancel_prefetch(ticket)
        return self._answer(query, ticket.arrived_tokens // self.cache.page_size)

    def _cancel_prefetch(self, ticket: PrefetchTicket) -> None:
        if self.tier is None:  # tickets come from the tier manager: there are none without one
            raise RuntimeError("a prefetch ticket on a cache server without a tier manager")
        self.tier.cancel_prefetch(ticket)

    def deliver(self) -> list[tuple[bytes, protos.Message]]:
        """The deferred lookup answers due now: ``(peer, answer)`` pairs to send."""
        if not self._deferred:
            return []
        now = self.clock()
        out: list[tuple[bytes, protos.Message]] = []
        for slot, query in list(self._deferred.items()):
            ticket = self._prefetches.get(slot)
            if ticket is not None and ticket.ready(now):
                out.append((query.peer, self._finish_prefetch(slot, query)))
            elif ticket is None or now >= query.deadline:
                out.append((query.peer, protos.LookupResult(query.req, pending=ticket is not None)))
            else:
                continue
            del self._deferred[slot]
        return out

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    def _answer(self, query: _Query, storage_pages: int, match: MatchResult | None = None) -> protos.Message:
        """The L2 hit of the query's key now, locked under a lease (none for no hit);
        ``match``: the key's match made a moment ago in this call, if any (not made twice)."""
        if match is None:
            match = self.cache.match_prefix(query.key, query.cache_salt)
        if match.host_hit_length == 0:
            return protos.LookupResult(query.req)
        node = match.last_host_node
        pages = self.cache.host_prefix_pages(node)
        npages = self.cache.protect_host(node)
        storage_pages = min(storage_pages, len(pages))
        lease = self.leases.add(Lease(0, LeaseKind.LOOKUP, query.session, self.clock(), node=node, npages=npages,
                                      storage_pages=storage_pages))
        self.counters.lookup_hit_pages += len(pages)
        self.counters.lookup_storage_pages += storage_pages
        return protos.LookupResult(query.req, lease.lease_id, pages, storage_pages)

    def _remember_prefetched(self, slot: tuple[int, str]) -> None:
        self._prefetched[slot] = None
        while len(self._prefetched) > PREFETCHED_MEMORY:
            self._prefetched.popitem(last=False)

    # ------------------------------------------------------------------ save
    def reserve(self, msg: protos.Reserve) -> protos.Message:
        key = self._request_key(msg)
        if isinstance(key, protos.EngineError):
            return key
        ps = self.cache.page_size
        end = len(key) // ps
        if msg.start_page < 0:
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", f"start_page must be >= 0, got {msg.start_page}")
        held = self.cache.match_prefix(key, msg.cache_salt).host_hit_length // ps
        start = max(msg.start_page, held)
        want = end - start
        if want <= 0:
            return protos.ReserveResult(msg.req, 0, start)
        host = self.host
        if host.free_count < want:
            self.cache.evict_host((want - host.free_count) * ps)
        n = min(want, host.free_count)
        if n < want:
            self.counters.reserve_short_pages += want - n
        if n == 0:
            return protos.ReserveResult(msg.req, 0, start)
        pages = list(host.alloc(n))
        lease = self.leases.add(Lease(0, LeaseKind.RESERVE, msg.session, self.clock(),
                                      key=key[: (start + n) * ps], cache_salt=msg.cache_salt,
                                      start_page=start, pages=pages))
        self.counters.reserved_pages += n
        return protos.ReserveResult(msg.req, lease.lease_id, start, pages)

    def commit(self, msg: protos.Commit) -> None:
        self.leases.touch(msg.session, self.clock())
        lease = self.leases.take(msg.lease, msg.session, LeaseKind.RESERVE)
        if lease is None:
            log.warning("commit of unknown reservation %d (session %d): dropped", msg.lease, msg.session)
            return
        if not msg.ok:
            self.counters.commit_failed_pages += len(lease.pages)
            self.host.free(lease.pages)
            return
        assert lease.key is not None
        res = self.cache.insert_host(lease.key, lease.pages, lease.cache_salt, start_page=lease.start_page)
        self.counters.committed_pages += res.host_pages_taken
        self.counters.commit_duplicate_pages += len(lease.pages) - res.host_pages_taken
        if res.host_pages_taken and self.tier is not None:
            self.tier.back_up(res.node)

    def release(self, msg: protos.Release) -> None:
        self.leases.touch(msg.session, self.clock())
        lease = self.leases.take(msg.lease, msg.session, LeaseKind.LOOKUP)
        if lease is None:
            log.warning("release of unknown lease %d (session %d): dropped", msg.lease, msg.session)
            return
        self._end(lease)
        loaded = max(0, msg.loaded_pages)
        from_storage = min(loaded, lease.storage_pages)
        self.counters.loaded_host_pages += loaded - from_storage
        self.counters.loaded_storage_pages += from_storage

    def heartbeat(self, msg: protos.Heartbeat) -> None:
        if self.leases.touch(msg.session, self.clock()) is None:
            log.debug("heartbeat of unknown session %d", msg.session)

    # ------------------------------------------------------------------ housekeeping
    def _end(self, lease: Lease) -> None:
        """Undo what an open lease holds (release its lock or free its reserved pages)."""
        if lease.kind is LeaseKind.LOOKUP:
            assert lease.node is not None
            self.cache.release_host(lease.node, lease.npages)
        else:
            self.host.free(lease.pages)

    def expire(self) -> int:
        """Expire silent sessions and stale leases; returns how many leases ended."""
        now = self.clock()
        ended = self.leases.expire(now)
        for lease in ended:
            self._end(lease)
        live = self.leases.sessions
        for slot in [s for s in self._prefetches if s[0] not in live]:
            self._cancel_prefetch(self._prefetches.pop(slot))
            self._deferred.pop(slot, None)
        if ended:
            log.warning("expired %d leases of engines that stopped answering", len(ended))
        return len(ended)

    @property
    def idle(self) -> bool:
        return not self.leases.leases and (self.tier is None or not self.tier.in_flight)

    def check_idle(self) -> None:
        """The exact integrity check (no leaked page) when nothing is open. A failure is a
        bug of this daemon, not of an engine: it is logged, kept for ``stats`` (and the
        tests), and serving goes on."""
        if not self.idle:
            return
        try:
            self.cache.check_integrity(exact=True)
            self.exact_checks += 1
        except IntegrityError as exc:
            if self.integrity_error is None:
                log.error("integrity check failed: %s", exc)
            self.integrity_error = str(exc)

    def flush(self) -> int:
        """Drop every unlocked node; returns the tokens freed."""
        before = self.cache.host_evictable_size() + self.cache.host_protected_size()
        self.cache.flush()
        return before - (self.cache.host_evictable_size() + self.cache.host_protected_size())

    def stats(self) -> dict[str, Any]:
        ps = self.cache.page_size
        host = self.host
        reserved = sum(len(x.pages) for x in self.leases.leases.values() if x.kind is LeaseKind.RESERVE)
        out: dict[str, Any] = {
            "mode": "engine",
            "l2": {"full": {"used_tokens": host.used * ps, "capacity_tokens": host.capacity * ps,
                            "reserved_tokens": reserved * ps}},
            "engines": [{"session": s.session_id, "engine": s.engine, "pid": s.pid, "leases": len(s.leases)}
                        for s in self.leases.sessions.values()],
            "leases": {"open": len(self.leases.leases), "expired": self.leases.expired_leases,
                       "expired_sessions": self.leases.expired_sessions},
            "engine": vars(self.counters).copy(),
            "integrity": {"exact_checks": self.exact_checks, "error": self.integrity_error},
        }
        if self.tier is not None:
            out["tiers"] = {**vars(self.tier.counters), "in_flight": self.tier.in_flight}
        return out


def _key(token_ids: list[int]) -> array[int]:
    try:
        return array(KEY_TYPECODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
