"""Copies between a CUDA KV cache and hicache's L2 pages: pinned L2, a side stream, events.

**Not enabled.** This path has never run on a GPU: the connector refuses a CUDA KV cache at
start (``kv_copy.CUDA_REFUSAL``) until ``python -m hicache.connectors.gpu_check`` has passed
on one (every copy mode, bitwise against plain torch copies, then bandwidth). It is here so
that the check, and enabling it, need no new code.

Same contract as ``kv_copy.BlockCopier`` (``attach`` / ``detach`` / ``load`` / ``save``),
plus what the copy modes need (``hicache_copy``; docs/engine-mode.md, "Copy modes"):

============================  ===============================================================
call                          what it does
============================  ===============================================================
``attach(pool)``              map the L2 segment and register it as pinned memory
                              (``cudaHostRegister``), so copies are DMA and non-blocking
``start_load(pages, blocks)`` enqueue L2 -> block copies on the side stream, layer by layer,
                              recording one event per layer; returns at once (``layer``)
``wait_layer(i)``             make the compute stream wait for layer ``i``'s copies (vLLM's
                              ``wait_for_layer_load``)
``finish_loads()``            wait until every enqueued load is done: only then may the L2
                              pages' leases be released (the daemon may reuse them)
``load(pages, blocks)``       ``start_load`` + ``finish_loads`` (``sync``, and ``async`` from
                              the copy thread)
``mark_written()``            an event on the caller's current stream: the point after which
                              the blocks of a step are written (the worker takes it in
                              ``wait_for_save``, on vLLM's thread)
``save(blocks, pages,         the side stream waits for ``after`` (default: the calling
after=None)``                 thread's current stream now), copies block -> L2, and waits
                              for the copies: the commit may follow at once. ``async``
                              saves run on the copy thread, after the step's ``mark_written``
============================  ===============================================================

Every CUDA call (registration, the stream, events) is in ``CudaStreams``; ``InlineStreams``
stands in for it on the CPU, where a copy is done when its call returns, so that
``gpu_check --device cpu`` runs the same code everywhere else (what it checks there is the
check itself and the copy arithmetic, not CUDA).

Layouts: the block index on axis 0 (``[num_blocks, ...]``) or, as in vLLM's flash-attention
layout, on axis 1 after a K/V axis (``[2, num_blocks, ...]``); a page's bytes for one layer
are that layer's block in the view with the block axis first (C order), so a page written by
one layout is only read by the same layout (the layout is part of the page identity).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hicache.connectors.kv_copy import L2Pages, PoolRef
from hicache.memory.pools import page_runs


def block_first(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``t`` viewed with its block axis first; raises ValueError for a layout without one."""
    if t.shape[0] == num_blocks:
        return t
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return t.movedim(1, 0)
    raise ValueError(f"KV shape {tuple(t.shape)} has no block axis of {num_blocks} blocks first or after K/V")


class CudaStreams:
    """The CUDA calls of the copier: pinned registration, one side stream, events."""

    device_type = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # unannotated in torch

    @staticmethod
    def _cudart() -> Any:
        return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch

    def register(self, ptr: int, nbytes: int) -> int:
        """``cudaHostRegister``; the CUDA error code (0: ok)."""
        return int(self._cudart().cudaHostRegister(ptr, nbytes, 0))

    def unregister(self, ptr: int) -> None:
        self.side.synchronize()
        self._cudart().cudaHostUnregister(ptr)

    def on_side(self) -> contextlib.AbstractContextManager[object]:
        """Kernels and copies issued inside run on the side stream."""
        return torch.cuda.stream(self.side)

    def record_side(self) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(self.side)
        return event

    def record_current(self) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(torch.cuda.current_stream(self.device))
        return event

    def current_waits(self, event: object) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def side_waits(self, event: object) -> None:
        self.side.wait_event(event)  # type: ignore[arg-type]

    def sync_side(self) -> None:
        self.side.synchronize()


