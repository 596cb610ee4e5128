"""The copies one step does, as the scheduler side plans them and the worker side runs them.

The scheduler side builds a ``HiCacheConnectorMetadata`` per step (vLLM ships it to every
rank); each worker answers with a ``HiCacheWorkerMeta``. A plan holds one lease, and exactly
one message ends it:

===============  ===========================  ==========================================
plan             lease                        ended by (each rank, with its rank)
===============  ===========================  ==========================================
``LoadPlan``     a lookup's: pages locked     ``Release`` after the copy, failed or not
``SavePlan``     a reservation's pages        ``Commit`` (ok, or not ok: nothing inserted)
===============  ===========================  ==========================================

A page is one block of every layer, each from its layer's KV cache group's block table:
``blocks[g][i]`` is group ``g``'s block of page ``i`` (``NO_BLOCK`` where the group holds
none: before a sliding window, and every page of a state group, whose blocks move only as a
``StateCopy``). With window layers the daemon keeps a page in two parts, the full part
(``pages``) and the window part (``window_pages``): a lookup answers the window parts of
its hit's last window, a save writes them only from the first page whose window blocks the
request still holds in this step (``SaveRange.window_from``). With several KV cache groups a
hit loads asynchronously (vLLM cannot map a failed block back to its request): a failed
load fails its request (``failed_recving``), which vLLM recomputes whole. A GDN's state
group keeps a state at some block ends (vLLM's ``align`` mode): a save copies the
block-aligned states vLLM offers in the step (``boundary_state_offloads``) that the daemon
reserves a slot for; a hit ends after a page whose state the daemon keeps, and its load
copies that state into the state group's block of the hit's last page. Every plan names the
daemon run it was made under: a worker refuses a plan of another run than the step's
registration, whose page numbers would index a new daemon's pool. docs/architecture.md §13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

import protos
from hicache.connectors.kv_copy import NO_BLOCK, NO_PAGE, PoolRef
from hicache.connectors.vllm.layout import VllmKVLayout

VLLM_NULL_BLOCK = 0
"""The block id vLLM's hybrid allocator puts where a sliding-window group holds no block
(before the window); never a real block of any group."""


@dataclass
class StateCopy:
    """State slot ``slot`` and, per KV cache group ``g``, block ``blocks[g]`` (``NO_BLOCK`` for
    a group without state layers): the state of every state layer at one block end."""

    slot: int
    blocks: list[int]


@dataclass
class BlockCopyPlan:
    """L2 ``pages[i]`` and vLLM block ``blocks[g][i]`` of each KV cache group ``g``, copied
    under ``lease`` (of ``session`` in daemon run ``run``) for request ``rid``."""

    rid: str
    session: int
    run: int
    lease: int
    pages: list[int]
    blocks: list[list[int]]
    window_pages: list[int] = field(default_factory=list)
    """With window layers: the window part of ``pages[i]`` (``NO_PAGE``: none), else empty.
    A save's ``pages[i]`` may be ``NO_PAGE`` too: a page whose window part alone is saved."""
    states: list[StateCopy] = field(default_factory=list)
    """With state layers: the states copied with the pages (a load's: the one after its last page)."""


@dataclass
class LoadPlan(BlockCopyPlan):
    """Copy L2 ``pages[i]`` into vLLM block ``blocks[g][i]`` (``NO_BLOCK``: the group holds
    none there, outside its window), then release the lease. ``unloadable``: why the load
    must fail instead (vLLM recomputes), "" when it need not."""

    unloadable: str = ""


@dataclass
class SavePlan(BlockCopyPlan):
    """Copy vLLM block ``blocks[g][i]`` into L2 ``pages[i]``, then commit the lease."""


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    """What the worker side does in one step (built by the scheduler side). ``run`` and
    ``pool``: the registration the step's pages belong to (0 and None: none); a plan of
    another run is refused by the worker. ``step``: the scheduler side's number of the step;
    ``failures_known``: the steps whose synchronous load failed (``HiCacheWorkerMeta``) that
    the scheduler side learned of since the last step's metadata, so that the saves planned
    here already avoid the blocks those failures left stale. ``fresh_blocks`` (copy mode
    ``async`` only): every block vLLM gave a request in this step, of every group; the worker
    lets no forward pass write them while a save of the copy thread still reads them."""

    step: int = 0
    failures_known: frozenset[int] = frozenset()
    fresh_blocks: frozenset[int] = frozenset()
    run: int = 0
    pool: PoolRef | None = None
    window_pool: PoolRef | None = None
    state_pool: PoolRef | None = None
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class HiCacheWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler side after a step: the steps (``HiCacheConnectorMetadata.step``)
    in which a synchronous load of its failed. vLLM joins every rank's."""

    failed_steps: frozenset[int] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        theirs = other.failed_steps if isinstance(other, HiCacheWorkerMeta) else frozenset()
        return HiCacheWorkerMeta(self.failed_steps | theirs)


