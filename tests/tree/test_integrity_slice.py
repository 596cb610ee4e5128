"""The idle check in bounded slices (``check_integrity_slice``) and the collector kept off the tree."""

from __future__ import annotations

import gc
from array import array

import pytest

from hicache.runtime.gc_guard import GcGuard
from hicache.tree import IntegrityError
from hicache.tree.node import TreeNode
from tests.support.tree import cache_seq, full_cache


def _filled(n_seqs: int = 12):
    cache, dev, _ = full_cache(capacity=512, page_size=4)
    for i in range(n_seqs):
        cache_seq(cache, dev, array("I", [i % 3] * 8 + list(range(1000 + 40 * i, 1032 + 40 * i))))
    return cache, dev


def _round(cache, budget: int, exact: bool = False) -> int:
    """Slices until one ends a round; returns how many it took."""
    for calls in range(1, 1000):
        if cache.check_integrity_slice(exact, budget):
            return calls
    raise AssertionError("no round ended")


def test_a_round_takes_slices_of_the_budget_and_then_compares_the_totals():
    cache, _ = _filled()
    units = cache.core.node_count + 1 + cache.core.dev_total[0]
    assert _round(cache, budget=units + 1, exact=True) == 1  # a small tree: one call, as before
    calls = _round(cache, budget=10, exact=True)
    assert calls >= units // 20  # each slice stops near its budget (a node may overshoot it)
    cache.core.dev_total[0] += 1  # a counter off: a slice does not see it, the round's end does
    with pytest.raises(IntegrityError, match="L1 total counter"):
        _round(cache, budget=10)


def test_a_round_the_traffic_changed_compares_nothing_and_starts_again():
    cache, dev = _filled()
    assert not cache.check_integrity_slice(budget=10)
    cache_seq(cache, dev, array("I", range(5000, 5040)))  # changes the tree mid-round
    while not cache.check_integrity_slice(budget=10):
        pass
    # the round that ended is the next one: it began after the change
    assert cache._integrity_walker is not None and cache._integrity_walker.rounds == 1


def test_a_slice_checks_the_nodes_it_visits():
    cache, _ = _filled()
    leaf = next(n for n in cache.core.iter_nodes() if n.parent is not None and not n.children)
    leaf.data[0].value = leaf.data[0].value[:-1]  # one page short
    with pytest.raises(IntegrityError, match="pages for"):
        _round(cache, budget=8)


def test_a_leak_is_found_by_an_exact_round():
    cache, dev = _filled()
    dev.alloc(1)
    with pytest.raises(IntegrityError, match="leak"):
        _round(cache, budget=16, exact=True)


def test_removed_nodes_need_no_garbage_collection():
    """Every removed node goes by reference counting: none is left for the collector (the
    collector's other finds, such as another test's threads' garbage, are not the tree's)."""
    cache, dev = _filled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage, to look at
    try:
        cache.flush()
        assert cache.core.node_count == 0
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, TreeNode)]
        assert not cyclic, f"{len(cyclic)} removed nodes were left for the garbage collector"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    cache.check_integrity(exact=True)


def test_gc_guard_freezes_what_survives_and_gives_it_back():
    guard = GcGuard(interval_s=60.0)
    try:
        assert gc.get_freeze_count() > 0 and guard.settles == 1
        assert not guard.settle(0.0 + guard._last + 1.0)  # within the interval: nothing done
        assert guard.settle()
    finally:
        guard.close()
    assert gc.get_freeze_count() == 0


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_gc_guard_frees_a_frozen_cycle_at_its_next_refresh():
    import weakref
    guard = GcGuard(interval_s=1.0, refresh_s=10.0)
    try:
        obj = _Cycle()
        ref = weakref.ref(obj)
        now = guard._last + 1.0
        assert guard.settle(now)  # the cycle is alive: frozen
        del obj
        assert guard.settle(now + 1.0) and ref() is not None  # frozen garbage: a settle keeps it
        assert guard.settle(now + 12.0) and guard.refreshes == 1
        assert ref() is None  # the refresh collected the whole heap
    finally:
        guard.close()
