"""The embedded file store (docs/architecture.md §7, ``backend: file``).

Layout on disk: ``file_layout`` (``{dir}/{h[0:2]}/{h}.page``, one object per file, see
``page_format``). Several processes may use one directory at once.

Writes: a page is written to a temporary file named with this process's writer token
(``file_usage.WriterRegistry``) in the page's shard directory, then published under its
name with ``link`` (so a page that another writer published first is left alone, and this
process knows it did not add it); the temporary name is then removed. With ``fsync`` the
file is fsynced before it is published, its directory after, and every directory made on
the way is followed by an fsync of its parent (``file_layout.make_dirs``; the store root
once per shard this process first writes into), before the write is reported stored.

"Stored" means a whole object: ``batch_exists``, ``exists_each`` and the check before a
write take a page as present only if its file has the size and header of a complete
object that names it (``page_format.complete_object``). An incomplete one (a torn or
zero-length file left by a power loss with ``fsync: false``) is absent, and a write
replaces it.

Capacity: every process counts what it adds and removes in the shared
``file_usage.UsageRecord``; ``file_eviction.Evictor`` evicts above ``max_size_gb`` and on a
full disk (a write that finds no space is dropped and counted). Housekeeping
(``scan_on_start``: the start-up scan, dead writers' leftovers): ``file_housekeeping``.

Threads: page I/O runs on a ``file_batch.BatchRunner``; a call waits at most
``timeout_s`` for pages that have not started. No lock of this module is held across
I/O (the index, record and registry have their own, module docs).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from storage_backends.base import Buffer, StorageBackend, StoreUsage
from storage_backends.errors import StorageUnavailable
from storage_backends.file_batch import Batch, BatchRunner, Outcome
from storage_backends.file_eviction import Evictor
from storage_backends.file_housekeeping import Housekeeper
from storage_backends.file_index import ATIME_REFRESH_S, PageIndex
from storage_backends.file_layout import (
    PAGE_SUFFIX,
    SHARDS,
    Progress,
    fsync_dir,
    list_shard,
    make_dirs,
    page_path,
    tmp_path,
    walk,
)
from storage_backends.file_page_io import (
    examine,
    new_scratch,
    probe,
    publish,
    read_verified,
    remove_quietly,
    write_file,
)
from storage_backends.file_usage import UsageRecord, WriterRegistry
from storage_backends.keys import check_hashes, is_page_hash
from storage_backends.page_format import PageLayout, encode_header
from storage_backends.resilience import CircuitBreaker, ExponentialJitterBackoff
from storage_backends.settings import FileSettings
from storage_backends.stats import StatsCounter, StorageStats

log = logging.getLogger(__name__)

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
INLINE_MAX_OBJECT_BYTES = 192 * 1024
"""Batches of objects up to this size run on the calling thread (see ``FileBackend._inline``)."""


class FileBackend(StorageBackend):
    """Page objects as files in one directory tree. See the module docstring."""

    kind = "file"

    def __init__(self, settings: FileSettings, layout: PageLayout | None) -> None:
        super().__init__(layout)
        self.settings = settings
        self.root = os.path.abspath(settings.dir)
        self._root_slash = os.path.join(self.root, "")
        self._timeout = settings.resilience.timeout_s
        self._counters = StatsCounter()
        self._tmp_seq = itertools.count()
        self._closed = False
        self._hard_links = True
        self._index = PageIndex()
        self._init_process_state()
        self._evictor = Evictor(settings, self._root_slash, self._index, self._usage, self._counters,
                                want_scan=lambda: self._housekeeper.want_scan())
        try:
            make_dirs(self.root, settings.fsync)
            if settings.fsync:
                fsync_dir(os.path.dirname(self.root))  # the root's own entry, whoever made it
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
        self._housekeeper = Housekeeper(self.root, settings, self._index, self._usage, self._writers,
                                        self._evictor.evict, lambda: self._closed)
        if settings.scan_on_start:
            self._housekeeper.start()
        else:
            self._housekeeper.scan_done.set()

    # -- process-local state ---------------------------------------------------------

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._runner = BatchRunner(self.settings.io_threads, self._timeout)
        self._tls = threading.local()
        self._usage = UsageRecord(self.root)
        self._writers = WriterRegistry(self.root)
        self._durable_shards: set[str] = set()
        self._index.after_fork()

    def _ensure_process(self) -> None:
        if self._pid != os.getpid():
            # Threads, locks and flock'd descriptors do not survive fork: start over here.
            self._usage.forget_inherited()
            self._writers.forget_inherited()
            self._init_process_state()
            self._evictor.after_fork(self._usage)
            self._housekeeper.after_fork()

    def _inline(self, layout: PageLayout, n: int) -> bool:
        """Whether a batch of ``n`` pages runs on the calling thread instead of the pool.

        Small objects cost mostly Python work under the GIL (open, checksum, bookkeeping),
        which worker threads cannot run in parallel: handing them to the pool only adds
        thread hand-offs and GIL contention. Large objects spend their time in ``readv`` /
        ``writev`` with the GIL released, where the pool overlaps the copies and keeps
        several requests in flight for the device.
        """
        return n == 1 or self.settings.io_threads == 1 or layout.object_size <= INLINE_MAX_OBJECT_BYTES

    def _path(self, h: str) -> str:
        return page_path(self._root_slash, h)

    # -- data path ---------------------------------------------------------------------

    def batch_exists(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        self._ensure_process()
        if not hashes or self._closed or not self._breaker.up:
            return 0
        finished, result = self._runner.call(lambda: self._exists_prefix(hashes))
        if not finished:
            # No caller buffer is involved, so the look-ups may finish in the background.
            self._counters.add(errors=1, timeouts=1)
            self._breaker.record_failure()
            return 0
        count, failed = result if isinstance(result, tuple) else (0, True)
        if failed:
            self._counters.add(errors=1)
            self._breaker.record_failure()
        else:
            self._breaker.record_success()
        return int(count)

    def _exists_prefix(self, hashes: list[str]) -> tuple[int, bool]:
        for i, h in enumerate(hashes):
            try:
                whole, _st = self._examine(h, self.layout)
            except OSError as exc:
                log.debug("file store: looking at %s failed: %s", h, exc)
                return i, True
            if not whole:
                return i, False
        return len(hashes), False

    def exists_each(self, hashes: Sequence[str]) -> list[bool]:
        hashes = check_hashes(hashes)
        self._ensure_process()
        if not hashes or self._closed or not self._breaker.up:
            return [False] * len(hashes)
        out = []
        for h in hashes:
            try:
                out.append(self._examine(h, self.layout)[0])
            except OSError:
                out.append(False)
        return out

    def _examine(self, h: str, layout: PageLayout | None) -> tuple[bool, os.stat_result | None]:
        return examine(self._path(h), h, layout)

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
        batch = self._runner.run(hashes, lambda i, h: self._read_one(layout, h, views[i]),
                                 self._inline(layout, len(hashes)))
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
        # before any file (file_usage); the batch is in flight until it is counted (file_index)
        self._usage.reserve(len(hashes) * layout.object_size, then=lambda: self._index.writing(hashes))
        try:
            batch = self._runner.run(hashes, lambda i, h: self._write_one(layout, h, views[i]),
                                     self._inline(layout, len(hashes)))
        except BaseException:
            self._index.settled(hashes)  # a bug: what it published is measured by the next scan
            raise
        return self._account_writes(batch, layout, hashes)

    def delete(self, hashes: Sequence[str]) -> int:
        hashes = check_hashes(hashes)
        self._ensure_process()
        if self._closed or not self._breaker.up:
            return 0
        removed = freed = 0
        for h in hashes:
            path = self._path(h)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                self._index.removed(h)
            except OSError as exc:  # still there: still indexed and counted
                self._counters.add(errors=1)
                log.warning("file store: cannot delete page %s: %s", h, exc)
            else:
                removed += 1
                freed += size
                self._index.removed(h)
        self._usage.adjust(-freed, -removed)
        return removed

    def clear(self, progress: Progress | None = None) -> int:
        """Remove every page file (temporary files are their writers', or reclaimed as a
        dead writer's); ``progress`` is told after each shard (shards done, pages removed)."""
        self._ensure_process()
        if self._closed:
            return 0
        removed = freed = 0
        for i, shard in enumerate(SHARDS):
            if progress is not None and i:
                progress(i, removed)
            for name, path in self._list_shard(shard):
                if name.endswith(PAGE_SUFFIX):
                    try:
                        size = os.stat(path).st_size
                        os.unlink(path)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        self._counters.add(errors=1)
                        log.warning("file store: cannot delete %s: %s", path, exc)
                        continue
                    removed += 1
                    freed += size
        self._index.clear()
        self._usage.adjust(-freed, -removed)
        if progress is not None:
            progress(len(SHARDS), removed)
        return removed

    def stats(self) -> StorageStats:
        return self._counters.snapshot(self.kind, self._breaker.up and not self._closed)

    def health(self) -> bool:
        self._ensure_process()
        if self._closed:
            return False
        finished, ok = self._runner.call(self._probe)
        return finished and bool(ok)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._breaker.close()
        if self._pid != os.getpid():
            return  # the parent's threads and files are the parent's
        self._housekeeper.stop()
        self._runner.shutdown()
        self._writers.close()
        self._usage.close()

    # -- extras for the daemon and the CLI --------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes the whole store holds, as the shared record counts them."""
        self._ensure_process()
        return self._usage.read().bytes

    @property
    def page_count(self) -> int:
        """Pages in this process's index (the victims it can choose)."""
        return len(self._index)

    def size(self) -> StoreUsage:
        """Pages and bytes of the whole store (every process sharing the directory), as the
        shared record counts them: pages, and bytes of pages and temporary files."""
        self._ensure_process()
        usage = self._usage.read()
        return StoreUsage(usage.pages, usage.bytes)

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Wait for the start-up scan; True once it is complete."""
        return self._housekeeper.scan_done.wait(timeout)

    @property
    def scan_progress(self) -> tuple[int, int]:
        """The scan in progress (or the last one): (shards listed of 256, pages found)."""
        return self._housekeeper.progress

    def gc(self, target_bytes: int, progress: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Evict least recently used pages until the store holds at most ``target_bytes``;
        ``progress`` is told the pages removed so far, every few thousand.

        Waits for the start-up scan first. Returns (pages removed, bytes removed)."""
        self._housekeeper.scan_done.wait()
        self._ensure_process()
        return self._evictor.gc(target_bytes, progress)

    def iter_hashes(self) -> Iterator[str]:
        for shard in SHARDS:
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

    def usage(self, progress: Progress | None = None) -> StoreUsage:
        """A walk of the files: pages, bytes of pages and temporary files, temporary files
        (``progress``: ``file_layout.walk``'s). Removes nothing; holds nothing per file."""
        found = walk(self.root, collect=False, progress=progress)
        if not found.complete:
            raise StorageUnavailable(f"file store: cannot list every shard of {self.root} (see the log)")
        return StoreUsage(found.page_count, found.bytes, found.temp_files)

    # -- accounting -------------------------------------------------------------------

    def _account_reads(self, batch: Batch, layout: PageLayout) -> list[bool]:
        out = [o is Outcome.HIT for o in batch.outcomes]
        hits = sum(out)
        errors = batch.count(Outcome.ERROR)
        timeouts = batch.count(Outcome.TIMEOUT)
        self._counters.add(
            hits=hits,
            misses=len(out) - hits,
            bytes_read=hits * layout.payload_size,
            corrupt=batch.count(Outcome.CORRUPT),
            errors=errors + timeouts,
            timeouts=timeouts,
        )
        self._record(errors + timeouts)
        return out

    def _account_writes(self, batch: Batch, layout: PageLayout, hashes: list[str]) -> list[bool]:
        out = [o in (Outcome.HIT, Outcome.EXISTED) for o in batch.outcomes]
        written = batch.count(Outcome.HIT)
        full = batch.count(Outcome.FULL)
        errors = batch.count(Outcome.ERROR)
        timeouts = batch.count(Outcome.TIMEOUT)
        self._counters.add(
            writes=written,
            bytes_written=written * layout.payload_size,
            dropped_writes=len(out) - sum(out),
            errors=errors + timeouts + full,
            timeouts=timeouts,
        )
        self._record(errors + timeouts)
        self._evictor.after_writes((len(out) - written) * layout.object_size, written, full, layout.object_size,
                                   settled=lambda: self._index.settled(hashes))
        return out

    def _record(self, failures: int) -> None:
        if failures:
            self._breaker.record_failure()
        else:
            self._breaker.record_success()

    def take_evicted(self) -> list[str]:
        """The pages this instance's capacity eviction removed since the last call
        (``Evictor.take_evicted``)."""
        return self._evictor.take_evicted()

    # -- one page ----------------------------------------------------------------------

    def _read_one(self, layout: PageLayout, h: str, into: memoryview) -> Outcome:
        """Read and verify one page into ``into`` (``file_page_io.read_verified``); never
        raises for store trouble. ``fstat`` runs only for a page not indexed or whose access
        time is not known to be recent (``_touch_read``) and for a corrupt page (to delete
        exactly the file that was read)."""
        path = self._path(h)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return Outcome.MISS
        except OSError as exc:
            log.debug("file store: open %s failed: %s", path, exc)
            return Outcome.ERROR
        try:
            scratch = getattr(self._tls, "scratch", None)
            if scratch is None:
                scratch = self._tls.scratch = new_scratch()
            reason = read_verified(fd, scratch, into, layout, h)
            if reason is None:
                self._touch_read(h, layout.object_size, fd)
                return Outcome.HIT
            st = os.fstat(fd)
        except OSError as exc:
            log.debug("file store: read %s failed: %s", path, exc)
            return Outcome.ERROR
        finally:
            os.close(fd)
        self._discard(h, path, st, f"corrupt page {h} deleted: {reason}")
        return Outcome.CORRUPT

    def _touch_read(self, h: str, size: int, fd: int) -> None:
        """After a verified read of ``h`` on ``fd``: LRU bookkeeping, and keep the file's
        access time within ``ATIME_REFRESH_S`` of the truth so LRU order survives a restart
        on relatime / noatime mounts. Costs no syscall for an indexed page whose atime is
        recent; a page not indexed is added only if the file read is still linked (an
        eviction or delete may have removed it meanwhile: ``file_index``)."""
        now = time.time()
        if not self._index.read(h, now):
            return
        try:
            st = os.fstat(fd)
            if st.st_nlink == 0:
                return
            if now - st.st_atime > ATIME_REFRESH_S:
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        except OSError as exc:  # not our file (a shared store), or read-only: LRU only
            log.debug("file store: cannot refresh the access time of page %s: %s", h, exc)
        self._index.read_unknown(h, size, now)

    def _discard(self, h: str, path: str, st: os.stat_result, why: str) -> None:
        """Delete the object examined as ``st``, unless another writer has replaced it meanwhile."""
        log.warning("file store: %s", why)
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
                self._usage.adjust(-st.st_size, -1)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("file store: cannot delete page %s: %s", h, exc)
            return
        self._index.removed(h)

    def _write_one(self, layout: PageLayout, h: str, page: memoryview) -> Outcome:
        path = self._path(h)
        try:
            whole, st = self._examine(h, layout)
            token = self._writers.token()
        except OSError as exc:
            log.debug("file store: cannot write %s: %s", path, exc)
            return Outcome.ERROR
        if whole:
            return Outcome.EXISTED
        if st is not None:
            self._counters.add(corrupt=1)
            self._discard(h, path, st, f"incomplete object of page {h} ({st.st_size} bytes) written again")
        header = encode_header(layout, page, h)
        shard = f"{self._root_slash}{h[:2]}"
        tmp = tmp_path(shard, h, token, next(self._tmp_seq))
        try:
            fd = self._create(shard, tmp)
            try:
                write_file(fd, header, page, self.settings.fsync)
            finally:
                os.close(fd)
            published, self._hard_links = publish(tmp, path, self._hard_links)
            if self.settings.fsync:
                fsync_dir(shard)
        except OSError as exc:
            remove_quietly(tmp)
            if exc.errno in _FULL_ERRNOS:
                log.debug("file store: no space for page %s: %s", h, exc)
                return Outcome.FULL
            log.debug("file store: write %s failed: %s", path, exc)
            return Outcome.ERROR
        if not published:
            return Outcome.EXISTED
        self._index.published(h, layout.object_size, time.time())
        return Outcome.HIT

    def _create(self, shard: str, tmp: str) -> int:
        """Open a new temporary file in ``shard``, making the shard (durably with ``fsync``)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            make_dirs(shard, self.settings.fsync)
            self._durable_shards.add(shard)
            fd = os.open(tmp, flags, 0o644)
        if self.settings.fsync and shard not in self._durable_shards:
            # Made by another process, which may not have made its entry durable.
            try:
                fsync_dir(self.root)
            except OSError:
                os.close(fd)
                raise
            self._durable_shards.add(shard)
        return fd

    # -- store-wide -----------------------------------------------------------------

    def _list_shard(self, shard: str) -> list[tuple[str, str]]:
        entries = list_shard(self.root, shard)
        if entries is None:
            self._counters.add(errors=1)
            return []
        return entries

    def _probe(self) -> bool:
        return probe(self.root)

    def _on_breaker_change(self, up: bool) -> None:
        if not up:
            self._counters.add(trips=1)

