"""The cache server's reservations: where an engine saves newly computed pages in L2
(``reserve``), and that a save landed (``commit``: inserted in the tree, then backed up to
L3 by the tier manager) (docs/architecture.md §13).

Owns the reserve leases (made by ``reserve_range``; ended by the last rank's ``commit``:
inserted with ``insert_host`` when every rank wrote and the lease is live, else given back
with ``L2Pool.end``), the walk that finds where a save range starts (resumed from the
request's ``SaveCursor``, full-attention models only) and the bounded re-save of an evicted
prefix (``RESAVE_SHARE``).

A model with sliding-window layers keeps a page in two parts: the Full component holds the
full parts (the other layers' blocks) of every page, the SWA component the window parts,
only for the pages of the window before a request's prompt end, before its latest saved end,
and before the end of a held prefix that a request computed again and went on from (a
tombstone elsewhere). A reservation takes the full parts of the range and the window parts
that L2 lacks of those windows (``_window_wanted``), and a request's commit drops the window
parts it brought for its earlier ends (``_slide_window``). With state layers it takes a slot
for each offered state the tree lacks (``SaveRange.state_pages``).
"""

from __future__ import annotations

from array import array

import protos
from hicache.cache_server.handler import Handler
from hicache.cache_server.l2_pool import STATE, WINDOW, L2Pool
from hicache.cache_server.leases import Lease, LeaseKind
from hicache.cache_server.pins import EnginePins
from hicache.cache_server.sessions import Sessions, namespaced_salt
from hicache.cache_server.slots import Refusal, RequestSlots, SaveCursor
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.tree.cache import MatchResult, UnifiedRadixCache
from hicache.tree.node import TreeNode

