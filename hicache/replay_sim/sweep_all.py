"""Every policy against Belady on every vendored trace (``hicache replay --sweep-all DIR``).

Single tier: each trace of ``TRACES`` found under ``DIR`` at its three capacities, the hit
rate of every eviction policy and of Belady (``bounds.belady_hits``), the ceiling, and LRU
told which blocks return (``bounds.returning_lru_hits``: how much of Belady's edge is
knowing what returns at all).
Tiered: on every trace with prefix information, each tier admission (``write_policy`` and
L3 ``backup_policy``) against ``write_through``, with L3 unbounded, off and bounded
(``TIERED_SIZES``: L1 3M / L2 6M / L3 12M tokens on the Mooncake traces, the three
single-tier capacities elsewhere). The Azure traces carry no prefix information (lengths only): they are replayed as the
traces' README says to use them, every block unique, a pure-miss control (0% for every
policy and for Belady). Nothing is subsampled. Writes ``PREFIX.md`` (the tables),
``PREFIX.csv`` (one row per figure) and ``PREFIX.png`` (hit rate against capacity, one
panel per trace).
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hicache.replay_sim.bounds import belady_hits, infinite_hits, next_uses, returning_lru_hits
from hicache.replay_sim.tiered import SimConfig, simulate
from hicache.replay_sim.trace import Trace, load_trace
from hicache.replay_sim.workload import Workload

# (label, path under the traces directory, the three capacities in blocks)
TRACES: tuple[tuple[str, str, tuple[int, int, int]], ...] = (
    ("mooncake conversation", "mooncake/conversation_trace.jsonl", (1953, 5859, 19531)),
    ("mooncake synthetic", "mooncake/synthetic_trace.jsonl", (1953, 5859, 19531)),
    ("sglang multi-turn (blog)", "synthetic/sglang_hicache_blog_multiturn_p64.jsonl", (5000, 10000, 20000)),
    ("sglang shared prefix", "synthetic/sglang_gsp_default_p64.jsonl", (256, 1024, 2048)),
    ("lmcache multi-round QA", "synthetic/lmcache_mrqa_readme_c256.jsonl", (20, 50, 100)),
    ("azure code (control)", "azure_llm_2023/AzureLLMInferenceTrace_code.csv", (1953, 5859, 19531)),
    ("azure conversation (control)", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv", (1953, 5859, 19531)),
)
AZURE_BLOCK = 512
# (label, write_policy, backup_policy); L3 settings: (label, pages in blocks or None, on)
ADMISSIONS = (("write_through", "write_through", "all"),
              ("write_through_selective", "write_through_selective", "all"),
              ("write_through_filtered", "write_through_filtered", "all"),
              ("write_through_filtered + filtered backup", "write_through_filtered", "filtered"))
# tiered sizes in blocks (L1, L2, bounded L3): the Mooncake traces at L1 3M / L2 6M / L3 12M
# tokens; the others at their three single-tier capacities (the Azure controls: none)
TIERED_SIZES = {"mooncake conversation": (5859, 11719, 23438), "mooncake synthetic": (5859, 11719, 23438)}


@dataclass
class Row:
    trace: str
    capacity_blocks: int
    capacity_tokens: int
    rates: dict[str, float]
    belady: float
    ceiling: float
    returning_lru: float
    """LRU told which blocks return (``bounds.returning_lru_hits``)."""


@dataclass
class TieredRow:
    trace: str
    l3: str
    rates: dict[str, float]


@dataclass
class SweepAll:
    policies: list[str]
    rows: list[Row] = field(default_factory=list)
    tiered: list[TieredRow] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _azure_trace(path: Path) -> Trace:
    """Lengths only: each request's blocks get fresh ids (nothing shared)."""
    blocks: list[list[int]] = []
    nxt = 0
    with open(path, encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            n = -(-int(rec["ContextTokens"]) // AZURE_BLOCK)
            blocks.append(list(range(nxt, nxt + n)))
            nxt += n
    return Trace(path.name, blocks, [None] * len(blocks), [len(b) * AZURE_BLOCK for b in blocks])


def _load(path: Path) -> Workload:
    trace = _azure_trace(path) if path.suffix == ".csv" else load_trace(path)
    return Workload.build(trace, AZURE_BLOCK if path.suffix == ".csv" else None)


def jobs(root: Path) -> list[tuple[str, Path, tuple[int, int, int]]]:
    return [(label, root / rel, caps) for label, rel, caps in TRACES]


def run_sweep_all(root: str | Path, policies: Sequence[str],
                  progress: Callable[[str], None] | None = None) -> SweepAll:
    """Replay every trace found under ``root``; ``progress(line)`` after each replay."""
    t0 = time.perf_counter()
    out = SweepAll(list(policies))
    for label, path, caps in jobs(Path(root)):
        if not path.exists():
            out.missing.append(str(path))
            continue
        work = _load(path)
        total = work.total_pages
        nxt = next_uses(work.pages)
        ceiling = infinite_hits(work.pages) / total if total else 0.0
        longest = work.longest_pages()
        per_block = work.block_size // work.page_size
        for cap_blocks in caps:
            cap = cap_blocks * per_block
            rates = {}
            for pol in policies:
                rates[pol] = simulate(work.keys, SimConfig(cap, page_tokens=work.page_size, eviction=pol),
                                      work.tree_page_size, longest_pages=longest).hit_rate
                if progress is not None:
                    progress(f"{label} @ {cap_blocks} blocks: {pol} {100 * rates[pol]:.2f}%")
            opt = belady_hits(work.pages, cap, nxt) / total if total else 0.0
            told = returning_lru_hits(work.pages, cap, nxt) / total if total else 0.0
            out.rows.append(Row(label, cap_blocks, cap_blocks * work.block_size, rates, opt, ceiling, told))
        if path.suffix == ".csv":
            continue  # the pure-miss controls: nothing to admit
        l1, l2, l3b = TIERED_SIZES.get(label, caps)
        sizes = f"L1 {_fmt_tokens(l1 * work.block_size)} / L2 {_fmt_tokens(l2 * work.block_size)}"
        for l3_label, l3 in (("unbounded", None), ("off", 0), (_fmt_tokens(l3b * work.block_size), l3b)):
            rates = {}
            for name, wp, backup in ADMISSIONS:
                if l3 == 0 and backup != "all":
                    continue
                cfg = SimConfig(l1 * per_block, l2 * per_block, None if l3 is None else l3 * per_block,
                                work.page_size, write_policy=wp, backup_policy=backup)
                rates[name] = simulate(work.keys, cfg, work.tree_page_size, longest_pages=longest).hit_rate
                if progress is not None:
                    progress(f"{label} tiered (L3 {l3_label}): {name} {100 * rates[name]:.2f}%")
            out.tiered.append(TieredRow(label, f"{sizes} / L3 {l3_label}", rates))
    out.seconds = time.perf_counter() - t0
    return out


def _fmt_tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def markdown(res: SweepAll) -> str:
    """The two tables: single tier (hit rate and fraction of Belady; the best per row in
    bold) and tiered admission."""
    pols = res.policies
    lines = ["## Single tier: hit rate (fraction of Belady)", "",
             "| trace | capacity | " + " | ".join(pols) + " | LRU told what returns | Belady | ceiling |",
             "|---|---|" + "---|" * (len(pols) + 3)]
    for r in res.rows:
        best = max(r.rates.values())
        cells = []
        for p in pols:
            v = r.rates[p]
            ratio = f" ({v / r.belady:.2f}x)" if r.belady else ""
            txt = f"{100 * v:.2f}%{ratio}"
            cells.append(f"**{txt}**" if v == best and best > 0 else txt)
        lines.append(f"| {r.trace} | {_fmt_tokens(r.capacity_tokens)} ({r.capacity_blocks:,} blocks) | "
                     + " | ".join(cells) + f" | {100 * r.returning_lru:.2f}%"
                     + (f" ({r.returning_lru / r.belady:.2f}x)" if r.belady else "")
                     + f" | {100 * r.belady:.2f}% | {100 * r.ceiling:.2f}% |")
    if res.tiered:
        names = [n for n, _w, _b in ADMISSIONS]
        lines += ["", "## Tiered (LRU): hit rate by admission", "",
                  "| trace | tiers | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for t in res.tiered:
            lines.append(f"| {t.trace} | {t.l3} | "
                         + " | ".join(f"{100 * t.rates[n]:.2f}%" if n in t.rates else "-" for n in names) + " |")
    lines += ["", f"Every trace replayed whole (no subsampling), in {res.seconds:.0f} s. The Azure traces "
              "have no prefix information: every block is unique (a pure-miss control). "
              "\"LRU told what returns\" is LRU that knows whether each block is used again (not when): "
              "not a policy, a yardstick of how much of Belady's edge is predicting what returns at all."]
    if res.missing:
        lines.append("Not found: " + ", ".join(res.missing))
    return "\n".join(lines) + "\n"


def write_csv(res: SweepAll, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["trace", "mode", "capacity_blocks", "capacity_tokens", "l3", "policy", "hit_rate", "of_belady"])
        for r in res.rows:
            extra = [("lru_told_what_returns", r.returning_lru), ("belady", r.belady), ("ceiling", r.ceiling)]
            for p, v in list(r.rates.items()) + extra:
                w.writerow([r.trace, "single", r.capacity_blocks, r.capacity_tokens, "", p, f"{v:.6f}",
                            f"{v / r.belady:.4f}" if r.belady else ""])
        for t in res.tiered:
            for n, v in t.rates.items():
                w.writerow([t.trace, "tiered", "", "", t.l3, n, f"{v:.6f}", ""])


def plot(res: SweepAll, path: str) -> bool:
    """One panel per trace with prefix information; True once written (needs matplotlib)."""
    from hicache.replay_sim.plotting import pyplot_or_none

    plt = pyplot_or_none(path)
    if plt is None:
        return False
    traces = [t for t in dict.fromkeys(r.trace for r in res.rows) if any(r.belady for r in res.rows if r.trace == t)]
    cols = 3
    nrows = max(1, -(-len(traces) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), dpi=100, squeeze=False)
    for ax, t in zip(axes.flat, traces, strict=False):
        rows = [r for r in res.rows if r.trace == t]
        xs = [r.capacity_tokens for r in rows]
        for p in res.policies:
            ax.plot(xs, [100 * r.rates[p] for r in rows], marker="o", ms=3, label=p)
        ax.plot(xs, [100 * r.belady for r in rows], "k--", marker="s", ms=3, label="Belady")
        ax.axhline(100 * rows[0].ceiling, color="grey", lw=0.8, ls=":", label="ceiling")
        ax.set_xscale("log")
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("capacity (tokens)")
        ax.set_ylabel("hit rate (%)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(traces):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True
