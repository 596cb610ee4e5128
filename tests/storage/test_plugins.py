"""L3 backends from other packages (``storage_backends.plugins``): found by entry point,
their settings checked and redacted by their own class, a broken one failing only its kind.

The example plug-in (``examples/sqlite_store``) is installed by pip for these tests
(``sqlite_plugin``); the storage contract suite runs on it too (``test_contract.py``, kind
``sqlite-plugin``), and ``tests/e2e/test_storage_plugin.py`` serves a daemon from it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hicache.config import ConfigError, config_from_dict, dump_yaml
from hicache.storage_settings import l3_backends, redacted_options, storage_settings_from_config
from storage_backends import (
    BackendPlugin,
    FileSettings,
    StorageBackend,
    StorageConfigError,
    available_backends,
    create_backend,
    find_plugin,
    plugin_for,
)
from storage_backends import plugins as plugin_registry
from tests.storage.conftest import LAYOUT, random_hashes, random_pages

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_plugin_is_found_by_its_entry_point_and_builds_its_store(sqlite_plugin: Path,
                                                                              tmp_path: Path) -> None:
    assert "sqlite" in available_backends() and "sqlite" in l3_backends()
    plugin = plugin_for("sqlite")
    assert type(plugin).__module__ == "storage_backends.plugins"
    assert sys.modules[plugin.factory.__module__].__file__.startswith(str(sqlite_plugin))
    settings = plugin.settings({"path": str(tmp_path / "a.sqlite")})
    with create_backend(settings, LAYOUT) as be:
        assert be.kind == "sqlite"
        hashes = random_hashes(3)
        assert be.batch_set(hashes, random_pages(3)) == [True] * 3
        assert be.batch_exists(hashes) == 3


def test_the_plugin_checks_its_own_options(sqlite_plugin: Path, tmp_path: Path) -> None:
    plugin = plugin_for("sqlite")
    with pytest.raises(StorageConfigError, match=r"unknown key 'dir' for the sqlite backend \(its keys: path, timeout_s\)"):
        plugin.settings({"dir": "x"})
    with pytest.raises(StorageConfigError, match="the sqlite backend needs path"):
        plugin.settings({})
    with pytest.raises(StorageConfigError, match="timeout_s must be a number > 0"):
        plugin.settings({"path": str(tmp_path / "a"), "timeout_s": 0})
    with pytest.raises(StorageConfigError, match="must be a mapping"):
        plugin.settings(["path"])


@dataclass(frozen=True)
class _TokenSettings:
    endpoint: str
    token: str | None = field(default=None, repr=False, metadata={"secret": True})

    kind = "tokenstore"


def test_plugin_definitions_are_checked_and_secrets_redacted() -> None:
    def factory(settings: object, layout: object) -> StorageBackend:
        raise AssertionError("not built here")

    plugin = BackendPlugin("tokenstore", _TokenSettings, factory)
    assert plugin.redacted({"endpoint": "e", "token": "s3cret"}) == {"endpoint": "e", "token": "***"}
    assert plugin.redacted({"endpoint": "e", "token": None}) == {"endpoint": "e", "token": None}
    with pytest.raises(StorageConfigError, match="built in"):
        BackendPlugin("file", _TokenSettings, factory)
    with pytest.raises(StorageConfigError, match="must match"):
        BackendPlugin("Token Store", _TokenSettings, factory)
    with pytest.raises(StorageConfigError, match="settings_class.kind must be 'other'"):
        BackendPlugin("other", _TokenSettings, factory)
    with pytest.raises(StorageConfigError, match="not a dataclass"):
        BackendPlugin("tokenstore", dict, factory)
    # a plug-in that cannot be found: every option is hidden (only it knows its secrets)
    assert redacted_options(SimpleNamespace(backend="nosuch", options={"a": "1", "b": None})) == {"a": "***", "b": None}


@pytest.fixture
def broken_packages(tmp_path: Path, sqlite_plugin: Path) -> Iterator[None]:
    """An installed distribution (a dist-info on ``sys.path``) naming five bad entry points."""
    site = tmp_path / "site"
    info = site / "broken_backends-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-backends\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[hicache.storage_backends]\n"
        "missing = no_such_module_for_hicache:PLUGIN\n"
        "notaplugin = json:dumps\n"
        "renamed = hicache_sqlite_store:PLUGIN\n"
        "file = hicache_sqlite_store:PLUGIN\n"
    )
    sys.path.insert(0, str(site))
    plugin_registry._REGISTRY.scan()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        plugin_registry._REGISTRY.scan()


def test_a_broken_entry_point_fails_only_its_own_kind(broken_packages: None, tmp_path: Path) -> None:
    with pytest.raises(StorageConfigError, match="does not load: ModuleNotFoundError"):
        find_plugin("missing")
    with pytest.raises(StorageConfigError, match="is a function, not a storage_backends.BackendPlugin"):
        find_plugin("notaplugin")
    with pytest.raises(StorageConfigError, match="the entry point's name must be its kind"):
        find_plugin("renamed")
    assert "missing" not in available_backends() and "renamed" not in available_backends()
    with create_backend(FileSettings(dir=str(tmp_path / "f")), LAYOUT) as be:  # the built-in file kind stays
        assert be.kind == "file"
    assert find_plugin("sqlite") is not None
    with pytest.raises(ConfigError, match=r"cache\.l3\.backend: L3 backend 'missing': entry point missing"):
        config_from_dict({"cache": {"l3": {"backend": "missing"}}})


def test_config_takes_a_plugin_backend_and_its_options(sqlite_plugin: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "l3.sqlite")
    cfg = config_from_dict({"cache": {"l3": {"backend": "sqlite", "options": {"path": path, "timeout_s": 3}}}})
    settings = storage_settings_from_config(cfg.cache.l3)
    assert settings.kind == "sqlite" and settings.path == path and settings.timeout_s == 3
    assert yaml.safe_load(dump_yaml(cfg))["cache"]["l3"]["options"] == {"path": path, "timeout_s": 3}
    with pytest.raises(ConfigError, match=r"cache\.l3\.options: unknown key 'dirr'"):
        config_from_dict({"cache": {"l3": {"backend": "sqlite", "options": {"dirr": path}}}})
    # like cache.l3.redis beside backend file, options beside a built-in kind are not read
    assert storage_settings_from_config(config_from_dict(
        {"cache": {"l3": {"backend": "file", "options": {"path": path}}}}).cache.l3).kind == "file"
    with pytest.raises(ConfigError, match=r"cache\.l3\.options: must be a mapping"):
        config_from_dict({"cache": {"l3": {"backend": "sqlite", "options": [path]}}})
    with pytest.raises(ConfigError, match=r"unknown L3 backend 'sqlight'.*available: none, file, redis, sqlite"):
        config_from_dict({"cache": {"l3": {"backend": "sqlight"}}})


def test_openapi_attaches_a_plugin_store_by_name_only(sqlite_plugin: Path) -> None:
    """With a plug-in installed, ``PUT /cache/storage`` still takes a store's name, never a
    backend kind or its options (a plug-in store is attached as one of ``cache.l3_stores``)."""
    from hicache.api_server.openapi import storage_body

    body = storage_body()
    assert set(body["properties"]) == {"store"} and body["required"] == ["store"]


def test_storage_cli_acts_on_a_plugin_store(sqlite_plugin: Path, tmp_path: Path) -> None:
    db = tmp_path / "l3.sqlite"
    with create_backend(plugin_for("sqlite").settings({"path": str(db)}), LAYOUT) as be:
        be.batch_set(random_hashes(4), random_pages(4))
    cfg = tmp_path / "hicache.yaml"
    cfg.write_text(yaml.safe_dump({"cache": {"l3": {"backend": "sqlite", "options": {"path": str(db)}}}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sqlite_plugin), str(REPO)])}

    def storage(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hicache", "storage", "--config", str(cfg), *args],
                              env=env, capture_output=True, text=True, timeout=120)

    out = storage("stats", "--json")
    assert out.returncode == 0, out.stderr
    figures = yaml.safe_load(out.stdout)
    assert (figures["backend"], figures["pages"], figures["bytes"]) == ("sqlite", 4, 4 * LAYOUT.object_size)
    out = storage("verify")
    assert out.returncode == 0 and "4 ok, 0 bad" in out.stdout, out.stdout + out.stderr
    out = storage("clear", "--yes")
    assert out.returncode == 0 and "removed 4 pages" in out.stdout, out.stdout + out.stderr
    assert dataclasses.is_dataclass(plugin_for("sqlite").settings_class)
