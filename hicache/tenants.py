"""Tenants' cache namespaces: the effective ``cache_salt`` of a tenant's request, and back.

Used by the tokenizer (which namespaces each request by its key's tenant) and by the
scheduler (whose per-tenant L2 quotas read a namespace's tenant back from its salt).
"""

from __future__ import annotations

__all__ = ["TENANT_SALT_TAG", "split_tenant_salt", "tenant_of_salt", "tenant_salt"]

TENANT_SALT_TAG = "\x00tenant:"
"""How the effective ``cache_salt`` of a tenant's request starts (``tenant_salt``)."""


def tenant_salt(tenant: str | None, salt: str) -> str:
    """The effective ``cache_salt`` of a request authenticated as ``tenant`` whose body asked
    for ``salt`` (its ``cache_salt``; on ``/generate`` with ``extra_key`` appended).

    ``tenant`` None (no ``server.api_keys``: no key, or the tenant-less ``server.api_key``):
    ``salt`` unchanged, so page hashes are the same as without tenants. A tenant:
    ``TENANT_SALT_TAG + str(len(tenant)) + ":" + tenant + ":" + salt``. The map
    ``(tenant, salt) -> effective salt`` is injective (``split_tenant_salt`` inverts it: the
    decimal length, which holds no ``:``, says exactly where the tenant name ends), so no
    ``salt`` a client of one tenant can send gives the effective salt of another tenant's
    request, and the page-hash seed (``hicache.hashing``, which length-prefixes the salt)
    differs too: one tenant's pages are never another's hits, in L1, L2 or L3."""
    if tenant is None:
        return salt
    if not tenant:
        raise ValueError("a tenant name must not be empty")
    return f"{TENANT_SALT_TAG}{len(tenant)}:{tenant}:{salt}"


def split_tenant_salt(effective: str) -> tuple[str, str] | None:
    """``(tenant, salt)`` of an effective salt ``tenant_salt`` made for a tenant, None for one
    it did not make that way (it does not start with ``TENANT_SALT_TAG`` followed by a
    well-formed length and name)."""
    if not effective.startswith(TENANT_SALT_TAG):
        return None
    rest = effective[len(TENANT_SALT_TAG):]
    digits, sep, rest = rest.partition(":")
    if not sep or not digits.isascii() or not digits.isdigit() or digits.startswith("0"):
        return None
    n = int(digits)
    if len(rest) < n + 1 or rest[n] != ":":
        return None
    return rest[:n], rest[n + 1:]


def tenant_of_salt(salt: str) -> str | None:
    """The tenant of a namespace's effective ``cache_salt`` (None: no tenant's)."""
    pair = split_tenant_salt(salt)
    return None if pair is None else pair[0]
