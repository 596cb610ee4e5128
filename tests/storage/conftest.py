"""Fixtures for the storage suite: real ``redis-server`` processes on free loopback ports.

Every server runs in its own temporary directory with persistence off and is killed by
the fixture that started it. Tests that need Redis are skipped, with the reason, only when
``redis-server`` / ``redis-cli`` are not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hicache.bench.local_redis import (
    RedisProcess,
    find_redis_cli,
    find_redis_server,
    started,
    started_cluster,
)
from storage_backends import (
    FileSettings,
    PageLayout,
    RedisSettings,
    ResilienceSettings,
    create_backend,
    plugin_for,
)
from storage_backends.base import StorageBackend

REDIS_SERVER = find_redis_server()
REDIS_CLI = find_redis_cli()
NO_REDIS = "redis-server / redis-cli not installed (apt-get install redis-server)"

FAST = ResilienceSettings(timeout_s=2.0, failure_threshold=3, probe_base_s=0.05, probe_cap_s=0.5)


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private standalone server for tests that kill, pause or restart it."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    with started(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    with started(tmp_path_factory.mktemp("redis-standalone")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster on loopback, shared by the session; yields the URL of one node."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    with started_cluster(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes[0].url


@pytest.fixture
def redis_cluster_nodes(tmp_path: Path) -> Iterator[list[RedisProcess]]:
    """A private 3-master cluster for tests that kill and restart its nodes."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    with started_cluster(tmp_path / "cluster") as nodes:
        yield nodes


LAYOUT = PageLayout(layout_id=7, dtype="bfloat16", shape=(2, 4, 16, 64))  # 16 KiB pages

BACKEND_KINDS = ["file", "redis", "redis-cluster", "sqlite-plugin"]
"""``sqlite-plugin``: the example plug-in (``examples/sqlite_store``), installed by pip into a
directory on ``sys.path`` and built through its entry point, as a third party's would be."""


@pytest.fixture(scope="session")
def sqlite_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example plug-in installed into a fresh directory put on ``sys.path`` (spawned
    children inherit it) for the session; yields the directory."""
    from tests.storage.plugin_install import install_sqlite_plugin

    site = install_sqlite_plugin(tmp_path_factory.mktemp("plugin-site") / "site")
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))


def settings_for(kind: str, request: pytest.FixtureRequest, store: str, **overrides: object) -> object:
    """Settings for ``kind``; ``store`` names the directory (file) or key prefix (redis)."""
    if kind == "file":
        return FileSettings(dir=store, **{"resilience": FAST, **overrides})  # type: ignore[arg-type]
    if kind == "sqlite-plugin":
        request.getfixturevalue("sqlite_plugin")
        return plugin_for("sqlite").settings({"path": os.path.join(store, "l3.sqlite"), **overrides})
    prefix = os.path.basename(store)
    if kind == "redis":
        url = request.getfixturevalue("redis_standalone").url
        return RedisSettings(url=url, key_prefix=prefix, **{"resilience": FAST, **overrides})  # type: ignore[arg-type]
    url = request.getfixturevalue("redis_cluster")
    return RedisSettings(  # type: ignore[arg-type]
        url=url, cluster=True, key_prefix=prefix, **{"resilience": FAST, **overrides}
    )


BackendFactory = Callable[..., StorageBackend]


@pytest.fixture(params=BACKEND_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendFactory]:
    """``make_backend(layout=LAYOUT, **settings_overrides)``: backends that share one store.

    The store (a directory, or a key prefix on the shared servers) is private to the test
    and cleared at the end; every backend made is closed.
    """
    store = str(tmp_path / f"l3{uuid.uuid4().hex[:12]}")
    made: list[StorageBackend] = []

    def make(layout: PageLayout | None = LAYOUT, **overrides: object) -> StorageBackend:
        backend = create_backend(settings_for(kind, request, store, **overrides), layout)
        made.append(backend)
        return backend

    try:
        yield make
    finally:
        try:
            if made:
                made[0].clear()
        finally:
            for b in made:
                b.close()


def wait_until(cond: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll ``cond`` until it is true or ``timeout`` seconds passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) at ``mnt``, unmounted afterwards; the test is
    skipped where it cannot be mounted (not root, no ``mount``)."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def random_hashes(n: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(n)]


def random_pages(n: int, layout: PageLayout = LAYOUT) -> list[bytes]:
    return [os.urandom(layout.payload_size) for _ in range(n)]


def buffers(n: int, layout: PageLayout = LAYOUT) -> list[memoryview]:
    return [memoryview(bytearray(layout.payload_size)) for _ in range(n)]
