"""Mamba state slots of running requests: the ``ComponentHooks`` of ``MambaComponent``.

A running request's state slots are its ``Request.aux["mamba"]`` (a ``MambaSlots``), the one
object that assigns and frees them: its own slot (``own``, which admission also sets as
``tree.aux["mamba"]``, the tree's view), the branch snapshots (``taken``: the states after
the ``branch_positions`` its prefill passes: the prompt boundary, the fork from a cached
path, every ``cache.mamba_branch_interval`` tokens; each handed to the tree as soon as the
prefill passes it) and the boundary snapshot (``boundary``: the state after ``boundary_pos`` tokens, the latest page
boundary its forward passes crossed; handed to the tree at finish when it is the last full
page). Which call moves a slot where:

==================  ==========================================  ==========================
call                takes                                       gives away / frees
==================  ==========================================  ==========================
``take_own``        the own slot (admission)                    --
``snapshots``       branch / boundary slots (when needed)       --
``pop_branches``    --                                          the branch slots passed, to
                                                                the caller (``cache_unfinished_req``)
``hand_over``       --                                          the boundary slot to the
                                                                caller when it is the last
                                                                full page; frees the rest
``free_all``        --                                          frees every slot
==================  ==========================================  ==========================

At admission the own slot gets a copy of the matched state; the tree's
``RequestState.aux["mamba"]`` is set from it then and at the hand-over before
``cache_finished_req``. A snapshot that finds no slot is skipped (its state is just not
cached), never an error. Mamba places the prompt-state inserts (``insert_points``): at each
branch snapshot the prefill passed, with that snapshot's slot as the payload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hicache.config import STATE_SLOTS_PER_REQUEST
from hicache.memory.allocator import PageAllocator
from hicache.scheduler.component_hooks.base import ComponentHooks, InsertPoint, prompt_boundary
from hicache.tree.components import MambaComponent

if TYPE_CHECKING:
    from hicache.model.runner import ForwardItem
    from hicache.scheduler.request import Request
    from hicache.scheduler.state import SchedulerState
    from hicache.tree.cache import MatchResult


@dataclass(eq=False)
class MambaSlots:
    """A running request's Mamba state slots: the only code that assigns or frees them.

    ``take`` gets one slot (from the request's L1 reservation while it lasts:
    ``L1Budget.take``), or None when none can be had; ``allocator`` is the L1 state-slot
    allocator they go back to.

    ``branch_positions``: the page boundaries past the matched prefix whose state the
    prefill inserts into the tree as soon as it has passed them (ascending; see
    ``branch_points``): the prompt's last page boundary before its last token (a repeat of
    the prompt matches there), the point where the prompt forks from a cached path (a
    sibling sharing that prefix matches there), and every ``interval`` tokens (prefixes
    shared by requests not seen yet). ``taken``: the snapshots of those positions that
    forward passes were given and the tree has not taken yet.
    ``boundary_pos``: the position ``boundary`` holds the state after; -1 once a failed
    forward pass may have written it (it is then never handed over).
    """

    allocator: PageAllocator
    take: Callable[[], int | None]
    page_size: int
    branch_positions: list[int] = field(default_factory=list)
    own: int | None = None
    taken: list[tuple[int, int]] = field(default_factory=list)
    boundary: int | None = None
    boundary_pos: int = 0

    @classmethod
    def branch_points(cls, prompt_len: int, prefix: int, page_size: int, fork: int = 0,
                      interval: int = 0) -> list[int]:
        """The positions whose state a request admitted with ``prefix`` cached tokens
        inserts while it prefills (ascending, each a page boundary in ``(prefix, prompt
        boundary]``): the prompt boundary, ``fork`` (where its prompt leaves the cached
        path: 0 for none) and the multiples of ``interval`` (0: none)."""
        end = prompt_boundary(prompt_len, page_size)
        out = {end, fork}
        if interval > 0:
            out.update(range(interval, end, interval))
        return sorted(p for p in out if prefix < p <= end and p % page_size == 0)

    @classmethod
    def needed(cls, prompt_len: int, prefix: int, page_size: int) -> int:
        """Slots a request admitted with ``prefix`` cached tokens reserves: its own, one
        for the branch-point snapshots (unless the prefix already reaches the prompt
        boundary; further ones are taken only when free, never reserved) and a boundary one."""
        return STATE_SLOTS_PER_REQUEST - (1 if prompt_boundary(prompt_len, page_size) <= prefix else 0)

    @classmethod
    def for_admission(cls, allocator: PageAllocator, take: Callable[[], int | None], page_size: int,
                      prompt_len: int, prefix: int, *, fork: int = 0, interval: int = 0) -> MambaSlots:
        return cls(allocator, take, page_size,
                   branch_positions=cls.branch_points(prompt_len, prefix, page_size, fork, interval))

    def take_own(self) -> int | None:
        """The request's own state slot (once, at admission); None when none can be had."""
        if self.own is not None:
            raise RuntimeError("the request already has its own state slot")
        self.own = self.take()
        return self.own

    def snapshots(self, start: int, end: int) -> list[tuple[int, int]]:
        """``(position, slot)`` snapshots for computing ``[start, end)``: every branch
        position in ``(start, end]`` and the last page boundary in ``(start, end]``. A
        snapshot no slot can be had for is skipped: that state is then not cached, never
        an error."""
        out: list[tuple[int, int]] = []
        while self.branch_positions and self.branch_positions[0] <= start:
            self.branch_positions.pop(0)  # passed without a snapshot (none could be had)
        for pos in [p for p in self.branch_positions if start < p <= end]:
            self.branch_positions.remove(pos)
            slot = self.take()
            if slot is not None:
                self.taken.append((pos, slot))
                out.append((pos, slot))
        b = end // self.page_size * self.page_size
        if b > start:
            if self.boundary is None:
                self.boundary = self.take()
            if self.boundary is not None:
                out.append((b, self.boundary))
        return out

    def computed(self, snapshots: list[tuple[int, int]]) -> None:
        """The forward pass that was given ``snapshots`` ran: record what they hold."""
        for pos, slot in snapshots:
            if slot == self.boundary:
                self.boundary_pos = pos

    def forward_failed(self) -> None:
        """A forward pass with snapshots failed: the boundary slot's content is unknown."""
        self.boundary_pos = -1

    def pop_branches(self, computed: int) -> list[tuple[int, int]]:
        """``(position, slot)`` of the branch snapshots ``computed`` tokens have passed,
        ascending; the slots are the caller's from then on (``cache_unfinished_req(aux=
        {"mamba": slot})``)."""
        done = [t for t in self.taken if t[0] <= computed]
        self.taken = [t for t in self.taken if t[0] > computed]
        return done

    def hand_over(self, computed: int) -> int | None:
        """At finish, before ``cache_finished_req``: the boundary slot when it holds the
        state after the last full page of the ``computed`` tokens (the caller's from then
        on), else None; every other slot, the own one included, is freed here."""
        aligned = computed // self.page_size * self.page_size
        keep = None
        spare = [s for s in (self.own, *(slot for _pos, slot in self.taken)) if s is not None]
        if self.boundary is not None:
            if aligned > 0 and self.boundary_pos == aligned:
                keep = self.boundary
            else:
                spare.append(self.boundary)
        self._clear()
        if spare:
            self.allocator.free(spare)
        return keep

    def free_all(self) -> None:
        """Free every slot held (an admission undone)."""
        spare = [s for s in (self.own, self.boundary, *(slot for _pos, slot in self.taken)) if s is not None]
        self._clear()
        if spare:
            self.allocator.free(spare)

    def _clear(self) -> None:
        self.own = self.boundary = None
        self.taken = []
        self.branch_positions = []
        self.boundary_pos = 0


