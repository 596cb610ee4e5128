"""Every metric hicache exports, defined once, and who records which (docs/architecture.md §11).

``SPECS`` names every metric (names start with ``hicache_``); the tuples below are the only
values each label takes, which keeps the series set bounded.

Who records what (one writer per series, so nothing is counted twice):

=====================  =====================================================================
process                metrics
=====================  =====================================================================
tokenizer              requests_total, ttft, e2e and inter-token latency, prompt, generation
                       and cached tokens — all through ``Metrics.track_request``
scheduler              pool used/capacity (``set_pool``), queue depths (``set_queue``),
                       evictions (``evicted``), prefetch and backup tokens, time a forward
                       pass waited for load-backs (``load_join_waited``)
controller             transfers (``transfer`` context manager, ``transfer_done``, ``transfer_bytes``),
                       storage errors (``storage_op`` / ``storage_error``), ``set_storage_up``,
                       ``set_storage_attached``, the L3 size (``set_storage_size``:
                       ``hicache_storage_bytes`` / ``_pages``)
launcher               process restarts (``process_restarted``)
tokenizer, at scrape   the scheduler's and controller's health (``set_process_health``:
                       ``hicache_process_up``, ``hicache_process_heartbeat_age_seconds``), read
                       from the heartbeat files ``/health`` reads, right before each render
=====================  =====================================================================

Every one-label series exists from the start, at 0: each process creates the series it owns
(``SERIES_OWNERS``) in ``init_process_metrics``, so alerts never meet an absent series. The
process health series are not counters: they are set on every ``/metrics`` request, for
every heartbeat process the daemon runs, so they are in every exposition from the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TIERS = ("device", "host", "storage")
"""``tier`` label values everywhere: L1 (device), L2 (host), L3 (storage)."""

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
"""``direction`` label values: device->host, host->device, host->storage, storage->host."""

REQUEST_STATUSES = ("ok", "invalid", "aborted", "error")
"""``status`` of ``hicache_requests_total``: answered; refused by validation (4xx); ended by
the client's disconnect, a shutdown or the scheduler's abort; failed (5xx)."""

BACKUP_FAILURE_OUTCOMES = ("retried", "abandoned")
"""``outcome`` of ``hicache_backup_failures_total``: a failed L3 backup whose pages are backed
up again later, or one given up on after its last retry (its pages stay in L2 only)."""

STORAGE_OPS = ("get", "set", "exists", "delete")
"""``op`` of ``hicache_storage_errors_total``: the storage (L3) calls whose failures are counted."""

PROCESSES = ("tokenizer", "scheduler", "controller")
"""The daemon's supervised processes: the allowed ``process`` of ``hicache_process_restarts_total``."""

RESTARTABLE = ("controller",)
"""The processes the launcher restarts (the others end the daemon when they die), each with a
``hicache_process_restarts_total`` series from the start."""

