"""Store trouble ends in counted misses / dropped writes and a working backend, never a
wrong page and never an exception out of the interface."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hicache.bench.local_redis import RedisProcess, wait_cluster_ok
from storage_backends import FileSettings, PageLayout, RedisSettings, ResilienceSettings, create_backend
from storage_backends.file_backend import FileBackend
from storage_backends.page_format import HEADER_SIZE, encode_header
from tests.storage.conftest import LAYOUT, buffers, mounted_tmpfs, random_hashes, random_pages, wait_until

QUICK = ResilienceSettings(timeout_s=0.5, failure_threshold=2, probe_base_s=0.05, probe_cap_s=0.3)


# -- Redis ----------------------------------------------------------------------------------


def test_redis_killed_mid_batch_then_restarted(redis_process: RedisProcess) -> None:
    big = PageLayout(2, "uint8", (256 * 1024,))
    be = create_backend(RedisSettings(url=redis_process.url, resilience=QUICK, pipeline_bytes=1 << 20), big)
    kept = random_hashes(4)
    assert be.batch_set(kept, random_pages(4, big)) == [True] * 4

    hashes = random_hashes(400)
    page = os.urandom(big.payload_size)
    killer = threading.Timer(0.05, redis_process.kill)
    killer.start()
    result = be.batch_set(hashes, [page] * len(hashes))  # ~100 MiB: still running at the kill
    killer.join()
    assert not all(result)
    assert be.batch_get(kept, buffers(4, big)) == [False] * 4
    assert be.batch_set(random_hashes(2), [page] * 2) == [False, False]
    assert wait_until(lambda: not be.stats().up, 5)
    st = be.stats()
    assert st.errors >= 1 and st.dropped_writes >= 2 + result.count(False) and st.trips == 1
    assert be.batch_exists(kept) == 0 and be.delete(kept) == 0

    redis_process.start()  # empty: no persistence
    assert wait_until(lambda: be.stats().up, 10), "probe did not re-attach"
    h = random_hashes(3)
    pages = random_pages(3, big)
    assert be.batch_set(h, pages) == [True] * 3
    into = buffers(3, big)
    assert be.batch_get(h, into) == [True] * 3
    assert [bytes(b) for b in into] == pages
    be.close()


def _owner(nodes: list[RedisProcess], key: str) -> int:
    """Index in ``nodes`` of the master that owns ``key``'s slot."""
    slot = nodes[0].client().cluster("keyslot", key)
    for i, n in enumerate(nodes):
        if _owns(n, slot):
            return i
    raise AssertionError(f"no node owns slot {slot}")


def _owns(node: RedisProcess, slot: int) -> bool:
    myself = node.client().execute_command("CLUSTER", "MYID")
    myself = myself.decode() if isinstance(myself, bytes) else myself
    for start, end, *owners in node.client().execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            ident = owners[0][2]
            return (ident.decode() if isinstance(ident, bytes) else ident) == myself
    return False


def test_redis_cluster_master_killed_mid_traffic_then_restarted(redis_cluster_nodes: list[RedisProcess]) -> None:
    nodes = redis_cluster_nodes
    be = create_backend(RedisSettings(url=nodes[0].url, cluster=True, key_prefix="c", resilience=QUICK), LAYOUT)
    hashes = random_hashes(60)
    pages = random_pages(60)
    assert be.batch_set(hashes, pages) == [True] * 60
    owner = [_owner(nodes, f"c:{h}") for h in hashes]
    assert set(owner) == {0, 1, 2}, "60 random keys should land on every master"
    victim = 1
    on_victim = [i for i, o in enumerate(owner) if o == victim]
    elsewhere = [i for i, o in enumerate(owner) if o != victim]

    stop = threading.Event()
    traffic_errors: list[BaseException] = []

    def traffic() -> None:  # readers and writers keep going while the node dies
        into = buffers(60)
        while not stop.is_set():
            try:
                be.batch_get(hashes, into)
                be.batch_set(random_hashes(6), random_pages(6))
                be.batch_exists(hashes)
            except BaseException as exc:  # the interface must never raise for store trouble
                traffic_errors.append(exc)
                return

    workers = [threading.Thread(target=traffic) for _ in range(2)]
    for w in workers:
        w.start()
    time.sleep(0.1)
    nodes[victim].kill()
    time.sleep(0.3)
    stop.set()
    for w in workers:
        w.join(10)
    assert not traffic_errors, traffic_errors

    into = buffers(60)
    got = be.batch_get(hashes, into)
    assert [got[i] for i in on_victim] == [False] * len(on_victim)
    assert [got[i] for i in elsewhere] == [True] * len(elsewhere), "other masters must keep serving"
    assert all(bytes(into[i]) == pages[i] for i in elsewhere)
    before = be.stats()
    written = be.batch_set(random_hashes(30), random_pages(30))
    st = be.stats()
    assert 0 < written.count(True) < 30
    assert st.dropped_writes - before.dropped_writes == written.count(False)
    assert not st.up and st.trips >= 1 and st.errors >= 1
    assert be.batch_exists(hashes) == next(i for i, o in enumerate(owner) if o == victim)

    nodes[victim].start()  # empty (no persistence), same port and nodes.conf
    wait_cluster_ok(nodes, 10)
    fresh = [hashes[i] for i in on_victim]
    fresh_pages = [pages[i] for i in on_victim]

    def serves_again() -> bool:
        return be.batch_set(fresh, fresh_pages) == [True] * len(fresh)

    assert wait_until(serves_again, 10), "the restarted master was not re-attached"
    assert wait_until(lambda: be.stats().up, 5)
    into = buffers(60)
    assert be.batch_get(hashes, into) == [True] * 60
    assert [bytes(b) for b in into] == pages
    assert be.stats().corrupt == 0
    be.close()


