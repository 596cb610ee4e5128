"""Copies between an engine's KV blocks and hicache's L2 pages, in the engine's process.

The engine's KV is one tensor per attention layer, ``[num_blocks, *block]`` with the block
index first (vLLM's CPU layout ``LBHNC``: a block is ``[num_kv_heads, block_size,
2 * head_dim]``), each block contiguous. An L2 page holds one block of every layer, layer
after layer: viewed here as ``[l2_pages, num_layers, block_elems]`` over the shared-memory
segment the daemon named at registration. Copies go run by run (consecutive blocks to
consecutive pages in one strided copy per layer; ``hicache.memory.pools.page_runs``).

With tensor parallelism, each rank's tensors hold its own ``num_kv_heads / ranks`` heads:
a rank's block of a layer is the contiguous slice ``[rank, rank + 1)`` of the page's block
of that layer (heads first), so every rank copies its slice and a page has the one layout
at any rank count.

With several KV cache groups (vLLM's hybrid allocator: full and sliding-window attention
layers in groups of their own), each layer belongs to one group and a page's block of that
layer is the group's block: a copy names one block list per group.

With window layers (``window`` flags), a page is kept in two parts, each a pool of its own
(docs/architecture.md §13): the *full part* (the other layers, in model order) in the L2
pool, and the *window part* (the window layers, in model order) in the window pool, only for
the pages of a window before a hit's end. A copy then names, per page, its window part or
``NO_PAGE``. A sliding-window group holds no block before its window (``NO_BLOCK``): a load
leaves those layers of the page unloaded, which the engine never reads; every block the
group does hold in a load must have its window part (else the load fails: vLLM recomputes),
and a save copies the window layers of the pages with a window part only.

A model with state layers (a GDN's ``linear_attention``: Qwen3-Next) keeps, besides pages,
the recurrent state after some pages (``StateCopier``): one state is every state layer's
bytes of one block of its KV cache group, layer after layer (each layer's tensors one after
another), in a pool of state slots of its own.

Only CPU KV tensors are copied. A CUDA KV cache needs pinned L2 and a side stream with
events (``hicache.connectors.kv_copy_cuda``, the same contract for one KV cache group); that path has not run on a GPU
yet, so it is refused with that reason (``kv_problem``, and the connector at start) rather
than enabled untested; ``python -m hicache.connectors.gpu_check`` is its check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache.memory.pools import TORCH_DTYPES, page_runs, segment_tensor
from hicache.memory.shm import SharedSegment, TensorSpec

CUDA_REFUSAL = ("a CUDA KV cache is not supported yet: its copy path (hicache.connectors.kv_copy_cuda: pinned "
                "L2, a side stream with events) has not run on a GPU (python -m hicache.connectors.gpu_check "
                "verifies it there); run vLLM on the CPU, or without hicache")


NO_BLOCK = -1
"""In a group's block list of a load: the group holds no block for that page."""

NO_PAGE = -1
"""In a copy's window parts: that page has none."""


@dataclass(frozen=True)
class PoolRef:
    """Where the L2 pool of one daemon run lives (from ``EngineRegistered``)."""

    instance: str
    segment: str
    directory: str
    pages: int
    page_bytes: int


def kv_problem(layers: list[torch.Tensor], num_blocks: int, layer_block_bytes: int, dtype: torch.dtype) -> str | None:
    """None if these per-layer KV tensors can be copied block by block, else why not."""
    if not layers:
        return "the engine registered no KV tensors"
    for i, t in enumerate(layers):
        if t.device.type != "cpu":
            return CUDA_REFUSAL if t.device.type == "cuda" else f"KV tensors on {t.device} are not supported"
        if t.dtype != dtype:
            return f"layer {i}: KV dtype {t.dtype}, the engine's spec says {dtype}"
        if t.dim() < 2 or t.shape[0] != num_blocks:
            return (f"layer {i}: KV shape {tuple(t.shape)} does not have the {num_blocks} blocks on its first axis "
                    "(a layout with the block index first is required)")
        if not t.is_contiguous():
            return f"layer {i}: the KV tensor is not contiguous (strides {t.stride()})"
        if t[0].numel() * t.element_size() != layer_block_bytes:
            return (f"layer {i}: a block holds {t[0].numel() * t.element_size()} bytes, "
                    f"the geometry says {layer_block_bytes}")
    return None


