"""A request that grows the only leaf it uses extends it in place (no node per decode step)."""

from __future__ import annotations

from array import array

from hicache.memory.allocator import PageAllocator
from hicache.tree import (
    FullComponent,
    InsertParams,
    PagedInsert,
    RequestState,
    SWAComponent,
    UnifiedRadixCache,
)
from tests.support.tree import full_cache, toks


def _decode(cache: UnifiedRadixCache, dev: PageAllocator, tokens: array, first: int, step: int) -> RequestState:
    """Cache ``tokens`` as a request does that inserts after each step of ``step`` tokens."""
    ps = cache.page_size
    req = RequestState(tokens, dev.alloc(first // ps))
    cache.cache_unfinished_req(req, committed_len=first)
    for end in range(first + step, len(tokens) + 1, step):
        req.kv_pages += dev.alloc(step // ps)
        cache.cache_unfinished_req(req, committed_len=end)
        cache.check_integrity()
    return req


def test_decode_steps_extend_the_request_leaf_in_place():
    cache, dev, _ = full_cache(capacity=256, page_size=4)
    tokens = array("I", range(100, 164))
    req = _decode(cache, dev, tokens, 16, 4)
    assert cache.core.node_count == 1  # one leaf, grown 12 times
    assert req.last_node is not None and len(req.last_node.key) == 64
    assert req.prefix_len == 64 and cache.protected_size() == 64
    pages = list(req.kv_pages)
    cache.cache_finished_req(req)
    cache.check_integrity(exact=True)
    m = cache.match_prefix(tokens)
    assert m.device_len == 64 and list(m.device_indices) == pages
    assert cache.protected_size() == 0 and cache.evictable_size() == 64
    assert cache.evict(4).full_tokens == 64  # the leaf goes whole
    cache.check_integrity(exact=True)
    assert dev.used == 0


def test_a_leaf_another_request_holds_gets_a_child():
    cache, dev, _ = full_cache(capacity=256, page_size=4)
    tokens = array("I", range(100, 132))
    first = _decode(cache, dev, tokens[:16], 16, 4)  # still running: it holds its leaf
    shared = first.last_node
    req = _decode(cache, dev, tokens, 16, 4)
    assert shared.key == tokens[:16] and req.last_node.parent is shared  # a child for the first step,
    assert len(req.last_node.key) == 16 and cache.core.node_count == 2  # grown in place after it
    cache.cache_finished_req(first)
    cache.cache_finished_req(req)
    cache.check_integrity(exact=True)


def _grow(cache, dev, req: RequestState, more: str) -> None:
    req.token_ids = array("I", list(req.token_ids) + [ord(ch) for ch in more])
    req.kv_pages += dev.alloc(len(more))
    cache.cache_unfinished_req(req)


def test_a_leaf_with_an_l2_copy_is_not_extended():
    cache, dev, _ = full_cache(capacity=256, page_size=1, host_capacity=256)
    req = RequestState(toks("abcd"), dev.alloc(4))
    cache.cache_unfinished_req(req)
    leaf = req.last_node
    (node,) = cache.tiers.nodes_to_write_to_host()
    op = cache.tiers.start_write(node)
    assert op is not None
    _grow(cache, dev, req, "ef")  # a write in flight: a child
    cache.tiers.finish_write(op, True)
    assert leaf.key == toks("abcd") and req.last_node.parent is leaf
    child = req.last_node
    for node in cache.tiers.nodes_to_write_to_host():
        cache.tiers.finish_write(cache.tiers.start_write(node), True)
    _grow(cache, dev, req, "gh")  # an L2 copy: a child again
    assert child.key == toks("ef") and req.last_node.parent is child
    cache.check_integrity()


def test_a_leaf_with_page_hashes_is_not_extended():
    cache, dev, _ = full_cache(capacity=256, page_size=1)
    req = RequestState(toks("abcd"), dev.alloc(4))
    cache.cache_unfinished_req(req)
    leaf = req.last_node
    cache.hashes.node_hashes(leaf)
    _grow(cache, dev, req, "ef")
    assert leaf.key == toks("abcd") and req.last_node.parent is leaf
    _grow(cache, dev, req, "gh")  # the child has no hashes: grown in place
    assert req.last_node.key == toks("efgh")
    cache.check_integrity()


def test_auxiliary_data_keeps_its_boundaries():
    dev, swa = PageAllocator(64, "full"), PageAllocator(64, "swa")
    cache = UnifiedRadixCache([FullComponent(dev), SWAComponent(swa, 2)], 1)
    key = toks("abcd")
    r = cache.insert_with(InsertParams(key, dev.alloc(4), aux={"swa": PagedInsert(swa.alloc(4), 0, 0)}))
    longer = toks("abcdef")
    lock = cache.inc_lock_ref(r.node)
    r2 = cache.insert_with(InsertParams(longer, cache.match_prefix(key).device_indices + dev.alloc(2),
                                        prev_prefix_len=4, aux={"swa": PagedInsert([None] * 4 + swa.alloc(2), 0, 4)}))
    assert r2.node is not r.node and r.node.key == key  # SWA data on the leaf: a child, as before
    r3 = cache.insert(toks("abcdefgh"), cache.match_prefix(longer).device_indices + dev.alloc(2),
                      prev_prefix_len=6)
    assert r3.node is not r2.node  # the leaf holds SWA pages: its boundary stays
    cache.dec_lock_ref(lock)
    cache.check_integrity(exact=True)


def test_a_leaf_locked_by_another_holder_is_not_grown_by_an_insert():
    """A lock the inserting request does not own (a pin, a waiting request's hold, a running
    request that matched the leaf) keeps the leaf as it is: the new pages go to a child, which
    stays evictable once its inserter lets go."""
    cache, dev, _ = full_cache(capacity=256, page_size=4)
    tokens = array("I", range(100, 124))
    first = cache.insert(tokens[:8], dev.alloc(2))
    hold = cache.inc_lock_ref(first.node)
    r = cache.insert(tokens[:16], cache.match_prefix(tokens[:8]).device_indices + dev.alloc(2), prev_prefix_len=8)
    assert r.node is not first.node and r.node.parent is first.node
    assert cache.evict(8).full_tokens == 8  # the child, unlocked, goes
    cache.dec_lock_ref(hold)
    cache.check_integrity(exact=True)