def test_a_failed_existence_check_counts_an_error_as_a_failed_read_does(redis_process: RedisProcess) -> None:
    """A command that fails inside a pipeline (here WRONGTYPE: a list where a page should be)
    counts one error per page for an existence check as for a read; before, an existence
    check's failures moved the breaker toward ``down`` without counting any error."""
    be = create_backend(RedisSettings(url=redis_process.url, key_prefix="w", resilience=QUICK), LAYOUT)
    good, bad = random_hashes(2)
    assert be.batch_set([good], random_pages(1)) == [True]
    redis_process.client().rpush(f"w:{bad}", b"not a page")
    assert be.exists_each([good, bad]) == [True, False]
    assert be.stats().errors == 1
    assert be.batch_get([good, bad], buffers(2)) == [True, False]
    assert be.stats().errors == 2
    be.close()


def test_redis_slower_than_the_timeout(redis_process: RedisProcess) -> None:
    be = create_backend(RedisSettings(url=redis_process.url, resilience=QUICK), LAYOUT)
    h = random_hashes(4)
    pages = random_pages(4)
    be.batch_set(h, pages)
    redis_process.client().execute_command("CLIENT", "PAUSE", 2000)
    t0 = time.monotonic()
    assert be.batch_get(h, buffers(4)) == [False] * 4
    assert time.monotonic() - t0 < 1.5, "the call was not bounded by the timeout"
    st = be.stats()
    assert st.timeouts >= 1 and st.misses == 4
    assert be.batch_set(random_hashes(1), random_pages(1)) == [False]
    assert not be.stats().up
    assert wait_until(lambda: be.stats().up, 10)
    into = buffers(4)
    assert be.batch_get(h, into) == [True] * 4
    assert [bytes(b) for b in into] == pages
    be.close()


def test_redis_unreachable_at_start_is_an_error(redis_process: RedisProcess) -> None:
    from storage_backends import StorageUnavailable

    redis_process.kill()
    with pytest.raises(StorageUnavailable):
        create_backend(RedisSettings(url=redis_process.url, resilience=QUICK), LAYOUT)


def test_redis_corrupt_objects_are_misses_and_deleted(redis_process: RedisProcess) -> None:
    be = create_backend(RedisSettings(url=redis_process.url, key_prefix="p", resilience=QUICK), LAYOUT)
    raw = redis_process.client()
    h = random_hashes(4)
    pages = random_pages(4)
    be.batch_set(h, pages)
    flipped = bytearray(raw.get(f"p:{h[0]}"))
    flipped[HEADER_SIZE + 100] ^= 0x01
    raw.set(f"p:{h[0]}", bytes(flipped))
    raw.set(f"p:{h[1]}", raw.get(f"p:{h[1]}")[:-1])
    raw.set(f"p:{h[2]}", b"not a page")
    into = buffers(4)
    assert be.batch_get(h, into) == [False, False, False, True]
    assert bytes(into[3]) == pages[3]
    st = be.stats()
    assert st.corrupt == 3 and st.hits == 1 and st.up
    assert raw.exists(f"p:{h[0]}", f"p:{h[1]}", f"p:{h[2]}") == 0
    be.close()


