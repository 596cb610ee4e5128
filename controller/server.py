"""The cache-controller process: executes the scheduler's page moves and answers each op once.

It decides nothing about the tree. It maps the shared pools, owns the L3 backend, receives
``protos.to_controller`` messages on its PULL socket and pushes ``OpDone`` /
``PrefetchHits`` / ``StorageStatus`` / ``ErrorReply`` to the scheduler.

Contract with the scheduler:

=====================  ========================================  ==========================
message                executed on                               answered by
=====================  ========================================  ==========================
WriteToHost            the copy thread (FIFO: ops never          OpDone(ok | error |
LoadToDevice           overtake each other); small ops inline    cancelled)
                       when no copy is queued
BackupToStorage        an L3 worker thread                       OpDone(pages_done = pages
PrefetchFetch                                                    L3 holds / arrived)
PrefetchQuery          an L3 worker thread                       PrefetchHits(n)
Cancel                 main loop: an op not yet started is       the op's own OpDone
                       answered ``cancelled``; a running one     (never a second one)
                       finishes normally
StorageAdmin           main loop, once no L3 op is running       StorageStatus (after the
                                                                 evictions of the store
                                                                 it replaced or cleared)
(the store evicts)     main loop, each round; a page a backup    StorageEvicted (unprompted)
                       names waits for that backup's answer
                       (``controller.eviction_order``)
Shutdown / SIGTERM     stop reading, finish queued ops, exit 0   —
=====================  ========================================  ==========================

An L3 store that refuses the daemon's credentials at start (``StorageAuthError``,
``StorageTLSError``: a wrong password, an untrusted certificate) does not stop the start:
the controller runs without L3, logs the cause, sends an unprompted ``StorageStatus``
(``op_id`` -1, backend ``none``, ``stats.attach_error``) so that the scheduler issues no L3
ops, and reports the cause in every status until a store attaches. A store that cannot be
reached at all still fails the start.

Every op gets exactly one answer. A message that is refused (an op of another controller
run, bad indices, unknown component, a duplicate ``op_id`` of an op still running) is
answered ``OpDone(status="rejected")`` without touching memory; if an op with that id is
running it goes on and answers for itself. A frame that does not decode is answered with ``ErrorReply``.

Each round of the loop (a poll of at most 100 ms) writes the controller's heartbeat
(``hicache.runtime.heartbeat.HeartbeatWriter``); the launcher restarts a controller whose heartbeat
stays stale for ``server.controller_freeze_restart_s``. Once a second the loop publishes
``hicache_storage_attached``, ``hicache_storage_up`` and, where the backend can tell, the L3
size gauges.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import zmq

import protos
from controller.args import ControllerArgs
from controller.eviction_order import EvictionGate
from controller.storage_io import StorageIO
from controller.transfer import CopyPlan, TransferRefused, make_transfer_engine
from hicache.config import MetricsConfig
from hicache.memory.pools import attach_pools
from hicache.metrics import get_metrics, init_process_metrics
from hicache.runtime.heartbeat import HeartbeatWriter
from hicache.runtime.ipc import PullSocket, PushSocket, open_context
from hicache.runtime.logging_setup import setup_logging
from hicache.runtime.proc import die_with_parent
from storage_backends.errors import StorageAuthError, StorageTLSError

log = logging.getLogger("hicache.controller")

INLINE_COPY_BYTES = 4 * 1024 * 1024
"""Copies up to this size run on the main loop when no other copy is queued (saves a thread hop)."""

EVICTED_PER_FRAME = 4096
"""Hashes per ``StorageEvicted`` at most (about 270 kB, far below the frame limit)."""

ACCEPTS = protos.accepted_by("controller")
"""What the controller's inbox decodes (``protos.table``)."""

_OP_MESSAGES = (protos.WriteToHost, protos.LoadToDevice, protos.BackupToStorage, protos.PrefetchFetch,
                protos.PrefetchQuery)
"""The messages that start an op (each has an ``op_id``); ``ControllerServer._handlers`` starts them."""


@dataclass(slots=True)
class _Op:
    op_id: int
    kind: str  # "copy" | "l3"
    started: bool = False
    cancelled: bool = False


