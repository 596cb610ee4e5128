"""A load-back in flight and what else happens to its nodes meanwhile (hybrid trees).

A load-back copies L2 data into fresh L1 units while the scheduler goes on: requests insert
through the nodes being loaded, match them, and the load may fail (the controller died).
Whatever happens, no component's data of a node is readable before its copy landed, and
no L1 unit is freed while a node or a request still refers to it.
"""

from __future__ import annotations

from hicache.memory.allocator import PageAllocator
from hicache.tree import (
    FullComponent,
    InsertParams,
    MambaComponent,
    PagedInsert,
    SWAComponent,
    UnifiedRadixCache,
)
from tests.support.tree import toks

KEY = toks("aaaabbbbcccc")  # 12 tokens, page size 1


def hybrid_cache() -> tuple[UnifiedRadixCache, dict[str, PageAllocator]]:
    allocs = {name: PageAllocator(n, name) for name, n in
              (("full", 64), ("full-l2", 64), ("swa", 64), ("swa-l2", 64), ("mamba", 8), ("mamba-l2", 8))}
    cache = UnifiedRadixCache([FullComponent(allocs["full"], allocs["full-l2"]),
                               SWAComponent(allocs["swa"], 4, allocs["swa-l2"]),
                               MambaComponent(allocs["mamba"], allocs["mamba-l2"])], 1)
    return cache, allocs


def computed_insert(cache: UnifiedRadixCache, allocs: dict[str, PageAllocator]) -> tuple[list[int], list[int], int]:
    """A request that recomputed ``KEY`` inserts it with its own pages, window and state
    (as ``cache_finished_req`` does); returns its Full pages, SWA pages and state slot."""
    full, swa, state = allocs["full"].alloc(12), allocs["swa"].alloc(12), allocs["mamba"].alloc(1)[0]
    r = cache.insert_with(InsertParams(KEY, full, aux={"swa": PagedInsert(swa), "mamba": state}))
    allocs["full"].free(full[:r.prefix_len])
    return full, swa, state


def l2_only(cache: UnifiedRadixCache, allocs: dict[str, PageAllocator]) -> None:
    """``KEY`` cached, written to L2 and evicted from L1: an L2-only node with its window and state."""
    computed_insert(cache, allocs)
    for node in cache.tiers.nodes_to_write_to_host():
        op = cache.tiers.start_write(node)
        assert op is not None and set(op.transfers) == {"full", "swa", "mamba"}
        cache.tiers.finish_write(op, True)
    cache.evict_units({"full": 100})
    assert allocs["full"].used == allocs["swa"].used == allocs["mamba"].used == 0
    cache.check_integrity(exact=True)


def readable_units(cache: UnifiedRadixCache, name: str) -> set[int]:
    """The L1 units of ``name`` a match of ``KEY`` gives a request to read."""
    m = cache.match_prefix(KEY, copy_on_match=False)
    out: set[int] = set()
    node = m.last_device_node
    while node.parent is not None:
        v = cache.data(node, name).value
        if v is not None:
            out.update(cache.component(name).as_pages(v))
        node = node.parent
    return out


def test_an_insert_through_a_loading_node_never_exposes_the_loads_units() -> None:
    cache, allocs = hybrid_cache()
    l2_only(cache, allocs)
    load = cache.tiers.start_load_back(cache.match_prefix(KEY, copy_on_match=False))
    assert load is not None and set(load.transfers) == {"full", "swa", "mamba"}
    in_flight = {name: set(dst) for name, (_src, dst) in load.transfers.items()}
    assert cache.match_prefix(KEY, copy_on_match=False).device_len == 0  # loading: not readable

    _full, swa, state = computed_insert(cache, allocs)  # a request that recomputed it finishes first
    m = cache.match_prefix(KEY, copy_on_match=False)
    assert m.device_len == 12  # readable now: the request's own computed data
    for name in ("swa", "mamba"):
        exposed = readable_units(cache, name) & in_flight[name]
        assert not exposed, f"{name} units still being copied are readable: {sorted(exposed)}"
    assert readable_units(cache, "swa") == set(swa) and readable_units(cache, "mamba") == {state}

    cache.tiers.finish_load_back(load, ok=False)  # the controller died with the copy in flight
    assert readable_units(cache, "swa") == set(swa) and readable_units(cache, "mamba") == {state}
    for name in ("full", "swa", "mamba"):  # what the tree holds was not freed under it
        free = set(allocs[name].alloc(allocs[name].free_count) or [])
        held = readable_units(cache, name)
        assert not free & held, f"{name} units in the tree were freed: {sorted(free & held)}"
        allocs[name].free(sorted(free))
    cache.check_integrity(exact=True)


def test_a_request_that_matched_after_the_insert_keeps_its_units_when_the_load_fails() -> None:
    cache, allocs = hybrid_cache()
    l2_only(cache, allocs)
    load = cache.tiers.start_load_back(cache.match_prefix(KEY, copy_on_match=False))
    assert load is not None
    computed_insert(cache, allocs)
    m = cache.match_prefix(KEY, copy_on_match=False)
    lock = cache.inc_lock_ref(m.last_device_node)  # a request admitted on it
    swa_read, state_read = readable_units(cache, "swa"), readable_units(cache, "mamba")
    cache.tiers.finish_load_back(load, ok=False)
    taken = {name: allocs[name].alloc(allocs[name].free_count) or [] for name in ("swa", "mamba")}
    assert not set(taken["swa"]) & swa_read and not set(taken["mamba"]) & state_read, \
        "the matched request's window or state went back to the allocator"
    for name, units in taken.items():
        allocs[name].free(units)
    cache.dec_lock_ref(lock)
    cache.check_integrity(exact=True)


def test_a_load_that_lands_makes_every_component_readable_at_once() -> None:
    cache, allocs = hybrid_cache()
    l2_only(cache, allocs)
    load = cache.tiers.start_load_back(cache.match_prefix(KEY, copy_on_match=False))
    assert load is not None
    assert readable_units(cache, "swa") == set() and readable_units(cache, "mamba") == set()
    cache.tiers.finish_load_back(load, ok=True)
    m = cache.match_prefix(KEY, copy_on_match=False)
    assert m.device_len == 12
    assert readable_units(cache, "swa") <= set(load.transfers["swa"][1])
    assert readable_units(cache, "mamba") == set(load.transfers["mamba"][1])
    cache.check_integrity(exact=True)


def test_a_loading_node_split_by_a_match_gets_each_part_its_units() -> None:
    cache, allocs = hybrid_cache()
    l2_only(cache, allocs)
    load = cache.tiers.start_load_back(cache.match_prefix(KEY, copy_on_match=False))
    assert load is not None
    cache.match_prefix(toks("aaaabbXY"), copy_on_match=False)  # splits the loading node
    cache.tiers.finish_load_back(load, ok=True)
    assert cache.match_prefix(KEY, copy_on_match=False).device_len == 12
    assert readable_units(cache, "swa") == set(load.transfers["swa"][1])
    cache.check_integrity(exact=True)
    cache.flush()
    assert all(a.used == 0 for a in allocs.values())
