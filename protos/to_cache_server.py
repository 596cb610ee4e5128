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
                                            lease; may start an L3 prefetch and answer
                                            ``pending`` at once (never waits for L3)
``Reserve``         ``ReserveResult``       for each request of one engine step: L2 pages to save
                                            its new blocks into, held under a lease until
                                            ``Commit``
``Commit``          (none)                  the reserved pages hold the KV: insert them in the tree
                                            (``ok`` False: free them)
``Release``         (none)                  a lookup lease is no longer needed (loaded or dropped)
``EngineWorker``    (none)                  a worker process of a tensor-parallel engine: the
                                            daemon waits for it too before it frees what an
                                            expired session of that engine held
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
(``hicache.cache_server.leases``): their pages stay locked or reserved, since the engine
may still be reading or writing them, until its late ``Commit`` / ``Release`` arrives or
the daemon sees the engine's process gone (``pid``, ``pid_namespace``, ``start_time``),
and every worker process it announced (``EngineWorker``).

Tensor parallelism: an engine of ``tensor_parallel`` ranks registers once (its scheduler
half); each rank copies its own shard of every page (its heads of every layer) and sends its
own ``Commit`` / ``Release`` with its ``rank``. A lease ends when every rank has reported:
a reservation's pages enter the tree only if every rank wrote its shard (``ok``), and a
lookup's pages stay locked until every rank has loaded.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from protos.base import Message, message

__all__ = [
    "ALL_RANKS", "TOKEN_TYPECODE", "KV_DTYPE_BYTES", "KV_KINDS", "CacheServerMessage", "Commit",
    "EngineKVGeometry", "EngineRegister", "EngineWorker", "Finished", "Heartbeat", "Lookup", "Release", "Reserve", "SaveRange", "pack_tokens", "unpack_tokens",
]

TOKEN_TYPECODE = "I"
"""Token ids travel packed (``pack_tokens``): 4-byte unsigned integers, little-endian, the
array typecode the server unpacks them into (a 32k-token prompt is 128 KiB, packed and
unpacked as one memory copy instead of 32k msgpack integers)."""