class InlineStreams:
    """``CudaStreams``' stand-in on the CPU: every copy is done when its call returns, so
    there is nothing to register, record or wait for."""

    device_type = "cpu"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def register(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister(self, ptr: int) -> None:
        pass

    @contextlib.contextmanager
    def on_side(self) -> Iterator[object]:
        yield None

    def record_side(self) -> object:
        return None

    def record_current(self) -> object:
        return None

    def current_waits(self, event: object) -> None:
        pass

    def side_waits(self, event: object) -> None:
        pass

    def sync_side(self) -> None:
        pass


class CudaBlockCopier:
    """Block <-> page copies for one engine's CUDA KV tensors (``layers``, in layer order);
    ``inline=True`` takes CPU tensors and ``InlineStreams`` (``gpu_check --device cpu``)."""

    def __init__(self, layers: list[torch.Tensor], num_blocks: int, *, inline: bool = False) -> None:
        want = "cpu" if inline else "cuda"
        if not layers or any(t.device.type != want for t in layers):
            raise ValueError(f"CudaBlockCopier copies {want.upper()} KV tensors only")
        self.views = [block_first(t, num_blocks) for t in layers]
        self.block_shape = tuple(self.views[0].shape[1:])
        self.block_elems = self.views[0][0].numel()
        self.num_blocks = num_blocks
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        self.streams: CudaStreams | InlineStreams = (InlineStreams if inline else CudaStreams)(self.device)
        self.layer_events: list[object] = [None] * len(layers)
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
        rc = self.streams.register(pages.data_ptr(), nbytes)
        if rc != 0:
            self.l2.detach()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of L2 failed with CUDA error {rc}")
        self._pinned_ptr = pages.data_ptr()

    def detach(self) -> None:
        if self._pinned_ptr is not None:
            self.streams.unregister(self._pinned_ptr)
            self._pinned_ptr = None
        self.l2.detach()

    def _check(self, blocks: list[int], pages: list[int]) -> torch.Tensor:
        return self.l2.check(blocks, pages, self.num_blocks)

    # ------------------------------------------------------------------ copies
    def start_load(self, pages: list[int], blocks: list[int]) -> int:
        """Enqueue L2 ``pages[i]`` -> block ``blocks[i]`` for every layer; returns bytes."""
        l2 = self._check(blocks, pages)
        runs = page_runs(pages, blocks)
        with self.streams.on_side():
            for i, view in enumerate(self.views):
                for p, b, n in runs:
                    view[b : b + n].copy_(l2[p : p + n, i].view(n, *self.block_shape), non_blocking=True)
                self.layer_events[i] = self.streams.record_side()
        return len(pages) * l2[0].numel() * l2.element_size()

    def wait_layer(self, i: int) -> None:
        event = self.layer_events[i]
        if event is not None:
            self.streams.current_waits(event)

    def finish_loads(self) -> None:
        self.streams.sync_side()
        self.layer_events = [None] * len(self.views)

    def load(self, pages: list[int], blocks: list[int]) -> int:
        """``start_load`` and wait for it (``BlockCopier``'s synchronous contract)."""
        n = self.start_load(pages, blocks)
        self.finish_loads()
        return n

    def mark_written(self) -> object:
        """The point on the caller's current stream after which the blocks written so far
        may be saved (pass it to ``save`` from another thread)."""
        return self.streams.record_current()

    def save(self, blocks: list[int], pages: list[int], after: object = None) -> int:
        """Block ``blocks[i]`` of every layer -> L2 ``pages[i]``, after ``after``
        (``mark_written``; default: the calling thread's current stream now); returns once
        the bytes are in L2."""
        l2 = self._check(blocks, pages)
        runs = page_runs(blocks, pages)
        self.streams.side_waits(after if after is not None else self.streams.record_current())
        with self.streams.on_side():
            for i, view in enumerate(self.views):
                for b, p, n in runs:
                    l2[p : p + n, i].view(n, *self.block_shape).copy_(view[b : b + n], non_blocking=True)
        self.streams.sync_side()
        return len(pages) * l2[0].numel() * l2.element_size()
