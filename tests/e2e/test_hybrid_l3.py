"""End to end: a hybrid prefix (Full + SWA, Full + Mamba, Full + SWA + Mamba, and the
all-SWA patterns SWA only and SWA + Mamba, whose Full component is index-only) survives L2
eviction and a restart through L3, with a file store and with a real ``redis-server``.

SWA pages and Mamba states are backed up to L3 with their node's Full pages and prefetched
with them, so a daemon whose L1 and L2 are empty (flushed, or freshly started) still finds
the prompt's prefix up to its last valid boundary in L3. The oracle: the greedy output of
an L3 hit is identical to the cold run's. The hit rates (cached tokens / prompt tokens) are
printed (``-s``) for each case.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.local_redis import started
from tests.support.daemon import Daemon
from tests.support.redis_servers import REDIS_SERVER

LAYERS = {"swa": ["full", "swa"], "mamba": ["full", "mamba"], "swa+mamba": ["full", "swa", "mamba", "full"],
          "swa-only": ["swa", "swa"], "swa+mamba-only": ["swa", "mamba"]}
"""The last two have no full-attention layer: their Full component is index-only, each of
its pages an index marker in L3, and all their KV goes as SWA objects."""
PROMPT = 203


def _config(tmp: Path, layers: list[str], ps: int, l3: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny", "layers": layers, "sliding_window": 16}},
        "cache": {"page_size": ps, "l1": {"tokens": 2048, "state_slots": 16},
                  "l2": {"tokens": 8192, "state_slots": 64}, "l3": l3,
                  "prefetch": {"threshold_tokens": 1, "policy": "wait_complete"}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }


def _round(tmp: Path, kind: str, ps: int, l3: dict[str, Any], label: str) -> None:
    rng = random.Random(ps * 31 + len(kind))
    prompt = [rng.randrange(1, 250) for _ in range(PROMPT)]
    boundary = (len(prompt) - 1) // ps * ps  # the prompt's last page boundary before its last token
    cfg = _config(tmp, LAYERS[kind], ps, l3)
    d = Daemon(tmp, cfg, f"{label}-a")
    d.start()
    try:
        cold = d.generate(prompt)
        assert cold["meta_info"]["cached_tokens"] == 0, cold["meta_info"]
        d.wait_tiers_idle("writes and backups done")
        status, _ = d.request("POST", "/cache/flush")
        assert status == 200
        flushed = d.generate(prompt)
        assert flushed["output_ids"] == cold["output_ids"]
        fl = flushed["meta_info"]["cached_tokens_details"]
        assert fl["storage"] > 0, flushed["meta_info"]
        d.wait_tiers_idle("writes and backups done")
    finally:
        assert d.stop() == 0
    d2 = Daemon(tmp, cfg, f"{label}-b")
    d2.start()
    try:
        again = d2.generate(prompt)
        assert again["output_ids"] == cold["output_ids"]
        det = again["meta_info"]["cached_tokens_details"]
        assert det["storage"] > 0, again["meta_info"]
        assert again["meta_info"]["cached_tokens"] == boundary, (again["meta_info"], boundary)
        print(f"\nHITRATE {label} {kind} ps={ps}: after flush {fl['storage']}/{len(prompt)} "
              f"= {fl['storage'] / len(prompt):.3f}, after restart {det['storage']}/{len(prompt)} "
              f"= {det['storage'] / len(prompt):.3f} (boundary {boundary})")
    finally:
        assert d2.stop() == 0


FILE_CASES = [(kind, ps) for ps in (1, 16) for kind in LAYERS] + [("swa+mamba", 64)]
"""Every pattern at page 1 (a boundary at every token) and page 16; page 64 (the prompt's
last boundary far before its end) for the pattern with every component."""
REDIS_CASES = [("swa+mamba", 1), ("swa+mamba-only", 1)]
"""Redis with and without Full pages: the pattern changes which objects the controller
writes, not the code that writes them (the file half runs every pattern through the same
storage I/O); page 1 gives Redis the most objects per batch."""


@pytest.mark.parametrize(("kind", "ps"), FILE_CASES)
def test_hybrid_prefix_from_file_l3_after_flush_and_restart(tmp_path: Path, kind: str, ps: int) -> None:
    _round(tmp_path, kind, ps, {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}, "file")


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (apt-get install redis-server)")
@pytest.mark.parametrize(("kind", "ps"), REDIS_CASES)
def test_hybrid_prefix_from_redis_l3_after_flush_and_restart(tmp_path: Path, kind: str, ps: int) -> None:
    """Redis: ``REDIS_CASES``."""
    with started(tmp_path / "redis") as server:
        _round(tmp_path, kind, ps, {"backend": "redis", "redis": {"url": server.url, "key_prefix": "hyb",
                                                                   "timeout_s": 2.0}}, "redis")
