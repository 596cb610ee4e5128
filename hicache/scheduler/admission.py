"""Admission: moving waiting requests to running, through their tier states.

One pass (``Admission.run``) walks the waiting queue in ``scheduler.policy`` order. Each
request is matched (a peek: the tree counts a hit once, at admission), its L3 prefetch or
L2 load-back is started when the tier policy says so, and it is admitted when its prefix is
in L1 and its L1 budget can reserve the pages for its prompt plus its whole decode budget
(it stays queued otherwise; nothing fails for lack of room).

Hybrid models match the prompt without its last token, so the match ends at a boundary
valid for every component and is used as is (a truncated match would not be valid for SWA
or Mamba). At admission a request reserves every L1 unit it may still need (Full pages, and
through ``AuxMemory.amounts`` SWA pages and Mamba slots), checked first with
``can_reserve`` against ``room`` = free + evictable - reserved; ``unadmit`` undoes a
half-done admission.
"""

from __future__ import annotations

from hicache.scheduler.aux_memory import AuxMemory
from hicache.scheduler.controller_driver import LoadTicket
from hicache.scheduler.finishing import Finisher
from hicache.scheduler.queue_policy import order_waiting
from hicache.scheduler.request import LOADING, PREFETCH, RUNNING, WAITING, Request
from hicache.scheduler.state import SchedulerState
from hicache.tree.cache import MatchResult
from hicache.tree.node import ComponentType, LockToken
from hicache.tree.request_state import RequestState

FULL = ComponentType.FULL


