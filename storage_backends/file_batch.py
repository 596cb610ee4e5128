"""Running one batch of page I/O for the file store, with a deadline (docs/architecture.md §7).

``BatchRunner.run`` runs ``op(i, hashes[i])`` for every page of a batch, on the calling
thread or on the runner's pool of ``io_threads`` workers, and returns each page's
``Outcome``. A page that has not started by the deadline is ``TIMEOUT``; a page in progress
is always finished before ``run`` returns, so no worker touches a caller's buffer after the
call. The pool is made on first use; a runner belongs to one process (the backend makes a
new one after ``fork``).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from storage_backends.locks import ForkSafeLock

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    HIT = "hit"  # read verified / page published by this call
    EXISTED = "existed"  # write skipped: a whole object was there (or another writer's won)
    MISS = "miss"  # not present
    CORRUPT = "corrupt"  # present but failed verification (deleted)
    FULL = "full"  # write failed for lack of space
    ERROR = "error"  # I/O error (counts toward the breaker)
    TIMEOUT = "timeout"  # not started before the deadline


class Batch:
    """Results of one batch call, filled in by workers; ``cancelled`` stops unstarted pages."""

    __slots__ = ("outcomes", "cancelled")

    def __init__(self, n: int) -> None:
        self.outcomes: list[Outcome] = [Outcome.TIMEOUT] * n
        self.cancelled = False

    def count(self, outcome: Outcome) -> int:
        return self.outcomes.count(outcome)


class BatchRunner:
    def __init__(self, io_threads: int, timeout_s: float) -> None:
        self.io_threads = io_threads
        self.timeout_s = timeout_s
        self._lock = ForkSafeLock()
        self._pool: ThreadPoolExecutor | None = None

    def executor(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="l3-file-io")
                pool = self._pool
        return pool

    def run(self, hashes: Sequence[str], op: Callable[[int, str], Outcome], inline: bool) -> Batch:
        """Run ``op(i, hashes[i])`` for every page, honouring the timeout.

        ``inline``: on the calling thread, checking the deadline before each page. Otherwise
        on the pool: pages are split into at most ``io_threads`` contiguous chunks; after the
        deadline, chunks not yet started are cancelled and running chunks stop before their
        next page; the call then waits for pages in progress, so no worker outlives it.
        """
        n = len(hashes)
        batch = Batch(n)
        if inline:
            outcomes = batch.outcomes
            deadline = time.monotonic() + self.timeout_s
            for i, h in enumerate(hashes):
                if time.monotonic() > deadline:
                    break
                outcomes[i] = op(i, h)
            return batch
        chunks = min(self.io_threads, n)
        step = -(-n // chunks)

        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                if batch.cancelled:
                    return
                batch.outcomes[i] = op(i, hashes[i])

        pool = self.executor()
        futures: list[Future[None]] = [pool.submit(work, lo, min(lo + step, n)) for lo in range(0, n, step)]
        _, not_done = wait_futures(futures, timeout=self.timeout_s)
        if not_done:
            batch.cancelled = True
            for fut in not_done:
                fut.cancel()
            wait_futures([f for f in not_done if not f.cancelled()])
        for fut in futures:
            if not fut.cancelled() and fut.exception() is not None:
                # A bug in the page code, not store trouble: surface it in the log, count it.
                log.error("file store: page worker failed", exc_info=fut.exception())
        return batch

    def call(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """Run ``fn`` on the pool, waiting at most the timeout: (finished, its result). A call
        that did not finish goes on in the background (only for work without caller buffers)."""
        fut = self.executor().submit(fn)
        done, _ = wait_futures([fut], timeout=self.timeout_s)
        return (True, fut.result()) if done else (False, None)

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
