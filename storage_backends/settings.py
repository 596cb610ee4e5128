"""Settings classes for the backends.

``storage_backends`` does not read the daemon's config: the core converts its ``cache.l3``
section into these (see ``hicache.storage_settings.storage_settings_from_config``). All are
frozen; ``validate`` runs on construction and raises ``StorageConfigError`` with the
field's name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from storage_backends.errors import StorageConfigError


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/hicache/l3`` (``~/.cache/hicache/l3`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache", "l3")


@dataclass(frozen=True)
class ResilienceSettings:
    """Timeout, circuit breaker and health-probe tuning shared by every backend.

    ``timeout_s`` bounds each call (socket timeouts for Redis, a deadline on the I/O pool
    for files). After ``failure_threshold`` consecutive failed calls the store is marked
    down; a background probe then retries with exponential backoff between
    ``probe_base_s`` and ``probe_cap_s`` (with full jitter) until the store answers.
    """

    timeout_s: float = 2.0
    failure_threshold: int = 3
    probe_base_s: float = 0.1
    probe_cap_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise StorageConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.failure_threshold < 1:
            raise StorageConfigError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not 0 < self.probe_base_s <= self.probe_cap_s:
            raise StorageConfigError(
                f"need 0 < probe_base_s <= probe_cap_s, got {self.probe_base_s}, {self.probe_cap_s}"
            )


@dataclass(frozen=True)
class FileSettings:
    """The embedded file store.

    ``max_size_gb`` caps the bytes of page objects under ``dir`` (0 = no cap); once above
    it, least recently accessed pages are evicted down to ``low_water`` x the cap.
    ``fsync`` makes each write durable before it becomes visible (slower). ``io_threads``
    is the size of the worker pool that runs file I/O in parallel.
    """

    dir: str = field(default_factory=default_cache_dir)
    max_size_gb: float = 0.0
    low_water: float = 0.9
    fsync: bool = False
    io_threads: int = 4
    scan_on_start: bool = True
    stale_tmp_s: float = 300.0
    resilience: ResilienceSettings = field(default_factory=ResilienceSettings)

    kind = "file"

    def __post_init__(self) -> None:
        if not self.dir:
            raise StorageConfigError("file.dir must not be empty")
        if self.max_size_gb < 0:
            raise StorageConfigError(f"file.max_size_gb must be >= 0, got {self.max_size_gb}")
        if not 0 < self.low_water <= 1:
            raise StorageConfigError(f"file.low_water must be in (0, 1], got {self.low_water}")
        if not 1 <= self.io_threads <= 256:
            raise StorageConfigError(f"file.io_threads must be in [1, 256], got {self.io_threads}")
        if self.stale_tmp_s < 0:
            raise StorageConfigError(f"file.stale_tmp_s must be >= 0, got {self.stale_tmp_s}")

    @property
    def max_bytes(self) -> int:
        """The cap in bytes; 0 means unlimited."""
        return int(self.max_size_gb * 1024**3)


@dataclass(frozen=True)
class RedisSettings:
    """Redis or Redis Cluster.

    ``url``: ``redis://[user:pw@]host:port/db``, ``rediss://`` (TLS) or
    ``unix:///path.sock``. ``password`` overrides one in the URL. ``cluster`` selects
    ``RedisCluster`` (the URL names any one node). ``ttl_s`` sets an expiry on every page so
    a ``volatile-lru`` server can evict them. Keys are ``{key_prefix}:{hash}``. A pipeline
    carries at most ``pipeline_bytes`` of values or ``pipeline_max`` commands.
    """

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    password: str | None = None
    ttl_s: int | None = None
    key_prefix: str = "hicache"
    pipeline_bytes: int = 16 * 1024 * 1024
    pipeline_max: int = 256
    max_connections: int = 32
    resilience: ResilienceSettings = field(default_factory=ResilienceSettings)

    kind = "redis"

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise StorageConfigError(f"redis.url must be redis://, rediss:// or unix://, got {self.url!r}")
        if self.cluster and scheme == "unix":
            raise StorageConfigError("redis.cluster needs a redis:// or rediss:// url, not unix://")
        if self.ttl_s is not None and self.ttl_s < 1:
            raise StorageConfigError(f"redis.ttl_s must be >= 1 or null, got {self.ttl_s}")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise StorageConfigError(f"redis.key_prefix must be non-empty without spaces, got {self.key_prefix!r}")
        if self.pipeline_bytes < 1 or self.pipeline_max < 1 or self.max_connections < 1:
            raise StorageConfigError("redis.pipeline_bytes, pipeline_max and max_connections must be >= 1")


StorageSettings = FileSettings | RedisSettings
