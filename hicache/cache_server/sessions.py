"""The cache server's sessions: engine registration, heartbeats, workers, and the checks
every engine message passes first (docs/architecture.md §13).

Owns the geometry check of a registering engine (its KV pages must be the daemon's), its
session in the ``LeaseTable`` (``hicache.cache_server.leases``) and the session's namespace,
and the answers about sessions: ``stale_run`` (a message of another daemon run, refused
before it touches anything), ``unknown_session``, ``busy``. Each session has a *namespace*
from the engine's runtime identity (version, attention kernel, options, reset generation):
every cache salt of the session is prefixed with it (``namespaced_salt``), so engines whose
KV bytes could differ never share a page in L2, nor (the salt is part of every page hash) in
L3. Holds no page: what a lease holds is the lookups' and reservations' to give back.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import protos
from hicache.cache_server.counters import EngineCounters
from hicache.cache_server.geometry import block_size_hint, namespace_of
from hicache.cache_server.leases import EngineProcess, Lease, LeaseKind, LeaseTable, Report, Session
from hicache.cache_server.pins import EnginePins

log = logging.getLogger("hicache.cache_server")

MAX_TENSOR_PARALLEL = 64
"""The most tensor-parallel ranks an engine may register with."""

_IDENTITY = re.compile(r"[0-9a-f]{64}")


def namespaced_salt(namespace: str, cache_salt: str) -> str:
    """The salt the tree and the page hashes see for a session's ``cache_salt``."""
    return f"{namespace}:{cache_salt}"


def split_salt(tree_salt: str) -> tuple[str | None, str]:
    """``namespaced_salt``'s arguments back from its result: (namespace, ``cache_salt``)."""
    namespace, _, cache_salt = tree_salt.partition(":")
    return namespace, cache_salt