def test_redis_ttl_is_set(redis_process: RedisProcess) -> None:
    be = create_backend(RedisSettings(url=redis_process.url, key_prefix="ttl", ttl_s=100), LAYOUT)
    h = random_hashes(1)
    be.batch_set(h, random_pages(1))
    assert 0 < redis_process.client().ttl(f"ttl:{h[0]}") <= 100
    be.close()


# -- file store -----------------------------------------------------------------------------


def _file_backend(root: Path, layout: PageLayout = LAYOUT, **kw: object) -> FileBackend:
    be = create_backend(FileSettings(dir=str(root), **{"resilience": QUICK, **kw}), layout)  # type: ignore[arg-type]
    assert isinstance(be, FileBackend)
    return be


def _page_path(root: Path, h: str) -> Path:
    return root / h[:2] / f"{h}.page"


def test_file_damage_is_a_counted_miss_and_deleted(tmp_path: Path) -> None:
    be = _file_backend(tmp_path)
    h = random_hashes(6)
    pages = random_pages(6)
    be.batch_set(h, pages)
    p = [_page_path(tmp_path, x) for x in h]
    # truncated
    p[0].write_bytes(p[0].read_bytes()[: HEADER_SIZE + 10])
    # one payload byte flipped
    data = bytearray(p[1].read_bytes())
    data[-1] ^= 0x80
    p[1].write_bytes(bytes(data))
    # a header from another dtype, same size, valid checksum
    other = PageLayout(LAYOUT.layout_id, "float16", LAYOUT.shape)
    p[2].write_bytes(encode_header(other, pages[2], h[2]) + pages[2])
    # a header from another layout id
    p[3].write_bytes(encode_header(PageLayout(99, LAYOUT.dtype, LAYOUT.shape), pages[3], h[3]) + pages[3])
    # one byte appended
    p[4].write_bytes(p[4].read_bytes() + b"x")
    into = buffers(6)
    assert be.batch_get(h, into) == [False] * 5 + [True]
    assert bytes(into[5]) == pages[5]
    st = be.stats()
    assert st.corrupt == 5 and st.misses == 5 and st.errors == 0 and st.up
    assert not any(x.exists() for x in p[:5])
    assert be.batch_set(h[:5], pages[:5]) == [True] * 5  # rewritten cleanly
    assert be.batch_get(h, into) == [True] * 6
    assert [bytes(b) for b in into] == pages
    be.close()


def test_file_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    cap_pages = 10
    be = _file_backend(tmp_path, max_size_gb=cap_pages * LAYOUT.object_size / 1024**3, low_water=0.8)
    be.wait_scan(5)
    first = random_hashes(8)
    be.batch_set(first, random_pages(8))
    be.batch_get(first[:2], buffers(2))  # the two oldest are now the most recently used
    more = random_hashes(4)
    assert be.batch_set(more, random_pages(4)) == [True] * 4
    assert be.used_bytes <= cap_pages * LAYOUT.object_size
    st = be.stats()
    assert st.evictions >= 2 and st.dropped_writes == 0
    assert be.batch_exists(first[:2]) == 2
    assert be.batch_exists(more) == 4
    assert be.usage().bytes == be.used_bytes
    # what it evicted is told once, exactly: the pages no longer there
    evicted = be.take_evicted()
    assert len(evicted) == st.evictions and set(evicted) == {h for h in first + more if not be.batch_exists([h])}
    assert be.take_evicted() == []
    be.close()


def test_file_full_disk(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mnt:
        big = PageLayout(3, "uint8", (200 * 1024,))
        be = _file_backend(mnt / "l3", big)
        h = random_hashes(8)
        pages = random_pages(8, big)
        result = be.batch_set(h, pages)
        assert result.count(False) >= 3, result  # 1 MiB holds at most 4-5 such pages
        st = be.stats()
        assert st.dropped_writes == result.count(False) and st.errors >= 1
        assert not list(mnt.glob("l3/*/.*.tmp")), "temporary files left behind"
        into = buffers(8, big)
        got = be.batch_get(h, into)
        for i, ok in enumerate(got):
            if ok:
                assert bytes(into[i]) == pages[i]
        assert be.stats().corrupt == 0
        # after eviction made room, the store keeps working
        h2 = random_hashes(1)
        assert be.batch_set(h2, pages[:1]) == [True]
        assert be.stats().up
        be.close()


def _make_unwritable(path: Path) -> tuple[str, list[str]] | None:
    """Make ``path`` refuse new entries even for root; return (how, undo command) or None."""
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return "chattr +i", ["chattr", "-i", str(path)]
    if subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True).returncode == 0:
        return "read-only bind mount", ["umount", str(path)]
    return None


