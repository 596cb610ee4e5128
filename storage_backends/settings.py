"""Settings classes for the backends.

``storage_backends`` does not read the daemon's config: the core converts its ``cache.l3``
section into these (see ``hicache.storage_settings.storage_settings_from_config``). All are
frozen; ``validate`` runs on construction and raises ``StorageConfigError`` with the
field's name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

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

    ``max_size_gb`` caps the bytes of page objects (and temporary files) under ``dir``,
    whatever number of processes share it (0 = no cap); once above it, least recently
    accessed pages are evicted down to ``low_water`` x the cap. ``fsync`` makes each write
    durable, directories included, before it is reported stored (slower). ``io_threads``
    is the size of the worker pool that runs file I/O in parallel. ``scan_on_start`` runs
    the housekeeping thread (start-up scan, then every ``maintenance_s`` a look for dead
    writers' leftovers); temporary files without a writer token (older builds) are
    removed once older than ``stale_tmp_s``.
    """

    dir: str = field(default_factory=default_cache_dir)
    max_size_gb: float = 0.0
    low_water: float = 0.9
    fsync: bool = False
    io_threads: int = 4
    scan_on_start: bool = True
    stale_tmp_s: float = 300.0
    maintenance_s: float = 5.0
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
        if not self.maintenance_s > 0:
            raise StorageConfigError(f"file.maintenance_s must be > 0, got {self.maintenance_s}")

    @property
    def max_bytes(self) -> int:
        """The cap in bytes; 0 means unlimited."""
        return int(self.max_size_gb * 1024**3)


