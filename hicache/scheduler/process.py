"""The scheduler process: wires ``Scheduler`` to its sockets and runs the loop.

Sockets (addresses from ``Endpoints``):

===========  ======  ==========================================================
endpoint     kind    carries
===========  ======  ==========================================================
scheduler    PULL    from the tokenizer (generate, abort, admin), from the
                     controller (op answers), from the launcher (process events,
                     shutdown) — this process binds it
tokenizer    PUSH    token outputs and admin replies
controller   PUSH    page moves (``ResettablePush``: dropped when the controller dies)
launcher     PUSH    ready, and a restart request when the controller hangs
===========  ======  ==========================================================

The loop blocks on the inbox only while there is nothing to compute, and, for at most a
tenth of a forward pass (``Scheduler.load_join_wait_s``), while a load-back that could join
the next forward pass is in flight. A frame that does not
decode is logged and dropped; the loop goes on. SIGTERM or a ``Shutdown`` message stops
admission (new requests are answered with an error), lets running requests finish within
the grace period, aborts the rest, and exits 0.

Each round of the loop writes the process's heartbeat (``hicache.heartbeat.HeartbeatWriter``);
a round lasts one forward pass at most plus a poll of at most 20 ms, so a heartbeat older
than ``server.health_stale_s`` means the process is stopped or stuck (``/health`` says so).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import protos
from hicache.config import HicacheConfig
from hicache.heartbeat import HeartbeatWriter
from hicache.ipc import Endpoints, PullSocket, PushSocket, ResettablePush, open_context
from hicache.logging_setup import setup_logging
from hicache.memory.pools import PoolLayout, attach_pools
from hicache.proc import die_with_parent

log = logging.getLogger("hicache.scheduler")

CONTROLLER_OP_TIMEOUT_S = 60.0
"""An op unanswered for this long means the controller hangs: the launcher restarts it."""

IDLE_CHECK_INTERVAL_S = 1.0
METRICS_INTERVAL_S = 0.5

ACCEPTS = protos.accepted_by("scheduler")
"""What the scheduler process's inbox decodes (``protos.table``)."""


@dataclass(frozen=True)
class SchedulerArgs:
    """What the scheduler process is started with (pickled by ``spawn``)."""

    config: HicacheConfig
    layout: PoolLayout
    endpoints: Endpoints
    ready_address: str


