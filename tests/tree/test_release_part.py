"""``UnifiedRadixCache.release_part``: one component's part of a lock given back early."""

from __future__ import annotations

import pytest

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

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


def _cache() -> tuple[UnifiedRadixCache, PageAllocator, PageAllocator, PageAllocator]:
    dev, swa, mamba = PageAllocator(64, "full"), PageAllocator(64, "swa"), PageAllocator(8, "mamba")
    cache = UnifiedRadixCache([FullComponent(dev), SWAComponent(swa, 4), MambaComponent(mamba)], 1)
    key = toks("abcdefgh")
    cache.insert_with(InsertParams(key, dev.alloc(len(key)),
                                   aux={"swa": PagedInsert(swa.alloc(len(key))), "mamba": mamba.alloc(1)[0]}))
    return cache, dev, swa, mamba


def _protected(cache: UnifiedRadixCache) -> dict[ComponentType, int]:
    return {k: cache.protected_size(k) for k in (FULL, SWA, MAMBA)}


@pytest.mark.parametrize("name", ["full", "swa", "mamba"])
def test_release_part_unlocks_that_component_only(name: str) -> None:
    cache, *_ = _cache()
    node = cache.match_prefix(toks("abcdefgh"), copy_on_match=False).last_device_node
    token = cache.inc_lock_ref(node)
    locked = _protected(cache)
    assert all(locked.values())
    kind = cache.component(name).ctype
    token = cache.release_part(token, name)
    after = _protected(cache)
    assert after[kind] == 0
    assert {k: v for k, v in after.items() if k is not kind} == {k: v for k, v in locked.items() if k is not kind}
    assert cache.release_part(token, name) is token  # again: nothing changes
    assert _protected(cache) == after
    cache.dec_lock_ref(token)  # the rest, once
    assert not any(_protected(cache).values())
    cache.check_integrity(exact=True)


def test_the_released_part_becomes_evictable_while_the_rest_stays_locked() -> None:
    cache, *_ = _cache()
    node = cache.match_prefix(toks("abcdefgh"), copy_on_match=False).last_device_node
    token = cache.release_part(cache.inc_lock_ref(node), "swa")
    assert cache.evictable_size(SWA) == cache.total_size(SWA) > 0  # the window is released
    assert cache.evictable_size(FULL) == 0  # the Full lock holds
    cache.dec_lock_ref(token)
    cache.check_integrity(exact=True)


def test_releasing_every_part_leaves_nothing_to_unlock() -> None:
    cache, *_ = _cache()
    node = cache.match_prefix(toks("abcdefgh"), copy_on_match=False).last_device_node
    token = cache.inc_lock_ref(node)
    for name in ("swa", "full", "mamba"):
        token = cache.release_part(token, name)
    assert not any(_protected(cache).values())
    cache.dec_lock_ref(token)
    for kind in (FULL, SWA, MAMBA):  # nothing stays locked: everything is evictable
        assert cache.evictable_size(kind) == cache.total_size(kind) > 0, kind
    cache.check_integrity(exact=True)


def test_a_full_only_cache_releases_its_one_part() -> None:
    dev = PageAllocator(16, "full")
    cache = UnifiedRadixCache([FullComponent(dev)], 1)
    key = toks("abcd")
    cache.insert(key, dev.alloc(4))
    token = cache.inc_lock_ref(cache.match_prefix(key).last_device_node)
    token = cache.release_part(token, "full")
    assert cache.protected_size() == 0
    cache.dec_lock_ref(token)
    cache.check_integrity(exact=True)
