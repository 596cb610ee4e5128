"""Messages between the launcher and every process, and the generic error reply."""

from __future__ import annotations

from dataclasses import dataclass

from protos.base import Message, message


class LifecycleMessage(Message):
    __slots__ = ()


@message("ready")
@dataclass(slots=True)
class Ready(LifecycleMessage):
    """A process finished starting and is serving."""

    process: str
    pid: int


@message("shutdown")
@dataclass(slots=True)
class Shutdown(LifecycleMessage):
    """Stop in order: finish or abort running work, then exit."""

    reason: str = ""
    grace_s: float = 10.0


@message("error")
@dataclass(slots=True)
class ErrorReply(LifecycleMessage):
    """The answer to a frame that could not be decoded; ``ref`` names the request if known."""

    error: str
    ref: str = ""
