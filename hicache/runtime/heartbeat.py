"""Heartbeats: how the launcher and ``/health`` see that a process's loop is still turning.

The scheduler (or the engine-mode cache server) and the controller each stamp a file
``{runtime dir}/heartbeat/{name}`` with ``time.monotonic()`` from their loops, at most every
``HEARTBEAT_INTERVAL_S`` (``HeartbeatWriter``); the launcher and the tokenizer read the ages
(``heartbeat_ages``). A frozen process (SIGSTOP, a deadlock, a loop stuck in one call) stops
stamping while it is still alive, which a pid check cannot see.

A loop can also turn while its work does not move: the scheduler with requests that no
forward pass serves (a wedge). A second stamp in the same file, at ``STALL_OFFSET``, says
since when the process has had work and made no progress on it (0: it progresses, or has
nothing to do); ``HeartbeatWriter.stalled`` writes it, ``heartbeat_stalls`` reads it, and
``/health`` and ``/metrics`` show it as they show a stale heartbeat.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

HEARTBEAT_INTERVAL_S = 0.25
"""A process's loop writes its heartbeat at most this often."""

HEARTBEAT_PROCESSES = ("scheduler", "controller")
"""The processes that write heartbeats (the tokenizer is the one that answers ``/health``)."""

_STAMP = struct.Struct("<d")
STALL_OFFSET = _STAMP.size
"""Where the stall stamp lies in a heartbeat file (after the beat)."""


def heartbeat_path(runtime_dir: str | os.PathLike[str], process: str) -> Path:
    """The heartbeat file of ``process`` in the daemon's private runtime directory."""
    return Path(runtime_dir) / "heartbeat" / process


class HeartbeatWriter:
    """The heartbeat of one process: ``beat()`` from its loop.

    Construction creates (or takes over, after a restart) the file and stamps it, so a
    process is fresh from the moment it has a writer; create it right before ``Ready``.
    ``beat()`` costs a clock read, and a ``pwrite`` of 8 bytes when ``interval_s`` has
    passed since the last one. ``runtime_dir`` None (no runtime directory, e.g. a process
    started on its own) makes every method a no-op. Not thread-safe: one loop beats.
    """

    def __init__(self, runtime_dir: str | os.PathLike[str] | None, process: str,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._fd: int | None = None
        self._last = 0.0
        self._stall = -1.0
        if runtime_dir is None:
            return
        path = heartbeat_path(runtime_dir, process)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.beat(force=True)
        self.stalled(None)  # a restarted process takes the file over: no stall of its predecessor

    def beat(self, force: bool = False) -> None:
        """Stamp the file with now (at most every ``interval_s`` unless ``force``)."""
        if self._fd is None:
            return
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            os.pwrite(self._fd, _STAMP.pack(now), 0)

    def stalled(self, since: float | None) -> None:
        """Record since when (``time.monotonic()``) the process has had work without making
        progress on it; None: it progresses. Written only when it changes."""
        stamp = 0.0 if since is None else since
        if self._fd is None or stamp == self._stall:
            return
        self._stall = stamp
        os.pwrite(self._fd, _STAMP.pack(stamp), STALL_OFFSET)

    def close(self) -> None:
        """Stop writing (the file stays; its stamp ages). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_stamps(runtime_dir: str | os.PathLike[str] | None, processes: tuple[str, ...],
                 offset: int) -> dict[str, float]:
    """The stamp at ``offset`` of each of ``processes``' heartbeat files, for those readable."""
    if runtime_dir is None:
        return {}
    stamps: dict[str, float] = {}
    for name in processes:
        try:
            with open(heartbeat_path(runtime_dir, name), "rb") as fh:
                fh.seek(offset)
                raw = fh.read(_STAMP.size)
        except OSError:
            continue
        if len(raw) == _STAMP.size:
            stamps[name] = _STAMP.unpack(raw)[0]
    return stamps


def heartbeat_ages(runtime_dir: str | os.PathLike[str] | None,
                   processes: tuple[str, ...] = HEARTBEAT_PROCESSES) -> dict[str, float]:
    """Seconds since each of ``processes`` last beat. A process without a readable heartbeat
    (not started yet, no runtime directory) is left out: absent means unknown, not stale."""
    now = time.monotonic()
    return {name: max(0.0, now - beat) for name, beat in _read_stamps(runtime_dir, processes, 0).items()}


def heartbeat_stalls(runtime_dir: str | os.PathLike[str] | None,
                     processes: tuple[str, ...] = HEARTBEAT_PROCESSES) -> dict[str, float]:
    """Seconds each of ``processes`` has had work without progress, for those stalled now
    (``HeartbeatWriter.stalled``); a process that progresses, or has no readable stamp, is
    left out."""
    now = time.monotonic()
    return {name: max(0.0, now - since)
            for name, since in _read_stamps(runtime_dir, processes, STALL_OFFSET).items() if since > 0}
