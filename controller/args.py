"""What the cache-controller process is started with (``ControllerArgs``, pickled by the
``spawn`` that starts it). Light on purpose: the launcher builds these without importing the
controller's own modules (torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.memory.layout import PoolLayout
    from hicache.runtime.ipc import Endpoints

COPY_THREADS = 1
"""torch intra-op (OpenMP) threads of the controller process: the threads inside one ``copy_``.

One, measured with ``hicache bench transfer`` on the 2-core development machine. The
controller shares the cores with other processes that run torch (the model runner; in the
benchmark, the benchmark process). With torch's default of one thread per core, a copy big
enough for torch to split (a run of 64-token pages) left OpenMP workers of both processes
competing for the two cores, and copies of 0.5-4 MiB stalled for a scheduler tick (~4 ms,
0.13 GB/s instead of 3-9 GB/s) in both processes. With one thread those stalls are gone;
16-token pages (128 KiB runs, below torch's split size) copy at the same speed either way.
Alone on the machine, two threads copy multi-page 64-token runs up to ~1.5x faster: a host
with cores to spare may raise this."""


@dataclass(frozen=True)
class ControllerArgs:
    """What the controller process is started with (pickled by ``spawn``)."""

    layout: PoolLayout
    endpoints: Endpoints
    storage: Any = None  # storage_backends settings, or None for no L3
    ready_address: str | None = None
    device: str = "cpu"
    io_threads: int = 4
    log_level: str = "info"
    log_json: bool = False
    metrics_enabled: bool = True
    copy_threads: int = COPY_THREADS  # torch intra-op threads of the controller process
    l3_quotas_gb: dict[str, float] = field(default_factory=dict)
    """Per tenant, its L3 partition's size (``server.api_keys[].quota.l3_gb``)."""
    run: int = 0
    """This controller's run: the launcher draws a fresh one for every start, and ops
    naming another run are refused (``protos.to_controller``)."""
