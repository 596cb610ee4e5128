"""HiCache node state: L1/L2 residency, tier operations and their acknowledgements."""

from __future__ import annotations

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.tree import FullComponent, IntegrityError, UnifiedRadixCache
from tests.support.tree import cache_seq, full_cache, toks


def _write_all(cache, ok=True):
    ops = []
    for node in cache.tiers.nodes_to_write_to_host():
        op = cache.tiers.start_write(node)
        assert op is not None
        ops.append(op)
    for op in ops:
        cache.tiers.finish_write(op, ok)
        cache.check_integrity(exact=True)
    return ops


def test_l1_eviction_keeps_l2_copy_as_l2_only_node():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    ops = _write_all(cache)
    assert len(ops) == 1 and ops[0].src_pages == cache.match_prefix(toks("abcdef")).device_indices
    node = cache.match_prefix(toks("abcdef")).last_device_node
    assert node.host_value == ops[0].dst_pages
    cache.evict(100)
    cache.check_integrity(exact=True)
    assert dev.used == 0 and host.used == 6
    m = cache.match_prefix(toks("abcdef"))
    assert m.device_len == 0 and m.host_hit_length == 6 and m.last_host_node is node
    assert node.evicted and node.host_value is not None


def test_node_with_neither_copy_is_gone():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    cache.evict(100)  # never written to L2
    assert cache.core.node_count == 0
    assert cache.match_prefix(toks("abcdef")).host_hit_length == 0
    cache.check_integrity(exact=True)


def test_failed_write_leaves_node_as_before():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    node = cache.match_prefix(toks("abcdef")).last_device_node
    op = cache.tiers.start_write(node)
    assert node.lock_ref == 1 and host.used == 6
    assert cache.evict(100).full_tokens == 0  # locked during the copy
    assert cache.tiers.finish_write(op, ok=False) == []
    assert node.host_value is None and node.lock_ref == 0 and host.used == 0
    with pytest.raises(ValueError):
        cache.tiers.finish_write(op, ok=True)  # not in flight any more
    cache.check_integrity(exact=True)


def test_host_lock_protects_from_l2_eviction_and_refuses_below_zero():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    _write_all(cache)
    cache.evict(100)
    node = cache.match_prefix(toks("abcdef")).last_host_node
    n = cache.host.protect_host(node)
    assert cache.host_protected_size() == 6
    assert cache.host.evict_host(100) == 0
    cache.host.release_host(node, n)
    with pytest.raises(ValueError):
        cache.host.release_host(node, n)
    assert cache.host.evict_host(100) == 6
    assert host.used == 0 and cache.core.node_count == 0
    cache.check_integrity(exact=True)


def test_split_keeps_hashes_host_values_and_locks_consistent():
    cache, dev, host = full_cache(capacity=64, host_capacity=64, page_size=2)
    key = list(range(1, 13))
    cache_seq(cache, dev, key)
    _write_all(cache)
    node = cache.match_prefix(key).last_device_node
    hashes = list(cache.hashes.node_hashes(node))
    hv, dv = list(node.host_value), list(node.value)
    lock = cache.inc_lock_ref(node)
    npages = cache.host.protect_host(node)
    m = cache.match_prefix(key[:4] + [50, 51])  # split after 2 pages
    upper = m.last_device_node
    assert upper.parent.parent is None and node.parent is upper
    assert cache.hashes.node_hashes(upper) + cache.hashes.node_hashes(node) == hashes
    assert upper.host_value + node.host_value == hv and upper.value + node.value == dv
    assert upper.lock_ref == node.lock_ref == 1
    assert upper.host_lock_ref == node.host_lock_ref == 1
    cache.check_integrity(exact=True)
    cache.host.release_host(node, npages)
    cache.dec_lock_ref(lock)
    assert upper.lock_ref == node.lock_ref == 0 and upper.host_lock_ref == node.host_lock_ref == 0
    cache.check_integrity(exact=True)


def test_split_during_write_finishes_on_both_halves():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    node = cache.match_prefix(toks("abcdef")).last_device_node
    op = cache.tiers.start_write(node)
    cache_seq(cache, dev, toks("abcxyz"))  # splits the node being written
    cache.check_integrity()
    written = cache.tiers.finish_write(op, ok=True)
    upper = node.parent
    assert written == [upper, node]  # what the tier layer backs up to L3: both halves
    assert upper.host_value + node.host_value == op.dst_pages
    assert upper.lock_ref == 0 and node.lock_ref == 0 and not upper.in_flight
    cache.check_integrity(exact=True)


def test_load_back_success_and_failure():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    _write_all(cache)
    cache.evict(100)
    m = cache.match_prefix(toks("abcdefgh"))
    op = cache.tiers.start_load_back(m)
    assert op is not None and op.src_pages == m.last_host_node.host_value
    assert len(op.dst_pages) == 6 and dev.used == 6
    assert cache.match_prefix(toks("abcdef")).device_len == 0  # still loading: not readable
    cache.check_integrity()
    cache.tiers.finish_load_back(op, ok=False)
    assert dev.used == 0 and m.last_host_node.evicted
    cache.check_integrity(exact=True)
    m = cache.match_prefix(toks("abcdef"))
    op = cache.tiers.start_load_back(m)
    cache.tiers.finish_load_back(op, ok=True)
    again = cache.match_prefix(toks("abcdef"))
    assert again.device_len == 6 and again.device_indices == op.dst_pages
    cache.check_integrity(exact=True)


