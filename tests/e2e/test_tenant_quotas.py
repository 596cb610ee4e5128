"""End to end: per-tenant L2 quotas (``server.api_keys[].quota``) on a real daemon.

Tenant ``b`` caches a prompt; tenant ``a`` floods with prompts many times L2's size. With
quotas, ``b``'s prompt still comes back from L2 afterwards, ``a`` never holds more than its
quota there, and ``/metrics`` and ``/cache/stats`` show each tenant's use. The same flood on
the same daemon without quotas evicts ``b``'s pages: the control that shows the test can fail.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from tests.support.daemon import Daemon, DaemonFactory

KEY_A = "quota-alpha-key-0f3b9c2d71e84a56"
KEY_B = "quota-beta-key-5e7a1d9c3b2f4680"
KEY_OP = "quota-operator-key-8c1e4b7d2a9f3605"
"""The operator's key: ``/cache/stats`` of every tenant, a flush of everything, ``/metrics``."""
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
        "server": {"api_keys": keys, "operator": {"key": KEY_OP}},
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
    d.bearer = KEY_OP
    again = _flood_then_b(d)
    assert again["cached_tokens"] == 96, again  # every whole page, from L2 (L1 was flooded)
    assert again["cached_tokens_details"]["host"] == 96
    status, stats = d.request("GET", "/cache/stats", headers={"Authorization": f"Bearer {KEY_OP}"})
    assert status == 200
    assert stats["tenants"]["a"]["l2_used_tokens"] <= QUOTA and stats["tenants"]["a"]["l2_quota_tokens"] == QUOTA
    assert stats["tenants"]["b"]["l2_used_tokens"] >= 96
    deadline = time.monotonic() + 10
    while True:  # the scheduler publishes its gauges a few times a second (0 until a's pages are seen)
        samples = d.metric_samples()
        used = samples.get(("hicache_tenant_used_tokens", frozenset({("tenant", "a"), ("tier", "host")})))
        if used or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert used is not None and 0 < used <= QUOTA, (used, stats["tenants"])
    assert samples[("hicache_tenant_quota_tokens", frozenset({("tenant", "b"), ("tier", "host")}))] == QUOTA


def test_without_quotas_the_same_flood_evicts_the_other_tenant(daemons: DaemonFactory) -> None:
    d = daemons(_config(quotas=False), "no-quotas")
    again = _flood_then_b(d)
    assert again["cached_tokens"] == 0, again


# ------------------------------------------------------------------ L3 partitions (quota.l3_gb)

PAGE_OBJECT = 96 + 2 * 2 * 16 * 2 * 16 * 4  # header + the tiny model's float32 page of 16 tokens
GB = 1024**3


def _l3_config(tmp: Path, partitions: bool) -> dict[str, Any]:
    """L2 small, a file L3 of 36 pages: with ``partitions``, 12 of them are tenant ``a``'s own."""
    keys: list[dict[str, Any]] = [{"tenant": "a", "key": KEY_A}, {"tenant": "b", "key": KEY_B}]
    if partitions:
        keys[0]["quota"] = {"l3_gb": 12 * PAGE_OBJECT / GB}
    cfg = _config(quotas=False)
    cfg["cache"]["l3"] = {"backend": "file", "file": {"dir": str(tmp / "l3"), "max_size_gb": 36 * PAGE_OBJECT / GB}}
    cfg["cache"]["prefetch"] = {"threshold_tokens": 16}
    cfg["server"]["api_keys"] = keys
    return cfg


def _stats(d: Daemon) -> dict[str, Any]:
    status, stats = d.request("GET", "/cache/stats", headers={"Authorization": f"Bearer {KEY_OP}"})
    assert status == 200, (status, stats)
    return stats  # type: ignore[no-any-return]


def _backed_up(d: Daemon) -> None:
    """Until every page in L2 has its L3 copy (the backups of what was just computed)."""
    deadline = time.monotonic() + 20
    while True:
        tiers = _stats(d)["tiers"]
        if not tiers["in_flight"] and not tiers["writes_due"] and \
                _stats(d)["l2"]["full"]["used_tokens"] <= tiers["backup_tokens"]:
            return
        assert time.monotonic() < deadline, f"backups did not settle: {tiers}\n{d.log()}"
        time.sleep(0.2)


def _flush(d: Daemon) -> None:
    status, body = d.request("POST", "/cache/flush", headers={"Authorization": f"Bearer {KEY_OP}"})
    assert status == 200, (status, body)


def _flood_l3_then_a(d: Daemon, rng: random.Random) -> dict[str, Any]:
    """``a`` caches a prompt, L3 backs it up; ``b`` floods L3 with 30 x 8 pages; L1 and L2
    are flushed: ``a``'s prompt again, from L3 or computed."""
    a_prompt = [rng.randrange(3, 250) for _ in range(100)]  # 6 whole pages
    assert _generate(d, KEY_A, a_prompt)["cached_tokens"] == 0
    _backed_up(d)
    for _ in range(30):
        _generate(d, KEY_B, [rng.randrange(3, 250) for _ in range(130)])
        _backed_up(d)
    _flush(d)
    return _generate(d, KEY_A, a_prompt)


def _l3_gauge(d: Daemon, name: str, tenant: str) -> float:
    deadline = time.monotonic() + 10
    while True:  # the controller publishes its gauges once a second
        value = d.metric_samples().get((name, frozenset({("tenant", tenant)})))
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"no {name}{{tenant={tenant}}} in /metrics"
        time.sleep(0.3)


def test_a_tenants_l3_partition_survives_another_tenants_flood_and_holds_at_most_its_quota(
        daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_l3_config(tmp_path, partitions=True), "l3-partitions")
    d.bearer = KEY_OP
    rng = random.Random(5)
    again = _flood_l3_then_a(d, rng)
    assert again["cached_tokens"] == 96, again  # every whole page, from a's partition (L1, L2 flushed)
    assert again["cached_tokens_details"]["storage"] == 96, again
    assert len(list((tmp_path / "l3" / "tenants" / "a").glob("*/*.page"))) == 6
    assert _l3_gauge(d, "hicache_tenant_l3_quota_bytes", "a") == int(12 * PAGE_OBJECT)
    # a floods its own partition: it never holds more than its quota; b's pages stay
    b_prompt = [rng.randrange(3, 250) for _ in range(100)]
    _generate(d, KEY_B, b_prompt)
    _backed_up(d)
    for _ in range(6):
        _generate(d, KEY_A, [rng.randrange(3, 250) for _ in range(130)])
        _backed_up(d)
        assert _l3_gauge(d, "hicache_tenant_l3_used_bytes", "a") <= 12 * PAGE_OBJECT
    _flush(d)
    assert _generate(d, KEY_B, b_prompt)["cached_tokens_details"]["storage"] == 96
    assert len(list((tmp_path / "l3" / "tenants" / "a").glob("*/*.page"))) <= 12


def test_without_an_l3_partition_the_same_flood_evicts_the_tenants_l3_pages(
        daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_l3_config(tmp_path, partitions=False), "l3-shared")
    d.bearer = KEY_OP
    again = _flood_l3_then_a(d, random.Random(5))
    assert again["cached_tokens"] == 0, again
