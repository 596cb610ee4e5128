"""The scheduler's work for the auxiliary components: SWA windows and Mamba state slots.

Everything a running request of a hybrid model holds besides its Full pages is placed,
settled and handed to the tree here; admission (``hicache.scheduler.admission``), the
forward pass (``hicache.scheduler.forward_pass``) and finishing call in at fixed points:

====================  ===================================================================
call                  when, and what it does
====================  ===================================================================
``refusal``           a request is submitted: why it can never be served, or None
``amounts``           admission: the SWA pages and Mamba slots it reserves
``admit``             admission: the matched SWA pages, the own Mamba slot (a copy of the
                      matched state); False when no slot can be had now (queue again)
``ensure_swa_pages``  before a forward pass: SWA pages up to the tokens it computes
``swa_table``         the runner's SWA page table
``advance``           after a forward pass: insert the prompt state(s), settle the window
``hand_over_state``   before ``cache_finished_req``: the Mamba state the tree keeps
====================  ===================================================================

SWA: the request's SWA page table (``RequestState.aux["swa"]``, a ``SwaRequestPages``) covers
pages from its ``start_page`` on (the runner gets -1 before it). Its first ``prefix_len`` tokens'
entries are the tree's pages (-1 for
tombstones, never read); the rest are the request's own. As its computed position
advances, its own pages wholly before the window before its last page boundary are freed at
once (``settle_swa``), and once nothing the tree holds before its window is read again, the
SWA part of its lock is given back (``release_part``; the Full lock stays). When the
prefill passes the prompt's last page boundary, the Full pages and the window of SWA pages
before it go to the tree (``insert_prompt_state``). A request reserves only the SWA pages
it holds at once (``hicache.config.swa_request_pages``), re-sized after every pass.

Mamba: a running request's slots are its ``req.mamba`` (``MambaSlots``); the tree's
``RequestState.aux["mamba"]`` is set from it at admission (the own slot) and at the hand-over
before ``cache_finished_req``. A snapshot that finds no slot is skipped (its state is just
not cached), never an error.
"""

from __future__ import annotations

from hicache.config import STATE_SLOTS_PER_REQUEST, swa_min_pages, swa_request_pages
from hicache.model.runner import ForwardItem
from hicache.scheduler.request import MambaSlots, Request
from hicache.scheduler.state import SchedulerState
from hicache.tree.cache import MatchResult
from hicache.tree.components import PagedInsert, SWAComponent, SwaRequestPages
from hicache.tree.node import ComponentType, TreeNode
from hicache.tree.request_state import RequestState

SWA, MAMBA = ComponentType.SWA, ComponentType.MAMBA


