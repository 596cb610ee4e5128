"""A real ``hicache serve`` as a subprocess, talked to over HTTP, and the checks of its stop.

``Daemon`` owns its process group: ``stop`` sends SIGTERM and waits, ``kill_all`` kills what is
left. ``check_stopped_cleanly`` is the rule every stopped daemon meets: exit 0, no child left,
no shared-memory segment of its launcher left, its ``ipc.dir`` empty. The ``daemons`` fixture
(tests/e2e/conftest.py) applies it at teardown; ``DaemonFactory`` is that fixture's type.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hicache.bench.loopback_ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def shm_segments(prefix: str = "hicache-") -> set[str]:
    """The shared-memory segments whose names start with ``prefix``."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


class Daemon:
    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "d",
                 env: dict[str, str] | None = None) -> None:
        """``env``: extra environment variables for the daemon (on top of this process's)."""
        self.port = free_port()
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = dict(config)
        cfg.setdefault("server", {})["port"] = self.port
        self.config_path = self.dir / "hicache.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.engine_mode = cfg.get("engine", {}).get("kind", "builtin") != "builtin"
        self._engines_at_stop: set[int] = set()
        self.log_path = self.dir / "daemon.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.bearer: str | None = None
        """A key sent with every request that names no ``Authorization`` of its own (the
        operator's, for a daemon with keys: ``/metrics``, ``/cache/stats`` ...)."""

    def start(self, timeout_s: float = 180.0) -> None:
        """Launch and wait until healthy; in engine mode, after a ``stop``, also until every
        engine registered then that still runs has registered again (a lookup that meets its
        engine's registration in progress is a miss by design, which would make a test's
        expected hits a race with the engine's reconnection)."""
        self.launch()
        self.wait_healthy(timeout_s)
        # engines of other processes only: a test's own engine session waits in its own way
        running = {pid for pid in self._engines_at_stop if pid != os.getpid() and _running(pid)}
        if running:
            self.wait_for_stats("the engines to register again",
                                lambda st: running <= {e["pid"] for e in st.get("engines", [])}, 60)

    def replaces(self, other: Daemon) -> None:
        """This daemon takes ``other``'s engine socket (``other`` stopped): its ``start`` waits,
        as ``other``'s own restart would, until every engine ``other`` served then that still
        runs has registered with it."""
        self._engines_at_stop = set(other._engines_at_stop)

    def launch(self) -> None:
        """Start the launcher process without waiting for it (see ``wait_healthy``)."""
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hicache", "serve", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                env=None if self.env is None else {**os.environ, **self.env})

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Wait until ``/health`` says ok; raise (with the log) if the daemon exits or times out."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.get("/health")["status"] == "ok":
                    return
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                pass
            time.sleep(0.1)  # a start is seconds: a coarser poll would add to every test that starts one
        raise TimeoutError(f"daemon not healthy in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def request(self, method: str, path: str, body: Any = None, timeout: float = 120.0,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url(path), data=data, method=method,
                                     headers={"Content-Type": "application/json", **self._auth(), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        if status != 200:
            raise ValueError(f"GET {path}: {status} {body}")
        return body

    def _auth(self) -> dict[str, str]:
        return {} if self.bearer is None else {"Authorization": f"Bearer {self.bearer}"}

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(urllib.request.Request(self.url(path), headers=self._auth()), timeout=30) as resp:
            return resp.read().decode()

    def metric_samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of ``/metrics``: (name, labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(self.get_text("/metrics")):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = float(s.value)
        return out

    def wait_for_stats(self, what: str, check: Any, timeout_s: float = 20.0) -> dict[str, Any]:
        """Poll ``/cache/stats`` until ``check(stats)`` holds; fail naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.get("/cache/stats")
            if check(stats):
                return stats  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen within {timeout_s} s: {stats}\n{self.log()}")
            time.sleep(0.2)

    def wait_tiers_idle(self, what: str = "the tier layer settled", backed_up: bool = True,
                        timeout_s: float = 20.0) -> dict[str, Any]:
        """Until no tier op is in flight and no write is due (a flush skips nodes with a
        transfer in flight, so a test that flushes to force an L3 read waits here first) and,
        with ``backed_up``, L3 holds a copy of everything L2 holds."""
        def settled(s: dict[str, Any]) -> bool:
            tiers = s["tiers"]
            if tiers["in_flight"] or tiers["writes_due"]:
                return False
            return not backed_up or s["l2"]["full"]["used_tokens"] <= tiers["backup_tokens"]
        return self.wait_for_stats(what, settled, timeout_s)

    def generate(self, ids: list[int], n: int = 8) -> dict[str, Any]:
        status, body = self.request("POST", "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
        if status != 200:
            raise AssertionError(f"/generate: {status} {body}\n{self.log()}")
        return body

    def pids(self) -> dict[str, int]:
        """The processes' pids from /health (also while it reports a process restarting: 503)."""
        _status, body = self.request("GET", "/health")
        return body["processes"]

    def wait_replaced(self, name: str, old_pid: int, timeout_s: float) -> int | None:
        """The pid /health names for ``name`` once it is neither missing nor ``old_pid`` (a
        restarted process's successor); None if that did not happen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            pid = self.pids().get(name)
            if pid not in (None, old_pid):
                return pid
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def stop(self, timeout_s: float = 120.0) -> int:
        assert self.proc is not None
        if self.engine_mode and self.proc.poll() is None:
            try:
                self._engines_at_stop = {int(e["pid"]) for e in self.get("/cache/stats").get("engines", [])}
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                self._engines_at_stop = set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                raise
        return self.proc.returncode

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


def check_served_from_l3_after_restart(tmp: Path, config: dict[str, Any], prompt: list[int], expected: list[int],
                                       min_storage_tokens: int, env: dict[str, str] | None = None) -> None:
    """Start a fresh daemon on ``config`` (its L2 empty): ``prompt`` gives ``expected``
    with at least ``min_storage_tokens`` of it from L3; the daemon stops cleanly."""
    d = Daemon(tmp, config, "restarted", env=env)
    d.start()
    try:
        out = d.generate(prompt, 4)
        assert out["output_ids"] == expected
        assert out["meta_info"]["cached_tokens_details"]["storage"] >= min_storage_tokens, out["meta_info"]
    finally:
        assert d.stop() == 0, d.log()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def segments_of(launcher_pid: int) -> set[str]:
    """The shared-memory segments created by the daemon whose launcher has this pid."""
    return shm_segments(f"hicache-{launcher_pid}-")


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
"""``daemons(config, name="d", start=True, env=None)``: the ``daemons`` fixture's factory."""
