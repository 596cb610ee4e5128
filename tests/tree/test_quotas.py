"""Per-tenant L2 quotas (``hicache.tree.quotas``) on the real tree, checked against a naive model.

Three namespaces share an L2 of 24 pages: tenant ``a`` (quota 8 pages) floods, tenant ``b``
(quota 8) has a little cached, and requests without a tenant (no quota) come and go. After
every step: ``a`` never holds more than its quota in L2; ``b``'s pages, within its quota,
are never evicted; ``a``'s own coldest pages go first (the model keeps ``a``'s L2 as an LRU
list of its prompts); the tree's integrity holds, per-root L2 counts included.
"""

from __future__ import annotations

import random

from hicache.tenants import tenant_salt
from hicache.tree.quotas import TenantQuotas
from tests.support.tree import cache_seq, full_cache

QUOTA = 8
SA, SB = tenant_salt("a", ""), tenant_salt("b", "")


def _tenant(salt: str) -> str | None:
    from hicache.tenants import split_tenant_salt

    pair = split_tenant_salt(salt)
    return None if pair is None else pair[0]


def _write_all(cache) -> None:
    """Write every node the policy wants in L2 (a controller acking at once), then empty L1."""
    for node in cache.tiers.nodes_to_write_to_host():
        op = cache.tiers.start_write(node)
        if op is not None:
            cache.tiers.finish_write(op, ok=True)
    cache.evict(10_000)


def test_a_flooding_tenant_evicts_its_own_pages_never_another_quota_tenants() -> None:
    cache, dev, host = full_cache(capacity=64, page_size=1, host_capacity=24)
    quotas = cache.tiers.quotas = TenantQuotas(cache.core, {"a": QUOTA, "b": QUOTA}, _tenant)
    b_keys = [[1000, 1001, 1002], [1000, 1001, 1003]]  # 4 pages in b's namespace
    for k in b_keys:
        cache_seq(cache, dev, k, SB)
    _write_all(cache)
    assert quotas.used("b") == 4

    rng = random.Random(7)
    a_lru: list[list[int]] = []  # the model: a's prompts in L2, coldest first (4 pages each, disjoint)
    for step in range(40):
        if rng.random() < 0.3:  # no tenant: may take any free page, and may lose its own
            cache_seq(cache, dev, [rng.randrange(5000, 6000) for _ in range(4)])
        key = [10_000 + 4 * step + j for j in range(4)]
        cache_seq(cache, dev, key, SA)
        _write_all(cache)
        a_lru.append(key)
        while 4 * len(a_lru) > QUOTA:
            a_lru.pop(0)
        assert quotas.used("a") <= QUOTA
        assert quotas.used("b") == 4  # b's pages, within its quota, stay
        for k in b_keys:
            assert cache.match_prefix(k, SB).host_hit_length == 3
        # a's L2 holds exactly its newest prompts (its own pages went first, coldest first)
        held = [k for k in ([10_000 + 4 * s + j for j in range(4)] for s in range(step + 1))
                if cache.match_prefix(k, SA).host_hit_length == 4]
        assert sorted(map(tuple, held)) == sorted(map(tuple, a_lru)), step
        cache.check_integrity(exact=True)
    usage = quotas.usage()
    assert usage["a"] == (QUOTA, QUOTA) and usage["b"] == (4, QUOTA)


def test_a_tenant_without_a_quota_and_the_default_namespace_are_evicted_as_before() -> None:
    cache, dev, host = full_cache(capacity=64, page_size=1, host_capacity=12)
    quotas = cache.tiers.quotas = TenantQuotas(cache.core, {"b": 4}, _tenant)
    cache_seq(cache, dev, [1, 2, 3, 4], SB)
    for i in range(10):  # no tenant: fills what b does not reserve, evicting its own
        cache_seq(cache, dev, [100 + 4 * i + j for j in range(4)])
        cache_seq(cache, dev, [900 + 4 * i + j for j in range(4)], tenant_salt("c", ""))
        _write_all(cache)
        assert quotas.used("b") == 4
        assert host is not None and host.used <= 12
    assert cache.match_prefix([1, 2, 3, 4], SB).host_hit_length == 4
    assert "c" in quotas.usage() and quotas.usage()["c"][1] is None
    cache.flush()  # a flush evicts everything, quotas or not
    assert quotas.used("b") == 0
