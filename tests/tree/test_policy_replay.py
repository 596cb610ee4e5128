"""Eviction policies: their candidate lists and SLRU's preference (trace replays: tests/replay)."""

from __future__ import annotations

import random

from hicache.tree import POLICIES, TreeNode, make_policy
from tests.support.tree import cache_seq, full_cache, toks


def test_policy_lists_are_consistent():
    for name in sorted(POLICIES):
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


def _nodes(n: int) -> list[TreeNode]:
    return [TreeNode(None, toks(chr(ord("a") + i)), 1) for i in range(n)]


def test_sieve_order_visited_bits_and_persistent_hand():
    pol = make_policy("sieve")
    a, b, c, d = _nodes(4)
    for n in (a, b, c, d):
        pol.add(n.data[0].dlink)
    pol.touch(b.data[0].dlink)
    pol.touch(d.data[0].dlink)
    # lap 1: a offered, b's bit cleared, c offered, d's bit cleared; lap 2: all four
    assert list(pol.candidates()) == [a, c, a, b, c, d]
    pol.touch(b.data[0].dlink)
    it = pol.candidates()
    assert next(it) is a
    pol.remove(a.data[0].dlink)  # taken: the hand stays at b
    it.close()
    assert next(pol.candidates()) is c  # b visited again: passed over, not moved
    pol.check()


def test_arc_order_and_ghost_adaptation():
    pol = make_policy("arc")
    a, b, c = _nodes(3)
    for n in (a, b, c):
        pol.add(n.data[0].dlink)
    b.hit_count = 1
    pol.touch(b.data[0].dlink)  # re-used: T1 -> T2
    assert list(pol.candidates()) == [a, c, b]  # |T1| = 2 > p = 0: T1 first
    pol.remove(a.data[0].dlink)  # a's fingerprint -> B1
    a2 = TreeNode(None, toks("a"), 1)  # the same place in the tree again: a B1 hit
    pol.add(a2.data[0].dlink)
    assert pol.p == 1.0
    assert list(pol.candidates()) == [b, a2, c]  # |T1| = 1, not above p: T2 first
    pol.remove(b.data[0].dlink)  # b -> B2
    b2 = TreeNode(None, toks("b"), 1)
    pol.add(b2.data[0].dlink)  # a B2 hit lowers p
    assert pol.p == 0.0
    assert list(pol.candidates()) == [c, a2, b2]
    pol.check()


def test_new_policies_keep_locked_and_inner_nodes():
    for name in ("sieve", "arc"):
        cache, dev, _ = full_cache(capacity=64, eviction_policy=name)
        cache_seq(cache, dev, toks("aaaa"))
        cache_seq(cache, dev, toks("aabb"))
        lock = cache.inc_lock_ref(cache.match_prefix(toks("aabb")).last_device_node)
        res = cache.evict(64)
        assert res.full_tokens == 2  # only "aa" under "aa"'s other branch could go
        assert cache.match_prefix(toks("aabb")).device_len == 4
        cache.dec_lock_ref(lock)
        assert cache.evict(64).full_tokens == 4
        cache.check_integrity()


def test_demote_makes_an_entry_the_next_offered():
    for name in sorted(POLICIES):
        pol = make_policy(name)
        nodes = _nodes(4)
        for n in nodes:
            pol.add(n.data[0].dlink)
        pol.demote(nodes[2].data[0].dlink)
        assert next(pol.candidates()) is nodes[2], name
        assert len(pol) == 4
        pol.check()


def test_touch_all_orders_every_policy_as_one_touch_at_a_time():
    """``touch_all`` (LRU: a splice per run already in order) leaves each policy's
    candidates exactly as touching the links one by one does: random lists, random paths
    (runs in order, out of order, at the MRU end, repeated), checked against the plain loop."""
    rnd = random.Random(7)
    for name in sorted(POLICIES):
        for _ in range(200):
            fast, slow = make_policy(name), make_policy(name)
            a, b = _nodes(12), _nodes(12)
            for x, y in zip(a, b, strict=True):
                fast.add(x.data[0].dlink)
                slow.add(y.data[0].dlink)
            for _ in range(rnd.randrange(1, 6)):
                k = rnd.randrange(1, 12)
                if rnd.random() < 0.5:  # a run of the current order, as a touched path leaves it
                    start = rnd.randrange(0, 12 - k + 1)
                    picks = [a.index(link.owner) for link in fast.links()][start:start + k]
                else:
                    picks = rnd.sample(range(12), k)
                for i in picks:
                    a[i].hit_count = b[i].hit_count = rnd.randrange(0, 3)
                fast.touch_all([a[i].data[0].dlink for i in picks])
                for i in picks:
                    slow.touch(b[i].data[0].dlink)
                fast.check()
                assert [a.index(x.owner) for x in fast.links()] == [b.index(x.owner) for x in slow.links()], name
            assert [a.index(n) for n in fast.candidates()] == [b.index(n) for n in slow.candidates()], name
