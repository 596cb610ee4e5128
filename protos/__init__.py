"""The wire protocol between hicache's processes (docs/architecture.md §8).

Messages are grouped by the process that receives them: ``to_scheduler``, ``to_tokenizer``,
``to_controller``, ``to_cache_server`` (engine connectors -> the cache server of engine
mode) and ``to_engine`` (its answers), plus ``lifecycle`` (launcher <-> all). ``encode`` / ``decode`` are the
only way in and out of bytes; every decoding problem is a ``ProtocolError``. ``table``
(``ROUTES``, ``accepted_by``) says who sends each message, who receives it and what answers it.

This package depends on the standard library and msgpack only (no torch, no zmq).
"""

from __future__ import annotations

# Each module names what it exports in its ``__all__``; this package re-exports them all.
from protos import (
    base,
    codec,
    lifecycle,
    table,
    to_cache_server,
    to_controller,
    to_engine,
    to_scheduler,
    to_tokenizer,
)
from protos.base import *  # noqa: F403
from protos.codec import *  # noqa: F403
from protos.lifecycle import *  # noqa: F403
from protos.table import *  # noqa: F403
from protos.to_cache_server import *  # noqa: F403
from protos.to_controller import *  # noqa: F403
from protos.to_engine import *  # noqa: F403
from protos.to_scheduler import *  # noqa: F403
from protos.to_tokenizer import *  # noqa: F403

__all__ = [*base.__all__, *codec.__all__, *lifecycle.__all__, *table.__all__, *to_cache_server.__all__,
           *to_controller.__all__, *to_engine.__all__, *to_scheduler.__all__, *to_tokenizer.__all__]
