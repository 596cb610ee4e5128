"""Messages the cache server (the scheduler process in engine mode) receives from engines.

An engine (a vLLM instance, through ``hicache.connectors.vllm``) talks to the cache server
over one DEALER socket per connector half; the server's ROUTER answers each request that
expects an answer with the message named below, carrying the same ``req`` number, or with
an ``EngineError`` (same ``req``) saying why it was refused.

==================  ======================  =====================================================
request             answer                  what it does
==================  ======================  =====================================================
``EngineRegister``  ``EngineRegistered``    checks the engine's model and KV geometry against what
                                            the daemon serves; opens a session
``Lookup``          ``LookupResult``        L2 pages of the longest cached prefix, locked under a
                                            lease; may start an L3 prefetch (``pending``)
``Reserve``         ``ReserveResult``       L2 pages for the engine to save newly computed blocks
                                            into, held under a lease until ``Commit``
``Commit``          (none)                  the reserved pages hold the KV: insert them in the tree
                                            (``ok`` False: free them)
``Release``         (none)                  a lookup lease is no longer needed (loaded or dropped)
``Heartbeat``       (none)                  the session is alive: its leases stay valid
==================  ======================  =====================================================

Every request but ``EngineRegister`` names its ``session``; an unknown session (the daemon
restarted, or the session expired) is answered with ``EngineError(code="unknown_session")``
where an answer is expected, and the engine registers again. Leases expire when their
session sends nothing for the daemon's lease TTL: an engine that died leaks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.base import Message, message


class CacheServerMessage(Message):
    """Base of everything an engine can tell the cache server."""

    __slots__ = ()


@message("engine_register")
@dataclass(slots=True)
class EngineRegister(CacheServerMessage):
    """Open a session. The geometry fields describe one KV page (one engine block of every
    layer): ``page_bytes`` = ``num_layers`` x the bytes of one layer's block, in ``kv_layout``
    (the engine's per-block byte order, e.g. vLLM's CPU ``LBHNC``)."""

    req: int
    engine: str
    pid: int
    model_identity: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str
    page_bytes: int


@message("engine_lookup")
@dataclass(slots=True)
class Lookup(CacheServerMessage):
    """How many pages of ``token_ids`` (page-aligned) does L2 hold from the start? With
    ``prefetch`` the server may first fetch the pages that L3 holds after them."""

    req: int
    session: int
    rid: str
    token_ids: list[int]
    cache_salt: str = ""
    prefetch: bool = True


@message("engine_reserve")
@dataclass(slots=True)
class Reserve(CacheServerMessage):
    """L2 pages to save pages ``[start_page, len(token_ids) // block_size)`` of this prefix
    into. The server skips the pages it already holds."""

    req: int
    session: int
    rid: str
    token_ids: list[int]
    start_page: int
    cache_salt: str = ""


@message("engine_commit")
@dataclass(slots=True)
class Commit(CacheServerMessage):
    """The engine wrote the pages of reservation ``lease`` (``ok``) or gave up (not ``ok``)."""

    session: int
    lease: int
    ok: bool = True


@message("engine_release")
@dataclass(slots=True)
class Release(CacheServerMessage):
    """Unlock the pages of lookup lease ``lease``; the engine copied the first
    ``loaded_pages`` of them into its blocks (0: none, the lookup was not used)."""

    session: int
    lease: int
    loaded_pages: int = 0


@message("engine_heartbeat")
@dataclass(slots=True)
class Heartbeat(CacheServerMessage):
    session: int
