"""Eviction policies and the trace replay helper."""

from __future__ import annotations

import json
import os

import pytest

from hicache.tree import SLRUPolicy, TreeNode, make_policy
from hicache.tree.replay_core import block_tokens, load_mooncake, replay

from .helpers import cache_seq, full_cache, toks

TRACES = "/work/shared/traces"


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
    cache.match_prefix(toks("aaaa"))  # re-used: promoted
    cache_seq(cache, dev, toks("bbbb"))
    cache_seq(cache, dev, toks("cccc"))
    cache.evict(4)
    assert cache.match_prefix(toks("aaaa")).device_len == 4  # LRU would have taken "aaaa"
    assert cache.match_prefix(toks("bbbb")).device_len == 0
    cache.check_integrity()
    assert isinstance(make_policy("slru"), SLRUPolicy)


def test_replay_counts_block_prefix_hits():
    reqs = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9]]
    st = replay(reqs, capacity_blocks=100)
    assert (st.hit_blocks, st.total_blocks) == (0 + 2 + 3 + 0, 11)
    assert replay(reqs, capacity_blocks=3).hit_blocks < st.hit_blocks
    assert block_tokens([2, 5], 3) == [6, 7, 8, 15, 16, 17]
    assert replay(reqs, 100, tokens_per_block=4).hit_blocks == st.hit_blocks


def test_load_mooncake_rejects_bad_records(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "hash_ids": [1, 2]}) + "\n" + "{}\n")
    with pytest.raises(ValueError, match=":2:"):
        load_mooncake(p)


@pytest.mark.skipif(not os.path.exists(f"{TRACES}/synthetic/sglang_gsp_default_p64.jsonl"),
                    reason="shared traces not present")
def test_lru_replay_close_to_reference_hit_rate():
    reqs = load_mooncake(f"{TRACES}/synthetic/sglang_gsp_default_p64.jsonl")
    rate = replay(reqs, 2048).hit_rate
    assert abs(rate - 0.756) < 0.02  # the traces' README: LRU 75.6% at 2,048 blocks
