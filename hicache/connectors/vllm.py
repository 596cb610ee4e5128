"""``HiCacheConnector``: hicache as vLLM's L2 + L3, loaded by module path (README "Engine mode").

vLLM loads it with ``--kv-transfer-config '{"kv_connector": "HiCacheConnector",
"kv_connector_module_path": "hicache.connectors.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"hicache_config": "/path/to/hicache.yaml"}}'`` (the daemon's
own YAML: it says where the daemon's socket is). When the daemon uses CURVE
(``ipc.curve_keys_dir``), the connector connects with the client key pair and the daemon's
public key from that directory, or from the files named by the extra-config keys
``curve_client_secret_file`` and ``curve_server_public_file`` (``engine_client.curve_keys_for``). This module imports vLLM; nothing else in
hicache imports this module, so the daemon runs without vLLM installed.

Both halves, one class (vLLM makes one instance per role):

* **Scheduler half** (vLLM's engine core). ``get_num_new_matched_tokens`` asks the daemon
  for the L2 pages of the prompt beyond vLLM's own hit (page-aligned, leaving the last token
  to compute); the answer comes with a lease that keeps those pages locked. The daemon never
  waits for L3 before it answers: while it prefetches the prompt's next pages from L3 it
  answers *pending*, and the connector returns None, so vLLM schedules the other requests
  and asks about this one again on a later step (not before ``PENDING_RETRY_S``, doubling
  up to ``MAX_PENDING_RETRY_S``; the prefetch policy bounds the wait). A request vLLM asks about
  again before it could allocate its blocks (its KV space is full) is answered the hit it
  holds, without a round trip (``HELD_HIT_MAX_AGE_S``). A request's tokens
  travel once: asking again, and every later reserve, names the tokens the daemon holds for
  it (``base``) and sends only those after them, so a block filled during decode costs the
  same at any context length. ``update_state_after_alloc`` turns a hit into a load plan (L2
  page -> vLLM block); ``build_connector_meta`` reserves, in one round trip for the whole
  step (``Reserve``), L2 pages for the blocks of every scheduled request that become full
  in this step and that the daemon does not hold yet, and ``request_finished`` tells the
  daemon to forget the request (``Finished``).
  ``request_finished`` never delays freeing: saves complete inside the step that computed
  them. ``get_external_cache_hit_sources`` reports L2 hits as ``host`` and prefetched L3 hits
  (the tail of a hit: L3 continues what L2 holds) as ``disk``. Requests whose KV depends on
  more than their tokens (multimodal inputs, prompt embeddings, LoRA adapters) are neither
  looked up nor saved. ``reset_cache`` (vLLM's cache reset, e.g. after a weight update)
  moves the engine to a fresh namespace: nothing saved before it is served after it, and
  requests that began before it save nothing more. With vLLM's KV events on
  (``--kv-events-config``) and the daemon's (``events.enabled``), ``take_events`` hands vLLM's
  publisher the daemon's L2 and L3 events for this engine's pages
  (``hicache.kv_events.follower``; docs/architecture.md §14).
* **Worker half** (vLLM's worker). ``register_kv_caches`` checks the KV layout (CPU, block
  index first, contiguous blocks); ``start_load_kv`` copies the planned loads before the
  forward pass (so ``wait_for_layer_load`` has nothing to wait for) and releases each lease;
  a load that fails (or was planned under another daemon run) reports its blocks through
  ``get_block_ids_with_load_errors`` and vLLM recomputes them: the connector sets vLLM's
  ``kv_load_failure_policy`` to ``recompute`` at start (vLLM's default, ``fail``, would end
  the request with an error). ``wait_for_save`` copies the step's new full blocks into their
  reserved pages and commits them, but none in a step whose synchronous load failed, nor
  until the scheduler half knows of that failure (every request of the step may attend to
  the failed blocks: vLLM caches them when it allocates them, and others hit them in its
  prefix cache): they are committed as failed. The scheduler half then keeps those blocks,
  and what is computed on top of them, out of every save until they are computed again
  (``hicache.connectors.stale_blocks``).

Hybrid models (``SupportsHMA``: vLLM's hybrid allocator stays on): each KV cache group (full
attention, sliding window) has its own block table; a page is one block of every layer, each
taken from its layer's group. The daemon keeps a page in two parts: the full part (the
layers without a window) for every page, the window part (the window layers) only for the
pages of the windows before the boundaries where hits end (a prompt's end, a request's
latest saved end, a shared prefix's end: docs/architecture.md §13), which is all a hit there
reads (``kv_copy``). A lookup answers the window parts of its hit's last window; a save
writes the full parts of its range and the window parts the daemon names, only from the
first page whose window blocks the request still holds in this step (``window_from``). A
window group's blocks before its window are not loaded (vLLM holds none there). With several groups, vLLM cannot map a failed block back to its
request, so a hit loads asynchronously: the request waits for the step whose
``start_load_kv`` copies it (``get_finished``), and a failed load is reported for the request
(``failed_recving``), which vLLM recomputes whole.

GDN hybrids (Qwen3-Next): a ``MambaSpec`` group holds the gated delta net layers' state, one
per block, which vLLM (``align`` mode, on with prefix caching) keeps at some block ends only
and offers in the step that computes it (``boundary_state_offloads``). A save names the
block-aligned offers of its request (``SaveRange.state_pages``) and copies the ones the
daemon reserves a slot for (``StateCopier``: each state layer's block bytes); a hit ends
after a page whose state the daemon keeps, and its load copies that state into the state
group's block of the hit's last page, where vLLM reads a request's initial state. With
tensor parallelism each rank copies its heads' share of the state, side by side in a slot.

Every plan names the daemon run it was made under (``EngineRegistered.run``); the worker
refuses a plan of another run than the step's registration, whose page numbers would index
a new daemon's pool. The session registers with the engine's runtime identity
(``hicache.connectors.runtime_identity``: vLLM and torch versions, attention backend and ISA,
value-changing options, reset generation); an option the connector cannot classify refuses
the engine at start, naming it.

Tensor parallelism: the scheduler half is one per engine and plans for every rank; each
rank's worker half copies its own heads of every layer (``BlockCopier``'s shard: a page has
one layout at any rank count) and sends its own ``Commit`` / ``Release`` with its rank. The
daemon inserts a saved page only when every rank committed it, and unlocks a loaded one when
every rank released it; a rank whose load failed reports it as at one rank (vLLM joins the
ranks' load errors, so every rank recomputes). Ranks write different bytes than one process
(their all-reduce sums in another order): the rank count is part of the runtime identity, so
engines of different TP degrees never share a page. Each worker announces its process to the
daemon (``EngineWorker``): what a dead engine's expired session held is freed only once its
workers are gone too.

MLA (``MLAAttentionSpec``: DeepSeek V2 / V3 on vLLM's CPU MLA backend): a token's row is one
latent vector for all heads, a page holds it for every layer (``kv_kind`` ``mla``); every
rank holds the whole latent, so rank 0 alone saves it (stored once) and every rank loads it.

Refused at start, with the reason: pipeline parallelism, fewer KV heads than tensor-parallel
ranks (vLLM replicates them), vLLM's AMX MLA backend (not run with hicache), a vLLM version other than
the supported ones, a KV cache group that is not full or sliding-window attention, MLA of one
shape or a state group in ``align`` mode (``vllm_layout.check_setup``: e.g. MLA beside other
attention), a CUDA KV cache (its copy path has not run
on a GPU), and an engine whose model or KV geometry differs
from what the daemon serves. A daemon that is absent or slow costs hits, never correctness:
lookups time out (``engine.lookup_timeout_ms``) as misses and the connector backs off. A
daemon past its bound for this engine answers ``protos.BUSY`` at once: that lookup is a miss,
that step saves nothing (``busy_answers`` counts them), and no backoff follows.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import protos
from hicache.cache_server.geometry import namespace_of
from hicache.cache_server.leases import own_pid_namespace, process_start_time
from hicache.connectors.engine_client import (
    CacheSession,
    EngineAnswer,
    EngineCall,
    EngineClient,
    RegistrationRefused,
    SessionAnswer,
    curve_keys_for,
    engine_name,
)
from hicache.connectors.faults import FAIL_LOADS_ENV, ConnectorFaults, FaultConfigError
from hicache.connectors.kv_copy import (
    NO_BLOCK,
    NO_PAGE,
    BlockCopier,
    PoolRef,
    StateCopier,
    kv_problem,
    state_problem,
)
from hicache.connectors.runtime_identity import (
    UnclassifiedOption,
    runtime_entries,
    runtime_identity,
)
from hicache.connectors.stale_blocks import StaleBlocks, StepWrite
from hicache.connectors.token_pack import PackedTokens
from hicache.connectors.vllm_layout import ConnectorRefused, VllmKVLayout, check_setup
from hicache.connectors.vllm_stats import HiCachePromMetrics, HiCacheStats
from hicache.kv_events.follower import EventFollower, connect_address
from hicache.kv_events.format import BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
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

VLLM_NULL_BLOCK = 0
"""The block id vLLM's hybrid allocator puts where a sliding-window group holds no block
(before the window); never a real block of any group."""


# ---------------------------------------------------------------------- metadata


@dataclass
class StateCopy:
    """State slot ``slot`` and, per KV cache group ``g``, block ``blocks[g]`` (``NO_BLOCK`` for
    a group without state layers): the state of every state layer at one block end."""

    slot: int
    blocks: list[int]


@dataclass
class BlockCopyPlan:
    """L2 ``pages[i]`` and vLLM block ``blocks[g][i]`` of each KV cache group ``g``, copied
    under ``lease`` (of ``session`` in daemon run ``run``) for request ``rid``."""

    rid: str
    session: int
    run: int
    lease: int
    pages: list[int]
    blocks: list[list[int]]
    window_pages: list[int] = field(default_factory=list)
    """With window layers: the window part of ``pages[i]`` (``NO_PAGE``: none), else empty.
    A save's ``pages[i]`` may be ``NO_PAGE`` too: a page whose window part alone is saved."""
    states: list[StateCopy] = field(default_factory=list)
    """With state layers: the states copied with the pages (a load's: the one after its last page)."""


