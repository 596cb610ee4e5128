"""SWA windows of running requests: the ``ComponentHooks`` of ``SWAComponent``.

A request's SWA page table (``RequestState.aux["swa"]``, a ``SwaRequestPages``) covers pages
from its ``start_page`` on (the runner gets -1 before it). Its first ``prefix_len`` tokens'
entries are the tree's pages (-1 for tombstones, never read); the rest are the request's
own. As its computed position advances, its own pages wholly before the window before its
last page boundary are freed at once (``settle``), and once nothing the tree holds before
its window is read again, the SWA part of its lock is given back (``release_part``; the
Full lock stays). A request reserves only the SWA pages it holds at once
(``hicache.config.swa_request_pages``), re-sized after every pass.

When the prefill passes the prompt's last page boundary (or, with Mamba layers too, each
position Mamba inserts a state at), the window of SWA pages before it goes to the tree with
the Full pages (``insert_part`` / ``inserted``): without them the node would be no valid
boundary until the request finishes, and an L2 copy made of it meanwhile (write-through)
would lack its SWA pages for good. The tree takes those pages over (keeping them, or
freeing them where it has the same tokens' pages already), so the request's table up to
there becomes the tree's pages; they stay valid while it runs, as the lock the insert moves
to the new node covers the window before it. The request's own pages handed over this way
stay charged to its SWA reservation until it finishes (``Request.aux["swa"]``, a count).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hicache.config import swa_min_pages, swa_request_pages
from hicache.scheduler.component_hooks.base import ComponentHooks, InsertPoint, prompt_boundary
from hicache.tree.components import PagedInsert, SWAComponent, SwaRequestPages
from hicache.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.model.runner import ForwardItem
    from hicache.scheduler.request import Request
    from hicache.scheduler.state import SchedulerState
    from hicache.tree.cache import MatchResult
    from hicache.tree.request_state import RequestState


class SwaHooks(ComponentHooks):
    """SWA pages of the running requests (the module docstring)."""

    kind = SWAComponent

    def __init__(self, state: SchedulerState, component: SWAComponent) -> None:
        super().__init__(state, component)
        self.swa = component

    # ---------------------------------------------------------------- submit and admission
    def refusal(self, full_pages: int) -> str | None:
        s, a = self.s, self.swa.allocator
        need = min(full_pages, swa_min_pages(self.swa.sliding_window, s.chunk_tokens, s.page_size))
        if need > a.capacity:
            return (f"the request needs {need} L1 SWA pages at once (its windows, a prefill chunk and its "
                    f"match's window); L1 holds {a.capacity}")
        return None

    def amount(self, req: Request, need: int, prefix: int) -> int:
        """What it holds at once, not every page it computes."""
        return min(need, swa_request_pages(self.swa.sliding_window, self.s.chunk_tokens, self.s.page_size))

    def admit(self, req: Request, m: MatchResult, prefix: int) -> bool:
        st = req.tree
        assert st is not None
        pages = self.tree_pages(m.last_device_node, prefix // self.s.page_size)
        st.aux[self.name] = SwaRequestPages(pages, 0, prefix)
        return True

    def tree_pages(self, node: TreeNode, npages: int) -> list[int]:
        """The tree's SWA pages of the path ending at ``node`` (``npages`` pages), -1 for a
        tombstone's pages (outside the window of a valid match, never read)."""
        runs: list[list[int]] = []
        ps = self.s.page_size
        while node.parent is not None:
            v = self.s.cache.data(node, self.ctype).value
            runs.append(list(v) if v is not None else [-1] * (len(node.key) // ps))
            node = node.parent
        out = [p for run in reversed(runs) for p in run]
        if len(out) != npages:
            raise RuntimeError(f"the matched path holds {len(out)} SWA pages, {npages} expected")
        return out

    def table(self, st: RequestState | None) -> SwaRequestPages | None:
        """The request's SWA page table, None for none."""
        table: SwaRequestPages | None = st.aux.get(self.name) if st is not None else None
        return table

    def handed(self, req: Request) -> int:
        """Own SWA pages ``req`` handed to the tree with its prompt-state inserts."""
        n = req.aux.get(self.name, 0)
        return n if isinstance(n, int) else 0

    # ---------------------------------------------------------------- forward pass
    def ensure_pages(self, req: Request, upto: int) -> bool:
        t = self.table(req.tree)
        if t is None:
            return True
        need = -(-upto // self.s.page_size) - t.start_page - len(t.pages)
        if need <= 0:
            return True
        pages = self.s.budget.take(req.rid, self.ctype, need)
        if pages is None:
            return False
        t.pages.extend(pages)
        return True

    def fill_item(self, req: Request, item: ForwardItem) -> ForwardItem:
        """The runner's SWA page table: -1 for the pages released before its
        ``start_page`` (wholly before the window: never read)."""
        t = self.table(req.tree)
        if t is None:
            return item
        return replace(item, swa_pages=[-1] * t.start_page + t.pages if t.start_page else t.pages)

    def insert_points(self, req: Request, item: ForwardItem, prefill: bool) -> list[InsertPoint] | None:
        """The prompt boundary, once the prefill passed it (used when no component that
        keeps snapshots places the inserts)."""
        if self.table(req.tree) is None or not prefill:
            return None
        pos = prompt_boundary(req.prompt_len, self.s.page_size)
        return [(pos, None)] if item.start < pos <= req.computed else []

    def keep_from(self, pos: int) -> int:
        """The first SWA page a request that computed ``pos`` tokens keeps: the window
        before the last page boundary (so the tokens cached at finish end on a valid SWA
        boundary), which holds the window the runner reads for the next token
        (``[pos - window + 1, pos)``). Pages before it are never read again."""
        ps = self.s.page_size
        return max(0, pos // ps - -(-self.swa.sliding_window // ps))

    def drop_before(self, req: Request, page: int) -> None:
        """Release ``req``'s SWA table entries before ``page``: its own pages are freed at
        once, the tree's (its match, its prompt boundary's window) are just no longer its
        to read; the table's ``start_page`` advances to ``page``."""
        t = self.table(req.tree)
        assert t is not None
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

    def insert_part(self, req: Request, pos: int) -> object | None:
        """The table's pages from its ``start_page`` up to ``pos`` (own pages before the
        window before ``pos`` freed first), when ``pos`` passes the tree's part."""
        st = req.tree
        t = self.table(st)
        if st is None or t is None or pos <= st.prefix_len:
            return None
        self.drop_before(req, self.keep_from(pos))  # the window before pos stays
        return PagedInsert(t.pages[: pos // self.s.page_size - t.start_page], t.start_page, t.prefix_len)

    def inserted(self, req: Request, pos: int) -> None:
        """The table up to ``pos`` is the tree's pages now; the own ones among them count
        as handed over."""
        st = req.tree
        t = self.table(st)
        assert st is not None and t is not None
        if st.prefix_len != pos:
            raise RuntimeError(f"the prompt state's insert ended at {st.prefix_len}, not {pos}")
        assert st.last_node is not None
        ps = self.s.page_size
        npages, start = pos // ps, t.start_page
        handed = npages - max(start, t.prefix_len // ps)
        t.pages[: npages - start] = self.tree_pages(st.last_node, npages)[start:]
        t.prefix_len = pos
        req.aux[self.name] = self.handed(req) + max(0, handed)

    def settle(self, req: Request) -> None:
        """Free its SWA pages that fell out of the window, give back the SWA part of its
        lock once no tree page before its window is read again (the matched prefix or its
        prompt boundary; the Full lock stays), and re-size its SWA reservation to what it
        may still hold at once (``swa_request_pages`` for its phase, less the pages it
        holds and has handed to the tree, at most the pages it has still to allocate)."""
        st = req.tree
        t = self.table(st)
        if st is None or t is None:
            return
        ps = self.s.page_size
        keep = self.keep_from(req.computed)
        self.drop_before(req, keep)
        if st.lock is not None and keep >= t.prefix_len // ps:
            st.lock = self.s.cache.release_part(st.lock, self.name)
        end = t.start_page + len(t.pages)
        own = end - max(t.start_page, t.prefix_len // ps)
        future = -(-(req.prompt_len + req.params.max_new_tokens) // ps) - end
        step = self.s.chunk_tokens if req.prefilling else 1
        bound = swa_request_pages(self.swa.sliding_window, step, ps) - max(0, own) - self.handed(req)
        self.s.budget.resize(req.rid, self.ctype, max(0, min(future, bound)))
