"""The file store keeps what it promised and counts what it holds (docs/architecture.md §7):
one cap for every process sharing a directory, a full disk that costs only what the failed
writes needed, leftovers of killed writers reclaimed and counted, durable directories with
``fsync: true``, "stored" meaning a whole object, and an index that follows the files.

Real files and real processes (killed by pid); a real tmpfs for the full disk; ``strace``
records the syscall order of a durable write."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from storage_backends import FileSettings, PageLayout, ResilienceSettings, create_backend
from storage_backends.file_backend import FileBackend
from tests.storage.conftest import LAYOUT, buffers, mounted_tmpfs, random_hashes, random_pages, wait_until

REPO = str(Path(__file__).resolve().parents[2])
QUICK = ResilienceSettings(timeout_s=2.0, failure_threshold=3, probe_base_s=0.05, probe_cap_s=0.3)


def _backend(root: Path, layout: PageLayout | None = LAYOUT, **kw: object) -> FileBackend:
    be = create_backend(FileSettings(dir=str(root), **{"resilience": QUICK, **kw}), layout)  # type: ignore[arg-type]
    assert isinstance(be, FileBackend)
    return be


def _page(root: Path, h: str) -> Path:
    return root / h[:2] / f"{h}.page"


def _on_disk(root: Path) -> tuple[int, int, int]:
    """(page files, temporary files, bytes of both) under the store's shard directories."""
    pages = tmps = total = 0
    for shard in root.iterdir():
        if not re.fullmatch(r"[0-9a-f]{2}", shard.name) or not shard.is_dir():
            continue
        for f in shard.iterdir():
            if f.name.endswith(".page"):
                pages += 1
            elif f.name.endswith(".tmp"):
                tmps += 1
            else:
                continue
            total += f.stat().st_size
    return pages, tmps, total


# -- 2. one cap for every process on the directory -------------------------------------------

_CAPPED_WRITER = """
import os, sys
from storage_backends import FileSettings, PageLayout, create_backend
layout = PageLayout(4, "uint8", (256 * 1024,))
be = create_backend(FileSettings(dir=sys.argv[1], max_size_gb=float(sys.argv[2])), layout)
assert be.wait_scan(30)  # a scan while the other writes counts its pages twice (the safe side)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(15):
    be.batch_set([os.urandom(32).hex() for _ in range(4)], [os.urandom(layout.payload_size) for _ in range(4)])
be.close()
"""


