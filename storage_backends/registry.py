"""Build a backend from settings: the one place that maps a kind to a class.

The built-in kinds (``file``, ``redis``) are registered here; other packages add theirs
by entry point (``storage_backends.plugins``), and ``register_backend`` adds one in this
process only (the class must accept ``(settings, layout)``). ``create_backend`` raises
``StorageConfigError`` for an unknown kind and lets ``StorageUnavailable`` from the
constructor through: a store that was asked for and cannot start is an error at start,
with the reason.
"""

from __future__ import annotations

from typing import Any

from storage_backends.base import StorageBackend
from storage_backends.errors import StorageConfigError
from storage_backends.page_format import PageLayout
from storage_backends.plugins import BackendFactory, find_plugin, plugin_kinds

_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(kind: str, factory: BackendFactory) -> None:
    """Make ``create_backend`` build ``factory(settings, layout)`` for ``settings.kind == kind``."""
    _FACTORIES[kind] = factory


def _file(settings: Any, layout: PageLayout | None) -> StorageBackend:
    from storage_backends.file_backend import FileBackend

    return FileBackend(settings, layout)


def _redis(settings: Any, layout: PageLayout | None) -> StorageBackend:
    from storage_backends.redis_backend import RedisBackend

    return RedisBackend(settings, layout)


register_backend("file", _file)
register_backend("redis", _redis)


def available_backends() -> list[str]:
    """Every kind ``create_backend`` builds: registered here and provided by installed plug-ins."""
    return sorted({*_FACTORIES, *plugin_kinds()})


def create_backend(settings: Any, layout: PageLayout | None) -> StorageBackend:
    """A backend for ``settings`` (``FileSettings``, ``RedisSettings``, a registered kind's or
    an installed plug-in's settings).

    ``layout`` is what every page read or written must look like; ``None`` builds a
    backend for administration only (``hicache storage``).
    """
    kind = getattr(settings, "kind", None)
    factory = _FACTORIES.get(kind) if isinstance(kind, str) else None
    if factory is None and isinstance(kind, str):
        plugin = find_plugin(kind)
        factory = plugin.factory if plugin is not None else None
    if factory is None:
        raise StorageConfigError(f"unknown L3 backend {kind!r}; available: {', '.join(available_backends())}")
    return factory(settings, layout)
