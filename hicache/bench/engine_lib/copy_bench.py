"""``bench engine`` part ``copy``: the connector's block copies against raw torch copies.

In this process, without vLLM: per-layer KV tensors laid out as vLLM's CPU backend lays them
out (``[num_blocks, kv_heads, block_size, 2 * head_dim]``, ``LBHNC``) and an L2 pool in a
shared-memory segment with the daemon's page layout (one page = one block of every layer,
layer after layer), mapped by ``BlockCopier.attach`` through a ``PoolRef`` as the connector
maps the daemon's pool.

Measured, per size (bytes moved by one call, all layers together) and per index pattern:

* ``load``: ``BlockCopier.load(pages, [blocks])`` (L2 pages -> KV blocks), against the raw
  torch copy of the same blocks between plain tensors of the same shapes: per layer
  ``kv.index_copy_(0, blocks, pages[page_ids, layer])``;
* ``save``: ``BlockCopier.save([blocks], pages)``, against per layer
  ``pages[:, layer].index_copy_(0, page_ids, kv.index_select(0, blocks))``.

Patterns: ``runs`` (consecutive pages to consecutive blocks: what the daemon's allocator
hands out, one strided copy per layer) and ``scattered`` (a random permutation: one copy
per page and layer). Bandwidth in GiB/s, medians of interleaved repeats. Before timing, a
load and a save are checked bitwise against their source.
"""

from __future__ import annotations

import os
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache.connectors.kv_copy import BlockCopier, PoolRef
from hicache.memory.shm import SharedSegment

GiB = float(1 << 30)


@dataclass
class CopyRig:
    """KV tensors, an L2 segment of the same page layout, and a copier attached to it."""

    layers: list[torch.Tensor]
    segment: SharedSegment
    pages: torch.Tensor  # [l2_pages, num_layers, block_elems] over the segment
    copier: BlockCopier
    page_bytes: int

    def close(self) -> None:
        self.copier.detach()
        self.pages = torch.empty(0)
        try:
            self.segment.close()
        except BufferError:
            pass
        self.segment.unlink()


def make_rig(*, num_layers: int, kv_heads: int, block_size: int, head_dim: int, num_blocks: int, l2_pages: int,
             dtype: torch.dtype = torch.bfloat16, directory: str | None = None, seed: int = 0) -> CopyRig:
    """Random KV blocks and random L2 pages (distinct bit patterns), the copier attached."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    bits = {2: torch.int16, 4: torch.int32}[elem]
    layers = [torch.randint(-(1 << 14), 1 << 14, shape, generator=gen, dtype=bits).view(dtype)
              for _ in range(num_layers)]
    block_elems = kv_heads * block_size * 2 * head_dim
    page_bytes = num_layers * block_elems * elem
    name = f"hicache-bench-copy-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    seg = SharedSegment.create(name, l2_pages * page_bytes, directory)
    copier = BlockCopier(layers)
    copier.attach(PoolRef("bench", seg.name, seg.directory, l2_pages, page_bytes))
    pages = copier.l2.tensor
    assert pages is not None
    pages.view(bits).copy_(torch.randint(-(1 << 14), 1 << 14, pages.shape, generator=gen, dtype=bits))
    return CopyRig(layers, seg, pages, copier, page_bytes)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def loaded_correctly(rig: CopyRig, pages: list[int], blocks: list[int]) -> bool:
    """Every layer's block ``blocks[i]`` holds exactly the bytes of L2 page ``pages[i]``."""
    for i, layer in enumerate(rig.layers):
        flat = layer.view(layer.shape[0], -1)
        for p, b in zip(pages, blocks, strict=True):
            if not torch.equal(_bits(flat[b]), _bits(rig.pages[p, i])):
                return False
    return True


def _patterns(n: int, num_blocks: int, l2_pages: int, rng: random.Random) -> dict[str, tuple[list[int], list[int]]]:
    start_p = rng.randrange(0, l2_pages - n + 1)
    start_b = rng.randrange(0, num_blocks - n + 1)
    runs = (list(range(start_p, start_p + n)), list(range(start_b, start_b + n)))
    scattered = (rng.sample(range(l2_pages), n), rng.sample(range(num_blocks), n))
    return {"runs": runs, "scattered": scattered}


def _time_per_call(fn: Callable[[], Any], min_s: float) -> float:
    """Seconds per call of ``fn``, over enough calls to last ``min_s``."""
    calls = 0
    t0 = time.perf_counter()
    while True:
        fn()
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / calls


