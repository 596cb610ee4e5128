"""Engine sessions and the leases they hold on L2 pages.

A *session* is one connector (the scheduler half of one vLLM engine) that registered. Every
message it sends renews it; a session silent for ``ttl_s`` expires. A live session's leases
never expire: a lease ends only by its ``Release`` / ``Commit``, or with its session.

The leases of an expired session become **orphans**, not free pages: the engine may be
alive but stalled (then its worker still reads the pages of a planned load, or writes the
pages of a planned save, when it resumes). An orphan keeps what it holds until one of:

* its late ``Release`` / ``Commit`` arrives (the worker is done with those pages; a late
  commit's pages are freed, never inserted), or
* the engine's process is gone: same pid namespace as the daemon (``pid_namespace``),
  and ``/proc/<pid>`` missing, a zombie, or started at another time (``start_time``: the
  pid was reused). An engine the daemon cannot see (another pid namespace, no start time) keeps
  its orphans until their late messages arrive; ``stats`` counts them.

Who owns what while a lease is open (``CacheServer`` applies these; this table is the
contract):

==========  ====================================  ===============================================
kind        holds                                 on ``Release`` / ``Commit`` / end of an orphan
==========  ====================================  ===============================================
LOOKUP      ``host_lock_ref`` on the matched path  ``release_host(node, npages)``: unlocked
            (``node``, ``npages``), so L2 eviction
            cannot take the pages being loaded
RESERVE     ``pages``: L2 pages taken from the     ``Commit(ok)`` of a live lease: ``insert_host``
            allocator, in no tree node             (the tree takes them or frees duplicates);
                                                   ``Commit(not ok)``, any commit of an orphan,
                                                   the end of an orphan: freed to the allocator
==========  ====================================  ===============================================
"""

from __future__ import annotations

import enum
import itertools
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.tree.node import TreeNode


class LeaseKind(enum.Enum):
    LOOKUP = "lookup"
    RESERVE = "reserve"


@dataclass(frozen=True)
class EngineProcess:
    """Where an engine runs, as it said at registration: enough to tell that it is gone."""

    pid: int
    pid_namespace: str = ""
    start_time: int = 0


@dataclass
class Session:
    session_id: int
    engine: str
    process: EngineProcess
    namespace: str
    """Prefix of every cache salt of this session (from the engine's runtime identity)."""
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
    cache_salt: str = ""  # the effective salt (the session's namespace included)
    start_page: int = 0  # RESERVE: the key's page that ``pages[0]`` holds
    pages: list[int] = field(default_factory=list)  # RESERVE: the reserved L2 pages
    process: EngineProcess | None = None  # set when the lease becomes an orphan


def own_pid_namespace() -> str:
    """This process's pid namespace (``/proc/self/ns/pid``), empty where /proc lacks it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """Start of process ``pid`` in clock ticks since boot, or None when no such process runs
    (none, or a zombie: it has exited and writes nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    fields = raw[raw.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):  # field 3, the state: zombie or dead
        return None
    return int(fields[19])  # field 22, the start time


def process_gone(proc: EngineProcess, pid_namespace: str) -> bool:
    """Whether ``proc`` surely no longer runs, seen from a process in ``pid_namespace``.
    False whenever that cannot be known (another namespace, no start time)."""
    if not pid_namespace or proc.pid_namespace != pid_namespace or proc.start_time <= 0:
        return False
    started = process_start_time(proc.pid)
    return started is None or started != proc.start_time


class LeaseTable:
    """Sessions, leases and orphans; knows nothing of the tree (``CacheServer`` applies the effects).

    ``gone``: whether an engine process has surely ended (default: ``process_gone`` from
    this process's pid namespace; tests pass their own)."""

    def __init__(self, ttl_s: float, *, gone: Callable[[EngineProcess], bool] | None = None) -> None:
        self.ttl_s = ttl_s
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.orphans: dict[int, Lease] = {}
        namespace = own_pid_namespace()
        self.gone = gone if gone is not None else (lambda proc: process_gone(proc, namespace))
        self._session_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.expired_leases = 0  # monotonic: leases that became orphans
        self.expired_sessions = 0

    def open_session(self, engine: str, process: EngineProcess, namespace: str, now: float) -> Session:
        s = Session(next(self._session_ids), engine, process, namespace, now)
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
        """Remove and return the live lease if ``session_id`` holds it and it is of ``kind``."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.session != session_id or lease.kind is not kind:
            return None
        del self.leases[lease.lease_id]
        s = self.sessions.get(lease.session)
        if s is not None:
            s.leases.discard(lease.lease_id)
        return lease

    def credit(self, seconds: float) -> None:
        """The daemon could not hear the engines for ``seconds`` (its loop stalled): that time
        is no session's silence."""
        for s in self.sessions.values():
            s.last_seen += seconds

    def take_orphan(self, lease_id: int, session_id: int, kind: LeaseKind) -> Lease | None:
        """Remove and return the orphan if it was ``session_id``'s and of ``kind``."""
        lease = self.orphans.get(lease_id)
        if lease is None or lease.session != session_id or lease.kind is not kind:
            return None
        return self.orphans.pop(lease_id)

    def expire(self, now: float) -> int:
        """Close the sessions silent for more than ``ttl_s``; their leases become orphans.
        Returns how many leases did."""
        n = 0
        for s in [s for s in self.sessions.values() if now - s.last_seen > self.ttl_s]:
            del self.sessions[s.session_id]
            self.expired_sessions += 1
            for lease_id in sorted(s.leases):
                lease = self.leases.pop(lease_id, None)
                if lease is not None:
                    lease.process = s.process
                    self.orphans[lease_id] = lease
                    n += 1
        self.expired_leases += n
        return n

    def ended_orphans(self) -> list[Lease]:
        """Remove and return the orphans whose engine process is gone."""
        verdict: dict[EngineProcess, bool] = {}
        out: list[Lease] = []
        for lease in list(self.orphans.values()):
            assert lease.process is not None
            if lease.process not in verdict:
                verdict[lease.process] = self.gone(lease.process)
            if verdict[lease.process]:
                out.append(self.orphans.pop(lease.lease_id))
        return out
