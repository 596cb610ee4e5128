"""Pinned prefixes in engine mode (``cache.pinned`` with ``engine.kind: vllm``).

The engines compute KV; this daemon cannot run a prefix itself. So a pin here is a prefix
whose pages, once in L2, are host-locked there while an engine of its namespace is
registered, and which comes there from L3 when it can:

- Pages are per engine *namespace* (the runtime identity every salt carries: engines whose
  KV bytes could differ never share a page), so each namespace gets its own copy of every
  pin, started when the first engine of that namespace registers.
- Started, a pin is matched in L2; what is missing is prefetched from L3 (when L3 is on;
  by the rule every prefetch follows, ``cache.prefetch.threshold_tokens``); what L3 does not
  hold waits for an engine to save it: the first request that starts with the prefix.
- Each commit of a save in the pin's namespace and salt looks again (only the waiting pins
  of that salt: a commit's cost does not grow with the namespaces); once every whole page of
  the prefix is in L2, each node of its path is host-locked (``protect_host``).
- When the last session of a namespace ends (expired: an engine that stopped, or one that
  moved to a new namespace by a cache reset), its pins end: their locks are released and
  their pages stay as ordinary cache, evictable as ``DELETE /cache/pinned`` leaves them;
  an engine of that namespace registering again starts them again.

==========  ===============================================  ===============================
state       meaning                                          leaves it when
==========  ===============================================  ===============================
no_room     its namespace waits for the share (below)        a namespace's pins end and the
                                                             share has room (-> loading,
                                                             waiting or pinned)
loading     a prefetch of its missing pages from L3 runs     the prefetch ends (-> pinned,
                                                             or waiting)
waiting     some of its pages are in no tier here            a commit completes it (-> pinned)
pinned      host-locked in L2                                its namespace's last session ends
==========  ===============================================  ===============================

Sizes: one namespace's pins together may hold at most ``cache.pinned_fraction`` of L2
(checked at start, naming the pin that does not fit), and so may the pins of every
namespace together: a namespace's pins start only when the whole set fits beside those of
the namespaces started before it (it is ``no_room`` until then, first come first served).
Pins are given as token ids (the daemon has no tokenizer of the engines' model), for models
without window or state layers.
"""

from __future__ import annotations

import enum
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.scheduler.controller_driver import ControllerDriver, PrefetchTicket
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.node import KEY_TYPECODE, TreeNode

log = logging.getLogger("hicache.cache_server.pins")


