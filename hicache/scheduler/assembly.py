"""Building the scheduler's parts from the config: model, KV pools view, allocators, tree.

Shared by the scheduler process (pools in shared memory) and by tests (plain tensors).
"""

from __future__ import annotations

import torch

from hicache.config import HicacheConfig
from hicache.hashing import HashNamespace
from hicache.memory.allocator import PageAllocator
from hicache.model.loader import LoadedModel
from hicache.model.pools import KVPools
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import FullComponent


def pages_for(tokens: int, page_size: int) -> int:
    return tokens // page_size


def hash_namespace(cfg: HicacheConfig, model: LoadedModel) -> HashNamespace:
    """The page-hash namespace of this daemon's Full KV (salts derive from it per request)."""
    return HashNamespace(model.identity, cfg.model.dtype, cfg.cache.page_size, "full")


def build_cache(cfg: HicacheConfig, model: LoadedModel, l1_pages: int,
                l2_pages: int | None) -> tuple[UnifiedRadixCache, PageAllocator, PageAllocator | None]:
    """The tree with its L1 (and, when ``l2_pages``, L2) allocators for a full-attention model."""
    l1 = PageAllocator(l1_pages, "l1-full")
    l2 = PageAllocator(l2_pages, "l2-full") if l2_pages else None
    cache = UnifiedRadixCache([FullComponent(l1, l2)], cfg.cache.page_size, hasher=hash_namespace(cfg, model),
                              eviction_policy=cfg.cache.eviction, write_policy=cfg.cache.write_policy,
                              write_through_threshold=cfg.cache.write_through_threshold)
    return cache, l1, l2


def kv_pools_over(full_kv: torch.Tensor, page_size: int) -> KVPools:
    """The runner's view of an L1 Full-KV tensor ``[layers, 2, pages*ps, heads, dim]``."""
    return KVPools(page_size=page_size, full_kv=full_kv)