class L2Pages:
    """The L2 pool of one daemon run, mapped in the engine's process as
    ``[pages, num_layers, block_elems]`` of the KV dtype (one page = one block of every
    layer). Shared by the CPU and the CUDA copiers; not thread-safe."""

    def __init__(self, num_layers: int, block_elems: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.block_elems = block_elems
        self.dtype = dtype
        self.pool: PoolRef | None = None
        self.tensor: torch.Tensor | None = None
        self._segment: SharedSegment | None = None

    def attach(self, pool: PoolRef) -> bool:
        """Map ``pool``; False if it is the one mapped already. Raises when the segment is
        gone or its pages are not this engine's."""
        if self.pool == pool:
            return False
        per_page = self.num_layers * self.block_elems * torch.empty((), dtype=self.dtype).element_size()
        if pool.page_bytes != per_page:
            raise ValueError(f"the daemon's L2 pages hold {pool.page_bytes} bytes, this engine's {per_page}")
        if not per_page:  # pages of no layer (every layer has the window): no segment to map
            self.detach()
            self.tensor, self.pool = torch.empty((pool.pages, 0, self.block_elems), dtype=self.dtype), pool
            return True
        seg = SharedSegment.attach(pool.segment, pool.directory)
        if seg.size < pool.pages * pool.page_bytes:
            seg.close()
            raise ValueError(f"segment {pool.segment} holds {seg.size} bytes, {pool.pages} pages need more")
        dtype_name = next(k for k, v in TORCH_DTYPES.items() if v == self.dtype)
        pages = segment_tensor(seg, TensorSpec(pool.segment, (pool.pages, self.num_layers, self.block_elems), dtype_name))
        self.detach()
        self._segment, self.tensor, self.pool = seg, pages, pool
        return True

    def detach(self) -> None:
        self.tensor = None
        if self._segment is not None:
            try:
                self._segment.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        self._segment, self.pool = None, None

    def check(self, blocks: list[int], pages: list[int], num_blocks: int) -> torch.Tensor:
        """The mapped pages, after checking both index lists; raises on a bad one."""
        if self.tensor is None:
            raise RuntimeError("no L2 pool is mapped")
        if len(blocks) != len(pages):
            raise ValueError(f"{len(blocks)} blocks but {len(pages)} pages")
        if blocks and (min(blocks) < 0 or max(blocks) >= num_blocks):
            raise ValueError(f"block index out of range [0, {num_blocks})")
        if pages and (min(pages) < 0 or max(pages) >= self.tensor.shape[0]):
            raise ValueError(f"L2 page index out of range [0, {self.tensor.shape[0]})")
        return self.tensor


class BlockCopier:
    """Block <-> page copies for one engine's KV tensors (``layers``, in model order);
    ``layer_groups[i]``: the KV cache group of layer ``i`` (default: all in group 0);
    ``window[i]``: layer ``i`` has a sliding window, its blocks go to the pages' window parts
    (default: none); ``num_groups``: the KV cache groups a copy names block lists for (at
    least those of the layers; a group of no layer here, a state group, is not copied);
    ``rank`` of ``ranks``: the tensor-parallel shard these tensors hold (a
    page's block of a layer is ``ranks`` of their blocks, rank after rank).

    ``attach`` maps the L2 pools of a daemon run (again when the run changes); ``load`` and
    ``save`` raise on bad indices or an unmapped pool, and the caller turns that into load
    errors (vLLM recomputes) or a failed commit (the reservation is freed).
    """

    def __init__(self, layers: list[torch.Tensor], layer_groups: Sequence[int] | None = None, *,
                 window: Sequence[bool] | None = None, rank: int = 0, ranks: int = 1, num_groups: int = 0) -> None:
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of {ranks} ranks")
        self.layers = [t.view(t.shape[0], -1) for t in layers]
        self.num_blocks = layers[0].shape[0]
        shard = self.layers[0].shape[1]
        self.shard = slice(rank * shard, (rank + 1) * shard)  # this rank's part of a page's layer block
        groups = list(layer_groups) if layer_groups is not None else [0] * len(layers)
        if len(groups) != len(layers) or min(groups) < 0:
            raise ValueError("layer_groups must name a group (>= 0) for every layer")
        flags = list(window) if window is not None else [False] * len(layers)
        if len(flags) != len(layers):
            raise ValueError("window must flag every layer")
        self.windowed = any(flags)
        # a layer's place in its part of a page: full layers and window layers, each in model order
        self.place = [sum(1 for f in flags[:i] if f == flags[i]) for i in range(len(layers))]
        self.parts = (L2Pages(flags.count(False), shard * ranks, layers[0].dtype),
                      L2Pages(flags.count(True), shard * ranks, layers[0].dtype))
        self.l2 = self.parts[0]
        self.group_layers: list[list[int]] = [[] for _ in range(max(max(groups) + 1, num_groups))]
        for i, g in enumerate(groups):
            self.group_layers[g].append(i)
        self.group_window: list[bool] = []
        for g, members in enumerate(self.group_layers):
            kinds = {flags[i] for i in members}
            if len(kinds) > 1:
                raise ValueError(f"KV cache group {g} mixes window and full layers")
            self.group_window.append(kinds == {True})
        self.block_bytes = self.layers[0].shape[1] * self.layers[0].element_size()

    @property
    def pool(self) -> PoolRef | None:
        return self.l2.pool

    def maps(self, pool: PoolRef, window: PoolRef | None = None) -> bool:
        """Whether these pools are the ones mapped (``attach`` would change nothing)."""
        return self.l2.pool == pool and (not self.windowed or self.parts[1].pool == window)

    def attach(self, pool: PoolRef, window: PoolRef | None = None) -> None:
        """Map the L2 pool of full parts and, with window layers, ``window``'s pool of window parts."""
        if self.windowed and window is None:
            raise RuntimeError("this model has window layers, the daemon named no window pool")
        self.l2.attach(pool)
        if self.windowed and window is not None:
            self.parts[1].attach(window)

    def detach(self) -> None:
        for part in self.parts:
            part.detach()

    def _pairs(self, pages: list[int], blocks: Sequence[Sequence[int]], window_pages: Sequence[int] | None, *,
               load: bool) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """Per group, the mapped part it copies with and the (pages of that part, blocks),
        after checking every index list; raises on a bad one."""
        if len(blocks) != len(self.group_layers):
            raise ValueError(f"{len(blocks)} block lists for {len(self.group_layers)} KV cache groups")
        parts = list(window_pages) if window_pages is not None else [NO_PAGE] * len(pages)
        if len(parts) != len(pages):
            raise ValueError(f"{len(parts)} window parts for {len(pages)} pages")
        out: list[tuple[torch.Tensor, list[int], list[int]]] = []
        for ids, in_window, members in zip(blocks, self.group_window, self.group_layers, strict=True):
            if len(ids) != len(pages):
                raise ValueError(f"{len(ids)} blocks but {len(pages)} pages")
            if not members:  # a group of no layer copied here (a state group)
                out.append((self.l2.check([], [], self.num_blocks), [], []))
                continue
            if in_window:
                if load and any(b != NO_BLOCK and w == NO_PAGE for b, w in zip(ids, parts, strict=True)):
                    raise ValueError("a window block to load has no window part (the daemon kept none for it)")
                kept = [(w, b) for w, b in zip(parts, ids, strict=True) if w != NO_PAGE and b != NO_BLOCK]
                if not load and len(kept) != sum(1 for w in parts if w != NO_PAGE):
                    raise ValueError("a window part to save has no block of its window group")
                part = self.parts[1]
            else:
                kept = [(p, b) for p, b in zip(pages, ids, strict=True) if (not load or b != NO_BLOCK) and p != NO_PAGE]
                part = self.l2
            group_pages, group_blocks = [p for p, _ in kept], [b for _, b in kept]
            out.append((part.check(group_blocks, group_pages, self.num_blocks), group_pages, group_blocks))
        return out

    def load(self, pages: list[int], blocks: Sequence[Sequence[int]], window_pages: Sequence[int] | None = None
             ) -> int:
        """Copy L2 ``pages[i]`` into block ``blocks[g][i]`` of every layer of group ``g``
        (none where that is ``NO_BLOCK``; a window group's from ``window_pages[i]``);
        returns bytes copied."""
        return sum(copy() for copy in self.layer_loads(pages, blocks, window_pages))

    def layer_loads(self, pages: list[int], blocks: Sequence[Sequence[int]],
                    window_pages: Sequence[int] | None = None) -> list[Callable[[], int]]:
        """``load`` split by layer: one call per layer, in model order, each copying that
        layer's blocks and returning its bytes. The index lists are checked here, once
        (raises on a bad one); a call raises only if the copy itself fails."""
        out: list[Callable[[], int]] = [lambda: 0] * len(self.layers)
        for layers, (l2, group_pages, group_blocks) in zip(self.group_layers,
                                                           self._pairs(pages, blocks, window_pages, load=True),
                                                           strict=True):
            runs = page_runs(group_pages, group_blocks)
            for i in layers:
                out[i] = functools.partial(self._load_layer, i, l2, runs, len(group_pages))
        return out

    def _load_layer(self, i: int, l2: torch.Tensor, runs: list[tuple[int, int, int]], pages: int) -> int:
        layer, place = self.layers[i], self.place[i]
        for p, b, n in runs:
            layer[b : b + n].copy_(l2[p : p + n, place, self.shard])
        return pages * self.block_bytes

    def save(self, blocks: Sequence[Sequence[int]], pages: list[int], window_pages: Sequence[int] | None = None
             ) -> int:
        """Copy block ``blocks[g][i]`` of every layer of group ``g`` into L2 ``pages[i]``
        (none where that is ``NO_PAGE``; a window group's into ``window_pages[i]``, only
        where there is one; every copied block must be held); returns bytes copied."""
        copied = 0
        for layers, (l2, group_pages, group_blocks) in zip(self.group_layers,
                                                           self._pairs(pages, blocks, window_pages, load=False),
                                                           strict=True):
            for b, p, n in page_runs(group_blocks, group_pages):
                for i in layers:
                    l2[p : p + n, self.place[i], self.shard].copy_(self.layers[i][b : b + n])
            copied += len(group_pages) * len(layers) * self.block_bytes
        return copied


def state_problem(layers: list[list[torch.Tensor]], num_blocks: int, state_bytes: int) -> str | None:
    """None if these state layers (each a list of tensors with the block index first) can be
    copied block by block as ``state_bytes`` bytes per layer, else why not."""
    for i, tensors in enumerate(layers):
        total = 0
        for t in tensors:
            if t.device.type != "cpu":
                return CUDA_REFUSAL if t.device.type == "cuda" else f"state tensors on {t.device} are not supported"
            if t.dim() < 2 or t.shape[0] != num_blocks:
                return f"state layer {i}: shape {tuple(t.shape)} does not have the {num_blocks} blocks first"
            if not t[0].is_contiguous():
                return f"state layer {i}: a block's state is not contiguous (strides {t.stride()})"
            total += t[0].numel() * t.element_size()
        if total != state_bytes:
            return f"state layer {i}: a block holds {total} bytes of state, the geometry says {state_bytes}"
    return None


class StateCopier:
    """Copies of the recurrent state of one block of every state layer (``layers[i]``: the
    tensors of state layer ``i``, in model order, block index first; ``layer_groups[i]``: its
    KV cache group, an index into the block lists a copy names) to and from the state slots
    of a daemon run's pool, mapped as ``[slots, num_layers, ranks * state_bytes]`` bytes:
    with tensor parallelism each rank's tensors hold its share of every layer's state
    (``state_bytes``), and rank ``rank`` copies it at ``[rank, rank + 1)`` of the layer's
    part of a slot, so a slot holds every rank's share side by side. Not thread-safe; raises
    on a bad index or an unmapped pool."""

    def __init__(self, layers: list[list[torch.Tensor]], layer_groups: Sequence[int], *, rank: int = 0,
                 ranks: int = 1) -> None:
        if len(layers) != len(layer_groups) or not layers:
            raise ValueError("a state copier needs state layers, each with its KV cache group")
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of {ranks} ranks")
        self.layers = [list(tensors) for tensors in layers]
        self.layer_groups = list(layer_groups)
        self.num_blocks = layers[0][0].shape[0]
        self.state_bytes = sum(t[0].numel() * t.element_size() for t in layers[0])
        self.offset = rank * self.state_bytes  # this rank's share within a layer's part of a slot
        self.slots = L2Pages(len(layers), self.state_bytes * ranks, torch.uint8)

    @property
    def pool(self) -> PoolRef | None:
        return self.slots.pool

    def attach(self, pool: PoolRef) -> None:
        self.slots.attach(pool)

    def detach(self) -> None:
        self.slots.detach()

    def _check(self, slot: int, blocks: Sequence[int]) -> torch.Tensor:
        """The mapped slots, after checking ``slot`` and the block of every state layer's group."""
        needed = [blocks[g] if 0 <= g < len(blocks) else NO_BLOCK for g in self.layer_groups]
        return self.slots.check(needed, [slot] * len(needed), self.num_blocks)

    @staticmethod
    def _bytes(t: torch.Tensor, block: int) -> torch.Tensor:
        return t[block].reshape(-1).view(torch.uint8)

    def load(self, slot: int, blocks: Sequence[int]) -> int:
        """Copy state ``slot`` into block ``blocks[g]`` of every state layer of group ``g``;
        returns bytes copied."""
        return self._copy(slot, blocks, load=True)

    def save(self, blocks: Sequence[int], slot: int) -> int:
        """Copy block ``blocks[g]`` of every state layer of group ``g`` into state ``slot``;
        returns bytes copied."""
        return self._copy(slot, blocks, load=False)

    def _copy(self, slot: int, blocks: Sequence[int], *, load: bool) -> int:
        pool = self._check(slot, blocks)
        for i, tensors in enumerate(self.layers):
            b, at = blocks[self.layer_groups[i]], self.offset
            for t in tensors:
                block = self._bytes(t, b)
                part = pool[slot, i, at : at + block.numel()]
                (block if load else part).copy_(part if load else block)
                at += block.numel()
        return len(self.layers) * self.state_bytes
