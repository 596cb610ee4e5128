"""The recording API every process uses (docs/architecture.md §11).

Recording goes through the methods of ``Metrics`` — helpers and context managers that wrap
the thing measured — never through the prometheus objects. When metrics are disabled
(``metrics.enabled: false``), or before ``init_process_metrics``, every method is a no-op
and ``render_metrics`` returns None.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from hicache.metrics.catalogue import (
    DIRECTIONS,
    PROCESSES,
    REQUEST_STATUSES,
    SERIES_OWNERS,
    SPECS,
    STORAGE_OPS,
    TIERS,
    MetricSpec,
)
from hicache.runtime.heartbeat import HEARTBEAT_PROCESSES


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

    def backup_failures(self, retried: int, abandoned: int) -> None:
        """Failed L3 backups since the last call: to be retried, and given up on."""
        if retried:
            self._m["hicache_backup_failures_total"].labels(outcome="retried").inc(retried)
        if abandoned:
            self._m["hicache_backup_failures_total"].labels(outcome="abandoned").inc(abandoned)

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


NOOP = Metrics(None)
"""The disabled instance (``get_metrics`` before ``init_process_metrics``)."""
