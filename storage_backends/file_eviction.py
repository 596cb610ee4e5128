"""The file store's capacity eviction (docs/architecture.md §7).

``Evictor`` keeps one ``FileBackend``'s store under ``max_size_gb`` (the whole directory,
whatever number of processes share it) and makes room on a full disk:

==========================  ==================================================================
after a batch of writes      ``after_writes``: ``UsageRecord.settle`` gives back what was not
                             published and claims what is above the cap, down to ``low_water``
                             of it, or what the writes that found no space (``ENOSPC``) need:
                             their bytes, at most ``1 - low_water`` of the cap (of the store,
                             without a cap) per batch, so that one full disk never empties it
``gc(target)``               claims what is above ``target``
a claim                      ``evict``: unlinks the least recently used pages of this process's
                             ``file_index.PageIndex``, gives the record back what was not freed;
                             when the index ran out first (other processes' pages hold the
                             store) it asks the housekeeper for a scan
==========================  ==================================================================

The evicted hashes wait for ``take_evicted``. Lock: one ``ForkSafeLock`` around that list,
never held across I/O (the index and the record have their own). The record and the lock
are per process: the backend calls ``after_fork`` in a forked child.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable

from storage_backends.file_index import PageIndex
from storage_backends.file_layout import page_path
from storage_backends.file_usage import UsageRecord
from storage_backends.locks import ForkSafeLock
from storage_backends.settings import FileSettings
from storage_backends.stats import StatsCounter

log = logging.getLogger(__name__)

MAX_EVICTED_KEPT = 100_000
"""Evicted hashes kept for ``take_evicted`` at most (older ones are dropped untold)."""
PROGRESS_EVERY = 4096


class Evictor:
    def __init__(self, settings: FileSettings, root_slash: str, index: PageIndex, usage: UsageRecord,
                 counters: StatsCounter, want_scan: Callable[[], None]) -> None:
        self._max_bytes = settings.max_bytes
        self._low_bytes = int(self._max_bytes * settings.low_water)
        self._low_water = settings.low_water
        self._root_slash = root_slash
        self._index = index
        self._usage = usage
        self._counters = counters
        self._want_scan = want_scan
        self._evicted: deque[str] = deque(maxlen=MAX_EVICTED_KEPT)  # not yet taken; under _lock
        self._lock = ForkSafeLock()

    def after_fork(self, usage: UsageRecord) -> None:
        """In a forked child: its own record (the lock is free again already:
        ``storage_backends.locks``)."""
        self._usage = usage

    def after_writes(self, unused_bytes: int, written: int, full: int, object_size: int,
                     settled: Callable[[], None] | None = None) -> None:
        """Settle a batch of writes (``written`` published, ``unused_bytes`` of its reservation
        not used, ``full`` failed for lack of space; ``settled`` runs under the record's lock
        once they are counted) and evict what that claims."""
        claim = self._usage.settle(unused_bytes, written, self._max_bytes, self._low_bytes,
                                   self._full_disk_need(full, object_size), then=settled)
        if claim:
            self.evict(claim)

    def _full_disk_need(self, failed: int, object_size: int) -> int:
        """What ``failed`` writes that found no space need evicted: their bytes, at most
        ``1 - low_water`` of the cap (of the store without one), at least one page."""
        if not failed:
            return 0
        base = self._max_bytes or self._usage.read().bytes
        step = max(object_size, int((1 - self._low_water) * base))
        return min(failed * object_size, step)

    def gc(self, target_bytes: int, progress: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Evict until the store holds at most ``target_bytes``: (pages, bytes) removed;
        ``progress`` as ``evict``'s."""
        claim = self._usage.claim_above(target_bytes)
        return self.evict(claim, progress) if claim else (0, 0)

    def evict(self, claim: int, progress: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Unlink least recently used pages for the ``claim`` taken off the record; give the
        record back what was not freed. ``progress`` is told the pages removed so far every
        ``PROGRESS_EVERY`` unlinks. Returns (pages, bytes) this process removed."""
        victims = self._index.take_victims(claim)
        freed = pages = 0
        gone: list[str] = []
        kept: list[tuple[str, int]] = []
        for i, (h, size) in enumerate(victims):
            if progress is not None and i % PROGRESS_EVERY == 0 and i:
                progress(pages)
            try:
                os.unlink(page_path(self._root_slash, h))
            except FileNotFoundError:
                gone.append(h)  # another process removed it (and counted it out): gone all the same
            except OSError as exc:
                kept.append((h, size))
                self._counters.add(errors=1)
                log.warning("file store: cannot evict page %s: %s", h, exc)
            else:
                gone.append(h)
                pages += 1
                freed += size
        self._index.victims_done(victims, kept)
        self._usage.adjust(claim - freed, -pages)
        if freed < claim and len(self._index) == 0:
            self._want_scan()
        if victims:
            self._counters.add(evictions=pages)
            log.debug("file store: evicted %d pages (%d bytes)", pages, freed)
        if gone:
            with self._lock:
                self._evicted.extend(gone)
        if progress is not None:
            progress(pages)
        return pages, freed

    def take_evicted(self) -> list[str]:
        """The pages ``evict`` removed since the last call (at most the last
        ``MAX_EVICTED_KEPT``; another process's evictions in a shared store are not seen)."""
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
        return out
