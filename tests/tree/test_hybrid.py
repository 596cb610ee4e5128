"""SWA and Mamba components: validity, locks, tombstones, copy-on-write, cascade eviction."""

from __future__ import annotations

from hicache.memory.allocator import PageAllocator
from hicache.tree import (
    ComponentType,
    FullComponent,
    InsertParams,
    MambaComponent,
    PagedInsert,
    SWAComponent,
    UnifiedRadixCache,
)
from tests.support.tree import toks

SWA = ComponentType.SWA
MAMBA = ComponentType.MAMBA


def swa_cache(window: int):
    dev, swa = PageAllocator(128, "full"), PageAllocator(128, "swa")
    cache = UnifiedRadixCache([FullComponent(dev), SWAComponent(swa, window)], 1)
    return cache, dev, swa


def swa_insert(cache, dev, swa, s: str):
    key = toks(s)
    m = cache.match_prefix(key)
    have = m.device_len
    full_pages = m.device_indices + dev.alloc(len(key) - have)
    swa_pages = [None] * have + swa.alloc(len(key) - have)  # matched part: the tree's own
    r = cache.insert_with(InsertParams(key, full_pages, prev_prefix_len=have,
                                       aux={"swa": PagedInsert(swa_pages, 0, have)}))
    dev.free(full_pages[have:r.prefix_len])
    cache.check_integrity(exact=True)
    return r


def chain(cache, dev, swa):
    for s in ("aaaa", "aaaabbbb", "aaaabbbbcccc"):
        swa_insert(cache, dev, swa, s)
    nodes = []
    n = cache.match_prefix(toks("aaaabbbbcccc")).last_device_node
    while n.parent is not None:
        nodes.append(n)
        n = n.parent
    return nodes[::-1]  # [aaaa, bbbb, cccc]


def test_swa_match_valid_only_where_window_is_covered():
    cache, dev, swa = swa_cache(window=7)
    a, b, c = chain(cache, dev, swa)
    res = cache.evict_units({"swa": 1})  # the oldest SWA data: the internal "aaaa" -> tombstone
    assert res.units("swa") == 4 and cache.data(a, SWA).value is None and a.value is not None
    cache.check_integrity(exact=True)
    assert cache.match_prefix(toks("aaaabbbbcccc")).device_len == 12  # 8 tokens of window
    assert cache.match_prefix(toks("aaaabbbb")).device_len == 0  # only 4 < 7 covered
    assert cache.match_prefix(toks("aaaabbbbcczz")).device_len == 0  # 4 + 2 < 7
    assert cache.match_prefix(toks("aaaabbbbccczz")).device_len == 11  # 4 + 3 >= 7


def test_swa_lock_and_unlock_stop_at_the_same_uuid_boundary():
    cache, dev, swa = swa_cache(window=4)
    a, b, c = chain(cache, dev, swa)
    lock = cache.inc_lock_ref(c)
    assert [cache.data(n, SWA).lock_ref for n in (a, b, c)] == [0, 0, 1]
    assert [n.lock_ref for n in (a, b, c)] == [1, 1, 1]
    assert cache.protected_size(SWA) == 4 and cache.protected_size() == 12
    m = cache.match_prefix(toks("aaaabbbbccXY"))  # splits the boundary node
    upper = m.last_device_node
    assert upper.parent is b and c.parent is upper
    assert cache.data(upper, SWA).lock_ref == 1 and cache.data(c, SWA).lock_ref == 1
    cache.check_integrity(exact=True)
    cache.dec_lock_ref(lock)
    assert [cache.data(n, SWA).lock_ref for n in (a, b, upper, c)] == [0, 0, 0, 0]
    assert cache.protected_size(SWA) == 0 and cache.protected_size() == 0
    cache.check_integrity(exact=True)


def test_swa_tombstone_recovered_on_insert():
    cache, dev, swa = swa_cache(window=4)
    a, b, c = chain(cache, dev, swa)
    cache.evict_units({"swa": 1})
    assert cache.data(a, SWA).value is None
    used = swa.used
    key = toks("aaaabbbbcccc")
    full = dev.alloc(12)
    own = swa.alloc(12)  # a request that recomputed everything, SWA pages for all of it
    r = cache.insert_with(InsertParams(key, full, aux={"swa": PagedInsert(own)}))
    dev.free(full[:r.prefix_len])
    assert cache.data(a, SWA).value == own[:4]  # recovered from the request's pages
    assert swa.used == used + 4  # the other 8 were duplicates and were freed
    cache.check_integrity(exact=True)


