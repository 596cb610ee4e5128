"""TreeComponent and the three kinds of cached data (docs/architecture.md §4).

Each component decides, for its own data: where a match boundary is valid, how a lock
spreads over the path, how a split divides its data, and its cascade-eviction priority.
The core and the cache call these hooks and have no per-kind special cases, except that
FULL's data decides whether a node exists at all.

| hook                 | FULL                     | SWA                                   | MAMBA                    |
|----------------------|--------------------------|---------------------------------------|--------------------------|
| valid boundary       | has L1 data              | last ``sliding_window`` tokens have   | node has a state         |
|                      |                          | SWA data (or the whole prefix does)   |                          |
| lock                 | node -> root             | up until the window is covered; the   | the node only            |
|                      |                          | boundary node carries a uuid          |                          |
| split                | value sliced, lock_ref,  | value sliced, lock_ref and host lock  | state and locks stay on  |
|                      | host lock copied up      | copied up, boundary uuid moves up     | the lower (original) node|
| priority internal/leaf| 2 / 0                   | 1 / 0                                 | 0 / 0                    |
| L2 units             | one per page             | one per page                          | one per state            |
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from hicache.memory.allocator import PageAllocator
from hicache.tree.node import ComponentData, ComponentType, TreeNode

_uuids = itertools.count(1)


class TreeComponent:
    """Base class: one kind of cached data, with its L1 (and optional L2) allocator."""

    ctype: ComponentType = ComponentType.FULL
    paged = True  # values are page lists (FULL, SWA) rather than one state slot (MAMBA)

    def __init__(self, allocator: PageAllocator, host_allocator: PageAllocator | None = None) -> None:
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"{type(self).__name__} needs a PageAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.host_allocator = host_allocator
        self.slot = -1  # index into TreeNode.data, set by the cache

    @property
    def name(self) -> str:
        return self.ctype.wire_name

    # ---- units
    @staticmethod
    def units(value: Any) -> int:
        return len(value)

    @staticmethod
    def as_pages(value: Any) -> list[int]:
        return value

    @staticmethod
    def from_pages(pages: list[int]) -> Any:
        return pages

    # ---- hooks
    def priority(self, is_leaf: bool) -> int:
        raise NotImplementedError

    def new_validator(self) -> Callable[[TreeNode], bool] | None:
        """A stateful predicate fed the device path root-side first; it answers whether the
        boundary after each node is valid for this component. None: always valid."""
        return None

    def split(self, upper: ComponentData, lower: ComponentData, pages: int) -> None:
        """Divide ``lower``'s data: the first ``pages`` pages go to ``upper`` (new, empty)."""
        if lower.value is not None:
            upper.value, lower.value = lower.value[:pages], lower.value[pages:]
        if lower.host_value is not None:
            upper.host_value, lower.host_value = lower.host_value[:pages], lower.host_value[pages:]
        upper.lock_ref = lower.lock_ref
        upper.host_lock_ref = lower.host_lock_ref

    def lock(self, core: Any, node: TreeNode) -> Any:
        """Acquire this component's request lock from ``node``; returns a token for unlock."""
        raise NotImplementedError

    def unlock(self, core: Any, node: TreeNode, token: Any) -> None:
        raise NotImplementedError


class FullComponent(TreeComponent):
    """Full-attention KV: path locks; liveness of the node."""

    ctype = ComponentType.FULL

    def priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 2

    def lock(self, core: Any, node: TreeNode) -> None:
        i = self.slot
        units = core.units[i]
        prot = core.dev_prot
        while node.parent is not None:
            cd = node.data[i]
            if cd.lock_ref == 0 and cd.value is not None:
                prot[i] += units(cd.value)
            cd.lock_ref += 1
            node = node.parent

    def unlock(self, core: Any, node: TreeNode, token: Any = None) -> None:
        i = self.slot
        n: TreeNode | None = node
        while n is not None and n.parent is not None:  # validate first: fail without change
            if n.data[i].lock_ref <= 0:
                raise ValueError(f"dec_lock_ref below zero at {n!r}")
            n = n.parent
        units = core.units[i]
        prot = core.dev_prot
        while node.parent is not None:
            cd = node.data[i]
            cd.lock_ref -= 1
            if cd.lock_ref == 0 and cd.value is not None:
                prot[i] -= units(cd.value)
            node = node.parent


class SWAComponent(TreeComponent):
    """Sliding-window KV: only the last ``sliding_window`` tokens before a boundary matter.

    Internal nodes can hold a tombstone (``value is None``) while FULL keeps its data. A
    window lock walks up locking every node until ``sliding_window`` tokens with SWA data
    are covered; the node where it stops carries a uuid (``metadata['uuid']``, shared by
    every lock stopping there), and unlock walks up to the node with that uuid, so both stop
    at the same place even if the tree changed meanwhile. A split moves the uuid to the
    upper part (both parts hold the lock).
    """

    ctype = ComponentType.SWA

    def __init__(self, allocator: PageAllocator, sliding_window: int,
                 host_allocator: PageAllocator | None = None) -> None:
        super().__init__(allocator, host_allocator)
        if sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        self.sliding_window = sliding_window

    def priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 1

    def new_validator(self) -> Callable[[TreeNode], bool]:
        i, window = self.slot, self.sliding_window
        state = [0, 0]  # covered tokens ending at the boundary, depth in tokens

        def step(node: TreeNode) -> bool:
            n = len(node.key)
            state[1] += n
            if node.data[i].value is not None:
                state[0] += n
            else:
                state[0] = 0
            return state[0] >= window or state[0] == state[1]

        return step

    def split(self, upper: ComponentData, lower: ComponentData, pages: int) -> None:
        super().split(upper, lower, pages)
        if lower.metadata and "uuid" in lower.metadata:
            upper.metadata = {"uuid": lower.metadata.pop("uuid")}

    def lock(self, core: Any, node: TreeNode) -> int | None:
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
                    return uid
            node = node.parent
        return None

    def unlock(self, core: Any, node: TreeNode, token: int | None) -> None:
        i = self.slot
        path = []
        n = node
        while n.parent is not None:
            if n.data[i].lock_ref <= 0:
                raise ValueError(f"SWA dec_lock_ref below zero at {n!r}")
            path.append(n)
            md = n.data[i].metadata
            if token is not None and md is not None and md.get("uuid") == token:
                break
            n = n.parent  # type: ignore[assignment]
        else:
            if token is not None:
                raise ValueError("SWA lock boundary not found on the path")
        for n in path:
            core.unlock(n, i)


class MambaComponent(TreeComponent):
    """SSM/conv state: one state slot per node that has one; single-node locks.

    ``copy_state(src, dst)`` (optional) copies a state slot; it runs on match
    (copy-on-write: the request gets its own slot because decoding mutates it).
    """

    ctype = ComponentType.MAMBA
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
    def from_pages(pages: list[int]) -> Any:
        return pages[0]

    def priority(self, is_leaf: bool) -> int:
        return 0

    def new_validator(self) -> Callable[[TreeNode], bool]:
        i = self.slot
        return lambda node: node.data[i].value is not None

    def split(self, upper: ComponentData, lower: ComponentData, pages: int) -> None:
        pass  # the state belongs to the end of the key: it stays on the lower node

    def lock(self, core: Any, node: TreeNode) -> None:
        if node.parent is not None:
            core.lock(node, self.slot)

    def unlock(self, core: Any, node: TreeNode, token: Any = None) -> None:
        if node.parent is not None:
            core.unlock(node, self.slot)
