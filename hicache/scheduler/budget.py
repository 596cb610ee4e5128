"""The scheduler's L1 budget: what running requests may still allocate, per component.

A request is admitted only when L1 can promise it every unit it may still need: Full KV
pages for its prompt and whole decode budget; for a sliding-window model the SWA pages it
can hold at once (``hicache.config.swa_request_pages``: its windows and one prefill chunk,
as it frees the pages that fall out of the window), re-sized as it goes (``resize``); and up to ``STATE_SLOTS_PER_REQUEST`` state slots for a Mamba model. The promise is a
*reservation*: nothing is allocated at admission; the request allocates as its forward
passes need pages, and each allocation is taken from its reservation. ``L1Budget`` is the
one place that holds and changes reservation numbers.

Units are the allocator's: pages for FULL and SWA, state slots for MAMBA.

``room(kind)`` is what a new reservation may use::

    free + evictable - reserved

The tree's ``evictable`` is exactly what its eviction can free: data that in-flight
transfers hold (a load-back's new L1 pages and states, a write's source) is locked, so it
is not counted.

The promise to running requests is ``room >= 0`` for every kind: then whatever a request
still has reserved, its allocation can be had by evicting. Only two things lower room:
a reservation (checked by ``can_reserve``) and anything else that allocates L1 units or
makes evictable data unevictable, for someone who is not a running request. Each of those
asks ``fits`` first, with its exact cost, and waits (or does without) when it does not fit:

==============================  ============================================  ==========================
holder                          what it takes out of room                     checked by
==============================  ============================================  ==========================
a running request (admission)   its lock on the match (taken before the       ``can_reserve`` after
                                check), then its reservation                  the lock
a load-back in flight           the fresh units it copies into, and the L1    ``fits(load_back_cost)``
                                prefix its path lock protects                 at admission
the loaded prefix held until    its lock (``lock_if_room``); without room     ``lock_if_room``
admission (``Request.hold``)    the request re-matches at admission
an L2 write in flight           its node's path lock until the copy lands     ``fits(write_cost)``
                                (under write_back a write that does not fit   (``ControllerDriver.
                                is given up: its data may then be dropped)    write_gate``)
a pinned prefix (``l1``, or     its lock; the pin waits until it fits         ``lock_if_room``
the hold while it is written)
==============================  ============================================  ==========================

A lock shared with a running request costs nothing (that data is protected already), and
a holder that lets go only gives room back, so these checks keep ``room >= 0`` whenever it
was. ``fits`` compares against ``max(room, 0)``: nothing that costs units is let in while
room is short.

Contract (``holder`` is a request id; ``amounts`` maps a ``ComponentType`` to a count):

==============================  =======================================================
call                            changes
==============================  =======================================================
``room(kind)``                  nothing
``fits(cost)``                  nothing; True when each unit cost is at most ``max(room, 0)``
``lock_if_room(node)``          the tree's lock on ``node``, only when its cost ``fits``
``can_reserve(amounts)``        nothing; True when every amount fits ``room``
``reserve(holder, amounts)``    the holder's record and the totals, by ``amounts``
                                (refused, nothing changed, when it does not fit or the
                                holder already holds a reservation)
``take(holder, kind, n)``       allocates ``n`` units (evicting from the cache when short)
                                and lowers the holder's reservation by at most ``n``;
                                ``None`` and nothing changed when L1 cannot give them
``resize(holder, kind, n)``     the holder's reservation of ``kind`` set to ``n``: lowered
                                at will; raised by at most ``room(kind)`` (for units the
                                holder has just freed, so no other promise is broken)
``release(holder)``             drops the holder's record and its share of the totals
                                (finish, abort, a failed or undone admission)
``check()``                     nothing; raises ``BudgetError`` unless every total equals
                                the sum over holders and no number is negative
``check_idle()``                as ``check``, and also raises while anything is reserved
==============================  =======================================================

Every change of a number goes through ``_change``. The scheduler runs ``check_idle``
with the tree's integrity check whenever it is idle (``Scheduler.check_idle``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from hicache.memory.allocator import PageAllocator, PageIndices
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.node import ComponentType, LockToken, TreeNode

Amounts = Mapping[ComponentType, int]
"""Units per component kind (pages for FULL and SWA, state slots for MAMBA)."""



class BudgetError(RuntimeError):
    """The reservation numbers are inconsistent, or a reservation was refused."""


@dataclass
class _Kind:
    """One component's L1: its allocator, the cache's unit size and the running total."""

    kind: ComponentType
    allocator: PageAllocator
    unit_tokens: int
    """Tokens per unit in the cache's size counters (page size when paged, else 1)."""
    reserved: int = 0


