"""The scheduler's core: admission, continuous batching and the cache, without any sockets.

``Scheduler`` is fed messages (``submit``, ``abort``, ``admin``, ``on_controller``) and
advanced by ``step``; it answers through the ``emit`` callable (to the tokenizer) and talks
to the cache controller through the ``TierManager`` and ``controller_send``. The process
module (``hicache.scheduler.process``) wires those to ZeroMQ; tests call them directly.

One step:

1. start the L2 writes the write policy asks for;
2. walk the waiting queue in ``scheduler.policy`` order: match each request, start its L3
   prefetch or L2 load-back when the tier policy says so, and admit it when its prefix is
   in L1 and its L1 budget can reserve the pages for its prompt plus its whole decode
   budget (it stays queued otherwise; nothing fails for lack of room);
3. run one forward pass over every running request: one prefill chunk of at most
   ``chunked_prefill_tokens`` (all chunks together at most ``max_prefill_tokens``) or one
   decode token each; cache each finished prefill chunk (``cache_unfinished_req``), for
   full-attention models the last one too, so that a prompt admitted in one chunk is
   matched by concurrent requests while it decodes;
4. sample, emit tokens, and finish requests (``cache_finished_req`` gives their pages to
   the tree, which frees duplicates; the lock is released).

Fault isolation: an exception while serving one request (admitting it, preparing its part
of a forward pass, sampling or appending its token) fails that request alone, in
``_fail_request``: its client gets a final ``TokenOutput`` with finish_reason ``error`` and
the exception as the message, whatever it held goes back to the tree or the allocators as
for an abort, and the scheduler goes on with the others. An exception in the batched
forward pass itself (model code) fails every request of that batch the same way; the
requests not in it, and later ones, are served as usual. An unexpected exception while
checking a submitted request answers it with an error too. Only the exceptions of the
scheduler's own bookkeeping outside any one request (tier writes, the integrity check)
still propagate.

Page accounting: ``self.budget`` (``L1Budget``, ``hicache.scheduler.budget``) is the one
place that holds and changes reservation numbers. At admission a request reserves every L1
unit it may still need (Full pages; as many SWA pages; Mamba state slots), checked first
with ``can_reserve`` against ``room`` = free + evictable - reserved - what in-flight
load-backs hold; its allocations go through ``budget.take`` (which evicts when the
allocator is short and lowers the reservation), and ``_finish`` / ``_unadmit`` release what
is left. Whatever a finished or aborted request holds goes back to the tree or the allocator
in ``cache_finished_req``: nothing leaks. ``check_idle`` proves both whenever the scheduler
is idle: the tree's ``check_integrity`` and the budget's ``check_idle`` (each total equals
the sum over requests, and nothing is reserved).

Models: Full attention, optionally with SWA layers, Mamba layers or both (``("full",)``,
``("full", "swa")``, ``("full", "mamba")``, ``("full", "swa", "mamba")``: the cache's
components, in that order); a pattern without a full layer is refused at construction
with the reason. For hybrid models (with both aux components, each part below applies to
the same request, and its reservation holds both kinds):

- matching uses the prompt without its last token, so the match ends at a boundary valid
  for every component and is used as is (a truncated match would not be valid for SWA or
  Mamba);
- SWA: the request's SWA page table covers pages from ``swa_start_page`` on (the runner
  gets -1 before it). Its first ``swa_prefix_len`` tokens' entries are the tree's pages
  (-1 for tombstones, which the runner never reads); the rest are the request's own,
  allocated with its Full pages. As its computed position advances, its own pages wholly
  before the window before its last page boundary are freed at once (``_settle_swa``),
  and once nothing the tree holds before its window is read again, the SWA part of its
  lock is given back (``release_part``; the Full lock stays). When the prefill passes the
  prompt's last page boundary, the Full pages and the window of SWA pages before it go to
  the tree (``_insert_prompt_state``), so a repeat of the prompt matches it; at finish
  ``cache_finished_req`` takes the pages from ``swa_start_page`` on (earlier nodes are SWA
  tombstones). So a request reserves only the SWA pages it holds at once
  (``hicache.config.swa_request_pages``: its windows and one prefill chunk), re-sized after
  every pass; a boundary inside a prompt that other requests share later is a valid SWA
  match only while its window is still cached;
- Mamba: a running request's slots are its ``req.mamba`` (``MambaSlots``), the one object
  that assigns and frees them; the tree's ``RequestState.mamba_slot`` is set from it at
  admission (the own slot) and at the hand-over before ``cache_finished_req``. At
  admission the request gets its own state slot, a copy of the matched node's state (or a
  fresh one when nothing matched). Each forward that crosses a page boundary snapshots
  the state at the last one into the boundary slot; the prefill also snapshots at the
  prompt's last page boundary before its last token into the prompt slot, inserted at
  once with ``cache_unfinished_req(aux={"mamba": slot})`` so a repeated prompt matches it
  (with SWA layers too, that insert carries the request's SWA pages up to there, which
  become the tree's: ``_insert_prompt_state``). At
  finish the boundary snapshot, when it is the state after the last full page of the
  computed tokens, is handed to ``cache_finished_req``; ``MambaSlots.hand_over`` frees the
  request's own slot and any other snapshot. A request reserves its (up to three) slots
  at admission; a snapshot that still finds no slot is skipped (its state is just not
  cached), never an error.
- L2: SWA pages and Mamba states move to and from L2 with their nodes' Full pages when
  the tree has L2 allocators for them (``cache.l2.state_slots: 0`` keeps Mamba L1-only);
  L3 backups and prefetches carry them too, so a prefix prefetched from L3 is a valid
  hybrid match up to the last boundary whose SWA window and Mamba state L3 (or L1 / L2)
  still holds.
"""

