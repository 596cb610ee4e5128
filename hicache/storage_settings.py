"""The core config's ``cache.l3`` section as ``storage_backends`` settings.

``storage_backends`` does not read the daemon's config; this module is the one place that
converts it. Used by the controller (to build the L3 store and for the admin API's
attach), by ``hicache storage`` and by the config's validation and printing. Of
``storage_backends`` it imports the plug-in registry (standard library only) at once and the
rest lazily, so importing it loads no client library.

The built-in kinds have sections of their own (``cache.l3.file``, ``cache.l3.redis``); a
kind an installed package provides (``storage_backends.plugins``) takes its settings from
``cache.l3.options``, whose keys, checks and secrets its plug-in defines.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from storage_backends.plugins import RESERVED_KINDS
from storage_backends.settings import RedisConnection

BUILTIN_L3_BACKENDS = RESERVED_KINDS
"""The values of ``cache.l3.backend`` that need no plug-in (``none``, ``file``, ``redis``)."""


REDIS_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(RedisConnection))
"""The keys of ``cache.l3.redis`` that are ``RedisSettings`` fields of the same name and
meaning: both classes take them from ``RedisConnection`` (the section's ``timeout_s`` becomes
``resilience.timeout_s``; the rest of ``RedisSettings`` is tuning the config does not expose)."""


def l3_backends() -> list[str]:
    """Every value ``cache.l3.backend`` may take here: built in, or an installed plug-in's kind."""
    from storage_backends import plugin_kinds

    return [*BUILTIN_L3_BACKENDS, *plugin_kinds()]


def l3_problems(l3cfg: Any) -> list[tuple[str, str]]:
    """What is wrong with a ``cache.l3`` section's backend and options, as ``(key, reason)``
    with ``key`` relative to ``cache.l3``: an unknown backend (naming those available), a
    plug-in that cannot be used, options its settings refuse. The built-in sections' own
    keys are checked by ``hicache.config.validate``."""
    from storage_backends import StorageConfigError, plugin_for

    backend, options = l3cfg.backend, l3cfg.options
    if backend in BUILTIN_L3_BACKENDS:
        return []  # options are read only for a plug-in (as cache.l3.redis is only for redis)
    try:
        plugin = plugin_for(backend)
    except StorageConfigError as exc:
        return [("backend", str(exc))]
    try:
        plugin.settings(options)
    except StorageConfigError as exc:
        return [("options", str(exc))]
    return []


def redacted_options(l3cfg: Any) -> dict[str, Any]:
    """``cache.l3.options`` for printing: the plug-in's secrets as ``***``, and every value
    when the plug-in cannot be found (it alone knows which keys are secret)."""
    from storage_backends import StorageConfigError, find_plugin

    options = dict(l3cfg.options)
    try:
        plugin = find_plugin(l3cfg.backend) if l3cfg.backend not in BUILTIN_L3_BACKENDS else None
    except StorageConfigError:
        plugin = None
    if plugin is None:
        return {k: "***" if v is not None else v for k, v in options.items()}
    return plugin.redacted(options)


def storage_settings_from_config(l3cfg: Any) -> Any:
    """Convert a ``cache.l3`` section (``hicache.config.L3Config``) into backend settings.

    Returns ``None`` for ``backend: none`` (no L3 store), ``FileSettings`` for ``file``,
    ``RedisSettings`` for ``redis`` and a plug-in's settings (from ``options``) for a kind
    an installed package provides; settings the section does not name keep the
    backends' defaults. Duck-typed, so anything with the same attributes works: reads
    ``backend``, ``file.dir``, ``file.max_size_gb``, optional ``file.fsync`` and
    ``file.timeout_s``; those of
    ``REDIS_CONFIG_KEYS`` and ``timeout_s`` that ``redis`` has; ``options`` for a plug-in. Raises
    ``StorageConfigError`` (a ``ValueError``) for an unknown backend or a value the settings
    refuse; never touches the store, and never reads a password file or variable (the
    backend does, when it connects).
    """
    from storage_backends import FileSettings, RedisSettings, ResilienceSettings, plugin_for

    backend = getattr(l3cfg, "backend", "none")
    if backend in (None, "none"):
        return None
    if backend == "file":
        f = l3cfg.file
        timeout = getattr(f, "timeout_s", None)
        return FileSettings(
            dir=str(f.dir),
            max_size_gb=float(f.max_size_gb),
            fsync=bool(getattr(f, "fsync", False)),
            resilience=ResilienceSettings(timeout_s=float(timeout)) if timeout else ResilienceSettings(),
        )
    if backend == "redis":
        r = l3cfg.redis
        timeout = getattr(r, "timeout_s", None)
        given = {name: getattr(r, name) for name in REDIS_CONFIG_KEYS if hasattr(r, name)}
        return RedisSettings(
            **given,
            resilience=ResilienceSettings(timeout_s=float(timeout)) if timeout else ResilienceSettings(),
        )
    return plugin_for(str(backend)).settings(getattr(l3cfg, "options", None) or {})


TENANTS_DIR = "tenants"
"""Where a file store keeps its tenants' partitions: ``{dir}/tenants/{tenant}/`` (the store's
own pages live in its hex shard directories, which a store never leaves)."""


def l3_quotas_gb(cfg: Any) -> dict[str, float]:
    """Per tenant, the L3 partition its ``server.api_keys[].quota.l3_gb`` gives it (none: {})."""
    return {k.tenant: float(k.quota.l3_gb) for k in cfg.server.api_keys if k.quota is not None and k.quota.l3_gb}


def tenant_partitions(settings: Any, quotas_gb: dict[str, float]) -> tuple[Any, dict[str, Any]]:
    """The shared store's settings and each quota tenant's partition: a file store of its own
    at ``{dir}/tenants/{tenant}`` capped at its quota, so that only its own writes evict its
    pages; the shared store keeps the cap less the partitions. Without quotas, ``settings``
    and {}. Raises ``StorageConfigError`` (a ``ValueError``) for a store that is not a file
    store with a cap larger than the partitions (``hicache.config.quota_problems`` refuses
    such configs; a store attached at run time is checked here)."""
    from storage_backends import FileSettings, StorageConfigError

    if not quotas_gb:
        return settings, {}
    if not isinstance(settings, FileSettings):
        raise StorageConfigError(f"per-tenant L3 quotas (server.api_keys[].quota.l3_gb) need a file store, not "
                                 f"{getattr(settings, 'kind', type(settings).__name__)!r}: its eviction is blind "
                                 "to tenants")
    total = sum(quotas_gb.values())
    if not 0 < total < settings.max_size_gb:
        raise StorageConfigError(f"the tenants' L3 partitions ({total:g} GB) must be less than the file store's "
                                 f"max_size_gb ({settings.max_size_gb:g})")
    shared = dataclasses.replace(settings, max_size_gb=settings.max_size_gb - total)
    parts = {t: dataclasses.replace(settings, dir=os.path.join(settings.dir, TENANTS_DIR, t), max_size_gb=gb)
             for t, gb in sorted(quotas_gb.items())}
    return shared, parts
