"""A lock that a forked child finds free.

A backend may be used in a child forked from a process whose threads (I/O pool, start-up
scan, probe, listener) use it: ``threading.Lock`` is copied into the child in whatever state
it had at the fork, and a lock another thread held then is never released there (that thread
does not exist in the child). Every lock of the backends is a ``ForkSafeLock``: one
``os.register_at_fork`` hook gives each of them a new, free lock in the child, before any of
the child's code runs. What a lock guarded is the child's to reset (the backends do that on
their first call in a new process: ``_ensure_process`` and the ``after_fork`` methods).
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType


class ForkSafeLock:
    """``threading.Lock`` (``with``, ``acquire``, ``release``), free again in a forked child."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _ALL.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.Lock()


_ALL: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_all() -> None:
    for lock in list(_ALL):
        lock._renew()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_all)
