"""Zero-copy ``SET`` of page objects through redis-py.

redis-py (with hiredis) packs every command into one new ``bytes`` object, copying each
value; a page object would otherwise be copied twice (header + payload joined, then
packed). Fresh large allocations are expensive (page faults), so for page values this
module packs the RESP frame as a list of pieces instead -- the small RESP prefix plus the
96-byte header, then the caller's payload as a ``memoryview`` -- which redis-py sends
piece by piece with ``sendall`` without copying the payload.

``PageValue`` marks such a value; ``PagePacker`` packs commands that contain one and hands
every other command to redis-py's own packer. The connection classes install the packer
through redis-py's public ``command_packer`` connection argument. Nothing here holds state
between calls; a ``PageValue`` only references the caller's buffer for the duration of the
pipeline call that sends it.
"""

from __future__ import annotations

from typing import Any

from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.utils import HIREDIS_AVAILABLE

_CRLF = b"\r\n"


class PageValue:
    """A value sent as ``header`` followed by ``payload``, without joining them."""

    __slots__ = ("header", "payload", "nbytes")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload
        self.nbytes = len(header) + payload.nbytes


def _arg_bytes(arg: Any) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int) and not isinstance(arg, bool):
        return str(arg).encode()
    if isinstance(arg, (bytearray, memoryview)):
        return bytes(arg)
    if isinstance(arg, float):
        return repr(arg).encode()
    raise TypeError(f"cannot send {type(arg).__name__} to redis")


def _default_packer() -> Any:
    if HIREDIS_AVAILABLE:
        from redis.connection import HiredisRespSerializer

        serializer: Any = HiredisRespSerializer  # untyped in some redis releases (8.2)
        return serializer()
    from redis.connection import PythonRespSerializer

    return PythonRespSerializer(6000, _arg_bytes)


class PagePacker:
    """A redis-py command packer: scatter-gather for ``PageValue``, default otherwise."""

    def __init__(self) -> None:
        self._inner = _default_packer()

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(type(a) is PageValue for a in args):
            packed: list[bytes | memoryview] = self._inner.pack(*args)
            return packed
        out: list[bytes | memoryview] = []
        head = [b"*%d\r\n" % len(args)]
        for arg in args:
            if type(arg) is PageValue:
                head.append(b"$%d\r\n" % arg.nbytes)
                head.append(arg.header)
                out.append(b"".join(head))
                out.append(arg.payload)
                head = [_CRLF]
            else:
                raw = _arg_bytes(arg)
                head.append(b"$%d\r\n" % len(raw))
                head.append(raw)
                head.append(_CRLF)
        out.append(b"".join(head))
        return out


_PACKER = PagePacker()


class PageConnection(Connection):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _PACKER)
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # redis-py's constructors are untyped


class PageSSLConnection(SSLConnection):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _PACKER)
        super().__init__(**kwargs)


class PageUnixConnection(UnixDomainSocketConnection):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _PACKER)
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # redis-py's constructors are untyped


def connection_class_for(url: str) -> type:
    """The page-aware connection class for a ``redis://``, ``rediss://`` or ``unix://`` URL."""
    if url.startswith("rediss://"):
        return PageSSLConnection
    if url.startswith("unix://"):
        return PageUnixConnection
    return PageConnection
