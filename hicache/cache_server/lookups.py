"""The cache server's lookups: which L2 pages hold a request's prefix, locked under a lease
until every rank's ``Release`` (docs/architecture.md §13).

Owns the lookup leases (made by ``lookup``, ended by ``release``: ``L2Pool.end`` unlocks
them) and the prefetches from L3 that lookups start through the tier manager (one per
request at most; ``finished``, ``keep_sessions`` and a done prefetch's answer cancel its ticket).
A hit's answer: its full pages and, with window layers, the window parts of its last
window, with state layers the state after its last page, each host-locked (the tree's SWA
and Mamba rules end a hit only where those are held). A request's first lease counts its
hit in the tree; asking again does not.

A save in flight: when another reservation (another engine's, or a preempted request's own)
is saving the very pages after the hit, and they reach past what the engine holds itself
(``Lookup.local_pages``), the answer is ``pending`` rather than a hit that stops short: a
decode engine asking while the prefill engine's copy still runs gets the whole prefix a
moment later instead of computing it again. Each request waits so at most ``save_wait_s``
in all (from its first such answer); then it gets what L2 holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Container

import protos
from hicache.cache_server.handler import Handler
from hicache.cache_server.l2_pool import STATE, WINDOW, L2Pool
from hicache.cache_server.leases import Lease, LeaseKind, Report
from hicache.cache_server.request_tokens import Slot
from hicache.cache_server.sessions import Sessions, namespaced_salt
from hicache.cache_server.slots import Refusal, RequestSlots
from hicache.scheduler.controller_driver import ControllerDriver, PrefetchTicket
from hicache.tree.cache import MatchResult, UnifiedRadixCache


class Lookups(Handler):
    """Answers ``Lookup`` and ``Release``; the tier manager prefetches from L3."""

    def __init__(self, cache: UnifiedRadixCache, tier: ControllerDriver | None, sessions: Sessions,
                 slots: RequestSlots, l2: L2Pool, save_wait_s: float = 0.0) -> None:
        super().__init__(cache, tier, sessions, slots, l2)
        self._prefetches: dict[Slot, PrefetchTicket] = {}
        self.save_wait_s = save_wait_s
        """How long a request's lookups may wait in all for a save in flight (0: never)."""

    def lookup(self, msg: protos.Lookup) -> protos.Message:
        """The L2 hit of the request's tokens, locked under a lease, answered at once. When L3
        may hold pages after it, a prefetch starts and the answer is ``pending`` (nothing
        locked) until the prefetch is done: then the hit includes what arrived."""
        session = self.sessions.open_session(msg)
        if isinstance(session, protos.EngineError):
            return session
        slot = (msg.session, msg.rid)
        key = self.slots.tokens(slot, msg.base, msg.token_ids)
        if isinstance(key, Refusal):
            return protos.EngineError(msg.req, key.code, key.reason)
        self.counters.lookups += 1
        self.counters.lookup_tokens_received += len(key) - msg.base
        salt = namespaced_salt(session.namespace, msg.cache_salt)
        ticket = self._prefetches.get(slot)
        if ticket is not None:
            return self._prefetch_answer(msg, slot, key, salt, ticket)
        match = None
        memory = self.slots.memory(slot)
        if msg.prefetch and self.tier is not None and self.tier.l3_enabled and not memory.prefetched:
            match = self.cache.match_prefix(key, salt)
            if len(key) > match.host_hit_length:
                memory.prefetched = True
                ticket = self.tier.start_prefetch(msg.rid, key, match, salt)
                if ticket is not None and ticket.policy != "best_effort":
                    self._prefetches[slot] = ticket
                    return self._prefetch_answer(msg, slot, key, salt, ticket)
        return self._answer(msg, slot, key, salt, memory.storage_pages, match)

    def _prefetch_answer(self, msg: protos.Lookup, slot: Slot, key: array[int], salt: str,
                         ticket: PrefetchTicket) -> protos.Message:
        """``pending`` while the slot's prefetch runs; once it is done (or its policy gave up
        on it), the hit with what it brought."""
        if not ticket.ready(self.clock()):
            self.counters.lookup_pending += 1
            return protos.LookupResult(msg.req, pending=True)
        del self._prefetches[slot]
        self.cancel_prefetch(ticket)
        brought = ticket.arrived_tokens // self.cache.page_size
        memory = self.slots.memory(slot)
        memory.prefetched, memory.storage_pages = True, brought
        return self._answer(msg, slot, key, salt, brought)

    def cancel_prefetch(self, ticket: PrefetchTicket) -> None:
        if self.tier is None:  # tickets come from the tier manager: there are none without one
            raise RuntimeError("a prefetch ticket on a cache server without a tier manager")
        self.tier.cancel_prefetch(ticket)

    @property
    def prefetching(self) -> int:
        """Requests whose lookup waits for a prefetch from L3."""
        return len(self._prefetches)

    def _answer(self, msg: protos.Lookup, slot: Slot, key: array[int], salt: str, storage_pages: int,
                match: MatchResult | None = None) -> protos.Message:
        """The L2 hit of ``key`` now, locked under a lease (none for no hit), or ``pending``
        while a save in flight continues it (``_awaits_save``); ``match``: the key's match
        made a moment ago in this call, if any (not made twice). The request's first lease
        counts its hit in the tree (``record_hit``); asking again does not."""
        req, session = msg.req, slot[0]
        if match is None:
            match = self.cache.match_prefix(key, salt)
        if self._awaits_save(slot, key, salt, match.host_hit_length // self.cache.page_size, msg.local_pages):
            self.counters.lookup_save_waits += 1
            return protos.LookupResult(req, pending=True)
        if match.host_hit_length == 0:
            return protos.LookupResult(req)
        memory = self.slots.memory(slot)
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
                                      storage_pages=storage_pages, ranks=self.sessions.ranks(session),
                                      window_npages=window_npages, state_locked=self.state))
        self.counters.lookup_hit_pages += len(pages)
        self.counters.lookup_storage_pages += storage_pages
        self.counters.lookup_window_pages += len(window)
        self.counters.lookup_states += self.state
        return protos.LookupResult(req, lease.lease_id, pages, storage_pages, window_pages=window, state_slot=state)

    def _awaits_save(self, slot: Slot, key: array[int], salt: str, hit_pages: int, local_pages: int) -> bool:
        """Whether the lookup of ``key`` (its L2 hit ``hit_pages`` long) waits for a live
        reservation that begins at page ``hit_pages`` of the same prefix and reaches past
        ``max(hit_pages, local_pages)``: ``pending`` for at most ``save_wait_s`` per request."""
        if self.save_wait_s <= 0:
            return False
        ps = self.cache.page_size
        beyond = max(hit_pages, local_pages)
        reach = (beyond + 1) * ps  # the prefix must agree through the first page the engine lacks
        if len(key) < reach:
            return False
        at = (salt, hit_pages, key[hit_pages * ps:(hit_pages + 1) * ps].tobytes())
        if not any(lease.key is not None and lease.key_len >= reach and lease.key[:reach] == key[:reach]
                   for lease in self.leases.saving(at)):
            return False
        memory = self.slots.memory(slot)
        now = self.clock()
        if memory.save_wait_since is None:
            memory.save_wait_since = now
        return now - memory.save_wait_since < self.save_wait_s

    def release(self, msg: protos.Release) -> None:
        """A rank is done with a lookup's pages; with the last rank's release they are
        unlocked (the loaded count is the fewest any rank loaded)."""
        if self.sessions.stale(msg.run):
            return
        verdict, lease = self.leases.report(msg.lease, msg.session, LeaseKind.LOOKUP, msg.rank)
        if lease is not None and verdict is not Report.REPEATED:
            loaded = max(0, msg.loaded_pages)
            lease.loaded_pages = loaded if lease.loaded_pages is None else min(lease.loaded_pages, loaded)
        lease = self.live_due(msg.session, msg.lease, LeaseKind.LOOKUP, msg.rank, verdict, lease)
        if lease is None:
            return
        self.l2.end(lease)
        loaded = lease.loaded_pages or 0
        from_storage = min(loaded, lease.storage_pages)
        self.counters.loaded_host_pages += loaded - from_storage
        self.counters.loaded_storage_pages += from_storage

    def finished(self, slot: Slot) -> None:
        """The request ended: its prefetch, if one runs, is cancelled."""
        ticket = self._prefetches.pop(slot, None)
        if ticket is not None:  # the request ended while its prefetch ran
            self.cancel_prefetch(ticket)

    def keep_sessions(self, live: Container[int]) -> None:
        """Cancel the prefetches of every session not in ``live``."""
        for slot in [s for s in self._prefetches if s[0] not in live]:
            self.cancel_prefetch(self._prefetches.pop(slot))
