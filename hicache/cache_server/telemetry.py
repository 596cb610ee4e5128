"""Publishing the cache server's state to the metrics layer (engine mode).

Counters are published as deltas of the monotonic counters the cache server, the tree and
the tier manager keep, so nothing is counted twice.
"""

from __future__ import annotations

from hicache.cache_server.server import CacheServer
from hicache.metrics import Metrics


class EngineTelemetry:
    def __init__(self, metrics: Metrics, server: CacheServer) -> None:
        self.metrics = metrics
        self.server = server
        self._last: dict[str, int] = {}

    def _delta(self, key: str, value: int) -> int:
        d = value - self._last.get(key, 0)
        self._last[key] = value
        return d

    def publish(self) -> None:
        m, s = self.metrics, self.server
        if not m.enabled:
            return
        ps = s.cache.page_size
        host = s.host
        m.set_pool("host", "full", host.used * ps, host.capacity * ps)
        if s.window:
            window = s.cache.component("swa").host_allocator
            assert window is not None  # the server checked it
            m.set_pool("host", "swa", window.used * ps, window.capacity * ps)
        m.set_queue("engine_leases", len(s.leases.leases))
        m.set_queue("engine_sessions", len(s.leases.sessions))
        m.set_queue("engine_prefetching", s.prefetching)
        c = s.counters
        m.engine_loaded("host", self._delta("loaded_host", c.loaded_host_pages) * ps)
        m.engine_loaded("storage", self._delta("loaded_storage", c.loaded_storage_pages) * ps)
        page, window_page = s.pool.page_bytes, s.pool.window_page_bytes
        m.transfer_engine("h2d", self._delta("loaded_bytes", c.loaded_host_pages + c.loaded_storage_pages) * page)
        m.transfer_engine("d2h", self._delta("saved_bytes", c.committed_pages + c.commit_duplicate_pages) * page
                          + self._delta("saved_window_bytes", c.committed_window_pages) * window_page
                          + self._delta("saved_state_bytes", c.committed_states) * s.pool.state_bytes)
        m.evicted("host", self._delta("evicted_host", s.cache.evicted_host_tokens))
        if s.tier is not None:
            t = s.tier.counters
            m.prefetched(self._delta("prefetch", t.prefetch_tokens))
            m.backed_up(self._delta("backup", t.backup_tokens))
            m.backup_failures(self._delta("backups_retried", t.backups_failed - t.backups_abandoned),
                               self._delta("backups_abandoned", t.backups_abandoned))
