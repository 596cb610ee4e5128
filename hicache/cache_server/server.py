"""The cache server: the scheduler process's job in engine mode (docs/architecture.md §13).

Engines keep L1 (their own KV blocks and prefix cache); the cache server keeps the tree of
what L2 and L3 hold for them and answers their connectors. Page bytes never pass through
here: the engines copy between their KV tensors and the shared L2 pool themselves.
``CacheServer`` dispatches each engine message to the part that owns it:

| part                                  | owns                                                     |
|---------------------------------------|----------------------------------------------------------|
| ``Sessions`` (``sessions``)           | registration, heartbeats, workers, run and session checks|
| ``Lookups`` (``lookups``)             | ``Lookup`` / ``Release``: lookup leases, L3 prefetches   |
| ``Reservations`` (``reservations``)   | ``Reserve`` / ``Commit``: reserve leases, save cursors   |
| ``RequestSlots`` (``slots``)          | each running request's tokens, memory and save cursor    |
| ``L2Pool`` (``l2_pool``)              | the window and state parts, giving back what a lease holds|
| ``EngineCounters`` (``counters``)     | the counters every part adds to (``stats()["engine"]``)   |

``Lookups`` and ``Reservations`` share their base, ``Handler`` (``handler``). The parts hold
the server's one ``LeaseTable``; setting ``CacheServer.tier`` sets it on the handlers too.

The tree has no L1 pages (its Full component's L1 allocator is empty): every node is
L2-only, so the tree's L2 eviction (``evict_host``: unlocked leaves, LRU first) is the whole
policy, and ``check_integrity(exact=True)`` holds whenever no lease, reservation or transfer
is open (``check_idle``). Leases: ``hicache.cache_server.leases``.

Not thread-safe: only the process loop calls it. Every handler answers a bad request with an
``EngineError`` (or drops a fire-and-forget one with a warning); none raises for what an
engine sends.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import protos
from hicache.cache_server.counters import EngineCounters
from hicache.cache_server.l2_pool import L2Pool
from hicache.cache_server.leases import LeaseTable
from hicache.cache_server.lookups import Lookups
from hicache.cache_server.pins import EnginePins, PinEntry
from hicache.cache_server.reservations import Reservations
from hicache.cache_server.sessions import Sessions, namespaced_salt
from hicache.cache_server.slots import RequestSlots
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.integrity import IntegrityError

log = logging.getLogger("hicache.cache_server")


class CacheServer:
    """Answers engine connectors over one ``UnifiedRadixCache`` with L2 only.

    ``tier``: the tier manager (L3 backups and prefetches), None without a controller.
    ``clock``: monotonic seconds (tests pass their own). ``run``:
    this daemon run's number (default: random). ``leases``: the lease table (default: one
    with ``lease_ttl_s`` that watches engine processes through /proc). ``pinned``: the
    pinned prefixes (``hicache.cache_server.pins``; models without window or state layers).
    ``save_wait_s``: how long a request's lookups may wait in all for another engine's save
    of the pages after their hit (``engine.save_wait_ms``; 0: never).
    """

    def __init__(self, cache: UnifiedRadixCache, tier: ControllerDriver | None, geometry: protos.EngineKVGeometry,
                 pool: protos.L2PoolInfo, lease_ttl_s: float, *,
                 clock: Callable[[], float] = time.monotonic, run: int | None = None,
                 leases: LeaseTable | None = None, pinned: Sequence[PinEntry] = (),
                 pinned_fraction: float = 0.5, save_wait_s: float = 0.0) -> None:
        if cache.full.host_allocator is None:
            raise ValueError("the cache server needs a tree with an L2 allocator")
        if cache.page_size != geometry.block_size:
            raise ValueError("the tree's page size must be the engines' block size")
        self.cache = cache
        self._tier = tier
        self.geometry = geometry
        self.pool = pool
        self.leases = leases if leases is not None else LeaseTable(lease_ttl_s)
        self.run = run if run is not None else secrets.randbits(62) + 1
        self.clock = clock
        self.counters = EngineCounters()
        self.exact_checks = 0
        self.integrity_error: str | None = None
        self.l2 = L2Pool(cache, geometry, pool, self.counters)
        self.window = self.l2.window
        """Tokens of the window before a hit whose window parts it needs (0: no window layers)."""
        self.state = self.l2.state
        """The model has state layers: a hit ends only where the tree holds the state after it."""
        self.pins: EnginePins | None = None
        if pinned:
            if self.window or self.state:
                raise ValueError("cache.pinned in engine mode serves models without window or state layers")
            self.pins = EnginePins(cache, lambda: self.tier, pinned, pinned_fraction, namespaced_salt)
        self.sessions = Sessions(self.leases, self.run, clock, self.counters, geometry, pool, self.window, self.pins)
        self.slots = RequestSlots(self.leases, self.counters)
        self.requests = self.slots.requests
        self.lookups = Lookups(cache, tier, self.sessions, self.slots, self.l2, save_wait_s)
        self.reservations = Reservations(cache, tier, self.sessions, self.slots, self.l2, self.pins)
        self._handlers: dict[type, Callable[[Any], protos.Message | None]] = {
            protos.EngineRegister: self.sessions.register,
            protos.Lookup: self.lookups.lookup,
            protos.Reserve: self.reservations.reserve,
            protos.Commit: self.reservations.commit,
            protos.Release: self.lookups.release,
            protos.EngineWorker: self.sessions.worker,
            protos.Heartbeat: self.sessions.heartbeat,
            protos.Finished: self.finished,
        }

    @property
    def tier(self) -> ControllerDriver | None:
        """The tier manager (None without a controller); set it here, and its parts see it."""
        return self._tier

    @tier.setter
    def tier(self, tier: ControllerDriver | None) -> None:
        self._tier = self.lookups.tier = self.reservations.tier = tier

    @property
    def host(self) -> Any:
        return self.cache.full.host_allocator

    @property
    def prefetching(self) -> int:
        """Requests whose lookup waits for a prefetch from L3."""
        return self.lookups.prefetching

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: protos.Message) -> protos.Message | None:
        """The answer to one engine message (None for fire-and-forget ones)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return protos.EngineError(getattr(msg, "req", 0), "bad_request",
                                      f"{type(msg).__name__} is not an engine request")
        return handler(msg)

    def busy(self, msg: protos.Lookup | protos.Reserve) -> protos.EngineError:
        """The answer to a lookup or reserve its engine's full queue kept out (``Sessions.busy``)."""
        return self.sessions.busy(msg)

    def finished(self, msg: protos.Finished) -> None:
        """A request ended: its tokens, save cursor and prefetch are dropped."""
        if self.sessions.stale(msg.run):
            return
        self.leases.touch(msg.session, self.clock())
        slot = (msg.session, msg.rid)
        self.slots.finished(slot)
        self.lookups.finished(slot)

    # ------------------------------------------------------------------ housekeeping
    def expire(self) -> int:
        """Expire silent sessions (their leases become orphans) and end the orphans whose
        engine process is gone; returns how many leases became orphans."""
        expired_before = self.leases.expired_sessions
        orphaned = self.leases.expire(self.clock())
        live = self.leases.sessions
        self.lookups.keep_sessions(live)
        if self.leases.expired_sessions != expired_before:
            self.slots.keep_sessions(live)
            if self.pins is not None:  # a namespace whose last session ended keeps no pin
                self.pins.keep_namespaces({s.namespace for s in live.values()})
        if orphaned:
            log.warning("%d leases of engines that stopped answering are held until those engines are seen "
                        "gone or answer", orphaned)
        for lease in self.leases.ended_orphans():
            self.l2.end(lease)
            self.counters.orphans_ended_gone += 1
        return orphaned

    @property
    def idle(self) -> bool:
        return (not self.leases.leases and not self.leases.orphans
                and (self.tier is None or not self.tier.in_flight))

    def check_idle(self) -> None:
        """The exact integrity check (no leaked page) when nothing is open, one bounded slice
        per call (``check_integrity_slice``; ``exact_checks`` counts the rounds). A failure is a
        bug of this daemon, not of an engine: it is logged, kept for ``stats`` (and the
        tests), and serving goes on."""
        if not self.idle:
            return
        try:
            if self.cache.check_integrity_slice(exact=True):
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
        out: dict[str, Any] = {
            "mode": "engine",
            "l2": self.l2.stats(self.leases),
            "engines": [{"session": s.session_id, "engine": s.engine, "pid": s.process.pid,
                         "namespace": s.namespace, "leases": len(s.leases), "ranks": s.ranks, "busy": s.busy,
                         "workers": len(self.leases.workers.get(s.process, {}))}
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
        if self.pins is not None:
            out["pinned"] = self.pins.listing()
        return out
