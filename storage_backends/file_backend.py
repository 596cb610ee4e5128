"""The embedded file store (docs/architecture.md §7, ``backend: file``).

Layout on disk: ``{dir}/{h[0:2]}/{h}.page``, one object (header + payload, see
``page_format``) per file, 256 shard directories created on first use. Paths are built
only from validated page hashes.

Writes go to a temporary file ``.{h}.{pid}.{n}.tmp`` in the page's shard directory and
are renamed into place (with ``fsync`` of file and directory when configured), so a
reader -- in this or any other process -- sees a whole page or none; several processes
may write the same page at once and the last rename wins with a whole file. A page that
already exists is not rewritten. Temporary files older than ``stale_tmp_s`` are left
over from a crash and removed by the start-up scan.

Capacity: an in-memory LRU index (hash -> object bytes, oldest first) is rebuilt on start
by a background scan of the directory (ordered by file access time) while the store is
already serving; reads and existence checks go to the file system, so pages are usable
before the scan reaches them. When the bytes in the index exceed ``max_size_gb``, the
least recently used pages are deleted down to ``low_water`` of the cap. A full disk
(``ENOSPC``) drops the write, counts it, and evicts a little to make room. The evicted
hashes wait for ``take_evicted`` (the controller announces them as KV events).

Threads: page I/O runs on a pool of ``io_threads`` workers; a call waits at most
``timeout_s`` for pages that have not started. A page read or write already in progress
is always finished before the call returns, so no worker touches a caller's buffer after
the call. ``_index_lock`` guards the index, ``_used`` and the evicted hashes; it is never
held across I/O.
"""

from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from storage_backends.base import Buffer, StorageBackend, StoreUsage
from storage_backends.errors import StorageUnavailable
from storage_backends.keys import check_hashes, is_page_hash
from storage_backends.page_format import (
    HEADER_SIZE,
    NAME_OFFSET,
    PREFIX_SIZE,
    PageLayout,
    checksum,
    describe_mismatch,
    describe_name_mismatch,
    encode_header,
    page_name,
)
from storage_backends.resilience import CircuitBreaker, ExponentialJitterBackoff
from storage_backends.settings import FileSettings
from storage_backends.stats import StatsCounter, StorageStats

log = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"
_SHARDS = [f"{i:02x}" for i in range(256)]
_ATIME_REFRESH_S = 3600.0
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_CHECKSUM_END = PREFIX_SIZE + 8
INLINE_MAX_OBJECT_BYTES = 192 * 1024
MAX_EVICTED_KEPT = 100_000
"""Evicted hashes kept for ``take_evicted`` at most (older ones are dropped untold)."""
"""Batches of objects up to this size run on the calling thread (see ``FileBackend._run``)."""


class _Outcome(enum.Enum):
    HIT = "hit"  # read verified / page stored
    EXISTED = "existed"  # write skipped: page already there
    MISS = "miss"  # not present
    CORRUPT = "corrupt"  # present but failed verification (deleted)
    FULL = "full"  # write failed for lack of space
    ERROR = "error"  # I/O error (counts toward the breaker)
    TIMEOUT = "timeout"  # not started before the deadline


class _Batch:
    """Results of one batch call, filled in by workers; ``cancelled`` stops unstarted pages."""

    __slots__ = ("outcomes", "cancelled")

    def __init__(self, n: int) -> None:
        self.outcomes: list[_Outcome] = [_Outcome.TIMEOUT] * n
        self.cancelled = False


def _readv_full(fd: int, views: list[memoryview]) -> int:
    """``readv`` until every view is full or EOF; return bytes read."""
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def _skip(hdr: memoryview, into: memoryview, got: int) -> list[memoryview]:
    """The parts of ``[hdr, into]`` not yet filled after ``got`` bytes, plus a probe byte."""
    views = [hdr[got:], into] if got < hdr.nbytes else [into[got - hdr.nbytes :]]
    return [*views, memoryview(bytearray(1))]


