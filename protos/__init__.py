"""The wire protocol between hicache's processes (docs/architecture.md §8).

Messages are grouped by the process that receives them: ``to_scheduler``, ``to_tokenizer``,
``to_controller``, ``to_cache_server`` (engine connectors -> the cache server of engine
mode) and ``to_engine`` (its answers), plus ``lifecycle`` (launcher <-> all). ``encode`` / ``decode`` are the
only way in and out of bytes; every decoding problem is a ``ProtocolError``. ``table``
(``ROUTES``, ``accepted_by``) says who sends each message, who receives it and what answers it.

This package depends on the standard library and msgpack only (no torch, no zmq).
"""

from __future__ import annotations

from protos.base import MAX_FRAME_BYTES, PROTOCOL_VERSION, Message, ProtocolError
from protos.codec import MESSAGE_TYPES, decode, encode
from protos.lifecycle import ErrorReply, LifecycleMessage, ProcessEvent, Ready, Shutdown
from protos.table import ENGINE_SOCKET, ROUTES, Route, accepted_by, route_of
from protos.to_cache_server import (
    ALL_RANKS,
    TOKEN_TYPECODE,
    CacheServerMessage,
    Commit,
    EngineRegister,
    EngineWorker,
    Finished,
    Heartbeat,
    Lookup,
    Release,
    Reserve,
    SaveRange,
    pack_tokens,
    unpack_tokens,
)
from protos.to_controller import (
    BackupToStorage,
    Cancel,
    ControllerMessage,
    LoadToDevice,
    PrefetchFetch,
    PrefetchQuery,
    StorageAdmin,
    WriteToHost,
)
from protos.to_engine import (
    EngineError,
    EngineMessage,
    EngineRegistered,
    LookupResult,
    Reservation,
    ReserveResult,
)
from protos.to_scheduler import (
    AbortRequest,
    AdminRequest,
    GenerateRequest,
    OpDone,
    PrefetchHits,
    SamplingParams,
    SchedulerMessage,
    StorageEvicted,
    StorageStatus,
)
from protos.to_tokenizer import AdminReply, TokenizerMessage, TokenOutput, Usage

__all__ = [
    "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "MESSAGE_TYPES", "Message", "ProtocolError", "decode", "encode",
    "ErrorReply", "LifecycleMessage", "ProcessEvent", "Ready", "Shutdown",
    "BackupToStorage", "Cancel", "ControllerMessage", "LoadToDevice", "PrefetchFetch", "PrefetchQuery",
    "StorageAdmin", "WriteToHost",
    "AbortRequest", "AdminRequest", "GenerateRequest", "OpDone", "PrefetchHits", "SamplingParams",
    "SchedulerMessage", "StorageEvicted", "StorageStatus",
    "AdminReply", "TokenOutput", "TokenizerMessage", "Usage",
    "ALL_RANKS", "CacheServerMessage", "Commit", "EngineRegister", "EngineWorker", "Finished", "Heartbeat", "Lookup", "Release", "Reserve",
    "SaveRange", "TOKEN_TYPECODE", "pack_tokens", "unpack_tokens", "EngineError", "EngineMessage", "EngineRegistered", "LookupResult", "Reservation", "ReserveResult",
    "ENGINE_SOCKET", "ROUTES", "Route", "accepted_by", "route_of",
]
