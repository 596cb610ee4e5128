"""Small builders used by several tree tests."""

from __future__ import annotations

from array import array

from hicache.hashing import HashNamespace
from hicache.memory.allocator import PageAllocator
from hicache.tree import FullComponent, UnifiedRadixCache
from hicache.tree.cache import InsertParams

NS = HashNamespace(model_identity="test-model", kv_dtype="bf16", page_size=1)


def toks(s: str) -> array:
    """A string as a key (one token per character), in the tree's key type."""
    return array("I", [ord(ch) for ch in s])


def full_cache(capacity: int = 256, page_size: int = 1, host_capacity: int | None = None,
               **kw) -> tuple[UnifiedRadixCache, PageAllocator, PageAllocator | None]:
    dev = PageAllocator(capacity, "l1")
    host = PageAllocator(host_capacity, "l2") if host_capacity is not None else None
    ns = HashNamespace("test-model", "bf16", page_size)
    cache = UnifiedRadixCache([FullComponent(dev, host)], page_size, hasher=ns, **kw)
    return cache, dev, host


def cache_seq(cache: UnifiedRadixCache, alloc: PageAllocator, key: list[int], salt: str = ""):
    """What a scheduler does for one request: match, count its hit (admitted), lock, allocate
    the rest, insert, free duplicates and the unaligned tail, unlock. Returns the match."""
    ps = cache.page_size
    m = cache.match_prefix(key, salt)
    cache.record_hit(m)
    lock = cache.inc_lock_ref(m.last_device_node)
    have = len(m.device_indices)
    need = -(-len(key) // ps) - have
    new = alloc.alloc(need)
    if new is None:
        cache.evict(need * ps)
        new = alloc.alloc(need)
    assert new is not None
    pages = m.device_indices + new
    r = cache.insert_with(InsertParams(key, pages, salt, prev_prefix_len=m.device_len, owner=lock.node))
    dup = pages[have:r.prefix_len // ps]
    alloc.free(dup)
    alloc.free(pages[len(key) // ps:])
    cache.dec_lock_ref(lock)
    cache.check_integrity(exact=not cache.tiers.open_transfers)  # no leak when nothing is in flight
    return m
