"""Offline trace replay through the real tree and tier policies (``hicache replay``).

Modules: ``trace`` (Mooncake records, token mapping), ``workload`` (geometry and keys),
``tiered`` (the tiered simulation through ``UnifiedRadixCache``), ``bounds`` (Belady's
optimum, the infinite ceiling, LRU told which items return), ``sweep`` (curves over capacities and their PNG),
``sizes`` (capacity strings), ``sweep_all`` (every policy and Belady on every vendored
trace: ``hicache replay --sweep-all``).
"""

from __future__ import annotations

from hicache.replay_sim.bounds import belady_hits, infinite_hits, next_uses, returning_lru_hits
from hicache.replay_sim.tiered import SimConfig, SimReport, TierReport, simulate
from hicache.replay_sim.trace import Trace, TraceError, infer_block_size, load_trace
from hicache.replay_sim.workload import Workload

__all__ = [
    "SimConfig", "SimReport", "TierReport", "Trace", "TraceError", "Workload", "belady_hits",
    "infer_block_size", "infinite_hits", "load_trace", "next_uses", "returning_lru_hits",
    "simulate",
]
