"""Publishing the scheduler's state to the metrics layer (pools, queues, tier counters).

Called by the scheduler loop a few times a second; counters are published as deltas of
the monotonic counters the cache and the tier manager keep, so nothing is recorded twice.
"""

from __future__ import annotations

from typing import Any, TypeVar

from hicache.metrics import Metrics
from hicache.scheduler.request import LOADING, PREFETCH, WAITING
from hicache.scheduler.scheduler import Scheduler

N = TypeVar("N", int, float)


class SchedulerTelemetry:
    def __init__(self, metrics: Metrics, sched: Scheduler) -> None:
        self.metrics = metrics
        self.sched = sched
        self._last: dict[str, Any] = {}  # the last published value of each counter (int or float)

    def _delta(self, key: str, value: N) -> N:
        d: N = value - self._last.get(key, 0)
        self._last[key] = value
        return d

    def publish(self) -> None:
        m, s = self.metrics, self.sched
        if not m.enabled:
            return
        ps = s.page_size
        m.set_pool("device", "full", s.l1.used * ps, s.l1.capacity * ps)
        host = s.cache.full.host_allocator
        if host is not None:
            m.set_pool("host", "full", host.used * ps, host.capacity * ps)
        swa = s.cache.swa
        if swa is not None:
            m.set_pool("device", "swa", swa.allocator.used * ps, swa.allocator.capacity * ps)
            if swa.host_allocator is not None:
                m.set_pool("host", "swa", swa.host_allocator.used * ps, swa.host_allocator.capacity * ps)
        for tier, name in (("device", "l1"), ("host", "l2")):
            m.set_pinned(tier, s.pins.pinned_pages(name) * ps if s.pins.capacity_pages(name) else 0)
        quotas = s.cache.tiers.quotas
        if quotas is not None:
            for tenant, (used, quota) in quotas.usage().items():
                m.set_tenant_usage(tenant, "host", used * ps, None if quota is None else quota * ps)
        counts = {WAITING: 0, PREFETCH: 0, LOADING: 0}
        for req in s.waiting:
            counts[req.status] = counts.get(req.status, 0) + 1
        for status, n in counts.items():
            m.set_queue(status.value, n)
        m.set_queue("running", len(s.running))
        m.evicted("device", self._delta("evicted_device", s.cache.evicted_device_tokens))
        m.evicted("host", self._delta("evicted_host", s.cache.evicted_host_tokens))
        m.load_join_waited(self._delta("load_join_wait", s.counters.load_join_wait_s))
        if s.tier is not None:
            c = s.tier.counters
            m.prefetched(self._delta("prefetch", c.prefetch_tokens))
            m.backed_up(self._delta("backup", c.backup_tokens))
            m.backup_failures(self._delta("backups_retried", c.backups_failed - c.backups_abandoned),
                               self._delta("backups_abandoned", c.backups_abandoned))
