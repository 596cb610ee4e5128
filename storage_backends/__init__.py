"""L3 storage backends (docs/architecture.md §6-§7).

Page objects keyed by page hash, behind one interface (``StorageBackend``), built by
``create_backend(settings, layout)`` from ``FileSettings``, ``RedisSettings`` or the
settings of a kind another package provides by entry point (``BackendPlugin``). This
package imports nothing from ``hicache``; backends load their client libraries lazily.
"""

from __future__ import annotations

from storage_backends.base import StorageBackend, StoreUsage
from storage_backends.errors import (
    InvalidPageHash,
    PageFormatError,
    StorageCapacityError,
    StorageConfigError,
    StorageError,
    StorageTimeout,
    StorageUnavailable,
)
from storage_backends.keys import is_page_hash
from storage_backends.page_format import HEADER_SIZE, PageLayout
from storage_backends.plugins import ENTRY_POINT_GROUP, BackendPlugin, find_plugin, plugin_for, plugin_kinds
from storage_backends.registry import available_backends, create_backend, register_backend
from storage_backends.settings import FileSettings, RedisSettings, ResilienceSettings, StorageSettings
from storage_backends.stats import StorageStats

__all__ = [
    "ENTRY_POINT_GROUP",
    "HEADER_SIZE",
    "BackendPlugin",
    "FileSettings",
    "InvalidPageHash",
    "PageFormatError",
    "PageLayout",
    "RedisSettings",
    "ResilienceSettings",
    "StorageBackend",
    "StorageCapacityError",
    "StorageConfigError",
    "StorageError",
    "StorageSettings",
    "StorageStats",
    "StorageTimeout",
    "StorageUnavailable",
    "StoreUsage",
    "available_backends",
    "create_backend",
    "find_plugin",
    "is_page_hash",
    "plugin_for",
    "plugin_kinds",
    "register_backend",
]
