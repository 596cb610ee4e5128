"""The protocol in one table: every message, who sends it, who receives it, what answers it.

``ROUTES`` is the table the rest of the code reads: each process's inbox accepts exactly
``accepted_by(process)`` (the sockets' decode filters are built from it), and a test checks
that every message type has exactly one row and that each answer is itself a message of
the table sent the other way.

Processes: ``tokenizer`` (HTTP), ``scheduler`` (the builtin scheduler, or in engine mode the
cache server — one process, one inbox), ``controller`` (the cache controller), ``launcher``,
``engine`` (a vLLM connector; it reaches the scheduler process's engine socket, see
``ENGINE_SOCKET``). ``answers`` are the messages a receiver sends back for that request (any
one of them); ``()`` means none is owed (the note says what the sender observes instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.base import Message
from protos.lifecycle import ErrorReply, ProcessEvent, Ready, Shutdown
from protos.to_cache_server import (
    Commit,
    EngineRegister,
    EngineWorker,
    Finished,
    Heartbeat,
    Lookup,
    Release,
    Reserve,
)
from protos.to_controller import (
    BackupToStorage,
    Cancel,
    LoadToDevice,
    PrefetchFetch,
    PrefetchQuery,
    StorageAdmin,
    WriteToHost,
)
from protos.to_engine import EngineError, EngineRegistered, LookupResult, ReserveResult
from protos.to_scheduler import (
    AbortRequest,
    AdminRequest,
    ControllerStarted,
    GenerateRequest,
    OpDone,
    PrefetchHits,
    StorageEvicted,
    StorageStatus,
)
from protos.to_tokenizer import AdminReply, TokenOutput

__all__ = ["ENGINE_SOCKET", "ROUTES", "Route", "accepted_by", "route_of"]

PROCESSES = ("tokenizer", "scheduler", "controller", "launcher", "engine")
ENGINE_SOCKET = "engine"
"""The scheduler process's second socket (engine mode): what ``engine`` senders reach."""


@dataclass(frozen=True)
class Route:
    message: type[Message]
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    answers: tuple[type[Message], ...]
    note: str = ""


ROUTES: tuple[Route, ...] = (
    # tokenizer -> scheduler
    Route(GenerateRequest, ("tokenizer",), ("scheduler",), (TokenOutput,),
          "TokenOutputs of its rid, the last one finished=True (stop | length | abort | error)"),
    Route(AbortRequest, ("tokenizer",), ("scheduler",), (),
          "the request ends with its final TokenOutput, finish_reason abort (nothing if it had ended)"),
    Route(AdminRequest, ("tokenizer",), ("scheduler",), (AdminReply,)),
    # scheduler -> tokenizer
    Route(TokenOutput, ("scheduler",), ("tokenizer",), (), "answers GenerateRequest"),
    Route(AdminReply, ("scheduler",), ("tokenizer",), (), "answers AdminRequest"),
    # scheduler -> controller
    Route(WriteToHost, ("scheduler",), ("controller",), (OpDone,), "exactly one OpDone per op_id"),
    Route(LoadToDevice, ("scheduler",), ("controller",), (OpDone,), "exactly one OpDone per op_id"),
    Route(BackupToStorage, ("scheduler",), ("controller",), (OpDone,), "exactly one OpDone per op_id"),
    Route(PrefetchFetch, ("scheduler",), ("controller",), (OpDone,), "exactly one OpDone per op_id"),
    Route(PrefetchQuery, ("scheduler",), ("controller",), (PrefetchHits,)),
    Route(Cancel, ("scheduler",), ("controller",), (),
          "the op's own OpDone says cancelled (not started) or its outcome (already running)"),
    Route(StorageAdmin, ("scheduler",), ("controller",), (StorageStatus,)),
    # controller -> scheduler
    Route(OpDone, ("controller",), ("scheduler",), ()),
    Route(PrefetchHits, ("controller",), ("scheduler",), ()),
    Route(StorageStatus, ("controller",), ("scheduler",), (),
          "answers StorageAdmin, or unprompted (op_id -1) when the store changed on its own"),
    Route(StorageEvicted, ("controller",), ("scheduler",), (),
          "unprompted: pages the store evicted, for the KV events"),
    # engine connector -> cache server (scheduler process, engine socket), and back
    Route(EngineRegister, ("engine",), ("scheduler",), (EngineRegistered, EngineError)),
    Route(Lookup, ("engine",), ("scheduler",), (LookupResult, EngineError)),
    Route(Reserve, ("engine",), ("scheduler",), (ReserveResult, EngineError)),
    Route(Commit, ("engine",), ("scheduler",), ()),
    Route(Release, ("engine",), ("scheduler",), ()),
    Route(EngineWorker, ("engine",), ("scheduler",), ()),
    Route(Heartbeat, ("engine",), ("scheduler",), ()),
    Route(Finished, ("engine",), ("scheduler",), ()),
    Route(EngineRegistered, ("scheduler",), ("engine",), ()),
    Route(LookupResult, ("scheduler",), ("engine",), ()),
    Route(ReserveResult, ("scheduler",), ("engine",), ()),
    Route(EngineError, ("scheduler",), ("engine",), (), "a refused request, same req number"),
    # lifecycle
    Route(Ready, ("tokenizer", "scheduler", "controller", "launcher"), ("launcher", "tokenizer"), (),
          "a child -> launcher: it is serving; launcher -> tokenizer: a restarted child's new pid"),
    Route(Shutdown, ("launcher",), ("tokenizer", "scheduler", "controller"), (), "drain and exit 0"),
    Route(ControllerStarted, ("launcher",), ("scheduler",), (),
          "after the ProcessEvent died of the controller it replaces: the new one's pid and run"),
    Route(ProcessEvent, ("launcher", "scheduler", "controller"), ("launcher", "scheduler"), (),
          "launcher -> scheduler: died; scheduler -> launcher: restart; controller -> launcher: failed"),
    Route(ErrorReply, ("controller", "scheduler"), ("scheduler", "tokenizer"), (),
          "a frame that did not decode, or a request refused outright"),
)

_BY_MESSAGE = {r.message: r for r in ROUTES}


def route_of(message: type[Message]) -> Route:
    return _BY_MESSAGE[message]


def accepted_by(process: str, *, socket: str = "") -> tuple[type[Message], ...]:
    """The messages ``process``'s inbox decodes (in table order). ``socket=ENGINE_SOCKET``:
    those of the scheduler process's engine socket (sent by engines) instead of its inbox."""
    if process not in PROCESSES:
        raise ValueError(f"unknown process {process!r}")
    from_engines = socket == ENGINE_SOCKET
    return tuple(r.message for r in ROUTES
                 if process in r.receivers and ("engine" in r.senders) == from_engines)