def _writev_full(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class FileBackend(StorageBackend):
    """Page objects as files in one directory tree. See the module docstring."""

    kind = "file"

    def __init__(self, settings: FileSettings, layout: PageLayout | None) -> None:
        super().__init__(layout)
        self.settings = settings
        self.root = os.path.abspath(settings.dir)
        self._root_slash = os.path.join(self.root, "")
        self._timeout = settings.resilience.timeout_s
        self._max_bytes = settings.max_bytes
        self._low_bytes = int(self._max_bytes * settings.low_water)
        self._counters = StatsCounter()
        self._tmp_seq = itertools.count()
        self._closed = False
        self._init_process_state()
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"file store: cannot create {self.root}: {exc}") from exc
        if not self._probe():
            raise StorageUnavailable(f"file store: {self.root} is not writable and readable")
        res = settings.resilience
        self._breaker = CircuitBreaker(
            f"file:{self.root}",
            res.failure_threshold,
            self._probe,
            ExponentialJitterBackoff(res.probe_base_s, res.probe_cap_s),
            on_change=self._on_breaker_change,
        )
        # hash -> (object bytes, last access time we know of), least recently used first.
        self._index: OrderedDict[str, tuple[int, float]] = OrderedDict()
        # pages evicted and not yet taken (``take_evicted``); under the index lock
        self._evicted: deque[str] = deque(maxlen=MAX_EVICTED_KEPT)
        self._used = 0
        self._scan_done = threading.Event()
        if settings.scan_on_start:
            self._scan_thread: threading.Thread | None = threading.Thread(
                target=self._scan, name="l3-file-scan", daemon=True
            )
            self._scan_thread.start()
        else:
            self._scan_thread = None
            self._scan_done.set()

    # -- process-local state ---------------------------------------------------------

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._index_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()

    def _ensure_process(self) -> None:
        if self._pid != os.getpid():
            # Threads and locks do not survive fork: start over in this process.
            self._init_process_state()
            self._scan_done.set()

    def _executor(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="l3-file-io")
                pool = self._pool
        return pool

    # -- paths -------------------------------------------------------------------------

    def _path(self, h: str) -> str:
        return f"{self._root_slash}{h[:2]}/{h}{PAGE_SUFFIX}"

    # -- data path ---------------------------------------------------------------------

    def batch_exists(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        self._ensure_process()
        if not hashes or self._closed or not self._breaker.up:
            return 0
        fut = self._executor().submit(self._exists_prefix, hashes)
        done, _ = wait_futures([fut], timeout=self._timeout)
        if not done:
            # No caller buffer is involved, so the stat calls may finish in the background.
            self._counters.add(errors=1, timeouts=1)
            self._breaker.record_failure()
            return 0
        count, failed = fut.result()
        if failed:
            self._counters.add(errors=1)
            self._breaker.record_failure()
        else:
            self._breaker.record_success()
        return count

    def _exists_prefix(self, hashes: list[str]) -> tuple[int, bool]:
        for i, h in enumerate(hashes):
            try:
                os.stat(self._path(h))
            except FileNotFoundError:
                return i, False
            except OSError as exc:
                log.debug("file store: stat %s failed: %s", h, exc)
                return i, True
        return len(hashes), False

    def exists_each(self, hashes: Sequence[str]) -> list[bool]:
        hashes = check_hashes(hashes)
        self._ensure_process()
        if not hashes or self._closed or not self._breaker.up:
            return [False] * len(hashes)
        out = []
        for h in hashes:
            try:
                os.stat(self._path(h))
                out.append(True)
            except OSError:
                out.append(False)
        return out

    def batch_get(self, hashes: Sequence[str], into: Sequence[memoryview],
                  layout: PageLayout | None = None) -> list[bool]:
        layout = layout or self._require_layout()
        hashes, views = self._read_targets(hashes, into, layout)
        self._ensure_process()
        if not hashes:
            return []
        if self._closed or not self._breaker.up:
            self._counters.add(misses=len(hashes))
            return [False] * len(hashes)
        batch = self._run(layout, hashes, lambda i, h: self._read_one(layout, h, views[i]))
        return self._account_reads(batch, layout)

    def batch_set(self, hashes: Sequence[str], pages: Sequence[Buffer],
                  layout: PageLayout | None = None) -> list[bool]:
        layout = layout or self._require_layout()
        hashes, views = self._write_sources(hashes, pages, layout)
        self._ensure_process()
        if not hashes:
            return []
        if self._closed or not self._breaker.up:
            self._counters.add(dropped_writes=len(hashes))
            return [False] * len(hashes)
        batch = self._run(layout, hashes, lambda i, h: self._write_one(layout, h, views[i]))
        return self._account_writes(batch, layout)

    def delete(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        self._ensure_process()
        if self._closed or not self._breaker.up:
            return 0
        removed = 0
        for h in hashes:
            try:
                os.unlink(self._path(h))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._counters.add(errors=1)
                log.warning("file store: cannot delete page %s: %s", h, exc)
            self._forget(h)
        return removed

    def clear(self) -> int:
        self._ensure_process()
        if self._closed:
            return 0
        removed = 0
        for shard in _SHARDS:
            for name, path in self._list_shard(shard):
                if name.endswith(PAGE_SUFFIX) or name.endswith(TMP_SUFFIX):
                    try:
                        os.unlink(path)
                        removed += name.endswith(PAGE_SUFFIX)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        self._counters.add(errors=1)
                        log.warning("file store: cannot delete %s: %s", path, exc)
        with self._index_lock:
            self._index.clear()
            self._used = 0
        return removed

    def stats(self) -> StorageStats:
        return self._counters.snapshot(self.kind, self._breaker.up and not self._closed)

    def health(self) -> bool:
        self._ensure_process()
        if self._closed:
            return False
        fut = self._executor().submit(self._probe)
        done, _ = wait_futures([fut], timeout=self._timeout)
        return bool(done) and fut.result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._breaker.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    # -- extras for the daemon and the CLI --------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of page objects in the index (complete once the start-up scan is done)."""
        return self._used

    @property
    def page_count(self) -> int:
        return len(self._index)

    def size(self) -> StoreUsage:
        """Pages and object bytes in the index: every page this process wrote or found, and,
        once the start-up scan is done, every page in the directory (pages another daemon
        sharing the directory wrote since are counted when this one first sees them)."""
        with self._index_lock:
            return StoreUsage(len(self._index), self._used)

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Wait for the start-up scan; True once it is complete."""
        return self._scan_done.wait(timeout)

    def gc(self, target_bytes: int) -> tuple[int, int]:
        """Evict least recently used pages until at most ``target_bytes`` remain.

        Waits for the start-up scan first. Returns (pages removed, bytes removed).
        """
        self._scan_done.wait()
        return self._evict_to(target_bytes)

    def iter_hashes(self) -> Iterator[str]:
        for shard in _SHARDS:
            for name, _path in self._list_shard(shard):
                if name.endswith(PAGE_SUFFIX) and is_page_hash(name[: -len(PAGE_SUFFIX)]):
                    yield name[: -len(PAGE_SUFFIX)]

    def read_object(self, h: str) -> bytes | None:
        (h,) = check_hashes([h])
        try:
            with open(self._path(h), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageUnavailable(f"file store: cannot read page {h}: {exc}") from exc

    def usage(self) -> StoreUsage:
        pages = total = 0
        for shard in _SHARDS:
            try:
                it = os.scandir(os.path.join(self.root, shard))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StorageUnavailable(f"file store: cannot list {shard}: {exc}") from exc
            with it:
                for entry in it:
                    if entry.name.endswith(PAGE_SUFFIX):
                        try:
                            total += entry.stat(follow_symlinks=False).st_size
                            pages += 1
                        except FileNotFoundError:
                            continue
        return StoreUsage(pages, total)

    # -- batch machinery ---------------------------------------------------------------

    def _inline(self, layout: PageLayout, n: int) -> bool:
        """Whether a batch of ``n`` pages runs on the calling thread instead of the pool.

        Small objects cost mostly Python work under the GIL (open, checksum, bookkeeping),
        which worker threads cannot run in parallel: handing them to the pool only adds
        thread hand-offs and GIL contention. Large objects spend their time in ``readv`` /
        ``writev`` with the GIL released, where the pool overlaps the copies and keeps
        several requests in flight for the device.
        """
        return n == 1 or self.settings.io_threads == 1 or layout.object_size <= INLINE_MAX_OBJECT_BYTES

    def _run(self, layout: PageLayout, hashes: list[str], op: Callable[[int, str], _Outcome]) -> _Batch:
        """Run ``op(i, hashes[i])`` for every page, honouring the timeout.

        Either on the calling thread (see ``_inline``), checking the deadline before each
        page, or on the pool: pages are split into at most ``io_threads`` contiguous chunks;
        after the deadline, chunks not yet started are cancelled and running chunks stop
        before their next page; the call then waits for pages in progress, so no worker
        outlives it. Either way a page that has not started by the deadline is ``TIMEOUT``
        and no page is in progress after the call returns.
        """
        batch = _Batch(len(hashes))
        n = len(hashes)
        if self._inline(layout, n):
            outcomes = batch.outcomes
            deadline = time.monotonic() + self._timeout
            for i, h in enumerate(hashes):
                if time.monotonic() > deadline:
                    break
                outcomes[i] = op(i, h)
            return batch
        chunks = min(self.settings.io_threads, n)
        step = -(-n // chunks)

        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                if batch.cancelled:
                    return
                batch.outcomes[i] = op(i, hashes[i])

        pool = self._executor()
        futures: list[Future[None]] = [pool.submit(work, lo, min(lo + step, n)) for lo in range(0, n, step)]
        _, not_done = wait_futures(futures, timeout=self._timeout)
        if not_done:
            batch.cancelled = True
            for fut in not_done:
                fut.cancel()
            wait_futures([f for f in not_done if not f.cancelled()])
        for fut in futures:
            if not fut.cancelled() and fut.exception() is not None:
                # A bug in the page code, not store trouble: surface it in the log, count it.
                log.error("file store: page worker failed", exc_info=fut.exception())
        return batch

    def _account_reads(self, batch: _Batch, layout: PageLayout) -> list[bool]:
        out = [o is _Outcome.HIT for o in batch.outcomes]
        hits = sum(out)
        corrupt = batch.outcomes.count(_Outcome.CORRUPT)
        errors = batch.outcomes.count(_Outcome.ERROR)
        timeouts = batch.outcomes.count(_Outcome.TIMEOUT)
        self._counters.add(
            hits=hits,
            misses=len(out) - hits,
            bytes_read=hits * layout.payload_size,
            corrupt=corrupt,
            errors=errors + timeouts,
            timeouts=timeouts,
        )
        self._record(errors + timeouts)
        return out

    def _account_writes(self, batch: _Batch, layout: PageLayout) -> list[bool]:
        out = [o in (_Outcome.HIT, _Outcome.EXISTED) for o in batch.outcomes]
        written = batch.outcomes.count(_Outcome.HIT)
        full = batch.outcomes.count(_Outcome.FULL)
        errors = batch.outcomes.count(_Outcome.ERROR)
        timeouts = batch.outcomes.count(_Outcome.TIMEOUT)
        self._counters.add(
            writes=written,
            bytes_written=written * layout.payload_size,
            dropped_writes=len(out) - sum(out),
            errors=errors + timeouts + full,
            timeouts=timeouts,
        )
        self._record(errors + timeouts)
        if full:
            # Out of space below our cap: give back roughly what this batch needed.
            self._evict_to(max(0, self._used - (full + 1) * layout.object_size * 4))
        elif self._max_bytes and self._used > self._max_bytes:
            self._evict_to(self._low_bytes)
        return out

    def _record(self, failures: int) -> None:
        if failures:
            self._breaker.record_failure()
        else:
            self._breaker.record_success()

    # -- one page ----------------------------------------------------------------------

    def _scratch(self) -> tuple[bytearray, list[memoryview]]:
        """This thread's header buffer, and views of it plus a 1-byte overflow probe."""
        scratch = getattr(self._tls, "scratch", None)
        if scratch is None:
            hdr = bytearray(HEADER_SIZE + 1)
            mv = memoryview(hdr)
            scratch = self._tls.scratch = (hdr, [mv[:HEADER_SIZE], mv[HEADER_SIZE:]])
        return scratch

    def _read_one(self, layout: PageLayout, h: str, into: memoryview) -> _Outcome:
        """Read and verify one page into ``into``; never raises for store trouble.

        One ``open``, one ``readv`` of header + payload + one probe byte (so a long or short
        file shows in the byte count without an ``fstat``), ``close``. The header is
        verified by comparing its first ``PREFIX_SIZE`` bytes with the layout's constant
        prefix and its name field with ``h``'s, then the checksum. ``fstat`` runs only for a page whose access time is not
        known to be recent (to refresh it, see ``_touch_read``) and for a corrupt page (to
        delete exactly the file that was read).
        """
        path = f"{self._root_slash}{h[:2]}/{h}{PAGE_SUFFIX}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return _Outcome.MISS
        except OSError as exc:
            log.debug("file store: open %s failed: %s", path, exc)
            return _Outcome.ERROR
        size = layout.object_size
        try:
            hdr, (hdr_mv, probe) = self._scratch()
            got = os.readv(fd, [hdr_mv, into, probe])
            if 0 < got < size:
                # A short read without EOF (rare on local file systems): finish it.
                got += _readv_full(fd, _skip(hdr_mv, into, got))
            if got != size:
                reason = f"object is {'more than ' if got > size else ''}{min(got, size)} bytes, expected {size}"
            elif not hdr.startswith(layout.header_prefix):
                reason = describe_mismatch(layout, hdr_mv)
            elif hdr_mv[NAME_OFFSET:HEADER_SIZE] != page_name(h):
                reason = describe_name_mismatch(hdr_mv, h)
            elif int.from_bytes(hdr[PREFIX_SIZE:_CHECKSUM_END], "little") != checksum(into):
                reason = "payload checksum mismatch"
            else:
                self._touch_read(h, size, fd)
                return _Outcome.HIT
            st = os.fstat(fd)
        except OSError as exc:
            log.debug("file store: read %s failed: %s", path, exc)
            return _Outcome.ERROR
        finally:
            os.close(fd)
        log.warning("file store: corrupt page %s deleted: %s", h, reason)
        self._discard(h, path, st)
        return _Outcome.CORRUPT

    def _discard(self, h: str, path: str, st: os.stat_result) -> None:
        """Delete the object we read, unless another writer has replaced it meanwhile."""
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("file store: cannot delete corrupt page %s: %s", h, exc)
        self._forget(h)

    def _write_one(self, layout: PageLayout, h: str, page: memoryview) -> _Outcome:
        path = self._path(h)
        try:
            os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("file store: stat %s failed: %s", path, exc)
            return _Outcome.ERROR
        else:
            return _Outcome.EXISTED
        header = encode_header(layout, page, h)
        shard = f"{self._root_slash}{h[:2]}"
        tmp = f"{shard}/.{h}.{self._pid}.{next(self._tmp_seq)}{TMP_SUFFIX}"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                os.makedirs(shard, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _writev_full(fd, [memoryview(header), page])
                if self.settings.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.settings.fsync:
                self._fsync_dir(shard)
        except OSError as exc:
            self._remove_tmp(tmp)
            if exc.errno in _FULL_ERRNOS:
                log.debug("file store: no space for page %s: %s", h, exc)
                return _Outcome.FULL
            log.debug("file store: write %s failed: %s", path, exc)
            return _Outcome.ERROR
        self._touch(h, layout.object_size)
        return _Outcome.HIT

    @staticmethod
    def _remove_tmp(tmp: str) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("file store: cannot remove temporary file %s: %s", tmp, exc)

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- index and eviction ------------------------------------------------------------

    def _touch(self, h: str, size: int, atime: float | None = None) -> None:
        """Mark ``h`` most recently used (adding it with ``size`` bytes if new)."""
        now = time.time() if atime is None else atime
        with self._index_lock:
            old = self._index.get(h)
            if old is None:
                self._index[h] = (size, now)
                self._used += size
            else:
                self._index.move_to_end(h)

    def _touch_read(self, h: str, size: int, fd: int) -> None:
        """After a verified read of ``h`` on ``fd``: LRU bookkeeping, and keep the file's
        access time within ``_ATIME_REFRESH_S`` of the truth so LRU order survives a restart
        on relatime / noatime mounts. Costs no syscall for a page whose atime is recent."""
        now = time.time()
        with self._index_lock:
            old = self._index.get(h)
            if old is not None:
                self._index.move_to_end(h)
                if now - old[1] <= _ATIME_REFRESH_S:
                    return
                self._index[h] = (old[0], now)
        try:
            st = os.fstat(fd)
            if now - st.st_atime > _ATIME_REFRESH_S:
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        except OSError as exc:  # not our file (a shared store), or read-only: LRU only
            log.debug("file store: cannot refresh the access time of page %s: %s", h, exc)
        if old is None:
            self._touch(h, size, now)

    def _forget(self, h: str) -> None:
        with self._index_lock:
            old = self._index.pop(h, None)
            if old is not None:
                self._used -= old[0]

    def _evict_to(self, target_bytes: int) -> tuple[int, int]:
        victims: list[str] = []
        freed = 0
        with self._index_lock:
            while self._used > target_bytes and self._index:
                h, (size, _atime) = self._index.popitem(last=False)
                self._used -= size
                freed += size
                victims.append(h)
        removed = 0
        gone: list[str] = []
        for h in victims:
            try:
                os.unlink(self._path(h))
                removed += 1
                gone.append(h)
            except FileNotFoundError:
                gone.append(h)  # another process sharing the store removed it: gone all the same
            except OSError as exc:
                self._counters.add(errors=1)
                log.warning("file store: cannot evict page %s: %s", h, exc)
        if victims:
            self._counters.add(evictions=removed)
            log.debug("file store: evicted %d pages (%d bytes)", removed, freed)
        if gone:
            with self._index_lock:
                self._evicted.extend(gone)
        return removed, freed

    def take_evicted(self) -> list[str]:
        """The pages this instance's capacity eviction removed since the last call (at most
        the last ``MAX_EVICTED_KEPT``; another process's evictions in a shared store are
        not seen)."""
        with self._index_lock:
            out = list(self._evicted)
            self._evicted.clear()
        return out

    # -- start-up scan -----------------------------------------------------------------

    def _list_shard(self, shard: str) -> list[tuple[str, str]]:
        try:
            with os.scandir(os.path.join(self.root, shard)) as it:
                return [(e.name, e.path) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            self._counters.add(errors=1)
            log.warning("file store: cannot list shard %s: %s", shard, exc)
            return []

    def _scan(self) -> None:
        """Rebuild the LRU index from the directory; remove stale temporary files."""
        started = time.monotonic()
        found: list[tuple[float, str, int]] = []
        stale_before = time.time() - self.settings.stale_tmp_s
        try:
            for shard in _SHARDS:
                if self._closed:
                    return
                try:
                    it = os.scandir(os.path.join(self.root, shard))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                with it:
                    for entry in it:
                        name = entry.name
                        try:
                            if name.endswith(PAGE_SUFFIX) and is_page_hash(name[: -len(PAGE_SUFFIX)]):
                                st = entry.stat(follow_symlinks=False)
                                found.append((max(st.st_atime, st.st_mtime), name[: -len(PAGE_SUFFIX)], st.st_size))
                            elif name.endswith(TMP_SUFFIX):
                                if entry.stat(follow_symlinks=False).st_mtime < stale_before:
                                    os.unlink(entry.path)
                        except FileNotFoundError:
                            continue
            found.sort()
            with self._index_lock:
                # Pages touched since start are more recent than anything the scan found.
                merged: OrderedDict[str, tuple[int, float]] = OrderedDict(
                    (h, (size, atime)) for atime, h, size in found
                )
                for h, known in self._index.items():
                    merged.pop(h, None)
                    merged[h] = known
                self._index = merged
                self._used = sum(size for size, _atime in merged.values())
            log.info(
                "file store %s: %d pages, %.1f MiB found in %.2fs",
                self.root,
                len(found),
                self._used / 2**20,
                time.monotonic() - started,
            )
            if self._max_bytes and self._used > self._max_bytes:
                self._evict_to(self._low_bytes)
        except OSError as exc:
            self._counters.add(errors=1)
            log.warning("file store %s: start-up scan failed: %s", self.root, exc)
        finally:
            self._scan_done.set()

    # -- health ------------------------------------------------------------------------

    def _probe(self) -> bool:
        """Write, read back and remove a small file in the store root; never raises."""
        path = os.path.join(self.root, f".probe.{os.getpid()}.{threading.get_ident()}")
        token = os.urandom(16)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, token)
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                ok = f.read() == token
            os.unlink(path)
            return ok
        except OSError as exc:
            log.debug("file store %s: probe failed: %s", self.root, exc)
            self._remove_tmp(path)
            return False

    def _on_breaker_change(self, up: bool) -> None:
        if not up:
            self._counters.add(trips=1)
