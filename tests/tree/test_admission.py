"""Tier admission: the doorkeeper and ``write_through_filtered``'s cold writes."""

from __future__ import annotations

import pytest

from hicache.tree.admission import Doorkeeper
from tests.support.tree import cache_seq, full_cache, toks


def test_doorkeeper_remembers_other_owners_within_two_generations():
    d = Doorkeeper(capacity=2)
    assert not d.seen_before("a", 1)
    assert not d.seen_before("a", 1)  # the same owner again: no second sighting
    assert d.seen_before("a", 2)  # came back in another node
    assert d.seen_before("a", 2)  # the answer stays for that owner
    for k in ("b", "c", "d", "e"):
        d.seen_before(k, 9)
    assert len(d) <= 4 and d.rotations >= 2  # bounded: two generations of 2
    assert not d.seen_before("a", 3)  # forgotten
    with pytest.raises(ValueError):
        Doorkeeper(0)


def _write(cache, key):
    node = cache.match_prefix(toks(key)).last_device_node
    cold = cache.tiers.writes_cold(node)
    op = cache.tiers.start_write(node)
    assert op is not None and op.cold == cold
    cache.tiers.finish_write(op, True)
    return cold


@pytest.mark.parametrize("policy", ["write_through_filtered", "write_through"])
def test_filtered_writes_cold_what_it_saw_once_and_hot_what_came_back(policy):
    cache, dev, host = full_cache(capacity=64, host_capacity=4, write_policy=policy)
    for key in ("ab", "cd"):
        cache_seq(cache, dev, toks(key))
        assert not _write(cache, key)  # L2 has free pages: hot
    cache.evict(64)  # both L2-only now
    cache_seq(cache, dev, toks("ef"))
    assert _write(cache, "ef") == (policy == "write_through_filtered")  # L2 full, seen once
    cache.evict(64)
    cache_seq(cache, dev, toks("gh"))
    _write(cache, "gh")  # room for it: the coldest L2-only node goes
    cd, ef = cache.match_prefix(toks("cd")).host_hit_length, cache.match_prefix(toks("ef")).host_hit_length
    if policy == "write_through_filtered":
        assert (cd, ef) == (2, 0)  # the cold copy went first, "cd" stayed
    else:
        assert (cd, ef) == (0, 2)  # plain LRU: the older "cd" went
    cache.check_integrity()
    if policy == "write_through_filtered":
        cache.evict(64)
        cache_seq(cache, dev, toks("ef"))  # recomputed: the same first page hash, a new node
        node = cache.match_prefix(toks("ef")).last_device_node
        assert not cache.tiers.writes_cold(node)  # the doorkeeper saw it before: hot
