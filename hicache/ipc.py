"""Typed ZeroMQ sockets and private IPC addresses.

Each socket wrapper is bound to the message types its endpoint accepts (``accepts``): a
frame that does not decode, or decodes to a message this endpoint is not meant to receive,
raises ``ProtocolError`` from ``recv`` *after* the frame was consumed, so the caller logs it
(and answers it, for ROUTER sockets) and goes on with the next frame.

Addresses: by default ``ipc://`` sockets inside a private runtime directory created with mode
0700, so no other user can connect. ``tcp://`` only when configured.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import zmq

from protos import Message, ProtocolError, decode, encode

M = TypeVar("M", bound=Message)

ENDPOINT_NAMES = ("scheduler", "tokenizer", "controller", "launcher", "engine")
"""``engine``: the cache server's ROUTER for engine connectors (engine mode only)."""


def make_runtime_dir(base: str | None = None) -> Path:
    """Create a fresh private directory (mode 0700) for sockets; ``base`` None = the user's runtime dir.

    Raises PermissionError if the directory ends up accessible to other users.
    """
    parent = base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="hicache-", dir=parent))
    os.chmod(path, 0o700)
    ensure_private(path)
    return path


def ensure_private(path: Path) -> None:
    """Raise PermissionError unless ``path`` is a directory only its owner can enter."""
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} is accessible to other users (mode {oct(st.st_mode & 0o777)})")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user")


@dataclass(frozen=True)
class Endpoints:
    """The address each process binds for the messages it receives.

    ``ipc``: ``ipc://{dir}/{name}.sock``; ``tcp``: ``tcp://{host}:{base_port + i}``.
    """

    transport: str
    dir: str | None = None
    tcp_host: str = "127.0.0.1"
    tcp_base_port: int = 0

    def address(self, name: str) -> str:
        if name not in ENDPOINT_NAMES:
            raise ValueError(f"unknown endpoint {name!r}; known: {', '.join(ENDPOINT_NAMES)}")
        if self.transport == "ipc":
            if not self.dir:
                raise ValueError("ipc endpoints need a directory")
            return f"ipc://{os.path.join(self.dir, name)}.sock"
        if self.transport == "tcp":
            return f"tcp://{self.tcp_host}:{self.tcp_base_port + ENDPOINT_NAMES.index(name)}"
        raise ValueError(f"unknown transport {self.transport!r}")


def _check_type(msg: Message, accepts: tuple[type[Message], ...]) -> None:
    if not isinstance(msg, accepts):
        names = ", ".join(c.__name__ for c in accepts)
        raise ProtocolError(f"{type(msg).__name__} is not accepted on this endpoint (accepts {names})")


class PushSocket(Generic[M]):
    """Sends messages of type ``M`` to one PULL endpoint."""

    def __init__(self, ctx: zmq.Context, address: str, *, bind: bool = False) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(address)

    def send(self, msg: M) -> None:
        self.socket.send(encode(msg), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """Close; with ``linger_ms`` > 0, first wait up to that long for queued messages to leave."""
        self.socket.close(linger=linger_ms)


def _poller_for(socket: zmq.Socket) -> zmq.Poller:
    """A poller watching ``socket`` for input (made once per wrapper: ``Socket.poll`` builds a
    new ``Poller`` on every call)."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    return poller


def _recv_typed(socket: zmq.Socket, poller: zmq.Poller, accepts: tuple[type[Message], ...],
                timeout_ms: int | None) -> Message | None:
    """The next message of an accepted type, or None if none arrived within ``timeout_ms``
    (None = block). A bad frame is consumed and raises ProtocolError."""
    if timeout_ms is not None and not poller.poll(timeout_ms):
        return None
    msg = decode(socket.recv(copy=True))
    _check_type(msg, accepts)
    return msg


class PullSocket(Generic[M]):
    """Receives messages whose types are in ``accepts``; garbage raises ProtocolError."""

    def __init__(self, ctx: zmq.Context, address: str, accepts: tuple[type[M], ...], *, bind: bool = True) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.accepts = accepts
        self._poller = _poller_for(self.socket)
        (self.socket.bind if bind else self.socket.connect)(address)

    def recv(self, timeout_ms: int | None = None) -> M | None:
        """The next message, or None if none arrived within ``timeout_ms`` (None = block)."""
        return _recv_typed(self.socket, self._poller, self.accepts, timeout_ms)  # type: ignore[return-value]

    def recv_ready(self) -> M | None:
        """The next message if one is queued now, else None; never waits.

        For a caller whose own poller just reported this socket readable: unlike ``recv(0)``
        it does not poll again. A bad frame is consumed and raises ProtocolError."""
        try:
            frame = self.socket.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        msg = decode(frame)
        _check_type(msg, self.accepts)
        return msg  # type: ignore[return-value]

    def close(self) -> None:
        self.socket.close(linger=0)


class DealerSocket(Generic[M]):
    """Request side of a DEALER/ROUTER pair: sends any message, receives ``accepts``."""

    def __init__(self, ctx: zmq.Context, address: str, accepts: tuple[type[M], ...], *, identity: bytes | None = None) -> None:
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if identity:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        self.accepts = accepts
        self._poller = _poller_for(self.socket)
        self.socket.connect(address)

    def send(self, msg: Message) -> None:
        self.socket.send(encode(msg), copy=False)

    def recv(self, timeout_ms: int | None = None) -> M | None:
        return _recv_typed(self.socket, self._poller, self.accepts, timeout_ms)  # type: ignore[return-value]

    def close(self) -> None:
        self.socket.close(linger=0)


class RouterSocket(Generic[M]):
    """Reply side of a DEALER/ROUTER pair: ``recv`` returns (peer identity, message).

    A bad frame raises ``PeerProtocolError`` carrying the peer's identity, so the caller can
    answer it with an ``ErrorReply`` and keep serving.
    """

    def __init__(self, ctx: zmq.Context, address: str, accepts: tuple[type[M], ...]) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.accepts = accepts
        self._poller = _poller_for(self.socket)
        self.socket.bind(address)

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes, M] | None:
        if timeout_ms is not None and not self._poller.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart(copy=True)
        if len(frames) != 2:
            raise PeerProtocolError(frames[0], f"expected 2 frames (identity, message), got {len(frames)}")
        peer, frame = frames
        try:
            msg = decode(frame)
            _check_type(msg, self.accepts)
        except ProtocolError as exc:
            raise PeerProtocolError(peer, str(exc)) from None
        return peer, msg  # type: ignore[return-value]

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

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.ctx = ctx
        self.address = address
        self._push: PushSocket[M] = PushSocket(ctx, address)

    def send(self, msg: M) -> None:
        self._push.send(msg)

    @property
    def socket(self) -> zmq.Socket:
        return self._push.socket

    def reset(self) -> None:
        self._push.close(linger_ms=0)
        self._push = PushSocket(self.ctx, self.address)

    def close(self) -> None:
        self._push.close(linger_ms=0)
