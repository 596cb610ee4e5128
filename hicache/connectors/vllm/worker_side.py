"""The worker side of ``HiCacheConnector`` (one per vLLM worker process: one per tensor-parallel rank).

It copies between vLLM's KV tensors and the daemon's L2 pool as the step's
``HiCacheConnectorMetadata`` plans, and ends each plan's lease with its own rank:

=======================  ==============================================================
vLLM calls               this side
=======================  ==============================================================
``register_kv_caches``   checks the KV layout (CPU, block index first, contiguous
                         blocks) and the state layers; builds the copiers
``start_load_kv``        copies every planned load before the forward pass (so
                         ``wait_for_layer_load`` waits for nothing); ``Release`` each.
                         ``hicache_copy: async``: hands them to the copy thread;
                         ``layer``: to the layer loader (``layer_loads``)
``wait_for_layer_load``  ``layer``: waits until that layer of the step's loads is copied
``wait_for_save``        (``layer``: first finishes the step's loads, ``Release`` each)
                         copies the step's new full blocks into their reserved pages;
                         ``Commit`` each (ok or not); ``async`` / ``layer``: on the copy thread
``get_finished`` ...     reports asynchronous loads done (``failed_recving``: failed)
``get_block_ids_with_    reports a failed synchronous load's blocks: vLLM recomputes
load_errors``            them (the connector sets ``kv_load_failure_policy: recompute``)
=======================  ==============================================================

Rules:

====================  ===================================================================
what                  rule
====================  ===================================================================
a plan of another     fails (load) or is not saved: its page numbers index another
daemon run            daemon's pool
a failed synchronous  (a layer-wise load is one: its request is in the step) no save of
load                  that step is committed ok, nor of any later step until a
                      step's metadata names it (``failures_known``, from this side's
                      ``HiCacheWorkerMeta``): every request of the step may attend to the
                      failed blocks, which vLLM caches when it allocates them. A rank's
                      failed load is released as loading nothing; vLLM joins the ranks'
                      load errors, so every rank recomputes
tensor parallelism    each rank copies its own heads of every layer (``BlockCopier``'s
                      shard: a page has one layout at any rank count) and its heads'
                      share of each state; the daemon inserts a page when every rank
                      committed it, unlocks it when every rank released it. Before its
                      first copy under a daemon run a rank announces its process
                      (``EngineWorker``): a dead engine's pages are freed only once its
                      workers are gone too
MLA                   every rank holds the whole latent: rank 0 alone saves it (the others
                      commit without copying), every rank loads it
====================  ===================================================================

docs/architecture.md §13.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

import protos
from hicache.cache_server.leases import own_pid_namespace, process_start_time
from hicache.connectors.copy_thread import CopyJob, CopyThread
from hicache.connectors.engine_client import EngineClient
from hicache.connectors.faults import FAIL_LOADS_ENV
from hicache.connectors.kv_copy import NO_BLOCK, NO_PAGE, BlockCopier, StateCopier, kv_problem, state_problem
from hicache.connectors.layer_loads import LayerLoad, LayerLoads
from hicache.connectors.vllm.layout import ConnectorRefused
from hicache.connectors.vllm.plans import (
    HiCacheConnectorMetadata,
    HiCacheWorkerMeta,
    LoadPlan,
    SavePlan,
    StateCopy,
)
from hicache.connectors.vllm.settings import ConnectorSettings
from hicache.connectors.vllm.stats import HiCacheStats

log = logging.getLogger("hicache.connector")


def _fails(why: str) -> Callable[[], int]:
    """A layer's copy that raises ``why`` (the fault point of a layer-wise load)."""
    def copy() -> int:
        raise RuntimeError(why)
    return copy


