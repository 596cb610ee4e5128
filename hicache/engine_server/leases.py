"""Engine sessions and the leases they hold on L2 pages.

A *session* is one connector (the scheduler half of one vLLM engine) that registered. Every
message it sends renews it; a session silent for ``ttl_s`` is expired, and with it every
lease it holds. A lease also expires on its own after ``MAX_LEASE_AGE_TTLS`` TTLs: a live
engine loads and saves within one step, so an older lease is a leak, not work in flight.

Who owns what while a lease is open (``CacheServer`` applies these; this table is the
contract):

==========  ====================================  ===============================================
kind        holds                                 on ``Release`` / ``Commit`` / expiry
==========  ====================================  ===============================================
LOOKUP      ``host_lock_ref`` on the matched path  ``release_host(node, npages)``: unlocked
            (``node``, ``npages``), so L2 eviction
            cannot take the pages being loaded
RESERVE     ``pages``: L2 pages taken from the     ``Commit(ok)``: ``insert_host`` (the tree takes
            allocator, in no tree node             them or frees duplicates); ``Commit(not ok)``
                                                   and expiry: freed to the allocator
==========  ====================================  ===============================================
"""

from __future__ import annotations

import enum
import itertools
from array import array
from dataclasses import dataclass, field

from hicache.tree.node import TreeNode

MAX_LEASE_AGE_TTLS = 6
"""A lease older than this many session TTLs is expired even while its session is alive."""


class LeaseKind(enum.Enum):
    LOOKUP = "lookup"
    RESERVE = "reserve"


@dataclass
class Session:
    session_id: int
    engine: str
    pid: int
    last_seen: float
    leases: set[int] = field(default_factory=set)


@dataclass
class Lease:
    lease_id: int
    kind: LeaseKind
    session: int
    created: float
    node: TreeNode | None = None  # LOOKUP: the last matched node
    npages: int = 0  # LOOKUP: pages locked from ``node`` upwards
    storage_pages: int = 0  # LOOKUP: pages of the hit that a prefetch brought from L3
    key: array[int] | None = None  # RESERVE: the token prefix ending with the reserved pages
    cache_salt: str = ""
    start_page: int = 0  # RESERVE: the key's page that ``pages[0]`` holds
    pages: list[int] = field(default_factory=list)  # RESERVE: the reserved L2 pages


class LeaseTable:
    """Sessions and leases; knows nothing of the tree (``CacheServer`` applies the effects)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self._session_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.expired_leases = 0  # monotonic
        self.expired_sessions = 0

    def open_session(self, engine: str, pid: int, now: float) -> Session:
        s = Session(next(self._session_ids), engine, pid, now)
        self.sessions[s.session_id] = s
        return s

    def touch(self, session_id: int, now: float) -> Session | None:
        """The session, renewed; None if it is not open."""
        s = self.sessions.get(session_id)
        if s is not None:
            s.last_seen = now
        return s

    def add(self, lease: Lease) -> Lease:
        """Register ``lease`` under a fresh id (its ``lease_id`` is set here)."""
        lease.lease_id = next(self._lease_ids)
        self.leases[lease.lease_id] = lease
        self.sessions[lease.session].leases.add(lease.lease_id)
        return lease

    def take(self, lease_id: int, session_id: int, kind: LeaseKind) -> Lease | None:
        """Remove and return the lease if ``session_id`` holds it and it is of ``kind``."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.session != session_id or lease.kind is not kind:
            return None
        return self._remove(lease)

    def _remove(self, lease: Lease) -> Lease:
        del self.leases[lease.lease_id]
        s = self.sessions.get(lease.session)
        if s is not None:
            s.leases.discard(lease.lease_id)
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Close silent sessions; remove and return every lease that expired (theirs and
        the ones past ``MAX_LEASE_AGE_TTLS``)."""
        out: list[Lease] = []
        for s in [s for s in self.sessions.values() if now - s.last_seen > self.ttl_s]:
            del self.sessions[s.session_id]
            self.expired_sessions += 1
            out.extend(self.leases.pop(i) for i in sorted(s.leases) if i in self.leases)
        limit = MAX_LEASE_AGE_TTLS * self.ttl_s
        out.extend(self._remove(lease) for lease in [x for x in self.leases.values() if now - x.created > limit])
        self.expired_leases += len(out)
        return out
