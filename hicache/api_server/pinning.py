"""Pinned prefixes from the tokenizer's side: ``cache.pinned`` at start, ``/cache/pinned`` at run time.

The scheduler keeps the pins (``hicache.scheduler.pins``: what a pin holds, its states, the
size share). This module turns what an operator writes (text, or token ids; a cache salt; a
tenant) into the scheduler's ``pin`` admin op, and pins the configured set before the HTTP
port opens, so that the first request after a start (or a restart) already finds them.

A text is tokenized as a completion prompt is (``encode_prompt``: no chat template), and
namespaced as a request of its tenant is (``tenant_salt``). To pin a chat system prompt,
pin the rendered template's prefix, or its token ids.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache.api_server.scheduler_link import SchedulerLink
from hicache.api_server.validation import RequestError, check_token_ids, encode_prompt
from hicache.config import HicacheConfig, PinnedPrefixConfig
from hicache.tenants import tenant_salt
from hicache.text import Tokenizer

log = logging.getLogger("hicache.api_server.pinning")

PIN_TIMEOUT_S = 600.0
"""How long one ``PUT /cache/pinned`` may take: its prefix may have to be computed."""
CONFIGURED_PINS_TIMEOUT_S = 150.0
"""How long the whole ``cache.pinned`` set may take at start: within the launcher's wait for
the tokenizer's ``Ready`` (``hicache.daemon.launcher.START_TIMEOUT_S``, 180 s), which comes after it."""
PIN_FIELDS = ("name", "text", "input_ids", "cache_salt", "tiers", "tenant")


class PinStartError(RuntimeError):
    """A configured pin that could not be taken (the message names it)."""


def pin_args(name: str, ids: list[int], salt: str, tiers: list[str] | None) -> dict[str, Any]:
    """The ``pin`` admin op's arguments (``tiers`` None: every tier that is on)."""
    return {"name": name, "input_ids": ids, "cache_salt": salt, "tiers": tiers}


def configured_args(p: PinnedPrefixConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    ids = encode_prompt(tokenizer, p.text) if p.text is not None else list(p.token_ids or ())
    return pin_args(p.name, ids, tenant_salt(p.tenant, p.cache_salt), None if p.tiers is None else list(p.tiers))


def body_args(body: Any, tokenizer: Tokenizer, vocab_size: int, tenant: str | None,
              tenants: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``PUT /cache/pinned``'s body as the ``pin`` op's arguments; ``RequestError`` (400)
    naming the first bad field. The scheduler checks the rest (name, ids, tiers, size).
    ``input_ids`` follow ``/generate``'s rule (``validation.check_token_ids``: the served
    model's ``vocab_size``, which the OpenAPI document states for both).

    ``tenant``: the caller's (None: the operator). A tenant pins in its own namespace, as
    its own call (``args["tenant"]``: within its pin budget; a ``tenant`` field naming
    another is 403). The operator may name any of ``tenants`` in ``tenant``: the pin is
    then in that tenant's namespace, not refused by its budget."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - set(PIN_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; expected {', '.join(PIN_FIELDS)}", param=unknown[0])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of text and input_ids", param="text")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise RequestError("text must be a non-empty string", param="text")
        ids = encode_prompt(tokenizer, text)
    elif not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise RequestError(f"input_ids must be a non-empty list of token ids in [0, {vocab_size})",
                           param="input_ids")
    else:
        check_token_ids(ids, vocab_size)
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str):
        raise RequestError("cache_salt must be a string", param="cache_salt")
    tiers = body.get("tiers")
    owner = body.get("tenant", tenant)
    if tenant is not None and owner != tenant:
        raise RequestError("a tenant pins in its own namespace only", 403, "permission_error", "tenant")
    if tenant is None and owner is not None and owner not in tenants:
        raise RequestError("tenant must name a tenant of server.api_keys", param="tenant")
    args = pin_args(body.get("name"), ids, tenant_salt(owner, salt), tiers)  # type: ignore[arg-type]
    if tenant is not None:
        args["tenant"] = tenant
    return args


async def pin_configured(link: SchedulerLink, tokenizer: Tokenizer, cfg: HicacheConfig,
                         timeout_s: float = CONFIGURED_PINS_TIMEOUT_S) -> None:
    """Pin every ``cache.pinned`` entry, in order, each answered before the next is sent,
    all within ``timeout_s``. ``PinStartError`` naming the first that fails (too large for
    its share, too long for the model, not pinned in time)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(cfg.cache.pinned):
        where = f"cache.pinned[{i}] ({p.name})"
        try:
            args = configured_args(p, tokenizer)
            reply = await link.admin("pin", args, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise PinStartError(f"{where}: the pinned set was not pinned within {timeout_s:g} s") from None
        except Exception as exc:
            raise PinStartError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if not reply.ok:
            raise PinStartError(f"{where}: {reply.error}")
        loaded = reply.result.get("loaded") or {}
        log.info("pinned %s: %d tokens in %s (from L1 %d, L2 %d, L3 %d; the rest computed)", p.name,
                 reply.result.get("tokens", 0), "+".join(reply.result.get("tiers", [])), loaded.get("device", 0), loaded.get("host", 0),
                 loaded.get("storage", 0))
