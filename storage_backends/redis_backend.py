"""Redis and Redis Cluster as L3 (DESIGN §7, ``backend: redis``).

One string key per page, ``{key_prefix}:{hash}``, holding the page object (header +
payload). Batches are sent as non-transactional pipelines, each carrying at most
``pipeline_bytes`` of values or ``pipeline_max`` commands, so a round trip moves a useful
amount of data without building huge buffers; in cluster mode redis-py's cluster pipeline
groups the commands per node. ``SET`` is atomic, so concurrent writers of one page leave
one whole object. With ``ttl_s`` every page gets an expiry (``volatile-lru`` servers can
then evict them); without it the server should run ``maxmemory-policy allkeys-lru``.

Timeouts: every socket connect and read is bounded by ``timeout_s``; a connection error
is retried once on a fresh connection (a server restart leaves dead pooled sockets),
timeouts are not retried. Failures feed the circuit breaker.

Processes: the client is created per process (checked by pid on every call), never shared
across ``fork``. Thread safety: redis-py clients are thread-safe; this class adds no lock
besides the one guarding client creation.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from storage_backends.base import Buffer, StorageBackend, StoreUsage
from storage_backends.errors import StorageConfigError, StorageUnavailable
from storage_backends.keys import check_hashes, is_page_hash
from storage_backends.page_format import PageFormatError, PageLayout, check_object, encode_header
from storage_backends.redis_wire import PageValue, connection_class_for
from storage_backends.resilience import CircuitBreaker, ExponentialJitterBackoff
from storage_backends.settings import RedisSettings
from storage_backends.stats import StatsCounter, StorageStats

log = logging.getLogger(__name__)

_STORE_ERRORS = (RedisError, OSError)
_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def _redact(url: str) -> str:
    """The URL without its password, for log lines and errors."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


