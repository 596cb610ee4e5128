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

``SchedulerProcess`` is the loop (``hicache.scheduler.loop.ProcessLoop``: heartbeat,
telemetry, controller watchdog, drain) around ``hicache.scheduler.scheduler.Scheduler``; one
handler per inbox message type (``handlers``). A round reads the inbox, schedules, and runs
at most one forward pass. It waits on the inbox only while there is nothing to compute:
``RUNNING_POLL_MS`` with requests running, ``WAITING_POLL_MS`` with only waiting ones (their
prefetch deadlines need a tick), ``IDLE_POLL_MS`` with none; and, for at most a tenth of a
forward pass (``Scheduler.load_join_wait_s``), while a load-back that could join the next
forward pass is in flight. A frame that does not decode is logged and dropped; the loop
goes on.

SIGTERM (within ``SchedulerArgs.grace_s``) or a ``Shutdown`` message (within its
``grace_s``) stops admission (new requests are answered with an error), lets running and
waiting requests finish within the grace, aborts the rest, and exits 0.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import protos
from hicache.memory.layout import PoolLayout
from hicache.memory.pools import attach_pools
from hicache.scheduler.loop import Links, ProcessLoop, SchedulerArgs, StopSignal, Telemetry, enter_process

if TYPE_CHECKING:
    from hicache.kv_events.stream import KVEventStream
    from hicache.memory.pools import SharedPools
    from hicache.scheduler.controller_driver import ControllerDriver
    from hicache.scheduler.scheduler import Scheduler

log = logging.getLogger("hicache.scheduler")

RUNNING_POLL_MS = 0
"""Inbox wait with requests running: none, the next forward pass is due."""

WAITING_POLL_MS = 5
"""Inbox wait with only waiting requests: a short tick, for their prefetch deadlines."""

IDLE_POLL_MS = 20
"""Inbox wait with nothing to compute (acks and requests are messages: they wake it)."""

MIN_POLL_MS = 1
"""The shortest wait for a load-back ack that may join this forward pass."""

DRAINING_ERROR = "the server is shutting down"
"""The error a generation request gets while the process drains."""


