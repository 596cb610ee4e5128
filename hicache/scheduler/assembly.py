"""Building the scheduler's parts from the config: model, KV pools view, allocators, tree.

Shared by the scheduler process (pools in shared memory) and by tests (plain tensors).

Components (``ModelGeometry.components``, the cache's in this order): ``("full",)``,
``("full", "swa")``, ``("full", "mamba")`` or ``("full", "swa", "mamba")``; for a model with
no full-attention layer ``full`` is index-only (zero-layer pools: its allocator bounds the
cached token pages, the KV is all SWA's; ``ModelGeometry.full_index_only``). Every component gets its own L1 index allocator and, when L2 is on,
its own L2 allocator:

=========  ===============================  ==============================================
component  L1 allocator                     L2 allocator (only when L2 is on)
=========  ===============================  ==============================================
full       ``l1_pages`` pages               ``l2_pages`` pages
swa        ``swa_l1_pages``                 ``swa_l2_pages``
mamba      ``cache.l1.state_slots`` slots   ``cache.l2.state_slots`` slots (0: L1-only)
=========  ===============================  ==============================================

The SWA sizes default to ``hicache.config.swa_pool_tokens`` (the configured
``cache.l1.swa_tokens`` / ``cache.l2.swa_tokens``, else a default far below the Full pool:
a running request keeps only its windows, see ``swa_request_pages``), in pages, capped at
``l1_pages`` / ``l2_pages``.

Only Full KV goes to L3 (the controller stores the first paged component, ``full``).

Which component sets the tree can hold is ``hicache.model.geometry.unsupported_reason``
(torch-free: the start checks make it without importing this module).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache.config import HicacheConfig, swa_pool_tokens
from hicache.hashing import HashNamespace
from hicache.memory.allocator import PageAllocator
from hicache.memory.pools import SharedPools
from hicache.model.geometry import unsupported_reason
from hicache.model.loader import LoadedModel
from hicache.model.pools import KVPools
from hicache.storage_settings import l3_quotas_gb
from hicache.tenants import tenant_of_salt
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import FullComponent, MambaComponent, SWAComponent, TreeComponent
from hicache.tree.quotas import TenantQuotas

__all__ = ["build_cache", "hash_namespace", "kv_pools_from_shared", "kv_pools_over", "mamba_copier",
           "unsupported_reason"]
"""``unsupported_reason`` is ``hicache.model.geometry``'s (torch-free, so the start checks
need not import this module), named here too for the scheduler's callers."""


def hash_namespace(cfg: HicacheConfig, model: LoadedModel) -> HashNamespace:
    """The page-hash namespace of this daemon's Full KV (salts derive from it per request)."""
    return HashNamespace(model.identity, cfg.model.dtype, cfg.cache.page_size, "full")


def mamba_copier(conv: torch.Tensor, ssm: torch.Tensor) -> Callable[[int, int], None]:
    """``copy_state(src, dst)`` for L1 Mamba tensors ``[layers, slots, *shape]``: copies the
    conv and ssm state of slot ``src`` into slot ``dst`` for every mamba layer."""

    def copy_state(src: int, dst: int) -> None:
        if src == dst:
            return
        conv[:, dst].copy_(conv[:, src])
        ssm[:, dst].copy_(ssm[:, src])

    return copy_state


