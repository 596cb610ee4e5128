"""``HiCacheConnector``: the class vLLM loads, a facade over one side per role.

vLLM makes one connector per role: the scheduler role's delegates to a ``SchedulerSide``
(``scheduler_side``), a worker's to a ``WorkerSide`` (``worker_side``); each vLLM hook goes
to one side, and a hook of the other role fails (an assertion). Both roles read the same
``ConnectorSettings`` at start (refusing, with the reason, an engine hicache cannot serve),
and each counts its own work into its ``HiCacheStats`` (``stats``). ``SupportsHMA``: vLLM's
hybrid allocator stays on, so a model may have several KV cache groups (full attention,
sliding window, a GDN's state; ``plans``). docs/architecture.md §13.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache.connectors.vllm.plans import HiCacheConnectorMetadata
from hicache.connectors.vllm.scheduler_side import SchedulerSide
from hicache.connectors.vllm.settings import ConnectorSettings
from hicache.connectors.vllm.stats import HiCachePromMetrics, HiCacheStats
from hicache.connectors.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("hicache.connector")


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST
    _scheduler: SchedulerSide | None = None
    _worker: WorkerSide | None = None

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.read(vllm_config, kv_cache_config,
                                          self._kv_transfer_config.kv_connector_extra_config or {})
        self.stats = HiCacheStats()  # since the last get_kv_connector_stats (stats)
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._kv_transfer_config
            if transfer.kv_load_failure_policy != "recompute":
                log.info("hicache: kv_load_failure_policy %r -> 'recompute': a block hicache could not load is "
                         "recomputed, never served or failed", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"  # read by vLLM's scheduler after this constructor
            self._scheduler = SchedulerSide(vllm_config, settings, self.stats)
        else:
            self._worker = WorkerSide(settings, self.stats)

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler hook called on a worker's connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker hook called on the scheduler's connector"
        return self._worker

    # ================================================================== scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when its hybrid allocator is on (``SupportsHMA``): as ``request_finished``."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None  # never delays freeing: a save still copying fences its blocks' reuse instead

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache(self._vllm_kept_blocks())

    def _vllm_kept_blocks(self) -> int:
        """Blocks vLLM's block pools hold now besides their null block: vLLM's own prefix
        cache reset succeeds only with none (``BlockPool.reset_prefix_cache``, 0.32), and
        it runs just before this connector's. 0 when no cache manager was bound."""
        manager = self._kv_cache_manager  # set by KVConnectorBase_V1.bind_kv_cache_manager
        if manager is None:
            return 0
        pools = {id(m.block_pool): m.block_pool for m in manager.coordinator.single_type_managers}
        return sum(p.num_gpu_blocks - p.get_num_free_blocks() - 1 for p in pools.values())

    # ================================================================== worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's call before a step's forward pass: the fence of the copy thread's saves."""
        assert isinstance(kv_connector_metadata, HiCacheConnectorMetadata)
        self.worker.fence(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # hicache_copy: layer waits for that layer's copies; sync: a load completed in
        # start_load_kv; async: a loading request is not in the step
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are copied in wait_for_save, once every layer has been computed

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def _metadata(self) -> HiCacheConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheConnectorMetadata)
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving = self.worker.take_failed_async()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    # ================================================================== both roles
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This role's counters since the last call (``stats``)."""
        if self._scheduler is not None:
            self._scheduler.note_late_answers()
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiCacheStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        elif self._worker is not None:
            self._worker.shutdown()
