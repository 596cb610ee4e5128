"""CacheBase: the state and helpers every part of ``UnifiedRadixCache`` shares (docs/architecture.md §4).

``UnifiedRadixCache`` is built in six classes, one module each:

* ``CacheBase`` (this module): the constructor (the components checked and numbered, the
  ``TreeCore``, the write policy, the counters), the result types both halves
  return (``MatchResult``, ``InsertResult``, ``EvictResult``), and the helpers
  both use: ``_aligned`` (keys), ``_npages`` / ``_op_nodes`` (an op's span of nodes),
  ``_free`` (giving units back to an allocator), ``salt_of`` and ``_delete`` (removing a
  node, where L1 and L2 eviction both end);
* ``PageHashes`` (``hicache.tree.hashes``): the nodes' page hashes;
* ``HostCalls`` (``hicache.tree.host``): the L2-only calls (host locks, ``insert_host``,
  L2 eviction);
* ``TierCalls`` (``hicache.tree.tiering``): what moves between tiers and how the nodes'
  state follows (§5); it uses the two above;
* ``L1Eviction`` (``hicache.tree.eviction``): L1 eviction; it derives from ``CacheBase``;
* ``UnifiedRadixCache`` (``hicache.tree.cache``): the tree semantics the scheduler calls
  (match, insert, locks, sizes, requests, flush, integrity); it derives from
  ``L1Eviction`` and holds the three above it as ``hashes``, ``host`` and ``tiers``.

Those three hold a ``CacheBase`` (they derive from nothing); this module imports none of them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.memory.allocator import PageIndices
from hicache.tree.components import FullComponent, TreeComponent
from hicache.tree.core import TreeCore
from hicache.tree.node import KEY_TYPECODE, Key, TreeNode
from hicache.tree.policy import make_policy

WRITE_POLICIES = ("write_through", "write_through_selective", "write_through_filtered", "write_back")


@dataclass
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices``: FULL L1 pages of the valid device prefix (``device_len`` tokens).
    ``last_device_node``: the node ending that prefix (a root when nothing matched).
    ``host_hit_length``: tokens after it that are L2-only, ending at ``last_host_node``
    (a boundary valid for every component once loaded back).
    ``copies``: per component name, the request's private copy of the matched node's data
    (``TreeComponent.copy_on_match``: Mamba's state); the request owns and frees it.
    ``walked_len``: with auxiliary components, the tokens of the key the tree holds on
    the matched path in any tier, before the validators cut it (where the key forks from
    the tree or ends): a branch point whose state a request computing through it may add.
    ``walked_node``: the deepest node of that path (the root when nothing matched), where
    ``UnifiedRadixCache.record_hit`` counts the request's hit.
    """

    device_indices: PageIndices
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int = 0
    device_len: int = 0
    copies: dict[str, Any] = field(default_factory=dict)
    walked_len: int = 0
    walked_node: TreeNode | None = None
    path: list[TreeNode] | None = None
    """The walked path, root side first (``walked_node`` last), as the tree's shape was at
    ``shape_version`` (``TreeCore.shape_version``); ``record_hit`` uses it while the shape
    has not changed since."""
    shape_version: int = -1


@dataclass
class InsertResult:
    """``prefix_len``: tokens already on L1 before the insert (the caller frees its pages
    ``[prev_prefix_len, prefix_len)``); ``node``: the node ending the key; ``already_held``:
    the components whose end-node data the tree had already (the payload's was freed).
    ``insert_host`` only: ``host_pages_taken``, the FULL L2 pages it kept; ``new_nodes``, the
    nodes it made (root side first); ``aux_nodes``, the nodes the tree held before that took
    auxiliary L2 data from it; ``kept_end``, where the last node that kept any of its data
    ends (tokens of the key; 0 when it kept nothing): what a prefetch made matchable reaches
    there even when the tree had the FULL pages and took only auxiliary data."""

    prefix_len: int
    node: TreeNode
    already_held: frozenset[str] = frozenset()
    host_pages_taken: int = 0
    new_nodes: list[TreeNode] = field(default_factory=list)
    aux_nodes: list[TreeNode] = field(default_factory=list)
    kept_end: int = 0


@dataclass
class EvictResult:
    """What ``evict`` freed, per component name, in tokens (paged components) or states."""

    freed: dict[str, int] = field(default_factory=dict)

    def units(self, component: str) -> int:
        """What was freed of ``component`` (0 for none)."""
        return self.freed.get(component, 0)

    @property
    def full_tokens(self) -> int:
        return self.units("full")


