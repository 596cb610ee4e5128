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

``CacheServerProcess`` is the loop (``hicache.scheduler.loop.ProcessLoop``: heartbeat,
telemetry, controller watchdog, stop, as in builtin mode) around the ``CacheServer``; one
handler per inbox message type (``handlers``). A round polls both sockets (at most
``POLL_MS``, not at all while engine messages are queued), reads every engine message
waiting (at most ``READ_BATCH``) into a queue per engine (``EngineQueues``: a heartbeat is
served as it is read; a lookup or reserve past its engine's ``engine.queue_limit`` is
answered ``protos.BUSY`` at once), answers up to ``ENGINE_BATCH`` queued messages
round-robin across the engines (each at once: no answer waits for L3) and
``hicache.scheduler.loop.INBOX_BATCH`` inbox messages, and expires sessions every
``EXPIRE_INTERVAL_S``, once every engine message is read and served (``drain_engines``). A
session's silence counts only time this loop ran: after a stall of the loop (``STALL_S``)
every session is credited the stall, since its heartbeats could not be read.

A frame that does not decode is answered (ROUTER: an ``EngineError`` with ``req`` 0) or
logged and dropped (PULL); the loop goes on. SIGTERM or ``Shutdown`` ends the loop at the end
of the round (nothing to drain: open leases die with the process, the pools go with the
daemon).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING

import zmq

import protos
from hicache.cache_server.queues import EngineQueues, Offer, queue_key
from hicache.config import ENGINE_MODE_ERROR, EngineConfig
from hicache.memory.pools import attach_pools
from hicache.runtime.ipc import PeerProtocolError, RouterSocket
from hicache.scheduler.loop import (
    Every,
    Links,
    ProcessLoop,
    SchedulerArgs,
    StopSignal,
    Telemetry,
    enter_process,
    ignore,
)

if TYPE_CHECKING:
    from hicache.cache_server.server import CacheServer
    from hicache.kv_events.stream import KVEventStream
    from hicache.memory.pools import SharedPools

log = logging.getLogger("hicache.cache_server")

EXPIRE_INTERVAL_S = 0.25
"""How often expired leases and sessions are dropped (``CacheServer.expire``)."""

POLL_MS = 50
"""The longest wait of a round for the engines' socket and the inbox."""

STALL_S = 1.0
"""A gap between two rounds longer than this is a stall of this loop (a round takes at most
``POLL_MS`` plus its work): every session is credited the gap (``LeaseTable.credit``)."""

EXPIRE_DRAIN_LIMIT = 100_000
"""Engine messages served before an expiry at most; with more queued, the expiry waits."""

ENGINE_BATCH = 256
"""Engine messages answered per round at most, before the inbox."""

READ_BATCH = 4096
"""Engine messages read off the socket per round at most (into the queues)."""

ENGINE_ACCEPTS = protos.accepted_by("scheduler", socket=protos.ENGINE_SOCKET)
"""What the engine socket decodes (``protos.table``)."""