def build_cache(cfg: HicacheConfig, model: LoadedModel, l1_pages: int, l2_pages: int | None, *,
                pools: KVPools | None = None, swa_l1_pages: int | None = None,
                swa_l2_pages: int | None = None, l1_state_slots: int | None = None,
                l2_state_slots: int | None = None,
                ) -> tuple[UnifiedRadixCache, PageAllocator, PageAllocator | None]:
    """The tree with its allocators. Returns ``(cache, full L1 allocator, full L2 allocator)``;
    the SWA / Mamba allocators are ``cache.swa.allocator`` / ``cache.mamba.allocator`` (and
    their ``host_allocator``).

    SWA gets ``swa_l1_pages`` L1 pages (default: ``swa_pool_tokens``' L1 size, at most
    ``l1_pages``). L2 is on when ``l2_pages`` is truthy; then SWA gets ``swa_l2_pages``
    (default: ``swa_pool_tokens``' L2 size, at most ``l2_pages``) L2 pages and Mamba ``l2_state_slots`` (default ``cache.l2.state_slots``)
    L2 slots, none (L1-only) when that is 0. A Mamba model needs ``pools`` (its
    ``mamba_conv`` / ``mamba_ssm`` L1 tensors) for the copy-on-write of matched states.
    Raises ValueError for a model the tree cannot hold (see ``unsupported_reason``).
    """
    geometry = model.geometry
    problem = unsupported_reason(geometry)
    if problem:
        raise ValueError(problem)
    l1 = PageAllocator(l1_pages, "l1-full")
    l2 = PageAllocator(l2_pages, "l2-full") if l2_pages else None
    components: list[TreeComponent] = [FullComponent(l1, l2)]
    if geometry.swa is not None:
        if geometry.sliding_window is None:
            raise ValueError("a model with swa layers needs a sliding_window")
        d1, d2 = (n // cfg.cache.page_size for n in swa_pool_tokens(cfg, geometry.sliding_window))
        n1 = min(l1_pages, d1) if swa_l1_pages is None else swa_l1_pages
        n2 = (min(l2_pages, d2 or l2_pages) if swa_l2_pages is None else swa_l2_pages) if l2_pages else 0
        components.append(SWAComponent(PageAllocator(n1, "l1-swa"), geometry.sliding_window,
                                       PageAllocator(n2, "l2-swa") if n2 else None))
    if geometry.mamba is not None:
        if pools is None or pools.mamba_conv is None or pools.mamba_ssm is None:
            raise ValueError("a model with mamba layers needs its L1 mamba_conv / mamba_ssm tensors (pools=)")
        n1 = cfg.cache.l1.state_slots if l1_state_slots is None else l1_state_slots
        n2 = (cfg.cache.l2.state_slots if l2_state_slots is None else l2_state_slots) if l2_pages else 0
        if pools.num_state_slots < n1:
            raise ValueError(f"the mamba L1 tensors hold {pools.num_state_slots} state slots, {n1} requested")
        components.append(MambaComponent(PageAllocator(n1, "l1-mamba"),
                                         PageAllocator(n2, "l2-mamba") if n2 else None,
                                         mamba_copier(pools.mamba_conv, pools.mamba_ssm)))
    cache = UnifiedRadixCache(components, cfg.cache.page_size, hasher=hash_namespace(cfg, model),
                              eviction_policy=cfg.cache.eviction, write_policy=cfg.cache.write_policy,
                              write_through_threshold=cfg.cache.write_through_threshold)
    quotas = {k.tenant: k.quota.l2_tokens // cfg.cache.page_size for k in cfg.server.api_keys
              if k.quota is not None and k.quota.l2_tokens}
    if quotas and l2 is not None:
        cache.tiers.quotas = TenantQuotas(cache.core, quotas, tenant_of_salt)
    return cache, l1, l2


def l3_partition_of(cfg: HicacheConfig) -> Callable[[str], str] | None:
    """The L3 partition of a namespace's ``cache_salt``: its tenant where the tenant has an
    L3 quota (``server.api_keys[].quota.l3_gb``), else "" (the shared store); None without
    such quotas (``ControllerDriver.l3_partition``)."""
    parts = set(l3_quotas_gb(cfg))
    if not parts:
        return None

    def partition(salt: str) -> str:
        tenant = tenant_of_salt(salt)
        return tenant if tenant in parts else ""

    return partition


def kv_pools_over(full_kv: torch.Tensor, page_size: int, *, swa_kv: torch.Tensor | None = None,
                  mamba_conv: torch.Tensor | None = None, mamba_ssm: torch.Tensor | None = None) -> KVPools:
    """The runner's view of the L1 tensors: Full KV ``[layers, 2, pages*ps, heads, dim]``,
    SWA KV alike, Mamba conv / ssm ``[layers, slots, *shape]`` (None where the model has no
    such layers)."""
    return KVPools(page_size=page_size, full_kv=full_kv, swa_kv=swa_kv, mamba_conv=mamba_conv, mamba_ssm=mamba_ssm)


def kv_pools_from_shared(pools: SharedPools, page_size: int) -> KVPools:
    """The runner's view of the L1 tensors of mapped shared pools (every component present)."""
    comps = pools.components
    swa = comps["swa"].l1[0] if "swa" in comps else None
    conv = ssm = None
    if "mamba" in comps:
        conv, ssm = comps["mamba"].l1[0], comps["mamba"].l1[1]
    return kv_pools_over(comps["full"].l1[0], page_size, swa_kv=swa, mamba_conv=conv, mamba_ssm=ssm)
