"""What every phase of the scheduler reads and changes: one ``SchedulerState``.

The scheduler (``hicache.scheduler.scheduler``) is one object per phase around this state:

==================  ========================  ==============================================
module              object                    changes
==================  ========================  ==============================================
``admission``       ``Admission``             ``waiting`` -> ``running``: matching, tier
                                              ops, reservations, locks, hit counters
``forward_pass``    ``ForwardPass``           a running request's pages, ``computed``,
                                              its output tokens (one model call per step)
``aux_memory``      ``AuxMemory``             a running request's SWA pages and Mamba
                                              slots, through each component's hooks
                                              (``component_hooks``; the phases call it)
``finishing``       ``Finisher``              removes a request from every queue, gives
                                              back what it holds, sends its final output
``scheduler``       ``Scheduler``             ``waiting`` (submit), admin ops, the step
==================  ========================  ==============================================

Only the process loop's thread touches any of it (nothing here is locked).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import protos
from hicache.config import HicacheConfig
from hicache.memory.allocator import PageAllocator
from hicache.scheduler.budget import L1Budget
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.scheduler.request import Request
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import MambaComponent, SWAComponent
from hicache.tree.node import TreeNode


@dataclass
class SchedulerCounters:
    requests_ok: int = 0
    requests_error: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    forward_passes: int = 0
    integrity_checks: int = 0  # rounds of the idle integrity check that passed (``check_idle``)
    load_join_wait_s: float = 0.0  # time forward passes were held for load-backs (the loop adds it)


@dataclass(eq=False)
class SchedulerState:
    """The queues, the cache and its L1 budget, and the settings the phases share."""

    cfg: HicacheConfig
    cache: UnifiedRadixCache
    l1: PageAllocator
    emit: Callable[[protos.TokenizerMessage], None]
    tier: ControllerDriver | None
    clock: Callable[[], float] = time.monotonic
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    by_rid: dict[str, Request] = field(default_factory=dict)
    """Every request not finished yet (waiting or running), by id."""
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    match_len: dict[str, int] = field(default_factory=dict)
    """A waiting request's latest match length (L1 + L2), for the queue policy."""
    match_node: dict[str, TreeNode] = field(default_factory=dict)
    """A waiting request's latest matched node, for the queue policy."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        self.page_size = self.cache.page_size
        self.swa: SWAComponent | None = self.cache.swa
        self.mamba: MambaComponent | None = self.cache.mamba
        self.hybrid = bool(self.cache.aux)
        s = self.cfg.scheduler
        self.chunk_tokens = max(1, min(s.chunked_prefill_tokens, s.max_prefill_tokens))
        """The most tokens one request computes in one forward pass (a prefill chunk)."""
        self.budget = L1Budget(self.cache)
        """Every running request's L1 reservation (the only place those numbers change)."""

    def forget(self, req: Request) -> None:
        """Take ``req`` out of every queue and map (it is finished or dropped)."""
        self.by_rid.pop(req.rid, None)
        self.match_len.pop(req.rid, None)
        self.match_node.pop(req.rid, None)
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
