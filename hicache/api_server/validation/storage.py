"""``PUT /cache/storage``: the body names a store of the config, never a backend, URL, path
or secret source (docs/operations.md "Security"). See docs/architecture.md §11.
"""

from __future__ import annotations

from typing import Any

from hicache.api_server.validation.common import RequestError
from hicache.config import DEFAULT_STORE, HicacheConfig, to_dict

STORAGE_FIELDS = ("store",)


def parse_storage_choice(data: dict[str, Any], config: HicacheConfig) -> dict[str, Any]:
    """``PUT /cache/storage``'s body ``{"store": NAME}`` -> the ``storage_attach`` op's args
    ``{"l3": <that store's resolved cache.l3 section>}``.

    ``NAME`` is one the operator's config names: ``default`` (``cache.l3`` itself, when it
    names a store) or a key of ``cache.l3_stores``, checked with the rest of the config at
    start (its keys, files, and the tenants' L3 quotas). A body naming anything else (a
    backend, a URL, a directory, a password source) is refused: what the daemon reaches and
    which secrets it sends are the config's alone (docs/operations.md "Security"). The scheduler can
    rebuild the ``L3Config`` with ``config_from_dict({"cache": {"l3": args["l3"]}})``."""
    stores = attachable_stores(config)
    named = ", ".join(stores) or "none: cache.l3_stores is empty"
    unknown = sorted(set(data) - set(STORAGE_FIELDS))
    if unknown:
        raise RequestError(f"PUT /cache/storage takes {{\"store\": NAME}}, a store the config names "
                           f"({named}); got {', '.join(unknown)}", param=unknown[0])
    if not config.cache.l2.enabled:
        raise RequestError("an L3 backend needs cache.l2.enabled: true, and this daemon runs without L2", 409)
    name = data.get("store")
    if not isinstance(name, str) or name not in stores:
        raise RequestError(f"store must name a store of the config ({named}), got {name!r}", param="store")
    return {"l3": to_dict(stores[name])}


def attachable_stores(config: HicacheConfig) -> dict[str, Any]:
    """The stores ``PUT /cache/storage`` may attach, by name (``parse_storage_choice``)."""
    stores: dict[str, Any] = {}
    if config.cache.l3.backend != "none":
        stores[DEFAULT_STORE] = config.cache.l3
    stores.update(config.cache.l3_stores)
    return stores