def test_file_directory_without_write_permission(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    be = _file_backend(root)
    how = _make_unwritable(root)
    if how is None:
        pytest.skip("neither chattr +i nor a read-only bind mount works here (root ignores mode bits)")
    try:
        h = random_hashes(3)
        pages = random_pages(3)
        assert be.batch_set(h, pages) == [False] * 3
        assert be.batch_set(h, pages) == [False] * 3
        st = be.stats()
        assert st.errors >= 2 and st.dropped_writes == 6 and not st.up
        assert be.batch_get(h, buffers(3)) == [False] * 3
    finally:
        subprocess.run(how[1], check=True)
    assert wait_until(lambda: be.stats().up, 10), "probe did not re-attach"
    assert be.batch_set(h, pages) == [True] * 3
    into = buffers(3)
    assert be.batch_get(h, into) == [True] * 3 and [bytes(b) for b in into] == pages
    be.close()


def test_file_shard_that_is_not_a_directory(tmp_path: Path) -> None:
    be = _file_backend(tmp_path, resilience=ResilienceSettings(failure_threshold=100))
    bad = "ab" + random_hashes(1)[0][2:]
    (tmp_path / "ab").write_bytes(b"in the way")
    good = "cd" + random_hashes(1)[0][2:]
    pages = random_pages(2)
    assert be.batch_set([bad, good], pages) == [False, True]
    into = buffers(2)
    assert be.batch_get([bad, good], into) == [False, True]
    assert bytes(into[1]) == pages[1]
    st = be.stats()
    assert st.errors >= 1 and st.dropped_writes == 1
    be.close()


def test_file_store_restart_finds_pages_and_cleans_temp_files(tmp_path: Path) -> None:
    be = _file_backend(tmp_path)
    h = random_hashes(30)
    pages = random_pages(30)
    be.batch_set(h, pages)
    be.close()
    shard = tmp_path / h[0][:2]
    stale = shard / f".{h[0]}.1.0.tmp"
    fresh = shard / f".{h[0]}.2.0.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))

    be2 = _file_backend(tmp_path, stale_tmp_s=600)
    assert be2.wait_scan(10)
    # a temporary file of an older build (no writer token) counts until it is stale
    assert be2.page_count == 30 and be2.used_bytes == 30 * LAYOUT.object_size + len(b"partial")
    assert not stale.exists() and fresh.exists()
    into = buffers(30)
    assert be2.batch_get(h, into) == [True] * 30
    assert [bytes(b) for b in into] == pages
    be2.close()


_KILLED_WRITER = """
import os, sys
from storage_backends import FileSettings, PageLayout, create_backend
layout = PageLayout(4, "uint8", (1 << 20,))
be = create_backend(FileSettings(dir=sys.argv[1], io_threads=4), layout)
page = os.urandom(layout.payload_size)
print("ready", flush=True)
while True:
    be.batch_set([os.urandom(32).hex() for _ in range(8)], [page] * 8)
"""


def test_interrupted_writes_leave_no_visible_partial_page(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.6)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    layout = PageLayout(4, "uint8", (1 << 20,))
    be = _file_backend(tmp_path, layout)
    hashes = list(be.iter_hashes())
    assert hashes, "the writer stored nothing before it was killed"
    got = be.batch_get(hashes, buffers(len(hashes), layout))
    assert all(got) and be.stats().corrupt == 0
    be.close()


@pytest.mark.parametrize("layout", [LAYOUT, PageLayout(5, "uint8", (512 * 1024,))], ids=["inline", "pool"])
def test_file_slow_io_is_bounded_and_buffers_are_released(tmp_path: Path, monkeypatch, layout: PageLayout) -> None:
    be = _file_backend(
        tmp_path, layout, io_threads=2, resilience=ResilienceSettings(timeout_s=0.2, failure_threshold=50)
    )
    assert be._inline(layout, 20) == (layout is LAYOUT)
    h = random_hashes(20)
    be.batch_set(h, random_pages(20, layout))
    real = FileBackend._read_one
    active = threading.Semaphore(0)

    def slow(self, layout, hsh, into):
        active.release()
        time.sleep(0.1)
        out = real(self, layout, hsh, into)
        active.acquire()
        return out

    monkeypatch.setattr(FileBackend, "_read_one", slow)
    t0 = time.monotonic()
    got = be.batch_get(h, buffers(20, layout))
    elapsed = time.monotonic() - t0
    assert elapsed < 0.6
    assert 0 < got.count(True) < 20
    assert not active.acquire(blocking=False), "a worker was still touching a buffer after return"
    st = be.stats()
    assert st.timeouts == got.count(False) and st.up
    be.close()
