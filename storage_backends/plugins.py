"""L3 backends from other packages, found by entry point (docs/storage.md "Plug-in backends").

A package adds a kind of store by naming a ``BackendPlugin`` under the entry-point group
``hicache.storage_backends``, the entry point's name being the kind::

    [project.entry-points."hicache.storage_backends"]
    sqlite = "hicache_sqlite_store:PLUGIN"

The plug-in owns everything about its kind, and nothing in hicache names it:

- **schema**: its ``settings_class`` is a dataclass; its init fields are the keys that
  ``cache.l3.options`` (and ``PUT /cache/storage``'s ``options``) may hold, and it has a
  class attribute ``kind`` equal to the plug-in's kind (``create_backend`` dispatches on it);
- **validation**: the settings class's ``__post_init__`` raises ``StorageConfigError`` (or
  ``ValueError``) naming the key; ``BackendPlugin.settings`` adds unknown and missing keys;
- **redaction**: fields whose metadata has ``secret: True`` show as ``***`` wherever the
  config is printed (``BackendPlugin.redacted``);
- **construction**: ``factory(settings, layout)`` returns a ``StorageBackend`` keeping the
  contract of ``storage_backends.base`` (``tests/storage`` runs it on an installed plug-in).

Settings cross process boundaries by pickle, so the settings class must be importable at
module level in every process of the daemon (it is, when the package is installed).

Entry points are read on first use, read again when a kind is asked for that is not
known (a package installed while the process runs), and on every listing of the kinds. An entry point that fails to load, is
not a ``BackendPlugin``, has another name than its kind, or claims a built-in kind is kept
as *broken*: asking for that kind raises ``StorageConfigError`` with the reason, and every
other kind works as before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from storage_backends.base import StorageBackend
from storage_backends.errors import StorageConfigError
from storage_backends.locks import ForkSafeLock
from storage_backends.page_format import PageLayout

ENTRY_POINT_GROUP = "hicache.storage_backends"

BUILTIN_KINDS = ("file", "redis")
"""The kinds this package builds itself; no plug-in may take one, nor ``none`` (no L3)."""

RESERVED_KINDS = ("none", *BUILTIN_KINDS)
"""The values of ``cache.l3.backend`` that need no plug-in (``none``: no L3)."""

KIND_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")
"""What a plug-in's kind looks like (it is a config value and a metric label)."""

BackendFactory = Callable[[Any, "PageLayout | None"], StorageBackend]
"""``factory(settings, layout)``: a backend for these settings (``layout`` None: administration only)."""


