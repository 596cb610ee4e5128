"""End to end, liveness: heartbeats, ``/health`` naming a frozen process, the launcher
restarting a controller that stays frozen.

A process is frozen with SIGSTOP (it keeps its pid, its sockets and its memory, and does
nothing) and resumed with SIGCONT; every test resumes what it stopped, also when it fails,
so the ``daemons`` fixture can stop the daemon in order.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import Daemon, DaemonFactory, alive

STALE_S = 1.5
"""``server.health_stale_s`` of these daemons."""


def _config(tmp: Path, freeze_restart_s: float) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"tokens": 8192},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "server": {"health_stale_s": STALE_S, "controller_freeze_restart_s": freeze_restart_s},
        "logging": {"level": "warning"},
    }


def _health(d: Daemon, query: str = "") -> tuple[int, dict[str, Any]]:
    status, body = d.request("GET", "/health" + query, timeout=10)
    assert isinstance(body, dict), f"/health answered {status} {body!r}"
    return status, body


def _wait_health(d: Daemon, cond: Callable[[int, dict[str, Any]], bool], timeout_s: float,
                 what: str) -> dict[str, Any]:
    """Poll ``/health`` until ``cond(status, body)``; the last answer in the failure message."""
    deadline = time.monotonic() + timeout_s
    last: tuple[int, dict[str, Any]] | None = None
    while time.monotonic() < deadline:
        last = _health(d)
        if cond(*last):
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"no /health with {what} within {timeout_s:.0f} s; last: {last}\n{d.log()}")


@contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the block; SIGCONT at its end, whatever happens (unless it died)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(64)]
    return [system + [rng.randrange(1, 250) for _ in range(24)] for _ in range(4)]


def _restarts(d: Daemon) -> float | None:
    for family in text_string_to_metric_families(d.get_text("/metrics")):
        for s in family.samples:
            if s.name == "hicache_process_restarts_total" and s.labels.get("process") == "controller":
                return float(s.value)
    return None


def test_frozen_controller_is_reported_until_it_resumes(daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_config(tmp_path, freeze_restart_s=0))  # never restarted: the test resumes it
    status, body = _health(d)
    assert (status, body["status"]) == (200, "ok"), body
    assert "stale" not in body
    pids = d.pids()
    with _frozen(pids["controller"]):
        body = _wait_health(d, lambda s, b: s == 503 and "controller" in b.get("stale", {}),
                            10 * STALE_S, "the controller stale")
        assert body["status"] == "degraded", body
        assert body["stale"]["controller"] > STALE_S, body
        assert "scheduler" not in body["stale"], body  # the scheduler keeps beating
        assert body["processes"] == pids, body
        live_status, live = _health(d, "?live=1")  # liveness: this process answers
        assert live_status == 200, live
        assert live["status"] == "degraded" and "controller" in live["stale"], live
    body = _wait_health(d, lambda s, b: s == 200, 10 * STALE_S, "status ok after SIGCONT")
    assert body["status"] == "ok" and "stale" not in body, body
    assert d.pids() == pids, "a frozen controller was replaced although restarts are off"
    prompt = _prompts(1)[0]
    assert d.generate(prompt, 6)["output_ids"] == d.generate(prompt, 6)["output_ids"]


def test_frozen_scheduler_is_reported_not_restarted(daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_config(tmp_path, freeze_restart_s=3.0))
    pids = d.pids()
    with _frozen(pids["scheduler"]):
        body = _wait_health(d, lambda s, b: s == 503 and "scheduler" in b.get("stale", {}),
                            10 * STALE_S, "the scheduler stale")
        assert body["status"] == "degraded", body
        time.sleep(3.0 + 2 * STALE_S)  # past the controller's restart limit: nothing is killed
        assert alive(pids["scheduler"])
        assert _health(d)[1]["processes"] == pids
    _wait_health(d, lambda s, b: s == 200 and b["status"] == "ok", 10 * STALE_S, "status ok after SIGCONT")
    assert d.pids() == pids
    assert _restarts(d) == 0


def test_controller_frozen_past_the_limit_is_restarted(daemons: DaemonFactory, tmp_path: Path) -> None:
    limit_s = 3.0
    d = daemons(_config(tmp_path, freeze_restart_s=limit_s))
    prompts = _prompts(2)
    expected = [d.generate(p, 6)["output_ids"] for p in prompts]
    assert [d.generate(p, 6)["output_ids"] for p in prompts] == expected  # served from the cache
    assert _restarts(d) == 0
    old = d.pids()["controller"]
    fresh = _prompts(3)[0]  # new pages: its KV is copied to L2 by the controller
    during: dict[str, Any] = {}

    def ask() -> None:  # a request that arrives while the controller is frozen
        try:
            during["ids"] = d.generate(fresh, 6)["output_ids"]
        except Exception as exc:  # reported by the assertion below
            during["error"] = f"{type(exc).__name__}: {exc}"

    with _frozen(old):
        _wait_health(d, lambda s, b: "controller" in b.get("stale", {}), 10 * STALE_S, "the controller stale")
        worker = threading.Thread(target=ask, daemon=True)
        worker.start()
        deadline = time.monotonic() + limit_s + 30
        while d.pids().get("controller") == old and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d.pids().get("controller") != old, f"the frozen controller was not replaced\n{d.log()}"
    deadline = time.monotonic() + 10
    while alive(old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(old), "the frozen controller was not killed"
    _wait_health(d, lambda s, b: s == 200 and b["status"] == "ok", 30, "status ok after the restart")
    worker.join(60)
    assert "error" not in during and not worker.is_alive(), during
    assert [d.generate(p, 6)["output_ids"] for p in prompts] == expected, d.log()
    assert d.generate(fresh, 6)["output_ids"] == during["ids"]
    status, flushed = d.request("POST", "/cache/flush")
    assert status == 200, flushed
    # L1 and L2 empty: from L3 (written by either controller) or recomputed, the same ids
    assert [d.generate(p, 6)["output_ids"] for p in prompts] == expected, d.log()
    assert d.generate(fresh, 6)["output_ids"] == during["ids"]
    assert _restarts(d) == 1
