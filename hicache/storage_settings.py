"""The core config's ``cache.l3`` section as ``storage_backends`` settings.

``storage_backends`` does not read the daemon's config; this module is the one place that
converts it. Used by the controller (to build the L3 store and for the admin API's
attach) and by ``hicache storage``. It imports ``storage_backends`` lazily, so importing
it costs nothing until a store is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage_backends import FileSettings, RedisSettings

L3_BACKENDS = ("none", "file", "redis")
"""The values ``cache.l3.backend`` may take."""


def storage_settings_from_config(l3cfg: Any) -> FileSettings | RedisSettings | None:
    """Convert a ``cache.l3`` section (``hicache.config.L3Config``) into backend settings.

    Returns ``None`` for ``backend: none`` (no L3 store), ``FileSettings`` for ``file``
    and ``RedisSettings`` for ``redis``; settings the section does not name keep the
    backends' defaults. Duck-typed, so anything with the same attributes works: reads
    ``backend``, ``file.dir``, ``file.max_size_gb``, optional ``file.fsync``, and
    ``redis.url`` plus optional ``.cluster``, ``.password``, ``.password_file``,
    ``.password_env``, ``.tls_ca_file``, ``.tls_cert_file``, ``.tls_key_file``,
    ``.tls_verify_hostname``, ``.ttl_s``, ``.key_prefix``, ``.timeout_s``. Raises
    ``StorageConfigError`` (a ``ValueError``) for an unknown backend or a value the settings
    refuse; never touches the store, and never reads a password file or variable (the
    backend does, when it connects).
    """
    from storage_backends import FileSettings, RedisSettings, ResilienceSettings, StorageConfigError

    backend = getattr(l3cfg, "backend", "none")
    if backend in (None, "none"):
        return None
    if backend == "file":
        f = l3cfg.file
        return FileSettings(
            dir=str(f.dir),
            max_size_gb=float(f.max_size_gb),
            fsync=bool(getattr(f, "fsync", False)),
        )
    if backend == "redis":
        r = l3cfg.redis
        timeout = getattr(r, "timeout_s", None)
        return RedisSettings(
            url=str(r.url),
            cluster=bool(getattr(r, "cluster", False)),
            password=getattr(r, "password", None),
            password_file=getattr(r, "password_file", None),
            password_env=getattr(r, "password_env", None),
            tls_ca_file=getattr(r, "tls_ca_file", None),
            tls_cert_file=getattr(r, "tls_cert_file", None),
            tls_key_file=getattr(r, "tls_key_file", None),
            tls_verify_hostname=bool(getattr(r, "tls_verify_hostname", True)),
            ttl_s=getattr(r, "ttl_s", None),
            key_prefix=str(getattr(r, "key_prefix", "hicache")),
            resilience=ResilienceSettings(timeout_s=float(timeout)) if timeout else ResilienceSettings(),
        )
    raise StorageConfigError(f"cache.l3.backend: unknown backend {backend!r} ({', '.join(L3_BACKENDS)})")