def run_copy(*, sizes_mib: list[float], num_layers: int, kv_heads: int, block_size: int, head_dim: int,
             repeats: int, min_s: float = 0.02, directory: str | None = None, threads: int = 1,
             progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The copy measurements (see the module docstring), with torch on ``threads`` threads
    (the engines here run one). Returns, per op/pattern/size, the medians in GiB/s
    (``hicache``, ``torch``), their ratio, and the bitwise checks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _run_copy(sizes_mib, num_layers, kv_heads, block_size, head_dim, repeats, min_s, directory, progress)
    finally:
        torch.set_num_threads(before)
    out["threads"] = threads
    return out


def _run_copy(sizes_mib: list[float], num_layers: int, kv_heads: int, block_size: int, head_dim: int,
              repeats: int, min_s: float, directory: str | None, progress: Callable[[str], None]) -> dict[str, Any]:
    elem = 2
    page_bytes = num_layers * kv_heads * block_size * 2 * head_dim * elem
    most = max(1, max(int(s * (1 << 20)) // page_bytes for s in sizes_mib))
    num_blocks = l2_pages = max(2 * most, 16)
    rig = make_rig(num_layers=num_layers, kv_heads=kv_heads, block_size=block_size, head_dim=head_dim,
                   num_blocks=num_blocks, l2_pages=l2_pages, directory=directory)
    rng = random.Random(0)
    try:
        plain_pages = rig.pages.clone()  # same shape and contents, ordinary memory
        plain_layers = [t.view(t.shape[0], -1).clone() for t in rig.layers]
        # correctness, before timing
        check = _patterns(min(most, num_blocks), num_blocks, l2_pages, rng)
        checks: dict[str, bool] = {}
        for pat, (pg, bl) in check.items():
            rig.copier.load(pg, [bl])
            checks[f"load_{pat}"] = loaded_correctly(rig, pg, bl)
            for layer in rig.layers:
                layer.view(layer.shape[0], -1)[bl] = _bits(torch.randint(
                    -(1 << 14), 1 << 14, (len(bl), layer[0].numel()), dtype=torch.int16)).view(layer.dtype)
            rig.copier.save([bl], pg)
            checks[f"save_{pat}"] = loaded_correctly(rig, pg, bl)
        results: list[dict[str, Any]] = []
        for size in sizes_mib:
            n = max(1, int(size * (1 << 20)) // page_bytes)
            nbytes = n * page_bytes
            for pat, (pg, bl) in _patterns(n, num_blocks, l2_pages, rng).items():
                pg_t, bl_t = torch.tensor(pg), torch.tensor(bl)

                def ref_load(pg_t: torch.Tensor = pg_t, bl_t: torch.Tensor = bl_t) -> None:
                    for i, layer in enumerate(plain_layers):
                        layer.index_copy_(0, bl_t, plain_pages[pg_t, i])

                def ref_save(pg_t: torch.Tensor = pg_t, bl_t: torch.Tensor = bl_t) -> None:
                    for i, layer in enumerate(plain_layers):
                        plain_pages[:, i].index_copy_(0, pg_t, layer.index_select(0, bl_t))

                def our_load(pg: list[int] = pg, bl: list[int] = bl) -> int:
                    return rig.copier.load(pg, [bl])

                def our_save(pg: list[int] = pg, bl: list[int] = bl) -> int:
                    return rig.copier.save([bl], pg)

                runs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
                    "load": (our_load, ref_load),
                    "save": (our_save, ref_save),
                }
                for op, (ours, ref) in runs.items():
                    ours()
                    ref()
                    a: list[float] = []
                    b: list[float] = []
                    for _ in range(repeats):
                        a.append(nbytes / _time_per_call(ours, min_s) / GiB)
                        b.append(nbytes / _time_per_call(ref, min_s) / GiB)
                    row: dict[str, Any] = {"op": op, "pattern": pat, "size_mib": nbytes / (1 << 20), "pages": n,
                           "hicache_gib_s": statistics.median(a), "torch_gib_s": statistics.median(b)}
                    row["ratio"] = row["hicache_gib_s"] / row["torch_gib_s"]
                    results.append(row)
                    progress(f"copy {op:4s} {pat:9s} {row['size_mib']:6.2f} MiB: hicache "
                             f"{row['hicache_gib_s']:.2f} GiB/s, torch {row['torch_gib_s']:.2f} GiB/s "
                             f"({row['ratio']:.2f}x)")
        return {"page_bytes": page_bytes, "layers": num_layers, "kv_heads": kv_heads, "block_size": block_size,
                "head_dim": head_dim, "dtype": "bfloat16", "repeats": repeats, "checks": checks,
                "results": results}
    finally:
        rig.close()
