"""``python -m hicache.connectors.gpu_check``: verify the CUDA copy path on a GPU.

The one script a machine with a GPU runs before a CUDA KV cache may be enabled in the
connector (``kv_copy_cuda``; today refused at start). For both KV layouts (block index
first, and vLLM's flash-attention ``[2, num_blocks, block_size, heads, head_dim]``) it runs
every copy mode (``hicache_copy``) the way the worker would, on run-shaped and scattered
page lists, and compares every byte with plain torch indexing of the same tensors:

======  ======================================================================================
mode    what is checked
======  ======================================================================================
sync    ``load`` then ``save`` on the calling thread
layer   ``start_load``, then for each layer ``wait_layer`` and a read of that layer on the
        compute stream (vLLM's ``wait_for_layer_load``), then ``finish_loads``
async   a load on a copy thread while the compute stream is busy; a save on a copy thread
        of blocks the compute stream wrote behind a long kernel (``mark_written``: the
        save must wait for those writes)
======  ======================================================================================

Then it times loads and saves against ``torch`` copies of the same bytes between pinned host
memory and the device (medians of ``--repeats``). Prints one JSON object; exits 1 on any
mismatch, 2 without CUDA. ``--device cpu`` runs the same code with ``InlineStreams`` (the
check itself and the copy arithmetic, not CUDA: CI runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.connectors.kv_copy import PoolRef
from hicache.memory.pools import segment_tensor
from hicache.memory.shm import SharedSegment, TensorSpec

if TYPE_CHECKING:
    from hicache.connectors.kv_copy_cuda import CudaBlockCopier

MODES = ("sync", "layer", "async")

Case = tuple[list[int], list[int]]
"""(L2 pages, blocks), pairwise."""


def _layouts(num_blocks: int, bs: int, heads: int, dim: int) -> dict[str, tuple[int, ...]]:
    return {"block_first": (num_blocks, heads, bs, 2 * dim), "flash": (2, num_blocks, bs, heads, dim)}


class _Check:
    """One layout's copier, its block views, the L2 pages and the device's compute."""

    def __init__(self, copier: CudaBlockCopier, views: list[torch.Tensor], pages: torch.Tensor, busy_size: int) -> None:
        self.copier, self.views, self.pages = copier, views, pages
        self.device = copier.device
        self.cuda = self.device.type == "cuda"
        self._busy = torch.ones((busy_size, busy_size), dtype=pages.dtype, device=self.device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def busy(self, rounds: int = 8) -> torch.Tensor:
        """Kernels that keep the compute stream busy for a while (enqueued, not waited for)."""
        x = self._busy
        for _ in range(rounds):
            x = (x @ self._busy) * 1e-3
        return x

    def loaded(self, case: Case, layers: range | None = None) -> list[str]:
        """What differs between the blocks and the pages they were loaded from (read on
        the compute stream)."""
        pg, bl = case
        want = self.pages[pg].to(self.device)  # [n, layers, elems]
        return [f"layer {i} differs" for i in (layers or range(len(self.views)))
                if not torch.equal(self.views[i][bl].reshape(len(bl), -1), want[:, i])]

    def saved(self, blocks: list[int], back: list[int]) -> list[str]:
        self.sync()
        return [f"layer {i} differs" for i, v in enumerate(self.views)
                if not torch.equal(self.pages[back, i], v[blocks].reshape(len(blocks), -1).cpu())]

    def clear(self, blocks: list[int]) -> None:
        for v in self.views:
            v[blocks] = 0
        self.sync()

    def run(self, mode: str, case: Case, back: list[int]) -> list[str]:
        """One mode on one case: the load of ``case``, then a save of its blocks into the
        pages ``back``; what differed (empty: bitwise equal). The pages are restored."""
        pg, bl = case
        before = self.pages[back].clone()
        self.clear(bl)
        try:
            run: dict[str, Callable[[list[int], list[int], list[int]], list[str]]] = {
                "sync": self._sync, "layer": self._layer, "async": self._async}
            return run[mode](pg, bl, back)
        finally:
            self.pages[back] = before

    def _sync(self, pg: list[int], bl: list[int], back: list[int]) -> list[str]:
        self.copier.load(pg, bl)
        bad = self.loaded((pg, bl))
        self.copier.save(bl, back)
        return bad + [f"save: {b}" for b in self.saved(bl, back)]

    def _layer(self, pg: list[int], bl: list[int], back: list[int]) -> list[str]:
        self.copier.start_load(pg, bl)
        bad = []
        for i in range(len(self.views)):
            self.copier.wait_layer(i)
            bad += self.loaded((pg, bl), range(i, i + 1))  # read on the compute stream, now
            self.busy(1)  # the layer's compute
        self.copier.finish_loads()
        self.copier.save(bl, back)
        return bad + [f"save: {b}" for b in self.saved(bl, back)]

    def _async(self, pg: list[int], bl: list[int], back: list[int]) -> list[str]:
        errors: list[str] = []

        def on_thread(fn: Callable[[], object]) -> threading.Thread:
            def run() -> None:
                try:
                    fn()
                except Exception as exc:  # reported, not raised on the thread
                    errors.append(f"copy thread: {exc!r}")
            t = threading.Thread(target=run)
            t.start()
            return t

        t = on_thread(lambda: self.copier.load(pg, bl))
        self.busy()  # other requests' forward passes meanwhile
        t.join()
        bad = errors + self.loaded((pg, bl))
        errors.clear()
        # a step writes its blocks behind a long kernel; the copy thread saves them after it
        fresh = [torch.randn(v[bl].shape, generator=torch.Generator().manual_seed(i)).to(v.dtype).to(self.device)
                 for i, v in enumerate(self.views)]
        self.sync()
        self.busy()
        for v, f in zip(self.views, fresh, strict=True):
            v[bl] = f
        mark = self.copier.mark_written()
        on_thread(lambda: self.copier.save(bl, back, after=mark)).join()
        bad += errors + [f"save: {b}" for b in self.saved(bl, back)]
        return bad + [f"save: layer {i} is not the step's writes" for i, f in enumerate(fresh)
                      if not torch.equal(self.pages[back, i], f.reshape(len(bl), -1).cpu())]

    def bandwidth(self, case: Case, repeats: int) -> dict[str, float]:
        """GB/s of copier loads / saves against torch copies of the same bytes (pinned <->
        device on CUDA)."""
        pg, bl = case
        nbytes = len(pg) * self.pages[0].numel() * self.pages.element_size()
        host = torch.empty((len(pg), *self.pages.shape[1:]), dtype=self.pages.dtype)
        host = host.pin_memory() if self.cuda else host
        device = torch.empty(host.shape, dtype=self.pages.dtype, device=self.device)

        def timed(fn: Callable[[], object]) -> float:
            times = []
            for _ in range(repeats):
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                times.append(time.perf_counter() - t0)
            return nbytes / statistics.median(times) / 1e9

        res = {
            "load_gbps": timed(lambda: self.copier.load(pg, bl)),
            "save_gbps": timed(lambda: self.copier.save(bl, pg)),
            "raw_h2d_gbps": timed(lambda: device.copy_(host, non_blocking=True)),
            "raw_d2h_gbps": timed(lambda: host.copy_(device, non_blocking=True)),
        }
        res["load_ratio"] = res["load_gbps"] / res["raw_h2d_gbps"]
        res["save_ratio"] = res["save_gbps"] / res["raw_d2h_gbps"]
        return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the same checks with InlineStreams (the check, not CUDA)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--copy-pages", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--busy-size", type=int, default=0,
                   help="side of the matrices that keep the compute stream busy (default 4096 on CUDA, 128 on CPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    inline = args.device == "cpu"
    if not 0 < args.copy_pages <= min(args.blocks, args.pages - 10):
        p.error("--copy-pages must be > 0, at most --blocks and at most --pages - 10")
    if not inline and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    from hicache.connectors.kv_copy_cuda import CudaBlockCopier, block_first

    dtype = getattr(torch, args.dtype)
    busy_size = args.busy_size or (128 if inline else 4096)
    elem = torch.empty((), dtype=dtype).element_size()
    block_elems = args.heads * args.block_size * 2 * args.head_dim
    page_bytes = args.layers * block_elems * elem
    name = f"hicache-gpucheck-{os.getpid()}"
    seg = SharedSegment.create(name, args.pages * page_bytes)
    out: dict[str, object] = {"ok": True, "device": "cpu (InlineStreams)" if inline else torch.cuda.get_device_name(),
                              "modes": list(MODES), "page_bytes": page_bytes}
    gen = torch.Generator().manual_seed(0)
    try:
        pages = segment_tensor(seg, TensorSpec(name, (args.pages, args.layers, block_elems), args.dtype))
        pages.copy_(torch.randn(pages.shape, generator=gen).to(dtype))
        pool = PoolRef("gpucheck", name, seg.directory, args.pages, page_bytes)
        n = args.copy_pages
        first_block = min(100, args.blocks - n)
        cases: dict[str, Case] = {
            "runs": (list(range(10, 10 + n)), list(range(first_block, first_block + n))),
            "scattered": (torch.randperm(args.pages, generator=gen)[:n].tolist(),
                          torch.randperm(args.blocks, generator=gen)[:n].tolist()),
        }
        back = list(range(args.pages - n, args.pages))
        for layout, shape in _layouts(args.blocks, args.block_size, args.heads, args.head_dim).items():
            layers = [torch.zeros(shape, dtype=dtype, device=args.device) for _ in range(args.layers)]
            copier = CudaBlockCopier(layers, args.blocks, inline=inline)
            copier.attach(pool)
            check = _Check(copier, [block_first(t, args.blocks) for t in layers], pages, busy_size)
            for mode in MODES:
                for case_name, case in cases.items():
                    bad = check.run(mode, case, back)
                    out[f"{layout}_{mode}_{case_name}"] = "; ".join(bad) if bad else "bitwise equal"
                    out["ok"] = bool(out["ok"]) and not bad
            out[f"{layout}_bandwidth"] = check.bandwidth(cases["runs"], args.repeats)
            copier.detach()
    finally:
        seg.unlink()
        seg.close()
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
