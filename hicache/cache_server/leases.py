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
  pid was reused), and so is every worker process the engine's workers announced
  (``EngineWorker``: the ranks of a tensor-parallel engine run in processes of their own,
  children of the engine's). An engine the daemon cannot see (another pid namespace, no
  start time) keeps its orphans until their late messages arrive; ``stats`` counts them.

An engine of ``ranks`` tensor-parallel ranks has each rank load and save its own shard of
every page, and each sends its own ``Release`` / ``Commit``: a lease ends with the last
rank's report (``LeaseTable.report``), a reservation commits only if every rank wrote its
shard, and a lookup's loaded pages are the fewest any rank loaded.

Who owns what while a lease is open (``CacheServer`` applies these; this table is the
contract):

==========  ====================================  ===============================================
kind        holds                                 on ``Release`` / ``Commit`` / end of an orphan
==========  ====================================  ===============================================
LOOKUP      ``host_lock_ref`` on the matched path  ``release_host(node, npages)``: unlocked
            (``node``, ``npages``), so L2 eviction
            cannot take the pages being loaded
RESERVE     ``pages``: L2 pages taken from the     every rank's ``Commit(ok)`` on a live lease:
            allocator, in no tree node             ``insert_host`` (the tree takes them or frees
                                                   duplicates); a ``Commit(not ok)`` of any rank,
                                                   an orphan's last commit, the end of an
                                                   orphan: freed to the allocator
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
from protos import ALL_RANKS

MAX_WORKER_ENGINES = 4096
"""Tensor-parallel engines whose worker processes the lease table remembers at most."""


SaveAt = tuple[str, int, bytes]
"""Where a reservation's pages begin: its effective salt, its first page's index in the key,
and that page's tokens (``array('I')`` bytes). A lookup whose hit ends at that page asks
``LeaseTable.saving`` with the same triple (equal triples on different prefixes are possible:
the caller compares the prefixes)."""


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
    ranks: int = 1
    """Tensor-parallel ranks: each reports every lease of the session."""
    busy: int = 0
    """Its lookups and reserves answered ``protos.BUSY`` (its queue was full)."""


@dataclass
class Lease:
    lease_id: int
    kind: LeaseKind
    session: int
    created: float
    node: TreeNode | None = None  # LOOKUP: the last matched node
    npages: int = 0  # LOOKUP: pages locked from ``node`` upwards
    storage_pages: int = 0  # LOOKUP: pages of the hit that a prefetch brought from L3
    key: array[int] | None = None  # RESERVE: the request's tokens, shared: only ``key[:key_len]`` is the lease's ...
    key_len: int = 0  # RESERVE: ... prefix, ending with the reserved pages (later tokens may be appended)
    cache_salt: str = ""  # the effective salt (the session's namespace included)
    start_page: int = 0  # RESERVE: the key's page that ``pages[0]`` holds
    pages: list[int] = field(default_factory=list)  # RESERVE: the reserved L2 pages
    held_node: TreeNode | None = None  # RESERVE: where L2 held the key's prefix at reservation ...
    held_tokens: int = 0  # RESERVE: ... and that prefix's tokens (the commit's insert starts there)
    process: EngineProcess | None = None  # set when the lease becomes an orphan
    ranks: int = 1  # reports that end the lease (one per tensor-parallel rank)
    reported: set[int] = field(default_factory=set)  # the ranks whose report came
    failed: bool = False  # RESERVE: a rank's Commit said not ok
    loaded_pages: int | None = None  # LOOKUP: the fewest pages a rank said it loaded
    window_npages: int = 0  # LOOKUP: pages whose window parts are locked from ``node`` upwards
    window_pages: list[int] = field(default_factory=list)  # RESERVE: L2 window parts ...
    window_at: list[int] = field(default_factory=list)  # RESERVE: ... of these pages of ``key``
    state_locked: bool = False  # LOOKUP: the state at ``node``'s end is locked (models with state layers)
    state_slots: list[int] = field(default_factory=list)  # RESERVE: L2 states ...
    state_at: list[int] = field(default_factory=list)  # RESERVE: ... after these pages of ``key``
    rid: str = ""  # RESERVE: the request it saves for
    saves_at: SaveAt | None = None  # RESERVE with pages: where lookups find it (``LeaseTable.saving``)
    repeat_end: int = 0  # RESERVE: ``SaveRange.repeat_end`` (it ends at the prompt's last full page)


