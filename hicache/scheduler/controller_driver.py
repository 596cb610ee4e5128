"""The scheduler's half of HiCache (docs/architecture.md §5): tier policies that drive the cache controller.

The tree decides which pages move (``UnifiedRadixCache``'s tier calls); this class turns
those decisions into controller messages, matches the controller's answers back to them,
and applies them to the tree. It is transport-agnostic: it sends through a callable and is
fed every controller answer through ``on_message``. Only the scheduler's loop calls it.

Lifecycle of each kind of op (``op_id`` is the controller op id this class assigns; it is
the only id an op has, in this process and in the controller):

==============  ===============================  ============================  ===========================
op              started by                       on ``OpDone(ok)``             on failure / controller loss
==============  ===============================  ============================  ===========================
write (d2h)     ``issue_writes`` (write policy)  ``finish_write(ok)``; then an ``finish_write(fail)``: L2
                                                 L3 backup of every written    pages freed, node as before
                                                 node (a split gives several)
load (h2d)      ``start_load_back`` (admission)  ``finish_load_back(ok)``;     ``finish_load_back(fail)``:
                                                 the ticket becomes ``done``,  nodes L2-only again, the
                                                 ``on_message`` returns it     request recomputes
backup (h2s)    after a write                    ``finish_backup``             ``finish_backup``; its nodes
                                                                               are backed up again later
                                                                               (``retry_backups``)
prefetch query  ``start_prefetch``               (``PrefetchHits``) reserve    ticket done with 0 pages
                                                 L2 pages, send the fetch
prefetch fetch  after the query                  ``insert_host`` of the pages  reserved L2 pages freed
                                                 that arrived; the rest freed
==============  ===============================  ============================  ===========================

Who owns what while an op is in flight:

=====================  ==============================  ==========================  ==============================
thing                  owner                           made                        ended
=====================  ==============================  ==========================  ==============================
op id                  this class (one counter)        before the message is sent  never reused
registry entry         this class: ``_inflight``, the  with the id, before the     when its answer arrives, or on
(``InFlightOp``)       one table of ops in flight      message is sent             controller loss (all at once)
``TierOp``             the tree holds what it names    ``cache.start_*``           ``cache.finish_*``, called once,
                       (reserved pages, locks, marks);                             from the entry's end only
                       the entry holds the object
``LoadTicket``         the waiting request; the entry  ``start_load_back``         its ``ok`` is set when the
                       refers to it                                                entry ends
prefetch L2 pages      this class (``_prefetch_        ``PrefetchHits`` (reserve)  the fetch's end: given to the
                       reserved``), via the ticket                                 tree (``insert_host``) or freed
=====================  ==============================  ==========================  ==============================

Auxiliary components (SWA, Mamba) go through L3 with the Full pages: a backup carries the
node's auxiliary L2 units and their keys (``TierOp.aux_keys``); a prefetch query asks
which auxiliary objects exist for the queried pages, the fetch reads those into L2 units
reserved here (``PrefetchTicket.aux_units``) and ``insert_host`` gives the tree the ones
that arrived verified; the rest are freed at the fetch's end.

``on_controller_lost`` ends every entry at once, each exactly once (locks released, fresh
pages freed, nodes as before the op); answers that arrive later for those ids are ignored.
Every op carries the controller ``run`` it is meant for (``run``; None while no controller
is known to serve, and then no op is started): a controller refuses an op of another run,
so an op queued for a dead controller can never copy into pages freed since, even when
the scheduler learns of the death after the next controller is up. The caller also drops
the messages not yet delivered (``ControllerLink.reset``).

A backup that failed (the store refused or timed out, or its controller died) is tried again:
its span (the node and the ``npages`` pages above it, split or not since) waits in a queue
for ``BACKUP_RETRY_DELAYS_S[attempt]`` and is backed up again by ``retry_backups`` (the
loop's housekeeping) once a controller serves with L3 on; the nodes that left L2 meanwhile
are skipped. After the last delay, or with ``BACKUP_RETRY_QUEUE`` spans already waiting,
the pages stay in L2 only (``backups_abandoned``).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import protos
from hicache.config import PrefetchConfig
from hicache.hashing import component_keys
from hicache.tree.cache import MatchResult, TierOp, UnifiedRadixCache
from hicache.tree.node import TreeNode

log = logging.getLogger(__name__)

COPY_PATIENCE_S = 2.0
"""Seconds an op may go unanswered before this class takes its controller for slow or
frozen: no new L2 write starts then (a write locks its node's path in L1 until answered,
so writes to a frozen controller would lock L1 away from requests that need no tier)."""

BACKUP_RETRY_DELAYS_S = (1.0, 5.0, 30.0)
"""Seconds after a backup's first, second and third failure before its nodes are backed up
again; a fourth failure abandons them (they stay in L2 only, until evicted)."""
BACKUP_RETRY_QUEUE = 4096
"""Failed backups waiting for a retry at most; one more is abandoned at once."""


@dataclass
class TierCounters:
    """Monotonic counters for the metrics layer (pages unless the name says bytes/tokens)."""

    writes: int = 0
    writes_failed: int = 0
    loads: int = 0
    loads_failed: int = 0
    loaded_tokens: int = 0
    backups: int = 0
    backup_tokens: int = 0
    backups_failed: int = 0
    backup_retries: int = 0
    """Backups sent again for the nodes of a failed one (``retry_backups``)."""
    backups_abandoned: int = 0
    """Failed backups given up on: their pages reach L3 only if written again."""
    prefetch_queries: int = 0
    prefetch_hit_tokens: int = 0
    prefetch_tokens: int = 0
    prefetch_failed: int = 0
    prefetch_revoked_pages: int = 0
    prefetch_aux_units: int = 0
    """Auxiliary L2 units (SWA pages, Mamba states) that a prefetch brought and the tree took."""
    controller_losses: int = 0
    rejected: int = 0


@dataclass
class LoadTicket:
    """A load-back request ``rid`` waits for. ``ok`` is None while in flight.

    ``op_id``: the controller op id of its ``LoadToDevice``; ``node``: the node ending the
    loaded prefix (what to lock for ``rid`` once ``ok``); ``tokens``: how many it loads.
    """

    op_id: int
    rid: str
    node: TreeNode
    tokens: int
    ok: bool | None = None

    @property
    def done(self) -> bool:
        return self.ok is not None


@dataclass
class PrefetchTicket:
    """A prefetch for a waiting request.

    ``start_tokens``: where the L3 run starts (the end of the L1+L2 match); ``hashes``: the
    page hashes of the request's next pages; ``arrived_tokens``: the tokens after ``start_tokens``
    its L2 insert made matchable (new nodes, or auxiliary data for Full pages the tree held:
    ``InsertResult.kept_end``); ``complete``: no more will arrive. ``deadline``: monotonic time after which a
    ``timeout`` policy stops waiting (None: no limit).
    """

    rid: str
    key: list[int]
    cache_salt: str
    start_tokens: int
    hashes: list[str]
    policy: str
    deadline: float | None
    query_op: int
    """The op id of its ``PrefetchQuery``."""
    fetch_op: int | None = None
    """The op id of its ``PrefetchFetch``, once sent."""
    host_pages: list[int] = field(default_factory=list)
    aux_keys: dict[str, list[str]] = field(default_factory=dict)
    """Per auxiliary component, the L3 key of its object for each page of ``hashes``."""
    aux_units: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per auxiliary component, the objects being fetched: (page index into ``hashes``, the
    L2 unit reserved for it), in the order the fetch names them."""
    hit_tokens: int = 0
    arrived_tokens: int = 0
    complete: bool = False

    def ready(self, now: float) -> bool:
        """May the request be scheduled now, per the prefetch policy?"""
        if self.complete or self.policy == "best_effort":
            return True
        if self.policy == "timeout":
            return self.deadline is not None and now >= self.deadline
        return False  # wait_complete


