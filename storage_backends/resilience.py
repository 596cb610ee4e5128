"""Resilience shared by every backend: backoff strategies, a circuit breaker, a health probe.

The pieces are small strategy objects:

- a ``Backoff`` answers "how long to wait after ``n`` consecutive failures";
- ``CircuitBreaker`` counts consecutive failed calls and opens (store *down*) at a
  threshold; while open, callers skip the store entirely (reads are misses, writes are
  dropped);
- when it opens, the breaker starts a ``HealthProbe`` thread that calls the backend's
  cheap probe (Redis ``PING``, a file write/read in the store directory) with backoff and
  closes the breaker (store *up*) as soon as one succeeds.

Thread safety: all state changes happen under the breaker's lock; the probe function is
called without it. Fork safety: a breaker notices a changed pid and, if it is down,
starts a fresh probe thread in the new process (threads do not survive ``fork``).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from storage_backends.locks import ForkSafeLock

log = logging.getLogger(__name__)


class Backoff(ABC):
    """How long to wait before the next attempt, given the failures so far."""

    @abstractmethod
    def compute(self, failures: int) -> float:
        """Seconds to wait after ``failures`` (>= 1) consecutive failures."""


class ConstantBackoff(Backoff):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def compute(self, failures: int) -> float:
        return self.delay_s


class ExponentialJitterBackoff(Backoff):
    """``base * 2**(failures-1)`` capped at ``cap``, with "equal jitter".

    The wait is drawn uniformly from ``[d/2, d]``: never zero (no busy loop against a dead
    server), and daemons that lost the store at the same moment spread their retries.
    """

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()

    def compute(self, failures: int) -> float:
        exp = min(max(failures - 1, 0), 62)
        delay = min(self.cap_s, self.base_s * (2**exp))
        return float(delay / 2 + self._rng.uniform(0, delay / 2))


class CircuitBreaker:
    """Marks a store down after ``threshold`` consecutive failures; a probe brings it back.

    ``probe`` is called from a background thread while the breaker is open; it returns
    True when the store answers again and must not raise (a raise counts as False and is
    logged). ``on_change(up)`` is called (outside the lock) whenever the state flips.
    """

    def __init__(
        self,
        name: str,
        threshold: int,
        probe: Callable[[], bool],
        backoff: Backoff,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.name = name
        self.threshold = threshold
        self._probe = probe
        self._backoff = backoff
        self._on_change = on_change
        self._lock = ForkSafeLock()
        self._up = True
        self._consecutive = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    @property
    def up(self) -> bool:
        """True while calls may go to the store. Cheap; called on every operation."""
        if not self._up and self._pid != os.getpid():
            self._after_fork()
        return self._up

    def record_success(self) -> None:
        self._consecutive = 0

    def record_failure(self) -> None:
        """Count one failed call; open the breaker at the threshold."""
        with self._lock:
            self._consecutive += 1
            if not self._up or self._consecutive < self.threshold:
                return
            self._up = False
            self._start_probe_locked()
        log.warning("L3 store %s marked down after %d consecutive failures", self.name, self.threshold)
        if self._on_change:
            self._on_change(False)

    def force_down(self) -> None:
        """Open the breaker now (for example the store refused to start)."""
        with self._lock:
            self._consecutive = self.threshold
            if not self._up:
                return
            self._up = False
            self._start_probe_locked()
        if self._on_change:
            self._on_change(False)

    def close(self) -> None:
        """Stop the probe thread (if any) and wait briefly for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # -- internals ------------------------------------------------------------------

    def _after_fork(self) -> None:
        self._stop = threading.Event()
        self._thread = None
        self._pid = os.getpid()
        with self._lock:
            if not self._up:
                self._start_probe_locked()

    def _start_probe_locked(self) -> None:
        if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._probe_loop, name=f"l3-probe-{self.name}", daemon=True)
        self._thread.start()

    def _probe_loop(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            attempt += 1
            if self._stop.wait(self._backoff.compute(attempt)):
                return
            try:
                ok = bool(self._probe())
            except Exception:  # a probe must not kill its thread; the store stays down
                log.exception("L3 store %s: health probe raised", self.name)
                ok = False
            if ok:
                with self._lock:
                    self._up = True
                    self._consecutive = 0
                    self._thread = None
                log.warning("L3 store %s re-attached after %d probes", self.name, attempt)
                if self._on_change:
                    self._on_change(True)
                return
