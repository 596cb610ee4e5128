"""Core tree semantics: the seed's split bug, insert's return value, eviction, salts."""

from __future__ import annotations

import pytest

from hicache.hashing import HashNamespace, PageHasher
from hicache.memory.allocator import AllocatorError, PageAllocator
from hicache.tree import FullComponent, UnifiedRadixCache
from tests.support.tree import cache_seq, full_cache, toks


def test_seed_split_bug_match_stops_at_fork():
    cache, dev, _ = full_cache()
    cache_seq(cache, dev, toks("Hello_L.A.!"))
    cache_seq(cache, dev, toks("Hello_L.A.!world"))
    m = cache.match_prefix(toks("Hello_world"))
    assert m.device_len == 6
    node = m.last_device_node
    assert node.key == toks("Hello_")  # the node was split exactly there
    # the second request grew the first one's leaf in place (``extend_leaves``)
    assert [c.key for c in node.children.values()] == [toks("L.A.!world")]
    assert m.device_indices == cache.match_prefix(toks("Hello_L.A.!")).device_indices[:6]
    assert m.host_hit_length == 0
    cache.check_integrity(exact=True)


def test_match_returns_the_pages_of_the_prefix():
    cache, dev, _ = full_cache()
    cache_seq(cache, dev, toks("abcdef"))
    whole = cache.match_prefix(toks("abcdef")).device_indices
    part = cache.match_prefix(toks("abcxyz"))
    assert part.device_indices == whole[:3]
    assert part.last_device_node.key == toks("abc")


def test_insert_returns_length_already_cached_and_dedup_leaves_one_copy():
    cache, dev, _ = full_cache(capacity=64)
    a = toks("abcdefgh")
    pa = dev.alloc(len(a))
    assert cache.insert(a, pa).prefix_len == 0
    b = toks("abcdexyz")
    pb = dev.alloc(len(b))  # a request that computed everything itself (no match)
    r = cache.insert(b, pb)
    assert r.prefix_len == 5
    dev.free(pb[:r.prefix_len])  # the caller frees its duplicates
    # every cached token has exactly one page, and no page is leaked
    assert dev.used == 8 + 3
    assert cache.total_size() == 11
    cache.check_integrity(exact=True)
    again = dev.alloc(8)
    assert cache.insert(a, again).prefix_len == 8
    dev.free(again)
    cache.check_integrity(exact=True)


def test_page_alignment_ignores_partial_tail():
    cache, dev, _ = full_cache(page_size=4)
    key = list(range(10))  # 2 full pages + 2 tokens
    cache_seq(cache, dev, key)
    assert cache.total_size() == 8
    m = cache.match_prefix(list(range(10)))
    assert m.device_len == 8 and len(m.device_indices) == 2
    m2 = cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9])  # forks inside the second page
    assert m2.device_len == 4
    cache.check_integrity(exact=True)


def test_eviction_is_lru_leaf_first_and_skips_locked():
    cache, dev, _ = full_cache(capacity=64)
    cache_seq(cache, dev, toks("aaaa"))
    cache_seq(cache, dev, toks("bbbb"))
    cache_seq(cache, dev, toks("cccc"))
    cache.match_prefix(toks("cccc"))  # a peek: c stays the least recent
    m = cache.match_prefix(toks("aaaa"))
    cache.record_hit(m)  # a request admitted on a: now most recent
    lock = cache.inc_lock_ref(cache.match_prefix(toks("bbbb")).last_device_node)  # b locked
    assert cache.protected_size() == 4 and cache.evictable_size() == 8
    res = cache.evict(4)
    assert res.full_tokens == 4
    assert cache.match_prefix(toks("cccc")).device_len == 0  # c (oldest unlocked) went
    assert cache.match_prefix(toks("bbbb")).device_len == 4
    cache.evict(100)
    assert cache.match_prefix(toks("bbbb")).device_len == 4  # locked: never evicted
    assert cache.match_prefix(toks("aaaa")).device_len == 0
    cache.dec_lock_ref(lock)
    cache.evict(100)
    assert cache.total_size() == 0 and dev.used == 0
    assert m.device_len == 4
    cache.check_integrity(exact=True)