class AuxMemory:
    """SWA windows and Mamba slots of the running requests (a model without them: no-ops)."""

    def __init__(self, state: SchedulerState) -> None:
        self.s = state
        self.swa = state.swa
        self.mamba = state.mamba

    # ------------------------------------------------------------------ submit and admission
    def refusal(self, full_pages: int) -> str | None:
        """Why a request needing ``full_pages`` L1 pages can never be served, or None."""
        s = self.s
        if self.swa is not None:
            need = min(full_pages, swa_min_pages(self.swa.sliding_window, s.chunk_tokens, s.page_size))
            if need > self.swa.allocator.capacity:
                return (f"the request needs {need} L1 SWA pages at once (its windows, a prefill chunk and its "
                        f"match's window); L1 holds {self.swa.allocator.capacity}")
        if self.mamba is not None and self.mamba.allocator.capacity <= STATE_SLOTS_PER_REQUEST:
            return (f"a request needs {STATE_SLOTS_PER_REQUEST} L1 state slots besides the state it matches; "
                    f"L1 holds {self.mamba.allocator.capacity}")
        return None

    def amounts(self, req: Request, need: int, prefix: int) -> dict[ComponentType, int]:
        """What ``req`` reserves besides ``need`` Full pages, admitted with ``prefix`` tokens cached."""
        out: dict[ComponentType, int] = {}
        ps = self.s.page_size
        if self.swa is not None:  # what it holds at once, not every page it computes
            out[SWA] = min(need, swa_request_pages(self.swa.sliding_window, self.s.chunk_tokens, ps))
        if self.mamba is not None:  # its own state, the prompt snapshot (if still to take), a boundary one
            out[MAMBA] = MambaSlots.needed(req.prompt_len, prefix, ps)
        return out

    def admit(self, req: Request, m: MatchResult, prefix: int) -> bool:
        """Give the admitted ``req`` (its ``tree`` set, its reservation made) its SWA table
        and its own Mamba slot. False when the slot, counted free or evictable, cannot be
        had now (the caller undoes the admission); an exception leaves the caller to undo."""
        st = req.tree
        assert st is not None
        ps = self.s.page_size
        if self.swa is not None:
            st.aux[self.swa.name] = SwaRequestPages(self.tree_swa_pages(m.last_device_node, prefix // ps), 0, prefix)
        if self.mamba is not None:
            slots = req.mamba = MambaSlots.for_admission(
                self.mamba.allocator, lambda: self.take_slot(req), ps, req.prompt_len, prefix,
                fork=m.walked_len, interval=self.s.cfg.cache.mamba_branch_interval)
            slot = slots.take_own()
            if slot is None:
                return False
            st.aux[self.mamba.name] = slot  # the tree's view of it (undoing the admission frees it should the copy fail)
            if prefix > 0:
                src = self.s.cache.data(m.last_device_node, MAMBA).value
                if src is None:
                    raise RuntimeError("the matched node has no Mamba state")
                self.mamba.copy_state(src, slot)  # type: ignore[misc]
        return True

    def unadmit(self, req: Request) -> None:
        """Undo ``admit``: free ``req``'s Mamba slots (the tree's view of its own slot goes
        too); its SWA table holds only the tree's pages then, which its lock covered."""
        if req.mamba is not None:
            req.mamba.free_all()
            req.mamba = None
        if req.tree is not None and self.mamba is not None:
            req.tree.aux.pop(self.mamba.name, None)

    def tree_swa_pages(self, node: TreeNode, npages: int) -> list[int]:
        """The tree's SWA pages of the path ending at ``node`` (``npages`` pages), -1 for a
        tombstone's pages (outside the window of a valid match, never read)."""
        runs: list[list[int]] = []
        ps = self.s.page_size
        while node.parent is not None:
            v = self.s.cache.data(node, SWA).value
            runs.append(list(v) if v is not None else [-1] * (len(node.key) // ps))
            node = node.parent
        out = [p for run in reversed(runs) for p in run]
        if len(out) != npages:
            raise RuntimeError(f"the matched path holds {len(out)} SWA pages, {npages} expected")
        return out

    def take_slot(self, req: Request) -> int | None:
        """One L1 Mamba state slot for ``req`` (evicting a cached state if needed), taken
        from its reservation; past it (further branch snapshots) only out of the room no
        request has reserved. None when none can be had. Only ``req.mamba`` calls it."""
        budget = self.s.budget
        if budget.held(req.rid, MAMBA) == 0 and budget.room(MAMBA) <= 0:
            return None
        got = budget.take(req.rid, MAMBA, 1)
        return got[0] if got is not None else None

    # ------------------------------------------------------------------ forward pass
    @staticmethod
    def table(st: RequestState | None) -> SwaRequestPages | None:
        """The request's SWA page table (``aux["swa"]``), None for none."""
        table: SwaRequestPages | None = st.aux.get(SWAComponent.name) if st is not None else None
        return table

    def ensure_swa_pages(self, req: Request, upto: int) -> bool:
        """SWA pages up to ``upto`` tokens (the table covers pages from its ``start_page``)."""
        t = self.table(req.tree)
        if self.swa is None or t is None:
            return True
        need = -(-upto // self.s.page_size) - t.start_page - len(t.pages)
        if need <= 0:
            return True
        pages = self.s.budget.take(req.rid, SWA, need)
        if pages is None:
            return False
        t.pages.extend(pages)
        return True

    def swa_table(self, st: RequestState) -> list[int] | tuple[()]:
        """The runner's SWA page table: -1 for the pages released before its ``start_page``
        (wholly before the window: never read)."""
        t = self.table(st)
        if t is None:
            return ()
        return [-1] * t.start_page + t.pages if t.start_page else t.pages

    def advance(self, req: Request, item: ForwardItem, prefill: bool) -> None:
        """After ``req`` computed ``item`` (``req.computed`` is its end): insert the prompt's
        Mamba state(s) once the prefill passed their boundaries (or, without Mamba layers,
        the prompt boundary with its SWA window), so a repeat of the prompt matches it."""
        st = req.tree
        assert st is not None
        if req.mamba is not None:
            req.mamba.computed(list(item.snapshots))
            for pos, slot in req.mamba.pop_branches(req.computed):  # ascending
                self.insert_prompt_state(req, pos, slot)
        elif self.table(st) is not None and prefill:
            pos = MambaSlots.prompt_boundary(req.prompt_len, self.s.page_size)
            if item.start < pos <= req.computed:
                self.insert_prompt_state(req, pos, None)

    def swa_keep_from(self, pos: int) -> int:
        """The first SWA page a request that computed ``pos`` tokens keeps: the window
        before the last page boundary (so the tokens cached at finish end on a valid SWA
        boundary), which holds the window the runner reads for the next token
        (``[pos - window + 1, pos)``). Pages before it are never read again."""
        assert self.swa is not None
        ps = self.s.page_size
        return max(0, pos // ps - -(-self.swa.sliding_window // ps))

    def drop_swa_before(self, req: Request, page: int) -> None:
        """Release ``req``'s SWA table entries before ``page``: its own pages are freed at
        once, the tree's (its match, its prompt boundary's window) are just no longer its
        to read; the table's ``start_page`` advances to ``page``."""
        t = self.table(req.tree)
        assert self.swa is not None and t is not None
        drop = page - t.start_page
        if drop <= 0:
            return
        tree_end = t.prefix_len // self.s.page_size  # entries before it are the tree's
        first_own = max(0, tree_end - t.start_page)
        own = t.pages[first_own:drop]
        del t.pages[:drop]
        t.start_page = page
        if own:
            self.swa.allocator.free(own)

    def settle_swa(self, req: Request) -> None:
        """After ``req`` computed more: free its SWA pages that fell out of the window, give
        back the SWA part of its lock once no tree page before its window is read again
        (the matched prefix or its prompt boundary; the Full lock stays), and re-size its
        SWA reservation to what it may still hold at once (``swa_request_pages`` for its
        phase, less the pages it holds and has handed to the tree, at most the pages it has
        still to allocate). Nothing for a request without an SWA table."""
        st = req.tree
        t = self.table(st)
        if self.swa is None or st is None or t is None:
            return
        ps = self.s.page_size
        keep = self.swa_keep_from(req.computed)
        self.drop_swa_before(req, keep)
        if st.lock is not None and keep >= t.prefix_len // ps:
            st.lock = self.s.cache.release_part(st.lock, self.swa.name)
        end = t.start_page + len(t.pages)
        own = end - max(t.start_page, t.prefix_len // ps)
        future = -(-(req.prompt_len + req.params.max_new_tokens) // ps) - end
        step = self.s.chunk_tokens if req.prefilling else 1
        bound = swa_request_pages(self.swa.sliding_window, step, ps) - max(0, own) - req.swa_handed
        self.s.budget.resize(req.rid, SWA, max(0, min(future, bound)))

    def insert_prompt_state(self, req: Request, pos: int, slot: int | None) -> None:
        """Insert the prompt's Mamba state ``slot`` (the state after ``pos`` tokens, a page
        boundary; None for a model without mamba layers) with the Full pages up to there
        (``cache_unfinished_req``).

        With SWA layers too, the insert carries the request's SWA pages from
        the table's ``start_page`` up to ``pos`` (own pages before the window before ``pos`` are
        freed first; they are handed to the tree, and stay charged to the request's SWA
        reservation, ``swa_handed``):
        without them the node would be no valid boundary until the request finishes, and an
        L2 copy made of it meanwhile (write-through) would lack its SWA pages for good, so
        that it could never be loaded back. The tree takes those pages over (keeping them,
        or freeing them where it has the same tokens' pages already), so the request's SWA
        table up to ``pos`` becomes the tree's pages, like its Full pages; they stay valid
        while it runs, as the lock the insert moves to the new node covers the window
        before it (earlier pages are never read again).
        """
        st = req.tree
        assert st is not None
        ps = self.s.page_size
        aux: dict[str, object] = {} if slot is None else {"mamba": slot}
        t = self.table(st)
        with_swa = t is not None and pos > st.prefix_len
        npages, start, handed = pos // ps, 0, 0
        if t is not None and with_swa:
            self.drop_swa_before(req, self.swa_keep_from(pos))  # the window before pos stays
            start = t.start_page
            handed = npages - max(start, t.prefix_len // ps)
            aux[SWAComponent.name] = PagedInsert(t.pages[: npages - start], start, t.prefix_len)
        if not aux:
            return
        self.s.cache.cache_unfinished_req(st, committed_len=pos, aux=aux)
        if t is not None and with_swa:
            if st.prefix_len != pos:
                raise RuntimeError(f"the prompt state's insert ended at {st.prefix_len}, not {pos}")
            assert st.last_node is not None
            t.pages[: npages - start] = self.tree_swa_pages(st.last_node, npages)[start:]
            t.prefix_len = pos
            req.swa_handed += max(0, handed)

    # ------------------------------------------------------------------ finishing
    def hand_over_state(self, req: Request) -> None:
        """Before ``cache_finished_req``: the tree's ``aux["mamba"]`` becomes the boundary
        snapshot when that holds the state after the last full page of the computed tokens
        (the key the tree inserts), else None; ``req.mamba`` frees the request's own slot
        and every other snapshot. Nothing for a model without Mamba layers."""
        st = req.tree
        if self.mamba is None or st is None:
            return
        slots, req.mamba = req.mamba, None
        slot = slots.hand_over(req.computed) if slots is not None else None
        if slot is None:
            st.aux.pop(self.mamba.name, None)
        else:
            st.aux[self.mamba.name] = slot
