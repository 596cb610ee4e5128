"""End to end, ``/metrics``: the health of the scheduler and controller
(``hicache_process_up``, ``hicache_process_heartbeat_age_seconds``) read at scrape time from
the heartbeat files ``/health`` reads, and ``hicache_storage_attached``, which tells a daemon
without L3 from one whose L3 is down.

A process is frozen with SIGSTOP and resumed with SIGCONT (as in test_liveness.py); the
test resumes it also when it fails, so the ``daemons`` fixture can stop the daemon in order.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from hicache.metrics import Metrics
from tests.support.daemon import Daemon, DaemonFactory, alive

STALE_S = 1.5
"""``server.health_stale_s`` of these daemons."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _config(tmp: Path, l3: dict[str, Any], l2: bool = True) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"enabled": l2, "tokens": 8192}, "l3": l3},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        # never restarted: the test resumes the frozen controller itself
        "server": {"health_stale_s": STALE_S, "controller_freeze_restart_s": 0},
        "logging": {"level": "warning"},
    }


def _file_l3(tmp: Path) -> dict[str, Any]:
    return {"backend": "file", "file": {"dir": str(tmp / "l3")}}


def _samples(d: Daemon) -> Samples:
    return d.metric_samples()


def _by_process(samples: Samples, name: str) -> dict[str, float]:
    """``{process: value}`` of a ``process``-labelled metric."""
    return {dict(labels)["process"]: v for (n, labels), v in samples.items() if n == name}


def _health(samples: Samples) -> tuple[dict[str, float], dict[str, float]]:
    return (_by_process(samples, "hicache_process_up"),
            _by_process(samples, "hicache_process_heartbeat_age_seconds"))


def _plain(samples: Samples, name: str) -> float | None:
    return samples.get((name, frozenset()))


def _wait(d: Daemon, cond: Callable[[Samples], bool], timeout_s: float, what: str) -> Samples:
    """Scrape ``/metrics`` until ``cond(samples)``; the last scrape's health in the failure."""
    deadline = time.monotonic() + timeout_s
    samples: Samples = {}
    while time.monotonic() < deadline:
        samples = _samples(d)
        if cond(samples):
            return samples
        time.sleep(0.2)
    raise AssertionError(f"no /metrics with {what} within {timeout_s:.0f} s; last: {_health(samples)}\n{d.log()}")


@contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the block; SIGCONT at its end, whatever happens (unless it died)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


# --------------------------------------------------------------------------- the rule, in-process


def test_set_process_health_is_the_health_rule() -> None:
    """Up = alive and an age not over ``stale_s`` (an unknown age is not stale); the age is
    exported as read (NaN when unknown); only the processes given get series; a name outside
    the heartbeat processes is refused."""
    registry = CollectorRegistry()
    m = Metrics(registry)

    def value(name: str, process: str) -> float | None:
        return registry.get_sample_value(name, {"process": process})

    m.set_process_health({"scheduler": 0.2, "controller": 1.6}, {"scheduler": True, "controller": True}, 1.5)
    assert value("hicache_process_up", "scheduler") == 1 and value("hicache_process_up", "controller") == 0
    assert value("hicache_process_heartbeat_age_seconds", "controller") == pytest.approx(1.6)
    m.set_process_health({"scheduler": 1.5, "controller": 0.1}, {"scheduler": True, "controller": False}, 1.5)
    assert value("hicache_process_up", "scheduler") == 1, "an age equal to the limit is not stale (/health: >)"
    assert value("hicache_process_up", "controller") == 0, "a dead process is down whatever its age"
    m.set_process_health({}, {"scheduler": True}, 1.5)
    assert value("hicache_process_up", "scheduler") == 1
    age = value("hicache_process_heartbeat_age_seconds", "scheduler")
    assert age is not None and math.isnan(age)

    fresh = CollectorRegistry()
    Metrics(fresh).set_process_health({"scheduler": 0.1}, {"scheduler": True}, 1.5)
    assert fresh.get_sample_value("hicache_process_up", {"process": "controller"}) is None
    with pytest.raises(ValueError, match="process"):
        m.set_process_health({}, {"tokenizer": True}, 1.5)
    Metrics(None).set_process_health({"scheduler": 9.0}, {"scheduler": True}, 1.5)  # disabled: a no-op