def _tensors(value: Any) -> list[torch.Tensor]:
    """A layer's KV cache entry as a list of tensors (a state layer's is a list or tuple)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


class WorkerSide:
    """The worker role's state and calls (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, stats: HiCacheStats) -> None:
        self.layout = settings.layout
        self.geometry = settings.layout.geometry
        self.faults = settings.faults
        self.stats = stats
        self.worker_client = EngineClient(settings.address, settings.timeout_ms, curve=settings.curve)
        self.copier: BlockCopier | None = None
        self.state_copier: StateCopier | None = None
        self.rank = get_tensor_model_parallel_rank()
        self._announced_run = 0  # the daemon run this worker announced its process to (EngineWorker)
        self._load_errors: set[int] = set()
        self._unknown_failures: set[int] = set()  # steps whose load failed here, not yet known to the
        # scheduler side: nothing computed since may be saved (it may attend to the failed blocks)
        self._failures_to_report: set[int] = set()  # for the next HiCacheWorkerMeta
        self._loaded_async: set[str] = set()  # asynchronous loads done (or failed) since the last report
        self._failed_async: set[str] = set()  # of which these failed
        self.copies: CopyThread | None = None  # hicache_copy: async or layer (saves; async: loads too)
        if settings.copy_mode != "sync":
            self.copies = CopyThread(settings.address, settings.timeout_ms, curve=settings.curve,
                                     before_save=settings.faults.slow_copy)
        self.layer_loads: LayerLoads | None = None  # hicache_copy: layer, an engine whose hits load in the step
        self._layer_index: dict[str, int] = {}
        self._layer_meta: HiCacheConnectorMetadata | None = None  # the step whose layer-wise loads run
        if settings.copy_mode == "layer" and not self.layout.load_async:
            self.layer_loads = LayerLoads(len(self.layout.layer_names), before_layer=settings.faults.slow_copy)
            self._layer_index = {name: i for i, name in enumerate(self.layout.layer_names)}

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

    def fence(self, meta: HiCacheConnectorMetadata) -> None:
        """Before the step's forward pass writes anything: wait for the copy thread's saves
        that read a block vLLM gave out in this step (``fresh_blocks``: freed by a finished or
        preempted request, or out of a sliding window, then reused)."""
        if self.copies is not None and meta.fresh_blocks:
            waited = self.copies.wait_for_blocks(meta.fresh_blocks)
            if waited:
                self.stats.add("fence_waits")
                self.stats.add("fence_seconds", waited)

    def start_load_kv(self, meta: HiCacheConnectorMetadata) -> None:
        self.finish_layer_loads()  # the last step's, when vLLM deferred its wait_for_save
        self._unknown_failures -= meta.failures_known
        self.fence(meta)  # vLLM calls handle_preemptions first; a load must not overtake a fence either
        layered: list[LayerLoad] = []
        for plan in meta.loads:
            if self.layer_loads is not None:
                load = self._layer_load(meta, plan)
                if load is not None:
                    layered.append(load)
            elif self.copies is not None:
                self._load_on_copy_thread(meta, plan)
            else:
                self._load_now(meta, plan)
        if layered:
            assert self.layer_loads is not None
            self._layer_meta = meta
            self.layer_loads.start(layered)

    def _layer_load(self, meta: HiCacheConnectorMetadata, plan: LoadPlan) -> LayerLoad | None:
        """``plan`` split by layer for the layer loader; None when it fails at once (its
        blocks are load errors, its lease released as loading nothing). The fault point's
        load fails at its last layer, after the others were copied."""
        try:
            self._load_check(meta, plan, fault=False)
            if plan.states:
                raise RuntimeError("a layer-wise load copies no states")
            layers = self._attach(meta).layer_loads(plan.pages, plan.blocks, plan.window_pages or None)
        except Exception as exc:
            self._load_failed(meta, plan, str(exc), reported_async=False)
            self.worker_client.send(protos.Release(plan.session, plan.run, plan.lease, 0, self.rank))
            return None
        if self.faults.take_load_failure():
            layers[-1] = _fails(f"fault point {FAIL_LOADS_ENV}")
        return LayerLoad(plan.rid, len(plan.pages), layers, payload=plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until layer ``layer_name`` of this step's layer-wise loads is copied."""
        if self.layer_loads is None:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        waited = self.layer_loads.wait(i)
        if waited:
            self.stats.add("layer_waits")
            self.stats.add("layer_wait_seconds", waited)

    def finish_layer_loads(self) -> None:
        """Wait for the step's layer-wise loads, then end each one's lease: a load that failed
        is reported as load errors (vLLM recomputes its blocks) and released as loading nothing."""
        if self.layer_loads is None or self._layer_meta is None:
            return
        meta, self._layer_meta = self._layer_meta, None
        loads, seconds = self.layer_loads.finish()
        self.stats.add("load_seconds", seconds)
        for load in loads:
            plan = load.payload
            assert isinstance(plan, LoadPlan)
            if load.ok:
                self.stats.add("loaded_blocks", load.pages)
                self.stats.add("loaded_bytes", load.copied)
            else:
                self._load_failed(meta, plan, load.error, reported_async=False)
            self.worker_client.send(protos.Release(plan.session, plan.run, plan.lease,
                                                   load.pages if load.ok else 0, self.rank))

    def _load_check(self, meta: HiCacheConnectorMetadata, plan: LoadPlan, *, fault: bool = True) -> None:
        """Raise when ``plan`` must fail instead of loading (``fault``: the fault point may fail it here)."""
        if plan.run != meta.run:
            raise RuntimeError("planned under another daemon run (the daemon restarted)")
        if fault and self.faults.take_load_failure():
            raise RuntimeError(f"fault point {FAIL_LOADS_ENV}")
        if plan.unloadable:
            raise RuntimeError(plan.unloadable)

    def _load_failed(self, meta: HiCacheConnectorMetadata, plan: LoadPlan, why: str, *, reported_async: bool) -> None:
        if reported_async:
            self._async_load_failed(plan.rid, len(plan.pages), why)
            return
        log.warning("hicache: loading %d blocks of %s failed (%s): vLLM recomputes them", len(plan.pages), plan.rid, why)
        self._load_errors.update(b for ids in plan.blocks for b in ids if b != NO_BLOCK)
        self._unknown_failures.add(meta.step)
        self._failures_to_report.add(meta.step)
        self.stats.add("load_errors", len(plan.pages))

    def _async_load_failed(self, rid: str, pages: int, why: str) -> None:
        """An asynchronous load of ``rid`` failed: reported as ``failed_recving``, recomputed."""
        log.warning("hicache: loading %d blocks of %s failed (%s): vLLM recomputes them", pages, rid, why)
        self._failed_async.add(rid)
        self.stats.add("load_errors", pages)

    def _load_now(self, meta: HiCacheConnectorMetadata, plan: LoadPlan) -> None:
        """Copy ``plan`` before the forward pass, then release its lease."""
        loaded = 0
        began = time.perf_counter()
        try:
            self._load_check(meta, plan)
            copied = self._attach(meta).load(plan.pages, plan.blocks, plan.window_pages or None)
            copied += self._copy_states(meta, plan.states, load=True)
            loaded = len(plan.pages)
            self.stats.add("loaded_blocks", loaded)
            self.stats.add("loaded_bytes", copied)
        except Exception as exc:  # vLLM recomputes what could not be loaded
            self._load_failed(meta, plan, str(exc), reported_async=self.layout.load_async)
        if self.layout.load_async:
            self._loaded_async.add(plan.rid)
        self.stats.add("load_seconds", time.perf_counter() - began)
        self.worker_client.send(protos.Release(plan.session, plan.run, plan.lease, loaded, self.rank))

    def _load_on_copy_thread(self, meta: HiCacheConnectorMetadata, plan: LoadPlan) -> None:
        """Hand ``plan`` to the copy thread (its request waits for it alone); a plan that
        cannot load fails at once."""
        assert self.copies is not None
        try:
            self._load_check(meta, plan)
            copier = self._attach(meta)
            states = self._attach_states(meta, plan.states)
        except Exception as exc:
            self._load_failed(meta, plan, str(exc), reported_async=True)
            self._loaded_async.add(plan.rid)
            self.worker_client.send(protos.Release(plan.session, plan.run, plan.lease, 0, self.rank))
            return

        def copy() -> int:
            copied = copier.load(plan.pages, plan.blocks, plan.window_pages or None)
            return copied + sum(states.load(st.slot, st.blocks) for st in plan.states) if states else copied

        def end_lease(ok: bool) -> protos.Message:
            return protos.Release(plan.session, plan.run, plan.lease, len(plan.pages) if ok else 0, self.rank)

        self.copies.submit(CopyJob(plan.rid, "load", len(plan.pages), copy, end_lease))

    def _attach(self, meta: HiCacheConnectorMetadata) -> BlockCopier:
        """The copier, attached to the step's L2 pool (a worker of a tensor-parallel engine
        announces its process to that daemon run first, and copies nothing until that
        message is sent)."""
        if self.copier is None:
            raise RuntimeError("register_kv_caches was not called")
        if meta.pool is None:
            raise RuntimeError("no L2 pool is known")
        if self.layout.tp > 1 and meta.run != self._announced_run:
            engine = os.getppid()  # vLLM's executor, where the scheduler side runs, started this worker
            if not self.worker_client.send(protos.EngineWorker(meta.run, engine, process_start_time(engine) or 0,
                                                               own_pid_namespace(), self.rank, os.getpid(),
                                                               process_start_time(os.getpid()) or 0)):
                # a worker the daemon does not know of could still copy after the engine's
                # orphans were freed: no copy until it is announced (the next copy tries again)
                raise RuntimeError("this worker could not announce its process to the daemon")
            self._announced_run = meta.run
        if self.copies is not None and not self.copier.maps(meta.pool, meta.window_pool):
            self.copies.drain()  # the copy thread still copies through the mapping about to change
        self.copier.attach(meta.pool, meta.window_pool)
        return self.copier

    def _attach_states(self, meta: HiCacheConnectorMetadata, states: list[StateCopy]) -> StateCopier | None:
        """The state copier, attached to the step's state pool; None when ``states`` is empty."""
        if not states:
            return None
        if self.state_copier is None or meta.state_pool is None:
            raise RuntimeError("states to copy, but no state layers or no state pool is known")
        if self.copies is not None and self.state_copier.pool != meta.state_pool:
            self.copies.drain()
        self.state_copier.attach(meta.state_pool)
        return self.state_copier

    def _copy_states(self, meta: HiCacheConnectorMetadata, states: list[StateCopy], *, load: bool) -> int:
        """Copy a plan's states (state slot <-> the blocks of the state groups); bytes copied."""
        copier = self._attach_states(meta, states)
        if copier is None:
            return 0
        return sum(copier.load(st.slot, st.blocks) if load else copier.save(st.blocks, st.slot) for st in states)

    def wait_for_save(self, meta: HiCacheConnectorMetadata) -> None:
        self.finish_layer_loads()  # a save must know whether a load of its step failed
        if meta.saves:
            self.faults.stall_saves(self.rank)
        for plan in meta.saves:
            # a state offer holds for this step only (vLLM rewrites its block after it): copied now
            if self.copies is not None and not plan.states:
                self._save_on_copy_thread(meta, plan)
            else:
                self._save_now(meta, plan)

    def _save_check(self, meta: HiCacheConnectorMetadata, plan: SavePlan) -> BlockCopier:
        """The attached copier; raises when ``plan`` must not be saved."""
        if self._unknown_failures:
            raise RuntimeError("a load failed in this step or was not known when the save was planned: "
                               "its blocks may attend to KV that never arrived")
        if plan.run != meta.run:
            raise RuntimeError("planned under another daemon run (the daemon restarted)")
        return self._attach(meta)

    def _copies_page_data(self) -> bool:
        """MLA: every rank holds the whole latent, rank 0 alone copies it (the others commit)."""
        return self.rank == 0 or not self.layout.mla

    def _save_skipped(self, rid: str, blocks: int, why: str) -> None:
        log.warning("hicache: saving %d blocks of %s skipped: %s", blocks, rid, why)
        self.stats.add("save_skipped_blocks", blocks)

    @staticmethod
    def _saved_blocks(plan: SavePlan) -> int:
        """Blocks ``plan`` saves (its span may start at a window part only)."""
        return sum(1 for p in plan.pages if p != NO_PAGE)

    def _save_now(self, meta: HiCacheConnectorMetadata, plan: SavePlan) -> None:
        """Copy ``plan`` after the forward pass, then commit its lease."""
        blocks = self._saved_blocks(plan)
        ok = False
        began = time.perf_counter()
        try:
            copier = self._save_check(meta, plan)
            copied = copier.save(plan.blocks, plan.pages, plan.window_pages or None) if self._copies_page_data() else 0
            copied += self._copy_states(meta, plan.states, load=False)
            ok = True
            self.stats.add("saved_blocks", blocks)
            self.stats.add("saved_bytes", copied)
        except Exception as exc:
            self._save_skipped(plan.rid, blocks, str(exc))
        self.stats.add("save_seconds", time.perf_counter() - began)
        self.worker_client.send(protos.Commit(plan.session, plan.run, plan.lease, ok, self.rank))

    def _save_on_copy_thread(self, meta: HiCacheConnectorMetadata, plan: SavePlan) -> None:
        """Hand ``plan`` to the copy thread, which commits it once copied; a plan that must
        not be saved is committed not ok at once."""
        assert self.copies is not None
        blocks = self._saved_blocks(plan)
        try:
            copier = self._save_check(meta, plan)
        except Exception as exc:
            self._save_skipped(plan.rid, blocks, str(exc))
            self.worker_client.send(protos.Commit(plan.session, plan.run, plan.lease, False, self.rank))
            return
        copies_data = self._copies_page_data()

        def copy() -> int:
            return copier.save(plan.blocks, plan.pages, plan.window_pages or None) if copies_data else 0

        def end_lease(ok: bool) -> protos.Message:
            return protos.Commit(plan.session, plan.run, plan.lease, ok, self.rank)

        reads = frozenset(b for ids in plan.blocks for b in ids if b != NO_BLOCK)
        self.copies.submit(CopyJob(plan.rid, "save", blocks, copy, end_lease, reads))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose asynchronous load ran since the last call (failed ones too, as
        vLLM wants: ``get_transfer_results`` names those). Saves never delay freeing: a block
        a save still reads is fenced instead (``fence``)."""
        if self.copies is not None:
            self._take_copies()
        done, self._loaded_async = self._loaded_async, set()
        return None, done or None

    def _take_copies(self) -> None:
        """Count the copy thread's finished copies; note its loads as done (or failed)."""
        assert self.copies is not None
        for job in self.copies.take_done():
            if job.kind == "load":
                self._loaded_async.add(job.rid)
                self.stats.add("load_seconds", job.seconds)
                if job.ok:
                    self.stats.add("loaded_blocks", job.pages)
                    self.stats.add("loaded_bytes", job.copied)
                else:
                    self._async_load_failed(job.rid, job.pages, job.error)
            else:
                self.stats.add("save_seconds", job.seconds)
                if job.ok:
                    self.stats.add("saved_blocks", job.pages)
                    self.stats.add("saved_bytes", job.copied)
                else:
                    self._save_skipped(job.rid, job.pages, job.error)
            if not job.lease_ended:
                log.warning("hicache: the end of a %s lease of %s could not be sent (the daemon is not connected)",
                            job.kind, job.rid)

    def take_failed_async(self) -> set[str]:
        """The requests whose asynchronous load failed since the last call (``failed_recving``)."""
        failed, self._failed_async = self._failed_async, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.finish_layer_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> HiCacheWorkerMeta | None:
        """The steps whose synchronous load failed here since the last call, for the scheduler
        side (``update_connector_output``); None when there were none."""
        if not self._failures_to_report:
            return None
        failed, self._failures_to_report = frozenset(self._failures_to_report), set()
        return HiCacheWorkerMeta(failed)

    def shutdown(self) -> None:
        if self.layer_loads is not None:
            self.layer_loads.close()
        if self.copies is not None:
            self.copies.close()
        self.worker_client.close()
