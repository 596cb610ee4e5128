"""Which of vLLM's blocks may hold KV that is not their tokens', after a failed load.

vLLM caches the blocks of a synchronous load when it allocates them, before the load runs,
and under the ``recompute`` failure policy it keeps them cached after the load failed (it
evicts them only under ``fail``): until the request that loaded them computes them again,
they hold whatever the failed copy left, and every request that hits them in vLLM's own
prefix cache, in that step or a later one, computes on top of that. The connector's
scheduler half follows it here, per block of the KV cache group (a synchronous load has
one group: several load asynchronously and are never cached before they load):

=============================  ===============================================================
event                          effect on ``StaleBlocks``
=============================  ===============================================================
vLLM reports blocks invalid    each is stale from its first token; so is, in every request
(``mark_failed``)              whose block table holds one, every block after it (computed on
                               top of it, and vLLM makes that request compute them again)
a step computes tokens         a request whose step reads no stale token (every token before
(``step``)                     where the step starts, counting what other requests rewrite in
                               the same step: vLLM writes a layer's new KV of the whole batch
                               before any of it attends) writes good KV: a stale block's good
                               prefix grows by what it writes from there; a request that does
                               read a stale token writes stale KV from where it starts
a save is planned              ``first_stale`` pages end it: nothing from a stale block on is
                               saved (the request keeps trying in later steps)
=============================  ===============================================================

A block whose stale part nobody rewrites from its start (a request that goes on from inside
it) stays stale: its pages are not saved, which costs hits, never correctness. Nothing is
tracked (and nothing costs) while no load has failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepWrite:
    """One request's part of a step: its block table (the group's block ids, in token
    order) and the tokens it had computed before the step and will have after it."""

    blocks: Sequence[int]
    computed_before: int
    computed_after: int


class StaleBlocks:
    """The stale blocks of one KV cache group (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._good: dict[int, int] = {}
        """Stale block -> how many of its first tokens hold good KV (fewer than a block)."""

    def __bool__(self) -> bool:
        return bool(self._good)

    def __contains__(self, block: int) -> bool:
        return block in self._good

    def mark_failed(self, invalid: Iterable[int], tables: Iterable[Sequence[int]]) -> list[int]:
        """vLLM reported the ``invalid`` blocks (a load into them failed): they are stale, and
        so is every block after one of them in each of ``tables`` (the block tables of the
        requests the connector follows). Returns, per table, the index of its first invalid
        block (its length when it holds none)."""
        bad = set(invalid)
        for b in bad:
            self._good[b] = 0
        firsts: list[int] = []
        for table in tables:
            first = next((j for j, b in enumerate(table) if b in bad), len(table))
            for b in table[first:]:
                self._good[b] = 0
            firsts.append(first)
        return firsts

    def step(self, writes: Sequence[StepWrite]) -> list[int]:
        """Apply one step's writes (see the table); returns the indexes of the writes that
        read stale KV (their new KV is stale too)."""
        if not self._good:
            return []
        pending = list(range(len(writes)))
        progress = True
        while progress:  # a request may read what another rewrites in the same step: follow them in turn
            progress = False
            for i in list(pending):
                w = writes[i]
                if not self._reads_stale(w):
                    self._write(w, good=True)
                    pending.remove(i)
                    progress = True
        for i in pending:
            self._write(writes[i], good=False)
        return pending

    def _reads_stale(self, w: StepWrite) -> bool:
        """Whether ``w`` attends to a stale token computed before its step."""
        bs = self.block_size
        for j, b in enumerate(w.blocks[: -(-w.computed_before // bs)]):
            good = self._good.get(b)
            if good is not None and good < min(bs, w.computed_before - j * bs):
                return True
        return False

    def _write(self, w: StepWrite, *, good: bool) -> None:
        bs = self.block_size
        last = min(len(w.blocks), -(-w.computed_after // bs))
        for j in range(w.computed_before // bs, last):
            b = w.blocks[j]
            lo, hi = max(w.computed_before - j * bs, 0), min(w.computed_after - j * bs, bs)
            if not good:
                self._good[b] = min(self._good.get(b, bs), lo)
                continue
            have = self._good.get(b)
            if have is not None and lo <= have:
                if hi >= bs:
                    del self._good[b]
                else:
                    self._good[b] = max(have, hi)

    def first_stale(self, blocks: Sequence[int], end: int) -> int:
        """The first of the pages ``[0, end)`` (``blocks[j]`` holds page ``j``) whose block is
        stale; ``end`` when none is."""
        if not self._good:
            return end
        return next((j for j, b in enumerate(blocks[:end]) if b in self._good), end)
