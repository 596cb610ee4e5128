"""``hicache bench index``: the radix tree at 10^5 .. 10^7 cached pages.

Index-only: a bare page allocator and no KV bytes, so millions of pages fit in memory. Two
insert patterns, each built up to every size of ``--sizes`` (pages, page size ``--page-size``):

* ``shared``: sequences of a ``--prefix``-page prefix shared by a group (64 groups) plus
  ``--suffix`` pages of their own, one insert each (a long node per sequence);
* ``decode``: a shared prefix plus 8 pages of prompt, then ``--suffix`` inserts of one more
  page each, as a request that caches its KV after every decode step.

Per pattern and size it reports the tree's Python heap per cached page (``tree_bytes``:
``sys.getsizeof`` of the tree's objects; ``--tracemalloc`` cross-checks it with the build's
traced allocations), then, on the tree kept at that size, the median
time of ``match_prefix`` of a recent sequence, ``inc_lock_ref`` + ``dec_lock_ref`` of its
node, one insert of the pattern (a whole sequence, or one decode step), and the ``evict``
that brings the tree back to its size; the longest garbage-collector pause seen during all
of it (``gc.callbacks``; the settles of ``hicache.runtime.gc_guard`` included, its first one at
start, which the process loop makes at startup, not), a full ``gc.collect()``, the exact integrity check and one
idle-check slice (``UnifiedRadixCache.check_integrity_slice``).

Reference runs, measured in the same invocation: ``--legacy`` also builds every tree with
leaf extension off (a node per decode step, as before) and the collector left alone (no
``hicache.runtime.gc_guard`` settling). Figures: bytes per page against the 256 B/page budget; each
operation's time at the largest size against the smallest (flat: ratio <= 1.5); the longest
pause and each other figure against the legacy run.
"""

from __future__ import annotations

import argparse
from array import array
from typing import Any

GROUPS = 64
"""Prefix groups (system prompts) of the workload."""

