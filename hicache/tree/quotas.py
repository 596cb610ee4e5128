"""Per-tenant L2 quotas (``server.api_keys[].quota.l2_tokens``): a bound and a guarantee.

A tenant's namespaces are the tree's roots whose ``cache_salt`` is that tenant's
(``hicache.tenants``); its L2 use is the Full L2 pages under them (``TreeCore.host_by_root``,
summed over its roots). The rules, and where they are applied:

=====================================================  =======================================
rule                                                   where
=====================================================  =======================================
a tenant's L2 pages never pass its quota: an L2 write  ``TierCalls.start_write`` (and, for
or a prefetch that would pass it first evicts that     a prefetch, ``ControllerDriver``: it
tenant's own L2-only pages, coldest first; if those    brings fewer pages), through
are not enough, the write is not made (the node stays  ``make_room``
in L1) and the prefetch brings what fits
L2 eviction for anyone else's room never takes a       ``HostCalls.evict_host(may_evict=
quota tenant's pages: what a tenant holds within its   evictable_for(tenant))``
quota is never evicted for another tenant
pages of no tenant, or of a tenant without a quota,    as without quotas
are evicted as before; a flush evicts everything
=====================================================  =======================================

So the quotas together reserve L2: ``hicache.config`` refuses a set whose sum is more than
``cache.l2.tokens``. Costs: a tenant's use is a sum over its roots (one per ``cache_salt``
it uses); an eviction that skips protected pages walks past them in the L2 order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.tree.core import TreeCore
    from hicache.tree.node import TreeNode


class TenantQuotas:
    """The quotas of one tree (see the module docstring). ``quota_pages``: per tenant, Full
    L2 pages; ``tenant_of_salt``: a namespace's tenant from its ``cache_salt`` (None for
    none)."""

    def __init__(self, core: TreeCore, quota_pages: Mapping[str, int],
                 tenant_of_salt: Callable[[str], str | None]) -> None:
        self.core = core
        self.quota_pages = dict(quota_pages)
        self._tenant_of_salt = tenant_of_salt
        self._root_tenant: dict[TreeNode, str | None] = {}
        self.pending: dict[str, int] = {}
        """Per tenant, L2 pages reserved for writes and prefetches in flight (they count)."""

    def tenant(self, node: TreeNode) -> str | None:
        """The tenant whose namespace ``node`` is in (None: no tenant)."""
        root = node.root
        try:
            return self._root_tenant[root]
        except KeyError:
            t = self._root_tenant[root] = self._tenant_of_salt(root.salt or "")
            return t

    def tenant_of_salt(self, salt: str) -> str | None:
        return self._tenant_of_salt(salt)

    def used(self, tenant: str) -> int:
        """The tenant's Full L2 pages now, with those reserved for its transfers in flight."""
        held = sum(n for root, n in self.core.host_by_root.items() if n and self.tenant(root) == tenant)
        return held + self.pending.get(tenant, 0)

    def reserve(self, tenant: str | None, pages: int) -> None:
        """``pages`` L2 pages are on their way to ``tenant`` (a write or a prefetch started)."""
        if tenant is not None:
            self.pending[tenant] = self.pending.get(tenant, 0) + pages

    def settle(self, tenant: str | None, pages: int) -> None:
        """The transfer ``reserve`` counted has ended (its pages are now held, or freed)."""
        if tenant is not None:
            left = self.pending[tenant] - pages
            if left < 0:
                raise ValueError(f"tenant {tenant!r}: settling more L2 pages than were reserved")
            self.pending[tenant] = left

    def usage(self) -> dict[str, tuple[int, int | None]]:
        """Per tenant seen in L2 or with a quota: ``(pages held, quota pages or None)``
        (held: in L2 now, transfers in flight left out)."""
        out: dict[str, tuple[int, int | None]] = {t: (0, q) for t, q in self.quota_pages.items()}
        for root, n in self.core.host_by_root.items():
            t = self.tenant(root)
            if t is not None:
                used, q = out.get(t, (0, self.quota_pages.get(t)))
                out[t] = (used + n, q)
        return out

    def evictable_for(self, tenant: str | None) -> Callable[[TreeNode], bool]:
        """What L2 eviction for ``tenant``'s room may take: anything but another quota
        tenant's pages."""
        quotas = self.quota_pages

        def may_evict(node: TreeNode) -> bool:
            t = self.tenant(node)
            return t is None or t == tenant or t not in quotas

        return may_evict

    def make_room(self, evict_host: Callable[..., int], page_size: int, tenant: str | None, pages: int) -> int:
        """How many of ``pages`` new L2 pages ``tenant`` may take now, after evicting its own
        coldest L2-only pages to stay within its quota (``evict_host``: ``HostCalls``')."""
        if tenant is None or tenant not in self.quota_pages:
            return pages
        quota = self.quota_pages[tenant]
        over = self.used(tenant) + pages - quota
        if over > 0:
            evict_host(over * page_size, may_evict=lambda n: self.tenant(n) == tenant)
        return max(0, min(pages, quota - self.used(tenant)))
