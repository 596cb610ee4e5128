"""Tier sizes from a trace: where each tier stops paying, and the config that follows.

The model (docs/architecture.md §5). The tiers are inclusive: under the write policies
every page in L1 is also written to L2 and every page in L2 to L3, and a page leaves a
lower tier only to stay in the one above. So the pages that L1 + L2 hold together are
close to what one LRU cache of L2's size holds, and:

    hits from L1           = H(l1)
    hits from L2           = H(l2) - H(l1)       (0 when l2 <= l1)
    hits from L3           = H(l3) - H(max(l1, l2))
    hits of the whole set  = H(largest tier)

where ``H`` is LRU's hit curve, exact for every capacity at once (``reuse.reuse_profile``).
The real tree differs by a fraction of a point (it evicts whole nodes); ``Advisor.replay``
replays a config through the real tree and its tier calls (``tiered.simulate``) to give
the figure the daemon should reach.

The knee of a tier: the smallest size past which growing the tier up to its budget adds
at most ``gain`` (one point by default) of hit rate. Each tier is recommended at its knee
plus ``headroom`` (10 % by default), within its budget; a tier that adds at most ``gain``
over the tiers below is left off (L2 stays on where L3 needs it).

Why the headroom: a knee is often a cliff. A working set reused in a cycle hits entirely
from its size on and not at all one page below it (LRU evicts each page just before its
reuse), and the real tree has less than its nominal size for cached pages: it evicts whole
nodes, and running requests hold pages. Sized exactly at the knee, the tree replay of a
cyclic test workload lost 56 of its 70 points; with 10 % more it reached the model's figure.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hicache.replay_sim.bounds import belady_hits, next_uses
from hicache.replay_sim.reuse import ReuseProfile, reuse_profile
from hicache.replay_sim.tiered import SimConfig, SimReport, simulate
from hicache.replay_sim.workload import Workload

TIERS = ("L1", "L2", "L3")
DEFAULT_GAIN = 0.01
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Budgets:
    """The most each tier may have, in pages: ``l3`` None is unbounded; ``l2`` / ``l3`` 0
    forbid the tier."""

    l1: int
    l2: int
    l3: int | None

    def of(self, tier: str) -> int | None:
        return {"L1": self.l1, "L2": self.l2, "L3": self.l3}[tier]


@dataclass(frozen=True)
class TierAdvice:
    """One tier as recommended, sizes in pages.

    ``pages`` 0: leave the tier off. ``knee``: the tier's knee within its budget, kept when
    the tier is off to show where it would stop paying. ``knee_gain``: what the tier adds
    at its knee over the tiers below at theirs (the reason it is on or off). ``served``: the
    hit rate this tier serves as recommended; ``cumulative``: the hit rate of the tiers up to
    this one. ``belady``: Belady's rate for one cache of ``pages`` (None when off).
    """

    tier: str
    pages: int
    budget: int | None
    knee: int
    knee_gain: float
    served: float
    cumulative: float
    belady: float | None = None


@dataclass(frozen=True)
class GridRow:
    """One capacity of the grid: LRU's and Belady's hit rates for one cache of that size."""

    pages: int
    lru: float
    belady: float | None


@dataclass
class Advice:
    """What ``Advisor.advise`` found. ``policies``: the real-tree replay of the recommended
    sizes with each eviction policy; ``best_policy`` is the one with the most hits (the
    first listed on a tie)."""

    page_tokens: int
    total_pages: int
    unique_pages: int
    ceiling: float
    gain: float
    headroom: float
    tiers: list[TierAdvice]
    grid: list[GridRow]
    policies: dict[str, SimReport] = field(default_factory=dict)
    best_policy: str | None = None

    def tier(self, name: str) -> TierAdvice:
        return next(t for t in self.tiers if t.tier == name)

    @property
    def predicted_hit_rate(self) -> float:
        """The recommended config's hit rate: the real-tree replay with the best policy where
        it ran, else the LRU model."""
        if self.best_policy is not None:
            return self.policies[self.best_policy].hit_rate
        return self.tiers[-1].cumulative


def grid_capacities(unique_pages: int, extra: Sequence[int] = (), count: int = 10) -> list[int]:
    """``count`` capacities, geometric from 1/256 of the distinct pages to all of them, plus
    ``extra`` (the budgets and the recommended sizes), each at least one page."""
    hi = max(1, unique_pages)
    lo = max(1, hi // 256)
    caps = {hi, lo}
    if count > 1 and hi > lo:
        step = (hi / lo) ** (1 / (count - 1))
        caps.update(max(1, round(lo * step**i)) for i in range(count))
    caps.update(c for c in extra if c >= 1)
    return sorted(caps)


class Advisor:
    """Sizes and policies for one workload. The reuse profile is computed once (O(N log N),
    N = page references); Belady costs one pass per capacity, a replay one pass per config."""

    def __init__(self, work: Workload) -> None:
        self.work = work
        self.profile: ReuseProfile = reuse_profile(work.pages)
        self._next: list[list[int]] | None = None

    def belady(self, pages: int) -> float:
        """Belady's hit rate for one cache of ``pages``."""
        if self._next is None:
            self._next = next_uses(self.work.pages)
        total = self.profile.total
        return belady_hits(self.work.pages, pages, self._next) / total if total else 0.0

    def knee(self, low: int, budget: int | None, gain: float) -> int:
        """The smallest size in ``[low, budget]`` past which growing to ``budget`` adds at most
        ``gain``; ``low`` when even the budget adds no more than that over ``low``."""
        h = self.profile
        top = h.hit_rate(budget)
        if top - h.hit_rate(low) <= gain:
            return low
        size = h.smallest_reaching(top - gain)
        return max(low, size if budget is None else min(size, budget))

    def recommend(self, budgets: Budgets, gain: float = DEFAULT_GAIN, headroom: float = DEFAULT_HEADROOM,
                  belady: bool = True) -> list[TierAdvice]:
        """Each tier at its knee plus ``headroom``, within its budget (see the module docstring)."""
        h = self.profile
        if budgets.l1 < 1:
            raise ValueError("the L1 budget must be at least one page")
        knee1 = self.knee(1, budgets.l1, gain)
        # L2 above L1; L3 above both. A tier with a zero budget is off.
        knee2 = self.knee(knee1, budgets.l2, gain) if budgets.l2 > 0 else knee1
        l3_possible = budgets.l2 > 0 and (budgets.l3 is None or budgets.l3 > 0)
        knee3 = self.knee(knee2, budgets.l3, gain) if l3_possible else knee2
        knees = (knee1, knee2, knee3)
        gains = [h.hit_rate(knee1)] + [h.hit_rate(b) - h.hit_rate(a) for a, b in zip(knees, knees[1:], strict=False)]
        l3_on = l3_possible and gains[2] > gain
        l2_on = budgets.l2 > 0 and (gains[1] > gain or l3_on)

        def sized(knee: int, budget: int | None) -> int:
            size = int(-(-knee * (1 + headroom) // 1))
            return size if budget is None else min(size, budget)

        sizes = (sized(knee1, budgets.l1), sized(knee2, budgets.l2) if l2_on else 0,
                 sized(knee3, budgets.l3) if l3_on else 0)
        out = []
        prev = 0.0
        for tier, size, knee, knee_gain in zip(TIERS, sizes, knees, gains, strict=True):
            cum = h.hit_rate(size) if size else prev
            opt = self.belady(size) if belady and size else None
            out.append(TierAdvice(tier, size, budgets.of(tier), knee, knee_gain, cum - prev, cum, opt))
            prev = cum
        return out

    def replay(self, l1: int, l2: int, l3: int | None, policy: str, write_policy: str = "write_through",
               bytes_per_token: int = 0) -> SimReport:
        """The real tree and its tier calls on this workload (thresholds 0: every hit is used)."""
        w = self.work
        cfg = SimConfig(l1, l2, l3 if l2 else 0, w.page_size, policy, write_policy, bytes_per_token=bytes_per_token)
        cfg.validate()
        return simulate(w.keys, cfg, w.tree_page_size, longest_pages=w.longest_pages())

    def advise(self, budgets: Budgets, policies: Sequence[str], gain: float = DEFAULT_GAIN,
               headroom: float = DEFAULT_HEADROOM, grid_belady: bool = False, bytes_per_token: int = 0,
               workers: int = 1) -> Advice:
        """The recommendation, the grid (LRU per capacity, and Belady with ``grid_belady``)
        and a real-tree replay of the recommended sizes with each of ``policies``.

        The Belady runs and the replays are independent passes over the workload: with
        ``workers`` > 1 they run in that many forked processes (each reads the workload this
        process built; only the figures come back).
        """
        tiers = self.recommend(budgets, gain, headroom, belady=False)
        h = self.profile
        extra = [budgets.l1, budgets.l2] + [t.pages for t in tiers]
        if budgets.l3 is not None:
            extra.append(budgets.l3)
        caps = grid_capacities(h.unique, extra)
        sizes = {t.pages for t in tiers if t.pages} | (set(caps) if grid_belady else set())
        l1, l2, l3 = (t.pages for t in tiers)
        tasks: list[tuple[str, Any]] = [("belady", c) for c in sorted(sizes)]
        tasks += [("replay", (l1, l2, l3, pol, bytes_per_token)) for pol in policies]
        results = dict(zip(tasks, _run_tasks(self, tasks, workers), strict=True))
        opt = {c: results[("belady", c)] for c in sizes}
        tiers = [dataclasses.replace(t, belady=opt[t.pages]) if t.pages else t for t in tiers]
        grid = [GridRow(c, h.hit_rate(c), opt.get(c)) for c in caps]
        advice = Advice(self.work.page_size, h.total, h.unique, h.ceiling, gain, headroom, tiers, grid)
        for pol in policies:
            advice.policies[pol] = results[("replay", (l1, l2, l3, pol, bytes_per_token))]
        if advice.policies:
            advice.best_policy = max(policies, key=lambda p: (advice.policies[p].hit_tokens, -policies.index(p)))
        return advice


_FORKED: Advisor | None = None
"""The advisor a forked worker reads (set by ``_run_tasks`` before the pool forks)."""


def _task(task: tuple[str, Any]) -> Any:
    assert _FORKED is not None
    kind, arg = task
    if kind == "belady":
        return _FORKED.belady(arg)
    l1, l2, l3, policy, bpt = arg
    return _FORKED.replay(l1, l2, l3, policy, bytes_per_token=bpt)


def _run_tasks(advisor: Advisor, tasks: list[tuple[str, Any]], workers: int) -> list[Any]:
    """``_task`` of each task, in order: here, or in ``workers`` forked processes."""
    global _FORKED
    _FORKED = advisor
    try:
        if workers <= 1 or len(tasks) <= 1 or "fork" not in mp.get_all_start_methods():
            return [_task(t) for t in tasks]
        advisor.belady(1)  # next uses, computed once before the fork and inherited
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=mp.get_context("fork")) as pool:
            return list(pool.map(_task, tasks))
    finally:
        _FORKED = None
