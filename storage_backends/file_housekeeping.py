"""The file store's housekeeping thread (docs/architecture.md §7).

``Housekeeper`` runs one thread per store (``FileSettings.scan_on_start``): a scan at
start, then every ``maintenance_s`` a look for writers that died (``WriterRegistry``),
and a scan again at once when it finds one, or when an eviction found this process's
index too small (``want_scan``; then at most once per ten scan durations).

A scan (``scan``) walks the directory (``file_layout.walk``): removes the temporary files
of dead writers (and, without a writer token, those older than ``stale_tmp_s``), measures
pages and temporary files into the shared record (``UsageRecord.measured``: the pages this
process removed or published meanwhile left out, what anyone reserved meanwhile added),
rebuilds the index, and evicts if the store is above its cap. A long scan logs its
progress every ``PROGRESS_LOG_S``. The record is then exact but
for other processes' writes and removals during the walk, which it counts once too many
(the safe side: the store then holds a little less than its cap until the next scan).

Threads: ``scan`` runs on the housekeeping thread only; the other methods may be called
from any thread. The thread lives in the process that made the store (a forked child
has none).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from storage_backends.file_index import PageIndex
from storage_backends.file_layout import SHARDS, tmp_token, walk
from storage_backends.file_usage import UsageRecord, WriterRegistry
from storage_backends.settings import FileSettings

log = logging.getLogger(__name__)

PROGRESS_LOG_S = 5.0
"""A scan longer than this logs its progress this often (``Housekeeper.progress`` always has it)."""


class Housekeeper:
    def __init__(self, root: str, settings: FileSettings, index: PageIndex, usage: UsageRecord,
                 writers: WriterRegistry, evict: Callable[[int], object], closed: Callable[[], bool]) -> None:
        self.root = root
        self.settings = settings
        self._index = index
        self._usage = usage
        self._writers = writers
        self._evict = evict
        self._closed = closed
        self.scan_done = threading.Event()
        self.failed_scans = 0
        self._stop = threading.Event()
        self._scan_wanted = False
        self._last_scan = (0.0, 0.0)  # (monotonic end, seconds it took)
        self.progress = (0, 0)
        """The scan in progress, or the last one: (shards listed, pages found)."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="l3-file-maint", daemon=True)
        self._thread.start()

    def after_fork(self) -> None:
        """In a forked child: no maintenance thread runs here (it stayed in the parent), and
        the start-up scan counts as done (a new event: the parent's may have been mid-call)."""
        self._thread = None
        self.scan_done = threading.Event()
        self.scan_done.set()

    def want_scan(self) -> None:
        """An eviction could not free what it claimed: pages this process does not know of
        (other processes') hold the store."""
        self._scan_wanted = True

    def stop(self) -> None:
        """Stop the thread (a scan in progress stops at its next shard) and wait for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(30)

    def _run(self) -> None:
        try:
            self.scan()
        except Exception:  # a bug; the store serves without its index
            log.exception("file store %s: start-up scan failed", self.root)
        finally:
            self.scan_done.set()
        interval = self.settings.maintenance_s
        while not self._stop.wait(interval):
            try:
                end, took = self._last_scan
                due = self._scan_wanted and time.monotonic() - end > max(interval, 10 * took)
                if self._writers.find_dead() or due:
                    self.scan()
            except Exception:
                log.exception("file store %s: housekeeping failed", self.root)

    def _leftover(self, stale_before: float) -> Callable[[str, os.stat_result], bool]:
        """Whether a temporary file is a dead writer's (or, without a token, a stale one)."""
        def leftover(name: str, st: os.stat_result) -> bool:
            token = tmp_token(name)
            return self._writers.is_dead(token) if token is not None else st.st_mtime < stale_before
        return leftover

    def scan(self) -> None:
        """One scan (module doc)."""
        started = time.monotonic()
        self.progress = (0, 0)
        logged = [started]

        def progress(shards: int, pages: int) -> None:
            self.progress = (shards, pages)
            now = time.monotonic()
            if now - logged[0] >= PROGRESS_LOG_S:
                logged[0] = now
                log.info("file store %s: scanning, %d of %d shards, %d pages so far", self.root, shards,
                         len(SHARDS), pages)
        # One instant for both (file_index): a batch is counted either before the reading and
        # found by the walk, or after it and left out of what the walk found.
        since = self._usage.read(then=self._index.scan_started)
        result = None
        try:
            result = walk(self.root, self._leftover(time.time() - self.settings.stale_tmp_s),
                          stop=lambda: self._closed() or self._stop.is_set(), progress=progress)
        finally:
            counted = self._index.scan_found(result.pages if result is not None and result.complete else None)
            self._writers.release_dead()
        if not result.complete:
            self.failed_scans += 1
            log.warning("file store %s: the scan did not finish; the store is measured again later", self.root)
            return
        # What the record counts apart from the walk (file_index): this process's removals,
        # and its writes counted or reserved after the reading.
        pages_apart, bytes_apart = counted
        seen_pages = sum(1 for _atime, h, _size in result.pages if h in pages_apart) if pages_apart else 0
        seen_bytes = sum(size for _atime, h, size in result.pages if h in bytes_apart) if bytes_apart else 0
        usage = self._usage.measured(result.bytes - seen_bytes, len(result.pages) - seen_pages, since)
        took = time.monotonic() - started
        self._last_scan = (time.monotonic(), took)
        self._scan_wanted = False
        log.info("file store %s: %d pages, %.1f MiB found in %.2fs%s", self.root, len(result.pages),
                 result.bytes / 2**20, took,
                 f"; {result.reclaimed} temporary files of dead writers removed" if result.reclaimed else "")
        cap = self.settings.max_bytes
        if cap and usage.bytes > cap:
            claim = self._usage.settle(0, 0, cap, int(cap * self.settings.low_water))
            if claim:
                self._evict(claim)
