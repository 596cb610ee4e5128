"""The unified radix tree (docs/architecture.md §4) and its HiCache node state (§5).

Layers: ``TreeCore`` (pure tree, orders, counters), ``TreeComponent`` (one per kind of cached
data: ``FullComponent``, ``SWAComponent``, ``MambaComponent``), ``UnifiedRadixCache`` (the API
the scheduler calls, executing decisions against index allocators).
"""

from __future__ import annotations

from hicache.tree.cache import (
    EvictResult,
    InsertParams,
    InsertResult,
    LockToken,
    MatchResult,
    RequestState,
    TierOp,
    UnifiedRadixCache,
)
from hicache.tree.components import (
    FullComponent,
    MambaComponent,
    NoRoom,
    PagedAuxComponent,
    PagedInsert,
    SWAComponent,
    TreeComponent,
)
from hicache.tree.core import TreeCore
from hicache.tree.integrity import IntegrityError, check_integrity
from hicache.tree.node import ComponentData, ComponentType, TreeNode
from hicache.tree.policy import POLICIES, EvictionPolicy, LRUPolicy, SLRUPolicy, make_policy

__all__ = [
    "POLICIES", "ComponentData", "ComponentType", "EvictResult", "EvictionPolicy", "FullComponent",
    "InsertParams", "InsertResult", "IntegrityError", "LRUPolicy", "LockToken", "MambaComponent", "MatchResult",
    "NoRoom", "PagedAuxComponent", "PagedInsert",
    "RequestState", "SLRUPolicy", "SWAComponent", "TierOp", "TreeComponent", "TreeCore", "TreeNode",
    "UnifiedRadixCache", "check_integrity", "make_policy",
]