@dataclass
class LoadPlan(BlockCopyPlan):
    """Copy L2 ``pages[i]`` into vLLM block ``blocks[g][i]`` (``NO_BLOCK``: the group holds
    none there, outside its window), then release the lease. ``unloadable``: why the load
    must fail instead (vLLM recomputes), "" when it need not."""

    unloadable: str = ""


@dataclass
class SavePlan(BlockCopyPlan):
    """Copy vLLM block ``blocks[g][i]`` into L2 ``pages[i]``, then commit the lease."""


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    """What the worker half does in one step (built by the scheduler half). ``run`` and
    ``pool``: the registration the step's pages belong to (0 and None: none); a plan of
    another run is refused by the worker. ``step``: the scheduler half's number of the step;
    ``failures_known``: the steps whose synchronous load failed (``HiCacheWorkerMeta``) that
    the scheduler half learned of since the last step's metadata, so that the saves planned
    here already avoid the blocks those failures left stale."""

    step: int = 0
    failures_known: frozenset[int] = frozenset()
    run: int = 0
    pool: PoolRef | None = None
    window_pool: PoolRef | None = None
    state_pool: PoolRef | None = None
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class HiCacheWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler half after a step: the steps (``HiCacheConnectorMetadata.step``)
    in which a synchronous load of its failed. vLLM joins every rank's."""

    failed_steps: frozenset[int] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        theirs = other.failed_steps if isinstance(other, HiCacheWorkerMeta) else frozenset()
        return HiCacheWorkerMeta(self.failed_steps | theirs)


