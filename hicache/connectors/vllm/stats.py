"""hicache's numbers in vLLM's own stats: its log line and its ``/metrics``.

vLLM asks each connector half for ``get_kv_connector_stats`` every step, adds the two
(``aggregate``), ships the data to its logger process, rebuilds it there with
``build_kv_connector_stats`` and hands it to the Prometheus metrics that
``build_prom_metrics`` registered. ``HiCacheStats`` is that data: counters since the last
report (each half reports its own and starts again from zero).

=========================  ==========  ==========================================================
key                        half        counts
=========================  ==========  ==========================================================
``lookups``                scheduler   lookups sent to the daemon
``lookup_misses``          scheduler   lookups that could not be answered (timeout, daemon down
                                       or backing off, refused): counted as misses
``hit_tokens_host``        scheduler   tokens vLLM will load from L2
``hit_tokens_disk``        scheduler   tokens vLLM will load that a prefetch brought from L3
``busy_answers``           scheduler   lookups and reserves the daemon answered busy (its queue
                                       for this engine was full): served without the cache
``reserved_blocks``        scheduler   blocks the daemon reserved L2 pages for
``late_answers``           scheduler   answers that came after their call gave up (their
                                       leases were given back)
``loaded_blocks``          worker      blocks copied from L2 into vLLM's KV
``load_errors``            worker      blocks whose load failed (vLLM recomputes them)
``load_seconds``           worker      time spent copying loads
``saved_blocks``           worker      blocks copied into L2 and committed
``save_skipped_blocks``    both        blocks of a save that was not done (committed as failed;
                                       scheduler: a sliding-window group no longer held them)
``save_seconds``           worker      time spent copying saves
``fence_waits``            worker      forward passes that waited for the copy thread's saves
                                       (``hicache_copy: async``): a block they read was reused
``fence_seconds``          worker      time those waits took
``layer_waits``            worker      attention layers that waited for their layer-wise load
                                       (``hicache_copy: layer``): the copy was behind the compute
``layer_wait_seconds``     worker      time those waits took
``loaded_bytes``           worker      bytes copied by loads (a sliding-window group's layers of
                                       the pages before its window are not copied)
``saved_bytes``            worker      bytes of ``saved_blocks``
=========================  ==========  ==========================================================

Prometheus: ``vllm:hicache_<key>_total`` counters (``hit_tokens_*`` as one
``vllm:hicache_hit_tokens_total`` with a ``tier`` label), with vLLM's per-engine labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

KEYS: tuple[str, ...] = (
    "lookups", "lookup_misses", "lookups_pending", "lookups_unanswered_pending", "hit_tokens_host", "hit_tokens_disk",
    "reserved_blocks", "late_answers", "busy_answers",
    "loaded_blocks", "load_errors", "load_seconds", "saved_blocks", "save_skipped_blocks", "save_seconds",
    "loaded_bytes", "saved_bytes", "fence_waits", "fence_seconds", "layer_waits", "layer_wait_seconds",
)
HIT_TIERS = {"hit_tokens_host": "host", "hit_tokens_disk": "disk"}

_HELP = {
    "lookups": "Lookups hicache's connector sent to the daemon.",
    "lookup_misses": "Lookups without an answer (timeout, daemon down or backing off, refused): misses.",
    "lookups_pending": "Lookups answered pending: the daemon was fetching the prompt's pages from L3.",
    "lookups_unanswered_pending": "Asks about a request whose L3 prefetch was running that got no answer in "
                                  "time: the request kept waiting instead of becoming a miss.",
    "reserved_blocks": "Blocks the daemon reserved L2 pages for, to save into.",
    "busy_answers": "Lookups and reserves the daemon answered busy (its queue for this engine was full); those "
                    "requests went on without the cache.",
    "late_answers": "Daemon answers that came after their call gave up; their leases were given back.",
    "loaded_blocks": "KV blocks copied from hicache's L2 into vLLM's KV cache.",
    "load_errors": "KV blocks whose load from hicache failed; vLLM recomputed them.",
    "load_seconds": "Seconds spent copying KV blocks from hicache's L2.",
    "saved_blocks": "KV blocks copied into hicache's L2 and committed.",
    "save_skipped_blocks": "KV blocks of saves that were not done (committed as failed).",
    "save_seconds": "Seconds spent copying KV blocks into hicache's L2.",
    "fence_waits": "Forward passes that waited for a save of the copy thread (a block it read was reused).",
    "fence_seconds": "Seconds forward passes waited for saves of the copy thread.",
    "layer_waits": "Attention layers that waited for their layer-wise load from hicache's L2.",
    "layer_wait_seconds": "Seconds attention layers waited for their layer-wise loads.",
    "loaded_bytes": "Bytes copied from hicache's L2 into vLLM's KV cache.",
    "saved_bytes": "Bytes copied from vLLM's KV cache into hicache's L2.",
}


@dataclass
class HiCacheStats(KVConnectorStats):
    """Counters since the last report; ``data`` maps each of ``KEYS`` to a number."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in KEYS:
            self.data.setdefault(key, 0)

    def add(self, key: str, value: float = 1) -> None:
        self.data[key] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in KEYS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: round(v, 6) if isinstance(v, float) else v for key, v in self.data.items() if key in KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in KEYS)

    def take(self) -> HiCacheStats | None:
        """A copy of the counters, which start again from zero; None when all are zero."""
        if self.is_empty():
            return None
        out = HiCacheStats(dict(self.data))
        self.reset()
        return out


class HiCachePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per key, with vLLM's per-engine labels."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for key in KEYS:
            if key in HIT_TIERS:
                continue
            self._counters[key] = self._counter_cls(name=f"vllm:hicache_{key}", documentation=_HELP[key],
                                                    labelnames=labelnames)
        self._hits: Any = self._counter_cls(name="vllm:hicache_hit_tokens",
                                       documentation="Prompt tokens vLLM loaded from hicache, by tier "
                                                     "(host: L2, disk: prefetched from L3).",
                                       labelnames=[*labelnames, "tier"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key in HIT_TIERS:
                self._hits.labels(*labels, HIT_TIERS[key]).inc(value)
            elif key in self._counters:
                self._counters[key].labels(*labels).inc(value)