class ControllerServer:
    def __init__(self, args: ControllerArgs, ctx: zmq.SyncContext) -> None:
        self.args = args
        self.ctx = ctx
        self.pools = attach_pools(args.layout)
        self.engine = make_transfer_engine(self.pools, args.device)
        self.attach_error: str | None = None
        """Why the configured L3 store refused us at start (credentials), until one attaches."""
        self.storage = StorageIO(self.pools, None)
        if args.storage is not None:
            try:
                self.storage.attach(args.storage, args.l3_quotas_gb)
            except (StorageAuthError, StorageTLSError) as exc:  # a store that is down still fails the start
                self.attach_error = str(exc)
                log.error("the %s L3 store refused the daemon: %s; serving without L3 (fix cache.l3 and "
                          "attach it with PUT /cache/storage)", args.storage.kind, exc)
        self.inbox: PullSocket[protos.Message] = PullSocket(
            ctx, args.endpoints.address("controller"), ACCEPTS, bind=True)
        self.outbox: PushSocket[protos.Message] = PushSocket(ctx, args.endpoints.address("scheduler"))
        self._done_addr = f"inproc://controller-done-{id(self)}"
        self.done = ctx.socket(zmq.PULL)
        self.done.bind(self._done_addr)
        self._local = threading.local()
        self.copy_pool = ThreadPoolExecutor(1, thread_name_prefix="copy")
        self.io_pool = ThreadPoolExecutor(args.io_threads, thread_name_prefix="l3")
        self.ops: dict[int, _Op] = {}
        self.copies_queued = 0
        self.l3_running = 0
        self.pending_admin: list[protos.StorageAdmin] = []
        self.evictions = EvictionGate()
        self.stopping = False
        self._last_health = 0.0
        self.heartbeat = HeartbeatWriter(None, "controller")  # controller_main sets the real one
        self._handlers: dict[type[protos.Message], Callable[[Any], None]] = {
            protos.WriteToHost: self._start_copy, protos.LoadToDevice: self._start_copy,
            protos.BackupToStorage: self._start_l3, protos.PrefetchFetch: self._start_l3,
            protos.PrefetchQuery: self._start_l3,
        }

    # -- answering -----------------------------------------------------------------

    def _answer_from_worker(self, op_id: int, msg: protos.Message) -> None:
        """Worker threads answer through their own inproc socket; the main loop forwards.

        Two frames: the op id (ASCII digits, so the main loop need not decode the answer to
        know which op ended) and the encoded answer, which is forwarded as is."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(self._done_addr)
        sock.send_multipart((b"%d" % op_id, protos.encode(msg)))

    def _reject(self, op_id: int, reason: str) -> None:
        log.warning("op %d rejected: %s", op_id, reason)
        self.outbox.send(protos.OpDone(op_id, "rejected", 0, reason))

    # -- dispatch ------------------------------------------------------------------

    def handle(self, msg: protos.Message) -> None:
        if isinstance(msg, _OP_MESSAGES):
            op_id = msg.op_id
            if msg.run != self.args.run:  # queued for a controller that died: its pages may be reused
                self._reject(op_id, f"op {op_id} is for controller run {msg.run}, this is run {self.args.run} "
                                    "(sent before a restart)")
                return
            if op_id in self.ops:
                self._reject(op_id, f"duplicate op id {op_id}: an op with this id is still running")
                return
            self._handlers[type(msg)](msg)
        elif isinstance(msg, protos.Shutdown):
            log.info("shutdown requested: %s", msg.reason)
            self.stopping = True
        elif isinstance(msg, protos.Cancel):
            op = self.ops.get(msg.op_id)
            if op is not None and not op.started:
                op.cancelled = True
        elif isinstance(msg, protos.StorageAdmin):
            self.pending_admin.append(msg)

    def _start_copy(self, msg: protos.WriteToHost | protos.LoadToDevice) -> None:
        try:
            plan = self.engine.prepare(msg)
        except TransferRefused as exc:
            self._reject(msg.op_id, str(exc))
            return
        op = _Op(msg.op_id, "copy")
        direction = "d2h" if type(msg) is protos.WriteToHost else "h2d"
        if self.copies_queued == 0 and plan.nbytes <= INLINE_COPY_BYTES:
            # Runs to completion before the loop reads another message, so no Cancel or
            # duplicate can see it: it needs no entry in ``ops``.
            answer, seconds = self._copy(op, plan)
            self.outbox.send(answer)
            self._record_copy(direction, seconds, plan)
            return
        self.ops[msg.op_id] = op
        self.copies_queued += 1
        self.copy_pool.submit(self._copy_and_answer, op, plan, direction)

    def _copy(self, op: _Op, plan: CopyPlan) -> tuple[protos.OpDone, float | None]:
        """Execute a planned copy unless it was cancelled: the answer, and the seconds the copy
        took when it succeeded (None otherwise)."""
        if op.cancelled:
            return protos.OpDone(op.op_id, "cancelled"), None
        op.started = True
        start = time.perf_counter()
        try:
            self.engine.execute(plan)
        except Exception as exc:  # a copy that fails is reported, never lost
            log.exception("copy op %d failed", op.op_id)
            return protos.OpDone(op.op_id, "error", 0, f"{type(exc).__name__}: {exc}"), None
        return protos.OpDone(op.op_id, "ok", plan.pages), time.perf_counter() - start

    @staticmethod
    def _record_copy(direction: str, seconds: float | None, plan: CopyPlan) -> None:
        """Metrics of a finished copy; called after its answer left, off the op's round trip."""
        if seconds is not None:
            get_metrics().transfer_done(direction, seconds, plan.nbytes)

    def _copy_and_answer(self, op: _Op, plan: CopyPlan, direction: str) -> None:
        """Copy-thread body of a queued copy."""
        answer, seconds = self._copy(op, plan)
        self._answer_from_worker(op.op_id, answer)
        self._record_copy(direction, seconds, plan)

    def _start_l3(self, msg: protos.BackupToStorage | protos.PrefetchFetch | protos.PrefetchQuery) -> None:
        try:
            pages = None if isinstance(msg, protos.PrefetchQuery) else msg.host_pages
            into_l2 = isinstance(msg, protos.PrefetchFetch)  # writes its pages: none twice
            self.storage.check(msg.component, pages, msg.hashes, into_l2)
            self.storage.check_aux(msg.aux_keys, None if isinstance(msg, protos.PrefetchQuery) else msg.aux_pages,
                                   into_l2)
        except ValueError as exc:
            self._reject(msg.op_id, str(exc))
            return
        op = self.ops[msg.op_id] = _Op(msg.op_id, "l3")
        self.l3_running += 1
        if isinstance(msg, protos.BackupToStorage):
            self.evictions.backup_started(msg.op_id, msg.hashes)
        self.io_pool.submit(self._run_and_answer, op, lambda: self._l3(op, msg))

    def _l3(self, op: _Op, msg: protos.BackupToStorage | protos.PrefetchFetch | protos.PrefetchQuery) -> protos.Message:
        if isinstance(msg, protos.PrefetchQuery):
            op.started = True
            n = self.storage.query(msg.hashes, msg.tenant)
            present = {name: [i for i, p in enumerate(self.storage.query_aux(keys[:n], msg.tenant)) if p]
                       for name, keys in msg.aux_keys.items()} if n else {}
            return protos.PrefetchHits(op.op_id, n, present)
        if op.cancelled:
            return protos.OpDone(op.op_id, "cancelled")
        op.started = True
        page_bytes = self.pools[msg.component].layout.l2_page_bytes
        metrics = get_metrics()
        try:
            if isinstance(msg, protos.BackupToStorage):
                written_before = self.storage.counters.backup_pages
                with metrics.transfer("h2s", 0):
                    done = self.storage.backup(msg.component, msg.host_pages, msg.hashes, lambda: op.cancelled,
                                               msg.tenant)
                metrics.transfer_bytes("h2s", (self.storage.counters.backup_pages - written_before) * page_bytes)
                metrics.storage_error("set", len(msg.hashes) - done)
                for name, units in msg.aux_pages.items():  # after the Full pages, each on its own
                    stored = self.storage.backup_aux(name, units, msg.aux_keys[name], msg.tenant)
                    metrics.storage_error("set", len(units) - stored)
                aux_done: dict[str, list[bool]] = {}
            else:
                with metrics.transfer("s2h", 0):
                    done = self.storage.fetch(msg.component, msg.hashes, msg.host_pages, msg.tenant)
                    aux_done = {name: self.storage.fetch_aux(name, msg.aux_keys[name], units, msg.tenant)
                                for name, units in msg.aux_pages.items()}
                metrics.transfer_bytes("s2h", done * page_bytes + sum(
                    sum(ok) * self.pools[name].layout.l2_page_bytes for name, ok in aux_done.items()))
        except Exception as exc:  # the backends never raise for store trouble; this is a bug
            log.exception("L3 op %d failed", op.op_id)
            return protos.OpDone(op.op_id, "error", 0, f"{type(exc).__name__}: {exc}")
        return protos.OpDone(op.op_id, "ok" if done == len(msg.hashes) else "failed", done, None, aux_done)

    def _run_and_answer(self, op: _Op, work: Callable[[], protos.Message]) -> None:
        try:
            answer = work()
        except Exception as exc:  # pragma: no cover - work() already catches
            answer = protos.OpDone(op.op_id, "error", 0, f"{type(exc).__name__}: {exc}")
        self._answer_from_worker(op.op_id, answer)

    def _forward_done(self) -> None:
        """Forward one worker answer (the poller said one is queued) and retire its op."""
        op_id, frame = self.done.recv_multipart(zmq.NOBLOCK)
        op = self.ops.pop(int(op_id), None)
        if op is not None:
            if op.kind == "copy":
                self.copies_queued -= 1
            else:
                self.l3_running -= 1
        self.outbox.socket.send(frame)
        self.evictions.backup_answered(int(op_id))

    def _run_admin(self) -> None:
        while self.pending_admin and self.l3_running == 0:
            msg = self.pending_admin.pop(0)
            self._forward_evictions()  # what the store did before the op, told before its answer
            error = None
            try:
                if msg.op == "attach":
                    if not isinstance(msg.args.get("l3"), dict):
                        raise ValueError('attach needs args {"l3": <a cache.l3 section>}')
                    settings = l3_settings_from_mapping(msg.args["l3"])
                    if settings is None:
                        self.storage.detach()
                    else:
                        self.storage.attach(settings, self.args.l3_quotas_gb)
                elif msg.op == "detach":
                    self.storage.detach()
                elif msg.op == "clear":
                    self.storage.clear()
                elif msg.op != "status":
                    error = f"unknown storage admin op {msg.op!r}"
            except Exception as exc:  # reported to the caller; the controller keeps serving
                error = f"{type(exc).__name__}: {exc}"
            if self.storage.backend is not None:
                self.attach_error = None
            self.outbox.send(self._status(msg.op_id, error))

    def _status(self, op_id: int, error: str | None = None) -> protos.StorageStatus:
        up, stats = self.storage.status()
        if self.attach_error is not None:
            stats["attach_error"] = self.attach_error
        return protos.StorageStatus(op_id, self.storage.backend_name, up, stats, error)

    # -- the loop ------------------------------------------------------------------

    def serve(self) -> None:
        """Run until stopped and every op is answered.

        One ``zmq_poll`` over the inbox and the workers' answers per round, then at most one
        message from each ready socket: a ready socket always holds a message, so no read
        comes back empty (an empty non-blocking read costs more than a poll), and neither
        stream can starve the other.
        """
        inbox, done = self.inbox.socket, self.done
        if self.attach_error is not None:  # unprompted: the scheduler stops issuing L3 ops
            self.outbox.send(self._status(-1))
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        poller.register(done, zmq.POLLIN)
        while not (self.stopping and not self.ops):
            if self.stopping and inbox in poller:  # no more reading: stop waking up for it
                poller.unregister(inbox)
            for sock, _event in poller.poll(100):
                if sock is done:
                    self._forward_done()
                elif not self.stopping:
                    self._receive()
            self.heartbeat.beat()
            if self.pending_admin:
                self._run_admin()
            self._forward_evictions()
            now = time.monotonic()
            if now - self._last_health > 1.0:
                self._last_health = now
                self._publish_storage()

    def _forward_evictions(self) -> None:
        """Tell the scheduler which pages the store evicted on its own (``StorageEvicted``,
        for its KV events), in frames of at most ``EVICTED_PER_FRAME`` hashes; a page a
        backup names only after that backup's answer (``EvictionGate``)."""
        evicted = self.evictions.release(self.storage.take_evicted(), self.storage.holds_each)
        for start in range(0, len(evicted), EVICTED_PER_FRAME):
            self.outbox.send(protos.StorageEvicted(evicted[start:start + EVICTED_PER_FRAME]))

    def _publish_storage(self) -> None:
        """``hicache_storage_attached``, ``hicache_storage_up``, and the L3 size gauges where
        the backend can tell."""
        metrics = get_metrics()
        attached = self.storage.backend is not None
        metrics.set_storage_attached(attached)
        metrics.set_storage_up(attached and self.storage.status()[0])
        size = self.storage.size()
        if size is not None:
            metrics.set_storage_size(size.pages, size.bytes)
        for tenant, (held, cap) in self.storage.partition_sizes().items():
            metrics.set_tenant_l3_usage(tenant, held.bytes if held is not None else None, cap)

    def _receive(self) -> None:
        try:
            msg = self.inbox.recv_ready()
        except protos.ProtocolError as exc:
            log.warning("refused a frame: %s", exc)
            self.outbox.send(protos.ErrorReply(str(exc)))
            return
        if msg is not None:
            self.handle(msg)

    def close(self) -> None:
        self.copy_pool.shutdown(wait=True)
        self.io_pool.shutdown(wait=True)
        self.storage.detach()
        self.inbox.close()
        self.outbox.close(linger_ms=2000)
        self.done.close(0)
        self.pools.close()