from __future__ import annotations

import logging
import random
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import protos
from hicache.config import STATE_SLOTS_PER_REQUEST, HicacheConfig, swa_min_pages, swa_request_pages
from hicache.memory.allocator import PageAllocator
from hicache.model.loader import LoadedModel
from hicache.model.runner import ForwardItem, LogitsMode, ModelRunner
from hicache.model.sampling import PenaltyState, sample_next, token_logprobs
from hicache.model.sampling_params import finish_reason, from_wire, resolve_seed
from hicache.scheduler.budget import L1Budget
from hicache.scheduler.queue_policy import order_waiting
from hicache.scheduler.request import LOADING, PREFETCH, RUNNING, WAITING, MambaSlots, Request
from hicache.tier_manager import LoadTicket, TierManager
from hicache.tree.cache import LockToken, MatchResult, RequestState, UnifiedRadixCache
from hicache.tree.components import PagedInsert
from hicache.tree.node import KEY_TYPECODE, ComponentType, TreeNode

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA

log = logging.getLogger("hicache.scheduler")


LOAD_JOIN_WAIT_FRACTION = 0.1
"""At most this fraction of a forward pass is spent waiting for load-backs to join it."""
LOAD_JOIN_WAIT_MAX_S = 0.02
"""And never more than this (a GPU step is short; a slow ack is not worth a long stall)."""


class RequestRejected(ValueError):
    """A request that cannot be served as given (answered with finish_reason ``error``)."""


def _internal_error(during: str, exc: BaseException) -> str:
    """The message a client gets for a request that failed on an exception."""
    return f"internal error while {during}: {type(exc).__name__}: {exc}"


@dataclass
class SchedulerCounters:
    requests_ok: int = 0
    requests_error: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    forward_passes: int = 0
    integrity_checks: int = 0  # idle integrity checks that passed (``check_idle``)
    load_join_wait_s: float = 0.0  # time forward passes were held for load-backs (the loop adds it)