@dataclass
class _Hit:
    """A lookup answer held for one request until vLLM allocates its blocks."""

    session: int
    run: int
    lease: int
    pages: list[int]
    storage_pages: int  # the last ``storage_pages`` of ``pages`` came from L3 for this lookup
    first_page: int  # vLLM's own hit, in pages: the load starts there
    window_pages: list[int] = field(default_factory=list)  # the window parts of the last pages
    state_slot: int = NO_PAGE  # with state layers: the state after the last page
    answered_at: float = 0.0  # when the daemon answered it (monotonic)


@dataclass
class _StepRange:
    """A request scheduled in this step: the tokens it had computed before the step and will
    have computed after it."""

    tracked: _Tracked
    computed_before: int
    computed_after: int


@dataclass
class _Tracked:
    """The scheduler half's view of one request."""

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, as vLLM gave them
    saved_pages: int = 0  # pages [0, saved_pages) are in the daemon or planned for saving
    known_tokens: int = 0  # tokens the daemon holds for this request (a message's base counts from them)
    packed: PackedTokens = field(default_factory=PackedTokens)  # its prompt and the tokens its saves named,
    # packed once: every message's tokens are a span of these
    saves_closed: bool = False  # began before a cache reset (its KV may be of the old weights)
    retry_at: float = 0.0  # pending on an L3 prefetch: not asked again before this (monotonic)
    pending_wait: float = 0.0  # the current wait between two asks while pending
    pending_since: float = 0.0  # when its lookup was first answered pending (0: it was not)
    lookups_closed: bool = False  # an asynchronous load of it failed: it computes its prompt itself
    hit: _Hit | None = None
    state_offers: dict[int, list[int]] = field(default_factory=dict)  # page j -> per group, the block
    # holding the state after it, offered by vLLM in this step (state layers only) ...
    state_blocks: dict[int, list[int]] = field(default_factory=dict)  # ... and those its save range names
    loaded_tokens: int = 0
    loaded_storage_tokens: int = 0


# ---------------------------------------------------------------------- the connector


def _tensors(value: Any) -> list[torch.Tensor]:
    """A layer's KV cache entry as a list of tensors (a state layer's is a list or tuple)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _load_hicache_config(extra: dict[str, Any]) -> Any:
    from hicache.config import ConfigError, load_config

    path = extra.get("hicache_config")
    if not path:
        raise ConnectorRefused('kv_connector_extra_config needs "hicache_config": the path of the daemon\'s YAML')
    try:
        return load_config(path)
    except ConfigError as exc:
        raise ConnectorRefused(f"{path}: {exc}") from exc


def engine_address(cfg: Any) -> str:
    """The daemon's engine socket, from its config (``ipc.dir`` or ``ipc.tcp_*``)."""
    from hicache.runtime.ipc import Endpoints

    return Endpoints(cfg.ipc.transport, cfg.ipc.dir, cfg.ipc.tcp_host, cfg.ipc.tcp_base_port).address("engine")


