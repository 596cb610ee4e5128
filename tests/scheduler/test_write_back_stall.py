"""``write_back`` with tenants' L2 quotas: no request waits on a write that can never start.

Two quota tenants fill L2 with their quotas (together all of L2); a tenant without a quota
then sends requests that need L1 room. Under ``write_back`` L1 eviction keeps a node not in
L2 and queues its write, but that write needs L2 room no quota tenant gives up. The node's
data must then be reclaimable (dropped, as ``write_through`` would): every request
finishes, with its cold output, and the quota tenants' requests after it too.
"""

from __future__ import annotations

import random

from hicache.config import config_from_dict
from hicache.tenants import tenant_salt
from tests.support.rigs import L2Rig, cold_tokens, gen

PAGE = 16


def _cfg(write_policy: str = "write_back", l2: bool = True) -> object:
    """L1 512 tokens, L2 768 of which each quota tenant holds 384; ``l2`` False: the cold
    oracle (no L2, so no quotas either)."""
    quota = {"quota": {"l2_tokens": 384}} if l2 else {}
    keys = [{"tenant": "acme", "key": "acme-key-0123456789", **quota},
            {"tenant": "globex", "key": "globex-key-0123456789", **quota},
            {"tenant": "free", "key": "free-key-0123456789"}]
    return config_from_dict({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": PAGE, "l1": {"tokens": 512},
                  "l2": {"tokens": 768} if l2 else {"enabled": False}, "l3": {"backend": "none"},
                  "write_policy": write_policy},
        "scheduler": {"chunked_prefill_tokens": 128, "max_prefill_tokens": 256},
        "server": {"api_keys": keys},
    })


def _req(rid: str, tenant: str, ids: list[int]):  # type: ignore[no-untyped-def]
    msg = gen(rid, ids, 4)
    msg.cache_salt = tenant_salt(tenant, "")
    return msg


def test_a_tenant_without_quota_is_served_when_quota_tenants_hold_all_of_l2() -> None:
    rng = random.Random(46)
    prompts = {f"{t}{i}": (t, [rng.randrange(3, 500) for _ in range(rng.randrange(100, 300))])
               for t in ("acme", "globex") for i in range(8)}
    free = {f"free{i}": ("free", [rng.randrange(3, 500) for _ in range(rng.randrange(150, 300))]) for i in range(10)}
    after = {"acme-after": ("acme", [rng.randrange(3, 500) for _ in range(300)])}
    rig = L2Rig(_cfg())
    try:
        for batch in (prompts, free, after):
            rig.run([_req(rid, t, ids) for rid, (t, ids) in batch.items()], max_steps=2000)
        usage = rig.cache.tiers.quotas.usage()  # type: ignore[union-attr]
        assert all(used <= quota for used, quota in usage.values() if quota is not None), usage
        cold = _cfg(l2=False)
        for rid, (_tenant, ids) in {**prompts, **free, **after}.items():
            final = rig.final(rid)
            assert final.finish_reason == "length", (rid, final.error)
            assert rig.tokens(rid) == cold_tokens(cold, rid, ids, 4), rid  # type: ignore[arg-type]
    finally:
        rig.close()
