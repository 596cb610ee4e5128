"""The arguments of the tokenizer process (picklable: they cross a ``spawn``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hicache.config import HicacheConfig
from hicache.runtime.ipc import Endpoints

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""Request bodies larger than this are refused with 413 before they are read in full."""

DEFAULT_GRACE_S = 10.0
"""How long a shutdown waits for running requests before aborting them."""

DEFAULT_ADMIN_TIMEOUT_S = 30.0
"""How long an admin route waits for the scheduler's ``AdminReply`` before answering 504."""


@dataclass(frozen=True)
class TokenizerArgs:
    """What the launcher gives the tokenizer process.

    ``config`` is the resolved configuration (``server``, ``model``, ``tokenizer``,
    ``scheduler`` and ``metrics`` sections are used). ``endpoints`` names the scheduler's
    PULL address (this process connects a PUSH to it) and this process's own
    (``endpoints.address("tokenizer")``, bound here). Once the HTTP server listens, a
    ``protos.Ready("tokenizer", pid)`` is pushed to ``ready_address`` (skipped when None).
    ``process_pids`` maps process names (``scheduler``, ``controller``) to pids for
    ``GET /health``; the launcher may update an entry later by pushing ``Ready(name, pid)``
    to the tokenizer's address. ``grace_s`` bounds the drain on SIGTERM/SIGINT/``Shutdown``;
    ``max_body_bytes`` is the request body limit (413 above it); ``admin_timeout_s`` how long
    an admin route waits for the scheduler (504 after it). ``hold_port``: the launcher starts
    this process beside the scheduler; it loads what it needs, then waits for the launcher's
    ``Ready("scheduler", pid)`` on its own address before it pins ``cache.pinned`` and opens
    the HTTP port (nothing reaches a scheduler that is not ready).
    """

    config: HicacheConfig
    endpoints: Endpoints
    ready_address: str | None = None
    process_pids: Mapping[str, int] = field(default_factory=dict)
    grace_s: float = DEFAULT_GRACE_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S
    hold_port: bool = False