class Report(enum.Enum):
    """What ``LeaseTable.report`` made of one rank's ``Release`` / ``Commit``."""

    UNKNOWN = "unknown"  # no such lease of that session and kind (or a bad rank): dropped
    REPEATED = "repeated"  # that rank had reported already: dropped
    WAITING = "waiting"  # counted; other ranks have not reported yet
    LAST = "last"  # the last rank's report: the lease is removed, its effects are due


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
        self.workers: dict[EngineProcess, dict[int, EngineProcess]] = {}
        """Worker processes of tensor-parallel engines, by engine process and rank (``EngineWorker``)."""
        self._saving: dict[SaveAt, dict[int, Lease]] = {}
        """The live reservations with ``saves_at``, by it (an orphan's save is never inserted)."""

    def open_session(self, engine: str, process: EngineProcess, namespace: str, now: float,
                     ranks: int = 1) -> Session:
        s = Session(next(self._session_ids), engine, process, namespace, now, ranks=ranks)
        self.sessions[s.session_id] = s
        return s

    def add_worker(self, engine: EngineProcess, rank: int, worker: EngineProcess) -> None:
        """Remember that ``worker`` (rank ``rank``) serves ``engine``; at most
        ``MAX_WORKER_ENGINES`` engines are remembered (the oldest forgotten first)."""
        ranks = self.workers.pop(engine, {})
        ranks[rank] = worker
        self.workers[engine] = ranks  # last in the order: the newest
        while len(self.workers) > MAX_WORKER_ENGINES:
            del self.workers[next(iter(self.workers))]

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
        if lease.saves_at is not None:
            self._saving.setdefault(lease.saves_at, {})[lease.lease_id] = lease
        return lease

    def saving(self, at: SaveAt) -> list[Lease]:
        """The live reservations whose pages begin at ``at`` (not yet committed)."""
        found = self._saving.get(at)
        return list(found.values()) if found else []

    def _not_saving(self, lease: Lease) -> None:
        """``lease`` left the live leases: lookups no longer find it."""
        if lease.saves_at is None:
            return
        found = self._saving.get(lease.saves_at)
        if found is not None:
            found.pop(lease.lease_id, None)
            if not found:
                del self._saving[lease.saves_at]

    def credit(self, seconds: float) -> None:
        """The daemon could not hear the engines for ``seconds`` (its loop stalled): that time
        is no session's silence."""
        for s in self.sessions.values():
            s.last_seen += seconds

    def report(self, lease_id: int, session_id: int, kind: LeaseKind, rank: int) -> tuple[Report, Lease | None]:
        """Count rank ``rank``'s report on ``session_id``'s lease (live or orphan) of
        ``kind``; the lease comes back with every verdict but UNKNOWN, and is removed (from
        the live leases or the orphans) with LAST. The caller records what the report says
        (``failed``, ``loaded_pages``) on the lease. ``ALL_RANKS`` (the engine's scheduler
        half giving back a lease no rank was given) counts for every rank, and is a repeat
        once any rank reported."""
        lease = self.leases.get(lease_id)
        if lease is None:
            lease = self.orphans.get(lease_id)
        if (lease is None or lease.session != session_id or lease.kind is not kind
                or not (0 <= rank < lease.ranks or rank == ALL_RANKS)):
            return Report.UNKNOWN, None
        if rank in lease.reported or (rank == ALL_RANKS and lease.reported):
            return Report.REPEATED, lease
        lease.reported.update(range(lease.ranks) if rank == ALL_RANKS else (rank,))
        if len(lease.reported) < lease.ranks:
            return Report.WAITING, lease
        if self.leases.pop(lease_id, None) is not None:
            self._not_saving(lease)
            s = self.sessions.get(session_id)
            if s is not None:
                s.leases.discard(lease_id)
        else:
            del self.orphans[lease_id]
        return Report.LAST, lease

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
                    self._not_saving(lease)
                    lease.process = s.process
                    self.orphans[lease_id] = lease
                    n += 1
        self.expired_leases += n
        return n

    def _engine_gone(self, engine: EngineProcess) -> bool:
        """Whether the engine and every worker it announced have surely ended (its
        workers are forgotten then)."""
        workers = self.workers.get(engine, {})
        if not self.gone(engine) or not all(self.gone(w) for w in workers.values()):
            return False
        self.workers.pop(engine, None)
        return True

    def ended_orphans(self) -> list[Lease]:
        """Remove and return the orphans whose engine (with its workers) is gone."""
        verdict: dict[EngineProcess, bool] = {}
        out: list[Lease] = []
        for lease in list(self.orphans.values()):
            assert lease.process is not None
            if lease.process not in verdict:
                verdict[lease.process] = self._engine_gone(lease.process)
            if verdict[lease.process]:
                out.append(self.orphans.pop(lease.lease_id))
        return out
