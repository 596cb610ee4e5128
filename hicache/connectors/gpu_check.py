"""``python -m hicache.connectors.gpu_check``: verify the CUDA copy path on a GPU.

The one script a machine with a GPU runs before a CUDA KV cache may be enabled in the
connector (``kv_copy_cuda``; today refused at start): for both KV layouts (block index first,
and vLLM's flash-attention ``[2, num_blocks, block_size, heads, head_dim]``) it loads random
L2 pages into random blocks and saves blocks into pages, run-shaped and scattered, and
compares every byte with plain torch indexing of the same tensors; then it times loads and
saves against ``torch`` copies of the same bytes between pinned host memory and the device
(medians of ``--repeats``). Prints one JSON object; exits 1 on any mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.connectors.kv_copy import PoolRef
from hicache.memory.pools import segment_tensor
from hicache.memory.shm import SharedSegment, TensorSpec

if TYPE_CHECKING:
    from hicache.connectors.kv_copy_cuda import CudaBlockCopier


def _layouts(num_blocks: int, bs: int, heads: int, dim: int) -> dict[str, tuple[int, ...]]:
    return {"block_first": (num_blocks, heads, bs, 2 * dim), "flash": (2, num_blocks, bs, heads, dim)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--copy-pages", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    from hicache.connectors.kv_copy_cuda import CudaBlockCopier, block_first

    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    block_elems = args.heads * args.block_size * 2 * args.head_dim
    page_bytes = args.layers * block_elems * elem
    name = f"hicache-gpucheck-{os.getpid()}"
    seg = SharedSegment.create(name, args.pages * page_bytes)
    out: dict[str, object] = {"ok": True, "device": torch.cuda.get_device_name(), "page_bytes": page_bytes}
    gen = torch.Generator().manual_seed(0)
    try:
        pages = segment_tensor(seg, TensorSpec(name, (args.pages, args.layers, block_elems), args.dtype))
        pages.copy_(torch.randn(pages.shape, generator=gen).to(dtype))
        pool = PoolRef("gpucheck", name, seg.directory, args.pages, page_bytes)
        n = args.copy_pages
        cases = {
            "runs": (list(range(10, 10 + n)), list(range(100, 100 + n))),
            "scattered": (torch.randperm(args.pages, generator=gen)[:n].tolist(),
                          torch.randperm(args.blocks, generator=gen)[:n].tolist()),
        }
        for layout, shape in _layouts(args.blocks, args.block_size, args.heads, args.head_dim).items():
            layers = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(args.layers)]
            copier = CudaBlockCopier(layers, args.blocks)
            copier.attach(pool)
            views = [block_first(t, args.blocks) for t in layers]
            for case, (pg, bl) in cases.items():
                copier.load(pg, bl)
                want = pages[pg].to("cuda")  # [n, layers, elems]
                for i, v in enumerate(views):
                    got = v[bl].reshape(n, -1)
                    if not torch.equal(got, want[:, i]):
                        out["ok"] = False
                        out[f"{layout}_{case}_load"] = f"layer {i} differs"
                back = list(range(args.pages - n, args.pages))
                before = pages[back].clone()
                copier.save(bl, back)
                for i, v in enumerate(views):
                    if not torch.equal(pages[back, i], v[bl].reshape(n, -1).cpu()):
                        out["ok"] = False
                        out[f"{layout}_{case}_save"] = f"layer {i} differs"
                pages[back] = before
                out[f"{layout}_{case}"] = "bitwise equal" if out["ok"] else "MISMATCH"
            out[f"{layout}_bandwidth"] = _bandwidth(copier, views, pages, cases["runs"], args.repeats)
            copier.detach()
    finally:
        seg.unlink()
        seg.close()
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


def _bandwidth(copier: CudaBlockCopier, views: list[torch.Tensor], pages: torch.Tensor,
               case: tuple[list[int], list[int]], repeats: int) -> dict[str, float]:
    """GB/s of copier loads / saves against torch copies of the same bytes (pinned <-> device)."""
    pg, bl = case
    nbytes = len(pg) * pages[0].numel() * pages.element_size()
    pinned = torch.empty((len(pg), *pages.shape[1:]), dtype=pages.dtype).pin_memory()
    device = torch.empty(pinned.shape, dtype=pages.dtype, device="cuda")

    def timed(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9

    res = {
        "load_gbps": timed(lambda: copier.load(pg, bl)),
        "save_gbps": timed(lambda: copier.save(bl, pg)),
        "raw_h2d_gbps": timed(lambda: device.copy_(pinned, non_blocking=True)),
        "raw_d2h_gbps": timed(lambda: pinned.copy_(device, non_blocking=True)),
    }
    res["load_ratio"] = res["load_gbps"] / res["raw_h2d_gbps"]
    res["save_ratio"] = res["save_gbps"] / res["raw_d2h_gbps"]
    return res


if __name__ == "__main__":
    sys.exit(main())