def build_cache_server(args: SchedulerArgs, controller_send: Callable[[protos.ControllerMessage], None]
                       ) -> CacheServer:
    """The tree (L2 only: a Full component, an SWA one for a model with window layers and a
    Mamba one for a model with state layers),
    the tier manager and the ``CacheServer`` over the pools of ``args.layout`` (mapped by
    the caller)."""
    from hicache.cache_server.geometry import geometry_from_config, sliding_window_from_config
    from hicache.cache_server.l2_pool import STATE, WINDOW
    from hicache.cache_server.pins import PinEntry
    from hicache.cache_server.server import CacheServer
    from hicache.hashing import HashNamespace
    from hicache.memory.allocator import PageAllocator
    from hicache.scheduler.controller_driver import ControllerDriver
    from hicache.tree.cache import UnifiedRadixCache
    from hicache.tree.components import FullComponent, MambaComponent, SWAComponent, TreeComponent

    cfg = args.config
    geometry = geometry_from_config(cfg)
    full = args.layout.component("full")
    ps = cfg.cache.page_size
    comps: list[TreeComponent] = [FullComponent(PageAllocator(0, "l1-full"), PageAllocator(full.l2_pages, "l2-full"))]
    pool = protos.L2PoolInfo(args.layout.instance, full.l2[0].segment, args.layout.directory, full.l2_pages,
                      full.l2_page_bytes)
    if geometry.window_layers:
        window = args.layout.component(WINDOW)
        comps.append(SWAComponent(PageAllocator(0, "l1-swa"), sliding_window_from_config(cfg),
                                  PageAllocator(window.l2_pages, "l2-swa")))
        pool = dataclasses.replace(pool, window_segment=window.l2[0].segment, window_pages=window.l2_pages,
                                   window_page_bytes=window.l2_page_bytes)
    if geometry.state_layers:
        state = args.layout.component(STATE)
        comps.append(MambaComponent(PageAllocator(0, "l1-mamba"), PageAllocator(state.l2_pages, "l2-mamba")))
        pool = dataclasses.replace(pool, state_segment=state.l2[0].segment, state_slots=state.l2_pages,
                                   state_bytes=state.l2_page_bytes)
    cache = UnifiedRadixCache(comps, ps, hasher=HashNamespace(geometry.model_identity, geometry.kv_dtype, ps, "full"),
                              eviction_policy=cfg.cache.eviction, write_policy="write_through")
    tier = ControllerDriver(cache, controller_send, prefetch=cfg.cache.prefetch,
                       l3_enabled=cfg.cache.l3.backend != "none")
    pinned = [PinEntry(p.name, tuple(p.token_ids or ()), p.cache_salt) for p in cfg.cache.pinned]
    return CacheServer(cache, tier, geometry, pool, cfg.engine.lease_ttl_s, pinned=pinned,
                       pinned_fraction=cfg.cache.pinned_fraction, save_wait_s=cfg.engine.save_wait_ms / 1000)


