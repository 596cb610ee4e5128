"""What the cache server remembers of each running request, a *slot* (session, request id):
its held tokens (``RequestTokens``, the ``base`` of its next message), its ``SlotMemory``
(its prefetch, its counted hit, its window parts) and its ``SaveCursor`` (where its last
reservation found the end of its prefix in L2).

Each kind is bounded (``SLOT_MEMORY`` slots, ``REQUEST_MEMORY_TOKENS`` tokens), the least
recently used forgotten first. A request's ``Finished`` drops its tokens and its cursor, a
session's end all of its slots' (``keep_sessions``); its memory stays until pushed out.
Holds no page: a cursor's node is checked before every use (``SaveCursor``).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field

import protos
from hicache.cache_server.counters import EngineCounters
from hicache.cache_server.leases import LeaseTable
from hicache.cache_server.request_tokens import RequestTokens, Slot
from hicache.tree.node import KEY_TYPECODE, TreeNode

if KEY_TYPECODE != protos.TOKEN_TYPECODE:  # the wire's packed tokens become tree keys as they are
    raise ImportError(f"tree keys ({KEY_TYPECODE!r}) and packed tokens ({protos.TOKEN_TYPECODE!r}) differ")

SLOT_MEMORY = 16384
"""How many (session, request) pairs the server remembers between lookups (``SlotMemory``);
the oldest is forgotten first."""

REQUEST_MEMORY_TOKENS = 1 << 26
"""Tokens the server keeps of running requests at most, 256 MiB as keys (``RequestTokens``)."""


@dataclass
class SlotMemory:
    """What the server remembers of one (session, request) between its lookups."""

    prefetched: bool = False
    """Its prefetch ran: vLLM asking again starts no second one (nor holds pages twice)."""
    storage_pages: int = 0
    """Pages its prefetch brought: still the hit's L3 tail when the answer that said so never
    reached the engine (a call that gave up before it arrived)."""
    hit_counted: bool = False
    """The tree counted its hit (``record_hit``): once per request, however often asked."""
    save_wait_since: float | None = None
    """When its lookup was first answered ``pending`` for another engine's save in flight
    (``Lookups._awaits_save``): its waits end ``engine.save_wait_ms`` after that."""
    window_end: int = 0
    """With window layers: the page its last save ended at, whose window it brought ..."""
    window_kept: bool = True
    """... whether that window stays when the request saves further (a prompt's end) ..."""
    window_brought: list[int] = field(default_factory=list)
    """... and the pages of it whose window parts the request brought itself."""


@dataclass
class SaveCursor:
    """Where a running request's last reservation found the end of its prefix in L2, so that
    the next one walks only what came after it (``Reservations._held_prefix``), and its open
    reservations; also its re-save credit (``reserve_range``).

    Owned by ``RequestSlots``: one per (session, request) that reserved, at most
    ``SLOT_MEMORY`` (the least recently used forgotten first). Dropped whole by the request's
    ``Finished`` and by its session's end. Its ``node`` is dropped lazily on eviction: it is
    checked before every use, and must still be in the tree (eviction detaches a node, and
    only leaves are evicted, so its ancestors are in too) with its L2 copy, under the
    namespace root of ``salt``; else the walk starts again from the root. The tokens before
    ``depth`` are those of ``node``'s path: the node is dropped when the request's held tokens
    are replaced by ones that may differ before ``depth`` (``RequestSlots.tokens``). Full-attention
    models only (a window or a state rule needs the whole path's validators): with window or
    state layers ``node`` stays None and ``leases`` empty.
    """

    salt: str
    node: TreeNode | None = None
    depth: int = 0
    """Tokens from the root to ``node``'s end: the prefix L2 held at the last reservation."""
    leases: list[int] = field(default_factory=list)
    """Its reservations that may still be open (``Reservations._after_own_reservations``), each
    of a prefix of the request's held tokens (``RequestSlots.tokens`` forgets the others)."""
    credit: float = 0.0
    """Evicted pages before ``SaveRange.start_page`` its saves may still bring back
    (``RESAVE_SHARE`` per page of new content asked, less what re-saves took)."""


@dataclass(frozen=True)
class Refusal:
    """Why the tokens a message names cannot be had: an ``EngineError`` code and reason."""

    code: str
    reason: str



class RequestSlots:
    """The slots' tokens, memories and cursors; ``leases``: the open leases a cursor's
    reservations are looked up in."""

    def __init__(self, leases: LeaseTable, counters: EngineCounters) -> None:
        self.leases = leases
        self.counters = counters
        self.requests = RequestTokens(REQUEST_MEMORY_TOKENS)
        self._memories: OrderedDict[Slot, SlotMemory] = OrderedDict()
        self._cursors: OrderedDict[Slot, SaveCursor] = OrderedDict()

    def tokens(self, slot: Slot, base: int, token_ids: bytes) -> array[int] | Refusal:
        """The first ``base`` tokens held for ``slot`` followed by the packed ``token_ids``
        (now held for it), or why not."""
        if base < 0:
            self.counters.bad_requests += 1
            return Refusal("bad_request", f"base must be >= 0, got {base}")
        try:
            key = protos.unpack_tokens(token_ids)
        except ValueError as exc:
            self.counters.bad_requests += 1
            return Refusal("bad_request", str(exc))
        held = self.requests.get(slot)
        if base:
            if held is None or len(held) < base:
                self.counters.unknown_requests += 1
                return Refusal("unknown_request", f"request {slot[1]!r} has no {base} tokens here: send them all")
            if base == len(held):  # appended in place: the tokens before ``base`` stay what they were
                return self.requests.grow(slot, key)
            key = held[:base] + key
        cursor = self._cursors.get(slot)
        if cursor is not None:
            self._keep_prefixes(cursor, held, key, base)
        self.requests.set(slot, key)
        return key

    def _keep_prefixes(self, cursor: SaveCursor, held: array[int] | None, key: array[int], base: int) -> None:
        """The request's tokens become ``key``, whose first ``base`` are those of ``held`` (the
        tokens held before): ``cursor`` forgets its node, and those of its open reservations,
        whose prefix may not be a prefix of ``key`` any more (compared only past ``base``)."""
        def kept(n: int) -> bool:
            return n <= base or (held is not None and len(held) >= n and len(key) >= n and held[:n] == key[:n])

        if cursor.node is not None and not kept(cursor.depth):
            cursor.node, cursor.depth = None, 0
        if cursor.leases:
            cursor.leases = [lid for lid in cursor.leases if (lease := self.leases.leases.get(lid)) is not None
                             and lease.key is not None and kept(lease.key_len)]

    def memory(self, slot: Slot) -> SlotMemory:
        """The memory of ``slot``, made (and the oldest beyond ``SLOT_MEMORY`` forgotten) if new."""
        memory = self._memories.get(slot)
        if memory is None:
            memory = self._memories[slot] = SlotMemory()
            while len(self._memories) > SLOT_MEMORY:
                self._memories.popitem(last=False)
        return memory

    def known_memory(self, slot: Slot) -> SlotMemory | None:
        """The memory of ``slot`` if it has one (none is made)."""
        return self._memories.get(slot)

    def cursor(self, slot: Slot, salt: str) -> SaveCursor:
        """The ``SaveCursor`` of ``slot`` (made if new or of another salt; the most recent)."""
        cursor = self._cursors.get(slot)
        if cursor is None or cursor.salt != salt:
            cursor = self._cursors[slot] = SaveCursor(salt)
            while len(self._cursors) > SLOT_MEMORY:
                self._cursors.popitem(last=False)
        else:
            self._cursors.move_to_end(slot)
        return cursor

    def finished(self, slot: Slot) -> None:
        """The request ended: its tokens and its cursor are dropped (its memory stays)."""
        self.requests.forget(slot)
        self._cursors.pop(slot, None)

    def keep_sessions(self, live: Container[int]) -> None:
        """Drop the tokens and cursors of every slot whose session is not in ``live``."""
        self.requests.keep_sessions(live)
        for slot in [s for s in self._cursors if s[0] not in live]:
            del self._cursors[slot]
