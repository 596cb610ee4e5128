"""The tokenizer process: entry point, start-up, and orderly shutdown.

``tokenizer_main(args)`` is the ``multiprocessing`` spawn target. Start-up, in order: logging,
metrics (``init_process_metrics``), the tokenizer and the model limits, the API keys
(``server.api_key`` / ``server.api_keys``: key files and variables are read now), the
ZeroMQ link (binds ``endpoints.address("tokenizer")``), the HTTP server on
``server.host:server.port`` (its read deadlines ``server.header_timeout_s`` /
``server.body_timeout_s``), then ``Ready("tokenizer", pid)`` to ``args.ready_address``. With
``args.hold_port`` (the launcher's start) the process waits, after binding its ZeroMQ link,
for the launcher's ``Ready("scheduler", pid)`` before it pins and opens the HTTP port. Any
failure before Ready (a port or socket address in use, an unreadable tokenizer, a bad model
config, a key file that cannot be read: the reason, never a key) is logged and the process
exits with code 1 without sending Ready.

Shutdown — on SIGTERM (also sent by the kernel when the launcher dies: ``die_with_parent``),
SIGINT or a ``Shutdown`` message from the launcher:

1. stop listening; new requests on open connections get 503;
2. wait up to ``args.grace_s`` for running requests to finish;
3. end the ones still running: each gets ``finish_reason "abort"`` (streams end with their
   last chunk and ``[DONE]``) and the scheduler an ``AbortRequest``; pending admin calls 503;
4. close connections and sockets (queued aborts get a second to leave), exit 0.

Control messages the launcher may push to the tokenizer's address: ``Ready(name, pid)``
updates the pid ``/health`` shows for ``name`` (after a restart); ``Shutdown`` starts the
shutdown above.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import zmq

import protos
from hicache.api_server.args import TokenizerArgs
from hicache.metrics import init_process_metrics
from hicache.runtime.ipc import PushSocket
from hicache.runtime.logging_setup import setup_logging
from hicache.runtime.proc import die_with_parent

if TYPE_CHECKING:
    from aiohttp import web

    from hicache.api_server.http_api import HttpApi
    from hicache.api_server.scheduler_link import SchedulerLink

log = logging.getLogger("hicache.api_server")

_ABORT_WAIT_S = 2.0
"""After aborting the remaining requests: how long their handlers get to answer."""


def tokenizer_main(args: TokenizerArgs) -> None:
    """Process entry point. Returns (exit code 0) after an orderly shutdown; exits with 1 if
    start-up fails."""
    cfg = args.config
    die_with_parent()  # a launcher killed outright sends us SIGTERM: the orderly shutdown below
    setup_logging("tokenizer", cfg.logging.level, cfg.logging.json)
    init_process_metrics(cfg.metrics, "tokenizer")
    try:
        asyncio.run(_serve(args))
    except _StartupError as exc:
        log.error("the tokenizer process could not start: %s", exc)
        sys.exit(1)


class _StartupError(RuntimeError):
    pass


async def _serve(args: TokenizerArgs) -> None:
    # Imported here so that importing this module (the launcher does, for the spawn target)
    # stays cheap.
    from aiohttp import web

    from hicache.api_server.http_api import HttpApi, JsonErrorRunner
    from hicache.api_server.pinning import PinStartError, pin_configured
    from hicache.api_server.scheduler_link import SchedulerLink
    from hicache.api_server.validation import ModelLimits
    from hicache.config.security import load_api_keys
    from hicache.metrics import get_metrics
    from hicache.text import TokenizerError, load_tokenizer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cfg = args.config
    pids = {"tokenizer": os.getpid(), **args.process_pids}

    scheduler_ready = asyncio.Event()

    def on_control(msg: protos.Message) -> None:
        if isinstance(msg, protos.Ready):
            if pids.get(msg.process) != msg.pid:
                log.info("%s is now pid %d", msg.process, msg.pid)
            pids[msg.process] = msg.pid
            if msg.process == "scheduler":
                scheduler_ready.set()
        elif isinstance(msg, protos.Shutdown):
            log.info("shutdown requested by the launcher%s", f": {msg.reason}" if msg.reason else "")
            stop.set()

    try:
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
        limits = ModelLimits.from_config(cfg)
    except (TokenizerError, ValueError, OSError) as exc:
        raise _StartupError(str(exc)) from exc
    api_keys, problems = load_api_keys(cfg.server)  # key files and variables are read here, once
    if problems:
        raise _StartupError("; ".join(str(p) for p in problems))
    tenants = sorted({k.tenant for k in api_keys if k.tenant is not None})
    if tenants:
        log.info("%d API key(s) for %d tenant(s): %s", len(api_keys), len(tenants), ", ".join(tenants))
    try:
        link = SchedulerLink(args.endpoints, loop, on_control)
    except zmq.ZMQError as exc:
        raise _StartupError(f"cannot bind {args.endpoints.address('tokenizer')}: {exc}") from exc
    try:
        api = HttpApi(link=link, tokenizer=tokenizer, limits=limits, config=cfg, pids=pids, metrics=get_metrics(),
                      max_body_bytes=args.max_body_bytes, admin_timeout_s=args.admin_timeout_s, api_keys=api_keys)
    except OSError as exc:
        link.close()
        raise _StartupError(f"cannot open server.request_log {cfg.server.request_log}: "
                            f"{exc.strerror or exc}") from exc
    api.heartbeat_dir = args.endpoints.dir  # /health reads the scheduler's and controller's heartbeats
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    runner = JsonErrorRunner(api.app, header_timeout_s=cfg.server.header_timeout_s, handle_signals=False,
                             handler_cancellation=True, shutdown_timeout=_ABORT_WAIT_S,
                             access_log=log if debug else None)
    set_up = False
    try:
        link.start()
        if args.hold_port and not await _first_of(scheduler_ready, stop):
            log.info("tokenizer stopped before the scheduler was ready")
            return
        if cfg.cache.pinned and cfg.engine.kind == "builtin":  # before the port opens: the first request finds
            # them (in engine mode the cache server starts them itself, as engines register)
            pinning = asyncio.ensure_future(pin_configured(link, tokenizer, cfg))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({pinning, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not pinning.done():  # stopped while pinning
                pinning.cancel()
                log.info("tokenizer stopped while pinning cache.pinned")
                return
            try:
                pinning.result()
            except PinStartError as exc:
                raise _StartupError(str(exc)) from exc
        await runner.setup()
        set_up = True
        site = web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise _StartupError(f"cannot listen on {cfg.server.host}:{cfg.server.port}: {exc}") from exc
        where = ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses)
        log.info("serving %s on %s", limits.name, where)
        if args.ready_address:
            ready: PushSocket[protos.Message] = PushSocket(link.ctx, args.ready_address)
            ready.send(protos.Ready("tokenizer", os.getpid()))
            ready.close(linger_ms=5000)
        await stop.wait()
        await _drain(api, runner, link, args.grace_s)
    finally:
        if set_up:
            await runner.cleanup()
        link.close()
        if api.request_log is not None:
            api.request_log.close()
    log.info("tokenizer stopped")


async def _first_of(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait until ``wanted`` or ``stop`` is set; True when ``wanted`` is."""
    waits = {asyncio.ensure_future(wanted.wait()), asyncio.ensure_future(stop.wait())}
    _done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    return wanted.is_set()


async def _drain(api: HttpApi, runner: web.AppRunner, link: SchedulerLink, grace_s: float) -> None:
    """Steps 1-3 of the shutdown (see the module docstring)."""
    log.info("shutting down: draining %d request(s), up to %g s", link.open_requests, grace_s)
    api.begin_drain()
    for site in list(runner.sites):
        await site.stop()
    if not await api.wait_idle(grace_s):
        n = link.abort_all("the server is shutting down")
        log.warning("aborted %d request(s) still running after %g s", n, grace_s)
        await api.wait_idle(_ABORT_WAIT_S)