def scheduler_main(args: SchedulerArgs) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    cfg = args.config
    setup_logging("scheduler", cfg.logging.level, cfg.logging.json)
    stop_requested = [False]

    def on_sigterm(signum: int, _frame: object) -> None:
        stop_requested[0] = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()

    from hicache.metrics import init_process_metrics
    from hicache.model.loader import load_model
    from hicache.model.runner import ModelRunner
    from hicache.scheduler.assembly import build_cache, kv_pools_from_shared
    from hicache.scheduler.engine import Scheduler
    from hicache.scheduler.telemetry import SchedulerTelemetry
    from hicache.text import load_tokenizer
    from hicache.tier_manager import TierManager

    pools = attach_pools(args.layout)
    model = load_model(cfg.model)
    full = args.layout.component("full")
    l2_pages = full.l2_pages if cfg.cache.l2.enabled else None
    kv = kv_pools_from_shared(pools, cfg.cache.page_size)
    sizes: dict[str, int] = {}
    names = {c.name for c in args.layout.components}
    if "swa" in names:
        swa = args.layout.component("swa")
        sizes.update(swa_l1_pages=swa.l1_pages, swa_l2_pages=swa.l2_pages)
    if "mamba" in names:
        mamba = args.layout.component("mamba")
        sizes.update(l1_state_slots=mamba.l1_pages, l2_state_slots=mamba.l2_pages)
    cache, l1, _l2 = build_cache(cfg, model, full.l1_pages, l2_pages, pools=kv, **sizes)
    runner = ModelRunner(model, kv)
    eos = tuple(load_tokenizer(cfg.tokenizer, cfg.model).eos_token_ids)

    ctx = open_context(args.endpoints)
    ep = args.endpoints
    inbox: PullSocket[protos.Message] = PullSocket(ctx, ep.address("scheduler"), ACCEPTS, bind=True)
    to_tokenizer: PushSocket[protos.TokenizerMessage] = PushSocket(ctx, ep.address("tokenizer"))
    to_launcher: PushSocket[protos.Message] = PushSocket(ctx, args.ready_address)
    to_controller: ResettablePush[protos.ControllerMessage] | None = None
    tier = None
    if l2_pages:
        to_controller = ResettablePush(ctx, ep.address("controller"))
        tier = TierManager(cache, to_controller.send, load_back_threshold=cfg.cache.load_back_threshold,
                           prefetch=cfg.cache.prefetch, l3_enabled=cfg.cache.l3.backend != "none")
    sched = Scheduler(cfg, model, runner, cache, l1, to_tokenizer.send, tier=tier,
                      controller_send=to_controller.send if to_controller else None, eos_token_ids=eos)
    telemetry = SchedulerTelemetry(init_process_metrics(cfg.metrics, "scheduler"), sched)
    last_publish = 0.0
    heartbeat = HeartbeatWriter(ep.dir, "scheduler")
    to_launcher.send(protos.Ready("scheduler", os.getpid()))
    log.info("scheduler ready: model %s (%s), page size %d, L1 %d pages, L2 %s pages, L3 %s",
             cfg.model.kind, "+".join(model.geometry.components), cfg.cache.page_size, full.l1_pages, l2_pages,
             cfg.cache.l3.backend)

    draining = False
    deadline = 0.0
    restart_asked = False
    last_idle_check = 0.0

    def handle(msg: protos.Message) -> None:
        """Dispatch one inbox message (requests, controller answers, process events)."""
        nonlocal draining, deadline, restart_asked
        if isinstance(msg, protos.Shutdown):
            stop_requested[0] = True
            if not draining:
                draining, deadline = True, time.monotonic() + msg.grace_s
        elif isinstance(msg, protos.GenerateRequest):
            if draining:
                to_tokenizer.send(protos.TokenOutput(msg.rid, [], True, "error", None,
                                                     "the server is shutting down"))
            else:
                sched.submit(msg)
        elif isinstance(msg, protos.AbortRequest):
            sched.abort(msg.rid)
        elif isinstance(msg, protos.AdminRequest):
            sched.admin(msg)
        elif isinstance(msg, protos.ProcessEvent):
            if msg.process == "controller" and msg.event == "died" and tier is not None:
                failed = tier.on_controller_lost()
                if to_controller is not None:
                    to_controller.reset()
                restart_asked = False
                log.warning("controller died (%s): %d in-flight ops failed back", msg.detail, failed)
        elif isinstance(msg, protos.ErrorReply):
            log.warning("a peer refused one of our frames: %s", msg.error)
        else:
            sched.on_controller(msg)

    def receive(timeout_ms: int) -> bool:
        """Handle the next inbox message, waiting up to ``timeout_ms``; False if none came.
        A frame that does not decode is logged and dropped (and counts as one that came)."""
        try:
            msg = inbox.recv(timeout_ms)
        except protos.ProtocolError as exc:
            log.warning("refused a frame: %s", exc)
            return True
        if msg is None:
            return False
        handle(msg)
        return True

    try:
        while True:
            heartbeat.beat()
            if stop_requested[0] and not draining:
                draining, deadline = True, time.monotonic() + 30.0
                log.info("stopping: finishing %d running requests", len(sched.running))
            busy = sched.busy or (tier is not None and tier.in_flight > 0)
            # Never spin: with nothing to compute, wait for a message (acks and requests are
            # messages); waiting requests only need a short tick for prefetch deadlines.
            timeout = 0 if sched.running else (5 if sched.waiting else 20)
            for _ in range(256):
                if not receive(timeout):
                    break
                timeout = 0
            sched.schedule()
            wait_s = sched.load_join_wait_s()
            if wait_s > 0.0:
                # let load-backs that are about to finish join this forward pass
                began = time.monotonic()
                until = began + wait_s
                while sched.loads_pending and (left := until - time.monotonic()) > 0:
                    if not receive(max(1, int(left * 1000))):
                        break
                sched.counters.load_join_wait_s += time.monotonic() - began
                sched.schedule()
            sched.forward()
            if tier is not None and not restart_asked and tier.oldest_op_age() > CONTROLLER_OP_TIMEOUT_S:
                log.error("the controller has not answered for %.0f s: asking for a restart", tier.oldest_op_age())
                to_launcher.send(protos.ProcessEvent("controller", "restart", 0, "ops unanswered"))
                restart_asked = True
            now = time.monotonic()
            if now - last_publish > METRICS_INTERVAL_S:
                telemetry.publish()
                last_publish = now
            if not busy and now - last_idle_check > IDLE_CHECK_INTERVAL_S:
                sched.check_idle()
                last_idle_check = now
            if draining:
                if not sched.busy:
                    break
                if now > deadline:
                    for req in list(sched.running) + list(sched.waiting):
                        sched.abort(req.rid)
                    break
    finally:
        heartbeat.close()
        for sock in (inbox, to_launcher):
            sock.close()
        to_tokenizer.close(linger_ms=2000)
        if to_controller is not None:
            to_controller.close()
        ctx.term()
        pools.close()
    log.info("scheduler stopped")