if array(TOKEN_TYPECODE).itemsize != 4:  # pragma: no cover - every platform CPython supports today
    raise ImportError(f"array typecode {TOKEN_TYPECODE!r} is not 4 bytes on this platform")


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as the wire's packed bytes; OverflowError for an id outside [0, 2**32)."""
    packed = array(TOKEN_TYPECODE, token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> array[int]:
    """The token ids of packed bytes; ValueError when their length is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
    out = array(TOKEN_TYPECODE)
    out.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        out.byteswap()
    return out


ALL_RANKS = -1
"""The ``rank`` of a ``Commit`` / ``Release`` sent for every rank at once: by the engine's
scheduler half, for a lease no rank was given (a lookup not loaded, a reservation not saved)."""


KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

KV_KINDS = {"kv": 2, "mla": 1}
"""What a token's row of a head holds, and how many ``head_dim`` vectors: a key and a value,
or the compressed latent of multi-head latent attention (DeepSeek V2 / V3: ``kv_lora_rank``
plus the rotary part, one per token for all heads)."""


@dataclass(frozen=True)
class EngineKVGeometry:
    """One KV page: ``block_size`` tokens of every one of ``num_layers`` attention layers.

    ``state_layers`` more layers keep a recurrent state instead of KV (Qwen3-Next's gated
    delta net, ``linear_attention``; 0: none): vLLM keeps that state at some block ends, and
    the daemon keeps one, of ``state_bytes`` per layer, in model order, after the pages where
    the engine offered it (the tree's Mamba component: a hit ends only at a page whose state
    it holds). ``num_layers`` counts the attention layers only.

    ``window_layers`` of the layers have a sliding window (0: none). Such a page is kept in
    two parts (docs/architecture.md §13): the *full part*, the blocks of the other layers,
    in model order, kept for every page of a cached prefix; and the *window part*, the
    blocks of the window layers, in model order, kept only for the pages a hit at some
    boundary reads (the tree's SWA component: the last window before a boundary).

    ``kv_layout`` names the byte order of one layer's block (vLLM's CPU backend: ``LBHNC``,
    a block is ``[num_kv_heads, block_size, 2 * head_dim]``: K then V per token row).
    ``kv_kind`` says what a token row holds (``KV_KINDS``): ``kv``, a key and a value per
    head; ``mla``, one latent vector of ``head_dim`` (multi-head latent attention, one
    "head": ``[1, block_size, head_dim]``).
    """

    model_identity: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str
    kv_kind: str = "kv"
    window_layers: int = 0
    state_layers: int = 0
    state_bytes: int = 0

    @property
    def state_part_bytes(self) -> int:
        """Bytes of one kept state: every state layer's (0 without state layers)."""
        return self.state_layers * self.state_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer's block (K and V, or the latent)."""
        vectors = KV_KINDS.get(self.kv_kind, 0)
        return self.num_kv_heads * self.block_size * vectors * self.head_dim * KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of a whole page: both parts."""
        return self.num_layers * self.layer_block_bytes

    @property
    def full_page_bytes(self) -> int:
        """Bytes of a page's full part (0 for a model whose every layer has the window)."""
        return (self.num_layers - self.window_layers) * self.layer_block_bytes

    @property
    def window_page_bytes(self) -> int:
        """Bytes of a page's window part (0 without window layers)."""
        return self.window_layers * self.layer_block_bytes

    def mismatch(self, other: EngineKVGeometry) -> str | None:
        """None if ``other`` describes the same pages, else which fields differ (daemon vs engine)."""
        diffs = [f"{f.name}: daemon {getattr(self, f.name)!r}, engine {getattr(other, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        return "; ".join(diffs) if diffs else None



class CacheServerMessage(Message):
    """Base of everything an engine can tell the cache server."""

    __slots__ = ()


@message("engine_register")
@dataclass(slots=True)
class EngineRegister(CacheServerMessage):
    """Open a session. ``geometry`` describes one KV page (one engine block of every
    attention layer, ``EngineKVGeometry``); ``page_bytes`` is the engine's own count of its
    bytes, which the daemon checks against the geometry's.

    ``runtime_identity`` (64 hex characters) names everything else that changes the bytes
    of a page: the engine's version, attention backend and kernel ISA, block size, the
    options that change values, and the engine's cache-reset generation
    (``hicache.connectors.runtime_identity``). The session's pages live in a namespace of
    it, in L2 and L3: engines whose identities differ never share a page.

    ``pid_namespace`` (``/proc/self/ns/pid``'s link, empty when unknown) and ``start_time``
    (the process start in clock ticks since boot, 0 when unknown) let the daemon tell that
    process ``pid`` is gone, which frees what an expired session held.

    ``tensor_parallel``: the engine's ranks; each sends its ``Commit`` and ``Release`` of
    every lease (the page geometry is the whole model's: every rank holds
    ``num_kv_heads / tensor_parallel`` of its heads, or the whole latent with ``kv_kind``
    ``mla``).

    ``window_tokens``: the engine's window (vLLM's ``SlidingWindowSpec.sliding_window``) when
    the geometry has window layers; refused when it reads more tokens before a hit than the
    daemon keeps (the window parts are then kept where a hit reads them:
    ``EngineRegistered.window_segment``)."""

    req: int
    engine: str
    pid: int
    geometry: EngineKVGeometry
    page_bytes: int
    runtime_identity: str
    pid_namespace: str = ""
    start_time: int = 0
    tensor_parallel: int = 1
    window_tokens: int = 0


@message("engine_worker")
@dataclass(slots=True)
class EngineWorker(CacheServerMessage):
    """Worker process ``pid`` (rank ``rank``) serves the engine whose scheduler half runs
    as ``engine_pid`` (its parent). Sent by each worker of a tensor-parallel engine before
    its first copy in a daemon run: what an expired session of that engine held is freed
    only once the engine and these workers are all gone (a live worker may still copy)."""

    run: int
    engine_pid: int
    engine_start_time: int
    pid_namespace: str
    rank: int
    pid: int
    start_time: int


@message("engine_lookup")
@dataclass(slots=True)
class Lookup(CacheServerMessage):
    """How many pages of the request's tokens (page-aligned) does L2 hold from the start?
    The tokens are the first ``base`` the server holds for ``rid`` (from an earlier
    ``Lookup`` or ``Reserve`` of it in this session) followed by ``token_ids``, so asking
    again about a waiting request sends no token twice (``base`` 0: ``token_ids`` is all of
    them; without ``base`` tokens held: ``EngineError(code="unknown_request")``). Token ids
    are packed (``pack_tokens``).

    The answer never waits for L3: with ``prefetch``, when L3 may hold pages after the L2
    hit, the server starts fetching them into L2 and answers ``pending`` (ask again later)
    until they arrived or the prefetch policy gave up on them. It also answers ``pending``
    while another engine's reservation still saves the pages right after the hit, beyond the
    ``local_pages`` the engine holds itself (its own prefix cache), for at most
    ``engine.save_wait_ms`` per request."""

    req: int
    session: int
    run: int
    rid: str
    token_ids: bytes
    cache_salt: str = ""
    prefetch: bool = True
    base: int = 0
    local_pages: int = 0


@dataclass(slots=True)
class SaveRange:
    """One request's part of a ``Reserve``: L2 pages to save pages ``[start_page, P //
    block_size)`` of its prefix into, where the prefix (``P`` tokens) is the first ``base``
    tokens the server holds for ``rid`` followed by ``token_ids`` (packed, as in ``Lookup``). So a
    request sends each token once: a block filled during decode costs the same bytes at any
    context length.

    The server skips the pages it already holds, and starts earlier than ``start_page``
    where L2 lost pages before it (evicted since the engine saved them): the engine still
    holds every full layer's block of a running request, so it saves them again, as far as
    the request's re-save credit goes (a tenth of a page per page of new content it asked);
    past it the range gets no pages (docs/architecture.md, engine mode, "Reserve").

    ``window_from``: with window layers, the first page whose window layers' blocks the
    engine still holds (vLLM frees those before its window); the server asks for no window
    part before it. ``repeat_end``: set on the range that ends at the prompt's last full page,
    the page where the same prompt asked again would hit (``(prompt tokens - 1) //
    block_size``: the engine computes the last prompt token, so a prompt of whole blocks hits
    one block short); the server brings and keeps the windows before it and before the
    range's end when the request goes on (it drops the windows of a request's other save
    ends: a chunk or a decoded page is rarely where a hit ends); 0 on other ranges.
    ``state_pages``: with state layers, the pages ``j`` after which the engine holds the
    recurrent state in this step (vLLM offers the state at some block ends only); the server
    asks for those it lacks (``Reservation.state_at``)."""

    rid: str
    token_ids: bytes
    start_page: int
    cache_salt: str = ""
    base: int = 0
    window_from: int = 0
    repeat_end: int = 0
    state_pages: list[int] = field(default_factory=list)


@message("engine_reserve")
@dataclass(slots=True)
class Reserve(CacheServerMessage):
    """Reservations for every request of one engine step that has new full blocks to save:
    one round trip per step, however many requests it runs. ``ReserveResult.items[i]``
    answers ``items[i]``."""

    req: int
    session: int
    run: int
    items: list[SaveRange]


@message("engine_commit")
@dataclass(slots=True)
class Commit(CacheServerMessage):
    """Rank ``rank`` of the engine wrote its shard of the pages of reservation ``lease``
    (``ok``) or gave up (not ``ok``); ``ALL_RANKS``: every rank, the lease was never planned."""

    session: int
    run: int
    lease: int
    ok: bool = True
    rank: int = 0


@message("engine_release")
@dataclass(slots=True)
class Release(CacheServerMessage):
    """Unlock the pages of lookup lease ``lease``; the engine copied the first
    ``loaded_pages`` of them into its blocks (0: none, the lookup was not used); ``rank``:
    which rank of the engine did (``ALL_RANKS``: the lookup was not used by any)."""

    session: int
    run: int
    lease: int
    loaded_pages: int = 0
    rank: int = 0


@message("engine_heartbeat")
@dataclass(slots=True)
class Heartbeat(CacheServerMessage):
    """The session is alive. Unanswered, except when the daemon cannot place it (another
    run, an unknown session): then an ``EngineError`` with this ``req``, so the engine can tell
    which registration the refusal is about (the connector numbers its heartbeats)."""

    session: int
    run: int
    req: int = 0


@message("engine_finished")
@dataclass(slots=True)
class Finished(CacheServerMessage):
    """Request ``rid`` of the session ended: the server drops the tokens it held for it."""

    session: int
    run: int
    rid: str
