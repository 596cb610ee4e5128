"""L1 <-> L2 page copies for the cache controller.

The engine checks an op completely before touching memory (known components, equal source
and destination lengths, every index in range, no destination page twice), so a refused op
changes nothing. It copies with ``hicache.memory.pools`` primitives, which run without the
GIL for the bulk of the bytes.

Choosing the engine happens once, in ``make_transfer_engine``: the loop that calls it never
branches on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.memory.pools import SharedPools
from protos import LoadToDevice, WriteToHost


class TransferRefused(ValueError):
    """An op that cannot be executed as given (bad component, lengths or indices)."""


@dataclass(frozen=True)
class CopyResult:
    pages: int
    bytes: int


class CpuTransferEngine:
    """Copies between L1 and L2 pools that both live in host shared memory."""

    device = "cpu"

    def __init__(self, pools: SharedPools) -> None:
        self.pools = pools

    def check(self, msg: WriteToHost | LoadToDevice) -> None:
        """Raise TransferRefused with the reason if ``msg`` cannot be executed as given."""
        if set(msg.device_pages) != set(msg.host_pages):
            raise TransferRefused(
                f"components differ: device {sorted(msg.device_pages)} vs host {sorted(msg.host_pages)}")
        for name, dev in msg.device_pages.items():
            if name not in self.pools.components:
                raise TransferRefused(f"unknown component {name!r}")
            comp = self.pools[name]
            host = msg.host_pages[name]
            if len(dev) != len(host):
                raise TransferRefused(f"{name}: {len(dev)} device pages but {len(host)} host pages")
            for tier, pages in (("l1", dev), ("l2", host)):
                problem = comp.pages_problem(tier, pages)
                if problem:
                    raise TransferRefused(problem)
            dst = host if isinstance(msg, WriteToHost) else dev
            if len(set(dst)) != len(dst):
                raise TransferRefused(f"{name}: a destination page appears twice")

    def nbytes(self, msg: WriteToHost | LoadToDevice) -> int:
        return sum(len(pages) * self.pools[name].layout.l2_page_bytes for name, pages in msg.host_pages.items())

    def run(self, msg: WriteToHost | LoadToDevice) -> CopyResult:
        """Execute a checked op. Returns pages and bytes moved over all components."""
        pages = 0
        for name, dev in msg.device_pages.items():
            comp = self.pools[name]
            host = msg.host_pages[name]
            if isinstance(msg, WriteToHost):
                comp.copy_l1_to_l2(dev, host)
            else:
                comp.copy_l2_to_l1(host, dev)
            pages += len(dev)
        return CopyResult(pages, self.nbytes(msg))


def make_transfer_engine(pools: SharedPools, device: str) -> CpuTransferEngine:
    """The engine for ``device``. CUDA L1 pools are not supported by this build yet."""
    if device != "cpu":
        raise NotImplementedError(
            f"device {device!r}: this build keeps L1 in host memory only; set device: cpu")
    return CpuTransferEngine(pools)
