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
and every node has its own circuit breaker (and health probe). A node that is lost makes
only its own pages misses and its writes dropped; the other nodes keep serving, and the
lost node is skipped (no connection attempts on the data path) until its probe answers,
or finds, asking the cluster for its slot map, that the node owns no slot any more (a
replica promoted in its place after a failover): its slots then route to their new owner.
Slots moving (resharding: ``MOVED`` / ``ASK``) are followed by redis-py's cluster client.
``stats().up`` is False while the store, or any node of it, is marked down.

Attach: the constructor connects (``PING``) and raises when the store cannot be used:
``StorageAuthError`` ("authentication failed") for a refused or missing password,
``StorageTLSError`` ("certificate verify failed" / "TLS handshake failed") for a TLS
failure, ``StorageUnavailable`` ("cannot connect") otherwise, ``StorageConfigError`` for a
password file or variable that cannot be read. Messages name the store by its redacted URL
(``redact_url``): no password, password file content or key ever appears in a message, a
log line or ``stats()``.

TLS: ``rediss://`` URLs, standalone or cluster, verify the server's certificate
(``RedisSettings``: ``tls_ca_file``, ``tls_verify_hostname``, optional client certificate
``tls_cert_file`` / ``tls_key_file``). In cluster mode every node is reached over TLS with
the same settings.

Processes: the client is created per process (checked by pid on every call), never shared
across ``fork``. Thread safety: redis-py clients are thread-safe; this class adds no lock
besides the one guarding client (and key-event listener) creation.

Evictions: ``take_evicted`` follows the server's evicted / expired key events where the
server publishes them (``storage_backends.redis_evictions``).
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from storage_backends.base import Buffer, StorageBackend, StoreUsage
from storage_backends.errors import (
    PageFormatError,
    StorageAuthError,
    StorageConfigError,
    StorageTLSError,
    StorageUnavailable,
)
from storage_backends.keys import check_hashes, is_page_hash
from storage_backends.page_format import HEADER_SIZE, PageLayout, check_object, complete_object, encode_header
from storage_backends.redis_evictions import KeyEventListener
from storage_backends.redis_wire import PageValue, connection_class_for
from storage_backends.resilience import CircuitBreaker, ExponentialJitterBackoff
from storage_backends.settings import RedisSettings, redact_url, tls_file_problems
from storage_backends.stats import StatsCounter, StorageStats

log = logging.getLogger(__name__)

# RedisClusterException is not a RedisError: the cluster client raises it when no startup node answers.
_STORE_ERRORS = (RedisError, RedisClusterException, OSError)
_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


