"""What the cache server's request handlers (``Lookups``, ``Reservations``) share: the tree,
the tier manager and the server's parts they act through. Holds nothing of its own."""

from __future__ import annotations

from hicache.cache_server.l2_pool import L2Pool
from hicache.cache_server.leases import Lease, LeaseKind, Report
from hicache.cache_server.sessions import Sessions
from hicache.cache_server.slots import RequestSlots
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.tree.cache import UnifiedRadixCache


class Handler:
    """Base of a handler over ``cache`` (L2 only); ``tier``: the tier manager (None without
    a controller; ``CacheServer.tier`` sets it on every handler); the session's lease table,
    counters and clock are ``sessions``'."""

    def __init__(self, cache: UnifiedRadixCache, tier: ControllerDriver | None, sessions: Sessions,
                 slots: RequestSlots, l2: L2Pool) -> None:
        self.cache = cache
        self.tier = tier
        self.sessions = sessions
        self.leases = sessions.leases
        self.counters = sessions.counters
        self.clock = sessions.clock
        self.slots = slots
        self.l2 = l2
        self.window = l2.window
        """Tokens of the window before a hit whose window parts it needs (0: no window layers)."""
        self.state = l2.state
        """The model has state layers."""

    def live_due(self, session: int, lease_id: int, kind: LeaseKind, rank: int, verdict: Report,
                 lease: Lease | None) -> Lease | None:
        """The lease whose effects ``verdict`` made due (``Sessions.due``) if its session is
        live; an orphan's (its session expired) is ended here instead: never inserted."""
        lease = self.sessions.due(session, lease_id, kind, rank, verdict, lease)
        if lease is not None and lease.process is not None:
            self.l2.end_orphan(lease)
            return None
        return lease
