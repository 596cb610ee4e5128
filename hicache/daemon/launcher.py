"""The launcher that starts, supervises and stops the daemon's processes (``hicache serve``:
``hicache.cli.serve``).

Start (any failure stops what was started, removes what was created, and exits 1 naming
the process and the reason):

1. validate the config and make the start checks ``hicache check-config`` makes too
   (``hicache.daemon.startup_checks.startup_problems``: the model, its geometry, the memory its
   pools need); exit 2 with every problem and its key path;
2. create the private runtime directory, the metrics directory and the shared-memory pools;
3. spawn the cache controller (when L2 is on), the scheduler and the tokenizer side by side;
   wait for the first two's ``Ready``, then tell the tokenizer (``Ready("scheduler", pid)``
   pushed to its address: it has loaded its tokenizer meanwhile, and holds its HTTP port until
   then, so nothing reaches a scheduler that is not ready) and wait for its ``Ready``
   (``START_TIMEOUT_S`` each wait). None needs anything from another to start: what one
   sends another waits in its socket until the other reads it.

Supervision (the loop in ``Launcher.supervise``):

============================  =========================================================
event                         what the launcher does
============================  =========================================================
controller exits / is killed  tell the scheduler (``ProcessEvent died``: it fails the
                              in-flight ops back and drops undelivered messages), count
                              the restart, spawn a new controller on the same pools with a
                              fresh run, then tell the scheduler that run
                              (``ControllerStarted``: only ops naming it run there)
scheduler asks ``restart``    SIGKILL the hung controller (then as above)
controller frozen             no heartbeat for ``server.controller_freeze_restart_s``
                              (default 30 s; 0 = never): SIGKILL it (then as above)
scheduler frozen              no heartbeat for ``server.health_stale_s``: logged (and
                              ``/health`` says degraded), never restarted — its tree and
                              running requests cannot be rebuilt from outside
scheduler or tokenizer exits  stop everything, exit 1 with the process and exit code
scheduler, tokenizer or       a child exits 0 only when it was told to stop: the signal
controller exits 0            went to the whole process group (systemd's default
                              ``KillMode=control-group``, ``timeout``, Ctrl-C): orderly
                              stop of the others, exit 0 (a controller is not restarted)
SIGTERM / SIGINT              orderly stop (below), exit 0
============================  =========================================================

Heartbeats (``hicache.runtime.heartbeat``): the scheduler and the controller write a timestamp
(``time.monotonic()``, shared by every process of the host) to
``{runtime dir}/heartbeat/{name}`` from their loops, at most every ``HEARTBEAT_INTERVAL_S``.
Both loops block in polls of at most 100 ms, so a loop that runs beats; a process that is
stopped (SIGSTOP), or a loop stuck in one call, does not. The launcher reads them for the
freeze restart above; the tokenizer for ``/health``.

A frame on the launcher's socket that does not decode, or is not a message it accepts, is
logged and dropped; supervision goes on.

Orderly stop: SIGTERM to the tokenizer (stops accepting, drains within
``TokenizerArgs.grace_s``), then the scheduler (finishes running requests within
``SchedulerArgs.grace_s``, aborts the rest), then the controller (finishes queued L3
backups), each within ``STOP_TIMEOUT_S`` before SIGKILL; then the shared memory is unlinked
and the runtime directory removed. Children die with the launcher (``die_with_parent``) if
it is killed outright.

Imports: the launcher never imports torch (about 3 s of CPU per start on the development
machine): it creates the pools' segments from their layout (``hicache.memory.layout``) and
starts the children through ``hicache.daemon.entrypoints``, which import their modules in the
child. Module-level imports stay light (no zmq either); the sockets and the start checks are
imported where they are used, and the annotations' types only under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import zmq

    import protos
    from controller.args import ControllerArgs
    from hicache.api_server.args import TokenizerArgs
    from hicache.config import HicacheConfig, IpcConfig
    from hicache.memory.layout import PoolLayout
    from hicache.memory.shm import SharedSegment
    from hicache.runtime.ipc import Endpoints, PullSocket
    from hicache.scheduler.loop import SchedulerArgs

    ChildArgs = ControllerArgs | SchedulerArgs | TokenizerArgs

log = logging.getLogger("hicache.daemon.launcher")

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 40.0
"""How long a child may take to stop after SIGTERM before SIGKILL (more than the scheduler's
drain, ``hicache.scheduler.loop.DEFAULT_GRACE_S``)."""

INBOX_POLL_MS = 200
"""The launcher's wait for a message per round of start-up and supervision."""

