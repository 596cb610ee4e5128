"""One simulated engine of ``hicache bench capacity``: a vLLM engine's traffic to the cache
server, without vLLM or a model.

Each engine is a process of its own (``run_engine``, a ``multiprocessing`` spawn target) that
speaks the engine protocol through the connector's own client (``CacheSession``: the same
registration, heartbeat thread, timeouts and re-registration as inside vLLM) and copies the
pages it loads and saves between the daemon's real shared L2 pool and a buffer of its own,
as the connector copies them between L2 and vLLM's blocks. It imports neither torch nor
vLLM, so eight of them fit beside the daemon on a small machine.

A step, as vLLM's scheduler and the connector make one:

1. admit waiting requests while fewer than ``Load.running`` run: ``Lookup`` each (its prompt
   up to the last whole page before the last token); a hit's pages are copied out of L2 and
   ``Release``d, and count as computed; ``pending`` (a prefetch from L3) asks again later;
2. schedule tokens: one for each decoding request, then prompt chunks within
   ``Load.max_batched_tokens``;
3. one ``Reserve`` for every request whose pages filled in this step (only the tokens the
   daemon does not hold yet travel), then each reservation's pages are copied into L2 and
   ``Commit``ted;
4. ``Finished`` for the requests that decoded their last token.

Only ``Lookup`` and ``Reserve`` are answered; their round trips (from send to answer, in
the engine's process) are what the benchmark reports. A ``busy`` answer (the daemon's queue
for this engine was full) is counted (``lookup_busy``, ``reserve_busy``) and the request goes
on without the cache, as in the connector. Steps run on a fixed clock: a step
that starts late is counted, never skipped.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import resource
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import protos
from hicache.bench.capacity_lib.traffic import DECODED_TOKENS_FROM, TOKEN_LIMIT, Load, Prompts, load_prompts
from hicache.connectors.engine_client import CacheSession

PENDING_RETRY_S = 0.02
"""How soon a lookup answered ``pending`` asks again (the connector's first wait)."""

PROGRESS_EVERY_S = 1.0


@dataclass(frozen=True)
class EngineArgs:
    """Everything one simulated engine needs (picklable: it crosses a spawn)."""

    index: int
    engines: int
    address: str
    register: protos.EngineRegister
    timeout_ms: int
    load: Load
    trace: str
    max_prompt_tokens: int
    start_at: float
    """Wall-clock time (``time.time()``) of the first step, the same for every engine."""
    warmup_s: float
    duration_s: float
    out: str
    seed: int = 0


@dataclass
class SimRequest:
    rid: str
    prompt: array[int]
    decode_tokens: int
    tokens: array[int] = field(default_factory=lambda: array("I"))
    computed: int = 0
    """Tokens whose KV exists (loaded or computed)."""
    saved_pages: int = 0
    known_tokens: int = 0
    """Tokens the daemon holds for this request (sent in a lookup or a save range)."""
    retry_at: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = array("I", self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= len(self.prompt) + self.decode_tokens and self.computed >= len(self.tokens)


@dataclass
class Recorder:
    """Round trips and counts of the measured window (after the warm-up)."""

    rtt_us: dict[str, list[float]] = field(default_factory=lambda: {"lookup": [], "reserve": []})
    frame_bytes: dict[str, list[int]] = field(default_factory=lambda: {"lookup": [], "reserve": []})
    answer_bytes: dict[str, list[int]] = field(default_factory=lambda: {"lookup": [], "reserve": []})
    counts: dict[str, int] = field(default_factory=dict)
    late_ms: list[float] = field(default_factory=list)
    on: bool = False

    def add(self, name: str, n: int = 1) -> None:
        if self.on:
            self.counts[name] = self.counts.get(name, 0) + n


class PoolView:
    """The daemon's L2 pool mapped here with ``mmap`` (no torch): page ``i`` is bytes
    ``[i * page_bytes, (i + 1) * page_bytes)`` of the segment."""

    def __init__(self) -> None:
        self.pool: protos.L2PoolInfo | None = None
        self._map: mmap.mmap | None = None

    def ensure(self, pool: protos.L2PoolInfo) -> None:
        if self.pool == pool:
            return
        self.close()
        fd = os.open(os.path.join(pool.directory, pool.segment), os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, pool.pages * pool.page_bytes)
        finally:
            os.close(fd)
        self.pool = pool

    def load(self, pages: list[int], into: bytearray) -> None:
        """Copy ``pages`` out of L2 (into one scratch page, as a copy's cost)."""
        assert self._map is not None and self.pool is not None
        pb = self.pool.page_bytes
        for p in pages:
            into[:pb] = self._map[p * pb:(p + 1) * pb]

    def save(self, pages: list[int], data: bytes) -> None:
        assert self._map is not None and self.pool is not None
        pb = self.pool.page_bytes
        for p in pages:
            self._map[p * pb:(p + 1) * pb] = data[:pb]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        self._map, self.pool = None, None


class SimEngine:
    """The traffic of one engine (see the module docstring)."""

    def __init__(self, args: EngineArgs, prompts: Prompts) -> None:
        self.args = args
        self.load = args.load
        self.prompts = prompts
        self.session = CacheSession(args.address, args.timeout_ms, args.register)
        self.pool = PoolView()
        self.rec = Recorder()
        self.rng = random.Random(args.seed * 1000 + args.index)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.serial = 0
        self.arrivals = 0.0
        self.page = args.register.geometry.block_size
        self.scratch = bytearray(args.register.page_bytes)
        self.page_data = bytes(self.rng.getrandbits(8) for _ in range(args.register.page_bytes))

    def new_request(self, decode_tokens: int | None = None) -> SimRequest:
        self.serial += 1
        n = self.load.decode_tokens if decode_tokens is None else decode_tokens
        return SimRequest(f"e{self.args.index}-{self.serial}", self.prompts.take(), n)

    def next_decoded(self, req: SimRequest) -> int:
        """A token of ``req``'s own (the first decoded one is unique to the request)."""
        return (DECODED_TOKENS_FROM + self.args.index * 2**24 + self.serial * 7 + len(req.tokens)) % TOKEN_LIMIT

    def call(self, kind: str, make: Any) -> Any:
        t0 = time.perf_counter()
        answer = self.session.call(make)
        dt = (time.perf_counter() - t0) * 1e6
        if answer is None:
            self.rec.add(f"{kind}_unanswered")
            return answer
        if isinstance(answer, protos.EngineError) and answer.code == protos.BUSY:
            self.rec.add(f"{kind}_busy")  # as the connector: this request goes on without the cache
        if self.rec.on:
            self.rec.rtt_us[kind].append(dt)
        return answer

    # --- one step ---------------------------------------------------------------------------

    def admit(self, now: float) -> None:
        keep: list[SimRequest] = []
        for req in self.waiting:
            if len(self.running) >= self.load.running or now < req.retry_at:
                keep.append(req)
                continue
            state = self.lookup(req)
            if state == "pending":
                req.retry_at = now + PENDING_RETRY_S
                keep.append(req)
            else:
                self.running.append(req)
        self.waiting = keep

    def lookup(self, req: SimRequest) -> str:
        usable = (len(req.prompt) - 1) // self.page * self.page
        if usable <= 0:
            return "miss"
        packed = protos.pack_tokens(req.prompt[:usable])
        rid = req.rid
        if self.rec.on:
            self.rec.frame_bytes["lookup"].append(len(packed) + 64)
        answer = self.call("lookup", lambda r, reg: protos.Lookup(r, reg.session, reg.run, rid, packed, "", True, 0))
        self.rec.add("lookups")
        if not isinstance(answer, protos.LookupResult):
            return "miss"
        req.known_tokens = usable
        if answer.pending:
            self.rec.add("lookups_pending")
            return "pending"
        if self.rec.on:
            self.rec.answer_bytes["lookup"].append(len(protos.encode(answer)))
        reg = self.session.registered
        if answer.lease and reg is not None:
            self.pool.ensure(reg.pool)
            self.pool.load(answer.host_pages, self.scratch)
            self.session.send(protos.Release(reg.session, reg.run, answer.lease, len(answer.host_pages), 0))
            req.computed = len(answer.host_pages) * self.page
            self.rec.add("loaded_pages", len(answer.host_pages))
            self.rec.add("loaded_storage_pages", answer.storage_pages)
        return "hit"

    def compute(self) -> None:
        """One step's tokens: a decode token each, then prompt chunks within the budget."""
        budget = self.load.max_batched_tokens
        for req in self.running:
            if req.computed >= len(req.prompt) and len(req.tokens) < len(req.prompt) + req.decode_tokens:
                req.tokens.append(self.next_decoded(req))
                req.computed = len(req.tokens)
                budget -= 1
        for req in self.running:
            if budget <= 0:
                break
            if req.computed < len(req.prompt):
                n = min(budget, len(req.prompt) - req.computed)
                req.computed += n
                budget -= n
                self.rec.add("prefill_tokens", n)

    def save(self) -> None:
        asks: list[tuple[SimRequest, protos.SaveRange, int]] = []
        for req in self.running:
            full = req.computed // self.page
            if full <= req.saved_pages:
                continue
            end = full * self.page
            base = min(req.known_tokens, end)
            asks.append((req, protos.SaveRange(req.rid, protos.pack_tokens(req.tokens[base:end]), req.saved_pages,
                                               "", base), end))
            req.saved_pages = full
        if not asks:
            return
        items = [item for _, item, _ in asks]
        if self.rec.on:
            self.rec.frame_bytes["reserve"].append(sum(len(i.token_ids) + 48 for i in items) + 32)
        answer = self.call("reserve", lambda r, reg: protos.Reserve(r, reg.session, reg.run, items))
        self.rec.add("reserves")
        self.rec.add("save_ranges", len(items))
        if not isinstance(answer, protos.ReserveResult) or len(answer.items) != len(items):
            for req, _, _ in asks:
                req.known_tokens = 0
            return
        if self.rec.on:
            self.rec.answer_bytes["reserve"].append(len(protos.encode(answer)))
        reg = self.session.registered
        for (req, _, end), got in zip(asks, answer.items, strict=True):
            if got.code:
                req.known_tokens = 0
                self.rec.add("save_ranges_refused")
                continue
            req.known_tokens = end
            if not got.lease or reg is None:
                continue
            self.pool.ensure(reg.pool)
            self.pool.save(got.host_pages, self.page_data)
            self.session.send(protos.Commit(reg.session, reg.run, got.lease, True, 0))
            self.rec.add("reserved_pages", len(got.host_pages))

    def finish(self) -> None:
        reg = self.session.registered
        still: list[SimRequest] = []
        for req in self.running:
            if req.done:
                if reg is not None:
                    self.session.send(protos.Finished(reg.session, reg.run, req.rid))
                self.rec.add("finished")
            else:
                still.append(req)
        self.running = still

    def arrive(self) -> None:
        self.arrivals += self.load.new_per_s / self.load.steps_per_s
        while self.arrivals >= 1:
            self.arrivals -= 1
            self.waiting.append(self.new_request())
            self.rec.add("arrived")

    def step(self, now: float) -> None:
        self.arrive()
        self.admit(now)
        self.compute()
        self.save()
        self.finish()
        self.rec.add("steps")


def run_engine(args: EngineArgs, progress: Any) -> None:
    """Process entry point: step until the window ends, then write the results to ``args.out``.
    ``progress`` (a queue) gets ``(index, answered calls, their p99 in µs)`` every second."""
    prompts = load_prompts(args.trace, args.index, args.engines, args.max_prompt_tokens)
    sim = SimEngine(args, prompts)
    # start in a steady state: the requests in flight at staggered points of their decode
    for _ in range(args.load.running):
        sim.waiting.append(sim.new_request(sim.rng.randint(1, args.load.decode_tokens)))
    period = 1.0 / args.load.steps_per_s
    measure_from = args.start_at + args.warmup_s
    end = measure_from + args.duration_s
    cpu0 = wall0 = 0.0
    next_progress = args.start_at + PROGRESS_EVERY_S
    time.sleep(max(0.0, args.start_at - time.time()))
    k = 0
    while True:
        due = args.start_at + k * period
        now = time.time()
        if now >= end:
            break
        if now < due:
            time.sleep(due - now)
            now = time.time()
        elif sim.rec.on:
            sim.rec.late_ms.append((now - due) * 1000)
        if not sim.rec.on and now >= measure_from:
            sim.rec.on = True
            cpu0, wall0 = _cpu_s(), time.monotonic()
        sim.step(time.monotonic())
        k += 1
        if now >= next_progress:
            next_progress += PROGRESS_EVERY_S
            rtts = sim.rec.rtt_us["lookup"] + sim.rec.rtt_us["reserve"]
            progress.put((args.index, len(rtts), _quantile(rtts, 0.99)))
    cpu = _cpu_s() - cpu0
    wall = time.monotonic() - wall0
    sim.session.close()
    sim.pool.close()
    result = {"index": args.index, "rtt_us": sim.rec.rtt_us, "frame_bytes": sim.rec.frame_bytes,
              "answer_bytes": sim.rec.answer_bytes, "counts": sim.rec.counts, "late_ms": sim.rec.late_ms,
              "cpu_s": cpu, "wall_s": wall, "steps_planned": int(args.duration_s * args.load.steps_per_s)}
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, args.out)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]
