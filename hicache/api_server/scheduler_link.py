"""The tokenizer's ZeroMQ link to the scheduler, bridged onto the asyncio event loop.

Sockets (docs/architecture.md §2)::

    PUSH  connect  endpoints.address("scheduler")   GenerateRequest, AbortRequest, AdminRequest
    PULL  bind     endpoints.address("tokenizer")   TokenOutput, AdminReply, ErrorReply
                                                    (+ Ready, Shutdown from the launcher)

Sends happen on the event loop thread and never block: a full send queue (the scheduler is
not reading) raises ``SchedulerUnavailable``. Receives happen on one reader thread, which
decodes each frame and hands the message to the loop with ``call_soon_threadsafe``; a frame
that does not decode, or is of a type this endpoint does not accept, is logged, counted in
``bad_frames`` and dropped, and reading goes on.

Routing: every request has a ``rid``. Outputs (``TokenOutput``, or ``ErrorReply`` whose
``ref`` is the rid) go to the ``RequestChannel`` opened for that rid; outputs for a rid
with no open channel (a request that was aborted or has finished) are dropped. An
``AdminReply`` (or ``ErrorReply``) completes the admin call waiting on its rid.
``Ready`` and ``Shutdown`` are handed to the ``on_control`` callback.

What the scheduler must do (its side of the contract):

- ``GenerateRequest(rid, input_ids, sampling, stream, cache_salt)``: ``rid`` is 32 hex
  characters, unique; ``input_ids`` are validated (non-empty, each in ``[0, vocab_size)``,
  ``len(input_ids) + sampling.max_new_tokens <= max_context``, ``1 <= max_new_tokens <=
  scheduler.max_new_tokens_limit``); ``sampling`` passed ``hicache.model.sampling`` checks;
  ``sampling.stop_token_ids`` are the request's own stop ids (stop *strings* never reach the
  scheduler; a request with stop strings arrives with ``stream=True``, so that they are
  checked token by token). Answer with ``TokenOutput``s carrying **new** token ids only
  (deltas, in order).
  For ``stream=True`` send one per decode step (or per few steps): each becomes an SSE chunk.
  For ``stream=False`` they may be batched, but send the first token as soon as it exists,
  since the time to first token is measured at its arrival.
- Exactly one last ``TokenOutput`` per request with ``finished=True``, ``finish_reason`` in
  ``stop | length | abort | error`` (``error`` with ``error`` set: HTTP 500), and ``usage``
  set: ``prompt_tokens`` = ``len(input_ids)``, ``cached_device/host/storage`` = prompt tokens
  served from L1/L2/L3 (their sum is ``cached_tokens``). ``completion_tokens`` is recomputed
  here from the ids received. ``usage`` may also ride on earlier outputs; the latest wins.
- A request the scheduler refuses: a finished ``TokenOutput`` with ``finish_reason="error"``
  and ``error``, or an ``ErrorReply(error, ref=rid)``.
- ``AbortRequest(rid)`` arrives when the client disconnected, a stop string matched, or the
  server is shutting down: free the request's resources; sending more outputs for it is
  harmless (they are dropped), and an abort of an unknown or finished rid must be ignored.
- ``AdminRequest(rid, op, args)``: answer ``AdminReply(rid, ok, result, error)`` with the
  same ``rid``; ``result`` must be JSON-representable (it is the HTTP body). ``ok=False``
  with an ``error`` containing "busy" becomes 409, other errors 500. Ops: ``flush`` (empty
  L1 and L2, keep L3), ``stats`` (per tier and component: used, capacity, hit tokens),
  ``storage_status``, ``storage_attach`` (``args={"l3": <a resolved cache.l3 section>}``,
  see ``validation.parse_storage_choice``), ``storage_detach`` (only when idle, else a busy
  error), ``storage_clear``, ``pins`` / ``pin`` / ``unpin`` (``hicache.api_server.pinning``).
  A tenant's call carries ``args["tenant"]`` and acts on that tenant's namespaces and pins
  only (``hicache.api_server.access``); the operator's carries none.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import zmq

import protos
from hicache.runtime.ipc import Endpoints, PullSocket, PushSocket, open_context

log = logging.getLogger("hicache.api_server.link")

ACCEPTS: tuple[type[protos.Message], ...] = protos.accepted_by("tokenizer")
"""What the tokenizer's PULL socket accepts (``protos.table``)."""

