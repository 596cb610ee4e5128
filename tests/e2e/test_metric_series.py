"""End to end, ``/metrics``: every labelled series exists at 0 right after start, and the L3
size gauges match what the file store holds."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from tests.support.daemon import Daemon, DaemonFactory

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# (sample name, label, values): written out here, not taken from hicache.metrics, so a series
# dropped from the code's table fails the test.
EXPECTED_ZERO = (
    ("hicache_cached_tokens_total", "tier", ("device", "host", "storage")),
    ("hicache_requests_total", "status", ("ok", "invalid", "aborted", "error")),
    ("hicache_evicted_tokens_total", "tier", ("device", "host")),
    ("hicache_transfer_bytes_total", "direction", ("d2h", "h2d", "h2s", "s2h")),
    ("hicache_transfer_seconds_count", "direction", ("d2h", "h2d", "h2s", "s2h")),
    ("hicache_storage_errors_total", "op", ("get", "set", "exists", "delete")),
    ("hicache_process_restarts_total", "process", ("controller",)),
)


def _config(tmp: Path) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"tokens": 8192},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }


def _samples(d: Daemon) -> Samples:
    return d.metric_samples()


def _store(root: Path) -> tuple[int, int]:
    """Pages and bytes of the file store, counted on disk."""
    files = [p for p in root.glob("*/*.page") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def test_every_labelled_series_is_zero_right_after_start(daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_config(tmp_path))
    samples = _samples(d)
    missing, nonzero = [], []
    for name, label, values in EXPECTED_ZERO:
        for value in values:
            key = (name, frozenset({(label, value)}))
            if key not in samples:
                missing.append(f"{name}{{{label}={value!r}}}")
            elif samples[key] != 0:
                nonzero.append(f"{name}{{{label}={value!r}}} = {samples[key]}")
    assert not missing, f"series absent right after start: {missing}"
    assert not nonzero, f"series not 0 right after start: {nonzero}"
    for tier, component in (("device", "full"), ("host", "full")):  # gauges set by the first publish
        key = ("hicache_pool_capacity_tokens", frozenset({("tier", tier), ("component", component)}))
        assert samples.get(key, 0) > 0, (key, sorted(k for k in samples if k[0].startswith("hicache_pool")))
    assert samples.get(("hicache_storage_pages", frozenset())) == 0
    assert samples.get(("hicache_storage_bytes", frozenset())) == 0


def test_storage_size_gauges_match_the_file_store(daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_config(tmp_path))
    rng = random.Random(7)
    for _ in range(4):
        d.generate([rng.randrange(1, 250) for _ in range(96)], 4)
    root = tmp_path / "l3"
    deadline = time.monotonic() + 30
    seen: tuple[Any, ...] = ()
    while time.monotonic() < deadline:
        pages, nbytes = _store(root)
        samples = _samples(d)
        gauges = (samples.get(("hicache_storage_pages", frozenset())),
                  samples.get(("hicache_storage_bytes", frozenset())))
        seen = ((pages, nbytes), gauges)
        if pages > 0 and gauges == (pages, nbytes) and _store(root) == (pages, nbytes):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"the L3 gauges never matched the store (store, gauges): {seen}\n{d.log()}")
    assert pages >= 4 * 96 // 4 - 4, seen  # the prompts' full pages were backed up
    samples = _samples(d)
    written = samples.get(("hicache_transfer_bytes_total", frozenset({("direction", "h2s")})), 0)
    assert written > 0