def test_insert_refills_l2_only_nodes():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    _write_all(cache)
    cache.evict(100)
    pages = dev.alloc(8)
    r = cache.insert(toks("abcdefgh"), pages)
    assert r.prefix_len == 0  # nothing was on L1; the L2-only node took the pages
    assert cache.match_prefix(toks("abcdefgh")).device_indices == pages
    cache.check_integrity(exact=True)


def test_write_back_writes_on_eviction():
    cache, dev, host = full_cache(capacity=64, host_capacity=64, write_policy="write_back")
    cache_seq(cache, dev, toks("abcdef"))
    assert cache.tiers.nodes_to_write_to_host() == []
    assert cache.evict(100).full_tokens == 0  # queued for writing instead
    queued = cache.tiers.nodes_to_write_to_host()
    assert len(queued) == 1
    _write_all(cache)
    assert cache.evict(100).full_tokens == 6
    assert cache.match_prefix(toks("abcdef")).host_hit_length == 6
    cache.check_integrity(exact=True)


def test_write_through_selective_waits_for_hits():
    cache, dev, host = full_cache(capacity=64, host_capacity=64, write_policy="write_through_selective",
                                  write_through_threshold=2)
    cache_seq(cache, dev, toks("abcdef"))
    assert cache.tiers.nodes_to_write_to_host() == []
    for _ in range(5):  # one request waiting five scheduling passes: matched, never admitted
        cache.match_prefix(toks("abcdef"))
    assert cache.tiers.nodes_to_write_to_host() == []  # no hit counted by a peek
    cache.record_hit(cache.match_prefix(toks("abcdef")))
    assert cache.tiers.nodes_to_write_to_host() == []  # one hit so far
    cache.record_hit(cache.match_prefix(toks("abcdef")))
    assert len(cache.tiers.nodes_to_write_to_host()) == 1


def test_backup_and_prefetch_insert():
    cache, dev, host = full_cache(capacity=64, host_capacity=64, page_size=2)
    key = list(range(1, 9))
    cache_seq(cache, dev, key)
    _write_all(cache)
    node = cache.match_prefix(key).last_device_node
    op = cache.tiers.start_backup(node)
    assert op.hashes == cache.hashes.node_hashes(node) and node.host_lock_ref == 1
    cache.tiers.finish_backup(op, ok=True)
    assert node.host_lock_ref == 0
    # prefetched pages for the continuation of the key, inserted as L2-only nodes
    longer = key + [20, 21, 22, 23]
    hp = host.alloc(2)
    r = cache.host.insert_host(longer, hp, start_page=4)
    assert r.host_pages_taken == 2
    m = cache.match_prefix(longer)
    assert m.device_len == 8 and m.host_hit_length == 4
    hp2 = host.alloc(2)
    assert cache.host.insert_host(longer, hp2, start_page=4).host_pages_taken == 0  # duplicates freed
    cache.check_integrity(exact=True)


def test_insert_through_a_loading_node_survives_a_failed_load():
    cache, dev, host = full_cache(capacity=64, host_capacity=64)
    cache_seq(cache, dev, toks("abcdef"))
    _write_all(cache)
    cache.evict(100)
    op = cache.tiers.start_load_back(cache.match_prefix(toks("abcdef")))
    assert op is not None
    # meanwhile a request that recomputed the prefix finishes and inserts it, and more
    pages = dev.alloc(8)
    r = cache.insert(toks("abcdefgh"), pages)
    assert r.prefix_len == 0  # the loading node did not count as cached
    cache.check_integrity()
    assert cache.tiers.open_transfers == 1
    with pytest.raises(IntegrityError):
        cache.check_integrity(exact=True)  # the load's reserved pages are not the tree's yet
    cache.tiers.finish_load_back(op, ok=False)
    assert cache.tiers.open_transfers == 0
    with pytest.raises(ValueError):
        cache.tiers.finish_load_back(op, ok=False)  # exactly once
    write = cache.tiers.start_write(cache.match_prefix(toks("abcdefgh")).last_device_node)
    assert write is not None and cache.tiers.open_transfers == 1
    with pytest.raises(ValueError):
        cache.tiers.finish_load_back(write, ok=True)  # only as what it is
    cache.tiers.finish_write(write, ok=False)
    m = cache.match_prefix(toks("abcdefgh"))
    assert m.device_indices == pages  # the request's valid pages stayed
    assert dev.used == 8  # the load's spare pages were freed
    cache.check_integrity(exact=True)


def test_flush_under_write_back_drops_unwritten_data_too():
    """A flush discards: data waiting for its L2 write under ``write_back`` goes as well."""
    dev, host = PageAllocator(16, "full"), PageAllocator(16, "full-l2")
    cache = UnifiedRadixCache([FullComponent(dev, host)], 1, write_policy="write_back")
    cache.insert(toks("abcdef"), dev.alloc(6))
    assert cache.evict(6).full_tokens == 0  # eviction queues it for its write instead
    cache.flush()
    assert cache.total_size() == 0 and dev.used == 0 and cache.tiers.nodes_to_write_to_host() == []
    cache.check_integrity(exact=True)
