"""End to end: a real ``hicache serve`` with tenant API keys (``server.api_keys``).

A tenant's repeated prompt hits its own cached pages; another tenant's identical prompt gets
none, from L1/L2 or from L3 (no prefetch of the first tenant's pages either), whatever
``cache_salt`` it sends, including salts built to imitate the first tenant's namespace. Keys
come inline, from a file and from an environment variable, and never reach the log.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from hicache.tenants import TENANT_SALT_TAG, tenant_salt
from tests.support.daemon import Daemon, DaemonFactory

KEY_A = "e2e-alpha-key-6b1f0c9d2e7a4b38"
KEY_A2 = "e2e-alpha-rotated-4d9e2a7c1b05f3e6"
KEY_B = "e2e-beta-key-93c0a1e57d2b4f68"
KEY_ENV = "HC_E2E_TENANT_KEY_B"


def _call(d: Daemon, method: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    return d.request(method, path, body, headers=None if key is None else {"Authorization": f"Bearer {key}"})


def _generate(d: Daemon, key: str, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = _call(d, "POST", "/generate", body, key)
    assert status == 200, (status, out, d.log())
    return out["meta_info"] | {"output_ids": out["output_ids"]}


def test_tenants_share_nothing_in_any_tier(daemons: DaemonFactory, tmp_path: Path) -> None:
    key_file = tmp_path / "alpha-rotated.key"
    key_file.write_text(KEY_A2 + "\n")
    d = daemons({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"tokens": 8192},
                  "l3": {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "server": {"api_keys": [{"tenant": "alpha", "key": KEY_A}, {"tenant": "alpha", "key_file": str(key_file)},
                                {"tenant": "beta", "key_env": KEY_ENV}]},
        "logging": {"level": "debug"},
    }, env={KEY_ENV: KEY_B})
    prompt = [random.Random(7).randrange(1, 250) for _ in range(320)]
    body = {"input_ids": prompt[:8], "sampling_params": {"max_new_tokens": 1}}

    # authentication
    for key in (None, "wrong", KEY_A[:-1], KEY_B + "0"):
        status, err = _call(d, "POST", "/generate", body, key)
        assert status == 401 and err["error"]["type"] == "authentication_error", (key, status, err)
    assert _call(d, "GET", "/cache/stats")[0] == 401
    assert _call(d, "GET", "/health")[0] == 200
    for key in (None, KEY_A):  # every tenant's series: the operator's (none is configured here)
        status, metrics = _call(d, "GET", "/metrics", key=key)
        assert status in (401, 403) and "hicache_requests_total" not in str(metrics), (key, status)

    # one tenant, two keys (inline and key_file): the second request hits the first one's pages
    first = _generate(d, KEY_A, prompt)
    assert first["cached_tokens"] == 0, first
    again = _generate(d, KEY_A2, prompt)
    assert again["cached_tokens"] >= 316 and again["output_ids"] == first["output_ids"], again

    # the other tenant (key_env) gets nothing, whatever salt it picks
    # (distinct salts: a salt beta used before would hit beta's own pages)
    imitations = ["", tenant_salt("alpha", ""), tenant_salt("alpha", "")[len(TENANT_SALT_TAG):], ":alpha:",
                  "\x00tenant:5:alpha", "alpha"]
    assert len(set(imitations)) == len(imitations)
    for salt in imitations:
        other = _generate(d, KEY_B, prompt, salt)
        assert other["cached_tokens"] == 0, (salt, other)
        assert other["output_ids"] == first["output_ids"]

    # L3: once L1 and L2 are flushed, alpha's pages are only in L3; beta's requests (with salts
    # it has not used yet) neither load nor prefetch them, while alpha's own request does
    time.sleep(1.5)  # let write-through to L3 finish
    assert _call(d, "POST", "/cache/flush", None, KEY_A)[0] == 200  # alpha's own namespace
    for salt in ("x", tenant_salt("alpha", "x"), "\x00" + tenant_salt("alpha", "")):
        other = _generate(d, KEY_B, prompt, salt)
        details = other["cached_tokens_details"]
        assert other["cached_tokens"] == 0 and details["storage"] == 0 and details["host"] == 0, (salt, other)
    mine = _generate(d, KEY_A, prompt)
    assert mine["cached_tokens_details"]["storage"] >= 300, mine
    assert mine["output_ids"] == first["output_ids"]

    log = d.log_path.read_text(errors="replace")
    assert "3 API key(s) for 2 tenant(s): alpha, beta" in log, log[-4000:]
    for key in (KEY_A, KEY_A2, KEY_B):
        assert key not in log
