"""Prometheus metrics of every hicache process, served as one ``/metrics`` (docs/architecture.md §11).

All metrics are defined once, in ``SPECS`` below; names start with ``hicache_``. They use
prometheus-client's multiprocess mode: each process writes its samples to memory-mapped
files in one shared directory, and the tokenizer process renders the union of all of them.

Lifecycle (who calls what)::

    launcher   prepare_multiprocess_dir(path)   before spawning anything: creates/wipes the
                                                directory and sets PROMETHEUS_MULTIPROC_DIR,
                                                which spawned children inherit
               init_process_metrics(cfg, "launcher")   to count restarts
               mark_process_dead(pid)           after reaping any child (dead or restarted)
    each child init_process_metrics(cfg, name)  once at start, before recording anything
    tokenizer  render_metrics() -> bytes        the body of GET /metrics

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

Recording goes through the methods of ``Metrics`` — helpers and context managers that wrap
the thing measured — never through the prometheus objects. When metrics are disabled
(``metrics.enabled: false``), or before ``init_process_metrics``, every method is a no-op
and ``render_metrics`` returns None.

Gauges use ``livemostrecent``: the value is the one last set by a live process, and a dead
process's values disappear once the launcher calls ``mark_process_dead``. Counters and
histograms are summed over all processes, dead ones included, so a restarted controller's
totals keep counting from where the dead one stopped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from hicache.config import MetricsConfig
from hicache.runtime.heartbeat import HEARTBEAT_PROCESSES

log = logging.getLogger("hicache.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""The environment variable prometheus-client reads for the shared sample directory."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The media type of ``render_metrics()`` output (Prometheus text exposition 0.0.4)."""

TIERS = ("device", "host", "storage")
"""``tier`` label values everywhere: L1 (device), L2 (host), L3 (storage)."""

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
"""``direction`` label values: device->host, host->device, host->storage, storage->host."""

REQUEST_STATUSES = ("ok", "invalid", "aborted", "error")
"""``status`` of ``hicache_requests_total``: answered; refused by validation (4xx); ended by
the client's disconnect, a shutdown or the scheduler's abort; failed (5xx)."""

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
                  ("hicache_kv_events_total", "outcome", KV_EVENT_OUTCOMES)),
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


# --------------------------------------------------------------------------- lifecycle


def prepare_multiprocess_dir(path: str | os.PathLike[str]) -> Path:
    """Make ``path`` an empty private directory and export it as ``PROMETHEUS_MULTIPROC_DIR``.

    The launcher calls this before spawning the processes (they inherit the environment) and
    before its own ``init_process_metrics``. Stale sample files of an earlier run are removed,
    so counters start at zero. Returns the directory.
    """
    p = Path(path)
    if p.exists():
        for child in p.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ[MULTIPROC_ENV] = str(p)
    return p


def mark_process_dead(pid: int) -> None:
    """Drop the gauge values of a dead process (its counters keep counting in the totals).

    The launcher calls this after reaping a child, before restarting it. A no-op outside
    multiprocess mode.
    """
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]  # unannotated in prometheus_client


_current: Metrics | None = None


def init_process_metrics(config: MetricsConfig, process: str) -> Metrics:
    """Create this process's metrics (once per process; a second call returns the first result).

    With ``config.enabled`` and ``PROMETHEUS_MULTIPROC_DIR`` set, samples go to the shared
    directory. Enabled without the variable (a process started on its own), samples stay in
    this process and ``render_metrics`` shows only them. Disabled: a no-op ``Metrics``.
    The series ``process`` owns (``SERIES_OWNERS``) are created at zero.
    """
    global _current
    if _current is not None:
        return _current
    if not config.enabled:
        _current = Metrics(None)
        return _current
    from prometheus_client import CollectorRegistry, values

    if os.environ.get(MULTIPROC_ENV):
        # prometheus-client picks its value class when it is first imported; if that happened
        # before the directory was exported (a launcher that imported it early), switch now,
        # before any metric of this process exists.
        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
    else:
        log.warning("%s is not set: /metrics shows the metrics of the %s process only", MULTIPROC_ENV, process)
    _current = Metrics(CollectorRegistry(auto_describe=True))
    _current.init_series(process)
    return _current


def get_metrics() -> Metrics:
    """This process's metrics; a no-op instance before ``init_process_metrics``."""
    return _current if _current is not None else _NOOP


