"""What the scheduler process's loop does in both modes: builtin (``hicache.scheduler.process``,
``SchedulerProcess``) and engine (``hicache.cache_server.process``, ``CacheServerProcess``).

``ProcessLoop`` is the base of both. One round of ``run``:

1. stamp the heartbeat (``hicache.runtime.heartbeat``): a round lasts at most one forward pass (builtin)
   plus one poll (``IDLE_POLL_MS`` builtin, ``hicache.cache_server.process.POLL_MS`` engine),
   so a heartbeat older than ``server.health_stale_s`` means the process is stopped or stuck;
   after the round, the mode's ``stalled_since`` (work without progress) goes next to it;
2. after SIGTERM, start draining with ``SchedulerArgs.grace_s``;
3. ``round()``: the mode's own work (read the sockets, compute, answer); then, with
   ``events.enabled``, publish the round's tier changes as one KV event batch
   (``hicache.kv_events``, never waiting);
4. ask the launcher, once, to restart a controller that has left an op unanswered for
   ``server.controller_op_timeout_s``; back up again the failed L3 backups whose delay has
   passed (``ControllerDriver.retry_backups``);
5. settle the garbage collector (``hicache.runtime.gc_guard``: what survived since the last settle
   is frozen, so no collection walks the whole tree); publish telemetry every
   ``METRICS_INTERVAL_S``; run the idle integrity check while ``idle()``, every
   ``IDLE_CHECK_INTERVAL_S`` or less often (``IDLE_CHECK_SHARE``), one bounded slice of
   the tree at a time;
6. while draining: end once ``drained()``, or at the deadline after ``abort_remaining()``.
   Then the heartbeat, the sockets and the pools are closed.

Inbox messages are dispatched by type through ``handlers`` (message type -> bound method;
each mode adds its own): the base handles ``Shutdown`` (drain within its ``grace_s``),
``ProcessEvent`` (a dead controller: the in-flight ops fail back, the messages not yet
delivered to it are dropped, and no op is started until a controller serves again),
``ControllerStarted`` (the new controller's run, which every op carries from then on; the
L3 store in force is sent to it: ``hicache.scheduler.controller_link``) and
``ErrorReply`` (logged). The inbox is read ``INBOX_BATCH``
messages per round at most, so a flood of messages cannot starve the forward pass or the
engines' socket. A frame that does not decode is logged and dropped; the loop goes on.

Stop: SIGTERM (the launcher's orderly stop, or a signal to the whole process group) drains
within ``SchedulerArgs.grace_s`` (``DEFAULT_GRACE_S``: longer than the tokenizer's own drain,
``hicache.api_server.args.DEFAULT_GRACE_S``, whose aborts end the requests first when both get
the signal; shorter than the launcher's ``STOP_TIMEOUT_S`` before SIGKILL); a ``Shutdown``
message within its own ``grace_s``. SIGINT is ignored: Ctrl-C reaches the launcher, which
stops the children in order.
"""

from __future__ import annotations

import abc
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import protos
from hicache.config import HicacheConfig
from hicache.metrics import get_metrics
from hicache.runtime.gc_guard import GcGuard
from hicache.runtime.heartbeat import HeartbeatWriter
from hicache.runtime.ipc import Endpoints, PullSocket, PushSocket, ResettablePush, open_context
from hicache.runtime.logging_setup import setup_logging
from hicache.runtime.proc import die_with_parent
from hicache.scheduler.controller_link import ControllerLink

if TYPE_CHECKING:
    import zmq

    from hicache.kv_events.stream import KVEventStream
    from hicache.memory.layout import PoolLayout
    from hicache.memory.pools import SharedPools
    from hicache.scheduler.controller_driver import ControllerDriver

ACCEPTS = protos.accepted_by("scheduler")
"""What the scheduler process's inbox decodes (``protos.table``)."""

IDLE_CHECK_INTERVAL_S = 1.0
"""How often the idle integrity check runs at most (only while nothing is running or in flight)."""

IDLE_CHECK_SHARE = 0.02
"""The most of the loop's time the idle integrity check may take: after a check that took
``d`` seconds the next waits ``max(IDLE_CHECK_INTERVAL_S, d / IDLE_CHECK_SHARE)``. Each
check is one bounded slice of the tree (``check_integrity_slice``), and between two engine
steps the cache server is often idle: the share keeps even a slow slice from taking over."""

METRICS_INTERVAL_S = 0.5
"""How often the process publishes its gauges."""

