"""The cache server: the scheduler process's job in engine mode (README "Engine mode").

Engines keep L1 (their own KV blocks and prefix cache); this class keeps the tree of what
L2 and L3 hold for them and answers their connectors: which L2 pages hold a prefix
(``lookup``, locked under a lease), where to save newly computed pages (``reserve``), and
that a save landed (``commit``: inserted in the tree, then backed up to L3 by the tier
manager). Page bytes never pass through here: the engines copy between their KV tensors and
the shared L2 pool themselves.

The tree has no L1 pages (its Full component's L1 allocator is empty): every node is
L2-only, so the tree's L2 eviction (``evict_host``: unlocked leaves, LRU first) is the whole
policy, and ``check_integrity(exact=True)`` holds whenever no lease, reservation or transfer
is open (``check_idle``). Leases: ``hicache.cache_server.leases``.

A model with sliding-window layers keeps a page in two parts: the Full component holds the
full parts (the other layers' blocks) of every page, the SWA component the window parts,
only for the pages of the window before a request's prompt end, before its latest saved end,
and before the end of a held prefix that a request computed again and went on from (a
tombstone elsewhere). A hit is then valid only where the window before it is whole (the
tree's SWA rule, with the window of the model's ``config.json``): a lookup locks and answers
the full parts of the hit and the window parts of its last window; a reservation takes the
full parts of the range and the window parts that L2 lacks of those windows
(``_window_wanted``), and a request's commit drops the window parts it brought for its
earlier ends (``_slide_window``). docs/architecture.md §13 has the whole rule.

A model with state layers (a GDN's) keeps, besides its pages, the states the engine offered
after some of them (the tree's Mamba component, ``STATE``): a hit ends only after a page
whose state is kept, a lookup locks and answers that state, and a reservation takes a slot
for each offered state the tree lacks (``SaveRange.state_pages``).

Each daemon start has a random ``run``; every message an engine sends carries the run of its
session, and one of another run is refused (``stale_run``) before it touches anything. Each
session has a *namespace* from the engine's runtime identity (version, attention kernel,
options, reset generation): the server prefixes every cache salt of the session with it, so
engines whose KV bytes could differ never share a page in L2, nor (the salt is part of every
page hash) in L3.

Not thread-safe: only the process loop calls it. Every handler answers a bad request with an
``EngineError`` (or drops a fire-and-forget one with a warning); none raises for what an
engine sends.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import protos
from hicache.cache_server.geometry import namespace_of
from hicache.cache_server.leases import EngineProcess, Lease, LeaseKind, LeaseTable, Report, Session
from hicache.cache_server.pins import EnginePins, PinEntry
from hicache.cache_server.request_tokens import RequestTokens
from hicache.scheduler.controller_driver import ControllerDriver, PrefetchTicket
from hicache.tree.cache import MatchResult, UnifiedRadixCache
from hicache.tree.integrity import IntegrityError
from hicache.tree.node import KEY_TYPECODE, TreeNode

log = logging.getLogger("hicache.cache_server")

if KEY_TYPECODE != protos.TOKEN_TYPECODE:  # the wire's packed tokens become tree keys as they are
    raise ImportError(f"tree keys ({KEY_TYPECODE!r}) and packed tokens ({protos.TOKEN_TYPECODE!r}) differ")

SLOT_MEMORY = 16384
"""How many (session, request) pairs the server remembers between lookups (``SlotMemory``);
the oldest is forgotten first."""

MAX_TENSOR_PARALLEL = 64
"""The most tensor-parallel ranks an engine may register with."""

REQUEST_MEMORY_TOKENS = 1 << 26
"""Tokens the server keeps of running requests at most, 256 MiB as keys (``RequestTokens``)."""

RESAVE_SHARE = 0.1
"""Pages of a running request's evicted prefix that its saves may bring back, per page of new
content it asked to save (``SaveCursor.credit``): pages reserved stay within 1.1x the new
content at any L2 size."""

_IDENTITY = re.compile(r"[0-9a-f]{64}")


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive pages of sorted ``pages``."""
    out: list[tuple[int, int]] = []
    for j in pages:
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def namespaced_salt(namespace: str, cache_salt: str) -> str:
    """The salt the tree and the page hashes see for a session's ``cache_salt``."""
    return f"{namespace}:{cache_salt}"


def split_salt(tree_salt: str) -> tuple[str | None, str]:
    """``namespaced_salt``'s arguments back from its result: (namespace, ``cache_salt``)."""
    namespace, _, cache_salt = tree_salt.partition(":")
    return namespace, cache_salt


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
    window_end: int = 0
    """With window layers: the page its last save ended at, whose window it brought ..."""
    window_kept: bool = True
    """... whether that window stays when the request saves further (a prompt's end) ..."""
    window_brought: list[int] = field(default_factory=list)
    """... and the pages of it whose window parts the request brought itself."""


@dataclass
class SaveCursor:
    """Where a running request's last reservation found the end of its prefix in L2, so that
    the next one walks only what came after it (``CacheServer._held_prefix``), and its open
    reservations; also its re-save credit (``reserve_range``).

    Owned by the cache server: one per (session, request) that reserved, at most
    ``SLOT_MEMORY`` (the least recently used forgotten first). Dropped whole by the request's
    ``Finished`` and by its session's end. Its ``node`` is dropped lazily on eviction: it is
    checked before every use, and must still be in the tree (eviction detaches a node, and
    only leaves are evicted, so its ancestors are in too) with its L2 copy, under the
    namespace root of ``salt``; else the walk starts again from the root. The tokens before
    ``depth`` are those of ``node``'s path: the node is dropped when the request's held tokens
    are replaced by ones that may differ before ``depth`` (``_keep_prefixes``). Full-attention
    models only (a window or a state rule needs the whole path's validators): with window or
    state layers ``node`` stays None and ``leases`` empty.
    """

    salt: str
    node: TreeNode | None = None
    depth: int = 0
    """Tokens from the root to ``node``'s end: the prefix L2 held at the last reservation."""
    leases: list[int] = field(default_factory=list)
    """Its reservations that may still be open (``_after_own_reservations``), each of a
    prefix of the request's held tokens (``_keep_prefixes`` forgets the others)."""
    credit: float = 0.0
    """Evicted pages before ``SaveRange.start_page`` its saves may still bring back
    (``RESAVE_SHARE`` per page of new content asked, less what re-saves took)."""