def test_swa_partial_recovery_splits_at_window_start():
    cache, dev, swa = swa_cache(window=4)
    a, b, c = chain(cache, dev, swa)
    cache.evict_units({"swa": 1})
    full = dev.alloc(12)
    own = swa.alloc(10)  # the request released its first 2 SWA pages (outside its window)
    r = cache.insert_with(InsertParams(toks("aaaabbbbcccc"), full, aux={"swa": PagedInsert(own, 2)}))
    dev.free(full[:r.prefix_len])
    assert a.key == toks("aa") and cache.data(a.parent, SWA).value is None
    assert a.parent.key == toks("aa") and cache.data(a, SWA).value == own[:2]
    cache.check_integrity(exact=True)


def test_cascade_eviction_by_priority():
    cache, dev, swa = swa_cache(window=4)
    a, b, c = chain(cache, dev, swa)
    cache.match_prefix(toks("aaaabbbbcccc"))
    # internal SWA eviction leaves a tombstone and keeps FULL
    cache.evict_units({"swa": 8})
    assert cache.data(a, SWA).value is None and cache.data(b, SWA).value is None and a.value is not None
    # SWA eviction of a leaf deletes the leaf (all components, priority 0)
    cache.evict_units({"swa": 4})
    assert c.parent is None and cache.total_size() == 8
    # FULL eviction (priority 2) takes every component of the node with it
    swa_insert(cache, dev, swa, "aaaabbbbdddd")
    cache.evict(full_tokens=100)
    assert cache.total_size() == 0 and cache.total_size(SWA) == 0
    assert dev.used == 0 and swa.used == 0
    cache.check_integrity(exact=True)


# ------------------------------------------------------------------ mamba
def mamba_cache():
    dev, states = PageAllocator(128, "full"), PageAllocator(16, "mamba")
    memory: dict[int, list[int]] = {}

    def copy(src: int, dst: int) -> None:
        memory[dst] = list(memory[src])

    cache = UnifiedRadixCache([FullComponent(dev), MambaComponent(states, copy_state=copy)], 1)
    return cache, dev, states, memory


def mamba_insert(cache, dev, states, memory, s: str, with_state=True):
    key = toks(s)
    m = cache.match_prefix(key, copy_on_match=False)
    pages = m.device_indices + dev.alloc(len(key) - m.device_len)
    slot = None
    if with_state:
        slot = states.alloc(1)[0]
        memory[slot] = [len(key)]
    r = cache.insert_with(InsertParams(key, pages, prev_prefix_len=m.device_len, aux={"mamba": slot}))
    dev.free(pages[m.device_len:r.prefix_len])
    cache.check_integrity(exact=True)
    return r


def test_mamba_match_truncated_to_deepest_node_with_state():
    cache, dev, states, memory = mamba_cache()
    mamba_insert(cache, dev, states, memory, "aaaa")
    mamba_insert(cache, dev, states, memory, "aaaabbbb", with_state=False)
    m = cache.match_prefix(toks("aaaabbbbcc"))
    assert m.device_len == 4 and m.last_device_node.key == toks("aaaa")
    states.free([m.copies["mamba"]])
    cache.check_integrity(exact=True)


def test_mamba_copy_on_write_keeps_cached_state():
    cache, dev, states, memory = mamba_cache()
    mamba_insert(cache, dev, states, memory, "aaaa")
    m = cache.match_prefix(toks("aaaa"))
    src = cache.data(m.last_device_node, MAMBA).value
    own = m.copies["mamba"]
    assert own is not None and own != src
    memory[own].append(999)  # decoding mutates the request's own copy
    assert memory[src] == [4]
    states.free([own])
    cache.check_integrity(exact=True)


def test_mamba_single_node_lock_and_eviction():
    cache, dev, states, memory = mamba_cache()
    mamba_insert(cache, dev, states, memory, "aaaa")
    mamba_insert(cache, dev, states, memory, "aaaabbbb")
    m = cache.match_prefix(toks("aaaabbbb"), copy_on_match=False)
    leaf = m.last_device_node
    lock = cache.inc_lock_ref(leaf)
    assert cache.data(leaf, MAMBA).lock_ref == 1 and cache.data(leaf.parent, MAMBA).lock_ref == 0
    assert cache.protected_size(MAMBA) == 1
    res = cache.evict_units({"mamba": 2})  # only the parent's state can go: a tombstone
    assert res.units("mamba") == 1 and cache.data(leaf.parent, MAMBA).value is None and leaf.parent.value
    cache.dec_lock_ref(lock)
    cache.evict_units({"mamba": 1})  # a leaf: the whole node goes
    assert leaf.parent is None and cache.total_size() == 4
    assert states.used == 0
    cache.check_integrity(exact=True)


