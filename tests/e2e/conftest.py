"""Fixtures for the end-to-end failure tests: real ``redis-server`` processes, short private
directories for unix sockets, and daemons that are always stopped.

Every Redis server runs on a free loopback port in its own directory with persistence off
and is killed by the fixture that started it; tests that need one are skipped, with the
reason, only when ``redis-server`` is not installed. Every daemon made with ``daemons`` is
stopped with SIGTERM at the end of its test (also when the test fails) and must exit 0,
leaving no process and no shared-memory segment behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon import Daemon, alive

from hicache.bench.local_redis import RedisProcess, find_redis_server, started

REDIS_SERVER = find_redis_server()
NO_REDIS = "redis-server not installed (apt-get install redis-server)"
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


def segments_of(launcher_pid: int) -> set[str]:
    """The shared-memory segments created by the daemon whose launcher has this pid."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"hicache-{launcher_pid}-")}


def check_stopped_cleanly(d: Daemon, code: int, pids: dict[str, int]) -> None:
    """Exit code 0, every child gone, no shared memory of this daemon left, and nothing of it
    left in a configured ``ipc.dir``."""
    assert d.proc is not None
    assert code == 0, f"daemon {d.dir.name} exited with {code}:\n{d.log()}"
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {n: p for n, p in pids.items() if alive(p)}
    assert not left, f"processes left running after the stop: {left}\n{d.log()}"
    leaked = segments_of(d.proc.pid)
    assert not leaked, f"shared memory left behind: {sorted(leaked)}\n{d.log()}"
    ipc_dir = (yaml.safe_load(d.config_path.read_text()).get("ipc") or {}).get("dir")
    if ipc_dir and os.path.isdir(ipc_dir):  # a configured ipc.dir: the daemon's files removed
        left = sorted(os.listdir(ipc_dir))
        assert not left, f"left in ipc.dir {ipc_dir}: {left}\n{d.log()}"


DaemonFactory = Callable[..., Daemon]


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
