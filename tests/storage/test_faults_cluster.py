"""Storage fault tests, continued: a Redis Cluster changing under traffic (a replica
promoted when its master is killed, slots resharded with MIGRATE / ASK), and objects over
16 MiB on every backend. Pages keep flowing; a read is a miss or the exact bytes, never an
exception or another page's bytes, and once the cluster settles every page it kept is
served again."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.local_redis import RedisProcess, started_cluster, wait_cluster_ok
from storage_backends import PageLayout, RedisSettings, ResilienceSettings, create_backend
from storage_backends.base import StorageBackend
from tests.storage.conftest import (
    LAYOUT,
    NO_REDIS,
    REDIS_CLI,
    REDIS_SERVER,
    BackendFactory,
    buffers,
    random_hashes,
    random_pages,
    wait_until,
)

QUICK = ResilienceSettings(timeout_s=1.0, failure_threshold=2, probe_base_s=0.05, probe_cap_s=0.5)


def _node_id(node: RedisProcess) -> str:
    with node.client() as c:
        ident = c.execute_command("CLUSTER", "MYID")
    return ident.decode() if isinstance(ident, bytes) else str(ident)


def _slots_of(node: RedisProcess) -> int:
    """How many slots ``node`` serves as master, as the cluster says."""
    me = _node_id(node)
    with node.client() as c:
        ranges = c.execute_command("CLUSTER", "SLOTS")
    total = 0
    for start, end, master, *_replicas in ranges:
        ident = master[2].decode() if isinstance(master[2], bytes) else str(master[2])
        total += (end - start + 1) if ident == me else 0
    return total


def _role(node: RedisProcess) -> str:
    with node.client() as c:
        return str(c.info("replication").get("role"))


class Traffic:
    """Threads that read ``hashes`` (checking every hit's bytes) and write fresh pages,
    without pause, until stopped; any exception or wrong byte is kept for the test."""

    def __init__(self, be: StorageBackend, hashes: list[str], pages: list[bytes], threads: int = 2) -> None:
        self.be, self.hashes, self.pages = be, hashes, pages
        self.problems: list[str] = []
        self.hits = 0
        self.writes = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self) -> None:
        into = buffers(len(self.hashes))
        while not self._stop.is_set():
            try:
                got = self.be.batch_get(self.hashes, into)
                for ok, buf, want in zip(got, into, self.pages, strict=True):
                    if ok:
                        self.hits += 1
                        if bytes(buf) != want:
                            self.problems.append("a hit returned other bytes")
                self.writes += sum(self.be.batch_set(random_hashes(4), random_pages(4)))
                self.be.batch_exists(self.hashes)
            except BaseException as exc:  # the interface never raises for store trouble
                self.problems.append(repr(exc))
                return


def _serves_all(be: StorageBackend, hashes: list[str], pages: list[bytes]) -> bool:
    into = buffers(len(hashes))
    return be.batch_get(hashes, into) == [True] * len(hashes) and [bytes(b) for b in into] == pages


@pytest.fixture
def cluster_with_replicas(tmp_path: Path) -> Iterator[list[RedisProcess]]:
    """3 masters, one replica each (private: the test kills a master)."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    with started_cluster(tmp_path / "cluster", masters=3, replicas=1) as nodes:
        yield nodes


def test_redis_cluster_failover_while_pages_flow(cluster_with_replicas: list[RedisProcess]) -> None:
    nodes = cluster_with_replicas
    masters = [n for n in nodes if _role(n) == "master"]
    assert len(masters) == 3
    be = create_backend(RedisSettings(url=masters[0].url, cluster=True, key_prefix="fo", resilience=QUICK), LAYOUT)
    hashes = random_hashes(60)
    pages = random_pages(60)
    assert be.batch_set(hashes, pages) == [True] * 60
    for m in masters:  # replicated before the kill: the promoted replica has them
        with m.client() as c:
            assert c.execute_command("WAIT", 1, 5000) >= 1
    victim = masters[1]
    with Traffic(be, hashes, pages) as traffic:
        time.sleep(0.2)
        victim.kill()
        survivors = [n for n in nodes if n is not victim]
        assert wait_until(lambda: sum(_role(n) == "master" for n in survivors) == 3, 30), "no replica was promoted"
        wait_cluster_ok(survivors, 30)
        # the store serves every page again, and takes writes on every slot, while traffic goes on
        assert wait_until(lambda: _serves_all(be, hashes, pages), 30), "pages of the failed master not served again"
        assert wait_until(lambda: be.batch_set(random_hashes(30), random_pages(30)) == [True] * 30, 30)
    assert not traffic.problems, traffic.problems[:3]
    assert traffic.hits > 0 and traffic.writes > 0
    assert wait_until(lambda: be.stats().up, 10)
    assert be.stats().corrupt == 0
    be.close()


def test_redis_cluster_resharding_while_pages_flow(redis_cluster_nodes: list[RedisProcess]) -> None:
    nodes = redis_cluster_nodes
    be = create_backend(RedisSettings(url=nodes[0].url, cluster=True, key_prefix="rs", resilience=QUICK), LAYOUT)
    hashes = random_hashes(200)
    pages = random_pages(200)
    assert be.batch_set(hashes, pages) == [True] * 200
    slots_before = _slots_of(nodes[1])
    with Traffic(be, hashes, pages) as traffic:
        time.sleep(0.2)
        moved = subprocess.run(
            [str(REDIS_CLI), "--cluster", "reshard", f"127.0.0.1:{nodes[0].port}",
             "--cluster-from", _node_id(nodes[0]), "--cluster-to", _node_id(nodes[1]),
             "--cluster-slots", "3000", "--cluster-pipeline", "5", "--cluster-yes"],
            capture_output=True, timeout=300, check=False)  # MIGRATE a few keys at a time: ASK meanwhile
        assert moved.returncode == 0, moved.stdout.decode()[-1500:] + moved.stderr.decode()[-1500:]
        wait_cluster_ok(nodes, 30)
        assert wait_until(lambda: _serves_all(be, hashes, pages), 30), "resharded pages not served"
    assert not traffic.problems, traffic.problems[:3]
    assert traffic.hits > 0 and traffic.writes > 0
    assert _slots_of(nodes[1]) == slots_before + 3000  # the slots did move
    assert be.batch_set(random_hashes(50), random_pages(50)) == [True] * 50
    assert be.stats().corrupt == 0
    be.close()


# -- objects over 16 MiB ------------------------------------------------------------------------

HUGE = PageLayout(9, "uint8", (17 * 2**20 + 123,))


def test_objects_over_16_mib(make_backend: BackendFactory) -> None:
    be = make_backend(layout=HUGE)
    hashes = random_hashes(3)
    pages = [os.urandom(HUGE.payload_size) for _ in hashes]
    assert be.batch_set(hashes, pages) == [True] * 3
    assert be.batch_exists(hashes) == 3 and be.exists_each(hashes) == [True] * 3
    into = buffers(3, HUGE)
    assert be.batch_get(hashes, into) == [True] * 3
    assert [bytes(b) for b in into] == pages
    obj = be.read_object(hashes[0])
    assert obj is not None and len(obj) == HUGE.object_size
    st = be.stats()
    assert st.corrupt == st.errors == st.dropped_writes == 0