KILL_JOIN_S = 10.0
"""How long the launcher waits for a SIGKILLed controller to be reaped."""


def new_controller_run() -> int:
    """A fresh controller run (``ControllerArgs.run``): random, never 0 (0 is the run of a
    controller started outside a daemon, e.g. by a benchmark)."""
    import secrets

    return secrets.randbelow(2**62 - 1) + 1


class Liveness(enum.Enum):
    """What the launcher last saw of a process's heartbeat (it logs each change)."""

    BEATING = "beating"
    STALE = "stale"


class StartError(RuntimeError):
    """A process could not be started; the message names it and says why."""


@dataclass
class _Child:
    """One supervised process: its spawn target and arguments, the running process (None
    before the first start), how often it was restarted."""

    name: str
    target: Callable[[Any], None]
    args: ChildArgs
    proc: BaseProcess | None = None
    restarts: int = 0

    @property
    def process(self) -> BaseProcess:
        """The started process (``proc``); only after ``Launcher._spawn``."""
        assert self.proc is not None, f"the {self.name} was not started"
        return self.proc

    @property
    def pid(self) -> int:
        """The started process's pid."""
        pid = self.process.pid
        assert pid is not None, f"the {self.name} was not started"
        return pid


@dataclass
class Launcher:
    cfg: HicacheConfig
    children: dict[str, _Child] = field(default_factory=dict)
    stop_signal: int | None = None
    liveness: dict[str, Liveness] = field(default_factory=dict)

    def serve(self) -> int:
        from hicache.runtime.ipc import (
            CurveKeyError,
            Endpoints,
            FixedRuntimeDir,
            PullSocket,
            make_runtime_dir,
            open_context,
        )

        cfg = self.cfg
        from hicache.config import ConfigError
        from hicache.daemon.startup_checks import startup_problems

        problems = startup_problems(cfg)
        if problems:
            print(f"hicache: {ConfigError(problems)}", file=sys.stderr)
            return 2
        try:
            layout = self._layout()
        except ValueError as exc:
            print(f"hicache: {exc}", file=sys.stderr)
            return 2
        problem = _port_problem(cfg.server.host, cfg.server.port)
        if problem:  # say so now, not after the controller and the scheduler have started
            print(f"hicache: cannot listen on {cfg.server.host}:{cfg.server.port}: {problem}", file=sys.stderr)
            return 1
        fixed = FixedRuntimeDir.before_start(Path(cfg.ipc.dir)) if cfg.ipc.dir else None
        runtime = fixed.path if fixed is not None else make_runtime_dir()
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        endpoints = Endpoints(cfg.ipc.transport, str(runtime), cfg.ipc.tcp_host, cfg.ipc.tcp_base_port,
                              cfg.ipc.curve_keys_dir or None)
        _log_transport(cfg.ipc)
        _log_exposure(cfg)
        from hicache.metrics import init_process_metrics, prepare_multiprocess_dir

        prepare_multiprocess_dir(runtime / "metrics")
        init_process_metrics(cfg.metrics, "launcher")
        from hicache.memory.layout import create_segments, remove_stale_segments, unlink_segments

        stale = remove_stale_segments(layout.directory)
        if stale:
            log.warning("removed %d shared-memory segments of a daemon that did not stop cleanly", len(stale))
        segments: list[SharedSegment] | None = None
        ctx: zmq.Context[Any] | None = None
        inbox: PullSocket[protos.Message] | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        code = 1
        try:
            try:
                ctx = context = open_context(endpoints)
            except CurveKeyError as exc:  # the start checks loaded them: changed on disk since
                raise StartError(f"cannot load the CURVE keys (ipc.curve_keys_dir): {exc}") from None
            segments = create_segments(layout)
            inbox = PullSocket(ctx, endpoints.address("launcher"), self._accepts(), bind=True)
            self._define_children(layout, endpoints)
            tokenizer = self.children["tokenizer"]
            self._start([c for c in self.children.values() if c is not tokenizer], inbox, held=tokenizer,
                        release=lambda: self._release_tokenizer(context, endpoints))
            log.info("hicache is serving on http://%s:%d (pids: %s)", cfg.server.host, cfg.server.port,
                     {n: c.pid for n, c in self.children.items()})
            code = self.supervise(inbox, ctx, endpoints)
        except StartError as exc:
            print(f"hicache: {exc}", file=sys.stderr)
            code = 1
        finally:
            self._stop_all()
            if inbox is not None:
                inbox.close()
            if ctx is not None:
                ctx.term()
            if segments is not None:
                for seg in segments:
                    seg.close()
                unlink_segments(layout)
            if fixed is None:
                shutil.rmtree(runtime, ignore_errors=True)
            else:  # a configured directory: remove what this daemon put there, nothing else
                fixed.clear()
            # Stopped: a late SIGTERM / SIGINT (sent to the whole group, or a second Ctrl-C)
            # must not turn this exit into a death by signal while the interpreter shuts down.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return code

    # ------------------------------------------------------------------ setup
    def _layout(self) -> PoolLayout:
        """The pools of every component the model needs: ``full`` from ``cache.l1.tokens`` /
        ``cache.l2.tokens``, ``swa`` from ``hicache.config.swa_pool_tokens``; ``mamba`` state slots from
        ``cache.l1.state_slots`` / ``cache.l2.state_slots``. No L2 pools when L2 is off.
        A model without full-attention layers gets a zero-layer ``full`` (index-only: its
        page count bounds the cached token pages, its tensors hold no bytes and get no
        segment).
        Raises ValueError for a model the scheduler cannot serve."""
        from hicache.config import swa_pool_tokens
        from hicache.memory.layout import (
            PoolLayout,
            default_directory,
            new_instance_id,
            paged_layout,
            state_layout,
        )
        from hicache.model.geometry import geometry_for, unsupported_reason

        cfg = self.cfg
        if cfg.engine.kind != "builtin":
            return engine_layout(cfg)
        geometry = geometry_for(cfg.model)
        problem = unsupported_reason(geometry)
        if problem:
            raise ValueError(problem)
        full = geometry.full
        if full is None:  # unsupported_reason refuses such models; keeps the type checker informed
            raise ValueError("the model has no attention layer")
        ps = cfg.cache.page_size
        l1_pages = cfg.cache.l1.tokens // ps
        l2_pages = cfg.cache.l2.tokens // ps if cfg.cache.l2.enabled else 0
        inst = new_instance_id()
        comps = [paged_layout(inst, "full", ps, l1_pages, l2_pages, full.num_layers,
                              full.num_kv_heads, full.head_dim, full.dtype)]
        if geometry.swa is not None:
            swa = geometry.swa
            assert geometry.sliding_window is not None  # geometry_for sets it with swa layers
            swa_l1, swa_l2 = (n // ps for n in swa_pool_tokens(cfg, geometry.sliding_window))
            comps.append(paged_layout(inst, "swa", ps, swa_l1, swa_l2, swa.num_layers,
                                      swa.num_kv_heads, swa.head_dim, swa.dtype))
        if geometry.mamba is not None:
            mamba = geometry.mamba
            l2_slots = cfg.cache.l2.state_slots if cfg.cache.l2.enabled else 0
            comps.append(state_layout(inst, "mamba", cfg.cache.l1.state_slots, l2_slots, mamba.num_layers,
                                      (mamba.conv_shape, mamba.ssm_shape), mamba.dtype))
        return PoolLayout(inst, default_directory(), tuple(comps))

    @staticmethod
    def _accepts() -> tuple[type[protos.Message], ...]:
        import protos

        return protos.accepted_by("launcher")

    def _define_children(self, layout: PoolLayout, endpoints: Endpoints) -> None:
        from controller.args import ControllerArgs
        from hicache.api_server.args import TokenizerArgs
        from hicache.daemon.entrypoints import run_cache_server, run_controller, run_scheduler, run_tokenizer
        from hicache.scheduler.loop import SchedulerArgs
        from hicache.storage_settings import l3_quotas_gb, storage_settings_from_config

        cfg = self.cfg
        ready = endpoints.address("launcher")
        run = 0
        if cfg.cache.l2.enabled:
            storage = storage_settings_from_config(cfg.cache.l3)
            run = new_controller_run()
            self.children["controller"] = _Child("controller", run_controller, ControllerArgs(
                layout, endpoints, storage, ready, "cpu", log_level=cfg.logging.level, log_json=cfg.logging.json,
                metrics_enabled=cfg.metrics.enabled, l3_quotas_gb=l3_quotas_gb(cfg), run=run))
        # engine mode: the scheduler process is the cache server
        target: Callable[[SchedulerArgs], None] = run_scheduler if cfg.engine.kind == "builtin" else run_cache_server
        self.children["scheduler"] = _Child("scheduler", target, SchedulerArgs(cfg, layout, endpoints, ready,
                                                                               controller_run=run))
        self.children["tokenizer"] = _Child("tokenizer", run_tokenizer, TokenizerArgs(cfg, endpoints, ready,
                                                                                     hold_port=True))

    def _spawn(self, child: _Child) -> None:
        child.proc = mp.get_context("spawn").Process(target=child.target, args=(child.args,), name=child.name)
        child.proc.start()

    def _start(self, children: list[_Child], inbox: PullSocket[protos.Message], *, held: _Child | None = None,
                release: Callable[[], None] | None = None) -> None:
        """Spawn ``children`` (then ``held``) side by side and return once each has sent its
        ``Ready``: ``held`` finishes its start only when told (``release``, called once every
        one of ``children`` is ready). Raises StartError naming the first that fails, exits or
        is late (``START_TIMEOUT_S`` each wait), or when a stop signal arrives. Messages on the
        inbox other than these are dropped."""
        from hicache.api_server.args import TokenizerArgs

        for child in [*children, *([held] if held is not None else [])]:
            if isinstance(child.args, TokenizerArgs):  # /health shows the pids of the others
                pids = {n: c.pid for n, c in self.children.items() if c.proc is not None}
                child.args = dataclasses.replace(child.args, process_pids=pids)
            self._spawn(child)
        self._await_ready(children, inbox, [held] if held is not None else [])
        if held is not None:
            if release is not None:
                release()
            self._await_ready([held], inbox, [])

    def _release_tokenizer(self, ctx: zmq.Context[Any], endpoints: Endpoints) -> None:
        """Tell the tokenizer (``TokenizerArgs.hold_port``) that the scheduler is ready: it may
        open the HTTP port. Queued until the tokenizer's address is bound; delivered by the
        context's I/O thread after this socket is closed."""
        import protos
        from hicache.runtime.ipc import PushSocket

        push: PushSocket[protos.Message] = PushSocket(ctx, endpoints.address("tokenizer"))
        push.send(protos.Ready("scheduler", self.children["scheduler"].pid))
        push.close(linger_ms=int(START_TIMEOUT_S * 1000))

    def _await_ready(self, children: list[_Child], inbox: PullSocket[protos.Message], also_alive: list[_Child]) -> None:
        """Wait for each of ``children``'s ``Ready`` (``_start``'s errors), and meanwhile for
        each of ``also_alive`` to be alive."""
        import protos

        waiting = {c.name: c for c in children}
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting and time.monotonic() < deadline:
            if self.stop_signal is not None:
                raise StartError(f"interrupted while starting the {' and the '.join(waiting)}")
            msg = _recv(inbox, INBOX_POLL_MS)
            if isinstance(msg, protos.Ready) and msg.process in waiting:
                del waiting[msg.process]
            elif isinstance(msg, protos.ProcessEvent) and msg.process in waiting and msg.event == "failed":
                raise StartError(f"the {msg.process} failed to start: {msg.detail}")
            for child in [*waiting.values(), *also_alive]:
                if not child.process.is_alive():
                    raise StartError(f"the {child.name} exited during start with code {child.process.exitcode} "
                                     "(see its log above)")
        if waiting:
            raise StartError(f"the {' and the '.join(waiting)} did not report ready within {START_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ running
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

    def supervise(self, inbox: PullSocket[protos.Message], ctx: zmq.Context[Any], endpoints: Endpoints) -> int:
        import protos
        from hicache.metrics import get_metrics, mark_process_dead
        from hicache.runtime.ipc import PushSocket

        to_scheduler: PushSocket[protos.Message] = PushSocket(ctx, endpoints.address("scheduler"))
        to_tokenizer: PushSocket[protos.Message] = PushSocket(ctx, endpoints.address("tokenizer"))
        try:
            while self.stop_signal is None:
                msg = _recv(inbox, INBOX_POLL_MS)
                if self.stop_signal is not None:
                    break  # a signal arrived while waiting: children may be stopping already
                if isinstance(msg, protos.ProcessEvent) and msg.event == "restart" and "controller" in self.children:
                    proc = self.children["controller"].process
                    log.error("restarting the hung controller (pid %s): %s", proc.pid, msg.detail)
                    _kill(proc)
                self._check_heartbeats(endpoints.dir)
                stopped = self._stopped_cleanly()
                if stopped is not None:
                    log.info("the %s stopped (exit 0): the stop signal reached the process group; stopping "
                             "hicache", stopped)
                    return 0
                for name in ("scheduler", "tokenizer"):
                    proc = self.children[name].process
                    if not proc.is_alive():
                        log.error("the %s exited with code %s: stopping hicache", name, proc.exitcode)
                        print(f"hicache: the {name} exited unexpectedly with code {proc.exitcode}", file=sys.stderr)
                        return 1
                child = self.children.get("controller")
                if child is not None and not child.process.is_alive():
                    dead = child.process
                    log.error("the controller (pid %s) exited with code %s: restarting it", dead.pid, dead.exitcode)
                    mark_process_dead(child.pid)
                    to_scheduler.send(protos.ProcessEvent("controller", "died", child.pid, f"exit code {dead.exitcode}"))
                    child.restarts += 1
                    get_metrics().process_restarted("controller")
                    child.args = dataclasses.replace(child.args, run=new_controller_run())  # type: ignore[arg-type]
                    try:
                        self._start([child], inbox)
                    except StartError as exc:
                        if self.stop_signal is not None:
                            break  # asked to stop while restarting: an orderly stop
                        print(f"hicache: {exc}", file=sys.stderr)
                        return 1
                    to_scheduler.send(protos.ControllerStarted(child.pid, child.args.run))  # type: ignore[union-attr]
                    to_tokenizer.send(protos.Ready("controller", child.pid))
            log.info("signal %d: stopping", self.stop_signal)
            return 0
        finally:
            to_scheduler.close()
            to_tokenizer.close(linger_ms=500)

    def _check_heartbeats(self, runtime_dir: str | None) -> None:
        """Log each process whose heartbeat goes stale (``server.health_stale_s``) or comes
        back, and SIGKILL a controller stale for ``server.controller_freeze_restart_s`` (when
        > 0): the supervision loop then restarts it as a dead one. A scheduler is never
        killed here (see the module docstring)."""
        server = self.cfg.server
        from hicache.runtime.heartbeat import HEARTBEAT_PROCESSES, heartbeat_ages

        ages = heartbeat_ages(runtime_dir, tuple(n for n in HEARTBEAT_PROCESSES if n in self.children))
        for name, age in ages.items():
            proc = self.children[name].proc
            if proc is None or not proc.is_alive():
                continue  # a dead one is handled below in the loop
            state = Liveness.STALE if age > server.health_stale_s else Liveness.BEATING
            if state is not self.liveness.get(name, Liveness.BEATING):
                if state is Liveness.STALE:
                    log.error("the %s (pid %s) has not reported for %.1f s: it is frozen or stuck%s", name,
                              proc.pid, age, "; it is not restarted (its state cannot be rebuilt)"
                              if name == "scheduler" else "")
                else:
                    log.warning("the %s (pid %s) reports again", name, proc.pid)
            self.liveness[name] = state
            limit = server.controller_freeze_restart_s
            if name == "controller" and limit > 0 and age > limit:
                log.error("the controller (pid %s) has not reported for %.1f s (limit %g s): killing it to "
                          "restart it", proc.pid, age, limit)
                _kill(proc)
                self.liveness.pop(name, None)

    def _stopped_cleanly(self) -> str | None:
        """The name of a child that has exited with code 0, if any. A child exits 0 only after a
        SIGTERM or a ``Shutdown``; when the launcher did not send it, the signal was sent to
        the whole process group, and the launcher is being stopped too."""
        for name, child in self.children.items():
            if child.proc is not None and not child.proc.is_alive() and child.proc.exitcode == 0:
                return name
        return None

    def _stop_all(self) -> None:
        for name in ("tokenizer", "scheduler", "controller"):
            child = self.children.get(name)
            if child is None or child.proc is None or not child.proc.is_alive():
                continue
            child.proc.terminate()
            child.proc.join(STOP_TIMEOUT_S)
            if child.proc.is_alive():
                log.error("the %s did not stop within %.0f s: killing it", name, STOP_TIMEOUT_S)
                child.proc.kill()
                child.proc.join(5)


def _log_exposure(cfg: HicacheConfig) -> None:
    """Warn at start about what the config opened beyond this host on purpose (docs/operations.md
    "Security"): HTTP without a key, events without CURVE."""
    from hicache.config import events_endpoint_host, has_keys, is_loopback_host

    if not has_keys(cfg.server) and not is_loopback_host(cfg.server.host):
        log.warning("HTTP on %s:%d WITHOUT A KEY (server.allow_unauthenticated: true): anyone who can reach it acts "
                    "as the operator", cfg.server.host, cfg.server.port)
    ev = cfg.events
    if ev.enabled and ev.allow_insecure_tcp:
        hosts = [events_endpoint_host(e) for e in (ev.endpoint, ev.replay_endpoint) if e is not None]
        if any(h is not None and not is_loopback_host(h) for h in hosts):
            log.warning("KV events on %s WITHOUT CURVE (events.allow_insecure_tcp: true): anyone who can reach it "
                        "reads what the cache holds", ev.endpoint)


def _log_transport(ipc: IpcConfig) -> None:
    """Say at start how the daemon's processes reach each other (never any key material)."""
    if ipc.curve_keys_dir:
        log.info("ZeroMQ sockets use CURVE: keys in %s; the internal sockets admit the daemon's own client key, "
                 "the engine socket the keys in %s/authorized_clients", ipc.curve_keys_dir,
                 ipc.curve_keys_dir.rstrip("/"))
    elif ipc.transport == "tcp":
        log.warning("ipc.transport is tcp WITHOUT CURVE (ipc.allow_insecure_tcp: true): anyone who can reach "
                    "%s ports %d-%d can send messages to the daemon's processes; set ipc.curve_keys_dir (see "
                    "`hicache keygen`) on an untrusted network", ipc.tcp_host, ipc.tcp_base_port,
                    ipc.tcp_base_port + 4)


def engine_layout(cfg: HicacheConfig) -> PoolLayout:
    """Engine mode: L2 pages of the engines' KV geometry (``engine.*``), no L1 (it is the
    engines' own). A model with window layers gets two pools: ``full`` for the pages' full
    parts and ``swa`` for their window parts (``engine_window_pages``); a model with state
    layers (GDN) a ``mamba`` pool of ``cache.l2.state_slots`` states as bytes. Raises ValueError
    when the engine model cannot be served or L2 does not fit in the host's available memory."""
    from hicache.config import engine_window_pages
    from hicache.daemon.startup_checks import engine_geometry
    from hicache.memory.layout import (
        PoolLayout,
        default_directory,
        new_instance_id,
        paged_layout,
        state_layout,
    )
    from protos import KV_KINDS

    g, problems = engine_geometry(cfg)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    ps = cfg.cache.page_size
    l2_pages = cfg.cache.l2.tokens // ps
    inst = new_instance_id()
    # the pool's [layers, 2, tokens, heads, dim] shape only sizes it (engines view a page as bytes):
    # an MLA latent of head_dim per token is sized as a K/V pair of head_dim / 2
    vectors = KV_KINDS[g.kv_kind]
    if (g.head_dim * vectors) % 2:
        raise ValueError(f"a KV row of {g.head_dim * vectors} values per head cannot be sized as a K/V pair")
    dim = g.head_dim * vectors // 2
    full = paged_layout(inst, "full", ps, 0, l2_pages, g.num_layers - g.window_layers, g.num_kv_heads, dim,
                        g.kv_dtype)
    if full.l2_page_bytes != g.full_page_bytes:
        raise ValueError(f"the L2 pool's pages hold {full.l2_page_bytes} bytes, the engines' {g.full_page_bytes}")
    comps = [full]
    if g.window_layers:
        comps.append(paged_layout(inst, "swa", ps, 0, engine_window_pages(cfg), g.window_layers, g.num_kv_heads,
                                  dim, g.kv_dtype))
    if g.state_layers:
        comps.append(state_layout(inst, "mamba", 0, cfg.cache.l2.state_slots, g.state_layers, ((g.state_bytes,),),
                                  "uint8"))
    return PoolLayout(inst, default_directory(), tuple(comps))


def _port_problem(host: str, port: int) -> str | None:
    """Why the HTTP server could not listen on ``host:port`` now (e.g. another daemon holds
    it), or None. A bind test with ``SO_REUSEADDR``, as the server binds; the tokenizer's own
    bind still reports a port taken between this check and its start."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return str(exc)
    family, kind, proto, _name, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _kill(proc: BaseProcess) -> None:
    """SIGKILL a hung or frozen controller and reap it (the supervision loop restarts it)."""
    proc.kill()
    proc.join(KILL_JOIN_S)


def _recv(inbox: PullSocket[protos.Message], timeout_ms: int) -> protos.Message | None:
    """The next message on the launcher's inbox, or None; a bad frame is logged and dropped."""
    import protos

    try:
        return inbox.recv(timeout_ms)
    except protos.ProtocolError as exc:
        log.warning("refused a frame on the launcher socket: %s", exc)
        return None