class RedisBackend(StorageBackend):
    """Pages in Redis or Redis Cluster. See the module docstring."""

    kind = "redis"

    def __init__(self, settings: RedisSettings, layout: PageLayout | None) -> None:
        super().__init__(layout)
        self.settings = settings
        self._prefix = settings.key_prefix + ":"
        self._prefix_b = self._prefix.encode()
        self._counters = StatsCounter()
        self._closed = False
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._pid = -1
        self.name = f"{'redis-cluster' if settings.cluster else 'redis'}:{_redact(settings.url)}"
        res = settings.resilience
        self._breaker = CircuitBreaker(
            self.name,
            res.failure_threshold,
            self._probe,
            ExponentialJitterBackoff(res.probe_base_s, res.probe_cap_s),
            on_change=self._on_breaker_change,
        )
        # A store that was asked for and cannot be reached is an error at start.
        try:
            self._conn().ping()
        except _STORE_ERRORS as exc:
            self._drop_client()
            raise StorageUnavailable(f"{self.name}: cannot connect: {exc}") from exc

    # -- client per process ------------------------------------------------------------

    def _make_client(self) -> Any:
        s = self.settings
        t = s.resilience.timeout_s
        common: dict[str, Any] = {
            "socket_timeout": t,
            "socket_connect_timeout": t,
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "max_connections": s.max_connections,
            "health_check_interval": 0,
        }
        if s.password is not None:
            common["password"] = s.password
        common["connection_class"] = connection_class_for(s.url)
        try:
            if s.cluster:
                from redis.cluster import RedisCluster

                return RedisCluster.from_url(s.url, **common)
            return redis.Redis.from_url(s.url, **common)
        except ValueError as exc:  # bad URL pieces (port, db, options)
            raise StorageConfigError(f"{self.name}: {exc}") from exc

    def _conn(self) -> Any:
        client = self._client
        if client is None or self._pid != os.getpid():
            with self._client_lock:
                if self._client is None or self._pid != os.getpid():
                    # After fork the parent's sockets must not be used (nor closed) here.
                    self._client = self._make_client()
                    self._pid = os.getpid()
                client = self._client
        return client

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            try:
                client.close()
            except _STORE_ERRORS as exc:
                log.debug("%s: close failed: %s", self.name, exc)

    def _key(self, h: str) -> bytes:
        return self._prefix_b + h.encode()

    def _chunks(self, n: int, value_bytes: int) -> Iterator[tuple[int, int]]:
        per = max(1, min(self.settings.pipeline_max, self.settings.pipeline_bytes // max(1, value_bytes)))
        for lo in range(0, n, per):
            yield lo, min(lo + per, n)

    def _pipeline(self) -> Any:
        return self._conn().pipeline(transaction=False)

    def _store_failed(self, what: str, exc: BaseException) -> None:
        timeout = isinstance(exc, (RedisTimeoutError, TimeoutError))
        self._counters.add(errors=1, timeouts=int(timeout))
        log.debug("%s: %s failed: %r", self.name, what, exc)
        self._breaker.record_failure()

    # -- data path ---------------------------------------------------------------------

    def batch_exists(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        if not hashes or self._closed or not self._breaker.up:
            return 0
        count = 0
        try:
            for lo, hi in self._chunks(len(hashes), 1024):
                pipe = self._pipeline()
                for h in hashes[lo:hi]:
                    pipe.exists(self._key(h))
                for res in pipe.execute(raise_on_error=False):
                    if isinstance(res, Exception):
                        raise res
                    if not res:
                        self._breaker.record_success()
                        return count
                    count += 1
        except _STORE_ERRORS as exc:
            self._store_failed("EXISTS", exc)
            return 0
        self._breaker.record_success()
        return count

    def batch_get(self, hashes: Sequence[str], into: Sequence[memoryview]) -> list[bool]:
        layout = self._require_layout()
        hashes = check_hashes(hashes)
        if len(into) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(into)} buffers")
        views = []
        for buf in into:
            mv = memoryview(buf)
            if mv.readonly or mv.nbytes != layout.payload_size or not mv.contiguous:
                raise ValueError(
                    f"each buffer must be writable, contiguous and {layout.payload_size} bytes; got {mv.nbytes}"
                )
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
        n = len(hashes)
        out = [False] * n
        if not n:
            return out
        if self._closed or not self._breaker.up:
            self._counters.add(misses=n)
            return out
        hits = errors = 0
        corrupt: list[str] = []
        failed = False
        for lo, hi in self._chunks(n, layout.object_size):
            pipe = self._pipeline()
            for h in hashes[lo:hi]:
                pipe.get(self._key(h))
            try:
                results = pipe.execute(raise_on_error=False)
            except _STORE_ERRORS as exc:
                self._store_failed("GET", exc)
                failed = True
                break  # the rest of the batch would wait on the same trouble: misses
            for i, res in enumerate(results, lo):
                if res is None:
                    continue
                if isinstance(res, Exception):
                    errors += 1
                    continue
                try:
                    payload = check_object(layout, res)
                except PageFormatError as exc:
                    log.warning("%s: corrupt page %s deleted: %s", self.name, hashes[i], exc)
                    corrupt.append(hashes[i])
                    continue
                views[i][:] = payload
                out[i] = True
                hits += 1
        self._counters.add(
            hits=hits,
            misses=n - hits,
            bytes_read=hits * layout.payload_size,
            corrupt=len(corrupt),
            errors=errors,
        )
        if corrupt:
            self._delete_keys(corrupt)
        if not failed:
            if errors:
                self._breaker.record_failure()
            else:
                self._breaker.record_success()
        return out

    def batch_set(self, hashes: Sequence[str], pages: Sequence[Buffer]) -> list[bool]:
        layout = self._require_layout()
        hashes = check_hashes(hashes)
        if len(pages) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        views = []
        for page in pages:
            mv = memoryview(page)
            if mv.nbytes != layout.payload_size or not mv.contiguous:
                raise ValueError(f"each page must be contiguous and {layout.payload_size} bytes; got {mv.nbytes}")
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
        n = len(hashes)
        out = [False] * n
        if not n:
            return out
        if self._closed or not self._breaker.up:
            self._counters.add(dropped_writes=n)
            return out
        ttl = self.settings.ttl_s
        written = errors = 0
        failed = False
        for lo, hi in self._chunks(n, layout.object_size):
            pipe = self._pipeline()
            for i in range(lo, hi):
                value = PageValue(encode_header(layout, views[i]), views[i])
                pipe.set(self._key(hashes[i]), value, ex=ttl)
            try:
                results = pipe.execute(raise_on_error=False)
            except _STORE_ERRORS as exc:
                self._store_failed("SET", exc)
                failed = True
                break
            for i, res in enumerate(results, lo):
                if isinstance(res, Exception):
                    errors += 1
                    log.debug("%s: SET %s failed: %r", self.name, hashes[i], res)
                elif res:
                    out[i] = True
                    written += 1
        self._counters.add(
            writes=written,
            bytes_written=written * layout.payload_size,
            dropped_writes=n - written,
            errors=errors,
        )
        if not failed:
            if errors:
                self._breaker.record_failure()
            else:
                self._breaker.record_success()
        return out

    def delete(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        if not hashes or self._closed or not self._breaker.up:
            return 0
        return self._delete_keys(hashes)

    def _delete_keys(self, hashes: Sequence[str]) -> int:
        """Pipelined ``DEL`` (one key per command, so it works across cluster slots)."""
        removed = 0
        try:
            for lo, hi in self._chunks(len(hashes), 1024):
                pipe = self._pipeline()
                for h in hashes[lo:hi]:
                    pipe.delete(self._key(h))
                for res in pipe.execute(raise_on_error=False):
                    if isinstance(res, Exception):
                        raise res
                    removed += int(res)
        except _STORE_ERRORS as exc:
            self._store_failed("DEL", exc)
        return removed

    def clear(self) -> int:
        if self._closed or not self._breaker.up:
            return 0
        removed = 0
        batch: list[str] = []
        try:
            for h in self.iter_hashes():
                batch.append(h)
                if len(batch) >= 1024:
                    removed += self._delete_keys(batch)
                    batch.clear()
        except StorageUnavailable as exc:
            log.warning("%s: clear stopped: %s", self.name, exc)
        if batch:
            removed += self._delete_keys(batch)
        return removed

    def stats(self) -> StorageStats:
        return self._counters.snapshot(self.kind, self._breaker.up and not self._closed)

    def health(self) -> bool:
        return not self._closed and self._probe()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._breaker.close()
        self._drop_client()

    # -- administration ----------------------------------------------------------------

    def iter_hashes(self) -> Iterator[str]:
        pattern = self._prefix.translate(_GLOB_SPECIAL) + "*"
        plen = len(self._prefix_b)
        try:
            for key in self._conn().scan_iter(match=pattern, count=1000):
                raw = key if isinstance(key, bytes) else str(key).encode()
                h = raw[plen:].decode("ascii", "replace")
                if raw.startswith(self._prefix_b) and is_page_hash(h):
                    yield h
        except _STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: SCAN failed: {exc}") from exc

    def read_object(self, h: str) -> bytes | None:
        (h,) = check_hashes([h])
        try:
            return self._conn().get(self._key(h))
        except _STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: GET failed: {exc}") from exc

    def usage(self) -> StoreUsage:
        pages = total = 0
        batch: list[str] = []

        def flush() -> int:
            pipe = self._pipeline()
            for h in batch:
                pipe.strlen(self._key(h))
            size = sum(int(r) for r in pipe.execute(raise_on_error=False) if not isinstance(r, Exception))
            batch.clear()
            return size

        try:
            for h in self.iter_hashes():
                pages += 1
                batch.append(h)
                if len(batch) >= 1024:
                    total += flush()
            if batch:
                total += flush()
        except _STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: STRLEN failed: {exc}") from exc
        return StoreUsage(pages, total)

    def server_info(self) -> dict[str, Any]:
        """``maxmemory``, ``maxmemory-policy`` and used memory (first node in cluster mode)."""
        try:
            info = self._conn().info("memory")
        except _STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: INFO failed: {exc}") from exc
        if self.settings.cluster and isinstance(info, dict) and info and isinstance(next(iter(info.values())), dict):
            info = next(iter(info.values()))
        return {k: info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")}

    # -- health ------------------------------------------------------------------------

    def _probe(self) -> bool:
        """``PING`` (every primary in cluster mode); never raises."""
        try:
            return bool(self._conn().ping())
        except _STORE_ERRORS as exc:
            log.debug("%s: probe failed: %r", self.name, exc)
            return False
        except StorageConfigError:
            return False

    def _on_breaker_change(self, up: bool) -> None:
        if not up:
            self._counters.add(trips=1)