def test_mamba_state_stays_on_lower_node_when_split():
    cache, dev, states, memory = mamba_cache()
    mamba_insert(cache, dev, states, memory, "aaaabbbb")
    m = cache.match_prefix(toks("aaaaXXXX"), copy_on_match=False)
    assert m.last_device_node.parent is None  # no state at the split point: nothing valid
    (upper,) = m.last_device_node.children.values()
    assert upper.key == toks("aaaa") and cache.data(upper, MAMBA).value is None
    (lower,) = upper.children.values()
    assert cache.data(lower, MAMBA).value is not None
    assert m.device_len == 0
    r = mamba_insert(cache, dev, states, memory, "aaaabbbb")
    assert r.already_held == {"mamba"} and states.used == 1
    cache.check_integrity(exact=True)


def test_swa_chunked_prefill_then_finish():
    from hicache.tree import RequestState, SwaRequestPages

    cache, dev, swa = swa_cache(window=4)
    tokens = toks("abcdefghij")
    table = SwaRequestPages(swa.alloc(6))
    req = RequestState(tokens, dev.alloc(6), aux={"swa": table})
    cache.cache_unfinished_req(req, committed_len=6)
    assert req.prefix_len == 6 and cache.protected_size() == 6
    cache.check_integrity()  # the request still holds its pages
    req.kv_pages += dev.alloc(4)
    table.pages += swa.alloc(4)
    cache.cache_finished_req(req)
    cache.check_integrity(exact=True)
    m = cache.match_prefix(tokens)
    assert m.device_len == 10
    first = m.last_device_node.parent
    assert first.key == toks("abcdef") and cache.data(first, SWA).value is not None  # recovered
    assert cache.protected_size() == 0 and dev.used == 10 and swa.used == 10
    assert cache.total_size(SWA) == 10  # no SWA page leaked


def test_a_load_back_holds_the_auxiliary_data_it_loads_outside_the_tree():
    """Evictable means evict can free it: the state a load in flight copies is the op's,
    not the tree's, until the load lands."""
    dev, host = PageAllocator(32, "full"), PageAllocator(32, "full-l2")
    states, states_host = PageAllocator(8, "mamba"), PageAllocator(8, "mamba-l2")
    cache = UnifiedRadixCache([FullComponent(dev, host), MambaComponent(states, states_host)], 1)
    key = toks("aaaabbbb")
    r = cache.insert_with(InsertParams(key, dev.alloc(8), aux={"mamba": states.alloc(1)[0]}))
    op = cache.tiers.start_write(r.node)
    cache.tiers.finish_write(op, True)
    cache.evict(100)  # L2-only now, with its state in L2
    assert cache.total_size(MAMBA) == 0 and states.used == 0
    m = cache.match_prefix(key, copy_on_match=False)
    assert m.host_hit_length == 8  # valid once loaded: the state comes back too
    load = cache.tiers.start_load_back(m)
    assert load is not None and set(load.transfers) == {"full", "mamba"}
    assert cache.total_size(MAMBA) == 0 and states.used == 1 and cache.evictable_size(MAMBA) == 0
    assert cache.evictable_size() == 0
    assert cache.evict_units({"full": 100, "mamba": 5}).units("mamba") == 0  # nothing evictable was hidden
    cache.tiers.finish_load_back(load, True)
    assert cache.total_size(MAMBA) == 1 and cache.evictable_size(MAMBA) == 1 and cache.evictable_size() == 8
    assert cache.match_prefix(key, copy_on_match=False).device_len == 8
    cache.check_integrity(exact=True)


