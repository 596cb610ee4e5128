"""The message base class and the protocol constants.

Every message is a ``@message("tag")`` dataclass. The tag, not the class name, is what
travels: renaming a class never changes the wire format, and a receiver decodes only tags
it has in its explicit table (``protos.codec``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

__all__ = ["MAX_FRAME_BYTES", "PROTOCOL_VERSION", "Message", "ProtocolError"]

PROTOCOL_VERSION = 11
"""Bumped on any incompatible change of a message's fields or meaning."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Frames larger than this are refused on both encode and decode (a 128k-token prompt is ~0.6 MiB)."""


class ProtocolError(ValueError):
    """A frame that is not a valid message: garbage, unknown tag, wrong version, bad field, too big."""


class Message:
    """Base of every wire message. ``TAG`` is set by the ``message`` decorator."""

    TAG: ClassVar[str] = ""
    __slots__ = ()


M = TypeVar("M", bound=type)


def message(tag: str) -> Callable[[M], M]:
    """Class decorator: give a message class its wire tag."""

    def wrap(cls: M) -> M:
        if not tag or not tag.isascii():
            raise ValueError(f"bad message tag {tag!r}")
        cls.TAG = tag  # type: ignore[attr-defined]
        return cls

    return wrap