_redact = redact_url  # the URL without its secrets, for log lines and errors


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (redis-py wraps socket and
    TLS errors in its own ``ConnectionError``)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def attach_error(name: str, exc: BaseException, password_configured: bool, ca_file: str | None = None
                 ) -> StorageUnavailable:
    """The error a failed attach raises: ``StorageAuthError`` / ``StorageTLSError`` /
    ``StorageUnavailable`` with a message that names the cause and the store ``name`` (a
    redacted URL). Server and TLS messages never carry the password, so they are quoted.
    ``ca_file`` is the configured ``tls_ca_file`` (None: the system trust store)."""
    chain = list(_chain(exc))
    if any(isinstance(e, RedisAuthenticationError) for e in chain):
        if password_configured:
            why = "the server refused the password (check password / password_file / password_env and the user)"
        else:
            why = "the server requires a password and none is configured (password, password_file or password_env)"
        return StorageAuthError(f"{name}: authentication failed: {why}; server said: {exc}")
    verify = next((e for e in chain if isinstance(e, ssl.SSLCertVerificationError)), None)
    if verify is not None or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        detail = str(getattr(verify, "verify_message", None) or exc).rstrip(".")
        if "mismatch" in detail:
            hint = "the certificate does not name the URL's host; redis.tls_verify_hostname: false skips that check"
        elif ca_file:
            hint = f"the server's certificate does not chain to a CA in redis.tls_ca_file ({ca_file})"
        else:
            hint = "the server's certificate does not chain to a CA in the system trust store; set redis.tls_ca_file"
        return StorageTLSError(f"{name}: certificate verify failed: {detail} ({hint})")
    tls = next((e for e in chain if isinstance(e, ssl.SSLError)), None)
    if tls is not None:
        detail = getattr(tls, "reason", None) or str(tls)
        return StorageTLSError(f"{name}: TLS handshake failed: {detail} (is the server speaking TLS on this port, "
                               "and does it require a client certificate: redis.tls_cert_file?)")
    return StorageUnavailable(f"{name}: cannot connect: {exc}")


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
        self._node_breakers: dict[str, CircuitBreaker] = {}
        self._listener: KeyEventListener | None = None  # this process's, made by take_evicted
        self._listener_pid = -1
        self.name = f"{'redis-cluster' if settings.cluster else 'redis'}:{_redact(settings.url)}"
        res = settings.resilience
        self._breaker = CircuitBreaker(
            self.name,
            res.failure_threshold,
            self._probe,
            ExponentialJitterBackoff(res.probe_base_s, res.probe_cap_s),
            on_change=self._on_breaker_change,
        )
        # Read once, here: a client made later (after fork) uses the same secret. Never logged.
        self._password = settings.resolve_password()
        if settings.tls:
            problems = tls_file_problems(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
            if problems:
                raise StorageConfigError("; ".join(f"redis.{key}: {reason}" for key, reason in problems))
        # A store that was asked for and cannot be used is an error at attach, naming why.
        try:
            self._conn().ping()
        except _STORE_ERRORS as exc:
            self._drop_client()
            configured = self._password is not None or urlsplit(settings.url).password is not None
            raise attach_error(self.name, exc, configured, settings.tls_ca_file) from exc

    # -- client per process ------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        """What every client of this store is made with: timeouts, password, TLS."""
        s = self.settings
        t = s.resilience.timeout_s
        common: dict[str, Any] = {
            "socket_timeout": t,
            "socket_connect_timeout": t,
            "health_check_interval": 0,
        }
        if self._password is not None:
            common["password"] = self._password
        if s.tls:
            common.update(
                ssl_cert_reqs="required",
                ssl_check_hostname=s.tls_verify_hostname,
                ssl_ca_certs=s.tls_ca_file,
                ssl_certfile=s.tls_cert_file,
                ssl_keyfile=s.tls_key_file,
            )
        return common

    def _make_client(self) -> Any:
        s = self.settings
        common = self._client_options()
        common["retry"] = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        common["max_connections"] = s.max_connections
        common["connection_class"] = connection_class_for(s.url)
        url = s.url
        try:
            if s.cluster:
                from redis.cluster import RedisCluster

                if s.tls:
                    # RedisCluster lets the URL's scheme pick redis-py's plain SSLConnection for
                    # every node, over ours; with a redis:// URL it keeps our page-aware TLS
                    # class, and the ssl_* options above still apply to each node.
                    url = "redis://" + url.removeprefix("rediss://")
                return RedisCluster.from_url(url, **common)
            return redis.Redis.from_url(url, **common)
        except ValueError as exc:  # bad URL pieces (port, db, options)
            raise StorageConfigError(f"{self.name}: {redact_url(str(exc))}") from None

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

    def _node_breaker(self, name: str) -> CircuitBreaker:
        """The breaker of cluster node ``name`` (``host:port``), created on first use."""
        breaker = self._node_breakers.get(name)
        if breaker is None:
            with self._client_lock:
                breaker = self._node_breakers.get(name)
                if breaker is None:
                    res = self.settings.resilience
                    breaker = CircuitBreaker(
                        f"{self.name}@{name}",
                        res.failure_threshold,
                        functools.partial(self._probe_node, name),
                        ExponentialJitterBackoff(res.probe_base_s, res.probe_cap_s),
                        on_change=self._on_breaker_change,
                    )
                    if self._closed:
                        breaker.close()
                    self._node_breakers[name] = breaker
        return breaker

    def _route(self, hashes: Sequence[str], lo: int, hi: int) -> list[tuple[CircuitBreaker, list[int]]]:
        """Indices ``lo..hi-1`` grouped by the breaker that guards them: the store's breaker
        for a standalone server, the owning node's in cluster mode. May raise a store error
        (the cluster client could not be built)."""
        if not self.settings.cluster:
            return [(self._breaker, list(range(lo, hi)))]
        client = self._conn()
        nodes = client.nodes_manager
        groups: dict[str, list[int]] = {}
        for i in range(lo, hi):
            try:
                name = nodes.get_node_from_slot(client.keyslot(self._key(hashes[i]))).name
            except _STORE_ERRORS:
                name = ""  # slot not covered right now: let the cluster client route it
            groups.setdefault(name, []).append(i)
        return [(self._node_breaker(name) if name else self._breaker, idx) for name, idx in groups.items()]

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
                groups = self._route(hashes, lo, hi)
            except _STORE_ERRORS as exc:
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
                except _STORE_ERRORS as exc:
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
            for j, i in enumerate(idx):
                header, size = results[2 * j], results[2 * j + 1]
                present[i] = (not isinstance(header, Exception) and not isinstance(size, Exception)
                              and complete_object(header, int(size), hashes[i], layout))
            return sum(isinstance(res, Exception) for res in results)

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
        with self._client_lock:
            if self._listener_pid != os.getpid():
                self._listener_pid = os.getpid()  # once per process, followed or not
                listener = KeyEventListener(lambda: redis.Redis.from_url(self.settings.url, **self._client_options()),
                                            self._prefix_b, self.name)
                self._listener = listener if listener.start() else None
            listener = self._listener
        return listener.take() if listener is not None else []

    def stats(self) -> StorageStats:
        up = self._breaker.up and all(b.up for b in list(self._node_breakers.values()))
        return self._counters.snapshot(self.kind, up and not self._closed)

    def health(self) -> bool:
        return not self._closed and self._probe()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._breaker.close()
        with self._client_lock:
            listener, self._listener = self._listener, None
        if listener is not None and self._listener_pid == os.getpid():
            listener.close()
        with self._client_lock:
            node_breakers = list(self._node_breakers.values())
        for breaker in node_breakers:
            breaker.close()
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
            value: bytes | None = self._conn().get(self._key(h))
            return value
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

    def _probe_node(self, name: str) -> bool:
        """``PING`` cluster node ``name``. When it does not answer, ask the cluster where its
        slots are now (``CLUSTER SLOTS`` through any node): True also once it owns none (a
        replica was promoted in its place, its slots moved, it left). Never raises."""
        try:
            client = self._conn()
        except (*_STORE_ERRORS, StorageConfigError):
            return False
        try:
            node = client.get_node(node_name=name)
            if node is None or client.get_redis_connection(node).ping():
                return True
        except _STORE_ERRORS as exc:
            log.debug("%s: probe of node %s failed: %r", self.name, name, exc)
        try:
            client.nodes_manager.initialize()
            return name not in {n.name for n in client.get_primaries()}
        except _STORE_ERRORS as exc:
            log.debug("%s: cannot refresh the cluster's slots: %r", self.name, exc)
            return False

    def _on_breaker_change(self, up: bool) -> None:
        if not up:
            self._counters.add(trips=1)