def test_host_hit_ends_where_the_l2_data_is_valid():
    """An L2-only tail is reported only up to a boundary whose Mamba state is in L2."""
    dev, host = PageAllocator(32, "full"), PageAllocator(32, "full-l2")
    states = PageAllocator(8, "mamba")
    cache = UnifiedRadixCache([FullComponent(dev, host), MambaComponent(states, PageAllocator(0, "m2"))], 1)
    r = cache.insert_with(InsertParams(toks("aaaabbbb"), dev.alloc(8), aux={"mamba": states.alloc(1)[0]}))
    cache.tiers.finish_write(cache.tiers.start_write(r.node), True)  # no L2 room for the state: Full only
    cache.evict(100)
    m = cache.match_prefix(toks("aaaabbbb"), copy_on_match=False)
    assert m.device_len == 0 and m.host_hit_length == 0  # loading it back would give no valid match
    cache.check_integrity(exact=True)


def _l2_swa_cache(window: int, write_policy: str = "write_through"):
    dev, host = PageAllocator(64, "full"), PageAllocator(64, "full-l2")
    swa, swa_host = PageAllocator(64, "swa"), PageAllocator(64, "swa-l2")
    cache = UnifiedRadixCache([FullComponent(dev, host), SWAComponent(swa, window, swa_host)], 1,
                              write_policy=write_policy)
    return cache, dev, swa


def test_a_window_recovered_on_a_written_node_gets_its_own_l2_copy():
    """The node's FULL pages went to L2 while it was an SWA tombstone; once its window is
    recovered the write policy writes the window alone, so the prefix matches from L2."""
    cache, dev, swa = _l2_swa_cache(window=4)
    key = toks("aaaabbbb")
    full = dev.alloc(8)
    cache.insert_with(InsertParams(key, full, aux={"swa": PagedInsert(swa.alloc(4), 4)}))  # "aaaa": a tombstone
    b = cache.match_prefix(key).last_device_node
    a = b.parent
    assert a.key == toks("aaaa") and cache.data(a, SWA).value is None
    for n in cache.tiers.nodes_to_write_to_host():
        op = cache.tiers.start_write(n)
        assert op is not None and set(op.transfers) == ({"full"} if n is a else {"full", "swa"})
        cache.tiers.finish_write(op, True)
    assert a.data[0].host_value is not None and cache.data(a, SWA).host_value is None
    assert cache.tiers.nodes_to_write_to_host() == []
    cache.check_integrity(exact=True)
    again = dev.alloc(8)
    own = swa.alloc(8)
    r = cache.insert_with(InsertParams(key, again, aux={"swa": PagedInsert(own)}))  # recovers "aaaa"'s window
    dev.free(again[:r.prefix_len])
    assert cache.data(a, SWA).value == own[:4]
    assert cache.tiers.nodes_to_write_to_host() == [a]  # FULL is in L2: the window alone is due
    cache.check_integrity(exact=True)
    op = cache.tiers.start_write(a)
    assert op is not None and set(op.transfers) == {"swa"} and op.transfers["swa"][0] == own[:4]
    cache.tiers.finish_write(op, True)
    assert cache.data(a, SWA).host_value is not None and cache.tiers.nodes_to_write_to_host() == []
    cache.check_integrity(exact=True)
    cache.evict_units({"full": 100, "swa": 100})
    assert cache.total_size() == 0
    m = cache.match_prefix(toks("aaaa"))
    assert m.device_len == 0 and m.host_hit_length == 4  # matched from L2 with its window
    cache.check_integrity(exact=True)


def test_a_mamba_state_added_to_a_written_node_is_written_alone():
    dev, host = PageAllocator(32, "full"), PageAllocator(32, "full-l2")
    states, states_host = PageAllocator(8, "mamba"), PageAllocator(8, "mamba-l2")
    cache = UnifiedRadixCache([FullComponent(dev, host), MambaComponent(states, states_host)], 1)
    key = toks("aaaabbbb")
    full = dev.alloc(8)
    r = cache.insert_with(InsertParams(key, full))  # no state yet
    cache.tiers.finish_write(cache.tiers.start_write(r.node), True)
    assert cache.tiers.nodes_to_write_to_host() == []
    state = states.alloc(1)[0]
    again = dev.alloc(8)
    r2 = cache.insert_with(InsertParams(key, again, aux={"mamba": state}))
    dev.free(again[:r2.prefix_len])
    assert cache.data(r.node, MAMBA).value == state and cache.tiers.nodes_to_write_to_host() == [r.node]
    op = cache.tiers.start_write(r.node)
    assert op is not None and set(op.transfers) == {"mamba"}
    assert cache.tiers.start_write(r.node) is None  # in flight
    cache.tiers.finish_write(op, True)
    cache.check_integrity(exact=True)
    cache.evict_units({"full": 100, "mamba": 8})
    m = cache.match_prefix(key, copy_on_match=False)
    assert m.device_len == 0 and m.host_hit_length == 8
    cache.check_integrity(exact=True)


