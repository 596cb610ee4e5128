"""The engine side of the cache-server protocol, without vLLM: sockets, timeouts, sessions.

``EngineClient`` is one DEALER connection for one thread. ``call`` sends a request and
waits at most ``timeout_ms`` for the answer with the same ``req``; the engine must never
wait long on hicache, so a timeout (or a daemon that is not there) returns None, and the
client then stays *down* for a backoff (``BACKOFF_S``, doubling up to ``MAX_BACKOFF_S``):
calls during it return None at once instead of waiting again. An answer that arrives after
its call gave up is handed to ``on_stray`` when the next call (or ``drain``) reads past it:
``CacheSession`` gives back at once what it holds (a late lookup's lease is released, a late
reservation committed as failed), instead of leaving the pages held until the session
expires. ZeroMQ reconnects by itself when the daemon comes back (``IMMEDIATE``: nothing is
queued for a daemon that is not connected).

CURVE: when the daemon runs with ``ipc.curve_keys_dir``, ``curve`` (``CurveClientKeys``, from
``curve_keys_for``) makes the socket a CURVE client. With keys the daemon does not admit the
handshake never completes, so sends are never queued: every call times out into the backoff
above, as with a daemon that is not there.

``CacheSession`` is the registered session of one engine: it registers at start (and again
after ``unknown_session`` or ``stale_run``: the session expired or the daemon restarted, or
after ``reregister``: the engine's runtime identity changed), and a heartbeat thread with its
own socket keeps the session alive while the engine is idle. The daemon answers a heartbeat
it cannot place (another run, an unknown session) with that error: the heartbeat thread then
registers again itself, so an idle engine is known to a restarted daemon (which starts its
pinned prefixes for it) without waiting for the engine's next request. One registration runs
at a time (``_registering``); the engine's own thread never waits for one (while none is
open its calls return None at once and the heartbeat thread registers), and a registration
answered for an identity the engine has left since (``generation``) is dropped.

A call waits for a connection to the daemon at most ``SEND_WAIT_MS`` (a registration: its
timeout): a daemon that is gone costs the engine's thread that much per backoff period, a
daemon that is alive but does not answer one call's timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import zmq

import protos
from hicache.runtime.ipc import (
    CLIENT_SECRET_FILE,
    SERVER_PUBLIC_FILE,
    CurveClientKeys,
    CurveKeyError,
    curve_client,
    load_curve_client,
)

log = logging.getLogger("hicache.connector")

BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
SEND_WAIT_MS = 20
"""How long a fire-and-forget send waits for a connection to the daemon before it gives up."""

ASKED_MEMORY = 4096
"""Calls whose answers a session still recognises when they arrive late."""

REFUSED_RETRY_S = 30.0
"""After the daemon refused this engine, how long the heartbeat thread waits before it
registers again (the operator may have restarted the daemon with another config)."""

REGISTER_POLL_S = 0.1
"""How often the heartbeat thread tries to register while no session is open (its client's
backoff makes most tries return at once while the daemon is away)."""

REREGISTER_CODES = ("unknown_session", "stale_run")
"""Errors after which the session registers again and retries the call once."""

EngineCall = protos.EngineRegister | protos.Lookup | protos.Reserve
"""What an engine sends and waits for an answer to; each carries a ``req`` from ``next_req``."""

EngineAnswer = protos.EngineRegistered | protos.LookupResult | protos.ReserveResult | protos.EngineError
"""What the cache server answers an engine; each carries the ``req`` of the call it answers."""

ANSWERS: tuple[type[EngineAnswer], ...] = (protos.EngineRegistered, protos.LookupResult, protos.ReserveResult,
                                           protos.EngineError)
"""What the cache server answers an engine (the messages ``protos.table`` routes to engines)."""

SERVER_PUBLIC_KEY = "curve_server_public_file"
CLIENT_SECRET_KEY = "curve_client_secret_file"
"""``kv_connector_extra_config`` keys: the daemon's public key file (``server.key``) and the
engine's client key pair (a ``*.key_secret`` file, mode 0600, admitted in the daemon's
``authorized_clients``). Each defaults to the file in the daemon's ``ipc.curve_keys_dir``."""


