"""L1 <-> L2 page copies for the cache controller.

The engine checks an op completely before touching memory (known components, equal source
and destination lengths, every index in range, no destination page twice), so a refused op
changes nothing. ``prepare`` does the checks and turns the op into a ``CopyPlan`` (view
pairs from ``hicache.memory.pools``, one per run of consecutive pages and tensor; no bytes
move); ``execute`` copies it with one ``copy_`` per pair, which runs without the GIL for the
bulk of the bytes.

Threads: ``execute`` copies on the calling thread. Cutting a plan into two shares copied
by two threads at once was measured on the 2-core development machine (0.5-16 MiB batches
of scattered pages, page sizes 16 and 64): the hand-off to the second thread cost 20-60 us
per op, more than it saved up to 4 MiB, and at 16 MiB it gained at most ~10%, so there is
no such split. The threads torch uses inside one ``copy_`` are the controller process's
setting (``controller.args.COPY_THREADS``).

Choosing the engine happens once, in ``make_transfer_engine``: the loop that calls it never
branches on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.memory.pools import CopyPair, SharedPools
from protos import LoadToDevice, WriteToHost


class TransferRefused(ValueError):
    """An op that cannot be executed as given (bad component, lengths or indices)."""


def repeated_destination(component: str, pages: list[int]) -> str | None:
    """Why an op that writes ``pages`` of ``component`` cannot run (a page twice: two
    sources racing into one page), or None. For every op that writes pages: copies and
    L3 fetches."""
    if len(pages) > 1 and len(set(pages)) != len(pages):
        return f"{component}: a destination page appears twice"
    return None


@dataclass(frozen=True)
class CopyResult:
    pages: int
    bytes: int


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """A checked op as view pairs: ``dst.copy_(src)`` for each pair executes it.

    ``pages`` counts pages over all components (what ``OpDone.pages_done`` reports),
    ``nbytes`` the bytes that move."""

    pairs: list[CopyPair]
    pages: int
    nbytes: int


class CpuTransferEngine:
    """Copies between L1 and L2 pools that both live in host shared memory. Stateless
    between calls: safe to use from several threads."""

    device = "cpu"

    def __init__(self, pools: SharedPools) -> None:
        self.pools = pools

    def prepare(self, msg: WriteToHost | LoadToDevice) -> CopyPlan:
        """Check ``msg`` completely, then plan it; raise TransferRefused with the reason if it
        cannot be executed as given. Touches no memory."""
        device_pages, host_pages = msg.device_pages, msg.host_pages
        if device_pages.keys() != host_pages.keys():  # key views compare as sets, without building one
            raise TransferRefused(
                f"components differ: device {sorted(device_pages)} vs host {sorted(host_pages)}")
        to_host = isinstance(msg, WriteToHost)
        components = self.pools.components
        for name, dev in device_pages.items():
            comp = components.get(name)
            if comp is None:
                raise TransferRefused(f"unknown component {name!r}")
            host = host_pages[name]
            if len(dev) != len(host):
                raise TransferRefused(f"{name}: {len(dev)} device pages but {len(host)} host pages")
            problem = comp.pages_problem("l1", dev) or comp.pages_problem("l2", host)
            if problem:
                raise TransferRefused(problem)
            repeated = repeated_destination(name, host if to_host else dev)
            if repeated:
                raise TransferRefused(repeated)
        pairs: list[CopyPair] = []
        pages = nbytes = 0
        for name, dev in device_pages.items():
            comp = components[name]
            host = host_pages[name]
            pairs += comp.plan_l1_to_l2(dev, host) if to_host else comp.plan_l2_to_l1(host, dev)
            pages += len(dev)
            nbytes += len(dev) * comp.layout.l2_page_bytes
        return CopyPlan(pairs, pages, nbytes)

    def execute(self, plan: CopyPlan) -> None:
        """Copy every pair of a plan made by ``prepare``; returns when every byte has moved."""
        for dst, src in plan.pairs:
            dst.copy_(src)

    def run(self, msg: WriteToHost | LoadToDevice) -> CopyResult:
        """Check and execute an op. Returns pages and bytes moved over all components."""
        plan = self.prepare(msg)
        self.execute(plan)
        return CopyResult(plan.pages, plan.nbytes)


def make_transfer_engine(pools: SharedPools, device: str) -> CpuTransferEngine:
    """The engine for ``device``. CUDA L1 pools are not supported by this build yet."""
    if device != "cpu":
        raise NotImplementedError(
            f"device {device!r}: this build keeps L1 in host memory only; set device: cpu")
    return CpuTransferEngine(pools)