class MambaHooks(ComponentHooks):
    """Mamba state slots of the running requests (the module docstring)."""

    kind = MambaComponent

    def __init__(self, state: SchedulerState, component: MambaComponent) -> None:
        super().__init__(state, component)
        self.mamba = component

    def slots(self, req: Request) -> MambaSlots | None:
        """``req``'s state slots, None when it holds none."""
        slots = req.aux.get(self.name)
        return slots if isinstance(slots, MambaSlots) else None

    # ---------------------------------------------------------------- submit and admission
    def refusal(self, full_pages: int) -> str | None:
        capacity = self.mamba.allocator.capacity
        if capacity <= STATE_SLOTS_PER_REQUEST:
            return (f"a request needs {STATE_SLOTS_PER_REQUEST} L1 state slots besides the state it matches; "
                    f"L1 holds {capacity}")
        return None

    def amount(self, req: Request, need: int, prefix: int) -> int:
        """Its own state, the prompt snapshot (if still to take), a boundary one."""
        return MambaSlots.needed(req.prompt_len, prefix, self.s.page_size)

    def admit(self, req: Request, m: MatchResult, prefix: int) -> bool:
        """The own slot, holding a copy of the matched state; False when the slot,
        counted free or evictable, cannot be had now."""
        st = req.tree
        assert st is not None
        slots = req.aux[self.name] = MambaSlots.for_admission(
            self.mamba.allocator, lambda: self.take_slot(req), self.s.page_size, req.prompt_len, prefix,
            fork=m.walked_len, interval=self.s.cfg.cache.mamba_branch_interval)
        slot = slots.take_own()
        if slot is None:
            return False
        st.aux[self.name] = slot  # the tree's view of it (undoing the admission frees it should the copy fail)
        if prefix > 0:
            src = self.s.cache.data(m.last_device_node, self.ctype).value
            if src is None:
                raise RuntimeError("the matched node has no Mamba state")
            self.mamba.copy_state(src, slot)  # type: ignore[misc]
        return True

    def unadmit(self, req: Request) -> None:
        """Free ``req``'s slots; the tree's view of its own slot goes too."""
        slots = req.aux.pop(self.name, None)
        if isinstance(slots, MambaSlots):
            slots.free_all()
        if req.tree is not None:
            req.tree.aux.pop(self.name, None)

    def take_slot(self, req: Request) -> int | None:
        """One L1 Mamba state slot for ``req`` (evicting a cached state if needed), taken
        from its reservation; past it (further branch snapshots) only out of the room no
        request has reserved. None when none can be had. Only ``MambaSlots`` calls it."""
        budget = self.s.budget
        if budget.held(req.rid, self.ctype) == 0 and budget.room(self.ctype) <= 0:
            return None
        got = budget.take(req.rid, self.ctype, 1)
        return got[0] if got is not None else None

    # ---------------------------------------------------------------- forward pass
    def fill_item(self, req: Request, item: ForwardItem) -> ForwardItem:
        """Its own slot and the snapshots for the item's tokens (a snapshot no slot can be
        had for, reserved but with the evictable state busy, is skipped)."""
        slots = self.slots(req)
        if slots is None:
            return item
        return replace(item, state_slot=slots.own, snapshots=slots.snapshots(item.start, item.end))

    def forward_failed(self, req: Request, item: ForwardItem) -> None:
        """The failed pass may have written the snapshot slots: never hand one over."""
        slots = self.slots(req)
        if item.snapshots and slots is not None:
            slots.forward_failed()

    def insert_points(self, req: Request, item: ForwardItem, prefill: bool) -> list[InsertPoint] | None:
        """The branch snapshots ``req`` passed, each with its slot (the tree's from then on)."""
        slots = self.slots(req)
        if slots is None:
            return None
        slots.computed(list(item.snapshots))
        return [(pos, slot) for pos, slot in slots.pop_branches(req.computed)]

    # ---------------------------------------------------------------- finishing
    def hand_over(self, req: Request) -> None:
        """The tree's ``aux["mamba"]`` becomes the boundary snapshot when that holds the
        state after the last full page of the computed tokens (the key the tree inserts),
        else None; every other slot, the own one included, is freed."""
        st = req.tree
        if st is None:
            return
        slots = req.aux.pop(self.name, None)
        slot = slots.hand_over(req.computed) if isinstance(slots, MambaSlots) else None
        if slot is None:
            st.aux.pop(self.name, None)
        else:
            st.aux[self.name] = slot
