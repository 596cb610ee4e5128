"""End to end: per-tenant L2 quotas (``server.api_keys[].quota``) on a real daemon.

Tenant ``b`` caches a prompt; tenant ``a`` floods with prompts many times L2's size. With
quotas, ``b``'s prompt still comes back from L2 afterwards, ``a`` never holds more than its
quota there, and ``/metrics`` and ``/cache/stats`` show each tenant's use. The same flood on
the same daemon without quotas evicts ``b``'s pages: the control that shows the test can fail.
"""

from __future__ import annotations

import random
import time
from typing import Any

from conftest import DaemonFactory
from daemon import Daemon

KEY_A = "quota-alpha-key-0f3b9c2d71e84a56"
KEY_B = "quota-beta-key-5e7a1d9c3b2f4680"
QUOTA = 256


def _config(quotas: bool) -> dict[str, Any]:
    keys: list[dict[str, Any]] = [{"tenant": "a", "key": KEY_A}, {"tenant": "b", "key": KEY_B}]
    if quotas:
        for k in keys:
            k["quota"] = {"l2_tokens": QUOTA}
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 16, "l1": {"tokens": 512}, "l2": {"tokens": 1024}, "l3": {"backend": "none"},
                  "load_back_threshold": 0},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 256},
        "server": {"api_keys": keys},
        "logging": {"level": "warning"},
    }


def _generate(d: Daemon, key: str, ids: list[int]) -> dict[str, Any]:
    status, out = d.request("POST", "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
                            headers={"Authorization": f"Bearer {key}"})
    assert status == 200, (status, out, d.log())
    return out["meta_info"]


def _flood_then_b(d: Daemon) -> dict[str, Any]:
    rng = random.Random(11)
    b_prompt = [rng.randrange(3, 250) for _ in range(100)]  # 6 whole pages
    assert _generate(d, KEY_B, b_prompt)["cached_tokens"] == 0
    for _ in range(30):  # 30 x 130 tokens: far more than L1 (512) and L2 (1,024) hold
        _generate(d, KEY_A, [rng.randrange(3, 250) for _ in range(130)])
    return _generate(d, KEY_B, b_prompt)


def test_a_flooding_tenant_cannot_evict_another_tenants_pages_below_its_quota(daemons: DaemonFactory) -> None:
    d = daemons(_config(quotas=True), "quotas")
    again = _flood_then_b(d)
    assert again["cached_tokens"] == 96, again  # every whole page, from L2 (L1 was flooded)
    assert again["cached_tokens_details"]["host"] == 96
    status, stats = d.request("GET", "/cache/stats", headers={"Authorization": f"Bearer {KEY_B}"})
    assert status == 200
    assert stats["tenants"]["a"]["l2_used_tokens"] <= QUOTA and stats["tenants"]["a"]["l2_quota_tokens"] == QUOTA
    assert stats["tenants"]["b"]["l2_used_tokens"] >= 96
    deadline = time.monotonic() + 10
    while True:  # the scheduler publishes its gauges a few times a second
        samples = d.metric_samples()
        used = samples.get(("hicache_tenant_used_tokens", frozenset({("tenant", "a"), ("tier", "host")})))
        if used is not None or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert used is not None and 0 < used <= QUOTA
    assert samples[("hicache_tenant_quota_tokens", frozenset({("tenant", "b"), ("tier", "host")}))] == QUOTA


def test_without_quotas_the_same_flood_evicts_the_other_tenant(daemons: DaemonFactory) -> None:
    d = daemons(_config(quotas=False), "no-quotas")
    again = _flood_then_b(d)
    assert again["cached_tokens"] == 0, again
