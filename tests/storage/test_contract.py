"""The contract every L3 backend keeps, run against file, Redis and Redis Cluster."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

from storage_backends import InvalidPageHash, PageLayout, StorageBackend
from storage_backends import locks as fork_safe_locks
from storage_backends.locks import ForkSafeLock
from tests.storage.conftest import LAYOUT, BackendFactory, buffers, random_hashes, random_pages


def test_round_trip_is_bit_exact(make_backend: BackendFactory) -> None:
    be = make_backend()
    hashes = random_hashes(40)
    pages = random_pages(40)
    assert be.batch_set(hashes, pages) == [True] * 40
    into = buffers(40)
    assert be.batch_get(hashes, into) == [True] * 40
    for got, want in zip(into, pages, strict=True):
        assert bytes(got) == want
    st = be.stats()
    assert st.up and st.hits == 40 and st.misses == 0
    assert st.bytes_read == st.bytes_written == 40 * LAYOUT.payload_size
    assert st.errors == st.corrupt == st.dropped_writes == 0


def test_buffers_of_other_formats_are_accepted(make_backend: BackendFactory) -> None:
    be = make_backend()
    h = random_hashes(2)
    raw = bytearray(os.urandom(2 * LAYOUT.payload_size))
    pages = [memoryview(raw)[: LAYOUT.payload_size], memoryview(raw)[LAYOUT.payload_size :].cast("H")]
    assert be.batch_set(h, pages) == [True, True]
    dest = bytearray(2 * LAYOUT.payload_size)
    into = [memoryview(dest)[: LAYOUT.payload_size].cast("I"), memoryview(dest)[LAYOUT.payload_size :]]
    assert be.batch_get(h, into) == [True, True]
    assert dest == raw


def test_missing_pages_are_misses_and_hits_keep_their_place(make_backend: BackendFactory) -> None:
    be = make_backend()
    hashes = random_hashes(6)
    pages = random_pages(6)
    assert be.batch_set(hashes[::2], pages[::2]) == [True] * 3
    into = buffers(6)
    assert be.batch_get(hashes, into) == [True, False, True, False, True, False]
    for i in (0, 2, 4):
        assert bytes(into[i]) == pages[i]
    assert be.stats().misses == 3
    assert be.batch_get([], []) == [] and be.batch_set([], []) == []


def test_batch_exists_counts_the_consecutive_prefix(make_backend: BackendFactory) -> None:
    be = make_backend()
    hashes = random_hashes(8)
    present = [0, 1, 2, 4, 5, 6, 7]
    be.batch_set([hashes[i] for i in present], random_pages(len(present)))
    assert be.batch_exists(hashes) == 3
    assert be.batch_exists(hashes[:3]) == 3
    assert be.batch_exists(hashes[3:]) == 0
    assert be.batch_exists(hashes[4:]) == 4
    assert be.batch_exists([]) == 0
    many = random_hashes(1500)  # longer than one pipeline chunk
    be.batch_set(many, [random_pages(1)[0]] * 1500)
    assert be.batch_exists(many) == 1500
    assert be.batch_exists(many + hashes[3:4] + many[:1]) == 1500


def test_existing_page_is_stored_and_delete_removes(make_backend: BackendFactory) -> None:
    be = make_backend()
    hashes = random_hashes(3)
    pages = random_pages(3)
    assert be.batch_set(hashes, pages) == [True] * 3
    assert be.batch_set(hashes[:1], pages[:1]) == [True]
    assert be.delete(hashes[:2] + random_hashes(1)) == 2
    assert be.batch_exists(hashes) == 0
    assert be.batch_exists(hashes[2:]) == 1
    assert be.batch_get(hashes, buffers(3)) == [False, False, True]
    assert be.take_evicted() == []  # a delete asked for is no eviction of the store's own


def test_clear_removes_only_this_store(make_backend: BackendFactory, kind: str, tmp_path) -> None:
    be = make_backend()
    hashes = random_hashes(5)
    be.batch_set(hashes, random_pages(5))
    assert sorted(be.iter_hashes()) == sorted(hashes)
    usage = be.usage()
    assert usage.pages == 5 and usage.bytes == 5 * LAYOUT.object_size
    assert be.read_object(hashes[0]) is not None and be.read_object(random_hashes(1)[0]) is None
    assert be.clear() == 5
    assert be.batch_exists(hashes) == 0
    assert list(be.iter_hashes()) == []


def test_bad_arguments_raise_programming_errors(make_backend: BackendFactory) -> None:
    be = make_backend()
    for bad in ["../../etc/passwd", "A" * 64, "a" * 63, "g" * 64, "a" * 62 + "/x", 5]:
        with pytest.raises(InvalidPageHash):
            be.batch_exists([bad])  # type: ignore[list-item]
        with pytest.raises(InvalidPageHash):
            be.batch_set([bad], random_pages(1))  # type: ignore[list-item]
    h = random_hashes(1)
    with pytest.raises(ValueError):
        be.batch_set(h, [b"short"])
    with pytest.raises(ValueError):
        be.batch_get(h, [memoryview(bytearray(10))])
    with pytest.raises(ValueError):
        be.batch_get(h, [memoryview(bytes(LAYOUT.payload_size))])  # read-only
    with pytest.raises(ValueError):
        be.batch_get(h, [])
    assert be.stats().errors == 0


def test_other_layout_or_dtype_is_a_counted_miss_and_deleted(make_backend: BackendFactory) -> None:
    writer = make_backend()
    same_size_other_dtype = PageLayout(LAYOUT.layout_id, "float16", LAYOUT.shape)
    other_id = PageLayout(LAYOUT.layout_id + 1, LAYOUT.dtype, LAYOUT.shape)
    other_shape = PageLayout(LAYOUT.layout_id, LAYOUT.dtype, (4, 2, 16, 64))
    for other in (same_size_other_dtype, other_id, other_shape):
        reader = make_backend(layout=other)
        h = random_hashes(2)
        pages = random_pages(2)
        assert writer.batch_set(h, pages) == [True, True]
        into = buffers(2, other)
        assert reader.batch_get(h, into) == [False, False]
        st = reader.stats()
        assert st.corrupt == 2 and st.misses == 2 and st.hits == 0
        assert writer.batch_exists(h) == 0, "a rejected object must be deleted"
        assert reader.stats().up


def test_admin_backend_without_layout(make_backend: BackendFactory) -> None:
    be = make_backend()
    h = random_hashes(2)
    be.batch_set(h, random_pages(2))
    admin = make_backend(layout=None)
    assert sorted(admin.iter_hashes()) == sorted(h)
    assert admin.batch_exists(h) == 2
    with pytest.raises(ValueError):
        admin.batch_get(h, buffers(2))


def test_health_and_close(make_backend: BackendFactory) -> None:
    be = make_backend()
    assert be.health()
    be.close()
    be.close()
    assert not be.health()
    assert not be.stats().up
    h = random_hashes(1)
    assert be.batch_set(h, random_pages(1)) == [False]
    assert be.batch_get(h, buffers(1)) == [False]
    assert be.batch_exists(h) == 0


# -- several processes --------------------------------------------------------------------

SMALL = PageLayout(1, "uint8", (64 * 1024,))


def _writer(settings: object, hashes: list[str], fill: int, rounds: int, start: mp.synchronize.Event) -> None:
    from storage_backends import create_backend

    be = create_backend(settings, SMALL)
    page = bytes([fill]) * SMALL.payload_size
    start.wait(30)
    for _ in range(rounds):
        be.delete(hashes)
        be.batch_set(hashes, [page] * len(hashes))
    be.close()


def test_concurrent_writers_never_leave_a_torn_page(make_backend: BackendFactory) -> None:
    """Four processes delete and rewrite the same pages with different bytes while we read."""
    be = make_backend(layout=SMALL)
    settings = be.settings  # type: ignore[attr-defined]
    hashes = random_hashes(24)
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(settings, hashes, fill, 15, start)) for fill in (1, 2, 3, 4)]
    for p in procs:
        p.start()
    start.set()
    into = [memoryview(bytearray(SMALL.payload_size)) for _ in hashes]
    seen_hits = 0
    deadline = time.monotonic() + 60
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for ok, buf in zip(be.batch_get(hashes, into), into, strict=True):
            if ok:
                seen_hits += 1
                first = buf[0]
                assert first in (1, 2, 3, 4)
                assert buf.tobytes().count(first) == SMALL.payload_size, "mixed page"
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert be.batch_get(hashes, into) == [True] * len(hashes)
    for buf in into:
        assert buf.tobytes().count(buf[0]) == SMALL.payload_size
    assert be.stats().corrupt == 0
    assert seen_hits > 0


def _child_round_trip(be: StorageBackend, conn: mp.connection.Connection) -> None:
    h = random_hashes(3)
    pages = random_pages(3)
    ok = be.batch_set(h, pages)
    into = buffers(3)
    got = be.batch_get(h, into)
    conn.send((h, ok, got, [bytes(b) == p for b, p in zip(into, pages, strict=True)]))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_while_a_thread_holds_the_backends_locks_leaves_the_child_working(make_backend: BackendFactory) -> None:
    """A lock another thread held at the fork is never released in the child (that thread is
    not there): the child must find every lock of the backend free."""
    be = make_backend()
    be.batch_set(random_hashes(1), random_pages(1))
    holding, release = threading.Event(), threading.Event()
    held: list[ForkSafeLock] = []

    def hold() -> None:
        held.extend(lock for lock in list(fork_safe_locks._ALL) if lock.acquire(timeout=5))
        holding.set()
        release.wait(30)
        for lock in held:
            lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30) and held
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_child_round_trip, args=(be, child_end))
    p.start()
    release.set()
    holder.join(30)
    assert parent_end.poll(60), "the forked child hung on a lock its parent's thread held"
    h, ok, got, same = parent_end.recv()
    p.join(30)
    assert p.exitcode == 0
    assert ok == got == same == [True] * 3
    assert be.batch_exists(h) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_backend_survives_fork(make_backend: BackendFactory) -> None:
    be = make_backend()
    be.batch_set(random_hashes(1), random_pages(1))  # clients, pools exist in the parent
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_child_round_trip, args=(be, child_end))
    p.start()
    h, ok, got, same = parent_end.recv()
    p.join(30)
    assert p.exitcode == 0
    assert ok == got == same == [True] * 3
    assert be.batch_exists(h) == 3
