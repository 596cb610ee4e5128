"""Where the daemon's pools live and how big they are: the layout every process agrees on,
and the creation and removal of its shared-memory segments. No torch here: the launcher
creates the segments from a layout without importing it (``hicache.memory.pools`` maps them
as tensors in the processes that copy).

Layout (the contract with the model runner, ``hicache.model.geometry``; ``ps`` = page size):

=========  ==========================================  ===========================================
component  L1 (what the model reads and writes)        L2 (page-contiguous host copy)
=========  ==========================================  ===========================================
full, swa  ``kv [layers, 2, l1_pages*ps, heads, dim]``  ``kv [l2_pages, layers, 2, ps, heads, dim]``
mamba      ``conv [layers, l1_slots, *conv_shape]``     ``conv [l2_slots, layers, *conv_shape]``
           ``ssm  [layers, l1_slots, *ssm_shape]``      ``ssm  [l2_slots, layers, *ssm_shape]``
=========  ==========================================  ===========================================

For an attention component one L2 page is one contiguous byte range, so an L3 object is
written from and read into L2 without an extra copy. A Mamba "page" is one state slot. Each
tensor lives in its own segment named ``{instance}-{component}-{tier}-{i}``; a tensor of zero
bytes (the index-only Full component of a model without full-attention layers) has none.

Who does what: the process that owns the daemon creates the segments (``create_segments``,
the launcher or a test harness) and removes them at shutdown (``unlink_segments``); every
other process attaches (``hicache.memory.pools.attach_pools``).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from hicache.memory.shm import SharedSegment, TensorSpec, shm_dir

Tier = Literal["l1", "l2"]

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


def default_directory() -> str:
    return shm_dir()


def create_segments(layout: PoolLayout) -> list[SharedSegment]:
    """Create every segment of ``layout`` (zero-filled) and map it. On failure, removes what
    it created and raises. The caller closes the segments and, at shutdown, ``unlink_segments``."""
    made: list[SharedSegment] = []
    try:
        for c in layout.components:
            for spec in (*c.l1, *c.l2):
                if not spec.nbytes:
                    continue  # zero bytes: no segment (module doc)
                made.append(SharedSegment.create(spec.segment, spec.nbytes, layout.directory))
        return made
    except BaseException:
        for seg in made:
            seg.unlink()
            seg.close()
        raise


def unlink_segments(layout: PoolLayout) -> None:
    """Remove the names of ``layout``'s segments (creator only); mappings stay valid until closed."""
    for name in layout.segments:
        SharedSegment(name, 0, None, layout.directory, owner=True).unlink()