def test_write_back_writes_an_unwritten_window_before_evicting_it():
    cache, dev, swa = _l2_swa_cache(window=4, write_policy="write_back")
    key = toks("aaaabbbb")
    r = cache.insert_with(InsertParams(key, dev.alloc(8), aux={"swa": PagedInsert(swa.alloc(8))}))
    assert cache.evict_units({"swa": 8}).units("swa") == 0  # queued for its write, nothing lost
    assert cache.tiers.nodes_to_write_to_host() == [r.node]
    op = cache.tiers.start_write(r.node)
    assert op is not None and set(op.transfers) == {"full", "swa"}
    cache.tiers.finish_write(op, True)
    assert cache.evict_units({"swa": 8}).units("swa") == 8
    m = cache.match_prefix(key)
    assert m.host_hit_length == 8  # the window went to L2 first
    cache.check_integrity(exact=True)


def test_l2_eviction_of_auxiliary_data_keeps_copies_of_l1_data():
    """Only L2-only auxiliary data makes room: evicting the copy of a window still in L1
    would leave the node wanting the same write again."""
    dev, host = PageAllocator(64, "full"), PageAllocator(64, "full-l2")
    swa, swa_host = PageAllocator(64, "swa"), PageAllocator(4, "swa-l2")
    cache = UnifiedRadixCache([FullComponent(dev, host), SWAComponent(swa, 4, swa_host)], 1)
    r1 = cache.insert_with(InsertParams(toks("aaaa"), dev.alloc(4), aux={"swa": PagedInsert(swa.alloc(4))}))
    cache.tiers.finish_write(cache.tiers.start_write(r1.node), True)
    r2 = cache.insert_with(InsertParams(toks("bbbb"), dev.alloc(4), aux={"swa": PagedInsert(swa.alloc(4))}))
    op = cache.tiers.start_write(r2.node)
    assert op is not None and set(op.transfers) == {"full"}  # no room: "aaaa"'s copy stays
    cache.tiers.finish_write(op, True)
    assert cache.data(r1.node, SWA).host_value is not None
    assert cache.tiers.nodes_to_write_to_host() == [r2.node]  # its window still waits
    cache.evict(4)  # "aaaa" (LRU) leaves L1: its L2 window is L2-only now
    assert cache.data(r1.node, SWA).value is None
    op = cache.tiers.start_write(r2.node)
    assert op is not None and set(op.transfers) == {"swa"}
    cache.tiers.finish_write(op, True)
    assert cache.data(r1.node, SWA).host_value is None and cache.data(r2.node, SWA).host_value is not None
    cache.check_integrity(exact=True)


def test_insert_host_gives_a_window_to_pages_the_tree_holds_by_splitting_their_node():
    """An L2-only tree (engine mode): ``insert_host`` with SWA units for pages before
    ``start_page`` (the window before a prefix the tree holds) splits the node holding them
    at the run's edges and gives it the run; the boundary becomes a valid hit. Units for a
    node that has SWA data already, or pages the tree does not hold, are freed."""
    host, swa_host = PageAllocator(64, "full-l2"), PageAllocator(16, "swa-l2")
    cache = UnifiedRadixCache([FullComponent(PageAllocator(0, "full"), host),
                               SWAComponent(PageAllocator(0, "swa"), 2, swa_host)], 1)
    a = toks("abcdefgh")
    r = cache.host.insert_host(a, host.alloc(8), aux={"swa": dict(zip([6, 7], swa_host.alloc(2), strict=True))})
    assert r.host_pages_taken == 8 and r.aux_nodes == []
    assert cache.match_prefix(a).host_hit_length == 8
    b = toks("abcdxy")
    assert cache.match_prefix(b).host_hit_length == 0  # "abcd" has no window
    units = swa_host.alloc(4)
    r = cache.host.insert_host(b, host.alloc(2), start_page=4,
                                aux={"swa": {2: units[0], 3: units[1], 4: units[2], 5: units[3]}})
    assert r.host_pages_taken == 2 and len(r.aux_nodes) == 1 and r.aux_nodes[0].key == toks("cd")
    assert cache.match_prefix(toks("abcdz")).host_hit_length == 4  # a hit where the two now branch
    assert cache.match_prefix(b).host_hit_length == 6 and cache.match_prefix(a).host_hit_length == 8
    free = swa_host.free_count
    again = swa_host.alloc(2)
    r = cache.host.insert_host(b, [], start_page=6, aux={"swa": {2: again[0], 3: again[1]}})  # held already
    assert r.aux_nodes == [] and swa_host.free_count == free
    cache.check_integrity(exact=True)