BYTES_PER_PAGE_GOAL = 256.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="100000,1000000", help="comma-separated cached pages")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--patterns", default="shared,decode", help="shared, decode or both")
    parser.add_argument("--prefix", type=int, default=64, help="pages of the shared prefix")
    parser.add_argument("--suffix", type=int, default=64, help="pages of each sequence's own part")
    parser.add_argument("--ops", type=int, default=300, help="timed operations of each kind")
    parser.add_argument("--legacy", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure with leaf extension and gc settling off (the reference)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also trace the build's allocations (slow: a cross-check of the heap figure)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


class _Workload:
    """Token ids of sequence ``i``, regenerated on demand (no workload held in memory)."""

    def __init__(self, page_size: int, prefix: int, suffix: int, decode: bool) -> None:
        self.ps = page_size
        self.prefix = prefix
        self.own = 8 if decode else suffix  # pages inserted whole after the prefix
        self.steps = suffix if decode else 0  # one-page inserts after that
        self.pages = prefix + self.own + self.steps
        self._base = GROUPS * prefix * page_size

    def tokens(self, i: int) -> array[int]:
        ps = self.ps
        g = i % GROUPS
        head = array("I", range(g * self.prefix * ps, (g + 1) * self.prefix * ps))
        start = self._base + i * (self.pages - self.prefix) * ps
        return head + array("I", range(start, start + (self.pages - self.prefix) * ps))

    def inserts(self, i: int) -> list[int]:
        """Page counts of sequence ``i``'s successive inserts."""
        first = self.prefix + self.own
        return [first] + [first + k for k in range(1, self.steps + 1)]


class _Tree:
    """A cache of one pattern kept near a target size."""

    def __init__(self, wl: _Workload, capacity: int, legacy: bool) -> None:
        from hicache.memory.allocator import PageAllocator
        from hicache.tree.cache import UnifiedRadixCache
        from hicache.tree.components import FullComponent

        self.wl = wl
        self.alloc = PageAllocator(capacity + 4 * wl.pages, checked=False)
        self.cache = UnifiedRadixCache([FullComponent(self.alloc)], wl.ps)
        self.cache.extend_leaves = not legacy
        self.next = 0

    def add_sequence(self, timings: list[float] | None = None) -> None:
        """Insert the next sequence, step by step (``timings``: each insert's seconds)."""
        import time

        cache, alloc, ps = self.cache, self.alloc, self.wl.ps
        seq = self.wl.tokens(self.next)
        self.next += 1
        m = cache.match_prefix(seq)
        have = len(m.device_indices)
        pages = m.device_indices
        prev = m.device_len
        for npages in self.wl.inserts(self.next - 1):
            new = alloc.alloc(npages - len(pages))
            assert new is not None
            pages = pages + new  # type: ignore[operator]  # one allocator: both lists
            t0 = time.perf_counter()
            r = cache.insert(seq[:npages * ps], pages, prev_prefix_len=prev)
            if timings is not None:
                timings.append(time.perf_counter() - t0)
            dup = pages[have:r.prefix_len // ps]
            if dup:
                alloc.free(dup)  # the tree kept its own pages there (not read again: below ``prev``)
            prev = npages * ps
            have = npages

    def pages(self) -> int:
        return self.cache.core.dev_total[0]


def tree_bytes(cache: Any) -> int:
    """The Python heap the tree's own objects take (``sys.getsizeof`` of each): nodes, their
    children dicts and the page keys indexing them, keys, per-component data, LRU links,
    page-index runs and page hashes, and the core's set of unwritten nodes. The page-index
    ints themselves are the allocator's (its free list made them) and are not counted."""
    import sys

    size = sys.getsizeof
    total = size(cache.core.unwritten)
    for node in cache.core.iter_nodes():
        total += size(node) + size(node.children) + size(node.key) + size(node.data)
        for k in node.children:
            total += size(k) if not isinstance(k, int) else 0
        if node.hash_value is not None:
            total += size(node.hash_value)
        for cd in node.data:
            total += size(cd) + size(cd.dlink) + size(cd.hlink)
            for v in (cd.value, cd.host_value, cd.metadata):
                if v is not None:
                    total += size(v)
    return total


def _measure(pattern: str, size: int, args: argparse.Namespace, legacy: bool) -> dict[str, float]:
    import gc
    import statistics
    import time
    import tracemalloc

    from hicache.runtime import gc_guard

    wl = _Workload(args.page_size, args.prefix, args.suffix, pattern == "decode")
    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.collect()
    tree = _Tree(wl, size, legacy)
    # as the process loop does at its start (startup work: its allocators' free lists frozen)
    guard = None if legacy else gc_guard.GcGuard()
    gc.callbacks.append(on_gc)
    try:
        if args.tracemalloc:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        last_settle = t0
        while tree.pages() < size:
            tree.add_sequence()
            if guard is not None and time.perf_counter() - last_settle > 1.0:
                guard.settle()  # what the loop does when idle
                last_settle = time.perf_counter()
        build_s = time.perf_counter() - t0
        traced = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        heap = tree_bytes(tree.cache)
        if guard is not None:
            guard.settle()
        cached = tree.pages()
        cache = tree.cache
        match_t: list[float] = []
        lock_t: list[float] = []
        insert_t: list[float] = []
        evict_t: list[float] = []
        for _ in range(args.ops):
            probe = wl.tokens(tree.next - 1 - (tree.next * 7919) % min(tree.next, 50))
            t0 = time.perf_counter()
            m = cache.match_prefix(probe)
            t1 = time.perf_counter()
            tok = cache.inc_lock_ref(m.last_device_node)
            cache.dec_lock_ref(tok)
            t2 = time.perf_counter()
            match_t.append(t1 - t0)
            lock_t.append(t2 - t1)
            tree.add_sequence(insert_t)
            over = tree.pages() - size
            t0 = time.perf_counter()
            if over > 0:
                cache.evict(over * wl.ps)
            evict_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gc.collect()
        full_gc = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache.check_integrity()
        full_check = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache.check_integrity_slice()
        slice_check = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
        if guard is not None:
            guard.close()
    us = 1e6
    return {
        "pages": cached, "nodes": cache.core.node_count, "build_s": build_s,
        "bytes_per_page": heap / cached, "traced_bytes_per_page": traced / cached,
        "match_us": statistics.median(match_t) * us, "lock_us": statistics.median(lock_t) * us,
        "insert_us": statistics.median(insert_t) * us, "evict_us": statistics.median(evict_t) * us,
        "gc_max_pause_ms": max(pauses, default=0.0) * 1e3, "gc_collections": len(pauses),
        "full_gc_ms": full_gc * 1e3, "integrity_full_ms": full_check * 1e3,
        "integrity_slice_ms": slice_check * 1e3,
    }


def run(args: argparse.Namespace) -> int:
    import gc

    from hicache.bench.report import Figure, print_table, write_json

    sizes = [int(float(x)) for x in args.sizes.split(",") if x.strip()]
    patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    modes = [False, True] if args.legacy else [False]
    results: dict[str, dict[str, float]] = {}
    for pattern in patterns:
        for size in sizes:
            for legacy in modes:
                name = f"{pattern}/{size}/{'legacy' if legacy else 'now'}"
                r = _measure(pattern, size, args, legacy)
                gc.collect()
                results[name] = r
                tr = f" (traced {r['traced_bytes_per_page']:.0f})" if args.tracemalloc else ""
                print(f"{name:<24} {r['pages']:>9,} pages {r['nodes']:>8,} nodes  "
                      f"{r['bytes_per_page']:6.0f} B/page{tr}  match {r['match_us']:7.1f} us  "
                      f"lock {r['lock_us']:6.1f} us  insert {r['insert_us']:7.1f} us  "
                      f"evict {r['evict_us']:7.1f} us  gc max {r['gc_max_pause_ms']:7.1f} ms  "
                      f"full gc {r['full_gc_ms']:7.1f} ms  check {r['integrity_full_ms']:7.1f} ms  "
                      f"slice {r['integrity_slice_ms']:6.2f} ms  (built in {r['build_s']:.1f}s)", flush=True)
    figures: list[Figure] = []
    lo, hi = min(sizes), max(sizes)
    for pattern in patterns:
        now = results[f"{pattern}/{hi}/now"]
        figures.append(Figure(f"{pattern}: heap per page at {hi:,} pages", "B/page", now["bytes_per_page"],
                              "budget", BYTES_PER_PAGE_GOAL, higher_is_better=False, goal=1.0))
        if hi != lo:
            small = results[f"{pattern}/{lo}/now"]
            for op in ("match", "lock", "insert", "evict"):
                figures.append(Figure(f"{pattern}: {op} at {hi:,} pages", "us", now[f"{op}_us"],
                                      f"{op} at {lo:,} pages", small[f"{op}_us"], higher_is_better=False,
                                      goal=1.5))
        if args.legacy:
            old = results[f"{pattern}/{hi}/legacy"]
            for key, label, unit in (("bytes_per_page", "heap per page", "B/page"),
                                     ("gc_max_pause_ms", "longest gc pause", "ms"),
                                     ("integrity_slice_ms", "idle check (one slice)", "ms"),
                                     ("insert_us", "insert", "us"), ("match_us", "match", "us")):
                ref_key = "integrity_full_ms" if key == "integrity_slice_ms" else key
                figures.append(Figure(f"{pattern}: {label} at {hi:,} pages", unit, now[key],
                                      "legacy, same run" if ref_key == key else "full check, legacy",
                                      old[ref_key], higher_is_better=False))
    print_table("hicache bench index (references measured in the same run)", figures)
    if args.json:
        write_json(args.json, "index", figures, {"per_config": results, "page_size": args.page_size})
    return 0
