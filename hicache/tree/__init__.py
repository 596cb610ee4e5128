"""The unified radix tree (docs/architecture.md §4) and its HiCache node state (§5).

Layers: ``TreeCore`` (pure tree, orders, counters), ``TreeComponent`` (one per kind of cached
data: ``FullComponent``, ``SWAComponent``, ``MambaComponent``), ``UnifiedRadixCache`` (the API
the scheduler calls, executing decisions against index allocators). ``UnifiedRadixCache``
(``cache``: match, insert, locks, sizes, requests) derives from ``L1Eviction`` (``eviction``:
L1 eviction), which derives from ``CacheBase`` (``base``: the tree's state, result types,
shared helpers), and holds its tier-facing parts,
each holding the cache in turn through a written interface (the ``CacheBase`` state):
``tiers``, a ``TierCalls`` (``tiering``: what moves between tiers and how the nodes' state
follows, ``TierOp``; with ``TreeLocks``), ``host``, a ``HostCalls`` (``host``: L2 locks,
L2-only inserts, L2 eviction), and ``hashes``, a ``PageHashes`` (``hashes``: page hashes).
"""

from __future__ import annotations

from hicache.tree.base import EvictResult, InsertResult, MatchResult
from hicache.tree.cache import InsertParams, UnifiedRadixCache
from hicache.tree.components import (
    FullComponent,
    MambaComponent,
    NoRoom,
    PagedAuxComponent,
    PagedInsert,
    SWAComponent,
    SwaRequestPages,
    TreeComponent,
)
from hicache.tree.content import ContentObserver, Tier
from hicache.tree.core import TreeCore
from hicache.tree.integrity import IntegrityError, check_integrity
from hicache.tree.node import ComponentData, ComponentType, LockToken, TreeNode
from hicache.tree.policy import POLICIES, EvictionPolicy, LRUPolicy, SLRUPolicy, make_policy
from hicache.tree.request_state import RequestState
from hicache.tree.tiering import TierOp

__all__ = [
    "POLICIES", "ComponentData", "ContentObserver", "ComponentType", "EvictResult", "EvictionPolicy", "FullComponent",
    "InsertParams", "InsertResult", "IntegrityError", "LRUPolicy", "LockToken", "MambaComponent", "MatchResult",
    "NoRoom", "PagedAuxComponent", "PagedInsert",
    "RequestState", "SLRUPolicy", "SWAComponent", "SwaRequestPages", "Tier", "TierOp", "TreeComponent", "TreeCore", "TreeNode",
    "UnifiedRadixCache", "check_integrity", "make_policy",
]
