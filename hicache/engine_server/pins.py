"""Pinned prefixes in engine mode (``cache.pinned`` with ``engine.kind: vllm``).

The engines compute KV; this daemon cannot run a prefix itself. So a pin here is a prefix
whose pages, once in L2, are host-locked there until the daemon stops, and which comes
there from L3 when it can:

- Pages are per engine *namespace* (the runtime identity every salt carries: engines whose
  KV bytes could differ never share a page), so each namespace gets its own copy of every
  pin, started when the first engine of that namespace registers.
- Started, a pin is matched in L2; what is missing is prefetched from L3 (when L3 is on;
  by the rule every prefetch follows, ``cache.prefetch.threshold_tokens``); what L3 does not
  hold waits for an engine to save it: the first request that starts with the prefix.
- Each commit of a save in the pin's namespace and salt looks again; once every whole page
  of the prefix is in L2, each node of its path is host-locked (``protect_host``).

==========  ===============================================  ===============================
state       meaning                                          leaves it when
==========  ===============================================  ===============================
loading     a prefetch of its missing pages from L3 runs     the prefetch ends (-> pinned,
                                                             or waiting)
waiting     some of its pages are in no tier here            a commit completes it (-> pinned)
pinned      host-locked in L2                                never: until the daemon stops
==========  ===============================================  ===============================

Sizes: the pins together may hold at most ``cache.pinned_fraction`` of L2 *per namespace*
(checked at start, naming the pin that does not fit). Pins are given as token ids (the
daemon has no tokenizer of the engines' model), for models without window or state layers.
"""

from __future__ import annotations

import enum
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.tier_manager import PrefetchTicket, TierManager
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.node import KEY_TYPECODE, TreeNode

log = logging.getLogger("hicache.engine_server.pins")


class EnginePinState(enum.Enum):
    """A pin's state in one namespace (the table above); the value is its name in stats."""

    LOADING = "loading"
    WAITING = "waiting"
    PINNED = "pinned"


@dataclass(frozen=True)
class PinEntry:
    """One configured pin: its name, token ids and the engines' own ``cache_salt``."""

    name: str
    tokens: tuple[int, ...]
    cache_salt: str = ""


@dataclass
class EnginePin:
    """One pin in one namespace. ``salt``: the tree's (namespaced) salt."""

    entry: PinEntry
    namespace: str
    salt: str
    key: array[int]
    state: EnginePinState = EnginePinState.WAITING
    ticket: PrefetchTicket | None = None
    tried_l3: bool = False
    locks: list[tuple[TreeNode, int]] = field(default_factory=list)
    from_l3: int = 0
    """Pages its prefetch brought from L3."""


class EnginePins:
    """The pins of one cache server (see the module docstring)."""

    def __init__(self, cache: UnifiedRadixCache, tier: Callable[[], TierManager | None], entries: Sequence[PinEntry],
                 fraction: float, salt_of: Callable[[str, str], str]) -> None:
        """``tier()``: the server's tier manager now (None without one); ``salt_of(namespace,
        cache_salt)``: the tree salt of a session's salt. Raises ``ValueError`` naming the
        first pin past the share, or shorter than a page."""
        self.cache = cache
        self._tier = tier
        self.entries = list(entries)
        self.salt_of = salt_of
        ps = cache.page_size
        host = cache.full.host_allocator
        assert host is not None
        share = int(host.capacity * fraction)
        held = 0
        for e in self.entries:
            pages = len(e.tokens) // ps
            if pages == 0:
                raise ValueError(f"pinned prefix {e.name!r} has {len(e.tokens)} tokens, less than one page ({ps})")
            if held + pages > share:
                raise ValueError(f"pinned prefix {e.name!r} ({pages * ps} tokens) does not fit L2's share for pinned "
                                 f"prefixes: {share * ps} of {host.capacity * ps} tokens (cache.pinned_fraction "
                                 f"{fraction:g}), {held * ps} already pinned")
            held += pages
        self.pins: list[EnginePin] = []
        self._namespaces: set[str] = set()

    def on_namespace(self, namespace: str) -> None:
        """An engine of ``namespace`` registered: start its pins, once per namespace."""
        if namespace in self._namespaces:
            return
        self._namespaces.add(namespace)
        for e in self.entries:
            pin = EnginePin(e, namespace, self.salt_of(namespace, e.cache_salt), array(KEY_TYPECODE, e.tokens))
            self.pins.append(pin)
            self._advance(pin)

    def on_commit(self, salt: str) -> None:
        """A save landed in the tree under ``salt``: the waiting pins of it look again."""
        for pin in self.pins:
            if pin.state is EnginePinState.WAITING and pin.salt == salt:
                self._advance(pin)

    def poll(self) -> None:
        """Pins whose prefetch ended look again."""
        for pin in self.pins:
            if pin.state is EnginePinState.LOADING and pin.ticket is not None and pin.ticket.complete:
                pin.from_l3 = pin.ticket.arrived_tokens // self.cache.page_size
                tier = self._tier()
                if tier is not None:
                    tier.cancel_prefetch(pin.ticket)
                pin.ticket = None
                self._advance(pin)

    def _advance(self, pin: EnginePin) -> None:
        ps = self.cache.page_size
        want = len(pin.key) // ps * ps
        m = self.cache.match_prefix(pin.key, pin.salt, copy_on_match=False)
        if m.host_hit_length >= want:
            pin.locks = self.cache.tiers.protect_host_path(m.last_host_node)
            pin.state = EnginePinState.PINNED
            log.info("pinned prefix %s (namespace %s): %d tokens in L2, %d from L3", pin.entry.name, pin.namespace,
                     want, pin.from_l3 * ps)
            return
        tier = self._tier()
        if not pin.tried_l3 and tier is not None and tier.l3_enabled:
            pin.tried_l3 = True
            ticket = tier.start_prefetch(f"pin:{pin.entry.name}", pin.key, m, pin.salt)
            if ticket is not None:
                pin.ticket, pin.state = ticket, EnginePinState.LOADING
                return
        pin.state = EnginePinState.WAITING

    def listing(self) -> list[dict[str, Any]]:
        ps = self.cache.page_size
        return [{"name": p.entry.name, "namespace": p.namespace, "state": p.state.value,
                 "tokens": len(p.key) // ps * ps, "from_l3_tokens": p.from_l3 * ps} for p in self.pins]