INBOX_BATCH = 256
"""Inbox messages handled per round at most, before the round's other work."""

DEFAULT_GRACE_S = 30.0
"""How long a SIGTERM lets running work finish before the rest is aborted."""

TOKENIZER_LINGER_MS = 2000
"""How long, at exit, the last token outputs and admin replies may take to leave."""


@dataclass(frozen=True)
class SchedulerArgs:
    """What the scheduler process is started with (pickled by ``spawn``): the config, the
    pools to map, the endpoints, the launcher's address for ``Ready`` and restart requests,
    and the drain allowed after SIGTERM (``grace_s``)."""

    config: HicacheConfig
    layout: PoolLayout
    endpoints: Endpoints
    ready_address: str
    grace_s: float = DEFAULT_GRACE_S
    controller_run: int = 0
    """The run of the controller started beside this process (``ControllerArgs.run``);
    later ones come in ``ControllerStarted``."""


class Telemetry(Protocol):
    """A mode's gauges (``SchedulerTelemetry``, ``EngineTelemetry``)."""

    def publish(self) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


class StopSignal:
    """Set (``requested``) by SIGTERM once ``install``ed; SIGINT is then ignored."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> StopSignal:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        self.requested = True


def enter_process(cfg: HicacheConfig) -> StopSignal:
    """The first steps of the scheduler process in either mode: logging, the stop signal,
    death with the launcher (``die_with_parent``)."""
    setup_logging("scheduler", cfg.logging.level, cfg.logging.json)
    stop = StopSignal().install()
    die_with_parent()
    return stop


@dataclass
class Links:
    """The scheduler process's sockets (see the tables of the two process modules).

    ``to_controller`` is None without a controller (L2 off, builtin mode); ``extra`` holds a
    mode's own sockets (engine mode's ROUTER), closed first."""

    ctx: zmq.Context[Any]
    inbox: PullSocket[protos.Message]
    to_tokenizer: PushSocket[protos.TokenizerMessage]
    to_launcher: PushSocket[protos.Message]
    to_controller: ControllerLink | None
    extra: list[Closable] = field(default_factory=list)

    @classmethod
    def open(cls, args: SchedulerArgs, *, controller: bool) -> Links:
        """Open the context and the sockets (binds the ``scheduler`` endpoint)."""
        ep = args.endpoints
        ctx = open_context(ep)
        return cls(ctx, PullSocket(ctx, ep.address("scheduler"), ACCEPTS, bind=True),
                   PushSocket(ctx, ep.address("tokenizer")), PushSocket(ctx, args.ready_address),
                   ControllerLink(ResettablePush(ctx, ep.address("controller"))) if controller else None)

    def close(self) -> None:
        for sock in (*self.extra, self.inbox, self.to_launcher):
            sock.close()
        self.to_tokenizer.close(linger_ms=TOKENIZER_LINGER_MS)
        if self.to_controller is not None:
            self.to_controller.close()
        self.ctx.term()


@dataclass
class Every:
    """A periodic task's timer: ``due(now)`` is True (and restarts the timer) once more than
    ``interval_s`` has passed since it last was."""

    interval_s: float
    last: float = 0.0

    def due(self, now: float) -> bool:
        if now - self.last > self.interval_s:
            self.last = now
            return True
        return False


class ProcessLoop(abc.ABC):
    """The loop of the scheduler process (see the module docstring); a mode subclasses it.

    Built once everything the process serves with is ready (the heartbeat starts here, right
    before ``run`` sends ``Ready``). ``tier`` is None when no controller runs."""

    log: ClassVar[logging.Logger] = logging.getLogger("hicache.scheduler")
    title: ClassVar[str] = "scheduler"
    """What the log calls the process ("... stopped")."""

    def __init__(self, args: SchedulerArgs, links: Links, pools: SharedPools | None, *,
                 tier: ControllerDriver | None, telemetry: Telemetry, stop: StopSignal,
                 kv_events: KVEventStream | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.args = args
        self.links = links
        self.pools = pools
        self.tier = tier
        self.telemetry = telemetry
        self.stop = stop
        self.kv_events = kv_events
        self._kv_events_counted = (0, 0)  # (published, dropped) events last put in the metrics
        self.clock = clock
        self.restart_asked = False
        self.drain_deadline: float | None = None
        self._metrics = Every(METRICS_INTERVAL_S)
        self._idle_check = Every(IDLE_CHECK_INTERVAL_S)
        self._gc: GcGuard | None = None  # from ``run`` on: the collector kept off the tree
        if tier is not None:
            tier.run = args.controller_run
        self.handlers: dict[type[protos.Message], Callable[[Any], object]] = {
            protos.Shutdown: self.on_shutdown,
            protos.ProcessEvent: self.on_process_event,
            protos.ControllerStarted: self.on_controller_started,
            protos.ErrorReply: self.on_error_reply,
            protos.StorageEvicted: self.on_storage_evicted,
        }
        self.heartbeat = HeartbeatWriter(args.endpoints.dir, "scheduler")

    # -- what a mode provides ----------------------------------------------------------

    @abc.abstractmethod
    def round(self) -> None:
        """The mode's work of one round: read its sockets (``read_inbox``), compute, answer."""

    @abc.abstractmethod
    def ready_line(self) -> str:
        """What the log says once the process is serving."""

    def idle(self) -> bool:
        """Whether the idle integrity check may run this round."""
        return True

    def stalled_since(self) -> float | None:
        """Since when the mode has had work without progress (``HeartbeatWriter.stalled``);
        None: it progresses."""
        return None

    @abc.abstractmethod
    def check_idle(self) -> None:
        """The idle integrity check (while ``idle()``, at most every ``IDLE_CHECK_INTERVAL_S``
        and within ``IDLE_CHECK_SHARE`` of the loop's time)."""

    @abc.abstractmethod
    def drained(self) -> bool:
        """Whether a drain has nothing left to finish (the loop then ends)."""

    @abc.abstractmethod
    def abort_remaining(self) -> None:
        """End what a drain did not finish within its grace."""

    @abc.abstractmethod
    def drain_started(self, grace_s: float) -> None:
        """Called once when a drain starts (a mode logs what it will finish)."""

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        """Publish the telemetry once (the pools' gauges are on ``/metrics`` as soon as the
        daemon serves), send ``Ready``, loop until a stop has drained, close everything."""
        self.telemetry.publish()
        self.links.to_launcher.send(protos.Ready("scheduler", os.getpid()))
        self.log.info("%s", self.ready_line())
        self._gc = GcGuard()
        try:
            while True:
                self.heartbeat.beat()
                if self.stop.requested:
                    self.begin_drain(self.args.grace_s)
                self.round()
                self.heartbeat.stalled(self.stalled_since())
                self.publish_kv_events()
                self.housekeeping()
                if self.drain_over():
                    break
        finally:
            self._gc.close()
            self._gc = None
            self.close()
        self.log.info("%s stopped", self.title)

    def housekeeping(self) -> None:
        """Steps 4 and 5 of a round: the controller watchdog, the failed L3 backups' retries,
        telemetry, the idle check."""
        self.watch_controller()
        if self.tier is not None:
            self.tier.retry_backups()
        now = self.clock()
        if self._metrics.due(now):
            self.telemetry.publish()
            self.count_kv_events()
        if self._gc is not None:
            self._gc.settle(now)
        if self.idle() and self._idle_check.due(now):
            start = self.clock()
            self.check_idle()
            took = self.clock() - start
            self._idle_check.interval_s = max(IDLE_CHECK_INTERVAL_S, took / IDLE_CHECK_SHARE)

    def publish_kv_events(self) -> None:
        """Publish the tier changes since the last call as one batch (never waits); a mode
        may call it inside its round too, before a long step, so the events wait for nothing."""
        if self.kv_events is not None:
            lag = self.kv_events.flush()
            if lag is not None:
                get_metrics().kv_event_lag(lag)

    def on_storage_evicted(self, msg: protos.StorageEvicted) -> None:
        """The L3 store evicted these pages: announce it (the tree is not changed)."""
        if self.kv_events is not None:
            self.kv_events.storage_evicted(msg.hashes)

    def storage_status_seen(self, op: str | None, msg: protos.StorageStatus) -> None:
        """The controller's answer to the storage admin op ``op`` (None: unprompted). When L3
        no longer holds what the events announced -- no store (detached, or refused), a store
        cleared (also on an error: in part, maybe) or another one attached -- the events
        remove every L3 page they announced (``KVEventStream.storage_replaced``)."""
        if self.kv_events is not None and (msg.backend == "none" or op == "clear"
                                           or (op == "attach" and msg.error is None)):
            self.kv_events.storage_replaced()

    def count_kv_events(self) -> None:
        """Put the events published and dropped since the last call in the metrics."""
        if self.kv_events is None:
            return
        st = self.kv_events.stats()
        published, dropped = self._kv_events_counted
        get_metrics().kv_events(st.published_events - published, st.dropped_events - dropped)
        self._kv_events_counted = (st.published_events, st.dropped_events)

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.count_kv_events()
        self.heartbeat.close()
        self.links.close()
        if self.pools is not None:
            self.pools.close()

    # -- the inbox ---------------------------------------------------------------------

    def receive(self, timeout_ms: int) -> bool:
        """Handle the next inbox message, waiting up to ``timeout_ms`` (0: only one queued now);
        False if none came. A frame that does not decode is logged and dropped, and counts as
        one that came."""
        inbox = self.links.inbox
        try:
            msg = inbox.recv_ready() if timeout_ms == 0 else inbox.recv(timeout_ms)
        except protos.ProtocolError as exc:
            self.log.warning("refused a frame: %s", exc)
            return True
        if msg is None:
            return False
        self.dispatch(msg)
        return True

    def read_inbox(self, timeout_ms: int) -> None:
        """Handle up to ``INBOX_BATCH`` messages: the first within ``timeout_ms``, then those
        queued now."""
        for _ in range(INBOX_BATCH):
            if not self.receive(timeout_ms):
                return
            timeout_ms = 0

    def dispatch(self, msg: protos.Message) -> None:
        if isinstance(msg, protos.StorageStatus) and self.links.to_controller is not None:
            self.links.to_controller.on_status(msg)  # the store in force, before the mode's handler
        handler = self.handlers.get(type(msg))
        if handler is None:  # the inbox decodes only ACCEPTS, which a mode's table covers
            self.log.warning("no handler for %s: dropped", type(msg).__name__)
            return
        handler(msg)

    def on_shutdown(self, msg: protos.Shutdown) -> None:
        self.stop.requested = True
        self.begin_drain(msg.grace_s)

    def on_process_event(self, msg: protos.ProcessEvent) -> None:
        """A controller that died: fail its in-flight ops back, drop what it was not sent
        yet, start no op until its successor serves (``on_controller_started``)."""
        if msg.process != "controller" or msg.event != "died" or self.tier is None:
            return
        failed = self.tier.on_controller_lost()
        self.tier.run = None
        if self.links.to_controller is not None:
            self.links.to_controller.reset()
        if self.kv_events is not None:  # the evictions it had not reported died with it
            self.kv_events.storage_replaced()
        self.restart_asked = False
        self.log.warning("controller died (%s): %d in-flight ops failed back", msg.detail, failed)

    def on_controller_started(self, msg: protos.ControllerStarted) -> None:
        """A new controller serves: ops carry its run from now on; it is sent the L3 store in
        force, and L3 stays off until its answer says which store serves."""
        if self.tier is None or self.links.to_controller is None:
            return
        if self.tier.run is not None and self.tier.in_flight:  # its predecessor's death was not reported
            self.tier.on_controller_lost()
            self.links.to_controller.reset()
        self.tier.run = msg.run
        self.restart_asked = False
        self.tier.l3_enabled = False
        sent = self.links.to_controller.restore()
        self.log.info("controller %d serves (run %d); L3 store sent to it: %s", msg.pid, msg.run, sent.op)

    def on_error_reply(self, msg: protos.ErrorReply) -> None:
        self.log.warning("a peer refused one of our frames: %s", msg.error)

    # -- controller liveness -----------------------------------------------------------

    def watch_controller(self) -> None:
        """Ask the launcher (once per controller) to restart a controller that has left an op
        unanswered for ``server.controller_op_timeout_s``."""
        if self.tier is None or self.restart_asked:
            return
        age = self.tier.oldest_op_age()
        if age > self.args.config.server.controller_op_timeout_s:
            self.log.error("the controller has not answered for %.0f s: asking for a restart", age)
            self.links.to_launcher.send(protos.ProcessEvent("controller", "restart", 0, "ops unanswered"))
            self.restart_asked = True

    # -- stopping ----------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def begin_drain(self, grace_s: float) -> None:
        """Start a drain ending ``grace_s`` from now; a drain already started keeps its deadline."""
        if self.drain_deadline is None:
            self.drain_deadline = self.clock() + grace_s
            self.drain_started(grace_s)

    def drain_over(self) -> bool:
        """While draining: True once ``drained()``, or at the deadline after ``abort_remaining()``."""
        if self.drain_deadline is None:
            return False
        if self.drained():
            return True
        if self.clock() > self.drain_deadline:
            self.abort_remaining()
            return True
        return False


def ignore(msg: protos.Message) -> None:
    """The handler of a message a mode accepts and has nothing to do with."""
