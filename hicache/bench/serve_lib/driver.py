"""When requests are sent: closed loop, open loop at a Poisson rate, or at trace times.

A *ready queue* holds the turns that may be sent: at the start, the first turn of every
conversation in order; when turn ``k`` of a conversation is answered, its turn ``k+1``
joins the back of the queue (so a conversation never has two requests in flight, and its
next prompt holds the answer just received). A turn whose conversation failed earlier is
not sent; it counts as ``skipped``.

Modes (``LoadSpec.mode``):

- ``closed``: ``clients`` workers; each takes the next ready turn, sends it, waits for the
  answer, repeats. Concurrency is exactly ``min(clients, ready turns)``.
- ``open``: arrivals at ``rate`` requests/s with exponential gaps from ``seed`` (``inf``: all
  at once); at each arrival the next ready turn is sent (if none is ready the arrival waits
  for one, as SGLang's multi-turn benchmark does). ``max_concurrency`` caps requests in
  flight.
- ``trace``: single-turn workloads with arrival times (``Turn.at_s``): each request is sent
  at ``at_s / speed`` seconds after the start, capped by ``max_concurrency`` if given.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from hicache.bench.serve_lib.client import HttpClient, RequestRecord
from hicache.bench.serve_lib.workloads import Workload, WorkloadError

__all__ = ["LoadSpec", "RunRecords", "drive", "poisson_arrivals"]

Mode = Literal["closed", "open", "trace"]


@dataclass(frozen=True)
class LoadSpec:
    """How to send a workload (see the module docstring). Invalid values raise ``WorkloadError``."""

    mode: Mode = "closed"
    clients: int = 4
    rate: float = math.inf
    max_concurrency: int | None = None
    speed: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open", "trace"):
            raise WorkloadError(f"unknown load mode {self.mode!r}")
        if self.clients < 1:
            raise WorkloadError(f"--clients must be >= 1, got {self.clients}")
        if not self.rate > 0:
            raise WorkloadError(f"--rate must be > 0, got {self.rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise WorkloadError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise WorkloadError(f"--speed must be a positive number, got {self.speed}")

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode, "clients": self.clients if self.mode == "closed" else None,
                "rate": (None if math.isinf(self.rate) else self.rate) if self.mode == "open" else None,
                "max_concurrency": self.max_concurrency, "speed": self.speed if self.mode == "trace" else None,
                "seed": self.seed}


@dataclass
class RunRecords:
    """Every sent request's record in completion order, the wall time from the first send to
    the last answer, and the number of turns not sent (their conversation failed)."""

    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    skipped: int = 0


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival offsets (s) with exponential gaps of mean ``1/rate`` from ``seed``;
    all 0 when ``rate`` is infinite. The first arrival is at 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


class _Run:
    def __init__(self, client: HttpClient, workload: Workload, on_done: Callable[[RequestRecord], None] | None,
                 sentinels: int) -> None:
        self.client = client
        self.workload = workload
        self.on_done = on_done
        self.sentinels = sentinels
        self.answers: dict[int, list[list[int]]] = {c.cid: [] for c in workload.conversations}
        self.by_cid = {c.cid: c for c in workload.conversations}
        self.ready: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        self.outstanding = workload.requests
        self.out = RunRecords()
        self.t0 = time.perf_counter()
        for c in workload.conversations:
            if c.turns:
                self.ready.put_nowait((c.cid, 0))
        if self.outstanding == 0:
            self._settle(0)

    def _settle(self, n: int) -> None:
        self.outstanding -= n
        if self.outstanding == 0:
            for _ in range(self.sentinels):
                self.ready.put_nowait(None)

    async def send(self, cid: int, k: int) -> None:
        conv = self.by_cid[cid]
        turn = conv.turns[k]
        prompt = conv.prompt(k, self.answers[cid])
        rec = await self.client.generate(prompt, turn.max_new_tokens, cid=cid, turn=k, t0=self.t0)
        self.out.records.append(rec)
        if self.on_done is not None:
            self.on_done(rec)
        if rec.ok and k + 1 < len(conv.turns):
            self.answers[cid].append(rec.output_ids)
            self.ready.put_nowait((cid, k + 1))
        elif not rec.ok:
            self.out.skipped += len(conv.turns) - k - 1
            self._settle(len(conv.turns) - k - 1)
        self._settle(1)

    def finish(self) -> RunRecords:
        ends = [r.end_s for r in self.out.records if r.end_s is not None]
        self.out.duration_s = max(ends, default=time.perf_counter() - self.t0)
        return self.out


async def _closed(run: _Run, clients: int) -> None:
    async def worker() -> None:
        while True:
            item = await run.ready.get()
            if item is None:
                return
            await run.send(*item)

    await asyncio.gather(*(worker() for _ in range(clients)))


async def _open(run: _Run, rate: float, max_concurrency: int | None, seed: int) -> None:
    arrivals = poisson_arrivals(rate, run.workload.requests, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task[None]] = []

    async def one(cid: int, k: int) -> None:
        try:
            await run.send(cid, k)
        finally:
            if sem is not None:
                sem.release()

    for at in arrivals:
        delay = run.t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        item = await run.ready.get()
        if item is None:
            break
        if sem is not None:
            await sem.acquire()
        tasks.append(asyncio.create_task(one(*item)))
    await asyncio.gather(*tasks)


async def _trace(run: _Run, speed: float, max_concurrency: int | None) -> None:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    order = sorted(run.workload.conversations, key=lambda c: c.turns[0].at_s or 0.0)
    tasks: list[asyncio.Task[None]] = []

    async def one(cid: int) -> None:
        try:
            await run.send(cid, 0)
        finally:
            if sem is not None:
                sem.release()

    for conv in order:
        delay = run.t0 + (conv.turns[0].at_s or 0.0) / speed - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        tasks.append(asyncio.create_task(one(conv.cid)))
    await asyncio.gather(*tasks)


async def drive(client: HttpClient, workload: Workload, load: LoadSpec,
                on_done: Callable[[RequestRecord], None] | None = None) -> RunRecords:
    """Send every turn of ``workload`` through ``client`` as ``load`` says; ``on_done`` is
    called with each finished record (for a progress bar). Returns when every turn was
    answered or skipped. ``WorkloadError`` for a trace mode on a workload without times or
    with multi-turn conversations."""
    if load.mode == "trace":
        if not workload.timed:
            raise WorkloadError("trace timing needs a workload whose records all have a timestamp")
        if any(len(c.turns) != 1 for c in workload.conversations):
            raise WorkloadError("trace timing needs single-turn requests")
    sentinels = load.clients if load.mode == "closed" else 1
    run = _Run(client, workload, on_done, sentinels)
    if load.mode == "closed":
        await _closed(run, load.clients)
    elif load.mode == "open":
        await _open(run, load.rate, load.max_concurrency, load.seed)
    else:
        await _trace(run, load.speed, load.max_concurrency)
    return run.finish()
