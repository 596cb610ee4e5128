"""Fixtures for the storage suite: real ``redis-server`` processes on free loopback ports.

Every server runs in its own temporary directory with persistence off and is killed by
the fixture that started it. Tests that need Redis are skipped, with the reason, only when
``redis-server`` / ``redis-cli`` are not installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from storage_backends import FileSettings, PageLayout, RedisSettings, ResilienceSettings, create_backend
from storage_backends.base import StorageBackend

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS = "redis-server / redis-cli not installed (apt-get install redis-server)"

FAST = ResilienceSettings(timeout_s=2.0, failure_threshold=3, probe_base_s=0.05, probe_cap_s=0.5)


def free_port(cluster: bool = False) -> int:
    """A loopback port that is free now (and, for cluster nodes, whose bus port +10000 is free)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port found")


class RedisProcess:
    """One ``redis-server`` we started; ``kill`` / ``start`` keep the same port and dir."""

    def __init__(self, workdir: Path, port: int, extra: list[str] | None = None) -> None:
        self.workdir = workdir
        self.port = port
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError(NO_REDIS)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private standalone server for tests that kill, pause or restart it."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisProcess(tmp_path / "redis", free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisProcess(tmp_path_factory.mktemp("redis-standalone"), free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()


CLUSTER_NODE_ARGS = [
    "--cluster-enabled", "yes",
    "--cluster-config-file", "nodes.conf",
    "--cluster-node-timeout", "2000",
    # An L3 cache keeps serving the slots it still has when one node is lost.
    "--cluster-require-full-coverage", "no",
]  # fmt: skip


def start_cluster(base: Path, masters: int = 3) -> list[RedisProcess]:
    """Start ``masters`` cluster-enabled servers, join them into one cluster (no replicas)
    and wait until every node reports ``cluster_state:ok``. On failure, kills what it started.
    """
    if REDIS_SERVER is None or REDIS_CLI is None:
        raise RuntimeError(NO_REDIS)
    nodes: list[RedisProcess] = []
    try:
        for i in range(masters):
            node = RedisProcess(base / f"node{i}", free_port(cluster=True), CLUSTER_NODE_ARGS)
            node.start()
            nodes.append(node)
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        wait_cluster_ok(nodes, 30)
    except BaseException:
        for n in nodes:
            n.kill()
        raise
    return nodes


def wait_cluster_ok(nodes: list[RedisProcess], timeout: float) -> None:
    """Wait until every node in ``nodes`` reports ``cluster_state:ok``; raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for n in nodes:
            try:
                info = n.client().cluster("info")
            except redis.RedisError:
                info = None
            states.append(info.get("cluster_state") if isinstance(info, dict) else None)
        if all(s == "ok" for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster did not become ready: {states}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster on loopback, shared by the session; yields the URL of one node."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    nodes = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield nodes[0].url
    finally:
        for n in nodes:
            n.kill()


@pytest.fixture
def redis_cluster_nodes(tmp_path: Path) -> Iterator[list[RedisProcess]]:
    """A private 3-master cluster for tests that kill and restart its nodes."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    nodes = start_cluster(tmp_path / "cluster")
    try:
        yield nodes
    finally:
        for n in nodes:
            n.kill()


LAYOUT = PageLayout(layout_id=7, dtype="bfloat16", shape=(2, 4, 16, 64))  # 16 KiB pages

BACKEND_KINDS = ["file", "redis", "redis-cluster"]


def settings_for(kind: str, request: pytest.FixtureRequest, store: str, **overrides: object) -> object:
    """Settings for ``kind``; ``store`` names the directory (file) or key prefix (redis)."""
    if kind == "file":
        return FileSettings(dir=store, **{"resilience": FAST, **overrides})  # type: ignore[arg-type]
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


def random_hashes(n: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(n)]


def random_pages(n: int, layout: PageLayout = LAYOUT) -> list[bytes]:
    return [os.urandom(layout.payload_size) for _ in range(n)]


def buffers(n: int, layout: PageLayout = LAYOUT) -> list[memoryview]:
    return [memoryview(bytearray(layout.payload_size)) for _ in range(n)]