WINDOW = "swa"
"""The tree component that holds the pages' window parts."""

STATE = "mamba"
"""The tree component that holds the states after pages (models with state layers)."""


@dataclass(frozen=True)
class Refusal:
    """Why the tokens a message names cannot be had: an ``EngineError`` code and reason."""

    code: str
    reason: str


@dataclass
class EngineCounters:
    """Monotonic counters for stats and metrics (pages unless the name says otherwise)."""

    lookups: int = 0
    lookup_hit_pages: int = 0
    lookup_storage_pages: int = 0
    loaded_host_pages: int = 0
    loaded_storage_pages: int = 0
    reserved_pages: int = 0
    reserve_short_pages: int = 0
    committed_pages: int = 0
    committed_window_pages: int = 0
    """Window parts of the committed pages (models with window layers)."""
    lookup_window_pages: int = 0
    """Window parts answered with lookup hits."""
    dropped_window_pages: int = 0
    """Window parts of a request's earlier save ends dropped as it went on (``_slide_window``)."""
    reserve_short_window_pages: int = 0
    committed_states: int = 0
    """States after committed pages (models with state layers)."""
    lookup_states: int = 0
    """States answered with hits."""
    reserve_short_states: int = 0
    """States a save asked for that found no room in L2 (their pages are kept without)."""
    """Window parts a save range went without (no room in L2 for them)."""
    commit_duplicate_pages: int = 0
    commit_failed_pages: int = 0
    refused: int = 0
    bad_requests: int = 0
    stale_run: int = 0
    """Messages of an earlier daemon run (refused or dropped)."""
    unknown_requests: int = 0
    """Lookups and save ranges that named tokens the server did not hold (``unknown_request``)."""
    lookup_pending: int = 0
    """Lookups answered ``pending`` (a prefetch from L3 in flight)."""
    lookup_tokens_received: int = 0
    """Token ids received in Lookups (with ``base``, only the new ones)."""
    reserves: int = 0
    """Reserve messages served (one per engine step that saves)."""
    save_ranges: int = 0
    """Save ranges in them (one per request and step)."""
    reserve_tokens_received: int = 0
    """Token ids received in Reserves (with ``base``, only the new ones)."""
    orphans_ended_late: int = 0
    """Orphaned leases ended by their late Release / Commit."""
    orphans_ended_gone: int = 0
    """Orphaned leases ended because their engine process is gone."""
    reserve_walked_pages: int = 0
    """Pages of tree nodes walked to find where save ranges start (a full-attention model's
    range resumes from its request's ``SaveCursor``: about the pages committed since its last one)."""
    reserve_resumed: int = 0
    """Save ranges whose match resumed from their request's ``SaveCursor``."""
    save_new_pages: int = 0
    """Pages from ``SaveRange.start_page`` to the range's end that L2 lacked: the new content asked."""
    resaved_pages: int = 0
    """Pages reserved before ``SaveRange.start_page`` (a running request's evicted prefix saved again)."""
    resave_refused_pages: int = 0
    """Evicted pages before ``SaveRange.start_page`` that went unsaved (more than the request's
    ``SaveCursor.credit``), with the range's whole save."""
    busy: int = 0
    """Lookups and reserves answered ``protos.BUSY`` (``busy``: their engine's queue was full)."""