def curve_keys_for(extra: Mapping[str, Any], keys_dir: str | None) -> CurveClientKeys | None:
    """The connector's CURVE client keys, or None when the daemon does not use CURVE.

    ``keys_dir``: the daemon's ``ipc.curve_keys_dir``. ``extra``: vLLM's
    ``kv_connector_extra_config`` (``SERVER_PUBLIC_KEY`` and ``CLIENT_SECRET_KEY``, each
    defaulting to the file in ``keys_dir``). Raises ValueError naming the key and the file
    when a key file is given to a daemon without CURVE, is missing, is readable by other
    users, or is malformed.
    """
    given = {k: extra.get(k) for k in (SERVER_PUBLIC_KEY, CLIENT_SECRET_KEY) if extra.get(k) is not None}
    for key, value in given.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"kv_connector_extra_config {key!r} must be a file path, got {value!r}")
    if not keys_dir:
        if given:
            raise ValueError(f"kv_connector_extra_config sets {', '.join(sorted(given))}, but the daemon's config "
                             "sets no ipc.curve_keys_dir: the daemon does not use CURVE")
        return None
    server = given.get(SERVER_PUBLIC_KEY) or str(Path(keys_dir) / SERVER_PUBLIC_FILE)
    client = given.get(CLIENT_SECRET_KEY) or str(Path(keys_dir) / CLIENT_SECRET_FILE)
    try:
        return load_curve_client(server, client)
    except CurveKeyError as exc:
        raise ValueError(f"CURVE keys for the daemon ({SERVER_PUBLIC_KEY}={server}, {CLIENT_SECRET_KEY}={client}): "
                         f"{exc}") from None


class RegistrationRefused(RuntimeError):
    """The daemon serves other KV pages than this engine's (the message says which fields)."""