@dataclass(frozen=True)
class BackendPlugin:
    """What a package names under ``hicache.storage_backends``: one kind of L3 store."""

    kind: str
    settings_class: type
    factory: BackendFactory
    summary: str = ""
    """One line for people (``hicache storage --help``, error messages)."""

    def __post_init__(self) -> None:
        if not KIND_PATTERN.fullmatch(self.kind):
            raise StorageConfigError(f"plug-in kind {self.kind!r} must match {KIND_PATTERN.pattern}")
        if self.kind in RESERVED_KINDS:
            raise StorageConfigError(f"plug-in kind {self.kind!r} is built in ({', '.join(RESERVED_KINDS)})")
        if not dataclasses.is_dataclass(self.settings_class):
            raise StorageConfigError(f"plug-in {self.kind}: settings_class {self.settings_class!r} is not a dataclass")
        if getattr(self.settings_class, "kind", None) != self.kind:
            raise StorageConfigError(f"plug-in {self.kind}: settings_class.kind must be {self.kind!r}, "
                                     f"got {getattr(self.settings_class, 'kind', None)!r}")
        if not callable(self.factory):
            raise StorageConfigError(f"plug-in {self.kind}: factory is not callable")

    def keys(self) -> list[str]:
        """The keys its settings take, in the class's order."""
        return [f.name for f in dataclasses.fields(self.settings_class) if f.init]

    def secret_keys(self) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(self.settings_class) if f.metadata.get("secret"))

    def settings(self, options: Mapping[str, Any]) -> Any:
        """The settings for ``options`` (the mapping under ``cache.l3.options``).

        Raises ``StorageConfigError`` naming an unknown key, a missing one, or what the
        settings class refused; a secret's value is never quoted."""
        if not isinstance(options, Mapping):
            raise StorageConfigError(f"must be a mapping of {self.kind} settings, got {type(options).__name__}")
        known = self.keys()
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise StorageConfigError(f"unknown key {unknown[0]!r} for the {self.kind} backend "
                                     f"(its keys: {', '.join(known) or 'none'})")
        required = [f.name for f in dataclasses.fields(self.settings_class) if f.init
                    and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in options]
        if missing:
            raise StorageConfigError(f"the {self.kind} backend needs {', '.join(missing)}")
        try:
            return self.settings_class(**options)
        except StorageConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise StorageConfigError(str(exc)) from None

    def redacted(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with each secret's value shown as ``***``."""
        secret = self.secret_keys()
        return {k: "***" if k in secret and v is not None else v for k, v in options.items()}


class _Registry:
    """The plug-ins found so far and the entry points that could not be used."""

    def __init__(self) -> None:
        self.lock = ForkSafeLock()
        self.plugins: dict[str, BackendPlugin] = {}
        self.broken: dict[str, str] = {}
        self.scanned = False

    def scan(self) -> None:
        plugins: dict[str, BackendPlugin] = {}
        broken: dict[str, str] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            where = f"entry point {ep.name} = {ep.value}"
            if ep.name in plugins or ep.name in broken:
                broken[ep.name] = f"{where}: the kind {ep.name!r} is named by two installed packages"
                plugins.pop(ep.name, None)
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a third party's import error must not stop the daemon
                broken[ep.name] = f"{where} does not load: {type(exc).__name__}: {exc}"
                continue
            if not isinstance(obj, BackendPlugin):
                broken[ep.name] = f"{where} is a {type(obj).__name__}, not a storage_backends.BackendPlugin"
            elif obj.kind != ep.name:
                broken[ep.name] = f"{where} names kind {obj.kind!r}; the entry point's name must be its kind"
            else:
                plugins[ep.name] = obj
        for name in RESERVED_KINDS:
            if name in plugins or name in broken:
                plugins.pop(name, None)
                broken[name] = f"an installed package claims the built-in kind {name!r}; it is ignored"
        self.plugins, self.broken, self.scanned = plugins, broken, True

    def find(self, kind: str) -> BackendPlugin | None:
        with self.lock:
            if not self.scanned or (kind not in self.plugins and kind not in self.broken):
                self.scan()
            if kind in self.broken and kind not in RESERVED_KINDS:
                raise StorageConfigError(f"L3 backend {kind!r}: {self.broken[kind]}")
            return self.plugins.get(kind)

    def kinds(self) -> list[str]:
        """Read afresh on every call (a listing is rare: an error message, the OpenAPI
        schema), so a package installed after the first scan is listed too."""
        with self.lock:
            self.scan()
            return sorted(self.plugins)


_REGISTRY = _Registry()


def find_plugin(kind: str) -> BackendPlugin | None:
    """The installed plug-in of ``kind``, None if no package names it. Raises
    ``StorageConfigError`` with the reason when one does but it cannot be used."""
    return _REGISTRY.find(kind)


def plugin_kinds() -> list[str]:
    """The kinds installed plug-ins provide (broken ones left out)."""
    return _REGISTRY.kinds()


def plugin_for(kind: str) -> BackendPlugin:
    """``find_plugin``, raising ``StorageConfigError`` for a kind nothing provides."""
    plugin = find_plugin(kind)
    if plugin is None:
        known = [*BUILTIN_KINDS, *plugin_kinds()]
        raise StorageConfigError(f"unknown L3 backend {kind!r}: not built in and no installed package provides it "
                                 f"(available: none, {', '.join(known)})")
    return plugin