class CacheServer:
    """Answers engine connectors over one ``UnifiedRadixCache`` with L2 only.

    ``tier``: the tier manager (L3 backups and prefetches), None without a controller.
    ``clock``: monotonic seconds (tests pass their own). ``run``:
    this daemon run's number (default: random). ``leases``: the lease table (default: one
    with ``lease_ttl_s`` that watches engine processes through /proc). ``pinned``: the
    pinned prefixes (``hicache.cache_server.pins``; models without window or state layers).
    """

    def __init__(self, cache: UnifiedRadixCache, tier: ControllerDriver | None, geometry: protos.EngineKVGeometry,
                 pool: protos.L2PoolInfo, lease_ttl_s: float, *,
                 clock: Callable[[], float] = time.monotonic, run: int | None = None,
                 leases: LeaseTable | None = None, pinned: Sequence[PinEntry] = (),
                 pinned_fraction: float = 0.5) -> None:
        if cache.full.host_allocator is None:
            raise ValueError("the cache server needs a tree with an L2 allocator")
        if cache.page_size != geometry.block_size:
            raise ValueError("the tree's page size must be the engines' block size")
        self.cache = cache
        self.tier = tier
        self.geometry = geometry
        self.pool = pool
        self.leases = leases if leases is not None else LeaseTable(lease_ttl_s)
        self.run = run if run is not None else secrets.randbits(62) + 1
        self.clock = clock
        self.counters = EngineCounters()
        self._prefetches: dict[tuple[int, str], PrefetchTicket] = {}
        self._slots: OrderedDict[tuple[int, str], SlotMemory] = OrderedDict()
        self._cursors: OrderedDict[tuple[int, str], SaveCursor] = OrderedDict()
        self.requests = RequestTokens(REQUEST_MEMORY_TOKENS)
        self.exact_checks = 0
        self.integrity_error: str | None = None
        swa = next((c for c in cache.aux if c.name == WINDOW), None)
        self.window: int = getattr(swa, "sliding_window", 0)
        """Tokens of the window before a hit whose window parts it needs (0: no window layers)."""
        self.window_pages_per_hit = -(-self.window // cache.page_size)
        """Pages whose window parts a hit reads (the window, page-aligned)."""
        if bool(self.window) != bool(geometry.window_layers) or (swa is not None and swa.host_allocator is None):
            raise ValueError("a model with window layers needs a tree with an L2 SWA component, and only it")
        mamba = next((c for c in cache.aux if c.name == STATE), None)
        self.state = mamba is not None
        """The model has state layers: a hit ends only where the tree holds the state after it."""
        if self.state != bool(geometry.state_layers) or (mamba is not None and mamba.host_allocator is None):
            raise ValueError("a model with state layers needs a tree with an L2 Mamba component, and only it")
        self.pins: EnginePins | None = None
        if pinned:
            if self.window or self.state:
                raise ValueError("cache.pinned in engine mode serves models without window or state layers")
            self.pins = EnginePins(cache, lambda: self.tier, pinned, pinned_fraction, namespaced_salt)
        self._handlers: dict[type, Callable[[Any], protos.Message | None]] = {
            protos.EngineRegister: self.register,
            protos.Lookup: self.lookup,
            protos.Reserve: self.reserve,
            protos.Commit: self.commit,
            protos.Release: self.release,
            protos.EngineWorker: self.worker,
            protos.Heartbeat: self.heartbeat,
            protos.Finished: self.finished,
        }

    @property
    def host(self) -> Any:
        return self.cache.full.host_allocator

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: protos.Message) -> protos.Message | None:
        """The answer to one engine message (None for fire-and-forget ones)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return protos.EngineError(getattr(msg, "req", 0), "bad_request",
                                      f"{type(msg).__name__} is not an engine request")
        return handler(msg)

    def busy(self, msg: protos.Lookup | protos.Reserve) -> protos.EngineError:
        """The answer to a lookup or reserve not served because its engine's queue was full
        (the process loop's ``EngineQueues``): ``protos.BUSY``, counted (in all and, when the
        message names an open session of this run, for that session, which it renews).
        Nothing else changes: the engine's request stays as the server held it."""
        self.counters.busy += 1
        if msg.run == self.run:
            session = self.leases.touch(msg.session, self.clock())
            if session is not None:
                session.busy += 1
        return protos.EngineError(msg.req, protos.BUSY, "the daemon is busy: this engine's queue is full")

    def _session_error(self, req: int, session: int) -> protos.EngineError:
        return protos.EngineError(req, "unknown_session",
                                  f"session {session} is not open (the daemon restarted or the session expired)")

    def _stale_error(self, req: int, run: int) -> protos.EngineError:
        return protos.EngineError(req, "stale_run", f"run {run} is not this daemon's run (it restarted)")

    def _stale(self, run: int) -> bool:
        """Whether a message carries another daemon run's number (counted)."""
        if run == self.run:
            return False
        self.counters.stale_run += 1
        return True

    def _open_session(self, msg: protos.Lookup | protos.Reserve) -> Session | protos.EngineError:
        """Renew the message's session and return it, or the error to answer."""
        if self._stale(msg.run):
            return self._stale_error(msg.req, msg.run)
        session = self.leases.touch(msg.session, self.clock())
        if session is None:
            return self._session_error(msg.req, msg.session)
        return session

    def _request_tokens(self, slot: tuple[int, str], base: int, token_ids: bytes) -> array[int] | Refusal:
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

    # ------------------------------------------------------------------ register
    def register(self, msg: protos.EngineRegister) -> protos.Message:
        theirs = msg.geometry
        if not _IDENTITY.fullmatch(msg.runtime_identity):
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", "runtime_identity must be 64 lowercase hex characters")
        sharded = theirs.kv_kind != "mla"  # every rank holds the whole latent of MLA
        if not 1 <= msg.tensor_parallel <= MAX_TENSOR_PARALLEL or (sharded and theirs.num_kv_heads % msg.tensor_parallel):
            self.counters.bad_requests += 1
            return protos.EngineError(msg.req, "bad_request", f"tensor_parallel {msg.tensor_parallel}: must be in "
                                      f"[1, {MAX_TENSOR_PARALLEL}] and divide num_kv_heads ({theirs.num_kv_heads})")
        problem = self.geometry.mismatch(theirs)
        if problem is None and msg.page_bytes != self.geometry.page_bytes:
            problem = f"page_bytes: daemon {self.geometry.page_bytes}, engine {msg.page_bytes}"
        if problem is None and self.window and not 0 < msg.window_tokens <= self.window + 1:
            problem = (f"window_tokens: the engine reads {msg.window_tokens - 1} tokens before a hit, this daemon "
                       f"keeps the window parts of {self.window} (the sliding_window of its config.json)")
        if problem is not None:
            self.counters.refused += 1
            log.warning("refused engine %s (pid %d): %s", msg.engine, msg.pid, problem)
            return protos.EngineError(msg.req, "refused", f"this daemon serves other KV pages: {problem}")
        process = EngineProcess(msg.pid, msg.pid_namespace, msg.start_time)
        namespace = namespace_of(msg.runtime_identity)
        s = self.leases.open_session(msg.engine, process, namespace, self.clock(), msg.tensor_parallel)
        if self.pins is not None:
            self.pins.on_namespace(namespace)
        log.info("engine %s (pid %d, %d rank%s) registered: session %d, namespace %s", msg.engine, msg.pid,
                 msg.tensor_parallel, "s" if msg.tensor_parallel > 1 else "", s.session_id, namespace)
        return protos.EngineRegistered(msg.req, s.session_id, self.run, self.pool, self.leases.ttl_s)

    # ------------------------------------------------------------------ lookup
    def lookup(self, msg: protos.Lookup) -> protos.Message:
        """The L2 hit of the request's tokens, locked under a lease, answered at once. When L3
        may hold pages after it, a prefetch starts and the answer is ``pending`` (nothing
        locked) until the prefetch is done: then the hit includes what arrived."""
        session = self._open_session(msg)
        if isinstance(session, protos.EngineError):
            return session
        slot = (msg.session, msg.rid)
        key = self._request_tokens(slot, msg.base, msg.token_ids)
        if isinstance(key, Refusal):
            return protos.EngineError(msg.req, key.code, key.reason)
        self.counters.lookups += 1
        self.counters.lookup_tokens_received += len(key) - msg.base
        salt = namespaced_salt(session.namespace, msg.cache_salt)
        ticket = self._prefetches.get(slot)
        if ticket is not None:
            return self._prefetch_answer(msg.req, slot, key, salt, ticket)
        match = None
        memory = self._slot(slot)
        if msg.prefetch and self.tier is not None and self.tier.l3_enabled and not memory.prefetched:
            match = self.cache.match_prefix(key, salt)
            if len(key) > match.host_hit_length:
                memory.prefetched = True
                ticket = self.tier.start_prefetch(msg.rid, key, match, salt)
                if ticket is not None and ticket.policy != "best_effort":
                    self._prefetches[slot] = ticket
                    return self._prefetch_answer(msg.req, slot, key, salt, ticket)
        return self._answer(msg.req, slot, key, salt, memory.storage_pages, match)

    def _prefetch_answer(self, req: int, slot: tuple[int, str], key: array[int], salt: str,
                         ticket: PrefetchTicket) -> protos.Message:
        """``pending`` while the slot's prefetch runs; once it is done (or its policy gave up
        on it), the hit with what it brought."""
        if not ticket.ready(self.clock()):
            self.counters.lookup_pending += 1
            return protos.LookupResult(req, pending=True)
        del self._prefetches[slot]
        self._cancel_prefetch(ticket)
        brought = ticket.arrived_tokens // self.cache.page_size
        memory = self._slot(slot)
        memory.prefetched, memory.storage_pages = True, brought
        return self._answer(req, slot, key, salt, brought)

    def _cancel_prefetch(self, ticket: PrefetchTicket) -> None:
        if self.tier is None:  # tickets come from the tier manager: there are none without one
            raise RuntimeError("a prefetch ticket on a cache server without a tier manager")
        self.tier.cancel_prefetch(ticket)

    @property
    def prefetching(self) -> int:
        """Requests whose lookup waits for a prefetch from L3."""
        return len(self._prefetches)

    def _answer(self, req: int, slot: tuple[int, str], key: array[int], salt: str, storage_pages: int,
                match: MatchResult | None = None) -> protos.Message:
        """The L2 hit of ``key`` now, locked under a lease (none for no hit); ``match``: the
        key's match made a moment ago in this call, if any (not made twice). The request's
        first lease counts its hit in the tree (``record_hit``); asking again does not."""
        session = slot[0]
        if match is None:
            match = self.cache.match_prefix(key, salt)
        if match.host_hit_length == 0:
            return protos.LookupResult(req)
        memory = self._slot(slot)
        if not memory.hit_counted:
            memory.hit_counted = True
            self.cache.record_hit(match)
        node = match.last_host_node
        pages = self.cache.host.host_prefix_pages(node)
        npages = self.cache.host.protect_host(node)
        window, window_npages = (self.cache.host.protect_host_window(node, WINDOW, self.window) if self.window
                                 else ([], 0))
        state = self.cache.host.protect_host_state(node, STATE) if self.state else -1
        storage_pages = min(storage_pages, len(pages))
        lease = self.leases.add(Lease(0, LeaseKind.LOOKUP, session, self.clock(), node=node, npages=npages,
                                      storage_pages=storage_pages, ranks=self._ranks(session),
                                      window_npages=window_npages, state_locked=self.state))
        self.counters.lookup_hit_pages += len(pages)
        self.counters.lookup_storage_pages += storage_pages
        self.counters.lookup_window_pages += len(window)
        self.counters.lookup_states += self.state
        return protos.LookupResult(req, lease.lease_id, pages, storage_pages, window_pages=window, state_slot=state)

    def _slot(self, slot: tuple[int, str]) -> SlotMemory:
        """The memory of ``slot``, made (and the oldest beyond ``SLOT_MEMORY`` forgotten) if new."""
        memory = self._slots.get(slot)
        if memory is None:
            memory = self._slots[slot] = SlotMemory()
            while len(self._slots) > SLOT_MEMORY:
                self._slots.popitem(last=False)
        return memory

    # ------------------------------------------------------------------ save
    def reserve(self, msg: protos.Reserve) -> protos.Message:
        """One reservation per save range of the step (``reserve_range``)."""
        session = self._open_session(msg)
        if isinstance(session, protos.EngineError):
            return session
        self.counters.reserves += 1
        return protos.ReserveResult(msg.req, [self.reserve_range(msg.session, session.namespace, item)
                                              for item in msg.items])

    def reserve_range(self, session: int, namespace: str, item: protos.SaveRange) -> protos.Reservation:
        """L2 pages for the pages of the range's prefix that L2 lacks: from the first one it
        lacks, which may be before ``item.start_page`` (pages saved earlier and evicted since:
        the tree can only take pages that continue what it holds, so a gap would make every
        later save of the request wasted). With window layers, also window parts
        (``_window_wanted``), and with state layers the states of ``item.state_pages`` that L2
        lacks, when the full pages could all be had.

        Bounded re-save: the pages before ``item.start_page`` that L2 lacks (its evicted
        prefix) are saved again only while they fit the request's ``SaveCursor.credit``
        (``RESAVE_SHARE`` per page of new content it asked, this range's included); past it
        the range saves nothing (its pages would follow a gap) and the answer is an empty
        reservation at the first page L2 lacks. So pages reserved stay within ``1 +
        RESAVE_SHARE`` times the new content at any L2 size, and a request whose prefix a
        thrashing L2 keeps losing stops saving instead of evicting other prefixes to hold its own.

        A full-attention model's match resumes from the request's ``SaveCursor``: a step's
        work is its new pages, not its context."""
        self.counters.save_ranges += 1
        if item.start_page < 0 or item.window_from < 0:
            self.counters.bad_requests += 1
            return protos.Reservation(code="bad_request", reason=f"start_page and window_from must be >= 0, got "
                                      f"{item.start_page} and {item.window_from}")
        key = self._request_tokens((session, item.rid), item.base, item.token_ids)
        if isinstance(key, Refusal):
            return protos.Reservation(code=key.code, reason=key.reason)
        self.counters.reserve_tokens_received += len(key) - item.base
        salt = namespaced_salt(namespace, item.cache_salt)
        ps = self.cache.page_size
        end = len(key) // ps
        cursor = self._cursor((session, item.rid), salt)
        match: MatchResult | None = None
        if self.window or self.state:
            match = self.cache.match_prefix(key, salt)
            self.counters.reserve_walked_pages += sum(len(x.key) for x in match.path or ()) // ps
            # the first page L2 lacks (with window or state layers a hit may end before it)
            start = match.walked_len // ps
        else:
            start = self._held_prefix(cursor, key, salt) // ps
            start = self._after_own_reservations(cursor, key, salt, start)
        new = max(0, end - max(start, item.start_page))
        gap = max(0, min(item.start_page, end) - start)
        credit = cursor.credit + RESAVE_SHARE * new
        if gap > credit:  # the request's evicted prefix is more than its saves may bring back
            self.counters.resave_refused_pages += gap
            return protos.Reservation(0, start)
        cursor.credit = credit - gap
        self.counters.save_new_pages += new
        want = max(0, end - start)
        host = self.host
        if host.free_count < want:
            self.cache.host.evict_host((want - host.free_count) * ps)
        n = min(want, host.free_count)
        if n < want:
            self.counters.reserve_short_pages += want - n
        top = start + n if n else min(start, end)  # the reservation's prefix ends at page ``top``
        window_at: list[int] = []
        self.counters.resaved_pages += min(n, gap)
        if match is not None and self.window and n == want:
            memory = self._slot((session, item.rid))
            own = memory.window_end if not memory.window_kept else -1  # its own earlier end: no branch point
            held = self.cache.host.host_page_flags(match.walked_node, WINDOW) if match.walked_node else []
            boundaries = [start if start != own else end, end, item.repeat_end]
            window_at = [j for j in self._window_wanted(item.window_from, match.host_hit_length // ps, boundaries,
                                                        end)
                         if j < top and not (j < len(held) and held[j])]
        window = self._alloc_aux(WINDOW, len(window_at))
        if len(window) < len(window_at):
            self.counters.reserve_short_window_pages += len(window_at)
            window_at = []
        state_at: list[int] = []
        if match is not None and self.state and n == want:
            held_states = self.cache.host.host_state_pages(match.walked_node, STATE) if match.walked_node else set()
            state_at = sorted({j for j in item.state_pages if 0 <= j < top and j not in held_states})
        states = self._alloc_aux(STATE, len(state_at))
        if len(states) < len(state_at):
            self.counters.reserve_short_states += len(state_at)
            state_at = []
        if n == 0 and not window_at and not state_at:
            return protos.Reservation(0, start)
        pages = list(host.alloc(n)) if n else []
        lease = self.leases.add(Lease(0, LeaseKind.RESERVE, session, self.clock(), key=key, key_len=top * ps,
                                      cache_salt=salt, start_page=min(start, top), pages=pages,
                                      ranks=self._ranks(session), window_pages=window, window_at=window_at,
                                      state_slots=states, state_at=state_at, rid=item.rid,
                                      repeat_end=item.repeat_end))
        self.counters.reserved_pages += n
        if match is None:
            cursor.leases.append(lease.lease_id)
            if cursor.node is not None and cursor.depth <= lease.start_page * ps:
                lease.held_node, lease.held_tokens = cursor.node, cursor.depth
        return protos.Reservation(lease.lease_id, start, pages, window_pages=window, window_at=window_at,
                                  state_slots=states, state_at=state_at)

    def _cursor(self, slot: tuple[int, str], salt: str) -> SaveCursor:
        """The ``SaveCursor`` of ``slot`` (made if new or of another salt; the most recent)."""
        cursor = self._cursors.get(slot)
        if cursor is None or cursor.salt != salt:
            cursor = self._cursors[slot] = SaveCursor(salt)
            while len(self._cursors) > SLOT_MEMORY:
                self._cursors.popitem(last=False)
        else:
            self._cursors.move_to_end(slot)
        return cursor

    def _held_prefix(self, cursor: SaveCursor, key: array[int], salt: str) -> int:
        """Tokens of ``key``'s prefix that L2 holds (for a full-attention model, what
        ``match_prefix`` answers as ``host_hit_length``), walked from ``cursor`` when its node
        is still valid (else from the root); ``cursor`` moves to the end found."""
        core = self.cache.core
        root = core.root(salt)
        if root is None:
            cursor.node, cursor.depth = None, 0
            return 0
        ps = self.cache.page_size
        n = len(key) // ps * ps
        node, depth = cursor.node, cursor.depth
        if node is not None and depth <= n and self._still_held(node, root):
            self.counters.reserve_resumed += 1
        else:
            node, depth = root, 0
        walked = 0
        for x in core.walk(node, key[depth:n], n - depth) if depth < n else ():
            walked += len(x.key)
            if x.loading or x.data[0].host_value is None:
                break
            node, depth = x, depth + len(x.key)
        self.counters.reserve_walked_pages += walked // ps
        cursor.node, cursor.depth = node, depth
        return depth

    @staticmethod
    def _still_held(node: TreeNode, root: TreeNode) -> bool:
        """Whether a node remembered from an earlier walk (a cursor's, a lease's) is still in
        the tree under ``root`` with its L2 copy: then its path spells the same tokens as then
        (splits keep a node's end, eviction detaches it, and engine mode never grows a node)."""
        return node.root is root and (node is root or (node.parent is not None and not node.loading
                                                       and node.data[0].host_value is not None))

    def _after_own_reservations(self, cursor: SaveCursor, key: array[int], salt: str, start: int) -> int:
        """``start`` moved past the pages that the request's own open reservations (its
        earlier saves, whose commits have not come yet) will insert from there on, so that a
        save of a page that filled while an earlier one was still being copied does not copy
        the request's whole prefix again. Full-attention models only (a window or a state
        part is brought at a save's own boundaries).

        Safe because a rank commits its saves in the order they were planned, so the earlier
        lease ends first; if it fails, the later one starts past what the tree holds and
        ``insert_host`` frees its pages (a shorter cache, never a wrong one)."""
        open_ = [lease for lid in cursor.leases if (lease := self.leases.leases.get(lid)) is not None]
        cursor.leases = [lease.lease_id for lease in open_]  # prefixes of ``key`` (``_keep_prefixes``)
        spans = [(lease.start_page, lease.start_page + len(lease.pages)) for lease in open_
                 if lease.cache_salt == salt and not lease.failed and lease.pages]
        for first, top in sorted(spans):  # by first page: one pass follows a run of them
            if first <= start < top:
                start = top
        return start

    def _window_wanted(self, window_from: int, valid: int, boundaries: list[int], end: int) -> list[int]:
        """The pages whose window parts a save range ending at page ``end`` should bring
        (none without window layers): those of the window before each of ``boundaries`` (its
        end; the first page L2 lacks, a prefix the tree holds and other requests go on from;
        where a repeat of its prompt hits), where no hit ends yet (``valid``: the page the
        longest valid hit of the range ends at), each only when the engine holds the whole
        window (from ``window_from`` on)."""
        if not self.window:
            return []
        wp = self.window_pages_per_hit
        wanted: set[int] = set()
        for boundary in boundaries:
            first = max(0, boundary - wp)
            if valid < boundary <= end and window_from <= first:  # a part of a window is no use
                wanted.update(range(first, boundary))
        return sorted(wanted)

    def _alloc_aux(self, name: str, want: int) -> list[int]:
        """``want`` L2 units of auxiliary component ``name`` (window parts, states), evicting
        unlocked ones if needed; none when there is no room for all of them (those pages are
        then kept without, and no hit ends where they were wanted until a later save brings
        them)."""
        if not want:
            return []
        alloc = self.cache.component(name).host_allocator
        assert alloc is not None  # the constructor checked that the component has L2
        if alloc.free_count < want:
            self.cache.host.evict_host_units(name, want - alloc.free_count)
        got = alloc.alloc(want) if alloc.free_count >= want else None
        return list(got) if got is not None else []

    @property
    def _window_alloc(self) -> Any:
        """The L2 allocator of window parts (only with window layers: the constructor checked it)."""
        return self.cache.component(WINDOW).host_allocator

    @property
    def _state_alloc(self) -> Any:
        """The L2 allocator of states (only with state layers: the constructor checked it)."""
        return self.cache.component(STATE).host_allocator

    @property
    def _window_free(self) -> int:
        """Free window parts in L2 (0 without window layers)."""
        return self._window_alloc.free_count if self.window else 0

    def _ranks(self, session: int) -> int:
        s = self.leases.sessions.get(session)
        return s.ranks if s is not None else 1

    def commit(self, msg: protos.Commit) -> None:
        """A rank wrote its shard of a reservation (``ok``) or gave up. With the last rank's
        commit: into the tree if every rank wrote (and the lease is live), else freed."""
        if self._stale(msg.run):
            return
        verdict, lease = self.leases.report(msg.lease, msg.session, LeaseKind.RESERVE, msg.rank)
        if lease is not None and not msg.ok:
            lease.failed = True
        lease = self._last(msg.session, msg.lease, LeaseKind.RESERVE, msg.rank, verdict, lease)
        if lease is None:
            return
        if lease.process is not None:  # an orphan (its session expired): never inserted
            self._end_orphan(lease)
            return
        if lease.failed:
            self.counters.commit_failed_pages += len(lease.pages)
            self._end(lease)
            return
        assert lease.key is not None
        aux: dict[str, dict[int, int]] = {}
        if lease.window_pages:
            aux[WINDOW] = dict(zip(lease.window_at, lease.window_pages, strict=True))
        if lease.state_slots:
            aux[STATE] = dict(zip(lease.state_at, lease.state_slots, strict=True))
        window_free = self._window_free
        state_free = self._state_alloc.free_count if self.state else 0
        held = lease.held_node
        root = self.cache.core.root(lease.cache_salt)
        if held is not None and (aux or root is None or not self._still_held(held, root)):
            held = None
        res = self.cache.host.insert_host(lease.key, lease.pages, lease.cache_salt, start_page=lease.start_page,
                                           aux=aux or None, length=lease.key_len, start_node=held,
                                           start_tokens=lease.held_tokens if held is not None else 0)
        self.counters.committed_window_pages += window_free - self._window_free + len(lease.window_pages)
        if self.state:
            self.counters.committed_states += state_free - self._state_alloc.free_count + len(lease.state_slots)
        self.counters.committed_pages += res.host_pages_taken
        self.counters.commit_duplicate_pages += len(lease.pages) - res.host_pages_taken
        if lease.window_pages:
            self._slide_window(lease, res.node)
        if self.tier is not None:  # new nodes, and held ones that took window parts or states (L3 lacks those)
            for node in res.aux_nodes + res.new_nodes:
                self.tier.back_up(node)
        if self.pins is not None:
            self.pins.on_commit(lease.cache_salt)

    def _slide_window(self, lease: Lease, node: TreeNode) -> None:
        """After a save of ``lease``'s request that ends at ``node``: the window parts the
        request brought for its earlier save ends, where they fall outside the new end's
        window, are dropped (SWA tombstones), unless that end was its prompt's (kept); the
        ones it brought for the new end are remembered. Only parts the request brought
        itself are dropped."""
        assert lease.key is not None
        end = lease.key_len // self.cache.page_size
        memory = self._slots.get((lease.session, lease.rid))
        if memory is None or end <= memory.window_end:
            return
        wp = self.window_pages_per_hit
        inside = end - wp  # pages before it are outside the new end's window
        brought = [j for j in lease.window_at if j >= inside]
        if not memory.window_kept:
            old = [j for j in memory.window_brought if j < inside]
            for lo, hi in _runs(old):
                self.counters.dropped_window_pages += self.cache.host.drop_host_units(node, WINDOW, lo, hi)
            brought = sorted(set(brought) | {j for j in memory.window_brought if j >= inside})
        memory.window_end, memory.window_kept, memory.window_brought = end, bool(lease.repeat_end), brought

    def release(self, msg: protos.Release) -> None:
        """A rank is done with a lookup's pages; with the last rank's release they are
        unlocked (the loaded count is the fewest any rank loaded)."""
        if self._stale(msg.run):
            return
        verdict, lease = self.leases.report(msg.lease, msg.session, LeaseKind.LOOKUP, msg.rank)
        if lease is not None and verdict is not Report.REPEATED:
            loaded = max(0, msg.loaded_pages)
            lease.loaded_pages = loaded if lease.loaded_pages is None else min(lease.loaded_pages, loaded)
        lease = self._last(msg.session, msg.lease, LeaseKind.LOOKUP, msg.rank, verdict, lease)
        if lease is None:
            return
        if lease.process is not None:  # an orphan (its session expired): never inserted
            self._end_orphan(lease)
            return
        self._end(lease)
        loaded = lease.loaded_pages or 0
        from_storage = min(loaded, lease.storage_pages)
        self.counters.loaded_host_pages += loaded - from_storage
        self.counters.loaded_storage_pages += from_storage

    def _last(self, session: int, lease_id: int, kind: LeaseKind, rank: int, verdict: Report,
              lease: Lease | None) -> Lease | None:
        """The lease when ``verdict`` made its effects due (the last rank reported), else
        None (warned about when the report was unknown or repeated)."""
        self.leases.touch(session, self.clock())
        if verdict is Report.UNKNOWN or verdict is Report.REPEATED:
            log.warning("%s of %s lease %d (session %d, rank %d): dropped", kind.value,
                        "unknown" if verdict is Report.UNKNOWN else "already reported", lease_id, session, rank)
            return None
        return lease if verdict is Report.LAST else None

    def worker(self, msg: protos.EngineWorker) -> None:
        """A worker process of a tensor-parallel engine: orphans of that engine wait for it too."""
        if self._stale(msg.run):
            return
        engine = EngineProcess(msg.engine_pid, msg.pid_namespace, msg.engine_start_time)
        self.leases.add_worker(engine, msg.rank, EngineProcess(msg.pid, msg.pid_namespace, msg.start_time))

    def heartbeat(self, msg: protos.Heartbeat) -> protos.EngineError | None:
        """Renews the session. A heartbeat of another run or of a session this run does not
        know is answered (with its ``req``): the engine's heartbeat thread registers again at once, so
        an idle engine's namespace (and its pins) is back without waiting for its next request."""
        if self._stale(msg.run):
            return self._stale_error(msg.req, msg.run)
        if self.leases.touch(msg.session, self.clock()) is None:
            log.debug("heartbeat of unknown session %d", msg.session)
            return self._session_error(msg.req, msg.session)
        return None

    def finished(self, msg: protos.Finished) -> None:
        if self._stale(msg.run):
            return
        self.leases.touch(msg.session, self.clock())
        slot = (msg.session, msg.rid)
        self.requests.forget(slot)
        self._cursors.pop(slot, None)
        ticket = self._prefetches.pop(slot, None)
        if ticket is not None:  # the request ended while its prefetch ran
            self._cancel_prefetch(ticket)

    def _end_orphan(self, orphan: Lease) -> None:
        """An expired session's lease whose every rank reported late: the engine is done
        with its pages, which are unlocked or freed now (a late commit's pages are never
        inserted)."""
        self._end(orphan)
        self.counters.orphans_ended_late += 1

    # ------------------------------------------------------------------ housekeeping
    def _end(self, lease: Lease) -> None:
        """Undo what an open lease holds (release its lock or free its reserved pages)."""
        if lease.kind is LeaseKind.LOOKUP:
            assert lease.node is not None
            self.cache.host.release_host(lease.node, lease.npages)
            if lease.window_npages:
                self.cache.host.release_host_window(lease.node, WINDOW, lease.window_npages)
            if lease.state_locked:
                self.cache.host.release_host_state(lease.node, STATE)
        else:
            self.host.free(lease.pages)
            if lease.window_pages:
                self._window_alloc.free(lease.window_pages)
            if lease.state_slots:
                self._state_alloc.free(lease.state_slots)

    def expire(self) -> int:
        """Expire silent sessions (their leases become orphans) and end the orphans whose
        engine process is gone; returns how many leases became orphans."""
        expired_before = self.leases.expired_sessions
        orphaned = self.leases.expire(self.clock())
        live = self.leases.sessions
        for slot in [s for s in self._prefetches if s[0] not in live]:
            self._cancel_prefetch(self._prefetches.pop(slot))
        if self.leases.expired_sessions != expired_before:
            self.requests.keep_sessions(live)
            for slot in [s for s in self._cursors if s[0] not in live]:
                del self._cursors[slot]
            if self.pins is not None:  # a namespace whose last session ended keeps no pin
                self.pins.keep_namespaces({s.namespace for s in live.values()})
        if orphaned:
            log.warning("%d leases of engines that stopped answering are held until those engines are seen "
                        "gone or answer", orphaned)
        for lease in self.leases.ended_orphans():
            self._end(lease)
            self.counters.orphans_ended_gone += 1
        return orphaned

    @property
    def idle(self) -> bool:
        return (not self.leases.leases and not self.leases.orphans
                and (self.tier is None or not self.tier.in_flight))

    def check_idle(self) -> None:
        """The exact integrity check (no leaked page) when nothing is open, one bounded slice
        per call (``check_integrity_slice``; ``exact_checks`` counts the rounds). A failure is a
        bug of this daemon, not of an engine: it is logged, kept for ``stats`` (and the
        tests), and serving goes on."""
        if not self.idle:
            return
        try:
            if self.cache.check_integrity_slice(exact=True):
                self.exact_checks += 1
        except IntegrityError as exc:
            if self.integrity_error is None:
                log.error("integrity check failed: %s", exc)
            self.integrity_error = str(exc)

    def flush(self) -> int:
        """Drop every unlocked node; returns the tokens freed."""
        before = self.cache.host_evictable_size() + self.cache.host_protected_size()
        self.cache.flush()
        return before - (self.cache.host_evictable_size() + self.cache.host_protected_size())

    def _window_stats(self) -> dict[str, Any]:
        """``stats()["l2"]["swa"]``: the window parts' pool (models with window layers)."""
        if not self.window:
            return {}
        ps = self.cache.page_size
        alloc = self._window_alloc
        reserved = sum(len(x.window_pages) for x in self.leases.leases.values() if x.kind is LeaseKind.RESERVE)
        return {WINDOW: {"used_tokens": alloc.used * ps, "capacity_tokens": alloc.capacity * ps,
                         "reserved_tokens": reserved * ps, "window_tokens": self.window,
                         "page_bytes": self.pool.window_page_bytes}}

    def _state_stats(self) -> dict[str, Any]:
        """``stats()["l2"]["mamba"]``: the states' pool (models with state layers)."""
        if not self.state:
            return {}
        alloc = self._state_alloc
        reserved = sum(len(x.state_slots) for x in self.leases.leases.values() if x.kind is LeaseKind.RESERVE)
        return {STATE: {"used_slots": alloc.used, "capacity_slots": alloc.capacity, "reserved_slots": reserved,
                        "slot_bytes": self.pool.state_bytes}}

    def stats(self) -> dict[str, Any]:
        ps = self.cache.page_size
        host = self.host
        reserved = sum(len(x.pages) for x in self.leases.leases.values() if x.kind is LeaseKind.RESERVE)
        out: dict[str, Any] = {
            "mode": "engine",
            "l2": {"full": {"used_tokens": host.used * ps, "capacity_tokens": host.capacity * ps,
                            "reserved_tokens": reserved * ps, "locked_tokens": self.cache.host_protected_size(),
                            "page_bytes": self.pool.page_bytes},
                   **self._window_stats(), **self._state_stats()},
            "engines": [{"session": s.session_id, "engine": s.engine, "pid": s.process.pid,
                         "namespace": s.namespace, "leases": len(s.leases), "ranks": s.ranks, "busy": s.busy,
                         "workers": len(self.leases.workers.get(s.process, {}))}
                        for s in self.leases.sessions.values()],
            "leases": {"open": len(self.leases.leases), "expired": self.leases.expired_leases,
                       "expired_sessions": self.leases.expired_sessions, "orphans": len(self.leases.orphans),
                       "orphaned_pages": sum(len(x.pages) or x.npages for x in self.leases.orphans.values())},
            "run": f"{self.run:016x}",
            "requests": {"held": len(self.requests), "tokens": self.requests.total},
            "engine": vars(self.counters).copy(),
            "integrity": {"exact_checks": self.exact_checks, "error": self.integrity_error},
        }
        if self.tier is not None:
            out["tiers"] = {**vars(self.tier.counters), "in_flight": self.tier.in_flight}
        if self.pins is not None:
            out["pinned"] = self.pins.listing()
        return out

