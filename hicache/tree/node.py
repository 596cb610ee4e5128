"""Tree nodes and per-component node data (docs/architecture.md §4).

A node's ``key`` is a page-aligned run of token ids (an ``array('I')``) and every per-page
field (``value``, ``host_value``, ``hash_value``) holds exactly one entry per page of it
(``hash_value``: ``HASH_BYTES`` raw bytes a page, all in one ``bytes`` buffer).
``TreeNode`` keeps the structure; ``ComponentData`` keeps what one component stores there.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias

    Key: TypeAlias = array[int]
else:
    Key = array
"""Token ids as ``array('I')`` (uint32): slices and comparisons are C-level memory copies
and compares, and the bytes are exactly what page hashing consumes."""

KEY_TYPECODE = "I"
KEY_ITEMSIZE = array(KEY_TYPECODE).itemsize
"""Bytes per token id in a key's ``tobytes()`` (the walks compare keys as bytes, in place)."""


class ComponentType(IntEnum):
    """Kinds of cached data. FULL is always present and decides whether a node lives."""

    FULL = 0
    SWA = 1
    MAMBA = 2

    @property
    def wire_name(self) -> str:
        return self.name.lower()


class LruLink:
    """One entry of an intrusive LRU list (see ``hicache.tree.policy``)."""

    __slots__ = ("prev", "next", "owner", "segment")

    def __init__(self, owner: TreeNode | None) -> None:
        self.prev: LruLink | None = None
        self.next: LruLink | None = None
        self.owner = owner
        self.segment = 0  # which list of a segmented policy holds it

    @property
    def linked(self) -> bool:
        return self.prev is not None


class ComponentData:
    """What one component keeps on one node.

    ``value``: L1 indices (a list of pages for FULL/SWA, one state slot for MAMBA) or None
    (a tombstone: evicted from L1). ``host_value``: L2 indices or None. ``lock_ref`` protects
    ``value`` from L1 eviction, ``host_lock_ref`` protects ``host_value`` from L2 eviction.
    ``dlink`` / ``hlink`` are this node's entries in the component's L1 / L2 LRU lists.
    """

    __slots__ = ("value", "lock_ref", "host_value", "host_lock_ref", "metadata", "dlink", "hlink")

    def __init__(self, owner: TreeNode | None, value: Any = None) -> None:
        self.value = value
        self.lock_ref = 0
        self.host_value: Any = None
        self.host_lock_ref = 0
        self.metadata: dict[str, Any] | None = None
        self.dlink = LruLink(owner)
        self.hlink = LruLink(owner)


class TreeNode:
    """A radix-tree node.

    ``children`` is indexed by the first page of each child's key (the token id itself when
    the page size is 1, the page's bytes otherwise). ``data[i]`` belongs to
    the cache's ``i``-th component (FULL is index 0). ``hash_value`` (the page hashes,
    ``HASH_BYTES`` raw bytes a page in one buffer, not a string per page) is computed
    lazily, only when a tier needs it, and split along with the node.
    ``loading`` marks an L1 copy whose host->device load is still in flight (not yet readable).
    ``salt`` is set on namespace roots only (one root per ``cache_salt``); ``root`` is the
    namespace root the node hangs under (itself for a root; it never changes).
    """

    __slots__ = (
        "children", "parent", "key", "data", "hash_value", "hit_count", "last_access_time",
        "host_time", "id", "loading", "in_flight", "salt", "root",
    )

    _next_id = 0

    def __init__(self, parent: TreeNode | None, key: Key, n_components: int) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.root: TreeNode = self if parent is None else parent.root
        self.key = key
        self.data = [ComponentData(self) for _ in range(n_components)]
        self.hash_value: bytes | None = None
        self.hit_count = 0
        self.last_access_time = 0  # logical clock: bumped on every touch and L1 (re)fill
        self.host_time = 0  # the same clock, bumped on touches and when the L2 copy lands
        TreeNode._next_id += 1
        self.id = TreeNode._next_id
        self.loading = False
        self.in_flight = 0  # tier operations (write / load / backup) holding this node
        self.salt: str | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def value(self) -> Any:
        """FULL-component L1 pages (None when the node is L2-only)."""
        return self.data[0].value

    @property
    def host_value(self) -> Any:
        """FULL-component L2 pages (None without an L2 copy)."""
        return self.data[0].host_value

    @property
    def lock_ref(self) -> int:
        return self.data[0].lock_ref

    @property
    def host_lock_ref(self) -> int:
        return self.data[0].host_lock_ref

    @property
    def evicted(self) -> bool:
        """True when the FULL data is not on the device (an L2-only node)."""
        return self.data[0].value is None

    def __repr__(self) -> str:
        d = self.data[0]
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, device={d.value is not None}, "
                f"host={d.host_value is not None}, lock={d.lock_ref}, host_lock={d.host_lock_ref})")


@dataclass
class LockToken:
    """Returned by ``inc_lock_ref``; pass it back to ``dec_lock_ref``."""

    node: TreeNode
    parts: tuple[Any, ...]