@dataclass(frozen=True)
class RedisConnection:
    """Where a Redis store is and how to reach it: the fields ``RedisSettings`` shares with
    the daemon's ``cache.l3.redis`` section (``hicache.config.RedisStoreConfig``), defined
    once here. Their meaning is documented on ``RedisSettings``; ``password`` is secret
    (never in ``repr``, redacted where a config is shown)."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    password: str | None = field(default=None, repr=False, metadata={"secret": True})
    password_file: str | None = None
    password_env: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify_hostname: bool = True
    ttl_s: int | None = None
    key_prefix: str = "hicache"


@dataclass(frozen=True)
class RedisSettings(RedisConnection):
    """Redis or Redis Cluster.

    ``url``: ``redis://[user[:pw]@]host:port/db``, ``rediss://`` (TLS) or
    ``unix:///path.sock``. ``cluster`` selects ``RedisCluster`` (the URL names any one
    node, ``rediss://`` works the same). ``ttl_s`` sets an expiry on every page so a
    ``volatile-lru`` server can evict them. Keys are ``{key_prefix}:{hash}``. A pipeline
    carries at most ``pipeline_bytes`` of values or ``pipeline_max`` commands.

    The password comes from at most one source: ``password`` (inline), ``password_file``
    (a file holding it; one trailing newline is dropped), ``password_env`` (the name of an
    environment variable holding it), or the URL's ``user:pw@`` (or ``?password=``). Files
    and variables are read when the backend attaches (``resolve_password``), not here, so
    these settings never hold a secret that was not given inline; ``repr`` never shows
    ``password``.

    TLS (``rediss://`` only): the server's certificate is always verified, against
    ``tls_ca_file`` (a PEM bundle, trusted in addition to the system's default store) or
    the system store alone when it is None; ``tls_verify_hostname`` also checks that the
    certificate names the URL's host. ``tls_cert_file`` (and ``tls_key_file`` when the key
    is not in the same PEM) present a client certificate to servers that require one; the
    key must not be encrypted.
    """

    pipeline_bytes: int = 16 * 1024 * 1024
    pipeline_max: int = 256
    max_connections: int = 32
    resilience: ResilienceSettings = field(default_factory=ResilienceSettings)

    kind = "redis"

    def __post_init__(self) -> None:
        try:
            parts = urlsplit(self.url)
            url_password = parts.password or next(iter(parse_qs(parts.query).get("password", [])), None)
        except ValueError as exc:
            raise StorageConfigError(f"redis.url does not parse: {exc}") from None
        scheme = parts.scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise StorageConfigError(f"redis.url must be redis://, rediss:// or unix://, got {redact_url(self.url)!r}")
        if self.cluster and scheme == "unix":
            raise StorageConfigError("redis.cluster needs a redis:// or rediss:// url, not unix://")
        sources = password_sources(self.password, self.password_file, self.password_env, url_password)
        if len(sources) > 1:
            raise StorageConfigError(f"redis: give the password in one place only, got {' and '.join(sources)}")
        for name in ("password_file", "password_env", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise StorageConfigError(f"redis.{name} must not be empty (null = unset)")
        tls = [n for n in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self, n) is not None]
        if tls and scheme != "rediss":
            raise StorageConfigError(f"redis.{tls[0]} needs a rediss:// url (TLS), got {scheme}://")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise StorageConfigError("redis.tls_key_file needs redis.tls_cert_file (the client certificate)")
        if self.ttl_s is not None and self.ttl_s < 1:
            raise StorageConfigError(f"redis.ttl_s must be >= 1 or null, got {self.ttl_s}")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise StorageConfigError(f"redis.key_prefix must be non-empty without spaces, got {self.key_prefix!r}")
        if self.pipeline_bytes < 1 or self.pipeline_max < 1 or self.max_connections < 1:
            raise StorageConfigError("redis.pipeline_bytes, pipeline_max and max_connections must be >= 1")

    @property
    def tls(self) -> bool:
        """True for a ``rediss://`` URL."""
        return self.url.startswith("rediss://")

    def resolve_password(self) -> str | None:
        """The password to send (None: none configured, or only the URL's, which the client
        reads from the URL itself). Reads ``password_file`` / ``password_env`` now.

        Raises ``StorageConfigError`` naming the key (never the secret) when the file
        cannot be read or is empty, or the variable is unset or empty.
        """
        if self.password:  # "" is no password, as for redis-py
            return self.password
        if self.password_file is not None:
            return read_password_file(self.password_file, "redis.password_file")
        if self.password_env is not None:
            return read_password_env(self.password_env, "redis.password_env")
        return None


def password_sources(password: str | None, password_file: str | None, password_env: str | None,
                     url_password: str | None) -> list[str]:
    """The names of the password sources that are set (more than one is a config error)."""
    named = (("password", password), ("password_file", password_file), ("password_env", password_env),
             ("a password in url", url_password))
    return [name for name, value in named if value is not None and value != ""]


def load_secret_file(path: str, what: str = "password") -> str:
    """The secret (``what``: a password, a key) held in ``path``: its text with one trailing
    newline (``\n`` or ``\r\n``) dropped. Raises ``ValueError`` with the reason (naming the
    path, never the content) when it cannot be read, is not UTF-8, is empty or holds more
    than one line."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    if not text:
        raise ValueError(f"{path} is empty (it must hold the {what})")
    if "\n" in text or "\r" in text:
        raise ValueError(f"{path} holds more than one line (it must hold only the {what})")
    return text


def load_secret_env(name: str) -> str:
    """The secret held in environment variable ``name``. Raises ``ValueError`` with the
    reason (naming the variable, never a value) when it is unset or empty."""
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"environment variable {name} is not set")
    if not value:
        raise ValueError(f"environment variable {name} is empty")
    return value


load_password_file = load_secret_file
load_password_env = load_secret_env


def read_password_file(path: str, key: str) -> str:
    """``load_password_file``, raising ``StorageConfigError`` prefixed with ``key``."""
    try:
        return load_password_file(path)
    except ValueError as exc:
        raise StorageConfigError(f"{key}: {exc}") from None


def read_password_env(name: str, key: str) -> str:
    """``load_password_env``, raising ``StorageConfigError`` prefixed with ``key``."""
    try:
        return load_password_env(name)
    except ValueError as exc:
        raise StorageConfigError(f"{key}: {exc}") from None


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def tls_file_problems(ca_file: str | None, cert_file: str | None, key_file: str | None) -> list[tuple[str, str]]:
    """Problems of the TLS files, as ``(key, reason)`` with ``key`` one of ``tls_ca_file``,
    ``tls_cert_file``, ``tls_key_file``: a file that cannot be read, a CA file that holds
    no PEM certificate, a certificate and key that do not load as a pair, an encrypted key
    (it would need a passphrase). Loads them the way the TLS connection will; empty when
    all is well. Reasons never include key material."""
    import ssl

    out: list[tuple[str, str]] = []
    for key, path in (("tls_ca_file", ca_file), ("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        if path is None:
            continue
        try:
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            out.append((key, f"cannot read {path}: {exc.strerror or exc}"))
    if out:
        return out
    if ca_file is not None:
        try:
            ssl.create_default_context().load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, ValueError) as exc:
            out.append(("tls_ca_file", f"{ca_file} holds no PEM CA certificate ({getattr(exc, 'reason', None) or exc})"))
    if cert_file is not None:
        what = f"{cert_file} and {key_file}" if key_file else cert_file
        try:
            ssl.create_default_context().load_cert_chain(cert_file, key_file, password=_no_passphrase)
        except _EncryptedKey:
            out.append((
                "tls_key_file" if key_file else "tls_cert_file",
                f"the private key in {key_file or cert_file} is encrypted; give an unencrypted key",
            ))
        except (ssl.SSLError, ValueError) as exc:
            out.append((
                "tls_cert_file",
                f"{what} do not hold a PEM certificate and its private key "
                f"({getattr(exc, 'reason', None) or exc})",
            ))
    return out


def redact_url(url: str) -> str:
    """``url`` without secrets, for log lines, errors and status output: a password in the
    userinfo becomes ``***`` (the user name stays), and so does the value of a
    ``password=`` query option. Never raises."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc_end = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if i != -1:
            netloc_end = min(netloc_end, i)
    netloc, tail = rest[:netloc_end], rest[netloc_end:]
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0] if ":" in userinfo else ""
        netloc = f"{user}:***@{host}" if user else f"***@{host}"
    if "?" in tail:
        path, _, query = tail.partition("?")
        query, hsep, frag = query.partition("#")
        items = []
        for item in query.split("&"):
            k, eq, _v = item.partition("=")
            items.append(f"{k}=***" if eq and k.lower() in ("password", "ssl_password") else item)
        tail = f"{path}?{'&'.join(items)}{hsep}{frag}"
    return f"{scheme}://{netloc}{tail}"


StorageSettings = FileSettings | RedisSettings