RESAVE_SHARE = 0.1
"""Pages of a running request's evicted prefix that its saves may bring back, per page of new
content it asked to save (``SaveCursor.credit``): pages reserved stay within 1.1x the new
content at any L2 size."""


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive pages of sorted ``pages``."""
    out: list[tuple[int, int]] = []
    for j in pages:
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


class Reservations(Handler):
    """Answers ``Reserve`` and ``Commit``; the tier manager backs committed pages up to L3;
    ``pins``: told of each commit (None without pins)."""

    def __init__(self, cache: UnifiedRadixCache, tier: ControllerDriver | None, sessions: Sessions,
                 slots: RequestSlots, l2: L2Pool, pins: EnginePins | None) -> None:
        super().__init__(cache, tier, sessions, slots, l2)
        self.pins = pins
        self.window_pages_per_hit = l2.window_pages_per_hit

    def reserve(self, msg: protos.Reserve) -> protos.Message:
        """One reservation per save range of the step (``reserve_range``)."""
        session = self.sessions.open_session(msg)
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
        key = self.slots.tokens((session, item.rid), item.base, item.token_ids)
        if isinstance(key, Refusal):
            return protos.Reservation(code=key.code, reason=key.reason)
        self.counters.reserve_tokens_received += len(key) - item.base
        salt = namespaced_salt(namespace, item.cache_salt)
        ps = self.cache.page_size
        end = len(key) // ps
        cursor = self.slots.cursor((session, item.rid), salt)
        match: MatchResult | None = None
        if self.window or self.state:
            match = self.cache.match_prefix(key, salt)
            self.counters.reserve_walked_pages += sum(len(x.key) for x in match.path or ()) // ps
            # the first page L2 lacks (with window or state layers a hit may end before it)
            start = match.walked_len // ps
        else:
            start = self._held_prefix(cursor, key, salt) // ps
            start = self._after_own_reservations(cursor, key, salt, start, item.start_page)
        new = max(0, end - max(start, item.start_page))
        gap = max(0, min(item.start_page, end) - start)
        credit = cursor.credit + RESAVE_SHARE * new
        if gap > credit:  # the request's evicted prefix is more than its saves may bring back
            self.counters.resave_refused_pages += gap
            return protos.Reservation(0, start)
        cursor.credit = credit - gap
        self.counters.save_new_pages += new
        want = max(0, end - start)
        host = self.l2.host
        if host.free_count < want:
            self.cache.host.evict_host((want - host.free_count) * ps)
        n = min(want, host.free_count)
        if n < want:
            self.counters.reserve_short_pages += want - n
        top = start + n if n else min(start, end)  # the reservation's prefix ends at page ``top``
        window_at: list[int] = []
        self.counters.resaved_pages += min(n, gap)
        if match is not None and self.window and n == want:
            memory = self.slots.memory((session, item.rid))
            own = memory.window_end if not memory.window_kept else -1  # its own earlier end: no branch point
            held = self.cache.host.host_page_flags(match.walked_node, WINDOW) if match.walked_node else []
            boundaries = [start if start != own else end, end, item.repeat_end]
            window_at = [j for j in self._window_wanted(item.window_from, match.host_hit_length // ps, boundaries,
                                                        end)
                         if j < top and not (j < len(held) and held[j])]
        window = self.l2.alloc_aux(WINDOW, len(window_at))
        if len(window) < len(window_at):
            self.counters.reserve_short_window_pages += len(window_at)
            window_at = []
        state_at: list[int] = []
        if match is not None and self.state and n == want:
            held_states = self.cache.host.host_state_pages(match.walked_node, STATE) if match.walked_node else set()
            state_at = sorted({j for j in item.state_pages if 0 <= j < top and j not in held_states})
        states = self.l2.alloc_aux(STATE, len(state_at))
        if len(states) < len(state_at):
            self.counters.reserve_short_states += len(state_at)
            state_at = []
        if n == 0 and not window_at and not state_at:
            return protos.Reservation(0, start)
        pages = list(host.alloc(n)) if n else []
        saves_at = (salt, start, key[start * ps:(start + 1) * ps].tobytes()) if n else None
        lease = self.leases.add(Lease(0, LeaseKind.RESERVE, session, self.clock(), key=key, key_len=top * ps,
                                      cache_salt=salt, start_page=min(start, top), pages=pages,
                                      ranks=self.sessions.ranks(session), window_pages=window, window_at=window_at,
                                      state_slots=states, state_at=state_at, rid=item.rid,
                                      repeat_end=item.repeat_end, saves_at=saves_at))
        self.counters.reserved_pages += n
        if match is None:
            cursor.leases.append(lease.lease_id)
            if cursor.node is not None and cursor.depth <= lease.start_page * ps:
                lease.held_node, lease.held_tokens = cursor.node, cursor.depth
        return protos.Reservation(lease.lease_id, start, pages, window_pages=window, window_at=window_at,
                                  state_slots=states, state_at=state_at)

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

    def _after_own_reservations(self, cursor: SaveCursor, key: array[int], salt: str, start: int,
                                asked: int) -> int:
        """``start`` moved past the pages that the request's own open reservations (its
        earlier saves, whose commits have not come yet) will insert from there on, so that a
        save of a page that filled while an earlier one was still being copied does not copy
        the request's whole prefix again. Full-attention models only (a window or a state
        part is brought at a save's own boundaries).

        Only reservations that end by ``asked`` (the range's ``start_page``) are passed: the
        engine asks from below one of its own open reservations only when it learned that the
        step which was to save those pages failed (``Tracked.saved_pages`` lowered to the
        first stale block), and that step's failed ``Commit`` comes from the worker, on another
        socket, so it may arrive after this ``Reserve``. Passing it would leave those pages
        to a lease about to fail, and the request, which computes them again, would not save
        them. Reserved again, they are saved from the good blocks; had the earlier lease not
        failed after all, the second commit of the same pages is a duplicate, freed.

        Safe because a rank commits its saves in the order they were planned, so the earlier
        lease ends first; if it fails, the later one starts past what the tree holds and
        ``insert_host`` frees its pages (a shorter cache, never a wrong one)."""
        open_ = [lease for lid in cursor.leases if (lease := self.leases.leases.get(lid)) is not None]
        cursor.leases = [lease.lease_id for lease in open_]  # prefixes of ``key`` (``_keep_prefixes``)
        spans = [(lease.start_page, lease.start_page + len(lease.pages)) for lease in open_
                 if lease.cache_salt == salt and not lease.failed and lease.pages]
        for first, top in sorted(spans):  # by first page: one pass follows a run of them
            if first <= start < top <= asked:
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

    def commit(self, msg: protos.Commit) -> None:
        """A rank wrote its shard of a reservation (``ok``) or gave up. With the last rank's
        commit: into the tree if every rank wrote (and the lease is live), else freed."""
        if self.sessions.stale(msg.run):
            return
        verdict, lease = self.leases.report(msg.lease, msg.session, LeaseKind.RESERVE, msg.rank)
        if lease is not None and not msg.ok:
            lease.failed = True
        lease = self.live_due(msg.session, msg.lease, LeaseKind.RESERVE, msg.rank, verdict, lease)
        if lease is None:
            return
        if lease.failed:
            self.counters.commit_failed_pages += len(lease.pages)
            self.l2.end(lease)
            return
        assert lease.key is not None
        aux: dict[str, dict[int, int]] = {}
        if lease.window_pages:
            aux[WINDOW] = dict(zip(lease.window_at, lease.window_pages, strict=True))
        if lease.state_slots:
            aux[STATE] = dict(zip(lease.state_at, lease.state_slots, strict=True))
        window_free = self.l2.window_free
        state_free = self.l2.state_alloc.free_count if self.state else 0
        held = lease.held_node
        root = self.cache.core.root(lease.cache_salt)
        if held is not None and (aux or root is None or not self._still_held(held, root)):
            held = None
        res = self.cache.host.insert_host(lease.key, lease.pages, lease.cache_salt, start_page=lease.start_page,
                                           aux=aux or None, length=lease.key_len, start_node=held,
                                           start_tokens=lease.held_tokens if held is not None else 0)
        self.counters.committed_window_pages += window_free - self.l2.window_free + len(lease.window_pages)
        if self.state:
            self.counters.committed_states += state_free - self.l2.state_alloc.free_count + len(lease.state_slots)
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
        memory = self.slots.known_memory((lease.session, lease.rid))
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
