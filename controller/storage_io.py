"""L2 <-> L3 operations for the cache controller: backup, existence query, fetch, admin.

Pages move between the store and L2 *in place*: a backup hands the store memoryviews of
the L2 pages, a fetch reads into them. Every component with L2 goes to L3, each under
its own keys and layout: Full and SWA KV one object per page (``PAGED_LAYOUT_ID``), a
Mamba state one object per state (``STATE_LAYOUT_ID``: the slot's bytes of each of the
component's L2 tensors, in pool order; staged through one buffer, as they are separate
byte ranges). An auxiliary object is written and read on its own (``backup_aux``,
``query_aux``, ``fetch_aux``): its absence or a refused (corrupt, mismatched) object only
shortens what the scheduler can match, never gives it other data.

An index-only component (paged, pages of zero bytes: the Full component of a model without
full-attention layers, ``MappedComponent.holds_bytes`` False) has nothing to store, but its
page hashes are the chain a prefetch counts (``query``) and the auxiliary keys derive from.
Each of its pages goes to L3 as an *index marker* under the page hash (``INDEX_LAYOUT_ID``:
dtype ``uint8``, shape ``(1,)``, payload ``INDEX_MARKER``): ``backup`` writes a marker per
page, ``fetch`` reads each into a scratch byte (the L2 page has no bytes to read into) and
counts a page only when its marker arrived verified and equal to ``INDEX_MARKER``. The
model's KV goes as its auxiliary SWA (and Mamba) objects, as for any hybrid model.

The backend's default layout (``create_backend(settings, layout)``) is
``default_layout()``, the layout of the objects ``backup`` and ``fetch`` move; every op
also passes its component's layout explicitly, so an object of another layout (a marker
read as a KV page, or the reverse) is refused, counted as corrupt and deleted.

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

from controller.transfer import repeated_destination
from hicache.memory.pools import SharedPools
from storage_backends import PageLayout, StorageBackend, StoreUsage, create_backend
from storage_backends.keys import is_page_hash

log = logging.getLogger(__name__)

PAGED_LAYOUT_ID = 1
"""Layout id of ``[layers, 2, page_size, kv_heads, head_dim]`` pages (the L2 page layout)."""

STATE_LAYOUT_ID = 2
"""Layout id of a state object: one L2 state slot of every tensor of the component
(``[layers, *shape]`` each), concatenated in pool order; its shape is the element count."""

INDEX_LAYOUT_ID = 3
"""Layout id of an index marker: the object of one page of an index-only component (dtype
``uint8``, shape ``(1,)``, payload ``INDEX_MARKER``; module doc)."""

INDEX_MARKER = b"\0"
"""The payload of an index marker."""


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
    """The controller's L3 store: ``backend``, the shared store, and ``partitions``, each quota
    tenant's own store (``hicache.storage_settings.tenant_partitions``). Every op names its
    ``tenant`` ("" for the shared store); a tenant without a partition uses the shared one."""

    def __init__(self, pools: SharedPools, backend: StorageBackend | None, backend_name: str = "none") -> None:
        self.pools = pools
        self.backend = backend
        self.backend_name = backend_name if backend is not None else "none"
        self.partitions: dict[str, StorageBackend] = {}  # set by ``attach``
        self._caps: dict[str, int] = {}  # each partition's cap in bytes (``attach``)
        self.counters = StorageCounters()
        self._layouts: dict[str, PageLayout] = {}

    def layout_for(self, component: str) -> PageLayout:
        """The layout of ``component``'s L3 objects: a KV page, an index marker (a paged
        component of zero-byte pages) or a state."""
        mapped = self.pools[component]
        comp = mapped.layout
        if comp.kind == "paged":
            if not mapped.holds_bytes:
                return PageLayout(INDEX_LAYOUT_ID, "uint8", (len(INDEX_MARKER),))
            return PageLayout(PAGED_LAYOUT_ID, comp.dtype, comp.l2_page_shape)
        itemsize = mapped.l2[0].element_size() if mapped.l2 else 1
        return PageLayout(STATE_LAYOUT_ID, comp.dtype, (comp.l2_page_bytes // itemsize,))

    def default_layout(self) -> PageLayout:
        """The layout a backend for these pools is built with: that of the first paged
        component (``full``), whose pages ``backup`` / ``fetch`` move under their hashes.
        Raises ValueError when there is no paged component."""
        component = next((c.name for c in self.pools.layout.components if c.kind == "paged"), None)
        if component is None:
            raise ValueError("no paged component to store in L3")
        return self.layout_for(component)

    def _layout(self, component: str) -> PageLayout:
        lay = self._layouts.get(component)
        if lay is None:
            lay = self._layouts[component] = self.layout_for(component)
        return lay

    def _unit_views(self, component: str, unit: int) -> list[memoryview]:
        """The bytes of L2 unit ``unit`` of ``component``, in place: one view for a page,
        one per tensor for a state slot."""
        comp = self.pools[component]
        if comp.layout.kind == "paged":
            return [comp.host_page_view(unit)]
        out = []
        for seg, t in zip(comp.l2_segments, comp.l2, strict=True):
            size = t[0].numel() * t.element_size()
            out.append(memoryview(seg.buffer)[unit * size:(unit + 1) * size])
        return out

    def check_aux(self, aux_keys: dict[str, list[str]], aux_pages: dict[str, list[int]] | None,
                  into_l2: bool = False) -> None:
        """Raise ValueError if an op's auxiliary components, keys, units or lengths are wrong
        (``into_l2``: the op writes the units, so none may appear twice)."""
        if aux_pages is not None and aux_pages.keys() != aux_keys.keys():
            raise ValueError(f"auxiliary components differ: keys {sorted(aux_keys)} vs pages {sorted(aux_pages)}")
        for name, keys in aux_keys.items():
            if name not in self.pools.components:
                raise ValueError(f"unknown component {name!r}")
            if not self.pools[name].layout.l2_pages:
                raise ValueError(f"component {name!r} has no L2 pool")
            bad = next((h for h in keys if not is_page_hash(h)), None)
            if bad is not None:
                raise ValueError(f"{name}: not a key (64 lowercase hex characters): {bad!r:.80}")
            if aux_pages is not None:
                units = aux_pages[name]
                if len(units) != len(keys):
                    raise ValueError(f"{name}: {len(keys)} keys but {len(units)} host pages")
                problem = self.pools[name].pages_problem("l2", units) or (
                    repeated_destination(name, units) if into_l2 else None)
                if problem:
                    raise ValueError(problem)

    def check(self, component: str, host_pages: list[int] | None, hashes: list[str], into_l2: bool = False) -> None:
        """Raise ValueError if the op's component, pages, hashes or lengths are wrong
        (``into_l2``: the op writes ``host_pages``, so none may appear twice)."""
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
            problem = self.pools[component].pages_problem("l2", host_pages) or (
                repeated_destination(component, host_pages) if into_l2 else None)
            if problem:
                raise ValueError(problem)

    def _store(self, tenant: str) -> StorageBackend | None:
        """The store of ``tenant``'s pages: its partition, else the shared store."""
        if tenant and self.backend is not None:
            return self.partitions.get(tenant, self.backend)
        return self.backend

    def backup(self, component: str, host_pages: list[int], hashes: list[str],
               cancelled: Callable[[], bool] = lambda: False, tenant: str = "") -> int:
        """Write L2 pages to L3 under their hashes; returns how many pages L3 holds afterwards
        (counted as a prefix). Pages L3 already holds at the start of the chain are skipped."""
        backend = self._store(tenant)
        if backend is None:
            self.counters.noop_ops += 1
            return 0
        present = backend.batch_exists(hashes)
        self.counters.backup_skipped += present
        if present == len(hashes) or cancelled():
            return present
        comp = self.pools[component]
        layout = self._layout(component)
        todo_hashes = hashes[present:]
        pages: list[memoryview | bytes]
        if comp.holds_bytes:
            pages = [comp.host_page_view(p) for p in host_pages[present:]]
        else:  # index-only: one marker per page (module doc)
            pages = [INDEX_MARKER] * len(todo_hashes)
        ok = backend.batch_set(todo_hashes, pages, layout)
        done = present
        for good in ok:
            if not good:
                break
            done += 1
        written = sum(ok)
        self.counters.backup_pages += written
        self.counters.backup_failed += len(ok) - written
        self.counters.bytes_written += written * layout.payload_size
        return done

    def backup_aux(self, component: str, units: list[int], keys: list[str], tenant: str = "") -> int:
        """Write auxiliary objects (each on its own) unless L3 has them; returns how many
        L3 holds afterwards."""
        backend = self._store(tenant)
        if backend is None or not keys:
            return 0
        present = backend.exists_each(keys)
        todo = [i for i, p in enumerate(present) if not p]
        self.counters.backup_skipped += len(keys) - len(todo)
        if not todo:
            return len(keys)
        layout = self._layout(component)
        pages: list[memoryview | bytes] = []
        for i in todo:
            views = self._unit_views(component, units[i])
            pages.append(views[0] if len(views) == 1 else b"".join(views))
        ok = backend.batch_set([keys[i] for i in todo], pages, layout)
        written = sum(ok)
        self.counters.backup_pages += written
        self.counters.backup_failed += len(ok) - written
        self.counters.bytes_written += written * layout.payload_size
        return len(keys) - len(todo) + written

    def query_aux(self, keys: list[str], tenant: str = "") -> list[bool]:
        """Which auxiliary objects L3 holds (each on its own; all False with no store)."""
        backend = self._store(tenant)
        if backend is None or not keys:
            return [False] * len(keys)
        return backend.exists_each(keys)

    def fetch_aux(self, component: str, keys: list[str], units: list[int], tenant: str = "") -> list[bool]:
        """Read auxiliary objects into L2 units; ``[i]`` is True iff object ``i`` arrived
        verified (a state is copied into its slot only then)."""
        backend = self._store(tenant)
        if backend is None or not keys:
            return [False] * len(keys)
        layout = self._layout(component)
        if self.pools[component].layout.kind == "paged":
            ok = backend.batch_get(keys, [self._unit_views(component, u)[0] for u in units], layout)
        else:
            staging = [bytearray(layout.payload_size) for _ in keys]
            ok = backend.batch_get(keys, [memoryview(b) for b in staging], layout)
            for good, buf, unit in zip(ok, staging, units, strict=True):
                if good:
                    off = 0
                    for view in self._unit_views(component, unit):
                        view[:] = buf[off:off + view.nbytes]
                        off += view.nbytes
        got = sum(ok)
        self.counters.fetch_pages += got
        self.counters.fetch_missed += len(keys) - got
        self.counters.bytes_read += got * layout.payload_size
        return ok

    def query(self, hashes: list[str], tenant: str = "") -> int:
        """How many consecutive pages of this chain L3 holds (0 with no store)."""
        backend = self._store(tenant)
        if backend is None:
            self.counters.noop_ops += 1
            return 0
        n = backend.batch_exists(hashes)
        self.counters.query_hits += n
        return n

    def fetch(self, component: str, hashes: list[str], host_pages: list[int], tenant: str = "") -> int:
        """Read pages into L2; returns how many *leading* pages arrived verified (for an
        index-only component: whose markers arrived verified, read into scratch bytes)."""
        backend = self._store(tenant)
        if backend is None:
            self.counters.noop_ops += 1
            return 0
        comp = self.pools[component]
        layout = self._layout(component)
        if comp.holds_bytes:
            ok = backend.batch_get(hashes, [comp.host_page_view(p) for p in host_pages], layout)
        else:
            scratch = [bytearray(layout.payload_size) for _ in hashes]
            ok = backend.batch_get(hashes, [memoryview(b) for b in scratch], layout)
            ok = [good and buf == INDEX_MARKER for good, buf in zip(ok, scratch, strict=True)]
        done = 0
        for good in ok:
            if not good:
                break
            done += 1
        self.counters.fetch_pages += done
        self.counters.fetch_missed += len(hashes) - done
        self.counters.bytes_read += done * layout.payload_size
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
        """What the store holds, partitions included, where its backend can tell cheaply
        (``StorageBackend.size``); None with no store attached or a backend that cannot tell
        (Redis). Never raises."""
        if self.backend is None:
            return None
        sizes = [self._size_of(b) for b in (self.backend, *self.partitions.values())]
        if any(u is None for u in sizes):
            return None
        return StoreUsage(sum(u.pages for u in sizes if u is not None), sum(u.bytes for u in sizes if u is not None))

    def partition_sizes(self) -> dict[str, tuple[StoreUsage | None, int]]:
        """Per tenant partition: what it holds (None if it cannot tell) and its cap in bytes."""
        return {t: (self._size_of(b), self._caps.get(t, 0)) for t, b in self.partitions.items()}

    @staticmethod
    def _size_of(backend: StorageBackend) -> StoreUsage | None:
        try:
            return backend.size()
        except Exception:  # a size is a nicety: never let it stop the controller's loop
            log.exception("the L3 backend could not tell its size")
            return None

    def take_evicted(self) -> list[str]:
        """The pages the stores evicted on their own since the last call
        (``StorageBackend.take_evicted``); [] with no store attached. Never raises."""
        out: list[str] = []
        for backend in self._all():
            try:
                out.extend(backend.take_evicted())
            except Exception:  # the events are a view: never let them stop the controller's loop
                log.exception("the L3 backend could not tell what it evicted")
        return out

    def holds_each(self, hashes: list[str]) -> list[bool]:
        """Per page hash, whether a store (the shared one or a partition) holds it now; all
        False with no store, or where a store cannot tell (``EvictionGate`` then tells the
        eviction: the safe way). Never raises."""
        held = [False] * len(hashes)
        for backend in self._all():
            try:
                held = [was or now for was, now in zip(held, backend.exists_each(hashes), strict=True)]
            except Exception:  # a check for the events: never let it stop the controller's loop
                log.exception("the L3 backend could not tell which pages it holds")
        return held

    def _all(self) -> list[StorageBackend]:
        return [] if self.backend is None else [self.backend, *self.partitions.values()]

    def attach(self, settings: Any, quotas_gb: dict[str, float] | None = None) -> None:
        """Replace the store, and its tenants' partitions (``quotas_gb``); raises
        (StorageError / StorageConfigError) if the new one cannot start, leaving the old one."""
        from hicache.storage_settings import tenant_partitions

        shared_settings, part_settings = tenant_partitions(settings, quotas_gb or {})
        layout = self.default_layout()
        built: list[StorageBackend] = []
        try:
            backend = create_backend(shared_settings, layout)
            built.append(backend)
            partitions = {}
            for tenant, ps in part_settings.items():
                partitions[tenant] = create_backend(ps, layout)
                built.append(partitions[tenant])
        except BaseException:
            for b in built:
                b.close()
            raise
        self.detach()
        self.backend = backend
        self.partitions = partitions
        self._caps = {t: int(ps.max_bytes) for t, ps in part_settings.items()}
        self.backend_name = settings.kind

    def detach(self) -> None:
        stores, self.backend, self.partitions, self.backend_name = self._all(), None, {}, "none"
        for backend in stores:
            try:
                backend.close()
            except Exception:  # one store that fails to close must not keep the others open
                log.exception("closing an L3 store failed")

    def clear(self) -> None:
        for backend in self._all():
            backend.clear()
