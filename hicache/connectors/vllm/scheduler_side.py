"""The scheduler side of ``HiCacheConnector`` (vLLM's engine core; one per engine, planning for every rank).

It holds the engine's session with the daemon (``CacheSession``: registered with the
engine's runtime identity, re-registered by its heartbeat thread whenever none is open) and
one ``Tracked`` per request vLLM asked about. Per step:

==================================  =======================================================
vLLM calls                          this side
==================================  =======================================================
``get_num_new_matched_tokens``      looks up the prompt's pages beyond vLLM's own hit
                                    (``Lookup``) and holds the answer (``Hit``); *pending*
                                    (the daemon never waits for L3 to answer; its prefetch
                                    policy bounds the wait): None, ask again later
``update_state_after_alloc``        turns the held hit into a ``LoadPlan``
``get_external_cache_hit_sources``  L2 hits as ``host``, the hit's tail that a prefetch
                                    brought from L3 as ``disk``
``build_connector_meta``            one ``Reserve`` for every block that becomes full in
                                    the step and that the daemon lacks; the step's plans
``update_connector_output``         learns failed loads: their blocks, and what is computed
                                    on them, stay out of every save until computed again
                                    (``StaleBlocks``); a failed asynchronous load closes
                                    its request's lookups
``request_finished``                ``Finished``: the daemon forgets the request; never
                                    delays freeing (saves complete inside their step)
``reset_cache``                     a new reset generation, so a new namespace, registered
                                    at once; requests that began before it save nothing more
==================================  =======================================================

Who frees what:

=======================  ===================================================================
held                     freed by
=======================  ===================================================================
a hit's lease            this side (``_release``, ``ALL_RANKS``) when vLLM's own hit covers
                         it, it is old or of another session, the request finished or the
                         cache was reset; once it is a ``LoadPlan``, each worker's ``Release``
a reservation's lease    each worker's ``Commit`` once it is a ``SavePlan``; else this side's
                         ``Commit`` not ok (the plan does not fit the request's blocks, or
                         the daemon answered more reservations than asked for)
a late answer's lease    ``CacheSession`` (its client's ``drain``, each ``build_connector_meta``)
=======================  ===================================================================

A request's tokens travel once: each message names the tokens the daemon holds for it
(``base``) and sends only those after them (``PackedTokens``), so a block filled during
decode costs the same at any context length. Requests whose KV depends on more than their
tokens are neither looked up nor saved. A daemon that serves another model or KV geometry
refuses the registration: the engine is refused at start. A daemon absent or slow costs
hits, never correctness (a call waits at most ``engine.lookup_timeout_ms``, then is a miss
and the client backs off); one answering ``protos.BUSY`` costs that lookup or that step's
saves, with no backoff. docs/architecture.md §13.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import protos
from hicache.cache_server.geometry import namespace_of
from hicache.cache_server.leases import own_pid_namespace, process_start_time
from hicache.connectors.engine_client import (
    CacheSession,
    EngineAnswer,
    EngineCall,
    RegistrationRefused,
    SessionAnswer,
    engine_name,
)
from hicache.connectors.kv_copy import PoolRef
from hicache.connectors.runtime_identity import runtime_identity
from hicache.connectors.stale_blocks import StaleBlocks, StepWrite
from hicache.connectors.vllm.events import EventRelay
from hicache.connectors.vllm.layout import ConnectorRefused
from hicache.connectors.vllm.plans import (
    HiCacheConnectorMetadata,
    HiCacheWorkerMeta,
    Hit,
    LoadPlan,
    load_plan,
    save_plan,
)
from hicache.connectors.vllm.settings import ConnectorSettings
from hicache.connectors.vllm.stats import HiCacheStats
from hicache.connectors.vllm.tracked import StepRange, Tracked, follow_step, fresh_blocks, take_state_offers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("hicache.connector")

PENDING_RETRY_S = 0.002
MAX_PENDING_RETRY_S = 0.032
"""While the daemon prefetches a waiting request's pages from L3, the connector asks again
after this long, doubling up to the maximum (vLLM's scheduler calls every step: in between
it answers "not yet" without a round trip)."""

HELD_HIT_MAX_AGE_S = 1.0
"""vLLM asks again about a waiting request it could not allocate blocks for (its KV space is
full) on every step. While the hit it was answered still holds its lease (no rank was given
it yet) and is younger than this, it is the answer again, without a round trip; an older one
is given back and the daemon asked anew (it may hold more of the prompt by then)."""

UNANSWERED_PENDING_WAIT_S = 2.0
"""A request whose lookup was answered *pending* (the daemon is fetching its pages from L3)
keeps waiting when a later ask gets no answer in time (a daemon loop slowed for a moment, or
the client's backoff after one such timeout): it becomes a miss only once this long has
passed since its first pending answer. A slow answer then costs a short wait, not the hit."""

BUSY_LOG_EVERY_S = 10.0
"""The shortest time between two log lines about ``busy`` answers."""


class SchedulerSide:
    """The scheduler role's state and calls (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, stats: HiCacheStats) -> None:
        self.config = settings.config
        self.layout = settings.layout
        self.geometry = settings.layout.geometry
        self.faults = settings.faults
        self.runtime = settings.runtime
        self.address = settings.address
        self.stats = stats
        self.loads, self.saves = settings.loads, settings.saves  # the engine's kv_role
        self.copy_async = settings.copy_mode != "sync"  # saves on the worker's copy thread
        # a hit's request waits for its own load (hicache_copy: layer loads in the request's step)
        self.load_async = settings.copy_mode == "async" or self.layout.load_async
        self._busy_count = 0  # busy answers since the last log line about them
        self._busy_logged_at = -BUSY_LOG_EVERY_S
        self.reset_generation = ""
        self._late_seen = 0
        timeout = settings.timeout_ms
        self.session = CacheSession(self.address, timeout, self._register_msg(), curve=settings.curve)
        self._requests: dict[str, Tracked] = {}
        self._step = 0  # the last step numbered (HiCacheConnectorMetadata.step)
        self._failures_learned: set[int] = set()  # failed steps learned since the last step's metadata
        self._stale = StaleBlocks(self.layout.block_size)  # blocks a failed load left without their KV
        self._loads: list[LoadPlan] = []
        self.events = EventRelay.follow(vllm_config, self.config, self._namespace())
        try:
            if self.session.ensure(timeout_ms=max(timeout, 2000)) is None:
                log.warning("hicache: the daemon at %s is not answering; serving without it until it does",
                            self.address)
        except RegistrationRefused as exc:
            raise ConnectorRefused(f"the hicache daemon at {self.address} refused this engine: {exc}") from exc
        self.session.start()  # from now on the heartbeat thread registers whenever no session is open

    def _namespace(self) -> str:
        return namespace_of(runtime_identity(self.runtime, self.reset_generation))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The daemon's L2 and L3 events for this engine's pages since the last call, as
        vLLM's events (``events``); never raises."""
        return self.events.take(self._registered) if self.events is not None else ()

    def _register_msg(self) -> protos.EngineRegister:
        g = self.geometry
        return protos.EngineRegister(
            req=0, engine=engine_name(), pid=os.getpid(), geometry=g, page_bytes=g.page_bytes,
            runtime_identity=runtime_identity(self.runtime, self.reset_generation),
            pid_namespace=own_pid_namespace(), start_time=process_start_time(os.getpid()) or 0, tensor_parallel=self.layout.tp,
            window_tokens=self.layout.window_tokens)

    @property
    def _registered(self) -> protos.EngineRegistered | None:
        """The open registration, or None."""
        return self.session.registered

    def reset_cache(self, kept: int) -> bool:
        """vLLM's cache reset (after a weight update, say): a new namespace for this engine's
        pages, so nothing saved before is ever served after, and no request that began
        before saves again. True: done (the daemon needs not answer).

        vLLM calls this even when its own reset failed (a request still holds blocks, which
        vLLM keeps, hashes and all; ``kept``: how many, counted by the connector from vLLM's
        block pools): then nothing changes here either and the answer is
        False, since requests of the new weights would compute on those blocks and save
        into the new namespace. vLLM's own ``reset_prefix_cache()`` without
        ``reset_connector=True`` does not call this: the engine keeps its namespace.

        The new identity registers here, on the engine's thread (one round trip; at most
        ``engine.lookup_timeout_ms`` when the daemon does not answer, then the heartbeat
        thread goes on trying): left to the heartbeat thread, a request arriving right after
        the reset could run its whole prefill before a session was open again, and a step
        without a session plans no save, so its prompt was never saved."""
        if kept:
            log.warning("hicache: cache reset refused: vLLM keeps %d blocks (its own reset failed); the engine "
                        "keeps its namespace", kept)
            return False
        self.reset_generation = secrets.token_hex(16)
        self.session.reregister(self._register_msg())
        try:
            if self.session.ensure() is None:
                log.warning("hicache: cache reset: the daemon is not answering; the new namespace registers "
                            "when it does")
        except RegistrationRefused as exc:  # the heartbeat thread meets it again; the next call raises it
            log.error("hicache: cache reset: the daemon refused this engine's new identity: %s", exc)
        if self.events is not None:  # the old namespace's pages are no longer this engine's
            self.events.change_namespace(self._namespace())
        for tracked in self._requests.values():
            self._release(tracked.hit)
            tracked.hit = None
            tracked.saves_closed = True
        log.info("hicache: cache reset: this engine's pages have a new namespace")
        return True

    def _call(self, make: Callable[[int, protos.EngineRegistered], EngineCall],
              timeout_ms: int | None = None) -> SessionAnswer:
        """A request within the session, with the registration it was asked under (see
        ``CacheSession.call_under``); never waits for a registration (the heartbeat thread
        registers while none is open, and again ``engine_client.REFUSED_RETRY_S`` after a refusal)."""
        try:
            return self.session.call_under(make, timeout_ms)
        except RegistrationRefused as exc:  # the daemon (restarted) serves other pages than this engine's
            log.error("hicache: the daemon refused this engine (%s); serving without hicache", exc)
            return SessionAnswer(None, None)

    def _busy(self) -> None:
        """The daemon answered a lookup or reserve ``protos.BUSY`` (its queue for this engine
        was full): that request goes on without the cache (no hit; nothing saved in that step).
        Counted (``busy_answers``) and logged at most every ``BUSY_LOG_EVERY_S``."""
        self.stats.add("busy_answers")
        self._busy_count += 1
        now = time.monotonic()
        if now >= self._busy_logged_at + BUSY_LOG_EVERY_S:
            log.warning("hicache: the daemon answered busy %d times since the last such line; those requests "
                        "went on without the cache", self._busy_count)
            self._busy_logged_at, self._busy_count = now, 0

    def _release(self, hit: Hit | None) -> None:
        """Give back a hit no rank was given (not planned for loading)."""
        if hit is None or not hit.lease:
            return
        self.session.send(protos.Release(hit.session, hit.run, hit.lease, 0, protos.ALL_RANKS))

    @staticmethod
    def _cacheable(request: Request) -> bool:
        """Whether a request's KV is a function of its token ids (and salt) alone: not with
        multimodal inputs, prompt embeddings or a LoRA adapter, whose KV depends on more
        than the tokens; such requests are neither looked up nor saved."""
        return (not request.mm_features and getattr(request, "prompt_embeds", None) is None
                and request.lora_request is None)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._cacheable(request):
            return 0, False
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            tracked = self._requests[rid] = Tracked(request)
        held, tracked.hit = tracked.hit, None  # asked again before vLLM allocated its blocks
        bs = self.layout.block_size
        tokens = request.prompt_token_ids or []
        usable = (len(tokens) - 1) // bs * bs  # vLLM computes at least the last prompt token
        # vLLM's own hit ends inside a block (a prefix match unit below the block): with state
        # layers a daemon hit could not be loaded from there (a state is kept at page ends only),
        # so it is not asked for: vLLM keeps its own hit and computes the rest
        inside = bool(self.layout.state_layer_names and num_computed_tokens % bs)
        if tracked.lookups_closed or usable <= num_computed_tokens or inside or not self.loads:
            self._release(held)
            return 0, False
        now = time.monotonic()
        if held is not None:
            reg = self._registered
            if (reg is not None and (reg.session, reg.run) == (held.session, held.run)
                    and now - held.answered_at < HELD_HIT_MAX_AGE_S):
                return self._held_answer(tracked, held, num_computed_tokens)
            self._release(held)
        if now < tracked.retry_at:  # its prefetch from L3 runs: not yet, without asking
            return None, False
        self.stats.add("lookups")
        slow = tracked.pending_since > 0 and self.faults.take_slow_pending_ask()
        answer, reg = self._lookup(tracked, tokens, usable, num_computed_tokens // bs, timeout_ms=0 if slow else None)
        if answer is None and tracked.pending_since and now - tracked.pending_since < UNANSWERED_PENDING_WAIT_S:
            self.stats.add("lookups_unanswered_pending")  # its prefetch ran a moment ago: wait, ask again
            tracked.retry_at = now + MAX_PENDING_RETRY_S
            return None, False
        if not isinstance(answer, protos.LookupResult):
            self.stats.add("lookup_misses")
            if isinstance(answer, protos.EngineError) and answer.code == protos.BUSY:
                self._busy()
            elif isinstance(answer, protos.EngineError):
                log.warning("hicache lookup refused: %s", answer.reason)
            return 0, False
        if answer.pending:
            self.stats.add("lookups_pending")
            tracked.pending_wait = min(max(tracked.pending_wait * 2, PENDING_RETRY_S), MAX_PENDING_RETRY_S)
            tracked.retry_at = now + tracked.pending_wait
            tracked.pending_since = tracked.pending_since or now
            return None, False
        tracked.pending_wait = tracked.retry_at = tracked.pending_since = 0.0
        assert reg is not None  # an answer comes with the registration it was asked under
        hit = Hit(reg.session, reg.run, answer.lease, list(answer.host_pages), answer.storage_pages,
                   num_computed_tokens // bs, list(answer.window_pages), answer.state_slot, now)
        tracked.saved_pages = max(tracked.saved_pages, len(hit.pages))
        return self._held_answer(tracked, hit, num_computed_tokens)

    def _held_answer(self, tracked: Tracked, hit: Hit, num_computed_tokens: int) -> tuple[int, bool]:
        """``hit`` (its lease held) as the answer beyond vLLM's own hit of ``num_computed_tokens``
        tokens, kept for ``update_state_after_alloc``; given back when it adds nothing."""
        external = len(hit.pages) * self.layout.block_size - num_computed_tokens
        if external <= 0:
            self._release(hit)
            return 0, False
        hit.first_page = num_computed_tokens // self.layout.block_size
        tracked.hit = hit
        return external, self.load_async

    def _lookup(self, tracked: Tracked, tokens: list[int], usable: int, local_pages: int,
                timeout_ms: int | None = None) -> tuple[EngineAnswer | None, protos.EngineRegistered | None]:
        """Ask about the request's first ``usable`` prompt tokens, sending only those the
        daemon does not hold for it yet (all of them again if it forgot them); the answer and
        the registration it was asked under (its lease is of that session and run).
        ``local_pages``: the blocks vLLM's own prefix cache holds (the daemon does not wait
        for a save in flight of those). ``timeout_ms``: the wait for the answer (None:
        ``engine.lookup_timeout_ms``)."""
        rid = tracked.request.request_id
        salt = tracked.request.cache_salt or ""
        base = min(tracked.known_tokens, usable)
        tracked.packed.extend(tokens, len(tokens))  # the prompt, once (vLLM only appends to it)
        new = tracked.packed.span(base, usable)
        got = self._call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, rid, new, salt, True, base,
                                                        local_pages), timeout_ms)
        if isinstance(got.answer, protos.EngineError) and got.answer.code == "unknown_request" and base:
            whole = tracked.packed.span(0, usable)
            got = self._call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, rid, whole, salt,
                                                            local_pages=local_pages), timeout_ms)
        if isinstance(got.answer, protos.LookupResult):
            tracked.known_tokens = usable
        elif isinstance(got.answer, protos.EngineError) and got.answer.code != protos.BUSY:
            tracked.known_tokens = 0  # not known to hold them: the next ask sends them all
        return got.answer, got.registered

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        hit, tracked.hit = tracked.hit, None
        if hit is None:
            return
        n = num_external_tokens // self.layout.block_size
        if n <= 0:
            self._release(hit)
            return
        plan = load_plan(self.layout, request.request_id, hit, tracked.block_ids, n)
        self._loads.append(plan)
        first, pages = hit.first_page, plan.pages
        tracked.loaded_tokens = len(pages) * self.layout.block_size
        # the pages from L3 are the hit's tail: [len - storage_pages, len); count the loaded ones
        storage_start = len(hit.pages) - hit.storage_pages
        from_storage = max(0, first + len(pages) - max(first, storage_start))
        tracked.loaded_storage_tokens = from_storage * self.layout.block_size
        self.stats.add("hit_tokens_host", tracked.loaded_tokens - tracked.loaded_storage_tokens)
        self.stats.add("hit_tokens_disk", tracked.loaded_storage_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        """A request whose asynchronous load failed is recomputed by vLLM from its first
        token; it is not looked up again (the same pages could fail again). Blocks whose
        synchronous load failed (``invalid_block_ids``: vLLM keeps them cached under the
        recompute policy) are stale until computed again (``StaleBlocks``): no save copies
        them, nor what was computed on top of them, and a request that held them saves its
        pages again from there once they are good. The workers' failed steps are passed on
        with the next step's metadata: the workers save again once every save planned
        after them knows of the stale blocks."""
        for rid in connector_output.failed_recving or ():
            tracked = self._requests.get(rid)
            if tracked is not None:
                tracked.lookups_closed = True
        invalid = connector_output.invalid_block_ids
        if invalid:
            g = self.layout.kv_groups[0]  # a synchronous load has one KV cache group
            held = [t for t in self._requests.values() if t.block_ids]
            firsts = self._stale.mark_failed(invalid, [t.block_ids[g] for t in held])
            for tracked, first in zip(held, firsts, strict=True):
                tracked.saved_pages = min(tracked.saved_pages, first)
        worker = connector_output.kv_connector_worker_meta
        if isinstance(worker, HiCacheWorkerMeta):
            self._failures_learned |= worker.failed_steps

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0:
            return {}
        tracked = self._requests.get(request.request_id)
        disk = min(num_external_tokens, tracked.loaded_storage_tokens) if tracked is not None else 0
        out = {CacheHitSource.HOST: num_external_tokens - disk, CacheHitSource.DISK: disk}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiCacheConnectorMetadata:
        self._step += 1
        meta = HiCacheConnectorMetadata(self._step, frozenset(self._failures_learned))
        self._failures_learned = set()
        meta.loads, self._loads = self._loads, []
        self.session.client.drain()  # late answers: their leases are given back now
        # the block tables, state offers and stale blocks follow every step, with or without a
        # session: a step missed would shift later blocks against their pages
        ranges = follow_step(self._requests, scheduler_output)
        offered = take_state_offers(self._requests, self.layout, scheduler_output) if self.layout.state_layer_names else []
        if self._stale:  # the step's writes first: its saves copy what its forward pass leaves
            g = self.layout.kv_groups[0]
            self._stale.step([StepWrite(r.tracked.block_ids[g] if r.tracked.block_ids else [], r.computed_before,
                                        r.computed_after) for r in ranges])
        if self.copy_async:
            meta.fresh_blocks = fresh_blocks(scheduler_output)
        if self.saves and self.session.registered is not None:
            self._plan_saves(ranges, meta)
        for tracked in offered:  # an offer holds for this step only (its block's bytes change after it)
            tracked.state_offers = {}
        reg = self.session.registered  # after the reserves, which may have registered again
        if reg is not None:
            meta.run = reg.run
            p = reg.pool
            meta.pool = PoolRef(p.instance, p.segment, p.directory, p.pages, p.page_bytes)
            if p.window_segment:
                meta.window_pool = PoolRef(p.instance, p.window_segment, p.directory, p.window_pages,
                                           p.window_page_bytes)
            if p.state_segment:
                meta.state_pool = PoolRef(p.instance, p.state_segment, p.directory, p.state_slots, p.state_bytes)
        return meta

    def _plan_saves(self, ranges: list[StepRange], meta: HiCacheConnectorMetadata) -> None:
        """Reserve L2 pages for the step's new full blocks, one ``Reserve`` for every request
        (a second one only for requests whose tokens the daemon forgot), and plan the saves.
        The daemon reserves from the first page it lacks, which covers a gap a short or
        failed reservation left earlier (the request still holds the full layers' blocks of
        every page; so a later block retries it), within the request's re-save credit (the
        daemon's ``reserve_range``). A sliding-window group gives up its blocks before the
        window as the request goes on; the daemon asks for window parts only from the range's
        ``window_from`` on, whose blocks the group holds in this step; a reservation whose
        window blocks are not all held is given back unsaved (the next step's range, ending
        later, tries again)."""
        asks: list[tuple[StepRange, protos.SaveRange, int]] = []  # (request, its range, the tokens it ends at)
        for step in ranges:
            planned = step.tracked.save_range(self.layout, self._stale, step.computed_before, step.computed_after)
            if planned is not None:
                asks.append((step, *planned))
        if not asks:
            return
        # each answer with the registration it was asked under: the second Reserve may be of
        # another session or daemon run (a restart in between), whose leases and pool differ
        answers = self._reserve([item for _, item, _ in asks])
        again = [i for i, (got, _) in enumerate(answers)
                 if got is not None and got.code == "unknown_request" and asks[i][1].base]
        if again:  # the daemon forgot those requests (or the session changed): send their tokens, once
            whole = []
            for i in again:
                step, item, end = asks[i]
                whole.append(replace(item, token_ids=step.tracked.packed.span(0, end), base=0))
            for i, answered in zip(again, self._reserve(whole), strict=True):
                answers[i] = answered
        for (step, item, end), (got, reg) in zip(asks, answers, strict=True):
            tracked = step.tracked
            if got is None or reg is None:
                continue
            if got.code:
                tracked.known_tokens = 0
                log.warning("hicache refused a save range of %s: %s", item.rid, got.reason)
                continue
            tracked.known_tokens = end
            if not got.lease:
                continue
            plan = save_plan(self.layout, item.rid, reg, got, tracked.block_ids, tracked.state_blocks)
            if plan is None:  # a window block it needs is not held: given back, the next step tries again
                self.session.send(protos.Commit(reg.session, reg.run, got.lease, False, protos.ALL_RANKS))
                self.stats.add("save_skipped_blocks", len(got.host_pages))
                continue
            meta.saves.append(plan)
            self.stats.add("reserved_blocks", len(got.host_pages))

    def _reserve(self, items: list[protos.SaveRange]
                 ) -> list[tuple[protos.Reservation | None, protos.EngineRegistered | None]]:
        """The daemon's reservation for each item, with the registration it was asked under
        (None for all without an answer)."""
        got = self._call(lambda req, reg: protos.Reserve(req, reg.session, reg.run, items))
        answer, reg = got.answer, got.registered
        if isinstance(answer, protos.ReserveResult) and len(answer.items) == len(items):
            return [(item, reg) for item in answer.items]
        if isinstance(answer, protos.EngineError) and answer.code == protos.BUSY:
            self._busy()  # nothing saved in this step: a later step's range starts where L2's pages end
        elif isinstance(answer, protos.EngineError):
            log.warning("hicache refused a reserve: %s", answer.reason)
        elif isinstance(answer, protos.ReserveResult):  # a daemon bug: give back what it holds
            log.warning("hicache answered %d reservations for %d save ranges", len(answer.items), len(items))
            if reg is not None:
                for item in answer.items:
                    if item.lease:
                        self.session.send(protos.Commit(reg.session, reg.run, item.lease, False, protos.ALL_RANKS))
        return [(None, None)] * len(items)

    def request_finished(self, request: Request) -> None:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None:
            self._release(tracked.hit)
            reg = self._registered
            if tracked.known_tokens and reg is not None:
                self.session.send(protos.Finished(reg.session, reg.run, request.request_id))

    def note_late_answers(self) -> None:
        """Count the answers that came after their call gave up (``late_answers``)."""
        late = self.session.late_leases
        self.stats.add("late_answers", late - self._late_seen)
        self._late_seen = late

    def shutdown(self) -> None:
        self.session.close()
        if self.events is not None:
            self.events.close()