def test_daemons_sharing_a_directory_keep_its_cap(tmp_path: Path) -> None:
    """Two processes with a cap of 40 pages each write 60 pages into one directory: the
    directory holds at most the cap, and what the store counts is what the files hold."""
    layout = PageLayout(4, "uint8", (256 * 1024,))
    cap = 40 * layout.object_size
    root = tmp_path / "l3"
    procs = [subprocess.Popen([sys.executable, "-c", _CAPPED_WRITER, str(root), repr(cap / 2**30)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        for p in procs:  # both write at once
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    pages, tmps, total = _on_disk(root)
    assert tmps == 0
    assert total <= cap, f"{pages} pages, {total / 2**20:.1f} MiB in a directory capped at {cap / 2**20:.1f} MiB"
    assert pages >= 30, f"only {pages} pages left: eviction went far below the cap"
    reader = _backend(root, layout, max_size_gb=cap / 2**30, scan_on_start=False)
    size = reader.size()
    assert size is not None and (size.pages, size.bytes) == (pages, total)
    reader.close()


def test_an_opened_store_counts_pages_another_process_wrote(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    a = _backend(root)
    b = _backend(root)
    assert a.wait_scan(10) and b.wait_scan(10)
    assert a.batch_set(random_hashes(5), random_pages(5)) == [True] * 5
    assert b.batch_set(random_hashes(3), random_pages(3)) == [True] * 3
    for be in (a, b):
        size = be.size()
        assert size is not None and (size.pages, size.bytes) == (8, 8 * LAYOUT.object_size)
    a.close()
    b.close()


# -- 3. a full disk ---------------------------------------------------------------------------


@pytest.fixture
def tmpfs_64m(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", "64m") as mnt:
        yield mnt


def test_a_full_disk_evicts_only_what_the_failed_writes_need(tmpfs_64m: Path) -> None:
    big = PageLayout(3, "uint8", (3 * 2**20,))
    root = tmpfs_64m / "l3"
    be = _backend(root, big)
    assert be.wait_scan(10)
    failures = 0
    for batch in [1] * 30 + [4] * 4:  # fill the disk one page at a time, then go on past it
        before = _on_disk(root)[0]
        result = be.batch_set(random_hashes(batch), random_pages(batch, big))
        failed = result.count(False)
        failures += failed
        after, tmps, _bytes = _on_disk(root)
        assert tmps == 0, "temporary files left behind"
        # at most one page evicted per failed write, whatever was written besides
        assert after >= before + result.count(True) - failed, (before, after, result)
    assert failures >= 4
    assert _on_disk(root)[0] >= 15, "a full disk emptied the store"
    st = be.stats()
    assert st.dropped_writes >= 4 and st.corrupt == 0
    h = list(be.iter_hashes())
    got = be.batch_get(h, buffers(len(h), big))
    assert all(got)
    be.close()


# -- 4. leftovers of killed writers ------------------------------------------------------------

_STUCK_WRITER = """
import os, sys, time
import storage_backends.file_page_io as fb
from storage_backends import FileSettings, PageLayout, create_backend
real = fb.writev_full
def half_then_hang(fd, views):
    real(fd, [views[0], views[1][: views[1].nbytes // 2]])
    print("mid-write", flush=True)
    time.sleep(3600)
fb.writev_full = half_then_hang
layout = PageLayout(4, "uint8", (1 << 20,))
be = create_backend(FileSettings(dir=sys.argv[1], io_threads=1), layout)
be.batch_set([os.urandom(32).hex()], [os.urandom(layout.payload_size)])
"""


def _kill_a_writer_mid_write(root: Path) -> int:
    """Start a writer, SIGKILL it by pid halfway through a page; returns the bytes it left
    (one temporary file, no page)."""
    pages, tmps, total = _on_disk(root) if root.exists() else (0, 0, 0)
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_WRITER, str(root)], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"mid-write"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    pages_after, tmps_after, total_after = _on_disk(root)
    assert (pages_after, tmps_after) == (pages, tmps + 1), "the killed writer should have left one temporary file"
    return total_after - total


def test_a_running_store_reclaims_a_killed_writers_leftovers(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    layout = PageLayout(4, "uint8", (1 << 20,))
    be = _backend(root, layout, maintenance_s=0.2)
    assert be.wait_scan(10)
    left = _kill_a_writer_mid_write(root)
    assert left > 0
    assert wait_until(lambda: _on_disk(root)[1] == 0, 15), "the dead writer's temporary file is still there"
    # The walk removes the file mid-scan; the record is set when that scan ends.
    assert wait_until(lambda: be.size().bytes == 0, 15), f"the record still counts {be.size()}"
    assert be.size().pages == 0
    be.close()


def test_a_restarted_store_reclaims_a_killed_writers_leftovers_at_once(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    layout = PageLayout(4, "uint8", (1 << 20,))
    _kill_a_writer_mid_write(root)
    be = _backend(root, layout)  # stale_tmp_s is 300 s: the file is seconds old
    assert be.wait_scan(10)
    assert _on_disk(root)[1] == 0
    be.close()


def test_leftovers_count_until_reclaimed(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    layout = PageLayout(4, "uint8", (1 << 20,))
    be = _backend(root, layout, scan_on_start=False)
    h = random_hashes(3)
    assert be.batch_set(h, random_pages(3, layout)) == [True] * 3
    left = _kill_a_writer_mid_write(root)
    usage = be.usage()
    pages, tmps, total = _on_disk(root)
    assert (usage.pages, usage.temp_files, usage.bytes) == (pages, tmps, total) == (3, 1, 3 * layout.object_size + left)
    be.close()


# -- 5. durability with fsync: true ----------------------------------------------------------

_DURABLE_WRITER = """
import os, sys
from storage_backends import FileSettings, PageLayout, create_backend
layout = PageLayout(4, "uint8", (4096,))
be = create_backend(FileSettings(dir=sys.argv[1], fsync=True, scan_on_start=False), layout)
assert be.batch_set([sys.argv[2]], [bytes(layout.payload_size)]) == [True]
os.write(1, b"REPORTED-DURABLE\\n")
be.close()
"""


def _strace_durable_write(root: Path, h: str, log: Path) -> list[str]:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    r = subprocess.run([strace, "-f", "-y", "-qq", "-o", str(log), "-e",
                        "trace=mkdir,mkdirat,fsync,fdatasync,rename,renameat,renameat2,link,linkat,write",
                        sys.executable, "-c", _DURABLE_WRITER, str(root), h],
                       cwd=REPO, capture_output=True, timeout=120)
    if r.returncode != 0 and b"PTRACE" in r.stderr.upper():
        pytest.skip(f"strace cannot trace here: {r.stderr.decode()[-200:]}")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    lines = log.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if "REPORTED-DURABLE" in line)
    return lines[:end]


def _fsynced_dirs(lines: list[str]) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in enumerate(lines)
            if (m := re.search(r"\bf(?:data)?sync\(\d+<([^>]*)>\)\s+= 0", line))]


@pytest.mark.parametrize("nested", ["dir", "dir/tenants/acme"], ids=["store", "tenant-partition"])
def test_a_durable_write_makes_every_new_directory_durable(tmp_path: Path, nested: str) -> None:
    """With ``fsync: true``, before a write is reported: every directory created on the
    page's path (the store root and its missing parents, the shard) is followed by an
    fsync of its parent; the page file is fsynced before it is published under its name,
    and its directory after."""
    root = tmp_path / "new" / nested
    h = random_hashes(1)[0]
    lines = _strace_durable_write(root, h, tmp_path / "strace.log")
    synced = _fsynced_dirs(lines)
    made = [(i, m.group(1)) for i, line in enumerate(lines)
            if (m := re.search(r'mkdir(?:at)?\((?:AT_FDCWD, )?"([^"]+)"[^)]*\)\s+= 0', line))]
    expect = {str(tmp_path / "new"), str(root), str(root / h[:2])}
    assert expect <= {d for _, d in made}, made
    for i, d in made:
        parent = os.path.dirname(d.rstrip("/"))
        assert any(j > i and s == parent for j, s in synced), f"mkdir {d} without a later fsync of {parent}"
    page = str(_page(root, h))
    publish = next(i for i, line in enumerate(lines)
                   if re.search(r"(rename|link)(at2?)?\(", line) and page in line and "= 0" in line)
    assert any(j < publish and s.endswith(".tmp") for j, s in synced), "the page was not fsynced before publishing"
    assert any(j > publish and s == str(root / h[:2]) for j, s in synced), "the shard was not fsynced after"


# -- 6. "stored" means a whole object -----------------------------------------------------------


def test_a_torn_file_is_not_stored_and_is_written_again(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    be = _backend(root)
    h = random_hashes(4)
    pages = random_pages(4)
    assert be.batch_set(h, pages) == [True] * 4
    _page(root, h[1]).write_bytes(b"")  # power loss with fsync: false
    _page(root, h[2]).write_bytes(_page(root, h[2]).read_bytes()[: LAYOUT.object_size // 2])
    _page(root, h[3]).write_bytes(bytes(LAYOUT.object_size))  # the right size, zeroed blocks
    assert be.batch_exists(h) == 1
    assert be.exists_each(h) == [True, False, False, False]
    admin = _backend(root, None, scan_on_start=False)
    assert admin.batch_exists(h) == 1 and admin.exists_each(h) == [True, False, False, False]
    admin.close()
    assert be.batch_set(h, pages) == [True] * 4
    into = buffers(4)
    assert be.batch_get(h, into) == [True] * 4
    assert [bytes(b) for b in into] == pages
    assert be.stats().corrupt == 3  # the torn objects it replaced
    assert be.batch_exists(h) == 4
    be.close()


def test_redis_a_torn_value_is_not_stored(redis_process) -> None:
    from storage_backends import RedisSettings

    be = create_backend(RedisSettings(url=redis_process.url, key_prefix="t"), LAYOUT)
    raw = redis_process.client()
    h = random_hashes(3)
    pages = random_pages(3)
    assert be.batch_set(h, pages) == [True] * 3
    raw.set(f"t:{h[1]}", raw.get(f"t:{h[1]}")[:100])
    raw.set(f"t:{h[2]}", b"")
    assert be.batch_exists(h) == 1
    assert be.exists_each(h) == [True, False, False]
    be.close()


# -- the index follows the files ----------------------------------------------------------------


def test_a_failed_delete_keeps_the_page_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "l3"
    be = _backend(root)
    assert be.wait_scan(10)
    h = random_hashes(2)
    assert be.batch_set(h, random_pages(2)) == [True, True]
    real_unlink = os.unlink

    def refuse(path, *a, **kw):
        if str(path).endswith(f"{h[0]}.page"):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", refuse)
    assert be.delete(h) == 1
    monkeypatch.undo()
    size = be.size()
    assert size is not None and (size.pages, size.bytes) == (1, LAYOUT.object_size)
    assert be.page_count == 1
    be.close()


def test_a_read_during_an_eviction_does_not_bring_the_page_back(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction has chosen a page; a read of it finishes before the unlink: the index
    (the page count, the next eviction's victims) must not take it back."""
    root = tmp_path / "l3"
    be = _backend(root, max_size_gb=4 * LAYOUT.object_size / 1024**3, low_water=0.5)
    assert be.wait_scan(10)
    h = random_hashes(4)
    assert be.batch_set(h, random_pages(4)) == [True] * 4
    real_unlink = os.unlink
    read_while_chosen: list[bool] = []

    def read_then_unlink(path, *a, **kw):
        name = os.path.basename(str(path))
        if name.endswith(".page") and name[:-5] in h:  # an eviction victim, its file still there
            read_while_chosen.extend(be.batch_get([name[:-5]], buffers(1)))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", read_then_unlink)
    assert be.batch_set(random_hashes(1), random_pages(1)) == [True]
    monkeypatch.undo()
    assert read_while_chosen and all(read_while_chosen), "no eviction, or its victims were not readable"
    files = _on_disk(root)[0]
    assert files == 5 - len(read_while_chosen)
    assert be.page_count == files, f"the index holds {be.page_count} pages, the store {files}"
    be.close()


@contextmanager
def _scan_held_at(monkeypatch: pytest.MonkeyPatch, shard: str) -> Iterator[threading.Event]:
    """A fault point: a scan that comes to list ``shard`` waits there until the ``with``
    block ends; yields an event set once it waits."""
    reached, gate = threading.Event(), threading.Event()
    real_scandir = os.scandir

    def held(path, *a, **kw):
        if str(path).endswith(f"/{shard}"):
            reached.set()
            gate.wait(10)
        return real_scandir(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", held)
    try:
        yield reached
    finally:
        gate.set()


def test_the_scan_does_not_bring_back_pages_deleted_while_it_runs(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "l3"
    first = _backend(root)
    h = random_hashes(6)
    assert first.batch_set(h, random_pages(6)) == [True] * 6
    first.close()
    with _scan_held_at(monkeypatch, "ff") as reached:  # every page is listed by then
        be = _backend(root)
        assert reached.wait(10)
        assert be.delete(h[:3]) == 3
    assert be.wait_scan(10)
    monkeypatch.undo()
    assert be.page_count == 3
    size = be.size()
    assert size is not None and (size.pages, size.bytes) == (3, 3 * LAYOUT.object_size)
    be.close()


def test_the_scan_counts_pages_written_while_it_runs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon serves while its start-up scan runs: the pages it writes meanwhile (which the
    walk then finds) are counted once."""
    root = tmp_path / "l3"
    first = _backend(root)
    assert first.batch_set(random_hashes(4), random_pages(4)) == [True] * 4
    first.close()
    with _scan_held_at(monkeypatch, "00") as reached:  # before the walk lists anything
        be = _backend(root)
        assert reached.wait(10)
        assert be.batch_set(random_hashes(5), random_pages(5)) == [True] * 5
    assert be.wait_scan(10)
    monkeypatch.undo()
    size = be.size()
    assert size is not None and (size.pages, size.bytes) == (9, 9 * LAYOUT.object_size) == _on_disk(root)[::2]
    be.close()


@pytest.mark.parametrize("counted", ["while the scan runs", "after the scan"])
def test_a_batch_published_before_a_scan_and_counted_after_its_start_is_counted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted: str) -> None:
    """A batch of writes publishes its pages, then counts them in the shared record. A scan
    that begins between the two finds the pages, and the record counts them after the
    scan's reading (while the scan runs, or after it): each is counted once."""
    root = tmp_path / "l3"
    first = _backend(root)
    assert first.batch_set(random_hashes(4), random_pages(4)) == [True] * 4
    first.close()
    be = _backend(root, scan_on_start=False)
    published, go = threading.Event(), threading.Event()
    settle = be._evictor.after_writes

    def held(*a: object, **kw: object) -> None:
        published.set()  # the batch's page is linked under its name by now
        assert go.wait(10)
        settle(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(be._evictor, "after_writes", held)
    writer = threading.Thread(target=lambda: be.batch_set(random_hashes(1), random_pages(1)))
    writer.start()
    assert published.wait(10)
    if counted == "while the scan runs":
        with _scan_held_at(monkeypatch, "00") as reached:  # the record is read by then
            scan = threading.Thread(target=be._housekeeper.scan)
            scan.start()
            assert reached.wait(10)
            go.set()
            writer.join(10)
        scan.join(10)
    else:
        be._housekeeper.scan()
        go.set()
        writer.join(10)
    monkeypatch.undo()
    size = be.size()
    assert size is not None and (size.pages, size.bytes) == (5, 5 * LAYOUT.object_size) == _on_disk(root)[::2]
    assert be.page_count == 5
    be.close()


def test_a_long_scan_logs_its_progress_and_the_walks_report_theirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from storage_backends import file_housekeeping

    root = tmp_path / "l3"
    first = _backend(root)
    assert first.batch_set(random_hashes(6), random_pages(6)) == [True] * 6
    first.close()
    monkeypatch.setattr(file_housekeeping, "PROGRESS_LOG_S", 0.0)  # every shard counts as long
    with caplog.at_level("INFO", logger="storage_backends.file_housekeeping"):
        be = _backend(root)
        assert be.wait_scan(10)
    lines = [r.getMessage() for r in caplog.records if "scanning" in r.getMessage()]
    assert len(lines) == 256 and lines[-1].endswith("256 of 256 shards, 6 pages so far")
    assert be.scan_progress == (256, 6)
    told: list[tuple[int, int]] = []
    usage = be.usage(progress=lambda shards, pages: told.append((shards, pages)))
    assert (usage.pages, usage.bytes) == (6, 6 * LAYOUT.object_size)
    assert [s for s, _ in told] == list(range(1, 257)) and told[-1] == (256, 6)
    evicted: list[int] = []
    assert be.gc(3 * LAYOUT.object_size, progress=evicted.append) == (3, 3 * LAYOUT.object_size)
    assert evicted[-1] == 3
    told.clear()
    assert be.clear(progress=lambda shards, pages: told.append((shards, pages))) == 3
    assert told[-1] == (256, 3) and [s for s, _ in told] == list(range(1, 257))
    be.close()
