"""Fixtures for the end-to-end failure tests: real ``redis-server`` processes, short private
directories for unix sockets, and daemons that are always stopped.

Every Redis server runs on a free loopback port in its own directory with persistence off
and is killed by the fixture that started it; tests that need one are skipped, with the
reason, only when ``redis-server`` is not installed. Every daemon made with ``daemons`` is
stopped with SIGTERM at the end of its test (also when the test fails) and must exit 0,
leaving no process and no shared-memory segment behind.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.local_redis import RedisProcess, started
from tests.support.daemon import Daemon, DaemonFactory, check_stopped_cleanly
from tests.support.redis_servers import NO_REDIS, REDIS_SERVER

STOP_TIMEOUT_S = 120.0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private standalone server (the test may kill and restart it)."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    with started(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private directory with a short path (unix socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hc", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonFactory]:
    """``daemons(config, name, start=True, env=None)``: a daemon stopped at the end of the test.

    At teardown each one still running gets SIGTERM; then every one must have exited 0
    with no process or shared-memory segment left (a test that stops a daemon itself
    checks the same with ``check_stopped_cleanly``).
    """
    made: list[tuple[Daemon, dict[str, int]]] = []

    def make(config: dict[str, Any], name: str = "d", start: bool = True, env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(tmp_path, config, name, env=env)
        pids: dict[str, int] = {}
        made.append((d, pids))
        if start:
            d.start()
            pids.update(d.pids())
        return d

    yield make
    problems: list[str] = []
    running = [(d, pids) for d, pids in made if d.proc is not None and d.proc.poll() is None]
    for d, pids in running:  # the pids now too (a restarted controller has a new one)
        try:
            pids.update({f"{n} (at stop)": p for n, p in d.pids().items()})
        except (OSError, ValueError, KeyError):
            pass
    for d, _pids in running:  # all at once: they stop in parallel
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
    for d, pids in made:
        if d.proc is None:
            continue
        try:
            code = d.proc.wait(STOP_TIMEOUT_S)
            check_stopped_cleanly(d, code, pids)
        except subprocess.TimeoutExpired:
            problems.append(f"{d.dir.name}: no exit within {STOP_TIMEOUT_S:.0f} s of SIGTERM:\n{d.log()}")
        except AssertionError as exc:
            problems.append(f"{d.dir.name}: {exc}")
        finally:
            d.kill_all()
    assert not problems, "\n\n".join(problems)