class CacheServerProcess(ProcessLoop):
    """The engine-mode loop around ``server`` (see the module docstring)."""

    log = log
    title = "cache server"

    def __init__(self, args: SchedulerArgs, links: Links, pools: SharedPools | None, server: CacheServer,
                 engines: RouterSocket[protos.Message], *, telemetry: Telemetry, stop: StopSignal,
                 kv_events: KVEventStream | None = None, queue_limit: int = EngineConfig.queue_limit) -> None:
        tier = server.tier
        assert tier is not None and links.to_controller is not None, "engine mode always runs a controller"
        super().__init__(args, links, pools, tier=tier, telemetry=telemetry, stop=stop, kv_events=kv_events)
        self.server = server
        self.engines = engines
        self.queues: EngineQueues[bytes] = EngineQueues(queue_limit)
        links.extra.append(engines)
        self._expire = Every(EXPIRE_INTERVAL_S)
        self._last_awake: float | None = None
        self.poller = zmq.Poller()
        self.poller.register(engines.socket, zmq.POLLIN)
        self.poller.register(links.inbox.socket, zmq.POLLIN)
        admin = _Admin(server, links.to_tokenizer.send, links.to_controller.send, self.storage_status_seen)
        self.handlers.update({
            protos.GenerateRequest: admin.refuse_generate,
            protos.AbortRequest: ignore,  # nothing generates here
            protos.AdminRequest: admin.admin,
            protos.StorageStatus: admin.on_storage_status,
            protos.OpDone: tier.on_message,
            protos.PrefetchHits: tier.on_message,
        })

    @classmethod
    def build(cls, args: SchedulerArgs, stop: StopSignal) -> CacheServerProcess:
        """Map the pools, open the sockets (the engines' ROUTER too), build the cache server."""
        from hicache.cache_server.sessions import split_salt
        from hicache.cache_server.telemetry import EngineTelemetry
        from hicache.kv_events.stream import KVEventStream
        from hicache.metrics import init_process_metrics
        from hicache.tree import Tier

        pools = attach_pools(args.layout)
        links = Links.open(args, controller=True)
        assert links.to_controller is not None
        server = build_cache_server(args, links.to_controller.send)
        engines: RouterSocket[protos.Message] = RouterSocket(links.ctx, args.endpoints.address("engine"),
                                                             ENGINE_ACCEPTS)
        telemetry = EngineTelemetry(init_process_metrics(args.config.metrics, "scheduler"), server)
        # L2 and L3 (the engines keep L1 themselves); events name the request's own cache_salt
        events = KVEventStream.open(args.config, server.cache, tiers=(Tier.HOST, Tier.STORAGE),
                                    split_salt=split_salt)
        return cls(args, links, pools, server, engines, telemetry=telemetry, stop=stop, kv_events=events,
                   queue_limit=args.config.engine.queue_limit)

    def ready_line(self) -> str:
        g, cfg = self.server.geometry, self.args.config
        return (f"cache server ready for engines on {self.args.endpoints.address('engine')}: {g.num_layers} layers "
                f"x {g.num_kv_heads} kv heads x {g.head_dim} dim, {g.kv_dtype}, block {g.block_size}, "
                f"L2 {self.server.pool.pages} pages, L3 {cfg.cache.l3.backend}")

    def awake(self) -> None:
        """Note that the loop runs; after a stall (more than ``STALL_S`` since the last note:
        the process was stopped, starved or busy) credit every session the gap, since the
        engines' messages of that time are not read yet."""
        now = self.clock()
        if self._last_awake is not None and now - self._last_awake > STALL_S:
            self.server.leases.credit(now - self._last_awake)
        self._last_awake = now

    def round(self) -> None:
        self.awake()
        ready = dict(self.poller.poll(0 if len(self.queues) else POLL_MS))
        self.awake()
        if self.engines.socket in ready:
            self.read_engines(READ_BATCH)
        for _ in range(ENGINE_BATCH):
            if not self.serve_queued():
                break
        if self.links.inbox.socket in ready:
            self.read_inbox(0)
        if self.server.pins is not None:
            self.server.pins.poll()  # pins whose prefetch from L3 ended
        if self._expire.due(self.clock()) and self.drain_engines():
            self.awake()
            self.server.expire()

    def drain_engines(self) -> bool:
        """Read and serve every engine message (at most ``EXPIRE_DRAIN_LIMIT`` read and served
        together); True when the socket and the queues are empty. Expiry runs only then, so a
        heartbeat behind a backlog renews its session before the session's silence is judged
        (messages still in the kernel's socket buffer after a stall are covered by
        ``STALL_S``'s credit instead)."""
        handled = 0
        while handled < EXPIRE_DRAIN_LIMIT:
            read = self.read_engines(READ_BATCH)
            handled += read
            while handled < EXPIRE_DRAIN_LIMIT and self.serve_queued():
                handled += 1
            if read < READ_BATCH and not len(self.queues):
                return True
        return False

    def read_engines(self, limit: int) -> int:
        """Read up to ``limit`` waiting engine messages into their queues (``EngineQueues``):
        a heartbeat, and a message past the queues' hard bounds, is served at once; a lookup
        or reserve past its engine's bound is answered ``protos.BUSY`` at once. A frame that
        does not decode is answered with an ``EngineError``. Returns how many frames it read
        (fewer than ``limit``: none is left waiting)."""
        engines = self.engines
        for n in range(limit):
            try:
                got = engines.recv(0)
            except PeerProtocolError as exc:
                log.warning("refused an engine frame: %s", exc)
                engines.send(exc.peer, protos.EngineError(0, "bad_request", f"refused frame: {exc}"))
                continue
            except protos.ProtocolError as exc:
                log.warning("refused an engine frame: %s", exc)
                continue
            if got is None:
                return n
            peer, msg = got
            offer = self.queues.offer(queue_key(peer, msg), peer, msg)
            if offer is Offer.BUSY:
                assert isinstance(msg, (protos.Lookup, protos.Reserve))
                engines.send(peer, self.server.busy(msg))
            elif offer is Offer.NOW:
                self.serve(peer, msg)
        return limit

    def serve_queued(self) -> bool:
        """Serve the next queued engine message (round-robin across the engines); False when
        none is queued."""
        got = self.queues.pop()
        if got is None:
            return False
        self.serve(*got)
        return True

    def serve(self, peer: bytes, msg: protos.Message) -> None:
        """Answer one engine message; an exception in a handler is logged and answered, so no
        engine message can stop the loop."""
        try:
            answer = self.server.handle(msg)
        except Exception as exc:  # a bug must cost this request, not the daemon
            log.exception("engine request %s failed", type(msg).__name__)
            answer = protos.EngineError(getattr(msg, "req", 0), "bad_request", f"{type(exc).__name__}: {exc}")
        if answer is not None:
            self.engines.send(peer, answer)

    def check_idle(self) -> None:
        self.server.check_idle()

    def drained(self) -> bool:
        return True  # open leases die with the process

    def abort_remaining(self) -> None:
        """Nothing runs here that a drain could finish."""

    def drain_started(self, grace_s: float) -> None:
        """The loop ends at the end of this round."""


