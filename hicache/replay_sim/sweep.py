"""Hit rate against capacity for several eviction policies, with Belady and the ceiling.

Every point is a single-tier replay through the real tree (``simulate`` with L1 only), so a
curve is exactly what the daemon's L1 would reach with that policy and that much memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache.replay_sim.bounds import belady_hits, infinite_hits, next_uses
from hicache.replay_sim.tiered import SimConfig, simulate
from hicache.replay_sim.workload import Workload


@dataclass
class SweepPoint:
    """One capacity: ``rates[policy]`` and Belady's rate, all in [0, 1]."""

    capacity_pages: int
    capacity_tokens: int
    rates: dict[str, float]
    belady: float

    def ratio(self, policy: str) -> float:
        """The policy's hit rate as a fraction of Belady's (1.0 when both are 0)."""
        return self.rates[policy] / self.belady if self.belady else 1.0


@dataclass
class SweepResult:
    trace: str
    page_tokens: int
    policies: list[str]
    ceiling: float
    points: list[SweepPoint] = field(default_factory=list)
    seconds: float = 0.0


def auto_capacities(unique_pages: int, count: int = 8) -> list[int]:
    """``count`` capacities, geometric from about 0.5% of the distinct pages to 60% of
    them (where every trace here has reached its ceiling), each at least one page."""
    lo, hi = max(1, unique_pages // 200), max(2, int(unique_pages * 0.6))
    if count < 2 or hi <= lo:
        return [hi]
    step = (hi / lo) ** (1 / (count - 1))
    caps = sorted({max(1, round(lo * step**i)) for i in range(count)})
    return caps


def run_sweep(work: Workload, capacities: Sequence[int], policies: Sequence[str],
              progress: Callable[[int], None] | None = None) -> SweepResult:
    """Replay every (capacity, policy) pair single-tier; ``progress(1)`` after each replay
    (and each Belady run). Capacities are in pages of ``work.page_size`` tokens."""
    import time

    t0 = time.perf_counter()
    pages = work.pages
    total = work.total_pages
    nxt = next_uses(pages)
    res = SweepResult(work.trace.name, work.page_size, list(policies),
                      infinite_hits(pages) / total if total else 0.0)
    longest = work.longest_pages()
    for cap in capacities:
        rates = {}
        for pol in policies:
            cfg = SimConfig(cap, page_tokens=work.page_size, eviction=pol)
            rates[pol] = simulate(work.keys, cfg, work.tree_page_size, longest_pages=longest).hit_rate
            if progress is not None:
                progress(1)
        opt = belady_hits(pages, cap, nxt) / total if total else 0.0
        if progress is not None:
            progress(1)
        res.points.append(SweepPoint(cap, cap * work.page_size, rates, opt))
    res.seconds = time.perf_counter() - t0
    return res


def plot_sweep(res: SweepResult, path: str, title: str | None = None) -> bool:
    """Write the curves as a PNG (matplotlib, Agg backend; imported here only); True once written.

    matplotlib is in the ``bench`` extra (``pip install "hicache[bench]"``), not a dependency
    of the daemon: without it the plot is skipped with a warning on stderr and False is
    returned, so ``hicache replay --sweep`` still prints its table and writes ``--json``.
    """
    from hicache.replay_sim.plotting import pyplot_or_none, save_capacity_plot

    plt = pyplot_or_none(path)
    if plt is None:
        return False

    xs = [p.capacity_tokens for p in res.points]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for pol in res.policies:
        ax.plot(xs, [100 * p.rates[pol] for p in res.points], marker="o", ms=3, label=pol)
    ax.plot(xs, [100 * p.belady for p in res.points], "k--", marker="s", ms=3, label="Belady (offline optimum)")
    ax.axhline(100 * res.ceiling, color="grey", lw=0.8, ls=":", label="infinite capacity")
    save_capacity_plot(plt, fig, ax, path, title or f"{res.trace}: hit rate by capacity")
    return True
