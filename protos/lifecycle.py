"""Messages between the launcher and every process, and the generic error reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protos.base import Message, message

__all__ = ["ErrorReply", "LifecycleMessage", "ProcessEvent", "Ready", "Shutdown"]

ProcessEventKind = Literal["died", "restart", "failed"]
"""The ``event`` of a ``ProcessEvent``; the codec refuses any other value."""


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


@message("process_event")
@dataclass(slots=True)
class ProcessEvent(LifecycleMessage):
    """Supervision news between the launcher and the scheduler.

    launcher -> scheduler: ``died`` (the cache controller is gone: fail its in-flight ops and
    drop undelivered messages now; its restart needs no message: new ops simply reach it).
    scheduler -> launcher: ``restart`` (the controller stopped answering: kill and restart it).
    a child -> launcher (its ready address): ``failed`` (it could not start; ``detail`` says why).
    """

    process: str
    event: ProcessEventKind
    pid: int = 0
    detail: str = ""