def test_drop_host_units_clears_a_page_range_of_a_window_and_keeps_locked_data():
    """``drop_host_units`` makes SWA tombstones of exactly the pages asked (splitting the
    nodes it starts or ends inside), leaves host-locked data, and the hits follow the SWA
    rule: the dropped boundary is no hit, the kept ones are."""
    host, swa_host = PageAllocator(64, "full-l2"), PageAllocator(16, "swa-l2")
    cache = UnifiedRadixCache([FullComponent(PageAllocator(0, "full"), host),
                               SWAComponent(PageAllocator(0, "swa"), 2, swa_host)], 1)
    a = toks("abcdefgh")
    r = cache.host.insert_host(a, host.alloc(8), aux={"swa": dict(zip(range(2, 8), swa_host.alloc(6), strict=True))})
    assert cache.host.host_page_flags(r.node, "swa") == [False] * 2 + [True] * 6
    assert cache.match_prefix(toks("abcdx")).host_hit_length == 4
    assert cache.host.drop_host_units(r.node, "swa", 3, 5) == 2
    assert cache.host.host_page_flags(r.node, "swa") == [False, False, True, False, False, True, True, True]
    assert cache.match_prefix(toks("abcdx")).host_hit_length == 0  # its window was dropped
    assert cache.match_prefix(a).host_hit_length == 8
    tail = cache.match_prefix(a).last_host_node
    _, npages = cache.host.protect_host_window(tail, "swa", 2)  # locks its node "fgh" whole
    assert cache.host.drop_host_units(tail, "swa", 5, 6) == 0
    cache.host.release_host_window(tail, "swa", npages)
    assert cache.host.drop_host_units(tail, "swa", 5, 6) == 1
    assert cache.match_prefix(a).host_hit_length == 8 and swa_host.free_count == 16 - 3
    cache.check_integrity(exact=True)


def test_insert_host_gives_a_state_after_a_page_inside_a_held_node_by_splitting_it():
    """An L2-only tree of a state model (engine mode with a GDN): ``insert_host`` with a
    Mamba state after a page inside a node the tree holds splits the node there and gives the
    upper part the state; the split point becomes a hit, the protected state is the one after
    it, and ``host_state_pages`` lists where states are kept. A state for a page that already
    ends a node with one is freed."""
    host, states = PageAllocator(64, "full-l2"), PageAllocator(8, "mamba-l2")
    cache = UnifiedRadixCache([FullComponent(PageAllocator(0, "full"), host),
                               MambaComponent(PageAllocator(0, "mamba"), states)], 1)
    a = toks("abcdefgh")
    end = states.alloc(1)[0]
    r = cache.host.insert_host(a, host.alloc(8), aux={"mamba": {7: end}})
    assert cache.host.host_state_pages(r.node, "mamba") == {7}
    assert cache.match_prefix(toks("abcdx")).host_hit_length == 0  # no state after "abcd"
    mid, dup = states.alloc(2)
    r = cache.host.insert_host(toks("abcdxy"), host.alloc(2), start_page=4, aux={"mamba": {3: mid, 5: dup}})
    assert len(r.aux_nodes) == 1 and r.aux_nodes[0].key == toks("abcd")
    m = cache.match_prefix(toks("abcdz"))
    assert m.host_hit_length == 4
    assert cache.host.protect_host_state(m.last_host_node, "mamba") == mid
    cache.host.release_host_state(m.last_host_node, "mamba")
    assert cache.match_prefix(a).host_hit_length == 8 and cache.match_prefix(toks("abcdxy")).host_hit_length == 6
    assert cache.host.host_state_pages(cache.match_prefix(a).last_host_node, "mamba") == {3, 7}
    free = states.free_count
    again = states.alloc(1)[0]
    r = cache.host.insert_host(a, [], start_page=8, aux={"mamba": {7: again}})  # a's end has its state
    assert r.aux_nodes == [] and states.free_count == free
    cache.check_integrity(exact=True)