class Scheduler:
    def __init__(
        self,
        cfg: HicacheConfig,
        model: LoadedModel,
        runner: ModelRunner,
        cache: UnifiedRadixCache,
        l1: PageAllocator,
        emit: Callable[[protos.TokenizerMessage], None],
        *,
        tier: TierManager | None = None,
        controller_send: Callable[[protos.ControllerMessage], None] | None = None,
        eos_token_ids: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from hicache.scheduler.assembly import unsupported_reason

        problem = unsupported_reason(model.geometry)
        if problem:
            raise ValueError(problem)
        have = tuple(c.name for c in cache.components)
        if have != model.geometry.components:
            raise ValueError(f"the cache holds components {have}, the model needs {model.geometry.components}")
        if l1 is not cache.full.allocator:
            raise ValueError("l1 must be the cache's Full L1 allocator")
        self.cfg = cfg
        self.model = model
        self.runner = runner
        self.cache = cache
        self.l1 = l1
        self.emit = emit
        self.tier = tier
        self.controller_send = controller_send
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.page_size = cache.page_size
        self.vocab_size = model.spec.vocab_size
        self.max_context = model.spec.max_context
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.by_rid: dict[str, Request] = {}
        self.swa = cache.swa
        self.mamba = cache.mamba
        self.chunk_tokens = max(1, min(cfg.scheduler.chunked_prefill_tokens, cfg.scheduler.max_prefill_tokens))
        """The most tokens one request computes in one forward pass (a prefill chunk)."""
        self.hybrid = bool(cache.aux)
        self.budget = L1Budget(cache)
        """Every running request's L1 reservation (the only place those numbers change)."""
        self.counters = SchedulerCounters()
        self.forward_s_ewma = 0.0  # recent forward-pass duration (s), for load_join_wait_s
        # called right before each model call (the loop publishes the KV events of the tier
        # changes so far, so that none waits for the pass)
        self.before_model: Callable[[], None] | None = None
        self._rng = random.Random(0)
        self._match_len: dict[str, int] = {}
        self._match_node: dict[str, object] = {}
        self._admin_waiting: dict[int, str] = {}
        self._admin_ids = iter(range(1, 2**62))

    # ------------------------------------------------------------------ input
    def submit(self, msg: protos.GenerateRequest) -> None:
        """Queue a request, or answer it at once with an error naming the problem (also when
        checking it raised something unexpected: that is logged and the request refused)."""
        try:
            req = self._validate(msg)
        except Exception as exc:
            if isinstance(exc, RequestRejected):
                error = str(exc)
            else:
                log.exception("request %s: checking it failed", msg.rid)
                error = _internal_error("checking the request", exc)
            self.counters.requests_error += 1
            self.emit(protos.TokenOutput(msg.rid, [], True, "error", protos.Usage(len(msg.input_ids)), error))
            return
        self.by_rid[req.rid] = req
        self.waiting.append(req)

    def _validate(self, msg: protos.GenerateRequest) -> Request:
        if msg.rid in self.by_rid:
            raise RequestRejected(f"request id {msg.rid!r} is already in use")
        if not msg.input_ids:
            raise RequestRejected("input_ids must not be empty")
        bad = next((t for t in msg.input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        s = msg.sampling
        limit = self.cfg.scheduler.max_new_tokens_limit
        if not 1 <= s.max_new_tokens <= limit:
            raise RequestRejected(f"max_new_tokens must be in [1, {limit}], got {s.max_new_tokens}")
        if len(msg.input_ids) + s.max_new_tokens > self.max_context:
            raise RequestRejected(
                f"prompt of {len(msg.input_ids)} tokens + max_new_tokens {s.max_new_tokens} exceeds the "
                f"model's context of {self.max_context}")
        try:
            params = from_wire(s)
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        need = -(-(len(msg.input_ids) + s.max_new_tokens) // self.page_size)
        if need > self.l1.capacity:
            raise RequestRejected(f"the request needs {need} L1 pages; L1 holds {self.l1.capacity}")
        if self.swa is not None:
            swa_need = min(need, swa_min_pages(self.swa.sliding_window, self.chunk_tokens, self.page_size))
            if swa_need > self.swa.allocator.capacity:
                raise RequestRejected(f"the request needs {swa_need} L1 SWA pages at once (its windows, a "
                                      f"prefill chunk and its match's window); L1 holds {self.swa.allocator.capacity}")
        if self.mamba is not None and self.mamba.allocator.capacity <= STATE_SLOTS_PER_REQUEST:
            raise RequestRejected(f"a request needs {STATE_SLOTS_PER_REQUEST} L1 state slots besides the state it "
                                  f"matches; L1 holds {self.mamba.allocator.capacity}")
        return Request(msg.rid, array(KEY_TYPECODE, msg.input_ids), params, resolve_seed(params), msg.stream,
                       msg.cache_salt, arrival=self.clock())

    def abort(self, rid: str) -> None:
        req = self.by_rid.get(rid)
        if req is None:
            return
        self.counters.requests_aborted += 1
        with self._request_scope(req, "aborting the request"):
            self._finish(req, "abort")

    # ------------------------------------------------------------------ admin
    def admin(self, msg: protos.AdminRequest) -> None:
        op = msg.op
        try:
            if op == "flush":
                before = self.cache.total_size()
                self.cache.flush()
                self.emit(protos.AdminReply(msg.rid, True, {"flushed_tokens": before - self.cache.total_size()}))
            elif op == "stats":
                self.emit(protos.AdminReply(msg.rid, True, self.stats()))
            elif op in ("storage_status", "storage_attach", "storage_detach", "storage_clear"):
                self._storage_admin(msg)
            else:
                self.emit(protos.AdminReply(msg.rid, False, {}, f"unknown admin op {op!r}"))
        except Exception as exc:  # an admin call must never take the scheduler down
            log.exception("admin op %s failed", op)
            self.emit(protos.AdminReply(msg.rid, False, {}, f"{type(exc).__name__}: {exc}"))

    def _storage_admin(self, msg: protos.AdminRequest) -> None:
        if self.controller_send is None:
            self.emit(protos.AdminReply(msg.rid, False, {}, "no cache controller: L2 is disabled"))
            return
        op = msg.op.removeprefix("storage_")
        if op != "status" and (self.running or self.waiting or (self.tier and self.tier.in_flight)):
            self.emit(protos.AdminReply(msg.rid, False, {}, "busy: requests or transfers are in flight; retry when idle"))
            return
        op_id = next(self._admin_ids)
        self._admin_waiting[op_id] = msg.rid
        self.controller_send(protos.StorageAdmin(op_id, op, msg.args))

    def on_controller(self, msg: protos.Message) -> None:
        """An answer from the cache controller."""
        if isinstance(msg, protos.StorageStatus):
            if self.tier is not None:
                self.tier.l3_enabled = msg.backend != "none"
            rid = self._admin_waiting.pop(msg.op_id, None)
            if rid is not None:
                result = {"backend": msg.backend, "up": msg.up, "stats": msg.stats}
                self.emit(protos.AdminReply(rid, msg.error is None, result, msg.error))
            return
        if self.tier is not None:
            loaded = self.tier.on_message(msg)
            if loaded is not None:
                self._load_finished(loaded)

    def stats(self) -> dict[str, Any]:
        ps = self.page_size
        out: dict[str, Any] = {
            "l1": {"full": {"used_tokens": self.l1.used * ps, "capacity_tokens": self.l1.capacity * ps,
                            "cached_tokens": self.cache.total_size()}},
            "requests": {"running": len(self.running), "waiting": len(self.waiting)},
            "hit_tokens": {"device": self.counters.cached_device, "host": self.counters.cached_host,
                           "storage": self.counters.cached_storage},
            "integrity_checks": self.counters.integrity_checks,
        }
        if self.swa is not None:
            a = self.swa.allocator
            out["l1"]["swa"] = {"used_tokens": a.used * ps, "capacity_tokens": a.capacity * ps,
                                "cached_tokens": self.cache.total_size(ComponentType.SWA)}
        if self.mamba is not None:
            a = self.mamba.allocator
            out["l1"]["mamba"] = {"used_slots": a.used, "capacity_slots": a.capacity,
                                  "cached_states": self.cache.total_size(ComponentType.MAMBA)}
        host = self.cache.full.host_allocator
        if host is not None:
            out["l2"] = {"full": {"used_tokens": host.used * ps, "capacity_tokens": host.capacity * ps}}
            for c in self.cache.aux:
                h = c.host_allocator
                if h is not None:
                    unit = ps if c.paged else 1
                    key = "tokens" if c.paged else "slots"
                    out["l2"][c.name] = {f"used_{key}": h.used * unit, f"capacity_{key}": h.capacity * unit}
        if self.tier is not None:
            out["tiers"] = {**vars(self.tier.counters), "in_flight": self.tier.in_flight,
                            "writes_due": len(self.cache.nodes_to_write_to_host())}
        return out

    # ------------------------------------------------------------------ the step
    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> bool:
        """One scheduling pass and at most one forward pass; True if a forward ran."""
        self.schedule()
        return self.forward()

    def schedule(self) -> None:
        """Start the writes the write policy asks for, then admit what can be admitted."""
        if self.tier is not None:
            self.tier.issue_writes()
        self._schedule()

    def forward(self) -> bool:
        """One forward pass over the running requests; True if one ran."""
        if not self.running:
            return False
        t0 = time.perf_counter()
        self._forward()
        took = time.perf_counter() - t0
        self.forward_s_ewma = took if self.forward_s_ewma == 0.0 else 0.8 * self.forward_s_ewma + 0.2 * took
        return True

    def load_join_wait_s(self) -> float:
        """How long the loop may wait for load-back acks before the next forward pass.

        A request whose prefix is coming back from L2 is admitted only once its load is
        acknowledged. If that ack lands just after a forward pass has started, the request
        waits a whole pass (with a CPU model, 100 ms or more) for a copy that took a
        millisecond. So when loads are in flight and requests are running, the loop waits
        for those acks up to ``LOAD_JOIN_WAIT_FRACTION`` of a typical forward pass (capped at
        ``LOAD_JOIN_WAIT_MAX_S``): the running requests lose at most that fraction of a step,
        the loaded ones join this pass. 0 when there is nothing to wait for.
        """
        if not self.running or not any(r.status == LOADING for r in self.waiting):
            return 0.0
        return min(LOAD_JOIN_WAIT_MAX_S, LOAD_JOIN_WAIT_FRACTION * self.forward_s_ewma)

    @property
    def loads_pending(self) -> bool:
        """True while a waiting request's load-back is still in flight."""
        return any(r.status == LOADING and r.load is not None and not r.load.done for r in self.waiting)

    def check_idle(self) -> None:
        """The integrity checks, run by the loop when nothing is running or in flight: the
        tree's (``check_integrity``) and the L1 budget's (totals equal the sums over
        requests, and nothing is reserved)."""
        if not self.busy and (self.tier is None or not self.tier.in_flight):
            self.cache.check_integrity()
            self.budget.check_idle()
            self.counters.integrity_checks += 1

    def _schedule(self) -> None:
        if not self.waiting:
            return
        budget = self.cfg.scheduler.max_prefill_tokens - sum(
            min(r.prompt_len - r.computed, self.cfg.scheduler.chunked_prefill_tokens)
            for r in self.running if r.prefilling)
        order = order_waiting(self.waiting, self.cfg.scheduler.policy,
                              lambda r: self._match_len.get(r.rid, 0),
                              lambda r: self._match_node.get(r.rid), self._rng)
        for req in order:
            if len(self.running) >= self.cfg.scheduler.max_running_requests or budget <= 0:
                break
            admitted = False
            with self._request_scope(req, "admitting the request"):
                admitted = self._try_admit(req)
            if admitted:
                self.waiting.remove(req)
                self.running.append(req)
                budget -= min(req.prompt_len - req.computed, self.cfg.scheduler.chunked_prefill_tokens)
        if not self.running and (self.tier is None or not self.tier.in_flight):
            # Nothing runs and nothing moves: loaded prefixes held for waiting requests may be
            # what keeps them all out. Let go of them; those requests may load again later.
            for req in self.waiting:
                if req.hold is not None:
                    self._release_hold(req)
                    req.load = None

    def _try_admit(self, req: Request) -> bool:
        """Move ``req`` along its tier states; True once it is admitted (status running)."""
        cache, tier, now = self.cache, self.tier, self.clock()
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
        key = req.input_ids[:-1] if self.hybrid else req.input_ids
        m = cache.match_prefix(key, req.cache_salt, copy_on_match=False)
        self._match_len[req.rid] = m.device_len + m.host_hit_length
        self._match_node[req.rid] = m.last_host_node
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
                # (a load takes L1 pages: never out of what running requests have reserved)
                if self.budget.room(FULL) >= m.host_hit_length // self.page_size:
                    load = tier.start_load_back(m, req.rid)
                if load is not None:
                    req.load = load
                    req.status = LOADING
                    req.load_sent_at, req.load_done_at = now, None
                    return False  # ``_load_finished`` takes it from the controller's answer
                if self.running or tier.in_flight:
                    # No room yet: pages are held by running requests or pinned by transfers
                    # (a node being written cannot be evicted, nor anything above it). Wait
                    # for them rather than recompute what L2 holds.
                    return False
        return self._admit(req, m)

    @staticmethod
    def _timings_ms(req: Request) -> tuple[float, float, float]:
        """(queue, load, prefill) in ms for ``Usage``; 0 for a phase that did not happen."""
        def ms(a: float | None, b: float | None) -> float:
            return (b - a) * 1000.0 if a is not None and b is not None else 0.0

        return (ms(req.arrival, req.admitted_at), ms(req.load_sent_at, req.load_done_at),
                ms(req.admitted_at, req.first_token_at))

    def _load_finished(self, load: LoadTicket) -> None:
        """A controller answer ended ``load`` (``TierManager.on_message`` returned it): when
        it loaded, lock what it loaded until its request is admitted, so that other requests'
        allocations cannot evict it first (its pages are LRU-old). Nothing for a request that
        is gone (aborted) or waits for another load."""
        req = self.by_rid.get(load.rid)
        if req is None or req.load is not load:
            return
        req.load_done_at = self.clock()
        if load.ok and req.hold is None:
            req.hold = self.cache.inc_lock_ref(load.node)

    def _release_hold(self, req: Request) -> None:
        if req.hold is not None:
            self.cache.dec_lock_ref(req.hold)
            req.hold = None

    def _admit(self, req: Request, m: MatchResult) -> bool:
        ps = self.page_size
        prefix = min(m.device_len, (req.prompt_len - 1) // ps * ps)  # at least one token to compute
        total_pages = -(-(req.prompt_len + req.params.max_new_tokens) // ps)
        need = total_pages - prefix // ps
        amounts = {FULL: need}
        if self.swa is not None:  # what it holds at once, not every page it computes
            amounts[SWA] = min(need, swa_request_pages(self.swa.sliding_window, self.chunk_tokens, ps))
        if self.mamba is not None:  # its own state, the prompt snapshot (if still to take), a boundary one
            amounts[MAMBA] = MambaSlots.needed(req.prompt_len, prefix, ps)
        lock = self.cache.inc_lock_ref(m.last_device_node)  # before the room: the match is not evictable
        if not self.budget.can_reserve(amounts):
            self.cache.dec_lock_ref(lock)
            return False
        try:
            return self._admit_locked(req, m, prefix, amounts, lock)
        except Exception:
            # give back the lock (held by req.tree once that is set) and the reservations
            if req.tree is None:
                self.cache.dec_lock_ref(lock)
            else:
                self._unadmit(req)
            raise

    def _admit_locked(self, req: Request, m: MatchResult, prefix: int, amounts: dict[ComponentType, int],
                      lock: LockToken) -> bool:
        """The rest of ``_admit`` once the match is locked and the room is there; on an
        exception ``_admit`` undoes what this did."""
        ps = self.page_size
        self._release_hold(req)  # the admission lock covers the loaded prefix now
        req.admitted_at = self.clock()
        st = RequestState(req.input_ids, list(m.device_indices[: prefix // ps]), req.cache_salt, prefix,
                          m.last_device_node, lock)
        req.tree = st
        req.computed = prefix
        self.budget.reserve(req.rid, amounts)
        if self.swa is not None:
            st.swa_pages = self._tree_swa_pages(m.last_device_node, prefix // ps)
            st.swa_start_page, st.swa_prefix_len = 0, prefix
        if self.mamba is not None:
            slots = req.mamba = MambaSlots.for_admission(
                self.mamba.allocator, lambda: self._take_slot(req), ps, req.prompt_len, prefix,
                fork=m.walked_len, interval=self.cfg.cache.mamba_branch_interval)
            slot = slots.take_own()
            if slot is None:  # counted free or evictable, but not evictable now: queue
                self._unadmit(req)
                return False
            st.mamba_slot = slot  # the tree's view of it (``_unadmit`` frees it should the copy fail)
            if prefix > 0:
                src = self.cache.data(m.last_device_node, MAMBA).value
                if src is None:
                    raise RuntimeError("the matched node has no Mamba state")
                self.mamba.copy_state(src, slot)  # type: ignore[misc]
        req.status = RUNNING
        self.cache.record_hit(m)  # once per request: the passes it waited matched without counting
        self._account_hits(req, prefix)
        return True

    def _unadmit(self, req: Request) -> None:
        """Undo a half-done ``_admit``: give back the lock, reservations and slots."""
        self.budget.release(req.rid)
        if req.mamba is not None:
            req.mamba.free_all()
            req.mamba = None
        st = req.tree
        if st is None:
            return
        if st.lock is not None:
            self.cache.dec_lock_ref(st.lock)
        st.mamba_slot = None  # freed with ``req.mamba``
        req.tree = None
        req.computed = 0

    def _tree_swa_pages(self, node: TreeNode, npages: int) -> list[int]:
        """The tree's SWA pages of the path ending at ``node`` (``npages`` pages), -1 for a
        tombstone's pages (outside the window of a valid match, never read)."""
        runs: list[list[int]] = []
        ps = self.page_size
        while node.parent is not None:
            v = self.cache.data(node, ComponentType.SWA).value
            runs.append(list(v) if v is not None else [-1] * (len(node.key) // ps))
            node = node.parent
        out = [p for run in reversed(runs) for p in run]
        if len(out) != npages:
            raise RuntimeError(f"the matched path holds {len(out)} SWA pages, {npages} expected")
        return out

    def _take_slot(self, req: Request) -> int | None:
        """One L1 Mamba state slot for ``req`` (evicting a cached state if needed), taken
        from its reservation; past it (further branch snapshots) only out of the room no
        request has reserved. None when none can be had. Only ``req.mamba`` calls it."""
        if self.budget.held(req.rid, MAMBA) == 0 and self.budget.room(MAMBA) <= 0:
            return None
        got = self.budget.take(req.rid, MAMBA, 1)
        return got[0] if got is not None else None

    def _account_hits(self, req: Request, prefix: int) -> None:
        loaded = req.load.tokens if req.load is not None and req.load.ok else 0
        fetched = req.prefetch.arrived_tokens if req.prefetch is not None else 0
        storage = min(fetched, loaded, prefix)
        host = min(loaded - storage, prefix - storage)
        req.cached_storage, req.cached_host = storage, host
        req.cached_device = prefix - storage - host
        c = self.counters
        c.cached_device += req.cached_device
        c.cached_host += req.cached_host
        c.cached_storage += req.cached_storage
        c.prompt_tokens += req.prompt_len

    # ------------------------------------------------------------------ forward
    def _ensure_pages(self, req: Request, upto: int) -> bool:
        assert req.tree is not None
        need = -(-upto // self.page_size) - len(req.tree.kv_pages)
        if need > 0:
            pages = self.budget.take(req.rid, FULL, need)
            if pages is None:
                return False
            req.tree.kv_pages.extend(pages)
        return self._ensure_swa_pages(req, upto)

    def _ensure_swa_pages(self, req: Request, upto: int) -> bool:
        """SWA pages up to ``upto`` tokens (the table covers pages from ``swa_start_page``)."""
        st = req.tree
        if self.swa is None or st is None or st.swa_pages is None:
            return True
        need = -(-upto // self.page_size) - st.swa_start_page - len(st.swa_pages)
        if need <= 0:
            return True
        pages = self.budget.take(req.rid, SWA, need)
        if pages is None:
            return False
        st.swa_pages.extend(pages)
        return True

    def _forward(self) -> None:
        chunk_cap = self.cfg.scheduler.chunked_prefill_tokens
        budget = self.cfg.scheduler.max_prefill_tokens
        batch: list[tuple[Request, ForwardItem]] = []
        for req in list(self.running):
            with self._request_scope(req, "preparing its forward pass"):
                assert req.tree is not None
                if req.prefilling:
                    n = min(req.prompt_len - req.computed, chunk_cap, max(budget, 0))
                    if n <= 0:
                        continue
                    budget -= n
                    tokens = req.input_ids[req.computed : req.computed + n]
                    logits: LogitsMode = "last" if req.computed + n == req.prompt_len else "none"
                else:
                    tokens = array(KEY_TYPECODE, [req.output_ids[-1]])
                    logits = "last"
                if not self._ensure_pages(req, req.computed + len(tokens)):
                    if self.tier is not None and (self.tier.in_flight or self.cache.nodes_to_write_to_host(limit=1)):
                        # Pages held by in-flight transfers, or queued for an L2 write before
                        # eviction (write_back), free up once the controller is done: sit this
                        # pass out rather than fail (the admission reservation covers us then).
                        continue
                    self._finish(req, "error", "L1 is out of pages for this request")
                    continue
                # Mamba snapshots (a snapshot no slot can be had for, reserved but with the
                # evictable state busy, is skipped: that state is then not cached)
                snaps = req.mamba.snapshots(req.computed, req.computed + len(tokens)) if req.mamba else []
                st = req.tree
                batch.append((req, ForwardItem(tokens, req.computed, st.kv_pages, self._swa_table(st),
                                               req.mamba.own if req.mamba else None, snaps, logits)))
        if not batch:
            return
        if self.before_model is not None:
            self.before_model()
        try:
            outputs = list(self.runner.forward([item for _r, item in batch]))
            if len(outputs) != len(batch):
                raise RuntimeError(f"the model runner returned {len(outputs)} outputs for {len(batch)} requests")
        except Exception as exc:
            log.exception("the forward pass over %d requests failed", len(batch))
            for req, item in batch:
                if item.snapshots and req.mamba is not None:
                    # the failed pass may have written the snapshot slots: never hand one over
                    req.mamba.forward_failed()
                self._fail_request(req, exc, "running the forward pass", logged=True)
            return
        self.counters.forward_passes += 1
        for (req, item), out in zip(batch, outputs, strict=True):
            with self._request_scope(req, "caching what its forward pass computed"):
                self._advance(req, item)
            if out is not None and not req.finished:
                with self._request_scope(req, "sampling its next token"):
                    self._append_token(req, out)

    def _advance(self, req: Request, item: ForwardItem) -> None:
        """After a forward pass: ``req`` has computed ``item``; hand the tree what is new.

        - Mamba: the prompt's state once the prefill passed its boundary (with the Full
          pages up to there), so a repeat of the prompt matches it;
        - every prefill chunk's Full pages (``cache_unfinished_req``). The last chunk (the
          one with logits) too for full-attention models, so that a concurrent request
          with the same prompt matches it while this one decodes. Not for hybrid models:
          there a match ends at the prompt's last page boundary before its last token,
          which the prompt-boundary insert already covers (with Mamba's state, with the
          window of SWA pages before it, or both);
        - SWA: the prompt-boundary insert (without mamba layers too), then ``_settle_swa``.
        """
        st = req.tree
        assert st is not None
        prefill = item.start < req.prompt_len
        req.computed = item.end
        if req.mamba is not None:
            req.mamba.computed(list(item.snapshots))
            for pos, slot in req.mamba.pop_branches(req.computed):  # ascending
                self._insert_prompt_state(req, pos, slot)
        elif st.swa_pages is not None and prefill:
            pos = MambaSlots.prompt_boundary(req.prompt_len, self.page_size)
            if item.start < pos <= req.computed:
                self._insert_prompt_state(req, pos, None)
        if prefill and (req.prefilling or not self.hybrid):
            self.cache.cache_unfinished_req(st, committed_len=req.computed)
        if st.swa_pages is not None:
            self._settle_swa(req)

    # ------------------------------------------------------------------ SWA memory
    def _swa_keep_from(self, pos: int) -> int:
        """The first SWA page a request that computed ``pos`` tokens keeps: the window
        before the last page boundary (so the tokens cached at finish end on a valid SWA
        boundary), which holds the window the runner reads for the next token
        (``[pos - window + 1, pos)``). Pages before it are never read again."""
        assert self.swa is not None
        return max(0, pos // self.page_size - -(-self.swa.sliding_window // self.page_size))

    def _swa_table(self, st: RequestState) -> list[int] | tuple[()]:
        """The runner's SWA page table: -1 for the pages released before ``swa_start_page``
        (wholly before the window: never read)."""
        if st.swa_pages is None:
            return ()
        return [-1] * st.swa_start_page + st.swa_pages if st.swa_start_page else st.swa_pages

    def _drop_swa_before(self, req: Request, page: int) -> None:
        """Release ``req``'s SWA table entries before ``page``: its own pages are freed at
        once, the tree's (its match, its prompt boundary's window) are just no longer its
        to read; ``swa_start_page`` advances to ``page``."""
        st = req.tree
        assert self.swa is not None and st is not None and st.swa_pages is not None
        drop = page - st.swa_start_page
        if drop <= 0:
            return
        tree_end = st.swa_prefix_len // self.page_size  # entries before it are the tree's
        first_own = max(0, tree_end - st.swa_start_page)
        own = st.swa_pages[first_own:drop]
        del st.swa_pages[:drop]
        st.swa_start_page = page
        if own:
            self.swa.allocator.free(own)

    def _settle_swa(self, req: Request) -> None:
        """After ``req`` computed more: free its SWA pages that fell out of the window, give
        back the SWA part of its lock once no tree page before its window is read again
        (the matched prefix or its prompt boundary; the Full lock stays), and re-size its
        SWA reservation to what it may still hold at once (``swa_request_pages`` for its
        phase, less the pages it holds and has handed to the tree, at most the pages it has
        still to allocate)."""
        st = req.tree
        assert self.swa is not None and st is not None and st.swa_pages is not None
        ps = self.page_size
        keep = self._swa_keep_from(req.computed)
        self._drop_swa_before(req, keep)
        if st.lock is not None and keep >= st.swa_prefix_len // ps:
            st.lock = self.cache.release_part(st.lock, self.swa.name)
        end = st.swa_start_page + len(st.swa_pages)
        own = end - max(st.swa_start_page, st.swa_prefix_len // ps)
        future = -(-(req.prompt_len + req.params.max_new_tokens) // ps) - end
        step = self.chunk_tokens if req.prefilling else 1
        bound = swa_request_pages(self.swa.sliding_window, step, ps) - max(0, own) - req.swa_handed
        self.budget.resize(req.rid, SWA, max(0, min(future, bound)))

    def _insert_prompt_state(self, req: Request, pos: int, slot: int | None) -> None:
        """Insert the prompt's Mamba state ``slot`` (the state after ``pos`` tokens, a page
        boundary; None for a model without mamba layers) with the Full pages up to there
        (``cache_unfinished_req``).

        With SWA layers too, the insert carries the request's SWA pages from
        ``swa_start_page`` up to ``pos`` (own pages before the window before ``pos`` are
        freed first; they are handed to the tree, and stay charged to the request's SWA
        reservation, ``swa_handed``):
        without them the node would be no valid boundary until the request finishes, and an
        L2 copy made of it meanwhile (write-through) would lack its SWA pages for good, so
        that it could never be loaded back. The tree takes those pages over (keeping them,
        or freeing them where it has the same tokens' pages already), so the request's SWA
        table up to ``pos`` becomes the tree's pages, like its Full pages; they stay valid
        while it runs, as the lock the insert moves to the new node covers the window
        before it (earlier pages are never read again).
        """
        st = req.tree
        assert st is not None
        ps = self.page_size
        aux: dict[str, object] = {} if slot is None else {"mamba": slot}
        with_swa = st.swa_pages is not None and pos > st.prefix_len
        npages, start, handed = pos // ps, 0, 0
        if with_swa:
            self._drop_swa_before(req, self._swa_keep_from(pos))  # the window before pos stays
            assert st.swa_pages is not None
            start = st.swa_start_page
            handed = npages - max(start, st.swa_prefix_len // ps)
            aux["swa"] = PagedInsert(st.swa_pages[: npages - start], start, st.swa_prefix_len)
        if not aux:
            return
        self.cache.cache_unfinished_req(st, committed_len=pos, aux=aux)
        if with_swa:
            if st.prefix_len != pos:
                raise RuntimeError(f"the prompt state's insert ended at {st.prefix_len}, not {pos}")
            assert st.swa_pages is not None and st.last_node is not None
            st.swa_pages[: npages - start] = self._tree_swa_pages(st.last_node, npages)[start:]
            st.swa_prefix_len = pos
            req.swa_handed += max(0, handed)

    def _append_token(self, req: Request, logits: torch.Tensor) -> None:
        params = req.params
        if params.penalized and req.penalties is None:
            req.penalties = PenaltyState(req.input_ids, logits.numel())
        token = sample_next(logits, params, req.seed, len(req.output_ids), req.penalties)
        req.output_ids.append(token)
        if req.penalties is not None:
            req.penalties.add(token)
        if params.logprobs is not None:
            chosen, ids, values = token_logprobs(logits, token, params.logprobs)
            req.logprobs.append(chosen)
            req.top_ids.append(ids)
            req.top_logprobs.append(values)
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        self.counters.generation_tokens += 1
        reason = finish_reason(req.output_ids, params, self.eos_token_ids)
        if reason is not None:
            self._finish(req, reason)
        elif req.stream or req.sent_tokens == 0:  # non-streaming: the first token at once (TTFT)
            self.emit(self._unsent(req))

    @staticmethod
    def _unsent(req: Request, finished: bool = False, reason: str | None = None,
                usage: protos.Usage | None = None, error: str | None = None) -> protos.TokenOutput:
        """The output of the tokens not sent yet (with their logprobs when asked); marks them sent."""
        start = req.sent_tokens
        req.sent_tokens = len(req.output_ids)
        out = protos.TokenOutput(req.rid, req.output_ids[start:], finished, reason, usage, error)
        if req.params.logprobs is not None:
            out.logprobs = req.logprobs[start:]
            out.top_ids = req.top_ids[start:]
            out.top_logprobs = req.top_logprobs[start:]
        return out

    # ------------------------------------------------------------------ finishing
    def _hand_over_state(self, req: Request) -> None:
        """Before ``cache_finished_req``: the tree's ``mamba_slot`` becomes the boundary
        snapshot when that holds the state after the last full page of the computed tokens
        (the key the tree inserts), else None; ``req.mamba`` frees the request's own slot
        and every other snapshot."""
        st = req.tree
        assert st is not None
        slots, req.mamba = req.mamba, None
        st.mamba_slot = slots.hand_over(req.computed) if slots is not None else None

    @contextmanager
    def _request_scope(self, req: Request, during: str) -> Iterator[None]:
        """Run a piece of ``req``'s own work: an exception in it fails ``req`` alone
        (``_fail_request``) and goes no further; the caller carries on with the others."""
        try:
            yield
        except Exception as exc:
            self._fail_request(req, exc, during)

    def _fail_request(self, req: Request, exc: BaseException, during: str, *, logged: bool = False) -> None:
        """The one place an exception while serving ``req`` becomes a failed request.

        ``req`` is finished with reason ``error`` and the message ``internal error while
        <during>: <exception>``, which its client receives; everything it holds goes back to
        the tree or the allocators (``_finish``, as for an abort), so nothing leaks. A
        request whose final output already went out is left as it is. Should giving back
        fail as well (now, or in the ``_finish`` the exception came from), the request is
        still forgotten and answered, so that it cannot fail every step again; what it held
        is then lost, and that is logged.
        """
        if not logged:
            log.error("request %s failed while %s", req.rid, during, exc_info=exc)
        if req.finished:
            return
        error = _internal_error(during, exc)
        if self.by_rid.get(req.rid) is req:  # else a ``_finish`` of it was under way and failed
            try:
                self._finish(req, "error", error)
                return
            except Exception:
                log.exception("request %s: giving back what it held failed", req.rid)
        log.error("request %s is dropped; what it held may be lost", req.rid)
        self.budget.release(req.rid)  # its reservation is only a number: that is never lost
        self.by_rid.pop(req.rid, None)
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        req.tree = None
        req.finished = True
        self.emit(protos.TokenOutput(req.rid, [], True, "error", protos.Usage(req.prompt_len), error))

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Give back everything ``req`` holds and send its final output."""
        self.by_rid.pop(req.rid, None)
        self._match_len.pop(req.rid, None)
        self._match_node.pop(req.rid, None)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.prefetch is not None and not req.prefetch.complete and self.tier is not None:
            self.tier.cancel_prefetch(req.prefetch)
        self._release_hold(req)
        self.budget.release(req.rid)
        if req.tree is not None:
            req.tree.token_ids = req.all_tokens()
            if self.mamba is not None:
                self._hand_over_state(req)
            self.cache.cache_finished_req(req.tree, committed_len=req.computed)
            req.tree = None
        if reason == "error":
            self.counters.requests_error += 1
        elif reason != "abort":
            self.counters.requests_ok += 1
        usage = protos.Usage(req.prompt_len, len(req.output_ids), req.cached_device, req.cached_host,
                             req.cached_storage, *self._timings_ms(req))
        req.finished = True
        self.emit(self._unsent(req, True, reason, usage, error))
