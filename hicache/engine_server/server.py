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

Each daemon start has a random ``run``; every message an engine sends carries the run of its
session, and one of another run is refused (``stale_run``) before it touches anything. Each
session has a *namespace* from the engine's runtime identity (version, attention kernel,
options, reset generation): the server prefixes every cache salt of the session with it, so
engines whose KV bytes could differ never share a page in L2, nor (the salt is part of every
page hash) in L3.

Not thread-safe: only the process loop calls it. Every handler answers a bad request with an
``EngineError`` (or drops a fire-and-forget one with a warning); none raises for what an
engine sends.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import protos
from hicache.engine_server.geometry import EngineKVGeometry
from hicache.engine_server.leases import EngineProcess, Lease, LeaseKind, LeaseTable, Session
from hicache.engine_server.request_tokens import RequestTokens
from hicache.tier_manager import PrefetchTicket, TierManager
from hicache.tree.cache import MatchResult, UnifiedRadixCache
from hicache.tree.integrity import IntegrityError
from hicache.tree.node import KEY_TYPECODE

log = logging.getLogger("hicache.engine_server")

PREFETCHED_MEMORY = 16384
"""How many (session, request) pairs remember that their prefetch ran, so a request that
vLLM asks about again is not prefetched (and held) a second time."""

REQUEST_MEMORY_TOKENS = 1 << 26
"""Tokens the server keeps of running requests at most, 256 MiB as keys (``RequestTokens``)."""

_IDENTITY = re.compile(r"[0-9a-f]{64}")
NAMESPACE_CHARS = 32
"""Hex characters of the runtime identity that prefix a session's salts (128 bits)."""


def namespaced_salt(namespace: str, cache_salt: str) -> str:
    """The salt the tree and the page hashes see for a session's ``cache_salt``."""
    return f"{namespace}:{cache_salt}"


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
    stale_run: int = 0
    """Messages of an earlier daemon run (refused or dropped)."""
    unknown_requests: int = 0
    """Reserves that named tokens the server did not hold (``unknown_request``)."""
    reserves: int = 0
    """Reserve messages served."""
    reserve_tokens_received: int = 0
    """Token ids received in Reserves (with ``base``, only the new ones)."""
    orphans_ended_late: int = 0
    """Orphaned leases ended by their late Release / Commit."""
    orphans_ended_gone: int = 0
    """Orphaned leases ended because their engine process is gone."""