def _vllm_event(event: KVEvent) -> KVCacheEvent:
    """One of hicache's KV events as vLLM's class of it."""
    if isinstance(event, BlockStored):
        return vllm_events.BlockStored(block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                                       token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                                       medium=event.medium, lora_name=None, extra_keys=event.extra_keys)
    if isinstance(event, BlockRemoved):
        return vllm_events.BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium)
    return vllm_events.AllBlocksCleared()


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_setup(vllm_config, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.hicache = _load_hicache_config(extra)
        if self.hicache.engine.kind != "vllm":
            raise ConnectorRefused(f"{extra['hicache_config']}: engine.kind is {self.hicache.engine.kind!r}; "
                                   "the daemon must run in engine mode (engine.kind: vllm)")
        self.layout = layout = VllmKVLayout.of(vllm_config, kv_cache_config)
        self.geometry = layout.geometry
        try:
            self.faults = ConnectorFaults.from_env()
        except FaultConfigError as exc:
            raise ConnectorRefused(str(exc)) from None
        try:
            self.runtime = runtime_entries(vllm_config, layout.head_size, self.faults.runtime)
        except UnclassifiedOption as exc:
            raise ConnectorRefused(f"cannot tell which KV pages this engine may share: {exc}") from None
        self.address = engine_address(self.hicache)
        self.stats = HiCacheStats()  # since the last get_kv_connector_stats (vllm_stats)
        self._busy_count = 0  # busy answers since the last log line about them
        self._busy_logged_at = -BUSY_LOG_EVERY_S
        try:
            curve = curve_keys_for(extra, self.hicache.runtime.ipc.curve_keys_dir)
        except ValueError as exc:
            raise ConnectorRefused(str(exc)) from None
        timeout = self.hicache.engine.lookup_timeout_ms
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._kv_transfer_config
            if transfer.kv_load_failure_policy != "recompute":
                log.info("hicache: kv_load_failure_policy %r -> 'recompute': a block hicache could not load is "
                         "recomputed, never served or failed", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"  # read by vLLM's scheduler after this constructor
            self.reset_generation = ""
            self._late_seen = 0
            self.session: CacheSession | None = CacheSession(self.address, timeout, self._register_msg(), curve=curve)
            self._requests: dict[str, _Tracked] = {}
            self._step = 0  # the last step numbered (HiCacheConnectorMetadata.step)
            self._failures_learned: set[int] = set()  # failed steps learned since the last step's metadata
            self._stale = StaleBlocks(layout.block_size)  # blocks a failed load left without their KV
            self._loads: list[LoadPlan] = []
            self.events = self._follow_events(vllm_config)
            self._events_run = 0  # the daemon run the follower's numbering belongs to
            try:
                if self.session.ensure(timeout_ms=max(timeout, 2000)) is None:
                    log.warning("hicache: the daemon at %s is not answering; serving without it until it does",
                                self.address)
            except RegistrationRefused as exc:
                raise ConnectorRefused(f"the hicache daemon at {self.address} refused this engine: {exc}") from exc
            self.session.start()  # from now on the heartbeat thread registers whenever no session is open
        else:
            self.session = None
            self.events = None
            self.worker_client = EngineClient(self.address, timeout, curve=curve)
            self.copier: BlockCopier | None = None
            self.state_copier: StateCopier | None = None
            self.rank = get_tensor_model_parallel_rank()
            self._announced_run = 0  # the daemon run this worker announced its process to (EngineWorker)
            self._load_errors: set[int] = set()
            self._unknown_failures: set[int] = set()  # steps whose load failed here, not yet known to the
            # scheduler half: nothing computed since may be saved (it may attend to the failed blocks)
            self._failures_to_report: set[int] = set()  # for the next HiCacheWorkerMeta
            self._loaded_async: set[str] = set()  # asynchronous loads done (or failed) since the last report
            self._failed_async: set[str] = set()  # of which these failed

    # ================================================================== scheduler half
    def _follow_events(self, vllm_config: VllmConfig) -> EventFollower | None:
        """With vLLM's KV events on and the daemon's ``events`` on: a follower of the daemon's
        stream, whose events ``take_events`` hands to vLLM's publisher (docs/architecture.md §14)."""
        wanted = vllm_config.kv_events_config
        ev = self.hicache.events
        if wanted is None or not wanted.enable_kv_cache_events or not ev.enabled:
            return None
        host = self.hicache.runtime.ipc.tcp_host
        try:
            follower = EventFollower(connect_address(ev.endpoint, host),
                                     connect_address(ev.replay_endpoint, host) if ev.replay_endpoint else None,
                                     self._namespace())
        except Exception as exc:  # the events are a view for routers, never a reason not to serve
            log.error("hicache: cannot follow the daemon's KV events at %s (%s); vLLM publishes its own only",
                      ev.endpoint, exc)
            return None
        log.info("hicache: handing the daemon's KV events (%s) to vLLM's publisher", ev.endpoint)
        return follower

    def _namespace(self) -> str:
        return namespace_of(runtime_identity(self.runtime, self.reset_generation))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The daemon's L2 and L3 events for this engine's pages since the last call, as
        vLLM's events (see ``hicache.kv_events.follower``); never raises."""
        if self.events is None:
            return ()
        try:
            reg = self._registered
            if reg is not None and reg.run != self._events_run:
                if self._events_run:
                    self.events.restart()
                self._events_run = reg.run
            return [_vllm_event(e) for e in self.events.take()]
        except Exception:  # the events are a view for routers: never a reason to fail a step
            log.exception("hicache: cannot hand on the daemon's KV events")
            return ()

    def _register_msg(self) -> protos.EngineRegister:
        g = self.geometry
        return protos.EngineRegister(
            req=0, engine=engine_name(), pid=os.getpid(), geometry=g, page_bytes=g.page_bytes,
            runtime_identity=runtime_identity(self.runtime, self.reset_generation),
            pid_namespace=own_pid_namespace(), start_time=process_start_time(os.getpid()) or 0, tensor_parallel=self.layout.tp,
            window_tokens=self.layout.window_tokens)

    @property
    def _registered(self) -> protos.EngineRegistered | None:
        """The open registration (scheduler half), or None."""
        return self.session.registered if self.session is not None else None

    def reset_cache(self) -> bool | None:
        """vLLM's cache reset (after a weight update, say): a new namespace for this engine's
        pages, so nothing saved before is ever served after, and no request that began
        before saves again. True: done (the daemon needs not answer).

        vLLM calls this even when its own reset failed (a request still holds blocks, which
        vLLM keeps, hashes and all): then nothing changes here either and the answer is
        False, since requests of the new weights would compute on those blocks and save
        into the new namespace. vLLM's own ``reset_prefix_cache()`` without
        ``reset_connector=True`` does not call this: the engine keeps its namespace."""
        if self.session is None:
            return None
        kept = self._vllm_kept_blocks()
        if kept:
            log.warning("hicache: cache reset refused: vLLM keeps %d blocks (its own reset failed); the engine "
                        "keeps its namespace", kept)
            return False
        self.reset_generation = secrets.token_hex(16)
        self.session.reregister(self._register_msg())
        if self.events is not None:  # the old namespace's pages are no longer this engine's
            self.events.change_namespace(self._namespace())
        for tracked in self._requests.values():
            self._release(tracked.hit)
            tracked.hit = None
            tracked.saves_closed = True
        log.info("hicache: cache reset: this engine's pages have a new namespace")
        return True

    def _vllm_kept_blocks(self) -> int:
        """Blocks vLLM's block pools hold now besides their null block: vLLM's own prefix
        cache reset succeeds only with none (``BlockPool.reset_prefix_cache``, 0.32), and
        it runs just before this connector's. 0 when no cache manager was bound."""
        manager = self._kv_cache_manager  # set by KVConnectorBase_V1.bind_kv_cache_manager
        if manager is None:
            return 0
        pools = {id(m.block_pool): m.block_pool for m in manager.coordinator.single_type_managers}
        return sum(p.num_gpu_blocks - p.get_num_free_blocks() - 1 for p in pools.values())

    def _call(self, make: Callable[[int, protos.EngineRegistered], EngineCall],
              timeout_ms: int | None = None) -> SessionAnswer:
        """A request within the session, with the registration it was asked under (see
        ``CacheSession.call_under``); never waits for a registration (the heartbeat thread
        registers while none is open, and again ``engine_client.REFUSED_RETRY_S`` after a refusal)."""
        if self.session is None:
            return SessionAnswer(None, None)
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

    def _release(self, hit: _Hit | None) -> None:
        """Give back a hit no rank was given (not planned for loading)."""
        if hit is None or not hit.lease or self.session is None:
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
            tracked = self._requests[rid] = _Tracked(request)
        held, tracked.hit = tracked.hit, None  # asked again before vLLM allocated its blocks
        bs = self.layout.block_size
        tokens = request.prompt_token_ids or []
        usable = (len(tokens) - 1) // bs * bs  # vLLM computes at least the last prompt token
        # vLLM's own hit ends inside a block (a prefix match unit below the block): with state
        # layers a daemon hit could not be loaded from there (a state is kept at page ends only),
        # so it is not asked for: vLLM keeps its own hit and computes the rest
        inside = bool(self.layout.state_layer_names and num_computed_tokens % bs)
        if tracked.lookups_closed or usable <= num_computed_tokens or inside:
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
        answer, reg = self._lookup(tracked, tokens, usable, timeout_ms=0 if slow else None)
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
        hit = _Hit(reg.session, reg.run, answer.lease, list(answer.host_pages), answer.storage_pages,
                   num_computed_tokens // bs, list(answer.window_pages), answer.state_slot, now)
        tracked.saved_pages = max(tracked.saved_pages, len(hit.pages))
        return self._held_answer(tracked, hit, num_computed_tokens)

    def _held_answer(self, tracked: _Tracked, hit: _Hit, num_computed_tokens: int) -> tuple[int, bool]:
        """``hit`` (its lease held) as the answer beyond vLLM's own hit of ``num_computed_tokens``
        tokens, kept for ``update_state_after_alloc``; given back when it adds nothing."""
        external = len(hit.pages) * self.layout.block_size - num_computed_tokens
        if external <= 0:
            self._release(hit)
            return 0, False
        hit.first_page = num_computed_tokens // self.layout.block_size
        tracked.hit = hit
        return external, self.layout.load_async

    def _lookup(self, tracked: _Tracked, tokens: list[int], usable: int,
                timeout_ms: int | None = None) -> tuple[EngineAnswer | None, protos.EngineRegistered | None]:
        """Ask about the request's first ``usable`` prompt tokens, sending only those the
        daemon does not hold for it yet (all of them again if it forgot them); the answer and
        the registration it was asked under (its lease is of that session and run).
        ``timeout_ms``: the wait for the answer (None: ``engine.lookup_timeout_ms``)."""
        rid = tracked.request.request_id
        salt = tracked.request.cache_salt or ""
        base = min(tracked.known_tokens, usable)
        tracked.packed.extend(tokens, len(tokens))  # the prompt, once (vLLM only appends to it)
        new = tracked.packed.span(base, usable)
        got = self._call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, rid, new, salt, True, base),
                         timeout_ms)
        if isinstance(got.answer, protos.EngineError) and got.answer.code == "unknown_request" and base:
            whole = tracked.packed.span(0, usable)
            got = self._call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, rid, whole, salt), timeout_ms)
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
        first = hit.first_page
        pages = hit.pages[first : first + n]
        # a sliding-window group holds blocks of the window only: its layers of the pages before it stay unloaded
        plan_blocks = self._page_blocks(tracked.block_ids, first, first + len(pages))
        # the window parts are the hit's last ones: page j has window_pages[j - (len(hit.pages) - len(window_pages))]
        window: list[int] = []
        if self.layout.windowed:
            lead = len(hit.pages) - len(hit.window_pages)
            window = [hit.window_pages[j - lead] if j >= lead else NO_PAGE for j in range(first, first + len(pages))]
        states: list[StateCopy] = []
        unloadable = ""
        if self.layout.state_layer_names:  # the state after the last loaded page, into that page's state blocks
            last = first + len(pages) - 1
            blocks_at = [ids[last] if g in self.layout.state_groups and last < len(ids) else NO_BLOCK
                         for g, ids in enumerate(tracked.block_ids)]
            if first + len(pages) != len(hit.pages) or hit.state_slot == NO_PAGE:
                unloadable = "the load does not end where the daemon kept the state"
            elif any(blocks_at[g] in (NO_BLOCK, VLLM_NULL_BLOCK) for g in self.layout.state_groups):
                unloadable = "vLLM gave no state block at the hit's end"
            else:
                states = [StateCopy(hit.state_slot, blocks_at)]
        self._loads.append(LoadPlan(request.request_id, hit.session, hit.run, hit.lease, pages, plan_blocks,
                                    window, states, unloadable))
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        meta = HiCacheConnectorMetadata(self._step, frozenset(self._failures_learned))
        self._failures_learned = set()
        meta.loads, self._loads = self._loads, []
        if self.session is None:
            return meta
        self.session.client.drain()  # late answers: their leases are given back now
        # the block tables, state offers and stale blocks follow every step, with or without a
        # session: a step missed would shift later blocks against their pages
        scheduled = scheduler_output.num_scheduled_tokens
        ranges: list[_StepRange] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
                ranges.append(_StepRange(tracked, new.num_computed_tokens,
                                         new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self._requests.get(rid)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tracked.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                if not tracked.block_ids:
                    tracked.block_ids = [[] for _ in new_blocks]
                for held, more in zip(tracked.block_ids, new_blocks, strict=True):
                    held.extend(more)
            computed = cached.num_computed_tokens[i]
            ranges.append(_StepRange(tracked, computed, computed + scheduled.get(rid, 0)))
        offered = self._take_state_offers(scheduler_output) if self.layout.state_layer_names else []
        if self._stale:  # the step's writes first: its saves copy what its forward pass leaves
            g = self.layout.kv_groups[0]
            self._stale.step([StepWrite(r.tracked.block_ids[g] if r.tracked.block_ids else [], r.computed_before,
                                        r.computed_after) for r in ranges])
        if self.session.registered is not None:
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

    def _take_state_offers(self, scheduler_output: SchedulerOutput) -> list[_Tracked]:
        """Note the states vLLM offers in this step (``boundary_state_offloads``: in align
        mode, the block holding each state it keeps, at the end of the step that computes
        it, whose bytes stay until the step ends): per request, the pages after which every
        state group offered its block. States inside a block (vLLM's partial tails) are not
        kept: a page is a whole block. Returns the requests noted (their offers are dropped
        at the end of the pass, whether their save range took them or not)."""
        block_state = scheduler_output.kv_connector_block_state
        offers = block_state.boundary_state_offloads if block_state is not None else {}
        bs = self.layout.block_size
        noted: list[_Tracked] = []
        for rid, entries in offers.items():
            tracked = self._requests.get(rid)
            if tracked is None:
                continue
            noted.append(tracked)
            by_page: dict[int, list[int]] = {}
            for group, block, tokens in entries:
                if tokens <= 0 or tokens % bs or group not in self.layout.state_groups:
                    continue
                by_page.setdefault(tokens // bs - 1, [NO_BLOCK] * self.layout.num_groups)[group] = block
            tracked.state_offers = {j: blocks for j, blocks in by_page.items()
                                    if all(blocks[g] not in (NO_BLOCK, VLLM_NULL_BLOCK) for g in self.layout.state_groups)}
        return noted

    def _save_range(self, tracked: _Tracked, computed_before_step: int, computed_after_step: int
                    ) -> tuple[protos.SaveRange, int] | None:
        """The save range of the blocks that are full once this step ran, beyond
        ``saved_pages``, with the tokens it ends at; None when there are none. With window
        layers, the range names the first page whose window blocks the request holds in this
        step: vLLM freed those wholly more than the window behind ``computed_before_step``."""
        offers, tracked.state_offers = tracked.state_offers, {}
        if tracked.saves_closed or not tracked.block_ids:
            return None
        bs = self.layout.block_size
        tokens = tracked.request.all_token_ids
        if not offers and min(computed_after_step, len(tokens)) // bs <= tracked.saved_pages:
            return None  # no block becomes full in this step (most decode steps): nothing to ask
        full = min(computed_after_step, len(tokens), min(len(tracked.block_ids[g]) for g in self.layout.kv_groups) * bs) // bs
        full = self._stale.first_stale(tracked.block_ids[self.layout.kv_groups[0]], full)  # never a stale block
        start = tracked.saved_pages
        state_pages = sorted(j for j in offers if j < full)
        if full <= start and not state_pages:
            return None
        tracked.saved_pages = max(start, full)
        end = full * bs
        base = min(tracked.known_tokens, end)  # the daemon holds these: send only the tokens after them
        window_from = max(0, computed_before_step - self.layout.window_tokens + 1) // bs if self.layout.windowed else 0
        prompt = len(tracked.request.prompt_token_ids or ())
        repeat_end = (prompt - 1) // bs if self.layout.windowed and full == prompt // bs else 0
        tracked.packed.extend(tokens, end)  # computed tokens: vLLM never rewrites them
        item = protos.SaveRange(tracked.request.request_id, tracked.packed.span(base, end), start,
                                tracked.request.cache_salt or "", base, window_from, repeat_end, state_pages)
        tracked.state_blocks = {j: offers[j] for j in state_pages}
        return item, end

    def _plan_saves(self, ranges: list[_StepRange], meta: HiCacheConnectorMetadata) -> None:
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
        asks: list[tuple[_StepRange, protos.SaveRange, int]] = []  # (request, its range, the tokens it ends at)
        for step in ranges:
            planned = self._save_range(step.tracked, step.computed_before, step.computed_after)
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
            plan = self._save_plan(item.rid, reg, got, tracked.block_ids, tracked.state_blocks)
            if plan is None:  # a window block it needs is not held: given back, the next step tries again
                if self.session is not None:
                    self.session.send(protos.Commit(reg.session, reg.run, got.lease, False, protos.ALL_RANKS))
                self.stats.add("save_skipped_blocks", len(got.host_pages))
                continue
            meta.saves.append(plan)
            self.stats.add("reserved_blocks", len(got.host_pages))

    def _save_plan(self, rid: str, reg: protos.EngineRegistered, got: protos.Reservation,
                   block_ids: list[list[int]], state_blocks: dict[int, list[int]]) -> SavePlan | None:
        """The copies of a reservation: full parts of pages ``start_page ..`` and window
        parts of pages ``window_at`` (which may lie before them), over the one page span
        that covers both, and the states after pages ``state_at`` (from the blocks vLLM
        offered, ``state_blocks``); None when a window block it names is not held (vLLM's
        null block), a state it names was not offered, or the reservation does not fit the
        request's blocks."""
        if len(got.state_at) != len(got.state_slots) or any(j not in state_blocks for j in got.state_at):
            return None
        states = [StateCopy(slot, state_blocks[j]) for j, slot in zip(got.state_at, got.state_slots, strict=True)]
        first, n = got.start_page, len(got.host_pages)
        lo = min([first] + list(got.window_at)) if got.window_at else first
        hi = max([first + n] + [j + 1 for j in got.window_at])
        if lo < 0 or len(got.window_at) != len(got.window_pages) or any(len(block_ids[g]) < hi
                                                                         for g in self.layout.kv_groups):
            return None
        pages = [NO_PAGE] * (first - lo) + list(got.host_pages) + [NO_PAGE] * (hi - first - n)
        blocks = self._page_blocks(block_ids, lo, hi)
        window: list[int] = []
        if self.layout.windowed:
            window = [NO_PAGE] * (hi - lo)
            for j, w in zip(got.window_at, got.window_pages, strict=True):
                window[j - lo] = w
            if any(ids[j - lo] == NO_BLOCK for ids, g in zip(blocks, self.layout.group_window, strict=True) if g
                   for j in got.window_at):
                return None
        elif got.window_at:
            return None
        return SavePlan(rid, reg.session, reg.run, got.lease, pages, blocks, window, states)

    def _page_blocks(self, block_ids: list[list[int]], lo: int, hi: int) -> list[list[int]]:
        """Per KV cache group, its blocks of pages ``[lo, hi)`` (``NO_BLOCK`` where it holds
        none: before a window; every page of a state group, whose blocks hold states, copied
        by ``StateCopy`` only)."""
        return [[NO_BLOCK] * (hi - lo) if g in self.layout.state_groups
                else [NO_BLOCK if b == VLLM_NULL_BLOCK else b for b in ids[lo:hi]]
                for g, ids in enumerate(block_ids)]

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
            if reg is not None and self.session is not None:
                for item in answer.items:
                    if item.lease:
                        self.session.send(protos.Commit(reg.session, reg.run, item.lease, False, protos.ALL_RANKS))
        return [(None, None)] * len(items)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when its hybrid allocator is on (``SupportsHMA``): as ``request_finished``."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None:
            self._release(tracked.hit)
            reg = self._registered
            if tracked.known_tokens and reg is not None and self.session is not None:
                self.session.send(protos.Finished(reg.session, reg.run, request.request_id))
        return False, None

    # ================================================================== worker half
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ConnectorRefused(f"vLLM registered no KV tensor for layers {missing}")
        layers = [kv_caches[n] for n in self.layout.layer_names]
        shards = 1 if self.layout.mla else self.layout.tp  # MLA: each rank holds the whole latent
        problem = kv_problem(layers, self.layout.num_blocks, self.geometry.layer_block_bytes // shards, self.layout.kv_dtype)
        if problem:
            raise ConnectorRefused(f"hicache cannot copy this KV cache: {problem}")
        self.copier = BlockCopier(layers, self.layout.layer_groups, window=self.layout.layer_window,
                                  rank=0 if self.layout.mla else self.rank, ranks=shards, num_groups=self.layout.num_groups)
        self.state_copier = None
        if self.layout.state_layer_names:
            missing = [n for n in self.layout.state_layer_names if n not in kv_caches]
            if missing:
                raise ConnectorRefused(f"vLLM registered no state tensor for layers {missing}")
            states = [_tensors(kv_caches[n]) for n in self.layout.state_layer_names]
            problem = state_problem(states, self.layout.num_blocks, self.layout.state_bytes)
            if problem:
                raise ConnectorRefused(f"hicache cannot copy this engine's state: {problem}")
            self.state_copier = StateCopier(states, self.layout.state_layer_groups, rank=self.rank, ranks=self.layout.tp)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheConnectorMetadata)
        self._unknown_failures -= meta.failures_known
        for plan in meta.loads:
            loaded = 0
            began = time.perf_counter()
            try:
                if plan.run != meta.run:
                    raise RuntimeError("planned under another daemon run (the daemon restarted)")
                if self.faults.take_load_failure():
                    raise RuntimeError(f"fault point {FAIL_LOADS_ENV}")
                if plan.unloadable:
                    raise RuntimeError(plan.unloadable)
                copied = self._attach(meta).load(plan.pages, plan.blocks, plan.window_pages or None)
                copied += self._copy_states(meta, plan.states, load=True)
                loaded = len(plan.pages)
                self.stats.add("loaded_blocks", loaded)
                self.stats.add("loaded_bytes", copied)
            except Exception as exc:  # vLLM recomputes what could not be loaded
                log.warning("hicache: loading %d blocks of %s failed (%s): vLLM recomputes them",
                            len(plan.pages), plan.rid, exc)
                if self.layout.load_async:
                    self._failed_async.add(plan.rid)
                else:
                    self._load_errors.update(b for ids in plan.blocks for b in ids if b != NO_BLOCK)
                    self._unknown_failures.add(meta.step)
                    self._failures_to_report.add(meta.step)
                self.stats.add("load_errors", len(plan.pages))
            if self.layout.load_async:
                self._loaded_async.add(plan.rid)
            self.stats.add("load_seconds", time.perf_counter() - began)
            self.worker_client.send(protos.Release(plan.session, plan.run, plan.lease, loaded, self.rank))

    def _attach(self, meta: HiCacheConnectorMetadata) -> BlockCopier:
        """The copier, attached to the step's L2 pool (a worker of a tensor-parallel engine
        announces its process to that daemon run first, and copies nothing until that
        message is sent)."""
        if self.copier is None:
            raise RuntimeError("register_kv_caches was not called")
        if meta.pool is None:
            raise RuntimeError("no L2 pool is known")
        if self.layout.tp > 1 and meta.run != self._announced_run:
            engine = os.getppid()  # vLLM's executor, where the scheduler half runs, started this worker
            if not self.worker_client.send(protos.EngineWorker(meta.run, engine, process_start_time(engine) or 0,
                                                               own_pid_namespace(), self.rank, os.getpid(),
                                                               process_start_time(os.getpid()) or 0)):
                # a worker the daemon does not know of could still copy after the engine's
                # orphans were freed: no copy until it is announced (the next copy tries again)
                raise RuntimeError("this worker could not announce its process to the daemon")
            self._announced_run = meta.run
        self.copier.attach(meta.pool, meta.window_pool)
        return self.copier

    def _copy_states(self, meta: HiCacheConnectorMetadata, states: list[StateCopy], *, load: bool) -> int:
        """Copy a plan's states (state slot <-> the blocks of the state groups); bytes copied."""
        if not states:
            return 0
        if self.state_copier is None or meta.state_pool is None:
            raise RuntimeError("states to copy, but no state layers or no state pool is known")
        self.state_copier.attach(meta.state_pool)
        copied = 0
        for st in states:
            copied += (self.state_copier.load(st.slot, st.blocks) if load
                       else self.state_copier.save(st.blocks, st.slot))
        return copied

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load completed in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are copied in wait_for_save, once every layer has been computed

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheConnectorMetadata)
        if meta.saves:
            self.faults.stall_saves(self.rank)
        for plan in meta.saves:
            blocks = sum(1 for p in plan.pages if p != NO_PAGE)  # the span may start at a window part only
            ok = False
            began = time.perf_counter()
            try:
                if self._unknown_failures:
                    raise RuntimeError("a load failed in this step or was not known when the save was planned: "
                                       "its blocks may attend to KV that never arrived")
                if plan.run != meta.run:
                    raise RuntimeError("planned under another daemon run (the daemon restarted)")
                copier = self._attach(meta)
                copied = (copier.save(plan.blocks, plan.pages, plan.window_pages or None)
                          if self.rank == 0 or not self.layout.mla else 0)
                copied += self._copy_states(meta, plan.states, load=False)
                ok = True
                self.stats.add("saved_blocks", blocks)
                self.stats.add("saved_bytes", copied)
            except Exception as exc:
                log.warning("hicache: saving %d blocks of %s skipped: %s", blocks, plan.rid, exc)
                self.stats.add("save_skipped_blocks", blocks)
            self.stats.add("save_seconds", time.perf_counter() - began)
            self.worker_client.send(protos.Commit(plan.session, plan.run, plan.lease, ok, self.rank))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose asynchronous load ran since the last call (failed ones too, as
        vLLM wants: ``get_transfer_results`` names those). Saves never delay freeing."""
        done, self._loaded_async = self._loaded_async, set()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving, self._failed_async = self._failed_async, set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The steps whose synchronous load failed here since the last call, for the scheduler
        half (``update_connector_output``); None when there were none."""
        if not self._failures_to_report:
            return None
        failed, self._failures_to_report = frozenset(self._failures_to_report), set()
        return HiCacheWorkerMeta(failed)

    # ================================================================== stats (both halves)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This half's counters since the last call (``vllm_stats``)."""
        if self.session is not None:
            late = self.session.late_leases
            self.stats.add("late_answers", late - self._late_seen)
            self._late_seen = late
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiCacheStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
            if self.events is not None:
                self.events.close()
        elif getattr(self, "worker_client", None) is not None:
            self.worker_client.close()