class SchedulerProcess(ProcessLoop):
    """The builtin-mode loop around ``sched`` (see the module docstring)."""

    log = log

    def __init__(self, args: SchedulerArgs, links: Links, pools: SharedPools | None, sched: Scheduler, *,
                 tier: ControllerDriver | None, telemetry: Telemetry, stop: StopSignal,
                 kv_events: KVEventStream | None = None) -> None:
        super().__init__(args, links, pools, tier=tier, telemetry=telemetry, stop=stop, kv_events=kv_events)
        self.sched = sched
        if kv_events is not None:  # the round's changes so far wait for no forward pass
            sched.before_model = self.publish_kv_events
            sched.storage_status_seen = self.storage_status_seen
        self._was_busy = False
        self.handlers.update({
            protos.GenerateRequest: self.on_generate,
            protos.AbortRequest: self.on_abort,
            protos.AdminRequest: sched.admin,
            protos.OpDone: sched.on_controller,
            protos.PrefetchHits: sched.on_controller,
            protos.StorageStatus: sched.on_controller,
        })

    @classmethod
    def build(cls, args: SchedulerArgs, stop: StopSignal) -> SchedulerProcess:
        """Map the pools, load the model and the tokenizer's end tokens, build the tree, the
        tier manager (when L2 is on) and the ``Scheduler``, open the sockets."""
        from hicache.kv_events.stream import KVEventStream
        from hicache.metrics import init_process_metrics
        from hicache.model.loader import load_model
        from hicache.model.runner import ModelRunner
        from hicache.scheduler.assembly import build_cache, kv_pools_from_shared, l3_partition_of
        from hicache.scheduler.controller_driver import ControllerDriver
        from hicache.scheduler.scheduler import Scheduler
        from hicache.scheduler.telemetry import SchedulerTelemetry
        from hicache.text import load_tokenizer
        from hicache.tree import Tier

        cfg = args.config
        pools = attach_pools(args.layout)
        model = load_model(cfg.model)
        full = args.layout.component("full")
        l2_pages = full.l2_pages if cfg.cache.l2.enabled else None
        kv = kv_pools_from_shared(pools, cfg.cache.page_size)
        cache, l1, _l2 = build_cache(cfg, model, full.l1_pages, l2_pages, pools=kv, **_aux_sizes(args.layout))
        runner = ModelRunner(model, kv)
        eos = tuple(load_tokenizer(cfg.tokenizer, cfg.model).eos_token_ids)
        links = Links.open(args, controller=bool(l2_pages))
        to_controller = links.to_controller
        tier = None
        if to_controller is not None:
            tier = ControllerDriver(cache, to_controller.send, load_back_threshold=cfg.cache.load_back_threshold,
                               prefetch=cfg.cache.prefetch, l3_enabled=cfg.cache.l3.backend != "none",
                               l3_partition=l3_partition_of(cfg))
        sched = Scheduler(cfg, model, runner, cache, l1, links.to_tokenizer.send, tier=tier,
                          controller_send=to_controller.send if to_controller else None, eos_token_ids=eos)
        telemetry = SchedulerTelemetry(init_process_metrics(cfg.metrics, "scheduler"), sched)
        events = KVEventStream.open(cfg, cache, tiers=tuple(Tier))  # L1, L2 and L3: this tree has them all
        return cls(args, links, pools, sched, tier=tier, telemetry=telemetry, stop=stop, kv_events=events)

    def ready_line(self) -> str:
        cfg, layout = self.args.config, self.args.layout
        full = layout.component("full")
        l2 = full.l2_pages if cfg.cache.l2.enabled else None
        return (f"scheduler ready: model {cfg.model.kind} ({'+'.join(self.sched.model.geometry.components)}), "
                f"page size {cfg.cache.page_size}, L1 {full.l1_pages} pages, L2 {l2} pages, L3 {cfg.cache.l3.backend}")

    # -- a round ----------------------------------------------------------------------

    def round(self) -> None:
        sched = self.sched
        self._was_busy = sched.busy or (self.tier is not None and self.tier.in_flight > 0)
        self.read_inbox(self._poll_ms())
        self.publish_kv_events()  # the controller's acks: pages that arrived in L2 / L3
        sched.schedule()
        if self._wait_for_load_backs():
            sched.schedule()
        sched.forward()

    def _poll_ms(self) -> int:
        if self.sched.running:
            return RUNNING_POLL_MS
        return WAITING_POLL_MS if self.sched.waiting else IDLE_POLL_MS

    def _wait_for_load_backs(self) -> bool:
        """Let load-backs about to finish join this forward pass (``Scheduler.load_join_wait_s``);
        True if it waited (the time is added to ``counters.load_join_wait_s``)."""
        sched = self.sched
        wait_s = sched.load_join_wait_s()
        if wait_s <= 0.0:
            return False
        began = self.clock()
        until = began + wait_s
        while sched.loads_pending and (left := until - self.clock()) > 0:
            if not self.receive(max(MIN_POLL_MS, int(left * 1000))):
                break
        sched.counters.load_join_wait_s += self.clock() - began
        return True

    def idle(self) -> bool:
        return not self._was_busy

    def stalled_since(self) -> float | None:
        return self.sched.stalled_since

    def check_idle(self) -> None:
        self.sched.check_idle()

    # -- messages ---------------------------------------------------------------------

    def on_generate(self, msg: protos.GenerateRequest) -> None:
        if self.draining:
            self.links.to_tokenizer.send(protos.TokenOutput(msg.rid, [], True, "error", None, DRAINING_ERROR))
        else:
            self.sched.submit(msg)

    def on_abort(self, msg: protos.AbortRequest) -> None:
        self.sched.abort(msg.rid)

    # -- stopping ---------------------------------------------------------------------

    def drain_started(self, grace_s: float) -> None:
        log.info("stopping: finishing %d running requests (up to %g s)", len(self.sched.running), grace_s)

    def drained(self) -> bool:
        return not self.sched.busy

    def abort_remaining(self) -> None:
        for req in list(self.sched.running) + list(self.sched.waiting):
            self.sched.abort(req.rid)


def _aux_sizes(layout: PoolLayout) -> dict[str, int]:
    """``build_cache``'s SWA / Mamba sizes from the pools the launcher made."""
    sizes: dict[str, int] = {}
    names = {c.name for c in layout.components}
    if "swa" in names:
        swa = layout.component("swa")
        sizes.update(swa_l1_pages=swa.l1_pages, swa_l2_pages=swa.l2_pages)
    if "mamba" in names:
        mamba = layout.component("mamba")
        sizes.update(l1_state_slots=mamba.l1_pages, l2_state_slots=mamba.l2_pages)
    return sizes


def scheduler_main(args: SchedulerArgs) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    stop = enter_process(args.config)
    SchedulerProcess.build(args, stop).run()