def test_parent_becomes_candidate_after_children_go():
    cache, dev, _ = full_cache()
    cache_seq(cache, dev, toks("prefix-a"))
    cache_seq(cache, dev, toks("prefix-b"))
    assert cache.total_size() == 9  # "prefix-" shared, then "a" and "b"
    assert cache.evict(100).full_tokens == 9
    assert cache.total_size() == 0 and dev.used == 0
    cache.check_integrity(exact=True)


def test_dec_lock_ref_refuses_to_go_below_zero():
    cache, dev, _ = full_cache()
    m = cache_seq(cache, dev, toks("abc"))
    node = cache.match_prefix(toks("abc")).last_device_node
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)
    assert m.device_len == 0
    cache.check_integrity(exact=True)


def test_cache_salt_isolates_key_spaces():
    cache, dev, _ = full_cache()
    cache_seq(cache, dev, toks("secret"), salt="tenant-a")
    assert cache.match_prefix(toks("secret"), "tenant-b").device_len == 0
    assert cache.match_prefix(toks("secret")).device_len == 0
    assert cache.match_prefix(toks("secret"), "tenant-a").device_len == 6
    cache.check_integrity(exact=True)


def test_page_hashes_chain_and_follow_splits():
    cache, dev, _ = full_cache(page_size=2)
    key = list(range(1, 13))
    cache_seq(cache, dev, key)
    hasher = PageHasher(HashNamespace("test-model", "bf16", 2))
    want = hasher.hash_pages(key)
    node = cache.match_prefix(key).last_device_node
    assert cache.hashes.node_hashes(node) == want
    assert cache.hashes.last_page_hash(node) == want[-1]
    m = cache.match_prefix(key[:6] + [99, 98])  # split after 3 pages
    assert m.last_device_node.hash_value == b"".join(bytes.fromhex(h) for h in want[:3])  # packed
    assert cache.hashes.node_hashes(node) == want[3:]
    salted = cache.match_prefix(key, "s")
    assert salted.device_len == 0
    cache_seq(cache, dev, key, salt="s")
    snode = cache.match_prefix(key, "s").last_device_node
    assert cache.hashes.node_hashes(snode) == PageHasher(hasher.namespace.with_salt("s")).hash_pages(key)
    cache.check_integrity(exact=True)


def test_cache_finished_and_unfinished_req():
    from hicache.tree import RequestState

    cache, dev, _ = full_cache(page_size=2, capacity=64)
    tokens = list(range(100, 111))  # 11 tokens: 5 full pages + 1
    req = RequestState(tokens, dev.alloc(3))  # chunk 1: 6 tokens computed, 3 pages
    cache.cache_unfinished_req(req, committed_len=6)
    assert req.prefix_len == 6 and req.lock is not None
    assert cache.protected_size() == 6
    req.kv_pages += dev.alloc(3)
    cache.cache_finished_req(req)
    assert cache.total_size() == 10 and cache.protected_size() == 0
    assert dev.used == 5
    cache.check_integrity(exact=True)


def test_allocator_contract():
    a = PageAllocator(4)
    assert a.can_alloc(4) and not a.can_alloc(5)
    assert a.alloc(5) is None and a.free_count == 4
    got = a.alloc(3)
    assert sorted(got) == [0, 1, 2] and a.used == 3
    with pytest.raises(AllocatorError, match="double free"):
        a.free([3])
    with pytest.raises(AllocatorError, match="outside"):
        a.free([7])
    with pytest.raises(AllocatorError, match="twice"):
        a.free([got[0], got[0]])
    assert a.used == 3  # nothing changed by the failures
    a.free(got)
    assert a.free_count == 4 and a.used == 0
    a.check()


