"""L2 <-> L3 operations for the cache controller: backup, existence query, fetch, admin.

Pages move between the store and L2 *in place*: a backup hands the store memoryviews of
the L2 pages, a fetch reads into them. Only paged components (full, swa) go to L3.

Store trouble never raises out of here: the backends already turn it into misses and
dropped writes. With no store attached every op is a counted no-op (0 hits, 0 pages).

Thread-safety: ``backup``, ``query`` and ``fetch`` may run on several worker threads at
once (the backends are thread-safe); ``attach`` / ``detach`` / ``clear`` are called by the
controller's main loop only while no L3 op is running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicache.memory.pools import SharedPools
from storage_backends import PageLayout, StorageBackend, StoreUsage, create_backend
from storage_backends.keys import is_page_hash

log = logging.getLogger(__name__)

PAGED_LAYOUT_ID = 1
"""Layout id of ``[layers, 2, page_size, kv_heads, head_dim]`` pages (the L2 page layout)."""


@dataclass
class StorageCounters:
    backup_pages: int = 0
    backup_skipped: int = 0
    backup_failed: int = 0
    fetch_pages: int = 0
    fetch_missed: int = 0
    query_hits: int = 0
    noop_ops: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class StorageIO:
    def __init__(self, pools: SharedPools, backend: StorageBackend | None, backend_name: str = "none") -> None:
        self.pools = pools
        self.backend = backend
        self.backend_name = backend_name if backend is not None else "none"
        self.counters = StorageCounters()

    def layout_for(self, component: str) -> PageLayout:
        comp = self.pools[component].layout
        return PageLayout(PAGED_LAYOUT_ID, comp.dtype, comp.l2_page_shape)

    def check(self, component: str, host_pages: list[int] | None, hashes: list[str]) -> None:
        """Raise ValueError if the op's component, pages, hashes or lengths are wrong."""
        if component not in self.pools.components:
            raise ValueError(f"unknown component {component!r}")
        if self.pools[component].layout.kind != "paged":
            raise ValueError(f"component {component!r} is not stored in L3")
        bad = next((h for h in hashes if not is_page_hash(h)), None)
        if bad is not None:
            raise ValueError(f"not a page hash (64 lowercase hex characters): {bad!r:.80}")
        if host_pages is not None:
            if len(host_pages) != len(hashes):
                raise ValueError(f"{len(hashes)} hashes but {len(host_pages)} host pages")
            problem = self.pools[component].pages_problem("l2", host_pages)
            if problem:
                raise ValueError(problem)

    def backup(self, component: str, host_pages: list[int], hashes: list[str],
               cancelled: Callable[[], bool] = lambda: False) -> int:
        """Write L2 pages to L3 under their hashes; returns how many pages L3 holds afterwards
        (counted as a prefix). Pages L3 already holds at the start of the chain are skipped."""
        backend = self.backend
        if backend is None:
            self.counters.noop_ops += 1
            return 0
        present = backend.batch_exists(hashes)
        self.counters.backup_skipped += present
        if present == len(hashes) or cancelled():
            return present
        comp = self.pools[component]
        todo_hashes = hashes[present:]
        views = [comp.host_page_view(p) for p in host_pages[present:]]
        ok = backend.batch_set(todo_hashes, views)
        done = present
        for good in ok:
            if not good:
                break
            done += 1
        written = sum(ok)
        self.counters.backup_pages += written
        self.counters.backup_failed += len(ok) - written
        self.counters.bytes_written += written * comp.layout.l2_page_bytes
        return done

    def query(self, hashes: list[str]) -> int:
        """How many consecutive pages of this chain L3 holds (0 with no store)."""
        if self.backend is None:
            self.counters.noop_ops += 1
            return 0
        n = self.backend.batch_exists(hashes)
        self.counters.query_hits += n
        return n

    def fetch(self, component: str, hashes: list[str], host_pages: list[int]) -> int:
        """Read pages into L2; returns how many *leading* pages arrived verified."""
        if self.backend is None:
            self.counters.noop_ops += 1
            return 0
        comp = self.pools[component]
        views = [comp.host_page_view(p) for p in host_pages]
        ok = self.backend.batch_get(hashes, views)
        done = 0
        for good in ok:
            if not good:
                break
            done += 1
        self.counters.fetch_pages += done
        self.counters.fetch_missed += len(hashes) - done
        self.counters.bytes_read += done * comp.layout.l2_page_bytes
        return done

    # -- administration (main loop only, no L3 op running) ---------------------------

    def status(self) -> tuple[bool, dict[str, Any]]:
        if self.backend is None:
            return False, {"attached": False, **vars(self.counters)}
        stats = self.backend.stats()
        stats_dict = stats.as_dict() if hasattr(stats, "as_dict") else dict(vars(stats))
        up = bool(stats_dict.get("up", True))
        return up, {"attached": True, **stats_dict, **{f"controller_{k}": v for k, v in vars(self.counters).items()
                                                       if k != "extra"}}

    def size(self) -> StoreUsage | None:
        """What the store holds, where its backend can tell cheaply (``StorageBackend.size``);
        None with no store attached or a backend that cannot tell (Redis). Never raises."""
        backend = self.backend
        if backend is None:
            return None
        try:
            return backend.size()
        except Exception:  # a size is a nicety: never let it stop the controller's loop
            log.exception("the L3 backend could not tell its size")
            return None

    def attach(self, settings: Any) -> None:
        """Replace the store; raises (StorageError / StorageConfigError) if the new one cannot start."""
        component = next((c.name for c in self.pools.layout.components if c.kind == "paged"), None)
        if component is None:
            raise ValueError("no paged component to store in L3")
        backend = create_backend(settings, self.layout_for(component))
        self.detach()
        self.backend = backend
        self.backend_name = settings.kind

    def detach(self) -> None:
        if self.backend is not None:
            try:
                self.backend.close()
            finally:
                self.backend = None
                self.backend_name = "none"

    def clear(self) -> None:
        if self.backend is not None:
            self.backend.clear()
