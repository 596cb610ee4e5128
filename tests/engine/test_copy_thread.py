"""The connector's copy thread (``hicache_copy: async``): order, the fence on a save's blocks,
failed copies ending their leases as failed; against a real socket standing for the daemon."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

import protos
from hicache.connectors.copy_thread import CopyJob, CopyThread


class Daemon:
    """A ROUTER socket standing for the daemon: collects what the copy thread sends."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(address)

    def received(self, n: int, timeout_s: float = 10.0) -> list[protos.Message]:
        out: list[protos.Message] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            if self.sock.poll(100):
                _, frame = self.sock.recv_multipart()
                out.append(protos.decode(frame))
        return out


@pytest.fixture
def daemon() -> Iterator[tuple[str, Daemon]]:
    d = tempfile.mkdtemp(prefix="hcct", dir="/tmp")
    address = f"ipc://{Path(d) / 'engine.sock'}"
    daemon = Daemon(address)
    try:
        yield address, daemon
    finally:
        daemon.sock.close(linger=0)


def _commit(lease: int):
    return lambda ok: protos.Commit(1, 1, lease, ok, 0)


def _release(lease: int, pages: int):
    return lambda ok: protos.Release(1, 1, lease, pages if ok else 0, 0)


def test_copies_run_in_order_and_each_ends_its_lease_as_it_went(daemon: tuple[str, Daemon]) -> None:
    address, d = daemon
    ran: list[str] = []
    gate = threading.Event()

    def copy(name: str, fail: bool = False):
        def run() -> int:
            gate.wait(10)
            ran.append(name)
            if fail:
                raise RuntimeError("the L2 pool went away")
            return 100
        return run

    copies = CopyThread(address, 1000)
    try:
        copies.submit(CopyJob("a", "save", 2, copy("save a"), _commit(11), frozenset({3, 4})))
        copies.submit(CopyJob("b", "save", 1, copy("save b", fail=True), _commit(12), frozenset({5})))
        copies.submit(CopyJob("c", "load", 3, copy("load c"), _release(13, 3)))
        assert copies.busy
        gate.set()
        copies.drain()
        assert not copies.busy
        assert ran == ["save a", "save b", "load c"]
        done = copies.take_done()
        assert [(j.rid, j.ok, j.copied) for j in done] == [("a", True, 100), ("b", False, 0), ("c", True, 100)]
        assert done[1].error == "the L2 pool went away"
        assert copies.take_done() == []
        got = d.received(3)
        assert got == [protos.Commit(1, 1, 11, True, 0), protos.Commit(1, 1, 12, False, 0),
                       protos.Release(1, 1, 13, 3, 0)]
    finally:
        copies.close()


def test_the_fence_waits_for_the_saves_reading_a_block_and_only_those(daemon: tuple[str, Daemon]) -> None:
    address, _ = daemon
    release = threading.Event()

    def slow() -> int:
        release.wait(10)
        return 1

    copies = CopyThread(address, 1000)
    try:
        copies.submit(CopyJob("a", "save", 2, slow, _commit(1), frozenset({7, 8})))
        assert copies.wait_for_blocks(frozenset({1, 2, 3})) == 0.0  # no save reads them
        waited: list[float] = []
        fence = threading.Thread(target=lambda: waited.append(copies.wait_for_blocks(frozenset({8, 9}))))
        fence.start()
        fence.join(0.3)
        assert fence.is_alive(), "the fence did not wait for the save reading block 8"
        release.set()
        fence.join(10)
        assert not fence.is_alive() and waited and waited[0] > 0
    finally:
        copies.close()


def test_a_disjoint_fence_does_not_wait_for_a_stalled_save(daemon: tuple[str, Daemon]) -> None:
    address, _ = daemon
    release = threading.Event()
    copies = CopyThread(address, 1000)
    try:
        copies.submit(CopyJob("a", "save", 1, lambda: int(release.wait(10)), _commit(1), frozenset({7})))
        done = threading.Event()
        t = threading.Thread(target=lambda: (copies.wait_for_blocks(frozenset({1, 2})), done.set()))
        t.start()
        assert done.wait(5), "a fence on blocks no save reads waited for the stalled save"
        release.set()
        t.join(5)
    finally:
        copies.close()


def test_the_save_fault_point_runs_on_the_copy_thread_before_each_save(daemon: tuple[str, Daemon]) -> None:
    address, _ = daemon
    seen: list[str] = []
    copies = CopyThread(address, 1000, before_save=lambda: seen.append(threading.current_thread().name))
    try:
        copies.submit(CopyJob("a", "load", 1, lambda: 1, _release(1, 1)))
        copies.submit(CopyJob("b", "save", 1, lambda: 1, _commit(2), frozenset({1})))
        copies.drain()
        assert seen == ["hicache-copy"]
    finally:
        copies.close()
