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
                                            into, held under a lease until ``Commit``; names the
                                            tokens the server holds for the request (``base``)
                                            and sends only the ones after them
``Commit``          (none)                  the reserved pages hold the KV: insert them in the tree
                                            (``ok`` False: free them)
``Release``         (none)                  a lookup lease is no longer needed (loaded or dropped)
``Heartbeat``       (none)                  the session is alive
``Finished``        (none)                  the request ended: the server forgets its tokens
==================  ======================  =====================================================

Every request but ``EngineRegister`` names its ``session`` and the daemon ``run`` that opened
it (``EngineRegistered.run``, random per daemon start): a message of another run (the daemon
restarted since) is refused with ``EngineError(code="stale_run")`` where an answer is
expected, dropped and counted otherwise, so a session, lease or page number of an earlier
run never reaches this run's state. An unknown session of this run (it expired) is answered
with ``EngineError(code="unknown_session")``; on either code the engine registers again.

A session silent for the daemon's lease TTL expires; its leases become *orphans*
(``hicache.engine_server.leases``): their pages stay locked or reserved, since the engine
may still be reading or writing them, until its late ``Commit`` / ``Release`` arrives or
the daemon sees the engine's process gone (``pid``, ``pid_namespace``, ``start_time``).
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
    (the engine's per-block byte order, e.g. vLLM's CPU ``LBHNC``).

    ``runtime_identity`` (64 hex characters) names everything else that changes the bytes
    of a page: the engine's version, attention backend and kernel ISA, block size, the
    options that change values, and the engine's cache-reset generation
    (``hicache.connectors.runtime_identity``). The session's pages live in a namespace of
    it, in L2 and L3: engines whose identities differ never share a page.

    ``pid_namespace`` (``/proc/self/ns/pid``'s link, empty when unknown) and ``start_time``
    (the process start in clock ticks since boot, 0 when unknown) let the daemon tell that
    process ``pid`` is gone, which frees what an expired session held."""

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
    runtime_identity: str
    pid_namespace: str = ""
    start_time: int = 0


@message("engine_lookup")
@dataclass(slots=True)
class Lookup(CacheServerMessage):
    """How many pages of ``token_ids`` (page-aligned) does L2 hold from the start? With
    ``prefetch`` the server may first fetch the pages that L3 holds after them."""

    req: int
    session: int
    run: int
    rid: str
    token_ids: list[int]
    cache_salt: str = ""
    prefetch: bool = True


@message("engine_reserve")
@dataclass(slots=True)
class Reserve(CacheServerMessage):
    """L2 pages to save pages ``[start_page, P // block_size)`` of the request's prefix
    into, where the prefix (``P`` tokens) is the first ``base`` tokens the server holds for
    ``rid`` (from its last ``Lookup`` or ``Reserve`` in this session) followed by
    ``token_ids``. So a request sends each token once: a block filled during decode costs
    the same bytes at any context length. ``base`` 0: ``token_ids`` is the whole prefix.
    Without ``base`` tokens held for the request (the server forgot it, or another session
    asks) the answer is ``EngineError(code="unknown_request")``: send again with ``base`` 0.

    The server skips the pages it already holds, and starts earlier than ``start_page``
    where L2 lost pages before it (evicted since the engine saved them): the engine still
    holds every block of a running request, so it saves them again."""

    req: int
    session: int
    run: int
    rid: str
    token_ids: list[int]
    start_page: int
    cache_salt: str = ""
    base: int = 0


@message("engine_commit")
@dataclass(slots=True)
class Commit(CacheServerMessage):
    """The engine wrote the pages of reservation ``lease`` (``ok``) or gave up (not ``ok``)."""

    session: int
    run: int
    lease: int
    ok: bool = True


@message("engine_release")
@dataclass(slots=True)
class Release(CacheServerMessage):
    """Unlock the pages of lookup lease ``lease``; the engine copied the first
    ``loaded_pages`` of them into its blocks (0: none, the lookup was not used)."""

    session: int
    run: int
    lease: int
    loaded_pages: int = 0


@message("engine_heartbeat")
@dataclass(slots=True)
class Heartbeat(CacheServerMessage):
    session: int
    run: int


@message("engine_finished")
@dataclass(slots=True)
class Finished(CacheServerMessage):
    """Request ``rid`` of the session ended: the server drops the tokens it held for it."""

    session: int
    run: int
    rid: str
