"""The one interface every L3 backend implements (docs/architecture.md §7).

Contract, common to all backends:

- Keys are page hashes (64 lowercase hex characters). A malformed hash is a programming
  error and raises ``InvalidPageHash``; a buffer of the wrong size raises ``ValueError``.
  Those are the only exceptions the data-path methods raise.
- **Store trouble never raises.** A store that is down, slow, full, or returns a corrupt
  object makes reads misses and writes ``False``; every such event is counted in
  ``stats()``. A corrupt object (any header field different from the backend's
  ``PageLayout``, a wrong length, a bad checksum) is a miss, counts in ``corrupt`` and is
  deleted.
- **Buffers.** ``batch_get`` writes each payload into the caller's buffer ``into[i]``,
  which the caller owns and which must be exactly ``layout.payload_size`` bytes and
  writable. Where the result is ``False`` the buffer's contents are unspecified (it may hold
  partial or rejected bytes); the caller must not use them. ``batch_set`` only reads the
  caller's pages during the call and keeps no reference afterwards.
- **Concurrency.** Every method may be called from several threads at once, and several
  processes may share one store: a reader sees either a whole page written by one writer
  or nothing, never a torn or mixed page.
- **Processes.** A backend notices when it is used in a new process (after ``fork``) and
  rebuilds its clients, pools and threads there. Build it after spawn where possible.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from storage_backends.keys import check_hashes
from storage_backends.page_format import PageLayout
from storage_backends.stats import StorageStats

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class StoreUsage:
    """What a store holds: its pages, and the bytes of its objects and of its temporary
    files (a file store's writes in progress and leftovers not yet reclaimed), of which
    ``temp_files`` files (0 where a backend has none or does not tell)."""

    pages: int
    bytes: int
    temp_files: int = 0


class StorageBackend(ABC):
    """An L3 store of page objects, keyed by page hash."""

    kind: str = "abstract"

    def __init__(self, layout: PageLayout | None) -> None:
        self.layout = layout

    # -- data path ------------------------------------------------------------------

    @abstractmethod
    def batch_exists(self, hashes: Sequence[str]) -> int:
        """How many pages, counted from ``hashes[0]``, exist consecutively.

        Returns ``k`` such that ``hashes[:k]`` all exist and ``hashes[k]`` (if any) does not.
        Existence is not verification: a later ``batch_get`` may still find a page corrupt.
        A store that is down answers 0.
        """

    def exists_each(self, hashes: Sequence[str]) -> list[bool]:
        """Whether each page exists, independently of the others (a store that is down
        answers all False). Backends override this with one batched round trip."""
        return [self.batch_exists([h]) == 1 for h in check_hashes(hashes)]

    @abstractmethod
    def batch_get(self, hashes: Sequence[str], into: Sequence[memoryview],
                  layout: PageLayout | None = None) -> list[bool]:
        """Read page ``hashes[i]`` into ``into[i]``; result ``i`` is True iff it was a verified hit.

        ``layout``: what the objects must look like (default: the backend's own). One store
        holds the objects of several layouts (one per cache component); an object read
        under a layout its header does not match is corrupt, counted and deleted."""

    @abstractmethod
    def batch_set(self, hashes: Sequence[str], pages: Sequence[Buffer],
                  layout: PageLayout | None = None) -> list[bool]:
        """Store ``pages[i]`` under ``hashes[i]``; result ``i`` is True iff the page is stored.

        A page that already exists counts as stored (content under a hash never changes).
        Each page must be exactly ``layout.payload_size`` bytes (``layout``: as in
        ``batch_get``).
        """

    @abstractmethod
    def delete(self, hashes: Sequence[str]) -> int:
        """Remove these pages if present; return how many were removed (0 when down)."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every page of this store (only this store's keys/files); return how many."""

    @abstractmethod
    def stats(self) -> StorageStats:
        """A snapshot of the counters and the up/down state."""

    @abstractmethod
    def health(self) -> bool:
        """Ask the store now (bounded by the timeout) whether it answers; never raises."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close connections. Idempotent; the backend is unusable after."""

    def take_evicted(self) -> list[str]:
        """The pages this backend removed on its own (its capacity eviction) since the last
        call, oldest first; the caller owns the list. ``[]`` where the backend evicts nothing
        itself or cannot tell (the default, and Redis: its ``maxmemory`` evictions happen
        in the server). Never raises."""
        return []

    # -- administration (``hicache storage``) ---------------------------------------

    @abstractmethod
    def iter_hashes(self) -> Iterator[str]:
        """Every page hash in the store (a scan; may miss pages written during it). May raise
        ``StorageError``: this is a tool path, not the data path."""

    @abstractmethod
    def read_object(self, h: str) -> bytes | None:
        """The raw stored object (header + payload) or None if absent. May raise ``StorageError``."""

    @abstractmethod
    def usage(self) -> StoreUsage:
        """Count pages and bytes by scanning. May raise ``StorageError``."""

    def size(self) -> StoreUsage | None:
        """What the store holds, if the backend knows it without asking the store (cheap
        enough to call every second, never raises); None where it cannot tell (the default,
        and Redis: its key count is not per prefix, and a scan is too costly)."""
        return None

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_targets(self, hashes: Sequence[str], into: Sequence[Buffer],
                      layout: PageLayout | None = None) -> tuple[list[str], list[memoryview]]:
        """Validate a ``batch_get``: the hashes, and one writable, contiguous buffer of exactly
        the page size per hash; returns the hashes and flat byte views of the buffers."""
        layout = layout or self._require_layout()
        checked = check_hashes(hashes)
        if len(into) != len(checked):
            raise ValueError(f"{len(checked)} hashes but {len(into)} buffers")
        views = []
        for buf in into:
            mv = memoryview(buf)
            if mv.readonly or mv.nbytes != layout.payload_size or not mv.contiguous:
                raise ValueError(
                    f"each buffer must be writable, contiguous and {layout.payload_size} bytes; got {mv.nbytes}"
                )
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
        return checked, views

    def _write_sources(self, hashes: Sequence[str], pages: Sequence[Buffer],
                       layout: PageLayout | None = None) -> tuple[list[str], list[memoryview]]:
        """Validate a ``batch_set``: the hashes, and one contiguous page of exactly the page
        size per hash; returns the hashes and flat byte views of the pages (read only)."""
        layout = layout or self._require_layout()
        checked = check_hashes(hashes)
        if len(pages) != len(checked):
            raise ValueError(f"{len(checked)} hashes but {len(pages)} pages")
        views = []
        for page in pages:
            mv = memoryview(page)
            if mv.nbytes != layout.payload_size or not mv.contiguous:
                raise ValueError(f"each page must be contiguous and {layout.payload_size} bytes; got {mv.nbytes}")
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
        return checked, views

    def _require_layout(self) -> PageLayout:
        if self.layout is None:
            raise ValueError(f"{type(self).__name__} was built without a PageLayout (administration only)")
        return self.layout
