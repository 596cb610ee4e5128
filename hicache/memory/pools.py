"""The daemon's pools mapped as torch tensors, and page copies between L1 and L2.

The layout (shapes, segment names, who creates and removes the segments) is
``hicache.memory.layout``; this module maps the segments of a layout in a process that copies
(the scheduler, the cache controller, a test harness) and plans the copies.

A tensor of zero bytes (the index-only Full component of a model without full-attention
layers: ``[0, 2, ...]``, see ``hicache.model.geometry``) has no segment: each process makes
its own empty tensor, the copy plans of such a component are empty and its L2 page views
are empty (``MappedComponent.holds_bytes``).

Page *indices* are allocated and freed by the scheduler alone (``hicache.memory.allocator``);
this module only moves bytes between indices it is given, after checking they are in range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from hicache.memory.layout import ComponentLayout, PoolLayout, Tier, create_segments, unlink_segments
from hicache.memory.shm import SharedSegment, TensorSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
}
"""The torch dtype of each dtype name a ``TensorSpec`` may carry (``hicache.memory.shm.DTYPE_BYTES``)."""


def segment_tensor(segment: SharedSegment, spec: TensorSpec) -> torch.Tensor:
    """A tensor of ``spec``'s shape and dtype viewing the start of ``segment`` (no copy); drop
    it before ``segment.close()``."""
    if spec.nbytes > segment.size:
        raise ValueError(f"segment {segment.name} has {segment.size} bytes; {spec} needs {spec.nbytes}")
    flat = torch.frombuffer(segment.buffer, dtype=torch.uint8, count=spec.nbytes)
    return flat.view(TORCH_DTYPES[spec.dtype]).view(spec.shape)

CopyPair = tuple[torch.Tensor, torch.Tensor]
"""``(dst, src)``: two views of equal shape; ``dst.copy_(src)`` moves the bytes."""


@dataclass
class MappedComponent:
    """One component's tensors, mapped in this process, with page-indexable views.

    ``l1_paged[i]`` is L1 tensor ``i`` viewed with the page index on axis ``l1_axis``
    (``[layers, 2, pages, ps, heads, dim]`` for paged, the tensor itself for state);
    ``l1_page_major[i]`` is the same view with the page axis moved to the front, the
    order L2 tensors have (page index on axis 0).
    """

    layout: ComponentLayout
    l1: list[torch.Tensor]
    l2: list[torch.Tensor]
    l2_segments: list[SharedSegment]
    l1_paged: list[torch.Tensor] = field(init=False)
    l1_axis: int = field(init=False)
    l1_page_major: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        if self.layout.kind == "paged":
            ps = self.layout.page_size
            self.l1_paged = [t.view(t.shape[0], 2, self.layout.l1_pages, ps, *t.shape[3:]) for t in self.l1]
            self.l1_axis = 2
        else:
            self.l1_paged = list(self.l1)
            self.l1_axis = 1
        self.l1_page_major = [t.movedim(self.l1_axis, 0) for t in self.l1_paged]

    @cached_property
    def holds_bytes(self) -> bool:
        """False for a component whose pages are zero bytes (index-only Full): nothing to copy."""
        return any(t.numel() for t in (*self.l1, *self.l2))

    def pages_problem(self, tier: Tier, pages: list[int]) -> str | None:
        """None if every index is a valid page of ``tier``, else the reason."""
        limit = self.layout.l1_pages if tier == "l1" else self.layout.l2_pages
        if pages and (min(pages) < 0 or max(pages) >= limit):
            bad = next(p for p in pages if not 0 <= p < limit)
            return f"{self.layout.name} {tier} page {bad} is out of range [0, {limit})"
        return None

    def plan_l1_to_l2(self, l1_pages: list[int], l2_pages: list[int]) -> list[CopyPair]:
        """The ``(dst, src)`` view pairs whose ``dst.copy_(src)`` sets L2[l2_pages[i]] = L1[l1_pages[i]].

        One pair per run of consecutive pages (``page_runs``) and tensor, both views with the
        page index on axis 0 and the same shape. Makes views only (one slice per side, of
        views made once in ``__post_init__``): no bytes move and no index is checked here.
        Empty for a component of zero-byte pages (``holds_bytes``).
        """
        if not self.holds_bytes:
            return []
        return [(dst[dst_start : dst_start + n], src[src_start : src_start + n])
                for (src_start, dst_start, n) in page_runs(l1_pages, l2_pages)
                for src, dst in zip(self.l1_page_major, self.l2, strict=True)]

    def plan_l2_to_l1(self, l2_pages: list[int], l1_pages: list[int]) -> list[CopyPair]:
        """The pairs that set L1[l1_pages[i]] = L2[l2_pages[i]]; see ``plan_l1_to_l2``."""
        if not self.holds_bytes:
            return []
        return [(dst[dst_start : dst_start + n], src[src_start : src_start + n])
                for (src_start, dst_start, n) in page_runs(l2_pages, l1_pages)
                for src, dst in zip(self.l2, self.l1_page_major, strict=True)]

    def host_page_view(self, page: int) -> memoryview:
        """The bytes of L2 page ``page`` (paged components), viewed in place: writable, no copy."""
        if self.layout.kind != "paged":
            raise ValueError(f"{self.layout.name} pages are not single byte ranges")
        size = self.layout.l2_page_bytes
        if size == 0:  # zero-byte pages (index-only Full): no segment to view
            return memoryview(bytearray())
        return memoryview(self.l2_segments[0].buffer)[page * size : (page + 1) * size]


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Split a page mapping into runs (src_start, dst_start, n) where both sides are consecutive.

    Copying a run is one strided tensor copy with no temporary; allocators hand out runs of
    consecutive pages, so real batches need few of them.
    """
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    if len(src) == 1:
        return [(src[0], dst[0], 1)]
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(src)
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i))
        i = j
    return runs


class SharedPools:
    """All components' pools mapped in this process. ``close`` unmaps; the creator also ``unlink``s."""

    def __init__(self, layout: PoolLayout, segments: list[SharedSegment]) -> None:
        self.layout = layout
        self._segments = segments
        by_name = {s.name: s for s in segments}

        def mapped(spec: TensorSpec) -> torch.Tensor:
            if not spec.nbytes:  # no segment: an empty tensor of the right shape, local to this process
                return torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
            return segment_tensor(by_name[spec.segment], spec)

        self.components: dict[str, MappedComponent] = {}
        for c in layout.components:
            l1 = [mapped(spec) for spec in c.l1]
            l2 = [mapped(spec) for spec in c.l2]
            self.components[c.name] = MappedComponent(c, l1, l2, [by_name[spec.segment] for spec in c.l2
                                                                  if spec.nbytes])

    def __getitem__(self, name: str) -> MappedComponent:
        try:
            return self.components[name]
        except KeyError:
            raise KeyError(f"no pool for component {name!r}") from None

    def close(self) -> None:
        """Drop the tensors and unmap (tensors handed out earlier must be dropped first)."""
        self.components.clear()
        for seg in self._segments:
            try:
                seg.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the process
        self._segments = []

    def unlink(self) -> None:
        """Remove the segments' names (the creator, at shutdown)."""
        unlink_segments(self.layout)


def create_pools(layout: PoolLayout) -> SharedPools:
    """Create every segment (zero-filled) and map it (``hicache.memory.layout.create_segments``)."""
    return SharedPools(layout, create_segments(layout))


def attach_pools(layout: PoolLayout) -> SharedPools:
    """Map the segments another process created; raises FileNotFoundError naming a missing one."""
    return SharedPools(layout, [SharedSegment.attach(name, layout.directory) for name in layout.segments])

