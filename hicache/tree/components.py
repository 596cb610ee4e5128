"""TreeComponent and the three kinds of cached data (docs/architecture.md §4).

A component is one kind of data a tree node can hold (Full KV, sliding-window KV, Mamba
state, ...). It decides everything about its own data through the hooks below; the tree
(``TreeCore`` and ``UnifiedRadixCache``) calls them and never branches on a component's
kind. The one asymmetry is the seed's: the first component (FULL) is the *primary*, whose
data decides whether a node exists at all (a node lives while it has primary data in L1 or
L2; the other components' data may be absent anywhere: a tombstone).

| hook                     | FULL (primary)          | SWA                                  | MAMBA                        |
|--------------------------|-------------------------|--------------------------------------|------------------------------|
| ``new_validator``        | (the tree walks it)     | the last ``sliding_window`` tokens   | the boundary node has a      |
| (valid boundary)         |                         | before it have SWA data (or the      | state                        |
|                          |                         | whole prefix does)                   |                              |
| ``lock`` / ``unlock``    | node -> root            | up until the window is covered; the  | the node only                |
|                          |                         | boundary node carries a uuid         |                              |
| ``split``                | value sliced, lock_ref, | value sliced, locks copied up,       | state and locks stay on the  |
|                          | host lock copied up     | boundary uuid moves up               | lower (original) node        |
| ``priority`` internal/leaf| 2 / 0                  | 1 / 0                                | 0 / 0                        |
| insert payload           | (the insert's ``value``)| ``PagedInsert``: pages from a start  | a state slot: the state after|
|                          |                         | page, tombstones recovered           | the key's last token         |
| ``copy_on_match``        | -                       | -                                    | a private copy of the state  |
| per-op nodes (``op_span``)| every node of the op   | every node of the op                 | the lowest node only         |
| L2 units                 | one per page            | one per page                         | one per state                |

Paged components (``paged = True``) hold one L1 / L2 index per page of the node's key;
state components hold one index per node. Every hook that changes data goes through the
``TreeCore`` methods (``set_value`` / ``clear_value`` / ``lock`` ...), which keep the
counters and LRU orders in step; an index a hook gives up is appended to ``spare`` (the
caller frees it in one call) or freed by the hook itself where it says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.memory.allocator import PageAllocator
from hicache.tree.node import ComponentData, ComponentType, TreeNode
from hicache.tree.request_state import RequestState

if TYPE_CHECKING:
    from hicache.tree.core import TreeCore

_uuids = itertools.count(1)


class _Released:
    """The type of ``RELEASED``."""

    def __repr__(self) -> str:
        return "RELEASED"


RELEASED: Any = _Released()
"""A lock part already given back (``UnifiedRadixCache.release_part``): the tree never passes
it to an ``unlock`` hook again."""

Validator = Callable[[TreeNode, bool], bool]
"""``step(node, from_host)``: fed a match path root-side first; answers whether the boundary
after ``node`` is valid for the component. ``from_host``: the node's data would come from L2
(a load-back), so its ``host_value`` counts instead of its ``value``."""


@dataclass(frozen=True)
class PagedInsert:
    """A paged component's data for one insert.

    ``pages``: the component's L1 pages of the key's pages from ``start_page`` on (earlier
    ones were released by the request). The pages of the first ``tree_len`` tokens are the
    tree's own (the request's match): neither stored nor freed, whatever they hold. Every
    other page is taken over by the insert: stored, or freed when the tree has it already.
    """

    pages: Sequence[int]
    start_page: int = 0
    tree_len: int = 0


class TreeComponent:
    """Base class: one kind of cached data, with its L1 (and optional L2) allocator.

    ``name`` identifies the component everywhere (``InsertParams.aux``, ``TierOp.transfers``,
    ``evict_units``, the wire); ``ctype`` is its ``ComponentType`` when it is one of the
    known kinds (None for any other). ``slot`` is its index into ``TreeNode.data``, set by
    the cache. ``lock_needs_token``: ``unlock`` needs what ``lock`` returned.
    """

    ctype: ComponentType | None = ComponentType.FULL
    name = "full"
    paged = True  # values are page lists (FULL, SWA) rather than one state slot (MAMBA)
    lock_needs_token = False

    def __init__(self, allocator: PageAllocator, host_allocator: PageAllocator | None = None) -> None:
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"{type(self).__name__} needs a PageAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.host_allocator = host_allocator
        self.slot = -1  # index into TreeNode.data, set by the cache

    # ---- units
    @staticmethod
    def units(value: Any) -> int:
        return len(value)

    @staticmethod
    def as_pages(value: Any) -> list[int]:
        return value  # type: ignore[no-any-return]

    @staticmethod
    def from_pages(pages: Sequence[int]) -> Any:
        return pages

    def unit_tokens(self, page_size: int) -> int:
        """Tokens one unit stands for in sizes and eviction amounts (1 for a state)."""
        return page_size if self.paged else 1

    # ---- structure and matching
    def priority(self, is_leaf: bool) -> int:
        """Cascade-eviction rank: evicting this component's data on a node also evicts the
        unlocked data of components whose rank there is lower or equal."""
        raise NotImplementedError

    def new_validator(self) -> Validator | None:
        """A fresh stateful boundary predicate (see ``Validator``); None: always valid."""
        return None

    def split(self, upper: ComponentData, lower: ComponentData, pages: int) -> None:
        """Divide ``lower``'s data: the first ``pages`` pages go to ``upper`` (new, empty)."""
        if lower.value is not None:
            upper.value, lower.value = lower.value[:pages], lower.value[pages:]
        if lower.host_value is not None:
            upper.host_value, lower.host_value = lower.host_value[:pages], lower.host_value[pages:]
        upper.lock_ref = lower.lock_ref
        upper.host_lock_ref = lower.host_lock_ref

    def op_span(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """Which nodes of an operation (lowest first, as ``split`` left them) carry this
        component's per-node data and locks: all of them for paged data (a split copies
        both up), the lowest for a state (a split leaves it there)."""
        return nodes if self.paged else nodes[:1]

    def copy_on_match(self, core: TreeCore, node: TreeNode, evict_one: Callable[[], object]) -> Any:
        """A private copy of ``node``'s data for the request that matched it (data a request
        mutates). Returns the copy's value, None when the component needs none, or raises
        ``NoRoom`` when no index can be had even after ``evict_one``."""
        return None

    # ---- locks
    def lock(self, core: TreeCore, node: TreeNode) -> Any:
        """Acquire this component's request lock from ``node``; returns a token for unlock."""
        raise NotImplementedError

    def unlock(self, core: TreeCore, node: TreeNode, token: Any) -> None:
        """Release what ``lock`` took (``token``: what it returned)."""
        raise NotImplementedError

    # ---- insert (payload: what ``InsertParams.aux[name]`` holds; None: nothing given)
    def check_insert(self, payload: Any, npages: int) -> None:
        """Refuse a payload that does not fit a key of ``npages`` pages (before any change)."""

    def insert_cuts(self, payload: Any, first_page: int, npages: int) -> list[int]:
        """Page offsets in ``(first_page, npages)`` where the new nodes of an insert must be
        cut, so that each new node is either wholly covered by the payload or not at all."""
        return []

    def overlap_cuts(self, core: TreeCore, node: TreeNode, first_page: int, payload: Any) -> list[int]:
        """Page offsets inside existing ``node`` (its key starts at page ``first_page``)
        where the insert must split it first, so that ``insert_overlap`` sees only nodes
        wholly on one side of each of this component's own boundaries."""
        return []

    def insert_overlap(self, core: TreeCore, node: TreeNode, first_page: int, payload: Any,
                       spare: list[int]) -> None:
        """The insert walks over existing ``node`` (its key starts at page ``first_page``):
        take what the payload gives for it, or give the request's duplicate to ``spare``."""

    def insert_new(self, core: TreeCore, node: TreeNode, first_page: int, payload: Any) -> None:
        """The insert created ``node`` (no data of this component yet) at page ``first_page``."""

    def insert_end(self, core: TreeCore, node: TreeNode, payload: Any, spare: list[int]) -> bool:
        """After the walk: ``node`` ends the key. True when the tree already held what the
        payload gives for it (the payload's units went to ``spare``)."""
        return False

    def discard(self, core: TreeCore, payload: Any, spare: list[int]) -> None:
        """An insert that stores nothing: give up every unit the payload owns."""

    # ---- requests (``RequestState`` fields this component owns)
    def request_payload(self, req: RequestState, npages: int) -> Any:
        """The payload for inserting ``req``'s first ``npages`` pages when it finishes."""
        return None

    def release_request(self, req: RequestState, npages: int, inserted: bool, spare: list[int]) -> None:
        """After ``cache_finished_req``: give up what ``req`` still holds of this component
        (``inserted``: its first ``npages`` pages went to the tree with ``request_payload``)."""


class NoRoom(Exception):
    """A component could not get an index it needs (raised by ``copy_on_match``)."""


class FullComponent(TreeComponent):
    """Full-attention KV: path locks; liveness of the node (the primary component)."""

    ctype = ComponentType.FULL
    name = "full"

    def priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 2

    def lock(self, core: TreeCore, node: TreeNode) -> None:
        i = self.slot
        units = core.units[i]
        prot = core.dev_prot
        core.version += 1
        while node.parent is not None:
            cd = node.data[i]
            if cd.lock_ref == 0 and cd.value is not None:
                prot[i] += units(cd.value)
            cd.lock_ref += 1
            node = node.parent

    def unlock(self, core: TreeCore, node: TreeNode, token: Any = None) -> None:
        i = self.slot
        n: TreeNode | None = node
        while n is not None and n.parent is not None:  # validate first: fail without change
            if n.data[i].lock_ref <= 0:
                raise ValueError(f"dec_lock_ref below zero at {n!r}")
            n = n.parent
        units = core.units[i]
        prot = core.dev_prot
        core.version += 1
        while node.parent is not None:
            cd = node.data[i]
            cd.lock_ref -= 1
            if cd.lock_ref == 0 and cd.value is not None:
                prot[i] -= units(cd.value)
            node = node.parent


class PagedAuxComponent(TreeComponent):
    """A non-primary paged component whose insert payload is a ``PagedInsert``: its data
    may be absent on any node (a tombstone), and an insert recovers tombstones from the
    request's own pages. Subclasses give ``priority``, ``new_validator`` and the locks."""

    def check_insert(self, payload: PagedInsert | None, npages: int) -> None:
        if payload is not None and len(payload.pages) < npages - payload.start_page:
            raise ValueError(f"insert: the {self.name} pages are shorter than the key after start_page")

    def _own_from(self, p: PagedInsert, page_size: int) -> int:
        return max(p.start_page, p.tree_len // page_size)  # request-owned pages start here

    def insert_cuts(self, payload: PagedInsert | None, first_page: int, npages: int) -> list[int]:
        if payload is not None and first_page < payload.start_page < npages:
            return [payload.start_page]
        return []

    def overlap_cuts(self, core: TreeCore, node: TreeNode, first_page: int, payload: PagedInsert | None
                     ) -> list[int]:
        # a tombstone that the request's own pages cover only in part: split where they
        # start (the upper part stays a tombstone, the lower one is recovered)
        if payload is None or node.data[self.slot].value is not None:
            return []
        own_lo = self._own_from(payload, core.page_size)
        return [own_lo] if first_page < own_lo < first_page + len(node.key) // core.page_size else []

    def insert_overlap(self, core: TreeCore, node: TreeNode, first_page: int, payload: PagedInsert | None,
                       spare: list[int]) -> None:
        if payload is None:
            return
        ps = core.page_size
        a, b = first_page, first_page + len(node.key) // ps
        own_lo = self._own_from(payload, ps)
        if b <= own_lo:
            return
        cd = node.data[self.slot]
        start = payload.start_page
        if cd.value is not None:  # the tree has it: the request's copy is a duplicate
            spare.extend(payload.pages[max(a, own_lo) - start:b - start])
            return
        if a < own_lo:
            raise RuntimeError(f"{self.name}: a tombstone to recover in part was not split first")
        core.set_value(node, self.slot, list(payload.pages[a - start:b - start]))

    def insert_new(self, core: TreeCore, node: TreeNode, first_page: int, payload: PagedInsert | None) -> None:
        if payload is None or first_page < payload.start_page:
            return  # before the payload's first page (a cut makes it a whole node)
        lo = first_page - payload.start_page
        core.set_value(node, self.slot, list(payload.pages[lo:lo + len(node.key) // core.page_size]))

    def discard(self, core: TreeCore, payload: PagedInsert | None, spare: list[int]) -> None:
        if payload is not None:  # the pages before the request-owned ones are the tree's
            spare.extend(payload.pages[self._own_from(payload, core.page_size) - payload.start_page:])


class SWAComponent(PagedAuxComponent):
    """Sliding-window KV: only the last ``sliding_window`` tokens before a boundary matter.

    Internal nodes can hold a tombstone (``value is None``) while FULL keeps its data. A
    window lock walks up locking every node until ``sliding_window`` tokens with SWA data
    are covered; the node where it stops carries a uuid (``metadata['uuid']``, shared by
    every lock stopping there), and unlock walks up to the node with that uuid, so both stop
    at the same place even if the tree changed meanwhile. A split moves the uuid to the
    upper part (both parts hold the lock).

    Its part of a ``RequestState``: ``aux["swa"]``, a ``SwaRequestPages``.
    """

    ctype = ComponentType.SWA
    name = "swa"
    lock_needs_token = True

    def __init__(self, allocator: PageAllocator, sliding_window: int,
                 host_allocator: PageAllocator | None = None) -> None:
        super().__init__(allocator, host_allocator)
        if sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        self.sliding_window = sliding_window

    def priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 1

    def new_validator(self) -> Validator:
        i, window = self.slot, self.sliding_window
        state = [0, 0]  # covered tokens ending at the boundary, depth in tokens

        def step(node: TreeNode, from_host: bool) -> bool:
            n = len(node.key)
            state[1] += n
            cd = node.data[i]
            if (cd.host_value if from_host else cd.value) is not None:
                state[0] += n
            else:
                state[0] = 0
            return state[0] >= window or state[0] == state[1]

        return step

    def split(self, upper: ComponentData, lower: ComponentData, pages: int) -> None:
        super().split(upper, lower, pages)
        if lower.metadata and "uuid" in lower.metadata:
            upper.metadata = {"uuid": lower.metadata.pop("uuid")}

    def lock(self, core: TreeCore, node: TreeNode) -> int | None:
        i = self.slot
        covered = 0
        while node.parent is not None:
            core.lock(node, i)
            cd = node.data[i]
            if cd.value is not None:
                covered += len(node.key)
                if covered >= self.sliding_window:
                    if cd.metadata is None:
                        cd.metadata = {}
                    uid = cd.metadata.get("uuid")
                    if uid is None:
                        uid = cd.metadata["uuid"] = next(_uuids)
                    return int(uid)
            node = node.parent
        return None

    def unlock(self, core: TreeCore, node: TreeNode, token: int | None) -> None:
        i = self.slot
        path = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            if n.data[i].lock_ref <= 0:
                raise ValueError(f"SWA dec_lock_ref below zero at {n!r}")
            path.append(n)
            md = n.data[i].metadata
            if token is not None and md is not None and md.get("uuid") == token:
                break
            n = n.parent
        else:
            if token is not None:
                raise ValueError("SWA lock boundary not found on the path")
        for n in path:
            core.unlock(n, i)

    def request_payload(self, req: RequestState, npages: int) -> PagedInsert | None:
        table: SwaRequestPages | None = req.aux.get(self.name)
        if table is None:
            return None
        return PagedInsert(table.pages[:max(0, npages - table.start_page)], table.start_page, table.prefix_len)

    def release_request(self, req: RequestState, npages: int, inserted: bool, spare: list[int]) -> None:
        table: SwaRequestPages | None = req.aux.pop(self.name, None)
        if table is not None:  # the pages past the inserted key are the request's own
            spare.extend(table.pages[max(0, npages - table.start_page):])


@dataclass
class SwaRequestPages:
    """A running request's SWA page table, its ``RequestState.aux["swa"]``: ``pages`` cover
    the key's pages from ``start_page`` on (earlier ones were released); the first
    ``prefix_len`` tokens' SWA pages are the tree's (from the match, or a prompt-boundary
    insert; chunked prefill inserts FULL pages only, so it leaves this unchanged), the rest
    the request's own."""

    pages: list[int]
    start_page: int = 0
    prefix_len: int = 0


class MambaComponent(TreeComponent):
    """SSM/conv state: one state slot per node that has one; single-node locks.

    ``copy_state(src, dst)`` (optional) copies a state slot; it runs on match
    (copy-on-write: the request gets its own slot because decoding mutates it).
    Its part of a ``RequestState``: ``aux["mamba"]``, a state slot (the state after the
    request's last full page).
    """

    ctype = ComponentType.MAMBA
    name = "mamba"
    paged = False

    def __init__(self, allocator: PageAllocator, host_allocator: PageAllocator | None = None,
                 copy_state: Callable[[int, int], None] | None = None) -> None:
        super().__init__(allocator, host_allocator)
        self.copy_state = copy_state

    @staticmethod
    def units(value: Any) -> int:
        return 1

    @staticmethod
    def as_pages(value: Any) -> list[int]:
        return [value]

    @staticmethod
    def from_pages(pages: Sequence[int]) -> Any:
        return pages[0]

    def priority(self, is_leaf: bool) -> int:
        return 0

    def new_validator(self) -> Validator:
        i = self.slot

        def step(node: TreeNode, from_host: bool) -> bool:
            cd = node.data[i]
            return (cd.host_value if from_host else cd.value) is not None

        return step

    def split(self, upper: ComponentData, lower: ComponentData, pages: int) -> None:
        pass  # the state belongs to the end of the key: it stays on the lower node

    def copy_on_match(self, core: TreeCore, node: TreeNode, evict_one: Callable[[], object]) -> int:
        src = node.data[self.slot].value
        core.lock(node, self.slot)  # the source must survive the eviction below
        try:
            dst = self.allocator.alloc(1)
            if dst is None:
                evict_one()
                dst = self.allocator.alloc(1)
        finally:
            core.unlock(node, self.slot)
        if dst is None:
            raise NoRoom(self.name)
        if self.copy_state is not None:
            self.copy_state(src, dst[0])
        return dst[0]

    def lock(self, core: TreeCore, node: TreeNode) -> None:
        if node.parent is not None:
            core.lock(node, self.slot)

    def unlock(self, core: TreeCore, node: TreeNode, token: Any = None) -> None:
        if node.parent is not None:
            core.unlock(node, self.slot)

    def insert_end(self, core: TreeCore, node: TreeNode, payload: int | None, spare: list[int]) -> bool:
        if payload is None:
            return False
        if node.parent is not None and node.data[self.slot].value is None:
            core.set_value(node, self.slot, payload)
            return False
        spare.append(payload)
        return True

    def discard(self, core: TreeCore, payload: int | None, spare: list[int]) -> None:
        if payload is not None:
            spare.append(payload)

    def request_payload(self, req: RequestState, npages: int) -> int | None:
        slot: int | None = req.aux.get(self.name)
        return slot

    def release_request(self, req: RequestState, npages: int, inserted: bool, spare: list[int]) -> None:
        slot: int | None = req.aux.pop(self.name, None)
        if slot is not None and not inserted:
            spare.append(slot)
