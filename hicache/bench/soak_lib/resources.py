"""What the soak watches of the daemon's processes: RSS, open files, shared memory segments.

``sample(processes, launcher_pid)`` reads ``/proc`` once: per process name, its RSS (KiB)
and number of open file descriptors (a process that just exited reads as absent), and the
number of shared-memory segments the daemon owns (``/dev/shm/hicache-{launcher_pid}-*``).

``verdict(samples)`` says whether they stayed flat: after a warm-up (the first
``WARMUP_FRACTION`` of the samples, while the pools fill), the mean of the last window is
compared with the mean of the first window after the warm-up, per process name (a
restarted controller is a new pid under the same name). Flat means RSS grew at most
``RSS_GROWTH_FRACTION`` (or ``RSS_GROWTH_FLOOR_KIB``, whichever is larger), open files at
most ``FD_GROWTH``, and the shared-memory segment count not at all.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

WARMUP_FRACTION = 0.2
WINDOW_FRACTION = 0.2
RSS_GROWTH_FRACTION = 0.10
RSS_GROWTH_FLOOR_KIB = 16 * 1024
FD_GROWTH = 8


@dataclass(frozen=True)
class Sample:
    t: float
    rss_kib: dict[str, int]
    fds: dict[str, int]
    shm_segments: int


@dataclass
class Verdict:
    flat: bool
    rows: list[dict[str, object]] = field(default_factory=list)


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_segments(launcher_pid: int) -> int:
    try:
        return sum(1 for n in os.listdir("/dev/shm") if n.startswith(f"hicache-{launcher_pid}-"))
    except OSError:
        return 0


def sample(processes: Mapping[str, int], launcher_pid: int) -> Sample:
    rss: dict[str, int] = {}
    fds: dict[str, int] = {}
    for name, pid in {**processes, "launcher": launcher_pid}.items():
        r, f = _rss_kib(pid), _fds(pid)
        if r is not None and f is not None:
            rss[name], fds[name] = r, f
    return Sample(time.time(), rss, fds, shm_segments(launcher_pid))


def _window(samples: list[Sample], start: int, size: int, read: str, name: str) -> float | None:
    values = [getattr(s, read).get(name) for s in samples[start:start + size]]
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def verdict(samples: list[Sample]) -> Verdict:
    """See the module docstring; too few samples (under 10) is not flat (nothing proven)."""
    if len(samples) < 10:
        return Verdict(False, [{"what": "samples", "note": f"only {len(samples)} samples"}])
    size = max(1, int(len(samples) * WINDOW_FRACTION))
    early = int(len(samples) * WARMUP_FRACTION)
    late = len(samples) - size
    names = sorted({n for s in samples for n in s.rss_kib})
    out = Verdict(True)
    for name in names:
        for read, limit_of in (("rss_kib", lambda v: max(v * RSS_GROWTH_FRACTION, RSS_GROWTH_FLOOR_KIB)),
                               ("fds", lambda v: FD_GROWTH)):
            a, b = _window(samples, early, size, read, name), _window(samples, late, size, read, name)
            if a is None or b is None:
                continue
            ok = b - a <= limit_of(a)
            out.flat &= ok
            out.rows.append({"what": f"{name} {read}", "after_warmup": round(a, 1), "end": round(b, 1),
                             "growth": round(b - a, 1), "allowed": round(limit_of(a), 1), "flat": ok})
    a_shm, b_shm = samples[early].shm_segments, samples[-1].shm_segments
    out.flat &= b_shm <= a_shm
    out.rows.append({"what": "shm segments", "after_warmup": a_shm, "end": b_shm, "growth": b_shm - a_shm,
                     "allowed": 0, "flat": b_shm <= a_shm})
    return out