@dataclass
class Reservation:
    """One holder's outstanding reservation, per kind (owned by the budget)."""

    holder: str
    units: dict[ComponentType, int] = field(default_factory=dict)

    def get(self, kind: ComponentType) -> int:
        return self.units.get(kind, 0)


@dataclass(eq=False)
class L1Budget:
    """The L1 reservations of running requests over the components of ``cache``."""

    cache: UnifiedRadixCache
    _kinds: dict[ComponentType, _Kind] = field(init=False, repr=False)
    _holders: dict[str, Reservation] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        ps = self.cache.page_size
        self._kinds = {c.ctype: _Kind(c.ctype, c.allocator, c.unit_tokens(ps))
                       for c in self.cache.components if c.ctype is not None}
        if len(self._kinds) != len(self.cache.components):
            raise ValueError("the L1 budget serves caches of the known component kinds only")

    # ------------------------------------------------------------------ reading
    @property
    def kinds(self) -> tuple[ComponentType, ...]:
        """The component kinds the cache has (FULL first)."""
        return tuple(self._kinds)

    def reserved(self, kind: ComponentType) -> int:
        """Units of ``kind`` reserved by all holders together (0 for a kind the cache lacks)."""
        k = self._kinds.get(kind)
        return k.reserved if k is not None else 0

    def held(self, holder: str, kind: ComponentType) -> int:
        """Units of ``kind`` ``holder`` still has reserved (0 when it holds nothing)."""
        r = self._holders.get(holder)
        return r.get(kind) if r is not None else 0

    def holders(self) -> Iterator[str]:
        return iter(self._holders)

    def room(self, kind: ComponentType) -> int:
        """Units of ``kind`` a new reservation may use: free + evictable - reserved."""
        k = self._kind(kind)
        return k.allocator.free_count + self.cache.evictable_size(kind) // k.unit_tokens - k.reserved

    def fits(self, cost: Mapping[str, int]) -> bool:
        """Whether taking ``cost`` (units per component name, as the tree's ``lock_cost``,
        ``load_back_cost`` and ``write_cost`` give them) out of room keeps every promise:
        each at most ``max(room, 0)``. Changes nothing."""
        for name, n in cost.items():
            if n > 0 and n > max(self.room(ComponentType[name.upper()]), 0):
                return False
        return True

    def lock_if_room(self, node: TreeNode) -> LockToken | None:
        """``cache.inc_lock_ref(node)`` for a holder that is not a running request, when what
        it makes unevictable ``fits``; else None, and nothing is locked."""
        if not self.fits(self.cache.lock_cost(node)):
            return None
        return self.cache.inc_lock_ref(node)

    def can_reserve(self, amounts: Amounts) -> bool:
        """Whether ``reserve`` of ``amounts`` would be accepted now; changes nothing."""
        for kind, n in amounts.items():
            if n < 0:
                raise ValueError(f"a reservation of {n} {kind.wire_name} units")
            if n and (kind not in self._kinds or n > self.room(kind)):
                return False
        return True

    # ------------------------------------------------------------------ changing
    def reserve(self, holder: str, amounts: Amounts) -> None:
        """Reserve ``amounts`` for ``holder`` (admission). Raises ``BudgetError``, changing
        nothing, when ``holder`` already holds a reservation or the amounts do not fit."""
        if holder in self._holders:
            raise BudgetError(f"{holder!r} already holds a reservation")
        if not self.can_reserve(amounts):
            wanted = ", ".join(f"{k.wire_name} {n} (room {self.room(k) if k in self._kinds else 0})"
                               for k, n in amounts.items())
            raise BudgetError(f"{holder!r}: the reservation does not fit: {wanted}")
        self._holders[holder] = Reservation(holder)
        for kind, n in amounts.items():
            if n:
                self._change(holder, kind, n)

    def take(self, holder: str, kind: ComponentType, n: int) -> PageIndices | None:
        """Allocate ``n`` units of ``kind`` for ``holder``, evicting unlocked cached data
        when the allocator is short, and lower its reservation by what this covers (at
        most what is left of it). None, with the reservation unchanged, when L1 cannot
        give ``n`` units now."""
        if holder not in self._holders:
            raise BudgetError(f"{holder!r} holds no reservation")
        k = self._kind(kind)
        if n <= 0:
            return k.allocator.empty()
        got = k.allocator.alloc(n)
        if got is None:
            short = n - k.allocator.free_count
            self.cache.evict_units({kind.wire_name: short * k.unit_tokens})
            got = k.allocator.alloc(n)
        if got is None:
            return None
        covered = min(n, self._holders[holder].get(kind))
        if covered:
            self._change(holder, kind, -covered)
        return got

    def resize(self, holder: str, kind: ComponentType, units: int) -> int:
        """Set ``holder``'s reservation of ``kind`` to ``units`` (e.g. after it freed pages,
        or when it needs fewer from now on). Lowering always succeeds; a raise is capped at
        ``room(kind)``, so it never takes what another reservation was promised. Returns the
        reservation now held."""
        if holder not in self._holders:
            raise BudgetError(f"{holder!r} holds no reservation")
        if units < 0:
            raise ValueError(f"a reservation of {units} {kind.wire_name} units")
        held = self._holders[holder].get(kind)
        delta = units - held
        if delta > 0:
            delta = min(delta, max(0, self.room(kind)))
        if delta:
            self._change(holder, kind, delta)
        return held + delta

    def release(self, holder: str) -> None:
        """Give back everything ``holder`` has reserved; nothing when it holds nothing."""
        r = self._holders.get(holder)
        if r is None:
            return
        for kind, n in list(r.units.items()):
            if n:
                self._change(holder, kind, -n)
        del self._holders[holder]

    def _change(self, holder: str, kind: ComponentType, delta: int) -> None:
        """The one place reservation numbers change: ``holder``'s and the total, together."""
        r = self._holders[holder]
        k = self._kind(kind)
        left = r.get(kind) + delta
        if left < 0 or k.reserved + delta < 0:
            raise BudgetError(f"{holder!r}: {kind.wire_name} reservation would go negative")
        r.units[kind] = left
        k.reserved += delta

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise ``BudgetError`` unless each kind's total equals the sum over holders and no
        number is negative."""
        for kind, k in self._kinds.items():
            total = 0
            for r in self._holders.values():
                n = r.get(kind)
                if n < 0:
                    raise BudgetError(f"{r.holder!r} has {n} {kind.wire_name} units reserved")
                total += n
            if total != k.reserved:
                raise BudgetError(f"{kind.wire_name}: {k.reserved} units reserved in total, "
                                  f"{total} over the {len(self._holders)} holders")
        for r in self._holders.values():
            stray = [kind for kind in r.units if kind not in self._kinds]
            if stray:
                raise BudgetError(f"{r.holder!r} holds units of a kind the cache lacks: {stray}")

    def check_idle(self) -> None:
        """``check``, and nothing may be reserved: for when no request runs."""
        self.check()
        if self._holders:
            raise BudgetError(f"nothing runs, yet {len(self._holders)} holders keep reservations: "
                              f"{sorted(self._holders)[:5]}")

    def _kind(self, kind: ComponentType) -> _Kind:
        k = self._kinds.get(kind)
        if k is None:
            raise KeyError(f"the cache has no {kind.wire_name} component")
        return k
