"""A ``hicache serve`` subprocess for ``hicache bench serve --compare`` (and the tests).

``ManagedDaemon(config, overrides, log_path)`` runs
``python -m hicache serve --config CONFIG --set server.host=127.0.0.1
--set server.port=PORT [--set OVERRIDE ...]`` on a free loopback port, in its own session,
with stdout and stderr appended to ``log_path``.

- ``start`` returns once ``GET /health`` answers ``{"status": "ok"}``; it raises
  ``DaemonStartError`` (with the log's tail) if the process exits first or is not healthy
  within the timeout, and then leaves no process behind.
- ``stop`` sends SIGTERM (the daemon's orderly stop) and waits; it returns the exit code
  (0 for a clean stop). A daemon that does not stop in time is killed (SIGKILL to its
  process group, which only holds the processes it started) and ``DaemonStopError`` raised.
- Used as a context manager it starts on entry and, on exit, kills a daemon that is still
  running (the caller stops it in order on the normal path).
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
from collections.abc import Sequence
from pathlib import Path

from hicache.bench.loopback_ports import free_port

__all__ = ["DaemonStartError", "DaemonStopError", "ManagedDaemon"]


class DaemonStartError(RuntimeError):
    """The daemon exited or stayed unhealthy while starting."""


class DaemonStopError(RuntimeError):
    """The daemon did not stop after SIGTERM in time (it was killed)."""


class ManagedDaemon:
    """One ``hicache serve`` child process (see the module docstring)."""

    def __init__(self, config: str | os.PathLike[str], overrides: Sequence[str] = (), *,
                 log_path: str | os.PathLike[str], port: int | None = None) -> None:
        self.config = str(config)
        self.overrides = list(overrides)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "hicache", "serve", "--config", self.config,
               "--set", "server.host=127.0.0.1", "--set", f"server.port={self.port}"]
        for o in self.overrides:
            cmd += ["--set", o]
        return cmd

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return bool(resp.status == 200 and json.loads(resp.read()).get("status") == "ok")
        except (OSError, urllib.error.URLError, ValueError, AttributeError):
            return False

    def start(self, timeout_s: float = 300.0) -> None:
        """Start and wait until healthy (see the module docstring)."""
        if self.proc is not None:
            raise RuntimeError("this daemon was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise DaemonStartError(f"hicache serve --config {self.config} exited with {code} while starting; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.3)
        self.kill()
        raise DaemonStartError(f"hicache serve --config {self.config} was not healthy within {timeout_s:g} s; "
                               f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM and wait; the exit code (``DaemonStopError`` if it had to be killed)."""
        if self.proc is None:
            raise RuntimeError("this daemon was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise DaemonStopError(f"the daemon (pid {self.proc.pid}) did not stop within {timeout_s:g} s "
                                      f"after SIGTERM; killed. Log {self.log_path}") from None
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL this daemon's process group if it still runs, and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> ManagedDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
