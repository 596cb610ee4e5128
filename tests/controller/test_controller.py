"""The cache-controller process: copies, L3 round trips, bad messages, and a SIGKILL mid-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protos
from hicache.hashing import HashNamespace, PageHasher, component_keys
from storage_backends import FileSettings
from tests.controller.controller_harness import ControllerHarness, fill_l1_pages, l1_pages, l2_pages


@pytest.fixture
def harness(tmp_path: Path):
    h = ControllerHarness(tmp_path, FileSettings(dir=str(tmp_path / "l3"), scan_on_start=False))
    yield h
    h.close()


def _zero_l1(h: ControllerHarness, component: str) -> None:
    for t in h.pools[component].l1:
        t.zero_()


def _zero_l2(h: ControllerHarness, component: str) -> None:
    for t in h.pools[component].l2:
        t.zero_()


def test_l1_l2_l3_round_trip_is_bit_exact(harness: ControllerHarness) -> None:
    h = harness
    dev, host = [3, 4, 5, 9, 20], [100, 7, 8, 9, 0]
    fill_l1_pages(h.pools, "full", dev, seed=1)
    original = l1_pages(h.pools, "full", dev)

    op = h.op_id()
    assert h.call(protos.WriteToHost(op, {"full": dev}, {"full": host})) == protos.OpDone(op, "ok", 5)
    _zero_l1(h, "full")
    op = h.op_id()
    assert h.call(protos.LoadToDevice(op, {"full": host}, {"full": dev})) == protos.OpDone(op, "ok", 5)
    assert all(torch.equal(a, b) for a, b in zip(l1_pages(h.pools, "full", dev), original, strict=True))

    hashes = PageHasher(HashNamespace("test-model", "float32", 4)).hash_pages(list(range(20)))
    op = h.op_id()
    assert h.call(protos.BackupToStorage(op, host, hashes)) == protos.OpDone(op, "ok", 5)
    op = h.op_id()  # backing up again skips what L3 holds and still reports every page held
    assert h.call(protos.BackupToStorage(op, host, hashes)) == protos.OpDone(op, "ok", 5)
    _zero_l2(h, "full")
    _zero_l1(h, "full")
    op = h.op_id()
    assert h.call(protos.PrefetchQuery(op, hashes + ["f" * 64])) == protos.PrefetchHits(op, 5)
    new_host = [50, 51, 52, 53, 54]
    op = h.op_id()
    assert h.call(protos.PrefetchFetch(op, hashes, new_host)) == protos.OpDone(op, "ok", 5)
    op = h.op_id()
    assert h.call(protos.LoadToDevice(op, {"full": new_host}, {"full": dev})) == protos.OpDone(op, "ok", 5)
    assert all(torch.equal(a, b) for a, b in zip(l1_pages(h.pools, "full", dev), original, strict=True))


def test_fetch_of_missing_pages_reports_the_prefix_that_arrived(harness: ControllerHarness) -> None:
    h = harness
    fill_l1_pages(h.pools, "full", [1, 2], seed=5)
    h.call(protos.WriteToHost(h.op_id(), {"full": [1, 2]}, {"full": [1, 2]}))
    hashes = PageHasher(HashNamespace("m", "float32", 4)).hash_pages(list(range(12)))
    op = h.op_id()
    assert h.call(protos.BackupToStorage(op, [1, 2], hashes[:2])) == protos.OpDone(op, "ok", 2)
    op = h.op_id()
    done = h.call(protos.PrefetchFetch(op, hashes, [10, 11, 12]))
    assert done == protos.OpDone(op, "failed", 2)


def test_mamba_state_slots_round_trip(harness: ControllerHarness) -> None:
    h = harness
    fill_l1_pages(h.pools, "mamba", [0, 5], seed=3)
    original = l1_pages(h.pools, "mamba", [0, 5])
    op = h.op_id()
    assert h.call(protos.WriteToHost(op, {"mamba": [0, 5]}, {"mamba": [15, 2]})).status == "ok"
    _zero_l1(h, "mamba")
    op = h.op_id()
    assert h.call(protos.LoadToDevice(op, {"mamba": [15, 2]}, {"mamba": [0, 5]})).status == "ok"
    assert all(torch.equal(a, b) for a, b in zip(l1_pages(h.pools, "mamba", [0, 5]), original, strict=True))
    op = h.op_id()
    refused = h.call(protos.BackupToStorage(op, [15], ["a" * 64], component="mamba"))
    assert isinstance(refused, protos.OpDone) and refused.status == "rejected"


BAD_OPS: list[tuple[protos.Message, str]] = [
    (protos.WriteToHost(901, {"full": [64]}, {"full": [0]}), "out of range"),
    (protos.WriteToHost(902, {"full": [0]}, {"full": [-1]}), "out of range"),
    (protos.LoadToDevice(903, {"full": [0, 1]}, {"full": [0]}), "1 device pages but 2 host pages"),
    (protos.LoadToDevice(904, {"nope": [0]}, {"nope": [0]}), "unknown component"),
    (protos.WriteToHost(905, {"full": [0, 1]}, {"full": [3, 3]}), "twice"),
    (protos.PrefetchFetch(906, ["a" * 64], [500]), "out of range"),
    (protos.BackupToStorage(907, [1, 2], ["a" * 64]), "1 hashes but 2 host pages"),
    (protos.PrefetchFetch(908, ["a" * 64, "b" * 64], [7, 7]), "twice"),
    (protos.PrefetchFetch(909, ["a" * 64], [7], aux_keys={"mamba": ["c" * 64, "d" * 64]},
                          aux_pages={"mamba": [3, 3]}), "twice"),
    # queued for a controller run that died: its pages may belong to someone else by now
    (protos.WriteToHost(910, {"full": [0]}, {"full": [0]}, run=7), "controller run 7"),
    (protos.LoadToDevice(911, {"full": [0]}, {"full": [0]}, run=7), "sent before a restart"),
    (protos.PrefetchFetch(912, ["a" * 64], [0], run=7), "controller run 7"),
    (protos.BackupToStorage(913, [0], ["a" * 64], run=7), "controller run 7"),
    (protos.PrefetchQuery(914, ["a" * 64], run=7), "controller run 7"),
]
"""Ops the controller must refuse, each with a piece of its error."""


def test_bad_ops_are_rejected_without_touching_memory(harness: ControllerHarness) -> None:
    """One controller takes every bad op in turn (each is refused alone: no state carries over)."""
    h = harness
    for msg, needle in BAD_OPS:
        before = [t.clone() for t in (*h.pools["full"].l2, *h.pools["full"].l1_paged)]
        answer = h.call(msg)
        assert isinstance(answer, protos.OpDone) and answer.status == "rejected", (msg, answer)
        assert answer.op_id == msg.op_id and answer.error and needle in answer.error, (msg, answer)
        after = (*h.pools["full"].l2, *h.pools["full"].l1_paged)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), msg


def test_garbage_and_wrong_messages_get_error_replies_and_serving_goes_on(harness: ControllerHarness) -> None:
    h = harness
    h.outbox.socket.send(b"\x00\x01garbage")
    assert isinstance(h.recv(), protos.ErrorReply)
    h.send(protos.AbortRequest("not-for-the-controller"))
    reply = h.recv()
    assert isinstance(reply, protos.ErrorReply) and "not accepted" in reply.error
    op = h.op_id()
    assert h.call(protos.WriteToHost(op, {"full": [0]}, {"full": [0]})) == protos.OpDone(op, "ok", 1)


def test_duplicate_op_id_of_a_running_op_is_rejected_once(harness: ControllerHarness) -> None:
    h = harness
    big = list(range(64))  # queued behind each other on the copy thread
    op = h.op_id()
    h.send(protos.WriteToHost(op, {"full": big}, {"full": big}))
    h.send(protos.WriteToHost(op, {"full": big}, {"full": [p + 64 for p in big]}))
    answers = [h.recv(), h.recv()]
    statuses = sorted(a.status for a in answers if isinstance(a, protos.OpDone) and a.op_id == op)
    # Either the first finished before the second arrived (two oks) or the second was refused.
    assert statuses in (["ok", "rejected"], ["ok", "ok"])


def test_cancel_of_a_finished_op_changes_nothing(harness: ControllerHarness) -> None:
    h = harness
    op = h.op_id()
    assert h.call(protos.WriteToHost(op, {"full": [1]}, {"full": [1]})).status == "ok"
    h.send(protos.Cancel(op))
    op2 = h.op_id()
    assert h.call(protos.PrefetchQuery(op2, ["a" * 64])) == protos.PrefetchHits(op2, 0)


def test_storage_admin_status_detach_attach(harness: ControllerHarness, tmp_path: Path) -> None:
    h = harness
    st = h.call(protos.StorageAdmin(h.op_id(), "status"))
    assert isinstance(st, protos.StorageStatus) and st.backend == "file" and st.error is None
    st = h.call(protos.StorageAdmin(h.op_id(), "detach"))
    assert isinstance(st, protos.StorageStatus) and st.backend == "none"
    op = h.op_id()
    assert h.call(protos.PrefetchQuery(op, ["a" * 64])) == protos.PrefetchHits(op, 0)
    st = h.call(protos.StorageAdmin(h.op_id(), "attach", {"l3": {"backend": "file", "file": {"dir": str(tmp_path / "b")}}}))
    assert isinstance(st, protos.StorageStatus) and st.backend == "file" and st.error is None
    st = h.call(protos.StorageAdmin(h.op_id(), "attach", {"l3": {"backend": "redis", "redis": {"url": "http://x"}}}))
    assert isinstance(st, protos.StorageStatus) and st.error and "cache.l3.redis.url" in st.error
    st = h.call(protos.StorageAdmin(h.op_id(), "attach", {"backend": "file"}))  # not wrapped in "l3"
    assert isinstance(st, protos.StorageStatus) and st.error and '"l3"' in st.error
    st = h.call(protos.StorageAdmin(h.op_id(), "frobnicate"))
    assert isinstance(st, protos.StorageStatus) and st.error and "unknown" in st.error


def test_sigkill_mid_batch_then_restart_keeps_pool_contents(harness: ControllerHarness) -> None:
    h = harness
    pages = list(range(32))
    fill_l1_pages(h.pools, "full", pages, seed=9)
    original = l1_pages(h.pools, "full", pages)
    assert h.call(protos.WriteToHost(h.op_id(), {"full": pages}, {"full": pages})).status == "ok"
    host_copy = l2_pages(h.pools, "full", pages)
    for i in range(20):  # a burst of ops the controller is busy with when it dies
        h.send(protos.WriteToHost(1000 + i, {"full": pages}, {"full": [p + 64 for p in pages]}))
    h.kill()
    while True:  # drain whatever was answered before the kill
        try:
            h.recv(0.2)
        except TimeoutError:
            break
    h.start()
    assert all(torch.equal(a, b) for a, b in zip(l1_pages(h.pools, "full", pages), original, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(l2_pages(h.pools, "full", pages), host_copy, strict=True))
    _zero_l1_pages = [t.select(2, p).zero_() for p in pages for t in h.pools["full"].l1_paged]
    assert _zero_l1_pages
    op = h.op_id()
    assert h.call(protos.LoadToDevice(op, {"full": pages}, {"full": pages})) == protos.OpDone(op, "ok", 32)
    assert all(torch.equal(a, b) for a, b in zip(l1_pages(h.pools, "full", pages), original, strict=True))


def test_shutdown_exits_cleanly(tmp_path: Path) -> None:
    h = ControllerHarness(tmp_path, None)
    try:
        h.send(protos.Shutdown("bye"))
        assert h.proc is not None
        h.proc.join(30)
        assert h.proc.exitcode == 0
    finally:
        h.close()


def test_mamba_states_go_through_l3_with_their_pages(harness: ControllerHarness) -> None:
    """A backup's auxiliary units and keys, a query's ``aux_present`` and a fetch's
    ``aux_done``, through the real controller process: bit-exact, a miss left alone."""
    h = harness
    fill_l1_pages(h.pools, "full", [1, 2], seed=7)
    fill_l1_pages(h.pools, "mamba", [3], seed=8)
    op = h.op_id()
    assert h.call(protos.WriteToHost(op, {"full": [1, 2], "mamba": [3]}, {"full": [1, 2], "mamba": [4]})).status == "ok"
    state = l2_pages(h.pools, "mamba", [4])
    hashes = PageHasher(HashNamespace("m", "float32", 4)).hash_pages(list(range(8)))
    keys = component_keys("mamba", hashes)
    op = h.op_id()
    assert h.call(protos.BackupToStorage(op, [1, 2], hashes, "full", {"mamba": [4]}, {"mamba": keys[1:]})) \
        == protos.OpDone(op, "ok", 2)
    _zero_l2(h, "mamba")
    op = h.op_id()
    assert h.call(protos.PrefetchQuery(op, hashes, "full", {"mamba": keys})) == protos.PrefetchHits(op, 2, {"mamba": [1]})
    op = h.op_id()
    done = h.call(protos.PrefetchFetch(op, hashes, [10, 11], "full", {"mamba": [keys[1], keys[0]]}, {"mamba": [6, 7]}))
    assert done == protos.OpDone(op, "ok", 2, None, {"mamba": [True, False]})
    assert all(torch.equal(a, b) for a, b in zip(l2_pages(h.pools, "mamba", [6]), state, strict=True))
    assert all(torch.count_nonzero(t) == 0 for t in l2_pages(h.pools, "mamba", [7]))
    op = h.op_id()  # an auxiliary unit out of range is refused before anything moves
    bad = h.call(protos.PrefetchFetch(op, hashes, [10, 11], "full", {"mamba": [keys[1]]}, {"mamba": [99]}))
    assert isinstance(bad, protos.OpDone) and bad.status == "rejected"