Kind = Literal["counter", "gauge", "histogram"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_EVENT_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its full exposition name (counters end in ``_total``), help, labels."""

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("hicache_cached_tokens_total", "counter",
               "Prompt tokens served from the cache, by the tier they came from", ("tier",)),
    MetricSpec("hicache_prompt_tokens_total", "counter", "Prompt tokens of finished requests"),
    MetricSpec("hicache_generation_tokens_total", "counter", "Tokens generated and returned to clients"),
    MetricSpec("hicache_requests_total", "counter", "Generation requests by outcome", ("status",)),
    MetricSpec("hicache_ttft_seconds", "histogram", "Time from request arrival to its first output token",
               buckets=_LATENCY_BUCKETS),
    MetricSpec("hicache_e2e_latency_seconds", "histogram", "Time from request arrival to its last output token",
               buckets=_E2E_BUCKETS),
    MetricSpec("hicache_inter_token_latency_seconds", "histogram", "Time between consecutive output tokens",
               buckets=_ITL_BUCKETS),
    MetricSpec("hicache_pool_used_tokens", "gauge", "Tokens held in a pool", ("tier", "component")),
    MetricSpec("hicache_pool_capacity_tokens", "gauge", "Tokens a pool can hold", ("tier", "component")),
    MetricSpec("hicache_transfer_bytes_total", "counter", "Bytes moved between tiers", ("direction",)),
    MetricSpec("hicache_transfer_seconds", "histogram", "Duration of one transfer between tiers", ("direction",),
               buckets=_TRANSFER_BUCKETS),
    MetricSpec("hicache_evicted_tokens_total", "counter", "Tokens evicted from a tier", ("tier",)),
    MetricSpec("hicache_prefetch_tokens_total", "counter", "Tokens prefetched from storage into host memory"),
    MetricSpec("hicache_backup_tokens_total", "counter", "Tokens backed up from host memory to storage"),
    MetricSpec("hicache_backup_failures_total", "counter",
               "Failed backups to storage: retried later, or abandoned after the last retry (their pages stay "
               "in host memory only)", ("outcome",)),
    MetricSpec("hicache_storage_errors_total", "counter", "Failed storage (L3) operations", ("op",)),
    MetricSpec("hicache_storage_up", "gauge",
               "1 while the storage (L3) backend is attached and healthy, else 0 (0 also with none attached)"),
    MetricSpec("hicache_storage_attached", "gauge",
               "1 while a storage (L3) backend is attached (cache.l3.backend or PUT /cache/storage), "
               "0 with none (cache.l3.backend: none, or detached)"),
    MetricSpec("hicache_queue_requests", "gauge", "Requests in a scheduler queue", ("queue",)),
    MetricSpec("hicache_load_join_wait_seconds_total", "counter",
               "Time the scheduler held a forward pass for load-backs about to finish, so they could join it"),
    MetricSpec("hicache_process_restarts_total", "counter", "Restarts of a daemon process", ("process",)),
    MetricSpec("hicache_storage_bytes", "gauge",
               "Bytes of page objects the storage (L3) backend holds; absent where the backend cannot tell"),
    MetricSpec("hicache_storage_pages", "gauge",
               "Page objects the storage (L3) backend holds; absent where the backend cannot tell"),
    MetricSpec("hicache_kv_events_total", "counter",
               "KV events for routers (events.enabled): published, or dropped because the publisher's "
               "queue was full", ("outcome",)),
    MetricSpec("hicache_kv_event_lag_seconds", "histogram",
               "Per KV event batch: from the oldest tier change in it to the batch on the socket",
               buckets=_EVENT_LAG_BUCKETS),
    MetricSpec("hicache_tenant_used_tokens", "gauge",
               "Tokens a tenant's cached pages hold in a tier (server.api_keys; L2: L3 is hicache_tenant_l3_used_bytes)", ("tenant", "tier")),
    MetricSpec("hicache_tenant_quota_tokens", "gauge",
               "A tenant's quota in a tier (server.api_keys[].quota)", ("tenant", "tier")),
    MetricSpec("hicache_tenant_l3_used_bytes", "gauge",
               "Bytes a tenant's L3 partition holds (server.api_keys[].quota.l3_gb; the file store)", ("tenant",)),
    MetricSpec("hicache_tenant_l3_quota_bytes", "gauge",
               "The size of a tenant's L3 partition (server.api_keys[].quota.l3_gb)", ("tenant",)),
    MetricSpec("hicache_pinned_tokens", "gauge",
               "Tokens pinned prefixes hold in a tier (cache.pinned, PUT /cache/pinned)", ("tier",)),
    MetricSpec("hicache_process_up", "gauge",
               "1 while a process is alive, its heartbeat is at most server.health_stale_s old and it "
               "has not had work without progress for longer (what /health calls ok), else 0", ("process",)),
    MetricSpec("hicache_process_heartbeat_age_seconds", "gauge",
               "Seconds since a process last wrote its heartbeat, read when /metrics is scraped "
               "(NaN while it has none)", ("process",)),
    MetricSpec("hicache_process_stalled_seconds", "gauge",
               "Seconds a process has had work without making progress on it (the scheduler: requests "
               "that no forward pass serves), read when /metrics is scraped; 0 while it progresses",
               ("process",)),
)

KV_EVENT_OUTCOMES = ("published", "dropped")

SERIES_OWNERS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "tokenizer": (("hicache_cached_tokens_total", "tier", TIERS),
                  ("hicache_requests_total", "status", REQUEST_STATUSES)),
    "scheduler": (("hicache_evicted_tokens_total", "tier", ("device", "host")),
                  ("hicache_kv_events_total", "outcome", KV_EVENT_OUTCOMES),
                  ("hicache_backup_failures_total", "outcome", BACKUP_FAILURE_OUTCOMES)),
    "controller": (("hicache_transfer_bytes_total", "direction", DIRECTIONS),
                   ("hicache_transfer_seconds", "direction", DIRECTIONS),
                   ("hicache_storage_errors_total", "op", STORAGE_OPS)),
    "launcher": (("hicache_process_restarts_total", "process", RESTARTABLE),),
}
"""The one-label series each process creates at zero when it starts (``init_process_metrics``):
``(metric, label, every value)``. Each series is created by the process that records it, so
``/metrics`` shows every combination with 0 right after start instead of leaving it absent
until its first event. Gauges with labels (pool fill, queue depths) are set by their owner's
first publish, at start, and need no entry. Evictions are counted for L1 and L2 only (the
scheduler's tree evicts those; the L3 backends evict on their own), so ``tier="storage"``
has no eviction series."""