class CacheBase:
    """The state of a ``UnifiedRadixCache`` (its arguments are described there) and the
    helpers both of its halves use. Not used on its own."""

    def __init__(
        self,
        components: Sequence[TreeComponent],
        page_size: int = 1,
        *,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
        write_through_threshold: int = 2,
    ) -> None:
        comps = list(components)
        if not comps or not isinstance(comps[0], FullComponent):
            raise ValueError("the first component must be a FullComponent")
        if any(isinstance(c, FullComponent) for c in comps[1:]):
            raise ValueError("only the first component may be a FullComponent")
        if len({c.name for c in comps}) != len(comps):
            raise ValueError("each component name may appear once")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        for i, c in enumerate(comps):
            if c.slot not in (-1, i):
                raise ValueError("a component instance can serve only one cache")
            c.slot = i
        self.components = comps
        self.page_size = page_size
        self.full: FullComponent = comps[0]
        self.aux = comps[1:]
        self._by_name = {c.name: c for c in comps}
        self._lock_needs_token = any(c.lock_needs_token for c in comps)
        self.eviction_policy = eviction_policy
        make_policy(eviction_policy)  # validate the name now
        hicache = comps[0].host_allocator is not None
        self.core = TreeCore(page_size, len(comps), [c.units for c in comps], [c.split for c in comps],
                             lambda: make_policy(eviction_policy),
                             written=[i == 0 or (hicache and c.host_allocator is not None)
                                      for i, c in enumerate(comps)])
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.hicache = hicache
        self._write_back = self.hicache and write_policy == "write_back"
        self._write_back_queue: dict[TreeNode, None] = {}
        # under write_back, nodes whose queued write could not start: eviction drops their
        # unwritten data (``TierCalls.release_write_back``)
        self._write_back_released: dict[TreeNode, None] = {}
        self.extend_leaves = True
        """Let an insert that continues a leaf only its request uses grow that leaf in place
        (``UnifiedRadixCache._extendable``), instead of a node per decode step."""
        self.evicted_device_tokens = 0  # monotonic: FULL tokens freed from L1 / L2 by eviction
        self.evicted_host_tokens = 0
        self._empty = self.full.allocator.empty
        # what a match under an unknown salt returns as its node: locking it is a no-op
        self._void_root = TreeNode(None, array(KEY_TYPECODE), len(comps))

    # ================================================================== helpers (both halves)
    def _aligned(self, key: Sequence[int]) -> tuple[Key, int]:
        """The key as ``array('I')`` (not copied when it already is one) and its
        page-aligned length. Token ids outside ``[0, 2**32)`` are refused."""
        if type(key) is not array or key.typecode != KEY_TYPECODE:
            try:
                key = array(KEY_TYPECODE, key)
            except (OverflowError, TypeError) as exc:
                raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
        n = len(key)
        return key, n - n % self.page_size

    def _npages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_size

    def _op_nodes(self, node: TreeNode, npages: int) -> list[TreeNode]:
        """Nodes from ``node`` upward spanning exactly ``npages`` pages (lowest first)."""
        out = []
        n: TreeNode | None = node
        while npages > 0:
            if n is None or n.parent is None:
                raise RuntimeError("in-flight operation lost its nodes")
            out.append(n)
            npages -= self._npages(n)
            n = n.parent
        if npages:
            raise RuntimeError("in-flight operation does not end on a node boundary")
        return out

    def _free(self, c: TreeComponent, units: Sequence[int], host: bool = False) -> None:
        if units:
            alloc = c.host_allocator if host else c.allocator
            if alloc is None:
                raise RuntimeError(f"{c.name} has no {'L2' if host else 'L1'} allocator")
            alloc.free(units)

    @staticmethod
    def salt_of(node: TreeNode) -> str:
        """The ``cache_salt`` of the root ``node`` hangs under ("" for none)."""
        while node.parent is not None:
            node = node.parent
        return node.salt or ""

    def _delete(self, node: TreeNode, cascade: bool = True) -> None:
        """Free every component's L1 and L2 data on ``node`` and detach it; with ``cascade``,
        ancestors left with no FULL data and no child go too (L1 and L2 eviction end here)."""
        core = self.core
        for c in self.components:
            v = core.clear_value(node, c.slot)
            if v is not None:
                self._free(c, c.as_pages(v))
            hv = core.clear_host(node, c.slot)
            if hv is not None:
                self._free(c, c.as_pages(hv), host=True)
        self._write_back_queue.pop(node, None)
        self._write_back_released.pop(node, None)
        parent = node.parent
        core.detach(node)
        # tombstone chain: a parent left with no FULL data anywhere and no child goes too
        while (cascade and parent is not None and parent.parent is not None and not parent.children
               and parent.data[0].value is None and parent.data[0].host_value is None):
            nxt = parent.parent
            core.detach(parent)
            parent = nxt
