"""The scheduler process in engine mode: the cache server's sockets and loop.

Sockets (addresses from ``Endpoints``):

===========  ======  ==========================================================
endpoint     kind    carries
===========  ======  ==========================================================
engine       ROUTER  engine connectors' requests and the answers (bound here)
scheduler    PULL    admin requests from the tokenizer, op answers from the
                     controller, process events and shutdown from the launcher
tokenizer    PUSH    admin replies (and errors for generation requests: the
                     engines generate, not this daemon)
controller   PUSH    L3 backups, prefetches, storage admin (``ResettablePush``)
launcher     PUSH    ready, and a restart request when the controller hangs
===========  ======  ==========================================================

A frame that does not decode is answered (ROUTER: an ``EngineError`` with ``req`` 0) or
logged and dropped (PULL); the loop goes on. SIGTERM or ``Shutdown`` ends the loop: open
leases die with the process (the pools go with the daemon). Each round of the loop (a poll of
at most ``POLL_MS``) writes the process's heartbeat, as the scheduler's does.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from itertools import count
from typing import Any

import zmq

import protos
from hicache.heartbeat import HeartbeatWriter
from hicache.ipc import PeerProtocolError, PullSocket, PushSocket, ResettablePush, RouterSocket, open_context
from hicache.logging_setup import setup_logging
from hicache.memory.pools import attach_pools
from hicache.proc import die_with_parent
from hicache.scheduler.process import ACCEPTS, CONTROLLER_OP_TIMEOUT_S, SchedulerArgs

log = logging.getLogger("hicache.engine_server")

EXPIRE_INTERVAL_S = 0.25
IDLE_CHECK_INTERVAL_S = 1.0
METRICS_INTERVAL_S = 0.5
POLL_MS = 50
DEFER_FRACTION = 0.5
"""A lookup waits for its prefetch at most this fraction of the engines' lookup timeout."""

ENGINE_ACCEPTS = protos.accepted_by("scheduler", socket=protos.ENGINE_SOCKET)
"""What the engine socket decodes (``protos.table``)."""


def build_cache_server(args: SchedulerArgs, pools: Any, controller_send: Any) -> Any:
    """The tree (L2 only), the tier manager and the ``CacheServer`` over mapped ``pools``."""
    from hicache.engine_server.geometry import geometry_from_config
    from hicache.engine_server.server import CacheServer, L2PoolInfo
    from hicache.hashing import HashNamespace
    from hicache.memory.allocator import PageAllocator
    from hicache.tier_manager import TierManager
    from hicache.tree.cache import UnifiedRadixCache
    from hicache.tree.components import FullComponent

    cfg = args.config
    geometry = geometry_from_config(cfg)
    full = args.layout.component("full")
    ps = cfg.cache.page_size
    comp = FullComponent(PageAllocator(0, "l1-full"), PageAllocator(full.l2_pages, "l2-full"))
    cache = UnifiedRadixCache([comp], ps, hasher=HashNamespace(geometry.model_identity, geometry.kv_dtype, ps, "full"),
                              eviction_policy=cfg.cache.eviction, write_policy="write_through")
    tier = TierManager(cache, controller_send, prefetch=cfg.cache.prefetch,
                       l3_enabled=cfg.cache.l3.backend != "none")
    pool = L2PoolInfo(args.layout.instance, full.l2[0].segment, args.layout.directory, full.l2_pages,
                      full.l2_page_bytes)
    return CacheServer(cache, tier, geometry, pool, cfg.engine.lease_ttl_s,
                       defer_s=cfg.engine.lookup_timeout_ms / 1000 * DEFER_FRACTION)


