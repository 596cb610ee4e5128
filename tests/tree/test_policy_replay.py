"""Eviction policies: their candidate lists and SLRU's preference (trace replays: tests/replay)."""

from __future__ import annotations

from hicache.tree import TreeNode, make_policy

from .helpers import cache_seq, full_cache, toks


def test_policy_lists_are_consistent():
    for name in ("lru", "slru"):
        pol = make_policy(name)
        nodes = [TreeNode(None, toks("x"), 1) for _ in range(10)]
        for n in nodes:
            pol.add(n.data[0].dlink)
        for n in nodes[::2]:
            n.hit_count = 1
            pol.touch(n.data[0].dlink)
        pol.remove(nodes[3].data[0].dlink)
        pol.check()
        assert len(pol) == 9 and set(pol.candidates()) == set(nodes) - {nodes[3]}


def test_slru_prefers_evicting_nodes_never_reused():
    cache, dev, _ = full_cache(capacity=64, eviction_policy="slru")
    cache_seq(cache, dev, toks("aaaa"))
    cache.record_hit(cache.match_prefix(toks("aaaa")))  # re-used: promoted
    cache_seq(cache, dev, toks("bbbb"))
    cache_seq(cache, dev, toks("cccc"))
    cache.evict(4)
    assert cache.match_prefix(toks("aaaa")).device_len == 4  # LRU would have taken "aaaa"
    assert cache.match_prefix(toks("bbbb")).device_len == 0
    cache.check_integrity()