class Admission:
    """The admission phase (see the module docstring)."""

    def __init__(self, state: SchedulerState, aux: AuxMemory, finisher: Finisher) -> None:
        self.s = state
        self.aux = aux
        self.finisher = finisher

    def run(self) -> None:
        """One pass over the waiting queue."""
        s = self.s
        if not s.waiting:
            return
        sc = s.cfg.scheduler
        budget = sc.max_prefill_tokens - sum(
            min(r.prompt_len - r.computed, sc.chunked_prefill_tokens) for r in s.running if r.prefilling)
        order = order_waiting(s.waiting, sc.policy, lambda r: s.match_len.get(r.rid, 0),
                              lambda r: s.match_node.get(r.rid), s.rng)
        for req in order:
            if len(s.running) >= sc.max_running_requests or budget <= 0:
                break
            admitted = False
            with self.finisher.request_scope(req, "admitting the request"):
                admitted = self.try_admit(req)
            if admitted:
                s.waiting.remove(req)
                s.running.append(req)
                budget -= min(req.prompt_len - req.computed, sc.chunked_prefill_tokens)
        if not s.running and (s.tier is None or not s.tier.in_flight):
            # Nothing runs and nothing moves: loaded prefixes held for waiting requests may be
            # what keeps them all out. Let go of them; those requests may load again later.
            for req in s.waiting:
                if req.hold is not None:
                    self.finisher.release_hold(req)
                    req.load = None

    def try_admit(self, req: Request) -> bool:
        """Move ``req`` along its tier states; True once it is admitted (status running)."""
        s = self.s
        cache, tier, now = s.cache, s.tier, s.clock()
        if req.status == LOADING:
            assert req.load is not None
            if not req.load.done:
                return False
            if req.load_done_at is None:  # ended with the controller: no answer reported it
                req.load_done_at = now
            req.status = WAITING
        if req.status == PREFETCH:
            assert req.prefetch is not None
            if not req.prefetch.ready(now):
                return False
            if not req.prefetch.complete and tier is not None:
                tier.cancel_prefetch(req.prefetch)
            req.status = WAITING
        # hybrid: match without the last prompt token, so the match is never truncated below
        key = req.input_ids[:-1] if s.hybrid else req.input_ids
        m = cache.match_prefix(key, req.cache_salt, copy_on_match=False)
        s.match_len[req.rid] = m.device_len + m.host_hit_length
        s.match_node[req.rid] = m.last_host_node
        if tier is not None and req.load is None:
            if req.prefetch is None and tier.l3_enabled:
                ticket = tier.start_prefetch(req.rid, req.input_ids, m, req.cache_salt)
                if ticket is not None:
                    req.prefetch = ticket
                    if not ticket.ready(now):
                        req.status = PREFETCH
                        return False
            if m.host_hit_length and m.host_hit_length >= max(tier.load_back_threshold, 1):
                load = None
                # a load takes L1 units and locks the L1 prefix above it: never out of what
                # running requests were promised (docs/architecture.md §5, the budget table)
                if s.budget.fits(cache.tiers.load_back_cost(m)):
                    load = tier.start_load_back(m, req.rid)
                if load is not None:
                    req.load = load
                    req.status = LOADING
                    req.load_sent_at, req.load_done_at = now, None
                    return False  # ``load_finished`` takes it from the controller's answer
                if s.running or tier.in_flight:
                    # No room yet: pages are held by running requests or pinned by transfers
                    # (a node being written cannot be evicted, nor anything above it). Wait
                    # for them rather than recompute what L2 holds.
                    return False
        return self.admit(req, m)

    def load_finished(self, load: LoadTicket) -> None:
        """A controller answer ended ``load`` (``ControllerDriver.on_message`` returned it): when
        it loaded, lock what it loaded until its request is admitted, so that other requests'
        allocations cannot evict it first (its pages are LRU-old), when L1's budget can spare
        that lock (``L1Budget.lock_if_room``; else the request matches again at admission and
        may find it evicted). Nothing for a request that is gone (aborted) or waits for
        another load."""
        req = self.s.by_rid.get(load.rid)
        if req is None or req.load is not load:
            return
        req.load_done_at = self.s.clock()
        if load.ok and req.hold is None:  # without room for the hold: re-matched at admission
            req.hold = self.s.budget.lock_if_room(load.node)

    def admit(self, req: Request, m: MatchResult) -> bool:
        s = self.s
        ps = s.page_size
        prefix = min(m.device_len, (req.prompt_len - 1) // ps * ps)  # at least one token to compute
        total_pages = -(-(req.prompt_len + req.params.max_new_tokens) // ps)
        need = total_pages - prefix // ps
        amounts = {FULL: need, **self.aux.amounts(req, need, prefix)}
        lock = s.cache.inc_lock_ref(m.last_device_node)  # before the room: the match is not evictable
        if not s.budget.can_reserve(amounts):
            s.cache.dec_lock_ref(lock)
            return False
        try:
            return self.admit_locked(req, m, prefix, amounts, lock)
        except Exception:
            # give back the lock (held by req.tree once that is set) and the reservations
            if req.tree is None:
                s.cache.dec_lock_ref(lock)
            else:
                self.unadmit(req)
            raise

    def admit_locked(self, req: Request, m: MatchResult, prefix: int, amounts: dict[ComponentType, int],
                     lock: LockToken) -> bool:
        """The rest of ``admit`` once the match is locked and the room is there; on an
        exception ``admit`` undoes what this did."""
        s = self.s
        self.finisher.release_hold(req)  # the admission lock covers the loaded prefix now
        req.admitted_at = s.clock()
        req.tree = RequestState(req.input_ids, list(m.device_indices[: prefix // s.page_size]), req.cache_salt,
                                prefix, m.last_device_node, lock)
        req.computed = prefix
        s.budget.reserve(req.rid, amounts)
        if not self.aux.admit(req, m, prefix):  # counted free or evictable, but not evictable now: queue
            self.unadmit(req)
            return False
        req.status = RUNNING
        s.cache.record_hit(m)  # once per request: the passes it waited matched without counting
        self.account_hits(req, prefix)
        return True

    def unadmit(self, req: Request) -> None:
        """Undo a half-done ``admit``: give back the lock, reservations and slots."""
        self.s.budget.release(req.rid)
        self.aux.unadmit(req)
        st = req.tree
        if st is None:
            return
        if st.lock is not None:
            self.s.cache.dec_lock_ref(st.lock)
        req.tree = None
        req.computed = 0

    def account_hits(self, req: Request, prefix: int) -> None:
        """Split ``req``'s ``prefix`` cached tokens by the tier they came from, and count them."""
        loaded = req.load.tokens if req.load is not None and req.load.ok else 0
        fetched = req.prefetch.arrived_tokens if req.prefetch is not None else 0
        storage = min(fetched, loaded, prefix)
        host = min(loaded - storage, prefix - storage)
        req.cached_storage, req.cached_host = storage, host
        req.cached_device = prefix - storage - host
        c = self.s.counters
        c.cached_device += req.cached_device
        c.cached_host += req.cached_host
        c.cached_storage += req.cached_storage
        c.prompt_tokens += req.prompt_len
