"""The scheduler's one entry to the auxiliary components' memory (SWA windows, Mamba slots).

Admission (``hicache.scheduler.admission``), the forward pass
(``hicache.scheduler.forward_pass``), finishing and submit call ``AuxMemory`` at fixed
points; it calls each auxiliary component's hooks in turn
(``hicache.scheduler.component_hooks``: the table of hooks is in ``base``). For a model
without auxiliary components every call is a no-op.

The one rule it adds is where the prompt's state goes to the tree while a request
prefills (``advance``): at the positions the first component in ``HOOK_CLASSES`` order
places (Mamba: each branch snapshot its prefill passed), else none. Every component adds
its payload to each such insert (SWA: the window of pages before it), and a position no
component adds a payload to inserts nothing.
"""

from __future__ import annotations

from hicache.model.runner import ForwardItem
from hicache.scheduler.component_hooks.base import ComponentHooks
from hicache.scheduler.component_hooks.mamba import MambaHooks
from hicache.scheduler.component_hooks.swa import SwaHooks
from hicache.scheduler.request import Request
from hicache.scheduler.state import SchedulerState
from hicache.tree.cache import MatchResult
from hicache.tree.node import ComponentType

HOOK_CLASSES: tuple[type[ComponentHooks], ...] = (MambaHooks, SwaHooks)
"""Every auxiliary component's hooks, in the order ``AuxMemory`` calls them: a component
that keeps state only at snapshots (Mamba) places the inserts before one that can be
inserted anywhere (SWA)."""


class AuxMemory:
    """The hooks of every auxiliary component of the tree, called in ``HOOK_CLASSES`` order."""

    def __init__(self, state: SchedulerState) -> None:
        self.s = state
        self.hooks: list[ComponentHooks] = []
        for cls in HOOK_CLASSES:
            self.hooks.extend(cls(state, c) for c in state.cache.aux if isinstance(c, cls.kind))
        served = {h.name for h in self.hooks}
        missing = [c.name for c in state.cache.aux if c.name not in served]
        if missing:
            raise ValueError(f"the scheduler has no request hooks for component(s) {missing}")

    # ---------------------------------------------------------------- submit and admission
    def refusal(self, full_pages: int) -> str | None:
        """Why a request needing ``full_pages`` L1 pages can never be served, or None."""
        for h in self.hooks:
            problem = h.refusal(full_pages)
            if problem is not None:
                return problem
        return None

    def amounts(self, req: Request, need: int, prefix: int) -> dict[ComponentType, int]:
        """What ``req`` reserves besides ``need`` Full pages, admitted with ``prefix`` tokens cached."""
        return {h.ctype: h.amount(req, need, prefix) for h in self.hooks}

    def admit(self, req: Request, m: MatchResult, prefix: int) -> bool:
        """Every component's memory for the admitted ``req``; False when one cannot be had
        now (the caller undoes the admission: ``unadmit``)."""
        return all(h.admit(req, m, prefix) for h in self.hooks)

    def unadmit(self, req: Request) -> None:
        """Undo ``admit`` (also a half-done one)."""
        for h in self.hooks:
            h.unadmit(req)

    # ---------------------------------------------------------------- forward pass
    def ensure_pages(self, req: Request, upto: int) -> bool:
        """Every component's pages for ``req``'s first ``upto`` tokens; False if one is short."""
        return all(h.ensure_pages(req, upto) for h in self.hooks)

    def fill_item(self, req: Request, item: ForwardItem) -> ForwardItem:
        """``item`` with every component's fields set (page tables, state slots)."""
        for h in self.hooks:
            item = h.fill_item(req, item)
        return item

    def forward_failed(self, req: Request, item: ForwardItem) -> None:
        for h in self.hooks:
            h.forward_failed(req, item)

    def advance(self, req: Request, item: ForwardItem, prefill: bool) -> None:
        """After ``req`` computed ``item`` (``req.computed`` is its end): insert the prompt's
        state at the positions the first placing component names (the module docstring),
        so a repeat of the prompt matches there."""
        for placer in self.hooks:
            points = placer.insert_points(req, item, prefill)
            if points is not None:
                for pos, payload in points:
                    self.insert_prompt_state(req, pos, placer, payload)
                break

    def settle(self, req: Request) -> None:
        """After ``req`` computed more (and the tree took what is new): each component
        frees what fell out of use and re-sizes its reservation."""
        for h in self.hooks:
            h.settle(req)

    def insert_prompt_state(self, req: Request, pos: int, placer: ComponentHooks, payload: object | None) -> None:
        """Insert ``req``'s first ``pos`` tokens (``cache_unfinished_req``) with ``placer``'s
        ``payload`` and every other component's part; nothing when none has one."""
        st = req.tree
        assert st is not None
        parts: dict[str, object] = {}
        for h in self.hooks:
            part = payload if h is placer and payload is not None else h.insert_part(req, pos)
            if part is not None:
                parts[h.name] = part
        if not parts:
            return
        self.s.cache.cache_unfinished_req(st, committed_len=pos, aux=parts)
        for h in self.hooks:
            if h.name in parts:
                h.inserted(req, pos)

    # ---------------------------------------------------------------- finishing
    def hand_over(self, req: Request) -> None:
        """Before ``cache_finished_req``: what the tree keeps of each component."""
        for h in self.hooks:
            h.hand_over(req)