def cache_server_main(args: SchedulerArgs) -> None:
    """Process entry point in engine mode (``multiprocessing`` spawn target)."""
    stop = enter_process(args.config)
    CacheServerProcess.build(args, stop).run()


ENGINE_PINS_FIXED = ("in engine mode the pinned prefixes are cache.pinned, started when each engine namespace "
                     "registers (hicache.cache_server.pins); they cannot be changed at run time")

class _Admin:
    """Tokenizer requests in engine mode: admin ops answered here (storage ops through the
    controller); generation requests are refused, since the engines generate."""

    def __init__(self, server: CacheServer, emit: Callable[[protos.TokenizerMessage], None],
                 controller_send: Callable[[protos.ControllerMessage], None],
                 status_seen: Callable[[str | None, protos.StorageStatus], None]) -> None:
        self.server = server
        self.emit = emit
        self.controller_send = controller_send
        self.status_seen = status_seen
        """Told of each ``StorageStatus`` and the op it answers (``ProcessLoop.storage_status_seen``)."""
        self._ids = count(1)
        self._waiting: dict[int, tuple[str, str]] = {}  # storage op id -> (rid, op)

    def refuse_generate(self, msg: protos.GenerateRequest) -> None:
        self.emit(protos.TokenOutput(msg.rid, [], True, "error", None, ENGINE_MODE_ERROR))

    def on_storage_status(self, msg: protos.StorageStatus) -> None:
        """The answer to a storage op (or the store's own change, ``op_id`` -1)."""
        if self.server.tier is not None:
            self.server.tier.l3_enabled = msg.backend != "none"
        waiting = self._waiting.pop(msg.op_id, None)
        self.status_seen(None if waiting is None else waiting[1], msg)
        if waiting is not None:
            self.emit(protos.AdminReply(waiting[0], msg.error is None,
                                        {"backend": msg.backend, "up": msg.up, "stats": msg.stats}, msg.error))

    def admin(self, msg: protos.AdminRequest) -> None:
        """``stats``, ``flush`` and ``pins`` answered here (``pin`` / ``unpin`` refused), ``storage_*`` through the controller (refused
        with ``busy`` unless idle, but for ``storage_status``)."""
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
                self._waiting[op_id] = (msg.rid, op)
                self.controller_send(protos.StorageAdmin(op_id, op, msg.args))
            elif msg.op == "pins":
                pins = self.server.pins
                self.emit(protos.AdminReply(msg.rid, True, {"pinned": [] if pins is None else pins.listing()}))
            elif msg.op in ("pin", "unpin"):  # engine-mode pins come from cache.pinned only
                self.emit(protos.AdminReply(msg.rid, False, {"refused": True}, ENGINE_PINS_FIXED))
            else:
                self.emit(protos.AdminReply(msg.rid, False, {}, f"unknown admin op {msg.op!r}"))
        except Exception as exc:  # an admin call must never take the cache server down
            log.exception("admin op %s failed", msg.op)
            self.emit(protos.AdminReply(msg.rid, False, {}, f"{type(exc).__name__}: {exc}"))
