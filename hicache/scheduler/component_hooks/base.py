"""The hooks one auxiliary tree component (SWA, Mamba, ...) gives the scheduler's phases.

A running request holds, besides its Full pages, whatever each auxiliary component needs
(SWA pages for its window, Mamba state slots). One ``ComponentHooks`` subclass per
component places, settles and hands that memory to the tree; ``AuxMemory`` calls every
component's hooks at these points (the defaults do nothing):

===================  =================  ==================================================
hook                 phase              what it does
===================  =================  ==================================================
``refusal``          submit             why a request can never be served, or None
``amount``           admission          the units the request reserves in the L1 budget
``admit``            admission          its memory at admission (a copy of the matched
                                        state, the matched pages); False: queue again
``unadmit``          admission undone   give back what ``admit`` took
``ensure_pages``     before a pass      pages up to the tokens the pass computes
``fill_item``        before a pass      its ``ForwardItem`` fields (page table, slots)
``forward_failed``   a pass failed      forget what the pass may have written
``insert_points``    after a pass       where the prompt's state goes to the tree now,
                                        or None: this component does not place inserts
``insert_part``      after a pass       its payload for an insert at a position, or None
``inserted``         after a pass       the tree took its payload: adopt the tree's view
``settle``           after a pass       free what fell out of use, re-size the reservation
``hand_over``        finishing          before ``cache_finished_req``: what the tree keeps
===================  =================  ==================================================

State: what a component keeps for a running request lives under its name in
``Request.aux`` (the scheduler's view) and ``RequestState.aux`` (the tree's view); only
that component's hooks read or write either entry. Everything runs on the scheduler's
process-loop thread, so nothing here is locked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from hicache.tree.components import TreeComponent
from hicache.tree.node import ComponentType

if TYPE_CHECKING:
    from hicache.model.runner import ForwardItem
    from hicache.scheduler.request import Request
    from hicache.scheduler.state import SchedulerState
    from hicache.tree.cache import MatchResult

def prompt_boundary(prompt_len: int, page_size: int) -> int:
    """A prompt's last page boundary before its last token (a repeat of the prompt matches there)."""
    return (prompt_len - 1) // page_size * page_size


InsertPoint = tuple[int, object | None]
"""A position (a page boundary) where the prompt's state goes to the tree, with the payload
of the component that placed it there (None: it adds none at that point)."""


class ComponentHooks:
    """One auxiliary component's per-request memory (the table above)."""

    kind: ClassVar[type[TreeComponent]]
    """The tree component class these hooks serve."""

    def __init__(self, state: SchedulerState, component: TreeComponent) -> None:
        if component.ctype is None:
            raise ValueError(f"the scheduler has no L1 budget kind for component {component.name!r}")
        self.s = state
        self.name = component.name
        self.ctype: ComponentType = component.ctype

    # ---------------------------------------------------------------- submit and admission
    def refusal(self, full_pages: int) -> str | None:
        """Why a request needing ``full_pages`` L1 pages can never be served, or None."""
        return None

    def amount(self, req: Request, need: int, prefix: int) -> int:
        """The L1 units ``req`` reserves, admitted with ``prefix`` cached tokens and
        ``need`` Full pages still to allocate."""
        return 0

    def admit(self, req: Request, m: MatchResult, prefix: int) -> bool:
        """Give the admitted ``req`` (its ``tree`` set, its reservation made) this
        component's memory. False when it cannot be had now (the caller undoes the
        admission and queues the request); an exception leaves the caller to undo."""
        return True

    def unadmit(self, req: Request) -> None:
        """Give back what ``admit`` took (also after a half-done ``admit``)."""

    # ---------------------------------------------------------------- forward pass
    def ensure_pages(self, req: Request, upto: int) -> bool:
        """Pages for ``req``'s first ``upto`` tokens, from its reservation; False if short."""
        return True

    def fill_item(self, req: Request, item: ForwardItem) -> ForwardItem:
        """``item`` (``req``'s share of the next pass) with this component's fields set."""
        return item

    def forward_failed(self, req: Request, item: ForwardItem) -> None:
        """The forward pass that computed ``item`` raised: what it may have written is unknown."""

    def insert_points(self, req: Request, item: ForwardItem, prefill: bool) -> list[InsertPoint] | None:
        """Where, after ``req`` computed ``item``, its prompt's state goes to the tree
        (ascending), or None when this component does not decide that."""
        return None

    def insert_part(self, req: Request, pos: int) -> object | None:
        """This component's payload for the insert of ``req``'s first ``pos`` tokens, or None."""
        return None

    def inserted(self, req: Request, pos: int) -> None:
        """The tree took this component's ``insert_part`` for ``req``'s first ``pos`` tokens."""

    def settle(self, req: Request) -> None:
        """After ``req`` computed more: free what it no longer reads, re-size its reservation."""

    # ---------------------------------------------------------------- finishing
    def hand_over(self, req: Request) -> None:
        """Before ``cache_finished_req``: set what the tree keeps of this component in
        ``req.tree.aux``; free the rest."""
