"""Who may call what on the HTTP API (docs/operations.md "Security"): the operator, a tenant, anyone.

``HttpApi._auth`` authenticates the bearer key; a request then is

- the **operator**'s: the key of ``server.operator``, or ``server.api_key`` (a daemon without
  tenants), or any request when no key is configured at all (the daemon then listens on
  loopback only, unless ``server.allow_unauthenticated``);
- a **tenant**'s: a key of ``server.api_keys`` (``TENANT`` on the request names it).

=============================================  ==========  ===========================================
route                                          operator    tenant
=============================================  ==========  ===========================================
``GET /health``                                yes (no key needed by anyone)
generation, ``/v1/models``, ``/openapi.json``  yes         yes, in its own cache namespace
``GET /cache/stats``                           everything  its own use (L2 pages, quota, pins)
``POST /cache/flush``                          everything  its own namespaces' pages
``GET /cache/pinned``                          every pin   its own pins and budget
``PUT /cache/pinned``                          any         in its namespace, within its pin budget
                                               namespace
                                               (``tenant``)
``DELETE /cache/pinned/{name}``                any pin     its own pins
                                               (``?tenant``)
``GET /metrics``                               yes         no (403): every tenant's series
``/cache/storage`` (all methods), ``clear``    yes         no (403)
=============================================  ==========  ===========================================

In engine mode the cache is the engines', not a tenant's: tenants get 403 on every
``/cache`` route. A tenant's call reaches the scheduler with ``args["tenant"]`` set
(``scoped_args``), which is what confines it there (``hicache.scheduler.scheduler``,
``hicache.scheduler.pins``); ``PUT /cache/storage`` names a store of the operator's config
(``validation.parse_storage_choice``), never a URL, host, path or secret source.
"""

from __future__ import annotations

from typing import Any

from hicache.api_server.validation import RequestError

__all__ = ["FORBIDDEN", "OPEN_PATHS", "operator_only", "scoped_args"]

OPEN_PATHS = frozenset({"/health"})
"""Routes served without a key. ``/metrics`` is not one of them once a key is configured:
its per-tenant series and hit counters tell one tenant about another's prompts."""

FORBIDDEN = 403


def operator_only(tenant: str | None, what: str) -> None:
    """RequestError 403 unless the caller is the operator (``tenant`` None)."""
    if tenant is not None:
        raise RequestError(f"{what} is the operator's (server.operator): a tenant's key may not", FORBIDDEN,
                           "permission_error")


def scoped_args(tenant: str | None, engine_mode: bool, what: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``args`` for an admin op a tenant may call on its own namespaces: with ``"tenant"``
    set for a tenant (its own call), unchanged for the operator. 403 for a tenant in engine
    mode, where the cache is the engines'."""
    out = dict(args or {})
    if tenant is None:
        return out
    if engine_mode:
        raise RequestError(f"{what}: in engine mode the cache is the engines', administered by the operator "
                           "(server.operator)", FORBIDDEN, "permission_error")
    out["tenant"] = tenant
    return out