SEND_HWM = 10_000
"""Messages queued towards the scheduler before sends fail (it drains them continuously)."""

_POLL_MS = 100


class SchedulerUnavailable(RuntimeError):
    """A message could not be queued for the scheduler, or the link is shutting down."""


def new_rid() -> str:
    """A fresh request id: 32 hex characters."""
    return uuid.uuid4().hex


class RequestChannel:
    """The stream of ``TokenOutput`` of one generation request, in arrival order.

    An ``ErrorReply`` naming the rid arrives as a finished ``TokenOutput`` with
    ``finish_reason="error"`` and the error text, so consumers handle one message type.
    """

    def __init__(self, link: SchedulerLink, rid: str) -> None:
        self.rid = rid
        self._link = link
        self._queue: asyncio.Queue[protos.TokenOutput] = asyncio.Queue()

    def put(self, msg: protos.TokenOutput) -> None:
        self._queue.put_nowait(msg)

    async def next(self) -> protos.TokenOutput:
        """The next output of this request (waits; cancellable)."""
        return await self._queue.get()

    def close(self) -> None:
        """Stop routing outputs here (idempotent). Does not abort anything."""
        self._link._close_channel(self.rid)


class SchedulerLink:
    """Both sockets plus the reader thread. Create and use on the event loop thread only."""

    def __init__(self, endpoints: Endpoints, loop: asyncio.AbstractEventLoop,
                 on_control: Callable[[protos.Message], None]) -> None:
        """Binds the PULL socket (raises ``zmq.ZMQError`` if the address is taken) and connects
        the PUSH socket; call ``start`` to begin reading."""
        self._loop = loop
        self._on_control = on_control
        self.ctx = open_context(endpoints)
        try:
            self._pull: PullSocket[protos.Message] = PullSocket(self.ctx, endpoints.address("tokenizer"), ACCEPTS)
            self._push: PushSocket[protos.Message] = PushSocket(self.ctx, endpoints.address("scheduler"))
        except zmq.ZMQError:
            self.ctx.destroy(linger=0)
            raise
        self._push.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._push.socket.setsockopt(zmq.SNDTIMEO, 0)
        self._channels: dict[str, RequestChannel] = {}
        self._admin: dict[str, asyncio.Future[protos.AdminReply]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_loop, name="scheduler-reader", daemon=True)
        self._closed = False
        self.bad_frames = 0

    def start(self) -> None:
        self._thread.start()

    # ---- sending (loop thread)

    def _send(self, msg: protos.Message) -> None:
        if self._closed:
            raise SchedulerUnavailable("the link to the scheduler is closed")
        try:
            self._push.send(msg)
        except zmq.Again:
            raise SchedulerUnavailable("the scheduler is not accepting requests (its queue is full)") from None

    def generate(self, req: protos.GenerateRequest) -> RequestChannel:
        """Open the channel for ``req.rid`` and send the request; SchedulerUnavailable if it
        could not be queued (the channel is then closed again)."""
        channel = RequestChannel(self, req.rid)
        self._channels[req.rid] = channel
        try:
            self._send(req)
        except BaseException:
            self._close_channel(req.rid)
            raise
        return channel

    def abort(self, rid: str) -> None:
        """Tell the scheduler to drop ``rid`` and close its channel. Best effort: a failure to
        send is logged, never raised (the scheduler ignores aborts of unknown rids)."""
        self._close_channel(rid)
        try:
            self._send(protos.AbortRequest(rid))
        except SchedulerUnavailable as exc:
            log.warning("could not send the abort of request %s: %s", rid, exc)

    async def admin(self, op: str, args: dict[str, Any] | None = None, timeout_s: float = 30.0) -> protos.AdminReply:
        """Send ``AdminRequest(rid, op, args)`` and wait for the ``AdminReply`` with that rid.

        Raises ``asyncio.TimeoutError`` after ``timeout_s`` and ``SchedulerUnavailable`` if it cannot
        be sent or the link closes meanwhile. An ``ErrorReply`` naming the rid comes back as
        ``AdminReply(ok=False)``.
        """
        rid = new_rid()
        fut: asyncio.Future[protos.AdminReply] = self._loop.create_future()
        self._admin[rid] = fut
        try:
            self._send(protos.AdminRequest(rid, op, dict(args or {})))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._admin.pop(rid, None)

    def abort_all(self, reason: str) -> int:
        """End every open request now: each channel receives a finished ``TokenOutput`` with
        ``finish_reason="abort"`` and the scheduler an ``AbortRequest``; waiting admin calls
        fail with SchedulerUnavailable. Returns the number of requests ended."""
        channels = list(self._channels.values())
        for ch in channels:
            ch.put(protos.TokenOutput(ch.rid, [], finished=True, finish_reason="abort", error=reason))
            self.abort(ch.rid)
        for fut in list(self._admin.values()):
            if not fut.done():
                fut.set_exception(SchedulerUnavailable(reason))
        return len(channels)

    @property
    def open_requests(self) -> int:
        return len(self._channels)

    def _close_channel(self, rid: str) -> None:
        self._channels.pop(rid, None)

    # ---- receiving

    def _read_loop(self) -> None:
        """Reader thread: frames -> messages -> the event loop."""
        pull = self._pull
        try:
            while not self._stop.is_set():
                try:
                    msg = pull.recv(timeout_ms=_POLL_MS)
                except protos.ProtocolError as exc:
                    self.bad_frames += 1
                    log.warning("dropped a bad frame on the tokenizer socket: %s", exc)
                    continue
                except zmq.ZMQError as exc:
                    if self._stop.is_set():
                        break
                    log.error("tokenizer socket error: %s", exc)
                    continue
                if msg is not None:
                    try:
                        self._loop.call_soon_threadsafe(self._dispatch, msg)
                    except RuntimeError:  # the loop closed under us: shutting down
                        break
        finally:
            pull.close()

    def _dispatch(self, msg: protos.Message) -> None:
        """Route one message (loop thread)."""
        if isinstance(msg, protos.TokenOutput):
            channel = self._channels.get(msg.rid)
            if channel is None:
                log.debug("dropped an output of request %s, which is not open", msg.rid)
                return
            channel.put(msg)
            if msg.finished:
                self._close_channel(msg.rid)
        elif isinstance(msg, protos.AdminReply):
            fut = self._admin.get(msg.rid)
            if fut is None or fut.done():
                log.warning("dropped an admin reply for %s, which nobody waits for", msg.rid)
                return
            fut.set_result(msg)
        elif isinstance(msg, protos.ErrorReply):
            self._dispatch_error(msg)
        else:
            self._on_control(msg)

    def _dispatch_error(self, msg: protos.ErrorReply) -> None:
        channel = self._channels.get(msg.ref)
        if channel is not None:
            channel.put(protos.TokenOutput(msg.ref, [], finished=True, finish_reason="error", error=msg.error))
            self._close_channel(msg.ref)
            return
        fut = self._admin.get(msg.ref)
        if fut is not None and not fut.done():
            fut.set_result(protos.AdminReply(msg.ref, False, {}, msg.error))
            return
        log.warning("the scheduler reported an error%s: %s", f" about {msg.ref}" if msg.ref else "", msg.error)

    # ---- closing

    def close(self, linger_ms: int = 1000) -> None:
        """Stop the reader and close both sockets; queued sends get ``linger_ms`` to leave."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        elif not self._thread.ident:  # never started: the socket is still ours to close
            self._pull.close()
        self._push.close(linger_ms=linger_ms)
        if self._thread.is_alive():  # the reader is stuck; do not wait for its socket
            log.warning("the scheduler reader thread did not stop; closing its socket anyway")
            self.ctx.destroy(linger=0)
        else:
            self.ctx.term()