class CacheServer:
    """Answers engine connectors over one ``UnifiedRadixCache`` with L2 only.

    ``tier``: the tier manager (L3 backups and prefetches), None without a controller.
    ``defer_s``: how long a lookup's answer may wait for its prefetch (less than the
    engines' lookup timeout). ``clock``: monotonic seconds (tests pass their own). ``run``:
    this daemon run's number (default: random). ``leases``: the lease table (default: one
    with ``lease_ttl_s`` that watches engine processes through /proc).
    """

    def __init__(self, cache: UnifiedRadixCache, tier: TierManager | None, geometry: EngineKVGeometry,
                 pool: L2PoolInfo, lease_ttl_s: float, *, defer_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, run: int | None = None,
                 leases: LeaseTable | None = None) -> None:
        if cache.full.host_allocator is None:
            raise ValueError("the cache server needs a tree with an L2 allocator")
        if cache.page_size != geometry.block_size:
            raise ValueError("the tree's page size must be the engines' block size")
        self.cache = cache
        self.tier = tier
        self.geometry = geometry
        self.pool = pool
        self.leases = leases if leases is not None else LeaseTable(lease_ttl_s)
        self.run = run if run is not None else secrets.randbits(62) + 1
        self.clock = clock
        self.counters = EngineCounters()
        self._prefetches: dict[tuple[int, str], PrefetchTicket] = {}
        self._prefetched: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._deferred: dict[tuple[int, str], _Query] = {}
        self.requests = RequestTokens(REQUEST_MEMORY_TOKENS)
        self.defer_s = defer_s
        self.exact_checks = 0
        self.integrity_error: str | None = None
        self._handlers: dict[type, Callable[[Any], protos.Message | None]] = {
            protos.EngineRegister: self.register,
            protos.Reserve: self.reserve,
            protos.Commit: self.commit,
            protos.Release: self.release,
            protos.Heartbeat: self.heartbeat,
            protos.Finished: self.finished,
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

    def _stale(self, run: int) -> bool:
        """Whether a message carries another daemon run's number (counted)."""
        if run == self.run:
            return False
        self.counters.stale_run += 1
        return True

    def _request_key(self, msg: protos.Lookup | protos.Reserve
                     ) -> tuple[Session, array[int]] | protos.EngineError:
        """Renew the request's session and return it with the tokens as a key, or the error to answer."""
        if self._stale(msg.run):
            return protos.EngineError(msg.req, "stale_run", f"run {msg.run} is not this daemon's run (it restarted)")
        session = self.leases.touch(msg.session, self.clock())
        if session is None:
            return self._session_error(msg.req, msg.session)
        try:
            return session, _key(msg.token_ids)
        except ValueError as exc:
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", str(exc))

    # ------------------------------------------------------------------ register
    def register(self, msg: protos.EngineRegister) -> protos.Message:
        theirs = EngineKVGeometry(msg.model_identity, msg.kv_dtype, msg.block_size, msg.num_layers,
                                  msg.num_kv_heads, msg.head_dim, msg.kv_layout)
        if not _IDENTITY.fullmatch(msg.runtime_identity):
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", "runtime_identity must be 64 lowercase hex characters")
        problem = self.geometry.mismatch(theirs)
        if problem is None and msg.page_bytes != self.pool.page_bytes:
            problem = f"page_bytes: daemon {self.pool.page_bytes}, engine {msg.page_bytes}"
        if problem is not None:
            self.counters.refused += 1
            log.warning("refused engine %s (pid %d): %s", msg.engine, msg.pid, problem)
            return protos.EngineError(msg.req, "refused", f"this daemon serves other KV pages: {problem}")
        process = EngineProcess(msg.pid, msg.pid_namespace, msg.start_time)
        namespace = msg.runtime_identity[:NAMESPACE_CHARS]
        s = self.leases.open_session(msg.engine, process, namespace, self.clock())
        log.info("engine %s (pid %d) registered: session %d, namespace %s", msg.engine, msg.pid, s.session_id,
                 namespace)
        p = self.pool
        return protos.EngineRegistered(msg.req, s.session_id, self.run, p.instance, p.segment, p.directory, p.pages,
                                       p.page_bytes, self.leases.ttl_s)

    # ------------------------------------------------------------------ lookup
    def lookup(self, msg: protos.Lookup, peer: bytes = b"") -> protos.Message | None:
        """The L2 hit of ``msg.token_ids``, locked under a lease. When L3 may hold the pages
        after it, a prefetch starts and the answer is *deferred* (None here): ``deliver``
        sends it, to ``peer``, once the prefetch is done or ``defer_s`` has passed (then as
        ``pending``: the engine asks again, and that lookup is deferred in turn)."""
        got = self._request_key(msg)
        if isinstance(got, protos.EngineError):
            return got
        session, key = got
        salt = namespaced_salt(session.namespace, msg.cache_salt)
        self.counters.lookups += 1
        slot = (msg.session, msg.rid)
        self.requests.set(slot, key)
        query = _Query(peer, msg.req, msg.session, key, salt, self.clock() + self.defer_s)
        if slot in self._prefetches:
            return self._defer(slot, query)
        match = None
        if msg.prefetch and self.tier is not None and self.tier.l3_enabled and slot not in self._prefetched:
            match = self.cache.match_prefix(key, salt)
            if len(key) > match.host_hit_length:
                self._remember_prefetched(slot)
                ticket = self.tier.start_prefetch(msg.rid, key, match, salt)
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
        """L2 pages for the pages of the prefix that L2 lacks: from the first one it lacks,
        which may be before ``msg.start_page`` (pages saved earlier and evicted since: the
        tree can only take pages that continue what it holds, so a gap would make every
        later save of the request wasted)."""
        got = self._request_key(msg)
        if isinstance(got, protos.EngineError):
            return got
        session, key = got
        if msg.start_page < 0 or msg.base < 0:
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", "start_page and base must be >= 0, got "
                                                              f"{msg.start_page} and {msg.base}")
        slot = (msg.session, msg.rid)
        self.counters.reserves += 1
        self.counters.reserve_tokens_received += len(key)
        if msg.base:
            held = self.requests.get(slot)
            if held is None or len(held) < msg.base:
                self.counters.unknown_requests += 1
                return protos.EngineError(msg.req, "unknown_request",
                                          f"request {msg.rid!r} has no {msg.base} tokens here: send them all")
            key = held[: msg.base] + key
        self.requests.set(slot, key)
        salt = namespaced_salt(session.namespace, msg.cache_salt)
        ps = self.cache.page_size
        end = len(key) // ps
        start = self.cache.match_prefix(key, salt).host_hit_length // ps
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
                                      key=key[: (start + n) * ps], cache_salt=salt,
                                      start_page=start, pages=pages))
        self.counters.reserved_pages += n
        return protos.ReserveResult(msg.req, lease.lease_id, start, pages)

    def commit(self, msg: protos.Commit) -> None:
        if self._stale(msg.run):
            return
        self.leases.touch(msg.session, self.clock())
        lease = self.leases.take(msg.lease, msg.session, LeaseKind.RESERVE)
        if lease is None:
            self._end_orphan(msg.lease, msg.session, LeaseKind.RESERVE)
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
        if self._stale(msg.run):
            return
        self.leases.touch(msg.session, self.clock())
        lease = self.leases.take(msg.lease, msg.session, LeaseKind.LOOKUP)
        if lease is None:
            self._end_orphan(msg.lease, msg.session, LeaseKind.LOOKUP)
            return
        self._end(lease)
        loaded = max(0, msg.loaded_pages)
        from_storage = min(loaded, lease.storage_pages)
        self.counters.loaded_host_pages += loaded - from_storage
        self.counters.loaded_storage_pages += from_storage

    def heartbeat(self, msg: protos.Heartbeat) -> None:
        if self._stale(msg.run):
            return
        if self.leases.touch(msg.session, self.clock()) is None:
            log.debug("heartbeat of unknown session %d", msg.session)

    def finished(self, msg: protos.Finished) -> None:
        if self._stale(msg.run):
            return
        self.leases.touch(msg.session, self.clock())
        self.requests.forget((msg.session, msg.rid))

    def _end_orphan(self, lease_id: int, session: int, kind: LeaseKind) -> None:
        """The late Release / Commit of an expired session's lease: the engine is done with
        its pages, which are unlocked or freed now (a late commit's pages are never inserted)."""
        orphan = self.leases.take_orphan(lease_id, session, kind)
        if orphan is None:
            log.warning("%s of unknown lease %d (session %d): dropped", kind.value, lease_id, session)
            return
        self._end(orphan)
        self.counters.orphans_ended_late += 1

    # ------------------------------------------------------------------ housekeeping
    def _end(self, lease: Lease) -> None:
        """Undo what an open lease holds (release its lock or free its reserved pages)."""
        if lease.kind is LeaseKind.LOOKUP:
            assert lease.node is not None
            self.cache.release_host(lease.node, lease.npages)
        else:
            self.host.free(lease.pages)

    def expire(self) -> int:
        """Expire silent sessions (their leases become orphans) and end the orphans whose
        engine process is gone; returns how many leases became orphans."""
        expired_before = self.leases.expired_sessions
        orphaned = self.leases.expire(self.clock())
        live = self.leases.sessions
        for slot in [s for s in self._prefetches if s[0] not in live]:
            self._cancel_prefetch(self._prefetches.pop(slot))
            self._deferred.pop(slot, None)
        if self.leases.expired_sessions != expired_before:
            self.requests.keep_sessions(live)
        if orphaned:
            log.warning("%d leases of engines that stopped answering are held until those engines are seen "
                        "gone or answer", orphaned)
        for lease in self.leases.ended_orphans():
            self._end(lease)
            self.counters.orphans_ended_gone += 1
        return orphaned

    @property
    def idle(self) -> bool:
        return (not self.leases.leases and not self.leases.orphans
                and (self.tier is None or not self.tier.in_flight))

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
            "engines": [{"session": s.session_id, "engine": s.engine, "pid": s.process.pid,
                         "namespace": s.namespace, "leases": len(s.leases)}
                        for s in self.leases.sessions.values()],
            "leases": {"open": len(self.leases.leases), "expired": self.leases.expired_leases,
                       "expired_sessions": self.leases.expired_sessions, "orphans": len(self.leases.orphans),
                       "orphaned_pages": sum(len(x.pages) or x.npages for x in self.leases.orphans.values())},
            "run": f"{self.run:016x}",
            "requests": {"held": len(self.requests), "tokens": self.requests.total},
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
