"""A file store process's LRU view of the pages it knows (docs/architecture.md §7).

The index picks eviction victims; it does not decide how full the store is (the shared
``file_usage.UsageRecord`` does). It holds ``hash -> (bytes, access time known)``, least
recently used first: every page the last scan found, and those this process wrote or read
since. It follows the files:

===============================  ==============================================================
event                            index
===============================  ==============================================================
this process published a page    added (most recent)
a verified read                  moved to the end; added only if the file read is still linked
                                 and no eviction has chosen it (``doomed``)
eviction chose a page            taken out and ``doomed`` until its unlink is done: a read
                                 finishing meanwhile does not bring it back
an unlink that failed            put back (the file is still there)
a page removed by this process   taken out; while a scan runs, remembered, so that the scan's
                                 merge does not bring it back (and its measurement leaves out
                                 what this process removed or published meanwhile: the shared
                                 record counted those already)
a batch of writes                in flight from its reservation in the shared record
                                 (``writing``) until the record counted its pages (``settled``);
                                 both are called under the record's lock
a scan's merge                   what it found (oldest first), less what was removed while it
                                 ran, then what this process touched since (more recent)
===============================  ==============================================================

A scan's measurement leaves out what the shared record counts apart from it
(``file_housekeeping``): the pages and bytes of those this process removed while it ran;
the pages of those the record counts as published after the scan's reading of it
(published while it runs, or in flight when it began); the bytes of those reserved after
that reading (published while it runs, not in flight when it began). ``scan_started`` runs
under the record's lock at the scan's reading, so a batch's reservation and its count each
fall either before both or after both. (Without the batches in flight, a page published
just before a scan and counted just after it was counted twice: found, and counted as a
write made while the scan ran.)

Pages other processes write are not in it until a scan or a read finds them.

Lock: one lock (``storage_backends.locks.ForkSafeLock``) guards everything here; it is never held across I/O.
``writing``, ``settled`` and ``scan_started`` are called with the shared record's lock held (lock order:
record, then index; nothing here calls out).
"""

from __future__ import annotations

from collections import OrderedDict

from storage_backends.locks import ForkSafeLock

ATIME_REFRESH_S = 3600.0
"""A read refreshes a page file's access time at most this often (``FileBackend._touch_read``)."""


class PageIndex:
    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._pages: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._doomed: set[str] = set()
        self._removed_in_scan: set[str] | None = None  # while a scan runs
        self._published_in_scan: set[str] = set()
        self._in_flight: set[str] = set()  # batches reserved, not yet counted (module doc)
        self._in_flight_at_scan: set[str] = set()

    def after_fork(self) -> None:
        """In a forked child: no batch in flight (its threads stayed in the parent; the lock is
        free again already: ``storage_backends.locks``)."""
        self._in_flight = set()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, h: object) -> bool:
        return h in self._pages

    def published(self, h: str, size: int, now: float) -> None:
        """This process put a new file under ``h``."""
        with self._lock:
            self._pages[h] = (size, now)
            self._pages.move_to_end(h)
            if self._removed_in_scan is not None:
                self._published_in_scan.add(h)

    def writing(self, hashes: list[str]) -> None:
        """The shared record reserved a batch of writes of ``hashes`` (under its lock)."""
        with self._lock:
            self._in_flight.update(hashes)

    def settled(self, hashes: list[str]) -> None:
        """The shared record counted the batch of writes of ``hashes`` (under its lock)."""
        with self._lock:
            self._in_flight.difference_update(hashes)

    def read(self, h: str, now: float) -> bool:
        """A verified read of ``h``: mark it most recent. True when the caller should look
        at the file (``fstat``) and then call ``read_unknown`` or refresh its access time:
        the page is not indexed, or its known access time is older than ``ATIME_REFRESH_S``."""
        with self._lock:
            old = self._pages.get(h)
            if old is None:
                return h not in self._doomed
            self._pages.move_to_end(h)
            if now - old[1] <= ATIME_REFRESH_S:
                return False
            self._pages[h] = (old[0], now)
            return True

    def read_unknown(self, h: str, size: int, now: float) -> None:
        """Add ``h``, read verified from a file that was still linked after the read, unless
        an eviction chose it meanwhile or it is indexed already."""
        with self._lock:
            if h not in self._doomed and h not in self._pages:
                self._pages[h] = (size, now)

    def removed(self, h: str) -> None:
        """This process removed ``h``'s file (or found it gone)."""
        with self._lock:
            self._pages.pop(h, None)
            if self._removed_in_scan is not None:
                self._removed_in_scan.add(h)

    def take_victims(self, nbytes: int) -> list[tuple[str, int]]:
        """Least recently used pages of at least ``nbytes`` in all (fewer when the index has
        no more), taken out and doomed until ``victims_done``."""
        out: list[tuple[str, int]] = []
        freed = 0
        with self._lock:
            while freed < nbytes and self._pages:
                h, (size, _atime) = self._pages.popitem(last=False)
                out.append((h, size))
                freed += size
                self._doomed.add(h)
                if self._removed_in_scan is not None:
                    self._removed_in_scan.add(h)
        return out

    def victims_done(self, victims: list[tuple[str, int]], kept: list[tuple[str, int]]) -> None:
        """The unlinks of ``victims`` are done; ``kept`` (a subset) failed and stay, oldest."""
        with self._lock:
            for h, _size in victims:
                self._doomed.discard(h)
            for h, size in reversed(kept):
                if self._removed_in_scan is not None:
                    self._removed_in_scan.discard(h)
                if h not in self._pages:
                    self._pages[h] = (size, 0.0)
                    self._pages.move_to_end(h, last=False)

    def scan_started(self) -> None:
        """A scan read the shared record (called under its lock): from now on remember what
        this process removes and publishes, and which batches were in flight (module doc)."""
        with self._lock:
            self._removed_in_scan = set()
            self._published_in_scan = set()
            self._in_flight_at_scan = set(self._in_flight)

    def scan_found(self, found: list[tuple[float, str, int]] | None) -> tuple[set[str], set[str]]:
        """Merge what a scan found (``(atime, hash, bytes)``, oldest first; None: the scan
        failed, keep the index as it is) and stop remembering. Returns the pages whose count
        and those whose bytes the record keeps apart from the scan (module doc)."""
        with self._lock:
            gone, self._removed_in_scan = self._removed_in_scan or set(), None
            published, self._published_in_scan = self._published_in_scan, set()
            in_flight, self._in_flight_at_scan = self._in_flight_at_scan, set()
            counted = gone | published | in_flight
            reserved = gone | (published - in_flight)
            if found is None:
                return counted, reserved
            merged: OrderedDict[str, tuple[int, float]] = OrderedDict(
                (h, (size, atime)) for atime, h, size in found if h not in gone and h not in self._doomed)
            for h, known in self._pages.items():  # touched since the scan began: more recent
                merged.pop(h, None)
                merged[h] = known
            self._pages = merged
        return counted, reserved

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
