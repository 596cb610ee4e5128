"""Typed ZeroMQ sockets (docs/architecture.md §2).

Each socket wrapper is bound to the message types its endpoint accepts (``accepts``): a
frame that does not decode, or decodes to a message this endpoint is not meant to receive,
raises ``ProtocolError`` from ``recv`` *after* the frame was consumed, so the caller logs it
(and answers it, for ROUTER sockets) and goes on with the next frame.

A wrapper made on a ``curve.SecureContext`` binds as a CURVE server (in the ZAP domain of its
address) and connects as a CURVE client; on a plain context its socket is plain.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import zmq

from hicache.runtime.ipc.curve import CurveKeys, SecureContext, curve_client, curve_server
from protos import Message, ProtocolError, decode, encode

M = TypeVar("M", bound=Message)


def _curve_of(ctx: zmq.SyncContext) -> CurveKeys | None:
    return ctx.curve_keys if isinstance(ctx, SecureContext) else None


def _bind_or_connect(ctx: zmq.SyncContext, socket: zmq.SyncSocket, address: str, bind: bool) -> None:
    """Bind (a CURVE server) or connect (a CURVE client) ``socket``; plain when ``ctx`` has no keys."""
    keys = _curve_of(ctx)
    if keys is not None:
        if bind:
            assert isinstance(ctx, SecureContext)
            curve_server(socket, keys, ctx.domain_of(address))
        else:
            curve_client(socket, keys.client())
    (socket.bind if bind else socket.connect)(address)


def _check_type(msg: Message, accepts: tuple[type[M], ...]) -> M:
    """``msg`` as one of the ``accepts`` types; ProtocolError if it is none of them."""
    if not isinstance(msg, accepts):
        names = ", ".join(c.__name__ for c in accepts)
        raise ProtocolError(f"{type(msg).__name__} is not accepted on this endpoint (accepts {names})")
    return msg


class PushSocket(Generic[M]):
    """Sends messages of type ``M`` to one PULL endpoint."""

    def __init__(self, ctx: zmq.SyncContext, address: str, *, bind: bool = False) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(ctx, self.socket, address, bind)

    def send(self, msg: M) -> None:
        self.socket.send(encode(msg), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """Close; with ``linger_ms`` > 0, first wait up to that long for queued messages to leave."""
        self.socket.close(linger=linger_ms)


def _poller_for(socket: zmq.SyncSocket) -> zmq.Poller:
    """A poller watching ``socket`` for input (made once per wrapper: ``Socket.poll`` builds a
    new ``Poller`` on every call)."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    return poller


def _recv_typed(socket: zmq.SyncSocket, poller: zmq.Poller, accepts: tuple[type[M], ...],
                timeout_ms: int | None) -> M | None:
    """The next message of an accepted type, or None if none arrived within ``timeout_ms``
    (None = block). A bad frame is consumed and raises ProtocolError."""
    if timeout_ms is not None and not poller.poll(timeout_ms):
        return None
    return _check_type(decode(socket.recv(copy=True)), accepts)


class PullSocket(Generic[M]):
    """Receives messages whose types are in ``accepts``; garbage raises ProtocolError."""

    def __init__(self, ctx: zmq.SyncContext, address: str, accepts: tuple[type[M], ...], *, bind: bool = True) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.accepts = accepts
        self._poller = _poller_for(self.socket)
        _bind_or_connect(ctx, self.socket, address, bind)

    def recv(self, timeout_ms: int | None = None) -> M | None:
        """The next message, or None if none arrived within ``timeout_ms`` (None = block)."""
        return _recv_typed(self.socket, self._poller, self.accepts, timeout_ms)

    def recv_ready(self) -> M | None:
        """The next message if one is queued now, else None; never waits.

        For a caller whose own poller just reported this socket readable: unlike ``recv(0)``
        it does not poll again. A bad frame is consumed and raises ProtocolError."""
        try:
            frame = self.socket.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return _check_type(decode(frame), self.accepts)

    def close(self) -> None:
        self.socket.close(linger=0)


class DealerSocket(Generic[M]):
    """Request side of a DEALER/ROUTER pair: sends any message, receives ``accepts``."""

    def __init__(self, ctx: zmq.SyncContext, address: str, accepts: tuple[type[M], ...], *, identity: bytes | None = None) -> None:
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if identity:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        self.accepts = accepts
        self._poller = _poller_for(self.socket)
        _bind_or_connect(ctx, self.socket, address, False)

    def send(self, msg: Message) -> None:
        self.socket.send(encode(msg), copy=False)

    def recv(self, timeout_ms: int | None = None) -> M | None:
        return _recv_typed(self.socket, self._poller, self.accepts, timeout_ms)

    def close(self) -> None:
        self.socket.close(linger=0)


class RouterSocket(Generic[M]):
    """Reply side of a DEALER/ROUTER pair: ``recv`` returns (peer identity, message).

    A bad frame raises ``PeerProtocolError`` carrying the peer's identity, so the caller can
    answer it with an ``ErrorReply`` and keep serving.
    """

    def __init__(self, ctx: zmq.SyncContext, address: str, accepts: tuple[type[M], ...]) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.accepts = accepts
        self._poller = _poller_for(self.socket)
        _bind_or_connect(ctx, self.socket, address, True)

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes, M] | None:
        if timeout_ms is not None and not self._poller.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart(copy=True)
        if len(frames) != 2:
            raise PeerProtocolError(frames[0], f"expected 2 frames (identity, message), got {len(frames)}")
        peer, frame = frames
        try:
            msg = _check_type(decode(frame), self.accepts)
        except ProtocolError as exc:
            raise PeerProtocolError(peer, str(exc)) from None
        return peer, msg

    def send(self, peer: bytes, msg: Message) -> None:
        self.socket.send_multipart([peer, encode(msg)], copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class PeerProtocolError(ProtocolError):
    """A bad frame from a known ROUTER peer."""

    def __init__(self, peer: bytes, reason: str) -> None:
        super().__init__(reason)
        self.peer = peer


class ResettablePush(Generic[M]):
    """A PUSH connection that can be torn down and rebuilt, dropping what it had queued.

    Used towards a peer that can die and be restarted (the cache controller): after the
    peer is lost, ``reset`` guarantees that no message sent before it is ever delivered
    to the new peer.
    """

    def __init__(self, ctx: zmq.SyncContext, address: str) -> None:
        self.ctx = ctx
        self.address = address
        self._push: PushSocket[M] = PushSocket(ctx, address)

    def send(self, msg: M) -> None:
        self._push.send(msg)

    @property
    def socket(self) -> zmq.SyncSocket:
        return self._push.socket

    def reset(self) -> None:
        self._push.close(linger_ms=0)
        self._push = PushSocket(self.ctx, self.address)

    def close(self) -> None:
        self._push.close(linger_ms=0)
