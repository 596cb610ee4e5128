"""A worker's copy thread: loads and saves beside vLLM's forward pass (``hicache_copy: async``).

The worker hands each copy to ``submit`` and goes on; one thread runs them in the order given
and ends each one's lease itself, on a socket of its own, the moment its copy is done (a
save's pages are committed, a hit's pages released, without waiting for the next step). The
worker picks the results up once a step (``take_done``) to report finished loads to vLLM.

==========================  ==============================================================
what                        rule
==========================  ==============================================================
order                       first in, first out: a load into a block runs after every save
                            handed over before it (which may read that block)
a save's source blocks      not written while the save reads them: before a forward pass
                            the worker waits for the saves reading any block vLLM gave out
                            in that step (``wait_for_blocks``); blocks vLLM keeps for a
                            running request are never written again once full
a copy that raises          its lease ends as failed: a save is committed not ok (nothing
                            served), a load releases nothing loaded (vLLM recomputes)
a late copy                 waited for, never abandoned: a load reported failed while its
                            copy still ran could write into blocks vLLM then recomputes
the copiers' L2 mapping     changed only while the thread is idle (``drain`` first)
==========================  ==============================================================

Locks: one ``threading.Condition`` guards the pending list and the done list; a copy runs
without it. docs/engine-mode.md, "Copy modes".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

import protos
from hicache.connectors.engine_client import EngineClient

if TYPE_CHECKING:
    from hicache.runtime.ipc import CurveClientKeys

log = logging.getLogger("hicache.connector")

CLOSE_WAIT_S = 30.0
"""How long ``close`` waits for the copies still queued before it leaves them to the process's end."""


@dataclass(eq=False)
class CopyJob:
    """One plan's copy: ``copy()`` returns the bytes copied and raises on failure;
    ``end_lease(ok)`` is the message that ends its lease. ``reads``: the vLLM blocks a save
    reads (empty for a load). The thread fills in the outcome."""

    rid: str
    kind: Literal["load", "save"]
    pages: int
    copy: Callable[[], int]
    end_lease: Callable[[bool], protos.Message]
    reads: frozenset[int] = frozenset()
    ok: bool = False
    copied: int = 0
    seconds: float = 0.0
    error: str = ""
    lease_ended: bool = False


class CopyThread:
    """The copy thread of one worker (see the module docstring)."""

    def __init__(self, address: str, timeout_ms: int, *, curve: CurveClientKeys | None = None,
                 before_save: Callable[[], None] | None = None) -> None:
        """``address``/``curve``: the daemon's engine socket (the thread opens its own);
        ``before_save``: called on the thread before each save's copy (a fault point)."""
        self._address, self._timeout_ms, self._curve = address, timeout_ms, curve
        self._before_save = before_save
        self._queue: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: list[CopyJob] = []  # handed over, not done: in order
        self._done: list[CopyJob] = []  # done since the last take_done
        self._thread = threading.Thread(target=self._run, name="hicache-copy", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        with self._cond:
            self._pending.append(job)
        self._queue.put(job)

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._pending)

    def wait_for_blocks(self, blocks: frozenset[int] | set[int]) -> float:
        """Wait until no pending save reads any of ``blocks``; the seconds waited (0.0: none)."""
        with self._cond:
            if not self._reads_any(blocks):
                return 0.0
            began = time.perf_counter()
            while self._reads_any(blocks):
                self._cond.wait()
        return time.perf_counter() - began

    def _reads_any(self, blocks: frozenset[int] | set[int]) -> bool:
        """Whether a pending save reads one of ``blocks`` (the caller holds the condition)."""
        return bool(blocks) and any(j.reads and not j.reads.isdisjoint(blocks) for j in self._pending)

    def drain(self) -> None:
        """Wait until every copy handed over is done."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def take_done(self) -> list[CopyJob]:
        """The copies done since the last call, in the order they ended."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Finish what is queued (at most ``CLOSE_WAIT_S``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("hicache: the copy thread did not finish its queue in %.0f s", CLOSE_WAIT_S)

    def _run(self) -> None:
        client = EngineClient(self._address, self._timeout_ms, curve=self._curve)
        try:
            with torch.inference_mode():  # thread-local: vLLM's KV tensors are inference tensors
                while (job := self._queue.get()) is not None:
                    self._one(job, client)
        finally:
            client.close()

    def _one(self, job: CopyJob, client: EngineClient) -> None:
        began = time.perf_counter()
        try:
            if job.kind == "save" and self._before_save is not None:
                self._before_save()
            job.copied = job.copy()
            job.ok = True
        except Exception as exc:  # the lease ends as failed: vLLM recomputes, nothing is served
            job.error = str(exc) or type(exc).__name__
        job.seconds = time.perf_counter() - began
        job.lease_ended = client.send(job.end_lease(job.ok))
        with self._cond:
            self._pending.remove(job)
            self._done.append(job)
            self._cond.notify_all()
