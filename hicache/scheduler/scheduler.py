"""The scheduler's core: admission, continuous batching and the cache, without any sockets.

``Scheduler`` is fed messages (``submit``, ``abort``, ``admin``, ``on_controller``) and
advanced by ``step``; it answers through the ``emit`` callable (to the tokenizer) and talks
to the cache controller through the ``ControllerDriver`` and ``controller_send``. The process
module (``hicache.scheduler.process``) wires those to ZeroMQ; tests call them directly.

It is one object per phase around one ``SchedulerState`` (the table in
``hicache.scheduler.state``). One step:

1. start the L2 writes the write policy asks for;
2. admission (``hicache.scheduler.admission``): walk the waiting queue in
   ``scheduler.policy`` order, start L3 prefetches and L2 load-backs, admit what fits;
3. the forward pass (``hicache.scheduler.forward_pass``): one model call over every
   running request, its pages cached, its tokens sampled and sent;
4. finishing (``hicache.scheduler.finishing``): ``cache_finished_req`` gives a finished
   request's pages to the tree, which frees duplicates; the lock is released.

What a hybrid model's requests hold besides Full pages (SWA windows, Mamba state slots) is
the business of ``hicache.scheduler.aux_memory``, which the phases call at fixed points; it
calls one hooks object per auxiliary component (``hicache.scheduler.component_hooks``).

Fault isolation (``hicache.scheduler.finishing``): an exception while serving one request
fails that request alone; one in the batched forward pass fails the requests of that batch.
An unexpected exception while checking a submitted request answers it with an error too.
Only the exceptions of the scheduler's own bookkeeping outside any one request (tier writes,
the integrity check) still propagate.

Page accounting: ``budget`` (``L1Budget``, ``hicache.scheduler.budget``) is the one place
that holds and changes reservation numbers. At admission a request reserves every L1 unit
it may still need; its allocations go through ``budget.take`` (which evicts when the
allocator is short and lowers the reservation), and finishing or undoing an admission
releases what is left. Whatever a finished or aborted request holds goes back to the tree
or the allocator in ``cache_finished_req``: nothing leaks. ``check_idle`` proves both
whenever the scheduler is idle: the tree's ``check_integrity`` and the budget's
``check_idle`` (each total equals the sum over requests, and nothing is reserved).

Models: Full attention, optionally with SWA layers, Mamba layers or both (``("full",)``,
``("full", "swa")``, ``("full", "mamba")``, ``("full", "swa", "mamba")``: the cache's
components, in that order); a pattern without a full layer is refused at construction
with the reason. SWA pages and Mamba states move to and from L2 with their nodes' Full
pages when the tree has L2 allocators for them (``cache.l2.state_slots: 0`` keeps Mamba
L1-only); L3 backups and prefetches carry them too, so a prefix prefetched from L3 is a
valid hybrid match up to the last boundary whose SWA window and Mamba state L3 (or L1 / L2)
still holds.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable
from typing import Any

import protos
from hicache.config import HicacheConfig
from hicache.memory.allocator import PageAllocator
from hicache.model.loader import LoadedModel
from hicache.model.runner import ModelRunner
from hicache.model.sampling_params import from_wire, resolve_seed
from hicache.scheduler.admission import Admission
from hicache.scheduler.aux_memory import AuxMemory
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.scheduler.finishing import Finisher, internal_error
from hicache.scheduler.forward_pass import ForwardPass
from hicache.scheduler.pins import PinnedPrefixes, pin_budgets
from hicache.scheduler.request import LOADING, Request
from hicache.scheduler.state import SchedulerCounters, SchedulerState
from hicache.tenants import tenant_of_salt
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.node import KEY_TYPECODE

log = logging.getLogger("hicache.scheduler")


LOAD_JOIN_WAIT_FRACTION = 0.1
"""At most this fraction of a forward pass is spent waiting for load-backs to join it."""
LOAD_JOIN_WAIT_MAX_S = 0.02
"""And never more than this (a GPU step is short; a slow ack is not worth a long stall)."""




class RequestRejected(ValueError):
    """A request that cannot be served as given (answered with finish_reason ``error``)."""


class Scheduler:
    """The phases around one ``SchedulerState``; the attributes below are the state's own
    objects (the same lists and maps), for the process loop, telemetry and tests."""

    def __init__(
        self,
        cfg: HicacheConfig,
        model: LoadedModel,
        runner: ModelRunner,
        cache: UnifiedRadixCache,
        l1: PageAllocator,
        emit: Callable[[protos.TokenizerMessage], None],
        *,
        tier: ControllerDriver | None = None,
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
        state = self.state = SchedulerState(cfg, cache, l1, self._route_output, tier, clock)
        self.cfg, self.model, self.runner, self.cache, self.l1 = cfg, model, runner, cache, l1
        self.emit, self.tier, self.controller_send = emit, tier, controller_send
        self.page_size = state.page_size
        self.vocab_size = model.spec.vocab_size
        self.max_context = model.spec.max_context
        self.waiting: list[Request] = state.waiting
        self.running: list[Request] = state.running
        self.by_rid: dict[str, Request] = state.by_rid
        self.counters: SchedulerCounters = state.counters
        self.budget = state.budget
        self.swa, self.mamba = state.swa, state.mamba
        self.aux = AuxMemory(state)
        self.finisher = Finisher(state, self.aux)
        self.admission = Admission(state, self.aux, self.finisher)
        self.forward_pass = ForwardPass(state, runner, self.aux, self.finisher, eos_token_ids)
        self.forward_s_ewma = 0.0  # recent forward-pass duration (s), for load_join_wait_s
        self.stalled_since: float | None = None
        """Since when requests have waited with no forward pass computing for any of them
        (None: the last step computed, or nothing waits); the loop writes it next to its
        heartbeat, where ``/health`` and ``/metrics`` read it (``hicache.runtime.heartbeat``)."""
        self._admin_waiting: dict[int, tuple[str, str]] = {}  # storage op id -> (rid, op)
        self.storage_status_seen: Callable[[str | None, protos.StorageStatus], None] | None = None
        """Told of each ``StorageStatus`` and the admin op it answers (None: unprompted)."""
        self._admin_ids = iter(range(1, 2**62))
        self.pins = PinnedPrefixes(state, self.submit, emit, cfg.cache.pinned_fraction, pin_budgets(cfg))
        if tier is not None:  # a write locks its node's path in L1 while it copies
            tier.write_gate = lambda node: self.budget.fits(cache.tiers.write_cost(node))

    def _route_output(self, msg: protos.TokenizerMessage) -> None:
        """What the phases emit: a pinned prefix's internal request's outputs go to ``pins``,
        everything else to the tokenizer."""
        if isinstance(msg, protos.TokenOutput) and self.pins.owns(msg.rid):
            self.pins.on_output(msg)
        else:
            self.emit(msg)

    @property
    def clock(self) -> Callable[[], float]:
        """The time source of every phase (``SchedulerState.clock``; tests set a fake one)."""
        return self.state.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.state.clock = clock

    @property
    def before_model(self) -> Callable[[], None] | None:
        """Called right before each model call (``ForwardPass.before_model``)."""
        return self.forward_pass.before_model

    @before_model.setter
    def before_model(self, hook: Callable[[], None] | None) -> None:
        self.forward_pass.before_model = hook

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
                error = internal_error("checking the request", exc)
            self.counters.requests_error += 1
            self._route_output(protos.TokenOutput(msg.rid, [], True, "error", protos.Usage(len(msg.input_ids)), error))
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
        pinned = self.pins.l1_pages
        if need > self.l1.capacity - pinned:
            held = f" ({pinned} of them held by pinned prefixes)" if pinned else ""
            raise RequestRejected(f"the request needs {need} L1 pages; L1 holds {self.l1.capacity}{held}")
        problem = self.aux.refusal(need)
        if problem is not None:
            raise RequestRejected(problem)
        return Request(msg.rid, array(KEY_TYPECODE, msg.input_ids), params, resolve_seed(params), msg.stream,
                       msg.cache_salt, arrival=self.clock())

    def abort(self, rid: str) -> None:
        req = self.by_rid.get(rid)
        if req is None:
            return
        self.counters.requests_aborted += 1
        with self.finisher.request_scope(req, "aborting the request"):
            self.finisher.finish(req, "abort")

    # ------------------------------------------------------------------ admin
    def admin(self, msg: protos.AdminRequest) -> None:
        """An admin op. ``args["tenant"]`` marks a tenant's own call (the tokenizer sets it
        from the caller's key, docs/operations.md "Security"): ``flush``, ``stats`` and the pin ops act
        on that tenant's namespaces and pins only, and storage ops are refused (the
        operator's alone)."""
        op = msg.op
        tenant = msg.args.get("tenant")
        try:
            if op == "flush":
                before = self.cache.total_size()
                self.cache.flush(None if tenant is None else (lambda node: tenant_of_salt(node.root.salt or "") == tenant))
                self.emit(protos.AdminReply(msg.rid, True, {"flushed_tokens": before - self.cache.total_size()}))
            elif op == "stats":
                self.emit(protos.AdminReply(msg.rid, True, self.stats() if tenant is None else self.tenant_stats(tenant)))
            elif op in ("storage_status", "storage_attach", "storage_detach", "storage_clear"):
                if tenant is not None:
                    self.emit(protos.AdminReply(msg.rid, False, {"refused": True}, "storage ops are the operator's"))
                    return
                self._storage_admin(msg)
            elif op == "pin":
                self.pins.pin(msg.rid, msg.args)
            elif op == "unpin":
                self.pins.unpin(msg.rid, msg.args)
            elif op == "pins":
                self.emit(protos.AdminReply(msg.rid, True, self.pins.listing(tenant)))
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
        self._admin_waiting[op_id] = (msg.rid, op)
        self.controller_send(protos.StorageAdmin(op_id, op, msg.args))

    def on_controller(self, msg: protos.Message) -> None:
        """An answer from the cache controller."""
        if isinstance(msg, protos.StorageStatus):
            if self.tier is not None:
                self.tier.l3_enabled = msg.backend != "none"
            waiting = self._admin_waiting.pop(msg.op_id, None)
            if self.storage_status_seen is not None:
                self.storage_status_seen(None if waiting is None else waiting[1], msg)
            if waiting is not None:
                rid = waiting[0]
                result = {"backend": msg.backend, "up": msg.up, "stats": msg.stats}
                self.emit(protos.AdminReply(rid, msg.error is None, result, msg.error))
            return
        if self.tier is not None:
            loaded = self.tier.on_message(msg)
            if loaded is not None:
                self.admission.load_finished(loaded)

    def stats(self) -> dict[str, Any]:
        ps = self.page_size
        out: dict[str, Any] = {
            "l1": {"full": {"used_tokens": self.l1.used * ps, "capacity_tokens": self.l1.capacity * ps,
                            "cached_tokens": self.cache.total_size()}},
            "requests": {"running": len(self.running), "waiting": len(self.waiting)},
            "hit_tokens": {"device": self.counters.cached_device, "host": self.counters.cached_host,
                           "storage": self.counters.cached_storage},
            "integrity_checks": self.counters.integrity_checks,
            "pinned": self.pins.listing()["tiers"],
        }
        for c in self.cache.aux:  # paged components count tokens, the others state slots
            a, cached = c.allocator, self.cache.total_size(c.name)
            if c.paged:
                out["l1"][c.name] = {"used_tokens": a.used * ps, "capacity_tokens": a.capacity * ps,
                                     "cached_tokens": cached}
            else:
                out["l1"][c.name] = {"used_slots": a.used, "capacity_slots": a.capacity, "cached_states": cached}
        host = self.cache.full.host_allocator
        if host is not None:
            out["l2"] = {"full": {"used_tokens": host.used * ps, "capacity_tokens": host.capacity * ps}}
            for c in self.cache.aux:
                h = c.host_allocator
                if h is not None:
                    unit = ps if c.paged else 1
                    key = "tokens" if c.paged else "slots"
                    out["l2"][c.name] = {f"used_{key}": h.used * unit, f"capacity_{key}": h.capacity * unit}
        quotas = self.cache.tiers.quotas
        if quotas is not None:
            out["tenants"] = {t: {"l2_used_tokens": used * ps, "l2_quota_tokens": None if q is None else q * ps}
                              for t, (used, q) in quotas.usage().items()}
        if self.tier is not None:
            out["tiers"] = {**vars(self.tier.counters), "in_flight": self.tier.in_flight,
                            "writes_due": len(self.cache.tiers.nodes_to_write_to_host())}
        return out

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        """``GET /cache/stats`` of a tenant: its own use only (its L2 pages and quota, its
        pins), nothing of the daemon's totals or of other tenants."""
        ps = self.page_size
        host = sum(n for root, n in self.cache.core.host_by_root.items() if tenant_of_salt(root.salt or "") == tenant)
        quota = next((k.quota.l2_tokens for k in self.cfg.server.api_keys
                      if k.tenant == tenant and k.quota is not None and k.quota.l2_tokens), None)
        return {"tenant": tenant, "l2": {"used_tokens": host * ps, "quota_tokens": quota},
                "pinned": self.pins.listing(tenant)["tiers"]}

    # ------------------------------------------------------------------ the step
    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> bool:
        """One scheduling pass and at most one forward pass; True if a forward ran."""
        self.schedule()
        return self.forward()

    def schedule(self) -> None:
        """Advance the pinned prefixes, start the writes the write policy asks for, then
        admit what can be admitted."""
        self.pins.poll()
        if self.tier is not None:
            self.tier.issue_writes()
        self.admission.run()

    def forward(self) -> bool:
        """One forward pass over the running requests; True if one ran."""
        passes = self.counters.forward_passes
        try:
            if not self.running:
                return False
            t0 = time.perf_counter()
            self.forward_pass.run()
            took = time.perf_counter() - t0
            self.forward_s_ewma = took if self.forward_s_ewma == 0.0 else 0.8 * self.forward_s_ewma + 0.2 * took
            return True
        finally:
            self._note_progress(self.counters.forward_passes != passes)

    def _note_progress(self, computed: bool) -> None:
        """``stalled_since``: set when requests are queued or running and a step computed
        nothing for any of them, cleared by a step that did or when none is left."""
        if computed or not self.busy:
            self.stalled_since = None
        elif self.stalled_since is None:
            self.stalled_since = self.clock()

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
        """The integrity checks, run by the loop when nothing is running or in flight: one
        bounded slice of the tree's (``check_integrity_slice``) and the L1 budget's (totals equal the sums over
        requests, and nothing is reserved)."""
        if not self.busy and (self.tier is None or not self.tier.in_flight):
            whole = self.cache.check_integrity_slice()
            self.budget.check_idle()
            if whole:  # a round of the tree's check ended here
                self.counters.integrity_checks += 1