@dataclass
class Hit:
    """A lookup answer, held (its lease locking ``pages``) for one request until vLLM
    allocates its blocks; then ``load_plan`` turns it into a ``LoadPlan``."""

    session: int
    run: int
    lease: int
    pages: list[int]
    storage_pages: int  # the last ``storage_pages`` of ``pages`` came from L3 for this lookup
    first_page: int  # vLLM's own hit, in pages: the load starts there
    window_pages: list[int] = field(default_factory=list)  # the window parts of the last pages
    state_slot: int = NO_PAGE  # with state layers: the state after the last page
    answered_at: float = 0.0  # when the daemon answered it (monotonic)


def load_plan(layout: VllmKVLayout, rid: str, hit: Hit, block_ids: list[list[int]], n: int) -> LoadPlan:
    """The load of ``n`` pages of ``hit`` from its ``first_page`` into the request's blocks."""
    first = hit.first_page
    pages = hit.pages[first : first + n]
    # a sliding-window group holds blocks of the window only: its layers of the pages before it stay unloaded
    blocks = page_blocks(layout, block_ids, first, first + len(pages))
    # the window parts are the hit's last ones: page j has window_pages[j - (len(hit.pages) - len(window_pages))]
    window: list[int] = []
    if layout.windowed:
        lead = len(hit.pages) - len(hit.window_pages)
        window = [hit.window_pages[j - lead] if j >= lead else NO_PAGE for j in range(first, first + len(pages))]
    states: list[StateCopy] = []
    unloadable = ""
    if layout.state_layer_names:  # the state after the last loaded page, into that page's state blocks
        last = first + len(pages) - 1
        blocks_at = [ids[last] if g in layout.state_groups and last < len(ids) else NO_BLOCK
                     for g, ids in enumerate(block_ids)]
        if first + len(pages) != len(hit.pages) or hit.state_slot == NO_PAGE:
            unloadable = "the load does not end where the daemon kept the state"
        elif any(blocks_at[g] in (NO_BLOCK, VLLM_NULL_BLOCK) for g in layout.state_groups):
            unloadable = "vLLM gave no state block at the hit's end"
        else:
            states = [StateCopy(hit.state_slot, blocks_at)]
    return LoadPlan(rid, hit.session, hit.run, hit.lease, pages, blocks, window, states, unloadable)


def page_blocks(layout: VllmKVLayout, block_ids: list[list[int]], lo: int, hi: int) -> list[list[int]]:
    """Per KV cache group, its blocks of pages ``[lo, hi)`` (``NO_BLOCK`` where it holds
    none: before a window; every page of a state group, whose blocks hold states, copied
    by ``StateCopy`` only)."""
    return [[NO_BLOCK] * (hi - lo) if g in layout.state_groups
            else [NO_BLOCK if b == VLLM_NULL_BLOCK else b for b in ids[lo:hi]]
            for g, ids in enumerate(block_ids)]


def save_plan(layout: VllmKVLayout, rid: str, reg: protos.EngineRegistered, got: protos.Reservation,
              block_ids: list[list[int]], state_blocks: dict[int, list[int]]) -> SavePlan | None:
    """The copies of a reservation: full parts of pages ``start_page ..`` and window
    parts of pages ``window_at`` (which may lie before them), over the one page span
    that covers both, and the states after pages ``state_at`` (from the blocks vLLM
    offered, ``state_blocks``); None when a window block it names is not held (vLLM's
    null block), a state it names was not offered, or the reservation does not fit the
    request's blocks."""
    if len(got.state_at) != len(got.state_slots) or any(j not in state_blocks for j in got.state_at):
        return None
    states = [StateCopy(slot, state_blocks[j]) for j, slot in zip(got.state_at, got.state_slots, strict=True)]
    first, n = got.start_page, len(got.host_pages)
    lo = min([first] + list(got.window_at)) if got.window_at else first
    hi = max([first + n] + [j + 1 for j in got.window_at])
    if lo < 0 or len(got.window_at) != len(got.window_pages) or any(len(block_ids[g]) < hi
                                                                     for g in layout.kv_groups):
        return None
    pages = [NO_PAGE] * (first - lo) + list(got.host_pages) + [NO_PAGE] * (hi - first - n)
    blocks = page_blocks(layout, block_ids, lo, hi)
    window: list[int] = []
    if layout.windowed:
        window = [NO_PAGE] * (hi - lo)
        for j, w in zip(got.window_at, got.window_pages, strict=True):
            window[j - lo] = w
        if any(ids[j - lo] == NO_BLOCK for ids, g in zip(blocks, layout.group_window, strict=True) if g
               for j in got.window_at):
            return None
    elif got.window_at:
        return None
    return SavePlan(rid, reg.session, reg.run, got.lease, pages, blocks, window, states)