# --------------------------------------------------------------------------- a real daemon


def test_frozen_controller_is_down_on_metrics_until_it_resumes(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Right after start both heartbeat processes are up with a fresh age. With the
    controller stopped, its age on /metrics rises past ``server.health_stale_s`` and keeps
    rising from scrape to scrape (read at scrape time: the stopped process publishes
    nothing), ``hicache_process_up{process="controller"}`` is 0 while /health names it stale,
    and the scheduler stays up; after SIGCONT both are up again with a fresh age."""
    d = daemons(_config(tmp_path, _file_l3(tmp_path)))
    up, age = _health(_samples(d))
    assert up == {"scheduler": 1, "controller": 1}, (up, age)
    assert set(age) == {"scheduler", "controller"} and all(0 <= a <= STALE_S for a in age.values()), age
    pids = d.pids()
    with _frozen(pids["controller"]):
        samples = _wait(d, lambda s: _health(s)[1].get("controller", 0) > STALE_S, 10 * STALE_S,
                        "the controller's heartbeat age over the limit")
        up, age = _health(samples)
        assert up["controller"] == 0, (up, age)
        assert up["scheduler"] == 1 and age["scheduler"] <= STALE_S, (up, age)
        status, body = d.request("GET", "/health", timeout=10)
        assert status == 503 and "controller" in body.get("stale", {}), body
        time.sleep(1.0)
        later = _health(_samples(d))[1]["controller"]
        assert later >= age["controller"] + 0.8, (age["controller"], later)
    samples = _wait(d, lambda s: _health(s)[0].get("controller") == 1, 10 * STALE_S, "the controller up again")
    up, age = _health(samples)
    assert up == {"scheduler": 1, "controller": 1} and age["controller"] <= STALE_S, (up, age)
    assert d.pids() == pids, "the frozen controller was replaced although restarts are off"


def test_storage_attached_tells_no_l3_from_l3_down(daemons: DaemonFactory, tmp_path: Path) -> None:
    """``hicache_storage_attached`` is 1 with a file L3 (and ``hicache_storage_up`` 1), 0
    with ``cache.l3.backend: none`` (``hicache_storage_up`` 0 too) and 0 again once the L3 is
    detached at run time; a daemon without L2 runs no controller: no storage series, and
    process health for the scheduler only."""
    with_l3 = daemons(_config(tmp_path / "a", _file_l3(tmp_path / "a")), "a", start=False)
    no_l3 = daemons(_config(tmp_path / "b", {"backend": "none"}), "b", start=False)
    no_l2 = daemons(_config(tmp_path / "c", {"backend": "none"}, l2=False), "c", start=False)
    for d in (with_l3, no_l3, no_l2):
        d.launch()
    for d in (with_l3, no_l3, no_l2):
        d.wait_healthy()

    s = _samples(with_l3)
    assert (_plain(s, "hicache_storage_attached"), _plain(s, "hicache_storage_up")) == (1, 1), with_l3.log()
    s = _samples(no_l3)
    assert (_plain(s, "hicache_storage_attached"), _plain(s, "hicache_storage_up")) == (0, 0), no_l3.log()
    assert _health(s)[0] == {"scheduler": 1, "controller": 1}
    s = _samples(no_l2)
    assert "controller" not in no_l2.pids()
    assert _plain(s, "hicache_storage_attached") is None and _plain(s, "hicache_storage_up") is None
    assert _health(s)[0] == {"scheduler": 1}

    status, body = with_l3.request("DELETE", "/cache/storage")
    assert status == 200, body
    _wait(with_l3, lambda s: (_plain(s, "hicache_storage_attached"), _plain(s, "hicache_storage_up")) == (0, 0),
          10, "storage attached 0 and up 0 after the detach")