def render_metrics() -> bytes | None:
    """The exposition text of all processes' metrics; None when metrics are disabled."""
    m = get_metrics()
    if not m.enabled:
        return None
    from prometheus_client import CollectorRegistry, generate_latest

    path = os.environ.get(MULTIPROC_ENV)
    if path:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
        return generate_latest(registry)
    return generate_latest(m.registry) if m.registry is not None else None


# --------------------------------------------------------------------------- recording


class _Noop:
    """Stands in for every prometheus object when metrics are disabled."""

    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


def _check(label: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{label} must be one of {', '.join(allowed)}; got {value!r}")


class Metrics:
    """The recording API. Every method is cheap and never raises for a valid label value.

    Label values are checked (``tier`` in ``TIERS``, ``direction`` in ``DIRECTIONS``,
    request ``status`` in ``REQUEST_STATUSES``) to keep the series set bounded; a wrong one
    is a ValueError (a programming error). Thread-safe.
    """

    def __init__(self, registry: Any | None) -> None:
        """``registry`` None = disabled (every method a no-op)."""
        self.registry = registry
        self.enabled = registry is not None
        self._m: dict[str, Any] = {}
        self._children: dict[tuple[str, str], Any] = {}
        for spec in SPECS:
            self._m[spec.name] = self._make(spec) if registry is not None else _Noop()

    def init_series(self, process: str) -> None:
        """Create, at zero, every series ``process`` owns (``SERIES_OWNERS``; an unknown
        process owns none). Idempotent; a no-op when disabled."""
        if not self.enabled:
            return
        for name, _label, values in SERIES_OWNERS.get(process, ()):
            for value in values:
                self._child(name, value)

    def _child(self, name: str, value: str) -> Any:
        """The series of one-label metric ``name`` for label value ``value``, looked up once.

        prometheus-client's ``labels(...)`` takes a lock and builds a key on every call; the
        hot paths (one transfer per controller op) reuse the child instead. Callers pass only
        checked values, so the cache stays as small as the label set."""
        child = self._children.get((name, value))
        if child is None:
            child = self._children[(name, value)] = self._m[name].labels(value)
        return child

    def _make(self, spec: MetricSpec) -> Any:
        from prometheus_client import Counter, Gauge, Histogram

        if spec.kind == "counter":
            return Counter(spec.name.removesuffix("_total"), spec.doc, spec.labels, registry=self.registry)
        if spec.kind == "gauge":
            return Gauge(spec.name, spec.doc, spec.labels, registry=self.registry,
                         multiprocess_mode="livemostrecent")
        return Histogram(spec.name, spec.doc, spec.labels, registry=self.registry, buckets=spec.buckets)

    # ---- tokenizer

    def track_request(self) -> RequestTracker:
        """A tracker for one generation request, started now; use it as a context manager."""
        return RequestTracker(self)

    def _request_done(self, status: str, latency: float | None, usage: TokenCounts | None) -> None:
        _check("status", status, REQUEST_STATUSES)
        self._m["hicache_requests_total"].labels(status=status).inc()
        if latency is not None:
            self._m["hicache_e2e_latency_seconds"].observe(latency)
        if usage is not None:
            self._m["hicache_prompt_tokens_total"].inc(usage.prompt)
            self._m["hicache_generation_tokens_total"].inc(usage.completion)
            for tier, n in zip(TIERS, (usage.device, usage.host, usage.storage), strict=True):
                if n:
                    self._m["hicache_cached_tokens_total"].labels(tier=tier).inc(n)

    # ---- scheduler

    def set_pool(self, tier: str, component: str, used: int, capacity: int) -> None:
        """The current fill of one pool (tier ``device`` or ``host``, component ``full`` ...)."""
        _check("tier", tier, TIERS)
        self._m["hicache_pool_used_tokens"].labels(tier=tier, component=component).set(used)
        self._m["hicache_pool_capacity_tokens"].labels(tier=tier, component=component).set(capacity)

    def set_tenant_usage(self, tenant: str, tier: str, used: int, quota: int | None) -> None:
        """A tenant's cached tokens in ``tier`` (and its quota there, when it has one)."""
        _check("tier", tier, TIERS)
        self._m["hicache_tenant_used_tokens"].labels(tenant=tenant, tier=tier).set(used)
        if quota is not None:
            self._m["hicache_tenant_quota_tokens"].labels(tenant=tenant, tier=tier).set(quota)

    def set_pinned(self, tier: str, tokens: int) -> None:
        """The tokens pinned prefixes hold in ``tier``."""
        _check("tier", tier, TIERS)
        self._m["hicache_pinned_tokens"].labels(tier=tier).set(tokens)

    def set_queue(self, queue: str, n: int) -> None:
        """The current length of a scheduler queue (e.g. ``waiting``, ``running``, ``loading``)."""
        self._m["hicache_queue_requests"].labels(queue=queue).set(n)

    def evicted(self, tier: str, tokens: int) -> None:
        _check("tier", tier, TIERS)
        if tokens:
            self._m["hicache_evicted_tokens_total"].labels(tier=tier).inc(tokens)

    def prefetched(self, tokens: int) -> None:
        if tokens:
            self._m["hicache_prefetch_tokens_total"].inc(tokens)

    def backed_up(self, tokens: int) -> None:
        if tokens:
            self._m["hicache_backup_tokens_total"].inc(tokens)

    def kv_events(self, published: int, dropped: int) -> None:
        """Counts of KV events published and dropped since the last call (``events.enabled``)."""
        if published:
            self._m["hicache_kv_events_total"].labels(outcome="published").inc(published)
        if dropped:
            self._m["hicache_kv_events_total"].labels(outcome="dropped").inc(dropped)

    def kv_event_lag(self, seconds: float) -> None:
        """One KV event batch sent, ``seconds`` after the oldest change in it."""
        self._m["hicache_kv_event_lag_seconds"].observe(max(0.0, seconds))

    def load_join_waited(self, seconds: float) -> None:
        if seconds > 0.0:
            self._m["hicache_load_join_wait_seconds_total"].inc(seconds)

    def engine_loaded(self, tier: str, tokens: int) -> None:
        """Engine mode: prompt tokens an engine loaded from the cache, by tier (``host`` or
        ``storage``): the engine-mode half of ``hicache_cached_tokens_total``."""
        _check("tier", tier, TIERS)
        if tokens:
            self._m["hicache_cached_tokens_total"].labels(tier=tier).inc(tokens)

    def transfer_engine(self, direction: str, nbytes: int) -> None:
        """Engine mode: bytes an engine copied between its KV and L2 (``h2d`` loads, ``d2h`` saves)."""
        self.transfer_bytes(direction, nbytes)

    # ---- controller

    @contextmanager
    def transfer(self, direction: str, nbytes: int = 0) -> Iterator[TransferRecord]:
        """Wrap one transfer: when the block completes, its duration is observed and its bytes
        counted — ``nbytes``, or what the block set on the yielded record (for moves whose size
        is known only afterwards, e.g. a partly successful L3 batch). A block that raises is
        counted nowhere (the exception propagates)."""
        _check("direction", direction, DIRECTIONS)
        record = TransferRecord(nbytes)
        start = time.perf_counter()
        yield record
        self.transfer_done(direction, time.perf_counter() - start, record.nbytes)

    def transfer_done(self, direction: str, seconds: float, nbytes: int) -> None:
        """Record one finished transfer that the caller timed itself: what ``transfer`` records
        when its block completes, without a context manager (for per-op hot paths)."""
        _check("direction", direction, DIRECTIONS)
        self._child("hicache_transfer_seconds", direction).observe(seconds)
        if nbytes:
            self._child("hicache_transfer_bytes_total", direction).inc(nbytes)

    def transfer_bytes(self, direction: str, nbytes: int) -> None:
        """Count bytes moved without timing them (prefer ``transfer``, which does both)."""
        _check("direction", direction, DIRECTIONS)
        if nbytes:
            self._child("hicache_transfer_bytes_total", direction).inc(nbytes)

    @contextmanager
    def storage_op(self, op: str) -> Iterator[None]:
        """Wrap one storage call: an exception out of the block counts a storage error for
        ``op`` (``get``, ``set``, ``exists``, ...) and propagates."""
        try:
            yield
        except BaseException:
            self.storage_error(op)
            raise

    def storage_error(self, op: str, n: int = 1) -> None:
        """Count failures reported without an exception (e.g. ``batch_set`` returning False);
        ``op`` is one of ``STORAGE_OPS``."""
        _check("op", op, STORAGE_OPS)
        if n:
            self._child("hicache_storage_errors_total", op).inc(n)

    def set_storage_up(self, up: bool) -> None:
        """Whether the attached L3 backend is healthy (False with none attached)."""
        self._m["hicache_storage_up"].set(1 if up else 0)

    def set_storage_attached(self, attached: bool) -> None:
        """Whether an L3 backend is attached at all: tells a store that is down
        (``hicache_storage_up`` 0, attached 1) from a daemon without one (both 0)."""
        self._m["hicache_storage_attached"].set(1 if attached else 0)

    def set_tenant_l3_usage(self, tenant: str, used: int | None, quota: int) -> None:
        """A tenant's L3 partition: the bytes it holds (None: it cannot tell now) and its size."""
        if used is not None:
            self._m["hicache_tenant_l3_used_bytes"].labels(tenant=tenant).set(used)
        self._m["hicache_tenant_l3_quota_bytes"].labels(tenant=tenant).set(quota)

    def set_storage_size(self, pages: int, nbytes: int) -> None:
        """What the storage (L3) backend holds now, as far as it can tell cheaply (the
        controller publishes it once a second)."""
        self._m["hicache_storage_pages"].set(pages)
        self._m["hicache_storage_bytes"].set(nbytes)

    # ---- tokenizer, when /metrics is scraped

    def set_process_health(self, ages: Mapping[str, float], alive: Mapping[str, bool], stale_s: float,
                           stalls: Mapping[str, float] | None = None) -> None:
        """Publish the health of the heartbeat processes the daemon runs, as ``/health`` judges
        it: for each name of ``alive`` (each one of ``HEARTBEAT_PROCESSES``; False = its pid is
        gone), ``hicache_process_heartbeat_age_seconds`` = ``ages[name]`` (seconds since its
        last heartbeat, ``hicache.runtime.heartbeat.heartbeat_ages``; NaN when absent: no readable
        heartbeat, unknown) and ``hicache_process_up`` = 1 when it is alive and its age is
        not over ``stale_s`` (an unknown age is not stale) and it has not been stalled
        (``stalls[name]``: seconds with work and no progress, ``heartbeat_stalls``) for
        longer, else 0; ``hicache_process_stalled_seconds`` = that stall (0 for none).
        Processes not in ``alive`` (a daemon without a controller) get no series."""
        for name, is_alive in alive.items():
            _check("process", name, HEARTBEAT_PROCESSES)
            age = ages.get(name)
            stall = (stalls or {}).get(name, 0.0)
            self._child("hicache_process_heartbeat_age_seconds", name).set(math.nan if age is None else age)
            self._child("hicache_process_stalled_seconds", name).set(stall)
            stale = (age is not None and age > stale_s) or stall > stale_s
            self._child("hicache_process_up", name).set(1 if is_alive and not stale else 0)

    # ---- launcher

    def process_restarted(self, process: str) -> None:
        _check("process", process, PROCESSES)
        self._child("hicache_process_restarts_total", process).inc()


@dataclass
class TransferRecord:
    """Yielded by ``Metrics.transfer``: the bytes the wrapped transfer moved (settable)."""

    nbytes: int = 0


@dataclass(frozen=True)
class TokenCounts:
    """The token accounting of one finished request, as recorded in the counters."""

    prompt: int
    completion: int
    device: int = 0
    host: int = 0
    storage: int = 0


class RequestTracker:
    """Times one generation request from its arrival (construction) to its end.

    ``tokens(n)`` is called as output tokens reach the tokenizer: the first call observes
    the time to first token, each later one the gap since the previous call spread over its
    ``n`` tokens (``n`` observations of ``gap / n``). ``finish(status, counts)`` sets the
    outcome; leaving the ``with`` block records it. Without ``finish``, a block left by an
    exception records ``aborted`` for a cancellation or a lost connection and ``error``
    otherwise; one left normally records ``ok``. The end-to-end latency is observed for
    ``ok`` requests only.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last: float | None = None
        self._status: str | None = None
        self._counts: TokenCounts | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        m = self._metrics._m
        if self._last is None:
            m["hicache_ttft_seconds"].observe(now - self._start)
            n -= 1
            gap = 0.0
        else:
            gap = (now - self._last) / n
        for _ in range(n):
            m["hicache_inter_token_latency_seconds"].observe(gap)
        self._last = now

    def finish(self, status: str, counts: TokenCounts | None = None) -> None:
        _check("status", status, REQUEST_STATUSES)
        self._status = status
        self._counts = counts

    def __enter__(self) -> RequestTracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        status = self._status
        if status is None:
            if exc_type is None:
                status = "ok"
            elif issubclass(exc_type, (ConnectionError, asyncio.CancelledError)):
                status = "aborted"
            else:
                status = "error"
        latency = time.perf_counter() - self._start if status == "ok" else None
        self._metrics._request_done(status, latency, self._counts)


_NOOP = Metrics(None)
