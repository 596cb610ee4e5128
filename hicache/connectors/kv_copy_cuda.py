"""Copies between a CUDA KV cache and hicache's L2 pages: pinned L2, a side stream, events.

**Not enabled.** This path has never run on a GPU: the connector refuses a CUDA KV cache at
start (``kv_copy.CUDA_REFUSAL``) until ``python -m hicache.connectors.gpu_check`` has passed
on one (bitwise load / save against plain torch copies, then bandwidth). It is here so that
the check, and enabling it, need no new code.

Same contract as ``kv_copy.BlockCopier`` (``attach`` / ``detach`` / ``load`` / ``save``),
plus what asynchronous copies need:

============================  ===============================================================
call                          what it does
============================  ===============================================================
``attach(pool)``              map the L2 segment and register it as pinned memory
                              (``cudaHostRegister``), so copies are DMA and non-blocking
``start_load(pages, blocks)`` enqueue L2 -> block copies on the side stream, layer by layer,
                              recording one event per layer; returns at once
``wait_layer(i)``             make the compute stream wait for layer ``i``'s copies (vLLM's
                              ``wait_for_layer_load``)
``finish_loads()``            wait until every enqueued load is done: only then may the L2
                              pages' leases be released (the daemon may reuse them)
``save(blocks, pages)``       side stream waits for the compute stream (the blocks are
                              written), copies block -> L2, and waits for the copies: the
                              commit may follow at once
============================  ===============================================================

Layouts: the block index on axis 0 (``[num_blocks, ...]``) or, as in vLLM's flash-attention
layout, on axis 1 after a K/V axis (``[2, num_blocks, ...]``); a page's bytes for one layer
are that layer's block in the view with the block axis first (C order), so a page written by
one layout is only read by the same layout (the layout is part of the page identity).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache.connectors.kv_copy import L2Pages, PoolRef
from hicache.memory.pools import page_runs


def _cudart() -> Any:
    """The CUDA runtime bindings (``cudaHostRegister`` / ``cudaHostUnregister``)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch


def block_first(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``t`` viewed with its block axis first; raises ValueError for a layout without one."""
    if t.shape[0] == num_blocks:
        return t
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return t.movedim(1, 0)
    raise ValueError(f"KV shape {tuple(t.shape)} has no block axis of {num_blocks} blocks first or after K/V")


class CudaBlockCopier:
    """Block <-> page copies for one engine's CUDA KV tensors (``layers``, in layer order)."""

    def __init__(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        if not layers or any(t.device.type != "cuda" for t in layers):
            raise ValueError("CudaBlockCopier copies CUDA KV tensors only")
        self.views = [block_first(t, num_blocks) for t in layers]
        self.block_shape = tuple(self.views[0].shape[1:])
        self.block_elems = self.views[0][0].numel()
        self.num_blocks = num_blocks
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self.layer_events: list[torch.cuda.Event | None] = [None] * len(layers)
        self.l2 = L2Pages(len(layers), self.block_elems, self.dtype)
        self._pinned_ptr: int | None = None

    # ------------------------------------------------------------------ the pool
    @property
    def pool(self) -> PoolRef | None:
        return self.l2.pool

    def attach(self, pool: PoolRef) -> None:
        if self.l2.pool == pool:
            return
        self.detach()
        self.l2.attach(pool)
        pages = self.l2.tensor
        assert pages is not None
        nbytes = pool.pages * pool.page_bytes
        rc = _cudart().cudaHostRegister(pages.data_ptr(), nbytes, 0)
        if int(rc) != 0:
            self.l2.detach()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of L2 failed with CUDA error {int(rc)}")
        self._pinned_ptr = pages.data_ptr()

    def detach(self) -> None:
        if self._pinned_ptr is not None:
            self.stream.synchronize()
            _cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self.l2.detach()

    def _check(self, blocks: list[int], pages: list[int]) -> torch.Tensor:
        return self.l2.check(blocks, pages, self.num_blocks)

    # ------------------------------------------------------------------ copies
    def start_load(self, pages: list[int], blocks: list[int]) -> int:
        """Enqueue L2 ``pages[i]`` -> block ``blocks[i]`` for every layer; returns bytes."""
        l2 = self._check(blocks, pages)
        runs = page_runs(pages, blocks)
        with torch.cuda.stream(self.stream):
            for i, view in enumerate(self.views):
                for p, b, n in runs:
                    view[b : b + n].copy_(l2[p : p + n, i].view(n, *self.block_shape), non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
                event.record(self.stream)
                self.layer_events[i] = event
        return len(pages) * l2[0].numel() * l2.element_size()

    def wait_layer(self, i: int) -> None:
        event = self.layer_events[i]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def finish_loads(self) -> None:
        self.stream.synchronize()
        self.layer_events = [None] * len(self.views)

    def load(self, pages: list[int], blocks: list[int]) -> int:
        """``start_load`` and wait for it (``BlockCopier``'s synchronous contract)."""
        n = self.start_load(pages, blocks)
        self.finish_loads()
        return n

    def save(self, blocks: list[int], pages: list[int]) -> int:
        """Block ``blocks[i]`` of every layer -> L2 ``pages[i]``, after the compute stream's
        writes; returns once the bytes are in L2."""
        l2 = self._check(blocks, pages)
        runs = page_runs(blocks, pages)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, view in enumerate(self.views):
                for b, p, n in runs:
                    l2[p : p + n, i].view(n, *self.block_shape).copy_(view[b : b + n], non_blocking=True)
        self.stream.synchronize()
        return len(pages) * l2[0].numel() * l2.element_size()