def l3_settings_from_mapping(raw: dict[str, Any]) -> Any:
    """Backend settings from a ``cache.l3``-shaped mapping (as the admin API receives it).

    Validated exactly like the config file; raises ``ConfigError`` naming each bad key.
    """
    from hicache.config import config_from_dict
    from hicache.storage_settings import storage_settings_from_config

    l3 = config_from_dict({"cache": {"l3": raw}}).cache.l3
    return storage_settings_from_config(l3)


def controller_main(args: ControllerArgs) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    setup_logging("controller", args.log_level, args.log_json)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; Ctrl-C reaches the group
    die_with_parent()
    torch.set_num_threads(max(1, args.copy_threads))
    init_process_metrics(MetricsConfig(enabled=args.metrics_enabled), "controller")
    ctx = open_context(args.endpoints)
    try:
        server = ControllerServer(args, ctx)
    except Exception as exc:  # e.g. an L3 store that was asked for and cannot start
        log.error("controller failed to start: %s: %s", type(exc).__name__, exc)
        if args.ready_address:
            failed: PushSocket[protos.Message] = PushSocket(ctx, args.ready_address)
            failed.send(protos.ProcessEvent("controller", "failed", os.getpid(), f"{type(exc).__name__}: {exc}"))
            failed.close(linger_ms=5000)
        ctx.term()
        raise SystemExit(1) from None
    # Fresh before Ready: the launcher judges a restarted controller by this file at once.
    server.heartbeat = HeartbeatWriter(args.endpoints.dir, "controller")
    server._publish_storage()  # the L3 gauges exist from the start
    if args.ready_address:
        ready: PushSocket[protos.Message] = PushSocket(ctx, args.ready_address)
        ready.send(protos.Ready("controller", os.getpid()))
        ready.close(linger_ms=5000)
    log.info("controller ready: components %s, L3 %s", list(server.pools.components), server.storage.backend_name)

    def stop_on_signal() -> None:
        stop.wait()
        server.stopping = True

    watcher = threading.Thread(target=stop_on_signal, daemon=True)
    watcher.start()
    try:
        server.serve()
    finally:
        server.heartbeat.close()
        server.close()
        ctx.term()
        time.sleep(0)