def cache_server_main(args: SchedulerArgs) -> None:
    """Process entry point in engine mode (``multiprocessing`` spawn target)."""
    cfg = args.config
    setup_logging("scheduler", cfg.logging.level, cfg.logging.json)
    stop = [False]

    def on_sigterm(signum: int, _frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    from hicache.engine_server.telemetry import EngineTelemetry
    from hicache.metrics import init_process_metrics

    pools = attach_pools(args.layout)
    ctx = open_context(args.endpoints)
    ep = args.endpoints
    to_controller: ResettablePush[protos.ControllerMessage] = ResettablePush(ctx, ep.address("controller"))
    server = build_cache_server(args, pools, to_controller.send)
    engines: RouterSocket[protos.Message] = RouterSocket(ctx, ep.address("engine"), ENGINE_ACCEPTS)
    inbox: PullSocket[protos.Message] = PullSocket(ctx, ep.address("scheduler"), ACCEPTS, bind=True)
    to_tokenizer: PushSocket[protos.TokenizerMessage] = PushSocket(ctx, ep.address("tokenizer"))
    to_launcher: PushSocket[protos.Message] = PushSocket(ctx, args.ready_address)
    telemetry = EngineTelemetry(init_process_metrics(cfg.metrics, "scheduler"), server)
    admin = _Admin(server, to_tokenizer.send, to_controller.send)
    poller = zmq.Poller()
    poller.register(engines.socket, zmq.POLLIN)
    poller.register(inbox.socket, zmq.POLLIN)
    heartbeat = HeartbeatWriter(ep.dir, "scheduler")
    to_launcher.send(protos.Ready("scheduler", os.getpid()))
    g = server.geometry
    log.info("cache server ready for engines on %s: %d layers x %d kv heads x %d dim, %s, block %d, L2 %d pages, "
             "L3 %s", ep.address("engine"), g.num_layers, g.num_kv_heads, g.head_dim, g.kv_dtype, g.block_size,
             server.pool.pages, cfg.cache.l3.backend)
    last = {"expire": 0.0, "idle": 0.0, "metrics": 0.0}
    restart_asked = False
    try:
        while not stop[0]:
            heartbeat.beat()
            ready = dict(poller.poll(1 if server.deferred else POLL_MS))
            if engines.socket in ready:
                for _ in range(256):
                    if not _serve_engine(engines, server):
                        break
            if inbox.socket in ready:
                for _ in range(256):
                    msg = _recv_inbox(inbox)
                    if msg is None:
                        break
                    if isinstance(msg, protos.Shutdown):
                        stop[0] = True
                    elif isinstance(msg, protos.ProcessEvent):
                        if msg.process == "controller" and msg.event == "died":
                            failed = server.tier.on_controller_lost()
                            to_controller.reset()
                            restart_asked = False
                            log.warning("controller died (%s): %d in-flight ops failed back", msg.detail, failed)
                    elif not isinstance(msg, protos.ErrorReply):
                        admin.handle(msg)
            for peer, answer in server.deliver():  # lookups that waited for a prefetch
                engines.send(peer, answer)
            now = time.monotonic()
            if now - last["expire"] > EXPIRE_INTERVAL_S:
                server.expire()
                last["expire"] = now
            if not restart_asked and server.tier.oldest_op_age() > CONTROLLER_OP_TIMEOUT_S:
                log.error("the controller has not answered for %.0f s: asking for a restart",
                          server.tier.oldest_op_age())
                to_launcher.send(protos.ProcessEvent("controller", "restart", 0, "ops unanswered"))
                restart_asked = True
            if now - last["metrics"] > METRICS_INTERVAL_S:
                telemetry.publish()
                last["metrics"] = now
            if now - last["idle"] > IDLE_CHECK_INTERVAL_S:
                server.check_idle()
                last["idle"] = now
    finally:
        heartbeat.close()
        for sock in (engines, inbox, to_launcher):
            sock.close()
        to_tokenizer.close(linger_ms=2000)
        to_controller.close()
        ctx.term()
        pools.close()
    log.info("cache server stopped")


def _serve_engine(engines: RouterSocket[protos.Message], server: Any) -> bool:
    """Answer one queued engine message; False when none is queued. A frame that does not
    decode is answered with an ``EngineError``; an exception in a handler is logged and
    answered too, so no engine message can stop the loop."""
    try:
        got = engines.recv(0)
    except PeerProtocolError as exc:
        log.warning("refused an engine frame: %s", exc)
        engines.send(exc.peer, protos.EngineError(0, "bad_request", f"refused frame: {exc}"))
        return True
    except protos.ProtocolError as exc:
        log.warning("refused an engine frame: %s", exc)
        return True
    if got is None:
        return False
    peer, msg = got
    try:
        answer = server.handle(msg, peer)
    except Exception as exc:  # a bug must cost this request, not the daemon
        log.exception("engine request %s failed", type(msg).__name__)
        answer = protos.EngineError(getattr(msg, "req", 0), "bad_request", f"{type(exc).__name__}: {exc}")
    if answer is not None:
        engines.send(peer, answer)
    return True


def _recv_inbox(inbox: PullSocket[protos.Message]) -> protos.Message | None:
    try:
        return inbox.recv_ready()
    except protos.ProtocolError as exc:
        log.warning("refused a frame: %s", exc)
        return protos.ErrorReply(str(exc))


class _Admin:
    """Tokenizer requests in engine mode: admin ops answered here (storage ops through the
    controller); generation requests are refused, since the engines generate."""

    def __init__(self, server: Any, emit: Any, controller_send: Any) -> None:
        self.server = server
        self.emit = emit
        self.controller_send = controller_send
        self._ids = count(1)
        self._waiting: dict[int, str] = {}

    def handle(self, msg: protos.Message) -> None:
        if isinstance(msg, protos.GenerateRequest):
            self.emit(protos.TokenOutput(msg.rid, [], True, "error", None,
                                         "this daemon runs in engine mode (engine.kind: vllm): it serves no model; "
                                         "send generation requests to the vLLM engine"))
        elif isinstance(msg, protos.AdminRequest):
            self._admin(msg)
        elif isinstance(msg, protos.StorageStatus):
            self.server.tier.l3_enabled = msg.backend != "none"
            rid = self._waiting.pop(msg.op_id, None)
            if rid is not None:
                self.emit(protos.AdminReply(rid, msg.error is None,
                                            {"backend": msg.backend, "up": msg.up, "stats": msg.stats}, msg.error))
        elif isinstance(msg, protos.OpDone | protos.PrefetchHits):
            self.server.tier.on_message(msg)

    def _admin(self, msg: protos.AdminRequest) -> None:
        try:
            if msg.op == "stats":
                self.emit(protos.AdminReply(msg.rid, True, self.server.stats()))
            elif msg.op == "flush":
                self.emit(protos.AdminReply(msg.rid, True, {"flushed_tokens": self.server.flush()}))
            elif msg.op in ("storage_status", "storage_attach", "storage_detach", "storage_clear"):
                op = msg.op.removeprefix("storage_")
                if op != "status" and not self.server.idle:
                    self.emit(protos.AdminReply(msg.rid, False, {},
                                                "busy: leases or transfers are open; retry when idle"))
                    return
                op_id = next(self._ids)
                self._waiting[op_id] = msg.rid
                self.controller_send(protos.StorageAdmin(op_id, op, msg.args))
            else:
                self.emit(protos.AdminReply(msg.rid, False, {}, f"unknown admin op {msg.op!r}"))
        except Exception as exc:  # an admin call must never take the cache server down
            log.exception("admin op %s failed", msg.op)
            self.emit(protos.AdminReply(msg.rid, False, {}, f"{type(exc).__name__}: {exc}"))