class OpKind(enum.Enum):
    """What a controller op the tier layer sent does (the lifecycle table above)."""

    WRITE = "write"
    LOAD = "load"
    BACKUP = "backup"
    QUERY = "query"
    FETCH = "fetch"


@dataclass
class InFlightOp:
    """One entry of the registry: a controller op sent and not yet ended.

    ``transfer``: the tree's op (write, load, backup); ``load``: the ticket of a load;
    ``prefetch``: the ticket of a query or fetch; ``started``: when it was sent;
    ``attempt``: a backup's retries before this one (0: its first try).
    """

    op_id: int
    kind: OpKind
    started: float
    transfer: TierOp | None = None
    load: LoadTicket | None = None
    prefetch: PrefetchTicket | None = None
    attempt: int = 0


@dataclass(order=True)
class BackupRetry:
    """The nodes of a failed backup, waiting to be backed up again: ``node`` and the
    ``npages`` pages from its end upward (the backup's span; a split since adds nodes above
    ``node``, which keeps the lower part). ``due``: when; ``attempt``: the retry it will be."""

    due: float
    seq: int
    node: TreeNode = field(compare=False)
    npages: int = field(compare=False)
    attempt: int = field(compare=False)


class ControllerDriver:
    """Tier policies over one ``UnifiedRadixCache`` and one cache controller.

    ``send``: delivers a message to the controller (never blocks for long).
    ``l3_enabled``: whether backups and prefetches are issued at all.
    ``l3_partition``: the L3 partition of a namespace's ``cache_salt`` (its tenant's name
    where the tenant has one, "" for the shared store; None: no partitions).
    ``run``: the run of the controller serving now, stamped on every op; None while none
    is known (after it died, before its successor started): no op is started then.
    Holds the registry of every op in flight (the module's ownership table).
    """

    def __init__(
        self,
        cache: UnifiedRadixCache,
        send: Callable[[protos.ControllerMessage], None],
        *,
        load_back_threshold: int = 0,
        prefetch: PrefetchConfig | None = None,
        l3_enabled: bool = False,
        l3_partition: Callable[[str], str] | None = None,
        run: int | None = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not cache.hicache:
            raise ValueError("ControllerDriver needs a cache with L2 (host allocators)")
        self.cache = cache
        self.send = send
        self.load_back_threshold = load_back_threshold
        self.prefetch_cfg = prefetch or PrefetchConfig()
        self.l3_enabled = l3_enabled
        self.l3_partition = l3_partition
        self.run = run
        self.clock = clock
        self.counters = TierCounters()
        self._inflight: dict[int, InFlightOp] = {}
        self._ids = itertools.count(1)
        self._prefetch_reserved = 0
        self._aux_reserved: dict[str, int] = {}
        self._backup_retries: list[BackupRetry] = []  # a heap, soonest first
        self.write_gate: Callable[[TreeNode], bool] | None = None
        """Whether L1 can spare what a write of a node locks while it copies (the scheduler's
        budget, ``L1Budget.fits`` of ``write_cost``); None: always."""

    # ------------------------------------------------------------------ queries
    @property
    def connected(self) -> bool:
        """Whether a controller is known to serve (ops may be started)."""
        return self.run is not None

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def in_flight_kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._inflight.values():
            out[e.kind.value] = out.get(e.kind.value, 0) + 1
        return out

    def oldest_op_age(self) -> float:
        """Seconds since the oldest in-flight op was sent (0 with none): a hung controller shows here."""
        if not self._inflight:
            return 0.0
        return self.clock() - min(e.started for e in self._inflight.values())

    @property
    def backups_waiting(self) -> int:
        """Failed backups waiting for their retry."""
        return len(self._backup_retries)

    def _register(self, op_id: int, kind: OpKind, *, transfer: TierOp | None = None,
                  load: LoadTicket | None = None, prefetch: PrefetchTicket | None = None,
                  attempt: int = 0) -> None:
        self._inflight[op_id] = InFlightOp(op_id, kind, self.clock(), transfer, load, prefetch, attempt)

    # ------------------------------------------------------------------ L1 -> L2
    def issue_writes(self, limit: int | None = None) -> int:
        """Start the L2 writes the write policy asks for now; returns how many were sent."""
        return self.write_nodes(self.cache.tiers.nodes_to_write_to_host(limit))

    def write_nodes(self, nodes: list[TreeNode]) -> int:
        """Start the L2 writes of ``nodes`` (parents first; a node the tree will not write
        now, e.g. one in flight, is skipped); returns how many were sent. A writable node
        whose write does not start (no controller, one unanswered past ``COPY_PATIENCE_S``,
        ``write_gate`` refuses, or L2 has no room) is released from ``write_back``'s keeping
        (``TierCalls.release_write_back``)."""
        sent = 0
        tiers = self.cache.tiers
        frozen = self.run is None or self.oldest_op_age() > COPY_PATIENCE_S
        for node in nodes:
            if not tiers.writable(node):
                continue
            op = None
            if not frozen and (self.write_gate is None or self.write_gate(node)):
                op = tiers.start_write(node)
            if op is None:
                # no controller to answer, no L1 room to lock it, or no L2 room (or quota)
                # for it: under write_back its data must not wait for a write that may
                # never start (``release_write_back``)
                tiers.release_write_back(node)
                continue
            assert self.run is not None  # started only when not frozen
            op_id = next(self._ids)
            self._register(op_id, OpKind.WRITE, transfer=op)
            dev = {name: list(src) for name, (src, _dst) in op.transfers.items()}
            host = {name: list(dst) for name, (_src, dst) in op.transfers.items()}
            self.send(protos.WriteToHost(op_id, dev, host, self.run))
            sent += 1
        return sent

    # ------------------------------------------------------------------ L2 -> L1
    def start_load_back(self, match: MatchResult, rid: str = "") -> LoadTicket | None:
        """Load the L2-only tail of ``match`` into L1 for request ``rid``, or None to
        recompute it instead (shorter than ``load_back_threshold``, or no room in L1)."""
        if self.run is None or match.host_hit_length <= 0 or match.host_hit_length < self.load_back_threshold:
            return None
        op = self.cache.tiers.start_load_back(match)
        if op is None:
            return None
        ticket = LoadTicket(next(self._ids), rid, op.node, match.host_hit_length)
        self._register(ticket.op_id, OpKind.LOAD, transfer=op, load=ticket)
        host = {name: list(src) for name, (src, _dst) in op.transfers.items()}
        dev = {name: list(dst) for name, (_src, dst) in op.transfers.items()}
        self.send(protos.LoadToDevice(ticket.op_id, host, dev, self.run))
        return ticket

    # ------------------------------------------------------------------ L2 -> L3
    def back_up(self, node: TreeNode, attempt: int = 0) -> None:
        """Write ``node``'s L2 pages to L3 (no-op with L3 off or no L2 copy); ``attempt``:
        how many retries came before (``retry_backups``)."""
        if not self.l3_enabled or self.run is None:
            return
        op = self.cache.tiers.start_backup(node)
        if op is None:
            return
        op_id = next(self._ids)
        self._register(op_id, OpKind.BACKUP, transfer=op, attempt=attempt)
        aux_pages = {name: list(op.transfers[name][0]) for name in op.aux_keys}
        self.send(protos.BackupToStorage(op_id, list(op.transfers["full"][0]), list(op.hashes), "full",
                                         aux_pages, {name: list(k) for name, k in op.aux_keys.items()},
                                         self._partition(node.root.salt or ""), self.run))

    def retry_backups(self) -> int:
        """Back up again the nodes of the failed backups whose delay has passed, while a
        controller serves with L3 on (otherwise they keep waiting); returns how many
        backups were sent. A node no longer in L2 (evicted, or gone from the tree) is
        skipped: there is nothing to back up."""
        if not self._backup_retries or self.run is None or not self.l3_enabled:
            return 0
        now, sent = self.clock(), 0
        while self._backup_retries and self._backup_retries[0].due <= now:
            r = heapq.heappop(self._backup_retries)
            for node in reversed(self._span(r.node, r.npages)):  # parents first
                before = self.in_flight
                self.back_up(node, r.attempt)
                sent += self.in_flight - before
        self.counters.backup_retries += sent
        return sent

    def _retry_later(self, op: TierOp, attempt: int) -> None:
        """Queue the span of a failed backup for retry ``attempt + 1``, or abandon it."""
        if attempt >= len(BACKUP_RETRY_DELAYS_S) or len(self._backup_retries) >= BACKUP_RETRY_QUEUE:
            self.counters.backups_abandoned += 1
            log.warning("an L3 backup of %d pages failed %d times: they stay in L2 only", op.npages, attempt + 1)
            return
        heapq.heappush(self._backup_retries, BackupRetry(self.clock() + BACKUP_RETRY_DELAYS_S[attempt],
                                                         next(self._ids), op.node, op.npages, attempt + 1))

    def _span(self, node: TreeNode, npages: int) -> list[TreeNode]:
        """The nodes from ``node`` upward that hold its last ``npages`` pages (lowest first);
        [] once ``node`` has left the tree (a detached node has no parent)."""
        out: list[TreeNode] = []
        n: TreeNode | None = node
        while npages > 0 and n is not None and n.parent is not None:
            out.append(n)
            npages -= len(n.key) // self.cache.page_size
            n = n.parent
        return out

    def _partition(self, cache_salt: str) -> str:
        return self.l3_partition(cache_salt) if self.l3_partition is not None else ""

    # ------------------------------------------------------------------ L3 -> L2
    def start_prefetch(self, rid: str, token_ids: Sequence[int], match: MatchResult,
                       cache_salt: str = "") -> PrefetchTicket | None:
        """Ask L3 for the pages after the L1+L2 match of a waiting request.

        None when L3 is off or the rest is shorter than ``prefetch.threshold_tokens``.
        """
        if not self.l3_enabled or self.run is None:
            return None
        ps = self.cache.page_size
        start = match.device_len + match.host_hit_length
        rest_pages = (len(token_ids) - start) // ps
        if rest_pages <= 0 or rest_pages * ps < max(self.prefetch_cfg.threshold_tokens, 1):
            return None
        parent = self.cache.hashes.last_page_hash(match.last_host_node) if match.last_host_node.parent else None
        hasher = self.cache.hashes.hasher_for(cache_salt)
        hashes = hasher.hash_pages(token_ids[start : start + rest_pages * ps], parent)
        cfg = self.prefetch_cfg
        deadline = None
        if cfg.policy == "timeout":
            deadline = self.clock() + cfg.timeout_base_s + cfg.timeout_per_ki_token_s * rest_pages * ps / 1024
        ticket = PrefetchTicket(rid, list(token_ids[: start + rest_pages * ps]), cache_salt, start, hashes,
                                cfg.policy, deadline, next(self._ids))
        ticket.aux_keys = {c.name: component_keys(c.name, hashes) for c in self.cache.aux
                           if c.host_allocator is not None}
        self._register(ticket.query_op, OpKind.QUERY, prefetch=ticket)
        self.counters.prefetch_queries += 1
        self.send(protos.PrefetchQuery(ticket.query_op, hashes, "full", ticket.aux_keys, self._partition(cache_salt),
                                       self.run))
        return ticket

    def _on_hits(self, ticket: PrefetchTicket, n: int, aux_present: dict[str, list[int]] | None = None) -> None:
        ps = self.cache.page_size
        self.counters.prefetch_hit_tokens += n * ps
        if n * ps < max(self.prefetch_cfg.threshold_tokens, 1) or self.run is None:
            ticket.complete = True
            return
        host_alloc = self.cache.full.host_allocator
        assert host_alloc is not None
        cap = int(host_alloc.capacity * self.prefetch_cfg.max_reserved_fraction) - self._prefetch_reserved
        n = min(n, max(cap, 0))
        evict_host = self.cache.host.evict_host
        quotas, may_evict = self.cache.tiers.quotas, None
        if quotas is not None and n:  # within the tenant's quota (``hicache.tree.quotas``)
            tenant = quotas.tenant_of_salt(ticket.cache_salt)
            n = quotas.make_room(evict_host, ps, tenant, n)
            may_evict = quotas.evictable_for(tenant)
        if n and host_alloc.free_count < n:
            evict_host((n - host_alloc.free_count) * ps, may_evict)
        n = min(n, host_alloc.free_count)
        pages = host_alloc.alloc(n) if n > 0 else None
        if not pages:
            ticket.complete = True
            self.counters.prefetch_failed += 1
            return
        ticket.host_pages = list(pages)
        self._prefetch_reserved += len(pages)
        if quotas is not None:
            quotas.reserve(quotas.tenant_of_salt(ticket.cache_salt), len(pages))
        self._reserve_aux(ticket, len(pages), aux_present or {})
        ticket.fetch_op = next(self._ids)
        self._register(ticket.fetch_op, OpKind.FETCH, prefetch=ticket)
        aux_keys = {name: [ticket.aux_keys[name][i] for i, _u in got] for name, got in ticket.aux_units.items()}
        aux_pages = {name: [u for _i, u in got] for name, got in ticket.aux_units.items()}
        self.send(protos.PrefetchFetch(ticket.fetch_op, ticket.hashes[: len(pages)], ticket.host_pages, "full",
                                       aux_keys, aux_pages, self._partition(ticket.cache_salt), self.run))

    def _reserve_aux(self, ticket: PrefetchTicket, npages: int, aux_present: dict[str, list[int]]) -> None:
        """Reserve an L2 unit for each auxiliary object L3 holds for the first ``npages``
        pages, the deepest first when room is short (the last boundaries are the ones a
        match reaches); at most ``max_reserved_fraction`` of each pool. Objects left out
        only shorten the valid match."""
        for name, present in aux_present.items():
            if name not in ticket.aux_keys:
                continue
            alloc = self.cache.component(name).host_allocator
            if alloc is None:
                continue
            idx = sorted({i for i in present if 0 <= i < npages})
            cap = int(alloc.capacity * self.prefetch_cfg.max_reserved_fraction)
            cap -= self._aux_reserved.get(name, 0)
            take = idx[len(idx) - max(0, min(len(idx), cap, alloc.free_count)):]
            units = alloc.alloc(len(take)) if take else None
            if not units:
                continue
            ticket.aux_units[name] = list(zip(take, units, strict=True))
            self._aux_reserved[name] = self._aux_reserved.get(name, 0) + len(units)

    def _on_fetched(self, ticket: PrefetchTicket, pages_done: int,
                    aux_done: dict[str, list[bool]] | None = None) -> None:
        ps = self.cache.page_size
        pages = ticket.host_pages
        self._prefetch_reserved -= len(pages)
        quotas = self.cache.tiers.quotas
        if quotas is not None:
            quotas.settle(quotas.tenant_of_salt(ticket.cache_salt), len(pages))
        host_alloc = self.cache.full.host_allocator
        assert host_alloc is not None
        if pages_done < len(pages):
            host_alloc.free(pages[pages_done:])
            self.counters.prefetch_revoked_pages += len(pages) - pages_done
        first = ticket.start_tokens // ps
        aux: dict[str, dict[int, int]] = {}
        for name, got in ticket.aux_units.items():
            self._aux_reserved[name] -= len(got)
            arrived = (aux_done or {}).get(name, [])
            keep = aux[name] = {}
            spare = []
            for k, (i, unit) in enumerate(got):
                if k < len(arrived) and arrived[k] and i < pages_done:
                    keep[first + i] = unit
                else:  # absent, refused or past the Full pages that arrived: unusable
                    spare.append(unit)
            alloc = self.cache.component(name).host_allocator
            if spare and alloc is not None:
                alloc.free(spare)
        ticket.aux_units = {}
        if pages_done:
            end = ticket.start_tokens + pages_done * ps
            res = self.cache.host.insert_host(ticket.key[:end], pages[:pages_done], ticket.cache_salt,
                                         start_page=first, aux=aux)
            ticket.arrived_tokens = max(0, res.kept_end - ticket.start_tokens)
            self.counters.prefetch_tokens += pages_done * ps
            self.counters.prefetch_aux_units += sum(len(m) for m in aux.values())
        ticket.host_pages = []
        ticket.complete = True

    def cancel_prefetch(self, ticket: PrefetchTicket) -> None:
        """The request no longer needs it (aborted or scheduled): stop waiting; a fetch in
        flight still lands in L2 (its pages are useful to others) and is inserted."""
        if ticket.fetch_op is not None and ticket.fetch_op in self._inflight:
            return
        self._inflight.pop(ticket.query_op, None)
        ticket.complete = True

    # ------------------------------------------------------------------ answers
    def on_message(self, msg: protos.Message) -> LoadTicket | None:
        """Apply one controller answer. Returns the load-back it ended (``ok`` set either
        way), so that the caller can lock what it loaded before anything else runs; None for
        every other answer. Answers for unknown (e.g. already failed) ops are ignored."""
        if isinstance(msg, protos.PrefetchHits):
            e = self._inflight.pop(msg.op_id, None)
            if e is not None and e.kind is OpKind.QUERY:
                assert e.prefetch is not None
                self._on_hits(e.prefetch, msg.n, msg.aux_present)
            return None
        if not isinstance(msg, protos.OpDone):
            return None
        if msg.status == "rejected":
            # The controller refused this message; if it is ours, the op never ran.
            self.counters.rejected += 1
            log.error("controller rejected op %d: %s", msg.op_id, msg.error)
        e = self._inflight.pop(msg.op_id, None)
        if e is None:
            return None
        return self._end(e, msg.status == "ok", msg.pages_done, msg.aux_done)

    def _end(self, e: InFlightOp, ok: bool, pages_done: int,
             aux_done: dict[str, list[bool]] | None = None) -> LoadTicket | None:
        """End an entry already taken out of the registry: apply its outcome to the tree and
        its ticket (each entry is ended exactly once). Returns its ticket for a load."""
        cache = self.cache
        if e.kind is OpKind.WRITE:
            assert e.transfer is not None
            written = cache.tiers.finish_write(e.transfer, ok)
            if ok:
                self.counters.writes += 1
                for node in written:  # every node of the write, also the parts of a split
                    self.back_up(node)
            else:
                self.counters.writes_failed += 1
        elif e.kind is OpKind.LOAD:
            assert e.transfer is not None and e.load is not None
            cache.tiers.finish_load_back(e.transfer, ok)
            e.load.ok = ok
            if ok:
                self.counters.loads += 1
                self.counters.loaded_tokens += e.load.tokens
            else:
                self.counters.loads_failed += 1
            return e.load
        elif e.kind is OpKind.BACKUP:
            assert e.transfer is not None
            cache.tiers.finish_backup(e.transfer, ok)
            if ok:
                self.counters.backups += 1
                self.counters.backup_tokens += e.transfer.npages * cache.page_size
            else:
                self.counters.backups_failed += 1
                self._retry_later(e.transfer, e.attempt)
        elif e.kind is OpKind.QUERY:
            assert e.prefetch is not None
            e.prefetch.complete = True
        elif e.kind is OpKind.FETCH:
            assert e.prefetch is not None
            self._on_fetched(e.prefetch, pages_done if pages_done >= 0 else 0, aux_done)
        return None

    def on_controller_lost(self) -> int:
        """The controller died or hung: end every op in flight now, as failed, each once
        (its tree op finished as failed, a load's ticket ``ok`` False, a fetch's reserved
        pages freed, a query's ticket complete). Returns how many were ended."""
        entries = list(self._inflight.values())
        self._inflight.clear()
        self.counters.controller_losses += 1
        for e in entries:
            self._end(e, False, 0)
        return len(entries)
