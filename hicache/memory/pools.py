"""The L1 and L2 pools of every cache component, in shared memory, and page copies between them.

Layout (the contract with the model runner, ``hicache.model.geometry``; ``ps`` = page size):

=========  ==========================================  ===========================================
component  L1 (what the model reads and writes)        L2 (page-contiguous host copy)
=========  ==========================================  ===========================================
full, swa  ``kv [layers, 2, l1_pages*ps, heads, dim]``  ``kv [l2_pages, layers, 2, ps, heads, dim]``
mamba      ``conv [layers, l1_slots, *conv_shape]``     ``conv [l2_slots, layers, *conv_shape]``
           ``ssm  [layers, l1_slots, *ssm_shape]``      ``ssm  [l2_slots, layers, *ssm_shape]``
=========  ==========================================  ===========================================

For an attention component one L2 page is one contiguous byte range, so an L3 object is
written from and read into L2 without an extra copy (``host_page_view``). A Mamba "page" is
one state slot. Each tensor lives in its own segment named ``{instance}-{component}-{tier}-{i}``.

A tensor of zero bytes (the index-only Full component of a model without full-attention
layers: ``[0, 2, ...]``, see ``hicache.model.geometry``) has no segment: each process makes
its own empty tensor, the copy plans of such a component are empty and its L2 page views
are empty (``MappedComponent.holds_bytes``).

Who does what: the process that owns the daemon creates the segments (``create_pools``) and
unlinks them at shutdown (``SharedPools.unlink``); the scheduler and the cache controller
attach (``attach_pools``). Page *indices* are allocated and freed by the scheduler alone
(``hicache.memory.allocator``); this module only moves bytes between indices it is given,
after checking they are in range.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch

from hicache.memory.shm import TORCH_DTYPES, SharedSegment, TensorSpec, shm_dir

Tier = Literal["l1", "l2"]

CopyPair = tuple[torch.Tensor, torch.Tensor]
"""``(dst, src)``: two views of equal shape; ``dst.copy_(src)`` moves the bytes."""


@dataclass(frozen=True)
class ComponentLayout:
    """Shapes of one component's pools. ``kind`` is ``paged`` (attention KV) or ``state`` (Mamba)."""

    name: str
    kind: Literal["paged", "state"]
    page_size: int
    l1_pages: int
    l2_pages: int
    l1: tuple[TensorSpec, ...]
    l2: tuple[TensorSpec, ...]

    @cached_property
    def l2_page_bytes(self) -> int:
        """Bytes of one page (or state slot) over all of the component's tensors, in either tier.

        Computed once per layout object (the copy path asks for it on every op)."""
        if self.l1_pages:
            return sum(spec.nbytes for spec in self.l1) // self.l1_pages
        return sum(spec.nbytes for spec in self.l2) // self.l2_pages

    @property
    def l2_page_shape(self) -> tuple[int, ...]:
        """Shape of one L2 page (paged components: ``[layers, 2, ps, heads, dim]``)."""
        if not self.l1:
            return self.l2[0].shape[1:]
        layers, two, _slots, heads, dim = self.l1[0].shape
        return (layers, two, self.page_size, heads, dim)

    @property
    def dtype(self) -> str:
        return (self.l1 or self.l2)[0].dtype


@dataclass(frozen=True)
class PoolLayout:
    """Everything a process needs to map the pools; picklable, so it travels as a spawn argument.

    A component with ``l2_pages == 0`` has no L2 tensors (L2 disabled); one with
    ``l1_pages == 0`` has no L1 tensors (engine mode: L1 is the engine's own KV)."""

    instance: str
    directory: str
    components: tuple[ComponentLayout, ...]

    def component(self, name: str) -> ComponentLayout:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no pool for component {name!r} (have: {', '.join(c.name for c in self.components)})")

    @property
    def segments(self) -> list[str]:
        """The shared-memory segments (a zero-byte tensor has none)."""
        return [spec.segment for c in self.components for spec in (*c.l1, *c.l2) if spec.nbytes]


def new_instance_id() -> str:
    """``hicache-{pid}-{random}``: the creating process's pid lets a later start find and remove
    the segments of a daemon that was killed before it could clean up (``remove_stale_segments``)."""
    return f"hicache-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_segments(directory: str | None = None) -> list[str]:
    """Unlink the segments of daemons whose creating process no longer exists."""
    d = directory or shm_dir()
    removed = []
    for entry in os.listdir(d):
        parts = entry.split("-")
        if len(parts) < 3 or parts[0] != "hicache" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # its creator is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        try:
            os.unlink(os.path.join(d, entry))
            removed.append(entry)
        except FileNotFoundError:
            pass
    return removed


def paged_layout(instance: str, name: str, page_size: int, l1_pages: int, l2_pages: int,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> ComponentLayout:
    l1 = TensorSpec(f"{instance}-{name}-l1-0", (num_layers, 2, l1_pages * page_size, num_kv_heads, head_dim), dtype)
    l2 = TensorSpec(f"{instance}-{name}-l2-0", (l2_pages, num_layers, 2, page_size, num_kv_heads, head_dim), dtype)
    return ComponentLayout(name, "paged", page_size, l1_pages, l2_pages, (l1,) if l1_pages else (),
                           (l2,) if l2_pages else ())


def state_layout(instance: str, name: str, l1_slots: int, l2_slots: int, num_layers: int,
                 shapes: tuple[tuple[int, ...], ...], dtype: str) -> ComponentLayout:
    l1 = tuple(TensorSpec(f"{instance}-{name}-l1-{i}", (num_layers, l1_slots, *s), dtype) for i, s in enumerate(shapes))
    l2 = tuple(TensorSpec(f"{instance}-{name}-l2-{i}", (l2_slots, num_layers, *s), dtype)
               for i, s in enumerate(shapes)) if l2_slots else ()
    return ComponentLayout(name, "state", 1, l1_slots, l2_slots, l1, l2)


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
            return by_name[spec.segment].tensor(spec)

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
        for name in self.layout.segments:
            SharedSegment(name, 0, None, self.layout.directory, owner=True).unlink()


def create_pools(layout: PoolLayout) -> SharedPools:
    """Create every segment (zero-filled) and map it. On failure, removes what it created."""
    made: list[SharedSegment] = []
    try:
        for c in layout.components:
            for spec in (*c.l1, *c.l2):
                if not spec.nbytes:
                    continue  # zero bytes: no segment (module doc)
                made.append(SharedSegment.create(spec.segment, spec.nbytes, layout.directory))
        return SharedPools(layout, made)
    except BaseException:
        for seg in made:
            seg.unlink()
            seg.close()
        raise


def attach_pools(layout: PoolLayout) -> SharedPools:
    """Map the segments another process created; raises FileNotFoundError naming a missing one."""
    return SharedPools(layout, [SharedSegment.attach(name, layout.directory) for name in layout.segments])


def default_directory() -> str:
    return shm_dir()