class EngineClient:
    """One DEALER socket to the cache server; not thread-safe (one per thread)."""

    def __init__(self, address: str, timeout_ms: int, *, clock: Callable[[], float] = time.monotonic,
                 curve: CurveClientKeys | None = None,
                 on_stray: Callable[[EngineAnswer], None] | None = None) -> None:
        """``curve``: connect as a CURVE client with these keys (None: a plain socket).
        ``on_stray``: called with each answer that arrives for no call waiting (late)."""
        self.address = address
        self.on_stray = on_stray
        self.timeout_ms = timeout_ms
        self.clock = clock
        self.curve = curve
        self._ctx: zmq.SyncContext = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        if curve is not None:
            curve_client(self._sock, curve)
        self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._req = 0
        self._down_until = 0.0
        self._backoff = BACKOFF_S
        self.timeouts = 0  # monotonic, for the connector's stats

    @property
    def down(self) -> bool:
        return self.clock() < self._down_until

    def next_req(self) -> int:
        self._req += 1
        return self._req

    def _mark_down(self) -> None:
        self.timeouts += 1
        self._down_until = self.clock() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def send(self, msg: protos.Message, wait_ms: int = SEND_WAIT_MS) -> bool:
        """Fire and forget; False when it could not be queued within ``wait_ms`` (the daemon
        is not connected: a fresh socket, or one reconnecting after a daemon restart)."""
        frame = protos.encode(msg)
        try:
            self._sock.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            pass
        if not self._sock.poll(wait_ms, zmq.POLLOUT):
            return False
        try:
            self._sock.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def call(self, msg: EngineCall, timeout_ms: int | None = None,
             connect_ms: int = SEND_WAIT_MS) -> EngineAnswer | None:
        """Send ``msg`` (its ``req`` set by ``next_req``) and return the answer with its ``req``,
        or None: down, not connected within ``connect_ms`` (a daemon that is gone costs that
        much, not the whole timeout), or no answer in time (then down for a backoff)."""
        if self.down:
            return None
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        if not self.send(msg, min(timeout, connect_ms)):
            self._mark_down()
            return None
        want = msg.req
        deadline = self.clock() + timeout / 1000
        while (left := deadline - self.clock()) > 0:
            if not self._poller.poll(max(1, int(left * 1000))):
                break
            try:
                answer = protos.decode(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except protos.ProtocolError as exc:
                log.warning("hicache sent a frame this connector cannot read: %s", exc)
                continue
            if isinstance(answer, ANSWERS) and answer.req == want:
                self._backoff = BACKOFF_S
                return answer
            self._stray(answer)
        self._mark_down()
        return None

    def drain(self) -> int:
        """Read every answer already queued (all late: no call waits) without waiting;
        returns how many there were."""
        n = 0
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            try:
                self._stray(protos.decode(frame))
            except protos.ProtocolError as exc:
                log.warning("hicache sent a frame this connector cannot read: %s", exc)

    def _stray(self, answer: protos.Message) -> None:
        if self.on_stray is not None and isinstance(answer, ANSWERS):
            self.on_stray(answer)

    def close(self) -> None:
        self._sock.close(linger=0)


@dataclass(frozen=True)
class SessionAnswer:
    """A call's answer (None: none came) and the registration it was asked under (None: no
    session was open): what the answer names (leases, pages) belongs to that session and run."""

    answer: EngineAnswer | None
    registered: protos.EngineRegistered | None


class CacheSession:
    """The engine's session with the cache server (the scheduler half of a connector).

    ``register`` is the ``EngineRegister`` to send (its ``req`` is replaced per call).
    ``registered`` holds the daemon's answer while the session is open. Raises
    ``RegistrationRefused`` from ``ensure`` when the daemon refuses this engine.

    Threads: the engine's (vLLM's scheduler) thread calls ``current`` / ``call`` and never
    waits for a registration: once ``start`` ran, registering is the heartbeat thread's job
    while no session is open (its own socket, paced by its client's backoff), so a daemon
    that is down or slow costs the engine's thread at most one call's timeout per backoff,
    never a wait behind the other thread's registration. ``reregister`` (a new identity)
    bumps ``generation``; a registration answered for an older generation is dropped, not
    adopted (it was sent before the identity changed).
    """

    def __init__(self, address: str, timeout_ms: int, register: protos.EngineRegister, *,
                 curve: CurveClientKeys | None = None) -> None:
        self.client = EngineClient(address, timeout_ms, curve=curve, on_stray=self._late)
        self.curve = curve
        self.address = address
        self.register_msg = register
        self.registered: protos.EngineRegistered | None = None
        self.generation = 0  # bumped by ``reregister``: a registration of an older one is dropped
        self.dropped_registrations = 0  # monotonic: answers of an older generation not adopted
        self._lock = threading.Lock()  # guards ``registered``, ``register_msg``, ``generation``
        self._registering = threading.Lock()  # one registration at a time (a call's or the heartbeat's)
        self._beat_refused = 0  # the latest heartbeat ``req`` answered stale_run / unknown_session
        self._stop = threading.Event()
        self._wake = threading.Event()  # the heartbeat thread registers now (no session is open)
        self._period_s = REGISTER_POLL_S  # between two heartbeats (a quarter of the lease TTL once known)
        self._beat: threading.Thread | None = None
        self._asked: OrderedDict[int, tuple[int, int]] = OrderedDict()  # req -> (session, run) of a call
        self.late_leases = 0  # monotonic: leases of late answers given back
        self._refusal: str | None = None  # the heartbeat thread's latest refusal, until ``current`` raises it

    def reregister(self, register: protos.EngineRegister) -> None:
        """Use ``register`` from now on: the next registration opens a new session with it,
        and one still in flight with the old message is dropped when its answer comes. The
        old session's leases end with their Release / Commit, or when it expires."""
        with self._lock:
            self.register_msg = register
            self.registered = None
            self.generation += 1
        self._wake.set()

    def ensure(self, timeout_ms: int | None = None) -> protos.EngineRegistered | None:
        """The open session, registering first if needed (waiting for another thread's
        registration to end); None while the daemon is unreachable. For the engine's start,
        its cache resets and tests: the engine's thread serves through ``current``."""
        if self.registered is not None:
            return self.registered
        return self._register(self.client, timeout_ms)

    def current(self) -> protos.EngineRegistered | None:
        """The open session, without waiting: None while none is open once ``start`` ran (the
        heartbeat thread registers); before it, a registration through this thread's socket
        unless another thread registers right now. Raises ``RegistrationRefused`` once for
        each refusal the heartbeat thread got."""
        refusal, self._refusal = self._refusal, None
        if refusal is not None:
            raise RegistrationRefused(refusal)
        reg = self.registered
        if reg is not None or self._beat is not None:
            return reg
        return self._register(self.client, wait=False)

    def _register(self, client: EngineClient, timeout_ms: int | None = None, *,
                  wait: bool = True) -> protos.EngineRegistered | None:
        """Register through ``client`` (the calling thread's socket) unless another thread
        just did (``wait`` False: or is doing it now; then None at once); raises
        ``RegistrationRefused`` when the daemon refuses this engine's current identity."""
        if not self._registering.acquire(blocking=wait):
            return None
        try:
            if self.registered is not None:
                return self.registered
            with self._lock:
                msg = replace(self.register_msg, req=client.next_req())
                generation = self.generation
            timeout = client.timeout_ms if timeout_ms is None else timeout_ms
            answer = client.call(msg, timeout, connect_ms=timeout)
            with self._lock:
                if generation != self.generation:  # asked with an identity the engine has left since
                    if isinstance(answer, protos.EngineRegistered):
                        self.dropped_registrations += 1
                        log.info("hicache: dropped a registration (session %d) of this engine's previous identity",
                                 answer.session)
                    return None
                if isinstance(answer, protos.EngineError):
                    raise RegistrationRefused(answer.reason)
                if not isinstance(answer, protos.EngineRegistered):
                    return None
                self.registered = answer
                self._period_s = max(answer.lease_ttl_s / 4, 0.05)
        finally:
            self._registering.release()
        log.info("hicache: registered with the daemon at %s (session %d, L2 %d pages of %d bytes)", self.address,
                 answer.session, answer.pool.pages, answer.pool.page_bytes)
        self.start()
        return answer

    def call(self, make: Callable[[int, protos.EngineRegistered], EngineCall],
             timeout_ms: int | None = None) -> EngineAnswer | None:
        """``call_under``'s answer alone."""
        return self.call_under(make, timeout_ms).answer

    def call_under(self, make: Callable[[int, protos.EngineRegistered], EngineCall],
                   timeout_ms: int | None = None) -> SessionAnswer:
        """``make(req, registered)`` built and sent within the session (the message names
        ``registered.session`` and ``registered.run``), with the registration it was sent
        under. When the daemon no longer knows the session or runs another run, registers
        again once without waiting (the daemon just answered) and retries. ``timeout_ms``:
        the wait for the call's answer (None: the client's own timeout)."""
        reg = self.current()
        for attempt in range(2):
            if reg is None:
                break
            req = self.client.next_req()
            self._asked[req] = (reg.session, reg.run)
            while len(self._asked) > ASKED_MEMORY:
                self._asked.popitem(last=False)
            answer = self.client.call(make(req, reg), timeout_ms)
            if answer is not None:
                self._asked.pop(req, None)
            if not (isinstance(answer, protos.EngineError) and answer.code in REREGISTER_CODES):
                return SessionAnswer(answer, reg)
            self._forget(reg)
            reg = self._register(self.client, wait=False) if attempt == 0 else None
        return SessionAnswer(None, None)

    def _forget(self, reg: protos.EngineRegistered) -> None:
        """The daemon no longer knows session ``reg``: it is closed here (unless replaced already)."""
        with self._lock:
            if self.registered is reg:
                self.registered = None
        self._wake.set()

    def _late(self, answer: EngineAnswer) -> None:
        """Give back what a late answer holds, under the session and run it was asked in."""
        asked = self._asked.pop(answer.req, None)
        if asked is None:
            return
        session, run = asked
        give_back: list[protos.Message] = []
        # no rank was given these leases: they are given back for every rank at once
        if isinstance(answer, protos.LookupResult) and answer.lease:
            give_back.append(protos.Release(session, run, answer.lease, 0, protos.ALL_RANKS))
        elif isinstance(answer, protos.ReserveResult):
            give_back += [protos.Commit(session, run, got.lease, False, protos.ALL_RANKS)
                          for got in answer.items if got.lease]
        for msg in give_back:
            self.client.send(msg)
        self.late_leases += len(give_back)
        if give_back:
            log.info("hicache: gave back %d leases of a late answer", len(give_back))

    def send(self, msg: protos.Message) -> bool:
        return self.client.send(msg)

    def start(self) -> None:
        """Start the heartbeat thread (once): it keeps the open session alive and registers
        while none is open."""
        if self._beat is not None:
            return
        self._beat = threading.Thread(target=self._heartbeat, name="hicache-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        """Heartbeats of the open session, each numbered. A refusal of one sent under the
        session still open (not of an older one's, in flight when it was replaced) ends that
        session here; while none is open this thread registers (woken at once when a session
        ends; the client's backoff paces it while the daemon is away), until the daemon
        refuses this engine (then the engine's next call raises it to the connector)."""
        client = EngineClient(self.address, self.client.timeout_ms, curve=self.curve, on_stray=self._beat_answer)
        sent_under: protos.EngineRegistered | None = None
        first_req = 0  # the first heartbeat sent under ``sent_under``
        refused: tuple[int, float] | None = None  # (generation, when) the daemon refused this engine
        try:
            while True:
                self._wake.wait(self._period_s if self.registered is not None else REGISTER_POLL_S)
                self._wake.clear()
                if self._stop.is_set():
                    return
                with self._lock:
                    reg = self.registered
                    generation = self.generation
                if reg is not None:
                    req = client.next_req()
                    if reg is not sent_under:
                        sent_under, first_req = reg, req
                    client.send(protos.Heartbeat(reg.session, reg.run, req))
                    client.drain()  # the daemon's answers to earlier heartbeats it could not place
                    if self._beat_refused < first_req:
                        continue
                    self._forget(reg)
                if refused is not None and refused[0] == generation and time.monotonic() < refused[1] + REFUSED_RETRY_S:
                    continue
                try:
                    self._register(client)
                except RegistrationRefused as exc:
                    refused = (generation, time.monotonic())
                    self._refusal = str(exc)
                    log.warning("hicache: the daemon refused this engine: %s", exc)
        finally:
            client.close()

    def _beat_answer(self, answer: EngineAnswer) -> None:
        if isinstance(answer, protos.EngineError) and answer.code in REREGISTER_CODES:
            self._beat_refused = max(self._beat_refused, answer.req)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._beat is not None:
            self._beat.join(timeout=2)
        self.client.close()


def engine_name() -> str:
    """A name for this engine process in the daemon's logs and stats."""
    return f"{os.uname().nodename}:{os.getpid()}"