def test_constructor_validation():
    with pytest.raises(ValueError):
        UnifiedRadixCache([], 1)
    with pytest.raises(ValueError):
        UnifiedRadixCache([FullComponent(PageAllocator(4))], 1, eviction_policy="nope")


def test_allocator_array_indices():
    from array import array

    a = PageAllocator(6, array_indices=True)
    got = a.alloc(4)
    assert isinstance(got, array) and sorted(got) == [0, 1, 2, 3]
    assert isinstance(a.empty(), array) and isinstance(a.alloc(0), array)
    with pytest.raises(AllocatorError, match="double free"):
        a.free([5])
    a.free(got[:2])
    a.free([got[2], got[3]])  # a list is accepted too
    assert a.free_count == 6
    a.check()
    b = PageAllocator(3, checked=False)
    b.alloc(1)
    with pytest.raises(AllocatorError):
        b.free([0, 1])  # more than was allocated: refused even without tracking


def test_cache_with_array_indices_returns_arrays():
    from array import array

    dev = PageAllocator(32, array_indices=True)
    cache = UnifiedRadixCache([FullComponent(dev)], 1)
    cache_seq(cache, dev, toks("abcdef"))
    m = cache.match_prefix(toks("abcxyz"))
    assert isinstance(m.device_indices, array) and len(m.device_indices) == 3
    assert isinstance(cache.match_prefix(toks("zzz")).device_indices, array)
    cache.check_integrity(exact=True)


def test_a_match_is_a_peek_and_record_hit_counts_once_what_is_still_there():
    cache, dev, _ = full_cache(capacity=64)
    cache_seq(cache, dev, toks("aaaabbbb"))
    cache_seq(cache, dev, toks("cccc"))  # the most recent
    for _ in range(3):
        m = cache.match_prefix(toks("aaaabbbb"))
    node = m.last_device_node
    assert node.hit_count == 0  # three peeks
    cache.evict(4)
    assert cache.match_prefix(toks("aaaabbbb")).device_len == 0  # still the oldest: evicted first
    cache_seq(cache, dev, toks("aaaabbbb"))
    m = cache.match_prefix(toks("aaaabbbb"))
    cache.record_hit(m)
    assert m.last_device_node.hit_count == 1
    cache.evict(4)  # now "cccc" is the oldest
    assert cache.match_prefix(toks("cccc")).device_len == 0
    stale = cache.match_prefix(toks("aaaabbbb"))
    cache.evict(100)  # the matched nodes are removed before the hit is recorded ...
    cache.record_hit(stale)  # ... which then counts nothing and changes nothing (no crash)
    assert stale.last_device_node.hit_count == 1
    assert cache.total_size() == 0
    cache.check_integrity(exact=True)


def test_record_hit_after_the_path_was_split_counts_the_path_as_it_is_now():
    """A match remembers its path; a split on it between the match and ``record_hit`` (another
    request's insert forking inside a node) makes ``record_hit`` walk the tree as it is now:
    both halves of the split node count the hit and are touched."""
    cache, dev, _ = full_cache(capacity=64)
    cache_seq(cache, dev, toks("aaaabbbb"))
    m = cache.match_prefix(toks("aaaabbbb"))
    assert m.path == [m.walked_node] and m.walked_node is m.last_device_node
    cache_seq(cache, dev, toks("aaaacc"))  # splits the matched node after "aaaa"
    upper = m.walked_node.parent
    assert upper is not None and upper.parent is not None and len(upper.key) == 4  # the new upper half
    cache.record_hit(m)
    assert (upper.hit_count, m.walked_node.hit_count) == (2, 1)  # the upper half: "aaaacc"'s hit too
    cache.evict(2)  # "cc", not touched by the hit, is the oldest leaf now
    assert cache.match_prefix(toks("aaaacc")).device_len == 4
    assert cache.match_prefix(toks("aaaabbbb")).device_len == 8
    cache.check_integrity(exact=True)
