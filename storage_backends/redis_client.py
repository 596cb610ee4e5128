"""The redis-py client of one Redis store, per process, and the attach (docs/architecture.md §7).

``StoreClient`` resolves the password once and checks the TLS files when it is made, makes
every client of the store with the same options (timeouts, password, TLS), and keeps one
client per process (checked by pid on every ``conn()``, never shared across ``fork``).
``attach`` connects (``PING``) and raises ``attach_error``'s error when the store cannot be
used:

========================================  ====================================================
a refused or missing password             ``StorageAuthError`` ("authentication failed")
a certificate that does not verify        ``StorageTLSError`` ("certificate verify failed")
any other TLS failure                     ``StorageTLSError`` ("TLS handshake failed")
anything else                             ``StorageUnavailable`` ("cannot connect")
an unreadable password file / variable    ``StorageConfigError`` (when it is made)
========================================  ====================================================

Messages name the store by its redacted URL (``settings.redact_url``): no password, password
file content or key ever appears in a message or a log line. Lock: one, around client
creation only; redis-py clients are thread-safe.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from storage_backends.errors import StorageAuthError, StorageConfigError, StorageTLSError, StorageUnavailable
from storage_backends.locks import ForkSafeLock
from storage_backends.redis_wire import connection_class_for
from storage_backends.settings import RedisSettings, redact_url, tls_file_problems

log = logging.getLogger(__name__)

# RedisClusterException is not a RedisError: the cluster client raises it when no startup node answers.
STORE_ERRORS = (RedisError, RedisClusterException, OSError)


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


class StoreClient:
    """This process's client of one store. See the module docstring."""

    def __init__(self, settings: RedisSettings, name: str) -> None:
        self.settings = settings
        self.name = name
        self._lock = ForkSafeLock()
        self._client: Any = None
        self._pid = -1
        # Read once, here: a client made later (after fork) uses the same secret. Never logged.
        self._password = settings.resolve_password()
        if settings.tls:
            problems = tls_file_problems(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
            if problems:
                raise StorageConfigError("; ".join(f"redis.{key}: {reason}" for key, reason in problems))

    def attach(self) -> None:
        """``PING``; on failure drop the client and raise (module docstring)."""
        # A store that was asked for and cannot be used is an error at attach, naming why.
        try:
            self.conn().ping()
        except STORE_ERRORS as exc:
            self.drop()
            configured = self._password is not None or urlsplit(self.settings.url).password is not None
            raise attach_error(self.name, exc, configured, self.settings.tls_ca_file) from exc

    def options(self) -> dict[str, Any]:
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

    def _make(self) -> Any:
        s = self.settings
        common = self.options()
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

    def conn(self) -> Any:
        """This process's client (``redis.Redis`` or ``RedisCluster``), made on first use.
        Raises ``StorageConfigError`` for a URL redis-py cannot use."""
        client = self._client
        if client is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    # After fork the parent's sockets must not be used (nor closed) here.
                    self._client = self._make()
                    self._pid = os.getpid()
                client = self._client
        return client

    def drop(self) -> None:
        """Close this process's client (a parent's is left alone); the next ``conn`` makes one."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            try:
                client.close()
            except STORE_ERRORS as exc:
                log.debug("%s: close failed: %s", self.name, exc)
