"""Redis and Redis Cluster as L3 (docs/architecture.md §7, ``backend: redis``).

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

Cluster: each batch is split by the node that owns each key's slot, one pipeline per node,
each node with its own circuit breaker (``redis_topology``): a node that is lost makes only
its own pages misses and its writes dropped; the other nodes keep serving. Slots moving
(resharding: ``MOVED`` / ``ASK``) are followed by redis-py's cluster client.

Attach, TLS and passwords: ``redis_client`` (the constructor connects, and raises an error
that names why the store cannot be used; no secret ever appears in a message, a log line or
``stats()``). ``rediss://`` URLs, standalone or cluster, verify the server's certificate
(``RedisSettings``: ``tls_ca_file``, ``tls_verify_hostname``, optional client certificate
``tls_cert_file`` / ``tls_key_file``); in cluster mode every node is reached over TLS with
the same settings.

Processes: the client is made per process (``redis_client.StoreClient``), never shared
across ``fork``. Thread safety: redis-py clients are thread-safe; this class adds one lock,
around the making of the key-event listener.

Evictions: ``take_evicted`` follows the server's evicted / expired key events where the
server publishes them (``storage_backends.redis_evictions``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage_backends.base import Buffer, StorageBackend, StoreUsage
from storage_backends.errors import PageFormatError, StorageUnavailable
from storage_backends.keys import check_hashes, is_page_hash
from storage_backends.locks import ForkSafeLock
from storage_backends.page_format import HEADER_SIZE, PageLayout, check_object, complete_object, encode_header
from storage_backends.redis_client import STORE_ERRORS, StoreClient
from storage_backends.redis_evictions import KeyEventListener
from storage_backends.redis_topology import Topology
from storage_backends.redis_wire import PageValue
from storage_backends.resilience import CircuitBreaker
from storage_backends.settings import RedisSettings, redact_url
from storage_backends.stats import StatsCounter, StorageStats

log = logging.getLogger(__name__)

_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


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
        self._listener_lock = ForkSafeLock()
        self._listener: KeyEventListener | None = None  # this process's, made by take_evicted
        self._listener_pid = -1
        self.name = f"{'redis-cluster' if settings.cluster else 'redis'}:{redact_url(settings.url)}"
        self._client = StoreClient(settings, self.name)
        self._topology = Topology(settings, self.name, self._client, self._counters, self._key)
        self._breaker = self._topology.store
        self._client.attach()

    def _key(self, h: str) -> bytes:
        return self._prefix_b + h.encode()

    def _chunks(self, n: int, value_bytes: int) -> Iterator[tuple[int, int]]:
        per = max(1, min(self.settings.pipeline_max, self.settings.pipeline_bytes // max(1, value_bytes)))
        for lo in range(0, n, per):
            yield lo, min(lo + per, n)

    def _pipeline(self) -> Any:
        return self._client.conn().pipeline(transaction=False)

    def _store_failed(self, what: str, exc: BaseException, breaker: CircuitBreaker) -> None:
        timeout = isinstance(exc, (RedisTimeoutError, TimeoutError))
        self._counters.add(errors=1, timeouts=int(timeout))
        log.debug("%s: %s failed: %r", self.name, what, exc)
        breaker.record_failure()

    def _run_groups(
        self,
        what: str,
        hashes: Sequence[str],
        value_bytes: int,
        command: Callable[[Any, int], object],
        consume: Callable[[list[int], list[Any]], int],
        span: tuple[int, int] | None = None,
    ) -> None:
        """Send ``command(pipe, i)`` for every index (of ``span``, default all), pipelined
        per chunk and per node.

        ``consume(indices, results)`` gets every pipeline that came back (results may hold
        per-command exceptions) and returns how many of them were errors. Indices whose
        store or node is down, or whose pipeline failed, are never passed to ``consume``.
        A failed pipeline counts an error and a breaker failure, and its node is skipped
        for the rest of the call; every other breaker used records success, or failure if
        ``consume`` reported errors for it. Never raises store errors.
        """
        failed: set[int] = set()
        used: dict[int, tuple[CircuitBreaker, int]] = {}
        first, stop = span or (0, len(hashes))
        for lo, hi in self._chunks(stop - first, value_bytes):
            lo, hi = lo + first, hi + first
            try:
                groups = self._topology.route(hashes, lo, hi)
            except STORE_ERRORS as exc:
                self._store_failed(what, exc, self._breaker)
                break
            for breaker, idx in groups:
                key = id(breaker)
                if key in failed or not breaker.up:
                    continue
                try:
                    pipe = self._pipeline()
                    for i in idx:
                        command(pipe, i)
                    results = pipe.execute(raise_on_error=False)
                except STORE_ERRORS as exc:
                    self._store_failed(what, exc, breaker)
                    failed.add(key)
                    used.pop(key, None)
                    continue
                bad = consume(idx, results)
                used[key] = (breaker, used.get(key, (breaker, 0))[1] + bad)
        for breaker, bad in used.values():
            if bad:
                breaker.record_failure()
            else:
                breaker.record_success()

    # -- data path ---------------------------------------------------------------------

    def batch_exists(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        if not hashes or self._closed or not self._breaker.up:
            return 0
        n = len(hashes)
        present = [False] * n
        count = 0
        # Windows in order, so that a miss early in a long batch ends the call early.
        for lo, hi in self._chunks(n, 1024):
            self._look(hashes, present, (lo, hi))
            while count < hi and present[count]:
                count += 1
            if count < hi:
                break
        return count

    def exists_each(self, hashes: Sequence[str]) -> list[bool]:
        hashes = check_hashes(hashes)
        present = [False] * len(hashes)
        if not hashes or self._closed or not self._breaker.up:
            return present
        self._look(hashes, present, (0, len(hashes)))
        return present

    def _look(self, hashes: list[str], present: list[bool], span: tuple[int, int]) -> None:
        """Set ``present[i]`` for the span: whether key ``i`` holds a whole object naming its
        page (``page_format.complete_object``: its header and length, one ``GETRANGE`` and
        one ``STRLEN`` each, no payload)."""
        layout = self.layout

        def send(pipe: Any, i: int) -> None:
            key = self._key(hashes[i])
            pipe.getrange(key, 0, HEADER_SIZE - 1)
            pipe.strlen(key)

        def consume(idx: list[int], results: list[Any]) -> int:
            bad = 0
            for j, i in enumerate(idx):
                header, size = results[2 * j], results[2 * j + 1]
                if isinstance(header, Exception) or isinstance(size, Exception):
                    bad += 1  # one error per page, as a read counts them
                    continue
                present[i] = complete_object(header, int(size), hashes[i], layout)
            if bad:
                self._counters.add(errors=bad)
            return bad

        self._run_groups("EXISTS", hashes, 0, send, consume, span)

    def batch_get(self, hashes: Sequence[str], into: Sequence[memoryview],
                  layout: PageLayout | None = None) -> list[bool]:
        layout = layout or self._require_layout()
        hashes, views = self._read_targets(hashes, into, layout)
        n = len(hashes)
        out = [False] * n
        if not n:
            return out
        if self._closed or not self._breaker.up:
            self._counters.add(misses=n)
            return out
        hits = 0
        errors: list[int] = []
        corrupt: list[str] = []

        def consume(idx: list[int], results: list[Any]) -> int:
            nonlocal hits
            bad = 0
            for i, res in zip(idx, results, strict=True):
                if res is None:
                    continue
                if isinstance(res, Exception):
                    bad += 1
                    continue
                try:
                    payload = check_object(layout, res, hashes[i])
                except PageFormatError as exc:
                    log.warning("%s: corrupt page %s deleted: %s", self.name, hashes[i], exc)
                    corrupt.append(hashes[i])
                    continue
                views[i][:] = payload
                out[i] = True
                hits += 1
            errors.append(bad)
            return bad

        self._run_groups("GET", hashes, layout.object_size, lambda p, i: p.get(self._key(hashes[i])), consume)
        self._counters.add(
            hits=hits,
            misses=n - hits,
            bytes_read=hits * layout.payload_size,
            corrupt=len(corrupt),
            errors=sum(errors),
        )
        if corrupt:
            self._delete_keys(corrupt)
        return out

    def batch_set(self, hashes: Sequence[str], pages: Sequence[Buffer],
                  layout: PageLayout | None = None) -> list[bool]:
        layout = layout or self._require_layout()
        hashes, views = self._write_sources(hashes, pages, layout)
        n = len(hashes)
        out = [False] * n
        if not n:
            return out
        if self._closed or not self._breaker.up:
            self._counters.add(dropped_writes=n)
            return out
        ttl = self.settings.ttl_s

        def send(pipe: Any, i: int) -> None:
            pipe.set(self._key(hashes[i]), PageValue(encode_header(layout, views[i], hashes[i]), views[i]), ex=ttl)

        written = 0
        errors: list[int] = []

        def consume(idx: list[int], results: list[Any]) -> int:
            nonlocal written
            bad = 0
            for i, res in zip(idx, results, strict=True):
                if isinstance(res, Exception):
                    bad += 1
                    log.debug("%s: SET %s failed: %r", self.name, hashes[i], res)
                elif res:
                    out[i] = True
                    written += 1
            errors.append(bad)
            return bad

        self._run_groups("SET", hashes, layout.object_size, send, consume)
        self._counters.add(
            writes=written,
            bytes_written=written * layout.payload_size,
            dropped_writes=n - written,
            errors=sum(errors),
        )
        return out

    def delete(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        if not hashes or self._closed or not self._breaker.up:
            return 0
        return self._delete_keys(hashes)

    def _delete_keys(self, hashes: Sequence[str]) -> int:
        """Pipelined ``DEL`` (one key per command, so it works across cluster slots)."""
        removed = 0

        def consume(idx: list[int], results: list[Any]) -> int:
            nonlocal removed
            bad = 0
            for res in results:
                if isinstance(res, Exception):
                    bad += 1
                else:
                    removed += int(res)
            self._counters.add(errors=bad)
            return bad

        self._run_groups("DEL", hashes, 0, lambda p, i: p.delete(self._key(hashes[i])), consume)
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

    def take_evicted(self) -> list[str]:
        """The page keys the server evicted or expired since the last call, as told by its
        key-event notifications (``storage_backends.redis_evictions``: only when the server's
        ``notify-keyspace-events`` publishes them; standalone Redis only). The first call in
        a process subscribes."""
        if self.settings.cluster or self._closed:
            return []
        listener: KeyEventListener | None
        with self._listener_lock:
            if self._listener_pid != os.getpid():
                self._listener_pid = os.getpid()  # once per process, followed or not
                listener = KeyEventListener(lambda: redis.Redis.from_url(self.settings.url, **self._client.options()),
                                            self._prefix_b, self.name)
                self._listener = listener if listener.start() else None
            listener = self._listener
        return listener.take() if listener is not None else []

    def stats(self) -> StorageStats:
        return self._counters.snapshot(self.kind, self._topology.up and not self._closed)

    def health(self) -> bool:
        return not self._closed and self._topology.probe()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._topology.close()
        with self._listener_lock:
            listener, self._listener = self._listener, None
        if listener is not None and self._listener_pid == os.getpid():
            listener.close()
        self._client.drop()

    # -- administration ----------------------------------------------------------------

    def iter_hashes(self) -> Iterator[str]:
        pattern = self._prefix.translate(_GLOB_SPECIAL) + "*"
        plen = len(self._prefix_b)
        try:
            for key in self._client.conn().scan_iter(match=pattern, count=1000):
                raw = key if isinstance(key, bytes) else str(key).encode()
                h = raw[plen:].decode("ascii", "replace")
                if raw.startswith(self._prefix_b) and is_page_hash(h):
                    yield h
        except STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: SCAN failed: {exc}") from exc

    def read_object(self, h: str) -> bytes | None:
        (h,) = check_hashes([h])
        try:
            value: bytes | None = self._client.conn().get(self._key(h))
            return value
        except STORE_ERRORS as exc:
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
        except STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: STRLEN failed: {exc}") from exc
        return StoreUsage(pages, total)

    def server_info(self) -> dict[str, Any]:
        """``maxmemory``, ``maxmemory-policy`` and used memory (first node in cluster mode)."""
        try:
            info = self._client.conn().info("memory")
        except STORE_ERRORS as exc:
            raise StorageUnavailable(f"{self.name}: INFO failed: {exc}") from exc
        if self.settings.cluster and isinstance(info, dict) and info and isinstance(next(iter(info.values())), dict):
            info = next(iter(info.values()))
        return {k: info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")}
