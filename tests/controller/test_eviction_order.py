"""The L3 store's own evictions reach the scheduler after the backup answers that name their
pages (``controller.eviction_order``): against a real controller loop and a real capped file
store, and the gate's rules one by one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import zmq

import protos
from controller.args import ControllerArgs
from controller.eviction_order import EvictionGate
from controller.server import ControllerServer
from hicache.memory.pools import create_pools
from hicache.runtime.ipc import Endpoints, PullSocket, PushSocket, make_runtime_dir
from storage_backends import FileSettings
from storage_backends.base import Buffer
from storage_backends.file_backend import FileBackend
from storage_backends.page_format import PageLayout
from tests.controller.controller_harness import small_layout

OBJECT_BYTES = 2 * 2 * 4 * 2 * 8 * 4 + 96  # the harness layout's L2 page (float32), and a header


class SlowFileBackend(FileBackend):
    """A file store whose writes answer late: the page I/O (and the capacity eviction it
    makes) is done, and the call returns half a second after, long enough for the
    controller's main loop to run several rounds first."""

    def batch_set(self, hashes: Sequence[str], pages: Sequence[Buffer],
                  layout: PageLayout | None = None) -> list[bool]:
        done = super().batch_set(hashes, pages, layout)
        time.sleep(0.5)
        return done


class Controller:
    """A controller loop in a thread of this process, its L3 a ``SlowFileBackend`` holding
    3.5 pages (evicting to 3), the test playing the scheduler."""

    def __init__(self, tmp: Path) -> None:
        self.layout = small_layout()
        self.pools = create_pools(self.layout)
        endpoints = Endpoints("ipc", str(make_runtime_dir(str(tmp))))
        self.ctx = zmq.Context()
        self.inbox: PullSocket[protos.Message] = PullSocket(
            self.ctx, endpoints.address("scheduler"), (protos.OpDone, protos.StorageEvicted, protos.StorageStatus))
        self.outbox: PushSocket[protos.Message] = PushSocket(self.ctx, endpoints.address("controller"))
        settings = FileSettings(dir=str(tmp / "l3"), max_size_gb=3.5 * OBJECT_BYTES / 1024**3, scan_on_start=False)
        self.server = ControllerServer(ControllerArgs(self.layout, endpoints, None), self.ctx)
        self.server.storage.backend = SlowFileBackend(settings, self.server.storage.default_layout())
        self.server.storage.backend_name = "file"
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def backup(self, op_id: int, hashes: list[str]) -> None:
        self.outbox.send(protos.BackupToStorage(op_id, list(range(len(hashes))), hashes))

    def messages_until(self, done: object, timeout_s: float = 20.0) -> list[protos.Message]:
        """Every message the controller sends until ``done(messages)`` holds."""
        got: list[protos.Message] = []
        deadline = time.monotonic() + timeout_s
        while not done(got):  # type: ignore[operator]
            assert time.monotonic() < deadline, got
            msg = self.inbox.recv(100)
            if msg is not None:
                got.append(msg)
        return got

    def close(self) -> None:
        self.outbox.send(protos.Shutdown("test done"))
        self.thread.join(20)
        self.server.close()
        self.inbox.close()
        self.outbox.close()
        self.ctx.term()
        self.pools.close()
        self.pools.unlink()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    c = Controller(tmp_path)
    try:
        yield c
    finally:
        c.close()


def _h(i: int) -> str:
    return f"{i:064x}"


def _evicted(messages: list[protos.Message]) -> list[str]:
    return [h for m in messages if isinstance(m, protos.StorageEvicted) for h in m.hashes]


def test_an_eviction_is_told_after_the_answer_of_the_backup_that_names_its_page(controller: Controller) -> None:
    """Three pages fill the store. A backup of [page 0, two new pages] finds page 0 there,
    writes the two others, and the store evicts the oldest two, page 0 among them, before
    the backup answers (late: a slow store). Its answer says page 0 is held; the eviction of
    page 0 must come after it, or the events would end with page 0 stored, though it is gone.
    Page 1 (named by no running backup) is told at once."""
    c = controller
    c.backup(1, [_h(0), _h(1), _h(2)])
    first = c.messages_until(lambda got: any(isinstance(m, protos.OpDone) for m in got))
    assert [m.status for m in first if isinstance(m, protos.OpDone)] == ["ok"] and _evicted(first) == []
    c.backup(2, [_h(0), _h(10), _h(11)])
    got = c.messages_until(lambda got: _h(0) in _evicted(got) and any(isinstance(m, protos.OpDone) for m in got))
    answer = next(i for i, m in enumerate(got) if isinstance(m, protos.OpDone))
    assert got[answer] == protos.OpDone(2, "ok", 3)  # page 0 counted as held: it was, when looked at
    told_0 = next(i for i, m in enumerate(got) if isinstance(m, protos.StorageEvicted) and _h(0) in m.hashes)
    assert told_0 > answer, got
    assert sorted(_evicted(got)) == [_h(0), _h(1)]
    told_1 = next(i for i, m in enumerate(got) if isinstance(m, protos.StorageEvicted) and _h(1) in m.hashes)
    assert told_1 < answer, got  # not held: no running backup named it
    assert c.server.evictions.held == 0


def test_the_gate_holds_what_a_running_backup_names_and_checks_it_once_more() -> None:
    gate = EvictionGate()
    held: set[str] = set()
    asked: list[list[str]] = []

    def holds(hashes: list[str]) -> list[bool]:
        asked.append(list(hashes))
        return [h in held for h in hashes]

    gate.backup_started(1, ["a", "b"])
    gate.backup_started(2, ["b"])
    assert gate.release(["a", "b", "c"], holds) == ["c"] and gate.held == 2 and asked == []
    gate.backup_answered(7)  # not a backup: nothing changes
    gate.backup_answered(1)
    held.add("a")  # written again after its eviction: its backup's answer is the truth
    assert gate.release([], holds) == [] and asked == [["a"]] and gate.held == 1  # "b": backup 2 runs
    gate.backup_answered(2)
    assert gate.release([], holds) == ["b"] and asked[-1] == ["b"] and gate.held == 0


def test_an_eviction_taken_right_after_an_answer_is_checked_too() -> None:
    """A backup answered before the store's eviction of its page was taken: that eviction may
    have come before the backup wrote the page again, so it is checked; the next round's is not."""
    gate = EvictionGate()
    gate.backup_started(1, ["a"])
    gate.backup_answered(1)
    assert gate.release(["a"], lambda hs: [True] * len(hs)) == []
    assert gate.release(["a"], lambda hs: [True] * len(hs)) == ["a"]  # since: an eviction after the answer