class Sessions:
    """Registers engines and answers for their sessions, over ``leases``.

    ``geometry`` / ``pool``: the daemon's KV pages and L2 pool; ``window``: tokens of the
    window whose parts the daemon keeps (0: no window layers); ``pins``: the pinned
    prefixes, told of each new namespace (None without pins).
    """

    def __init__(self, leases: LeaseTable, run: int, clock: Callable[[], float], counters: EngineCounters,
                 geometry: protos.EngineKVGeometry, pool: protos.L2PoolInfo, window: int,
                 pins: EnginePins | None) -> None:
        self.leases = leases
        self.run = run
        self.clock = clock
        self.counters = counters
        self.geometry = geometry
        self.pool = pool
        self.window = window
        self.pins = pins

    # ------------------------------------------------------------------ checks of every message
    def stale(self, run: int) -> bool:
        """Whether a message carries another daemon run's number (counted)."""
        if run == self.run:
            return False
        self.counters.stale_run += 1
        return True

    @staticmethod
    def session_error(req: int, session: int) -> protos.EngineError:
        return protos.EngineError(req, "unknown_session",
                                  f"session {session} is not open (the daemon restarted or the session expired)")

    @staticmethod
    def stale_error(req: int, run: int) -> protos.EngineError:
        return protos.EngineError(req, "stale_run", f"run {run} is not this daemon's run (it restarted)")

    def open_session(self, msg: protos.Lookup | protos.Reserve) -> Session | protos.EngineError:
        """Renew the message's session and return it, or the error to answer."""
        if self.stale(msg.run):
            return self.stale_error(msg.req, msg.run)
        session = self.leases.touch(msg.session, self.clock())
        if session is None:
            return self.session_error(msg.req, msg.session)
        return session

    def ranks(self, session: int) -> int:
        s = self.leases.sessions.get(session)
        return s.ranks if s is not None else 1

    def due(self, session: int, lease_id: int, kind: LeaseKind, rank: int, verdict: Report,
            lease: Lease | None) -> Lease | None:
        """The lease when ``verdict`` (``LeaseTable.report``'s) made its effects due (the last
        rank reported), else None (warned about when the report was unknown or repeated);
        the session is renewed either way."""
        self.leases.touch(session, self.clock())
        if verdict is Report.UNKNOWN or verdict is Report.REPEATED:
            log.warning("%s of %s lease %d (session %d, rank %d): dropped", kind.value,
                        "unknown" if verdict is Report.UNKNOWN else "already reported", lease_id, session, rank)
            return None
        return lease if verdict is Report.LAST else None

    def busy(self, msg: protos.Lookup | protos.Reserve) -> protos.EngineError:
        """The answer to a lookup or reserve not served because its engine's queue was full
        (the process loop's ``EngineQueues``): ``protos.BUSY``, counted (in all and, when the
        message names an open session of this run, for that session, which it renews).
        Nothing else changes: the engine's request stays as the server held it."""
        self.counters.busy += 1
        if msg.run == self.run:
            session = self.leases.touch(msg.session, self.clock())
            if session is not None:
                session.busy += 1
        return protos.EngineError(msg.req, protos.BUSY, "the daemon is busy: this engine's queue is full")

    # ------------------------------------------------------------------ session messages
    def register(self, msg: protos.EngineRegister) -> protos.Message:
        theirs = msg.geometry
        if not _IDENTITY.fullmatch(msg.runtime_identity):
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", "runtime_identity must be 64 lowercase hex characters")
        sharded = theirs.kv_kind != "mla"  # every rank holds the whole latent of MLA
        if not 1 <= msg.tensor_parallel <= MAX_TENSOR_PARALLEL or (sharded and theirs.num_kv_heads % msg.tensor_parallel):
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", f"tensor_parallel {msg.tensor_parallel}: must be in "
                                      f"[1, {MAX_TENSOR_PARALLEL}] and divide num_kv_heads ({theirs.num_kv_heads})")
        problem = self.geometry.mismatch(theirs)
        if problem is not None and theirs.block_size != self.geometry.block_size:
            problem += f"; {block_size_hint(self.geometry.block_size, theirs.block_size)}"
        if problem is None and msg.page_bytes != self.geometry.page_bytes:
            problem = f"page_bytes: daemon {self.geometry.page_bytes}, engine {msg.page_bytes}"
        if problem is None and self.window and not 0 < msg.window_tokens <= self.window + 1:
            problem = (f"window_tokens: the engine reads {msg.window_tokens - 1} tokens before a hit, this daemon "
                       f"keeps the window parts of {self.window} (the sliding_window of its config.json)")
        if problem is not None:
            self.counters.refused += 1
            log.warning("refused engine %s (pid %d): %s", msg.engine, msg.pid, problem)
            return protos.EngineError(msg.req, "refused", f"this daemon serves other KV pages: {problem}")
        process = EngineProcess(msg.pid, msg.pid_namespace, msg.start_time)
        namespace = namespace_of(msg.runtime_identity)
        s = self.leases.open_session(msg.engine, process, namespace, self.clock(), msg.tensor_parallel)
        if self.pins is not None:
            self.pins.on_namespace(namespace)
        log.info("engine %s (pid %d, %d rank%s) registered: session %d, namespace %s", msg.engine, msg.pid,
                 msg.tensor_parallel, "s" if msg.tensor_parallel > 1 else "", s.session_id, namespace)
        return protos.EngineRegistered(msg.req, s.session_id, self.run, self.pool, self.leases.ttl_s)

    def worker(self, msg: protos.EngineWorker) -> None:
        """A worker process of a tensor-parallel engine: orphans of that engine wait for it too."""
        if self.stale(msg.run):
            return
        engine = EngineProcess(msg.engine_pid, msg.pid_namespace, msg.engine_start_time)
        self.leases.add_worker(engine, msg.rank, EngineProcess(msg.pid, msg.pid_namespace, msg.start_time))

    def heartbeat(self, msg: protos.Heartbeat) -> protos.EngineError | None:
        """Renews the session. A heartbeat of another run or of a session this run does not
        know is answered (with its ``req``): the engine's heartbeat thread registers again at once, so
        an idle engine's namespace (and its pins) is back without waiting for its next request."""
        if self.stale(msg.run):
            return self.stale_error(msg.req, msg.run)
        if self.leases.touch(msg.session, self.clock()) is None:
            log.debug("heartbeat of unknown session %d", msg.session)
            return self.session_error(msg.req, msg.session)
        return None