class EnginePinState(enum.Enum):
    """A pin's state in one namespace (the table above); the value is its name in stats."""

    NO_ROOM = "no_room"
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

    def __init__(self, cache: UnifiedRadixCache, tier: Callable[[], ControllerDriver | None], entries: Sequence[PinEntry],
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
        self.share = int(host.capacity * fraction)
        """L2 pages the pins of every namespace together may hold."""
        held = 0
        for e in self.entries:
            pages = len(e.tokens) // ps
            if pages == 0:
                raise ValueError(f"pinned prefix {e.name!r} has {len(e.tokens)} tokens, less than one page ({ps})")
            if held + pages > self.share:
                raise ValueError(f"pinned prefix {e.name!r} ({pages * ps} tokens) does not fit L2's share for pinned "
                                 f"prefixes: {self.share * ps} of {host.capacity * ps} tokens (cache.pinned_fraction "
                                 f"{fraction:g}), {held * ps} already pinned")
            held += pages
        self.namespace_pages = held
        """L2 pages one namespace's pins hold, all pinned."""
        self._started: dict[str, list[EnginePin]] = {}  # namespace -> its pins, in start order
        self._no_room: list[str] = []  # namespaces waiting for the share, first come first
        self._waiting: dict[str, list[EnginePin]] = {}  # tree salt -> its waiting pins (what a commit completes)
        self._loading: list[EnginePin] = []

    @property
    def pins(self) -> list[EnginePin]:
        """The pins of every started namespace."""
        return [pin for pins in self._started.values() for pin in pins]

    @property
    def held_pages(self) -> int:
        """L2 pages the started namespaces' pins may hold (their share, taken at their start)."""
        return len(self._started) * self.namespace_pages

    def on_namespace(self, namespace: str) -> None:
        """An engine of ``namespace`` registered: start its pins, once per namespace, when the
        share has room for them (else they wait for it: ``no_room``)."""
        if namespace in self._started or namespace in self._no_room:
            return
        if self.held_pages + self.namespace_pages > self.share:
            self._no_room.append(namespace)
            log.warning("pinned prefixes of namespace %s wait for room: the pins of %d other namespaces hold "
                        "cache.pinned_fraction of L2", namespace, len(self._started))
            return
        self._start(namespace)

    def _start(self, namespace: str) -> None:
        pins = self._started[namespace] = [
            EnginePin(e, namespace, self.salt_of(namespace, e.cache_salt), array(KEY_TYPECODE, e.tokens))
            for e in self.entries]
        for pin in pins:
            self._advance(pin)

    def keep_namespaces(self, live: set[str]) -> None:
        """The namespaces with an open session now: the pins of every other one end (locks
        released, prefetches cancelled; their pages stay as ordinary cache), and namespaces
        waiting for room start while the share has it."""
        self._no_room = [ns for ns in self._no_room if ns in live]
        for namespace in [ns for ns in self._started if ns not in live]:
            for pin in self._started.pop(namespace):
                self._end(pin)
            log.info("pinned prefixes of namespace %s unpinned: its last engine session ended", namespace)
        while self._no_room and self.held_pages + self.namespace_pages <= self.share:
            self._start(self._no_room.pop(0))

    def _end(self, pin: EnginePin) -> None:
        for node, npages in pin.locks:
            self.cache.host.release_host(node, npages)
        pin.locks = []
        self._drop_ticket(pin)
        self._leave(pin)

    def _drop_ticket(self, pin: EnginePin) -> None:
        """Stop waiting for ``pin``'s prefetch (one in flight still lands in L2)."""
        if pin.ticket is not None:
            tier = self._tier()
            if tier is not None:
                tier.cancel_prefetch(pin.ticket)
            pin.ticket = None

    def _leave(self, pin: EnginePin) -> None:
        """Take ``pin`` out of the index of its state (waiting by salt, or loading)."""
        if pin.state is EnginePinState.WAITING:
            waiting = self._waiting.get(pin.salt, [])
            if pin in waiting:
                waiting.remove(pin)
            if not waiting:
                self._waiting.pop(pin.salt, None)
        elif pin.state is EnginePinState.LOADING and pin in self._loading:
            self._loading.remove(pin)

    def _enter(self, pin: EnginePin, state: EnginePinState) -> None:
        """Move ``pin`` to ``state`` (and into that state's index)."""
        self._leave(pin)
        pin.state = state
        if state is EnginePinState.WAITING:
            self._waiting.setdefault(pin.salt, []).append(pin)
        elif state is EnginePinState.LOADING:
            self._loading.append(pin)

    def on_commit(self, salt: str) -> None:
        """A save landed in the tree under ``salt``: the waiting pins of it look again."""
        for pin in list(self._waiting.get(salt, ())):
            self._advance(pin)

    def poll(self) -> None:
        """Pins whose prefetch ended look again."""
        for pin in list(self._loading):
            if pin.ticket is not None and pin.ticket.complete:
                pin.from_l3 = pin.ticket.arrived_tokens // self.cache.page_size
                self._drop_ticket(pin)
                self._advance(pin)

    def _advance(self, pin: EnginePin) -> None:
        ps = self.cache.page_size
        want = len(pin.key) // ps * ps
        m = self.cache.match_prefix(pin.key, pin.salt, copy_on_match=False)
        if m.host_hit_length >= want:
            pin.locks = self.cache.host.protect_host_path(m.last_host_node)
            self._enter(pin, EnginePinState.PINNED)
            log.info("pinned prefix %s (namespace %s): %d tokens in L2, %d from L3", pin.entry.name, pin.namespace,
                     want, pin.from_l3 * ps)
            return
        tier = self._tier()
        if not pin.tried_l3 and tier is not None and tier.l3_enabled:
            pin.tried_l3 = True
            ticket = tier.start_prefetch(f"pin:{pin.entry.name}", pin.key, m, pin.salt)
            if ticket is not None:
                pin.ticket = ticket
                self._enter(pin, EnginePinState.LOADING)
                return
        self._enter(pin, EnginePinState.WAITING)

    def listing(self) -> list[dict[str, Any]]:
        ps = self.cache.page_size
        out = [{"name": p.entry.name, "namespace": p.namespace, "state": p.state.value,
                "tokens": len(p.key) // ps * ps, "from_l3_tokens": p.from_l3 * ps} for p in self.pins]
        out += [{"name": e.name, "namespace": ns, "state": EnginePinState.NO_ROOM.value,
                 "tokens": len(e.tokens) // ps * ps, "from_l3_tokens": 0} for ns in self._no_room for e in self.entries]
        return out
