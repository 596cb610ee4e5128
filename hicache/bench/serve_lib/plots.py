"""PNG plots of ``hicache bench serve`` runs (matplotlib with the Agg backend, no display).

- ``ttft_cdf(runs, path)``: the empirical CDF of TTFT, one curve per run (a comparison draws
  both runs on one plot);
- ``tier_hits(run, path)``: prompt tokens per completion-time bin, stacked by where they came
  from (L1 device, L2 host, L3 storage, computed), from the summary's ``timeline``.

Both take summary documents (``results.summarize``) and write ``path``; they raise ``OSError``
if it cannot be written. matplotlib is not a dependency of the daemon (it is in the ``bench``
extra: ``pip install "hicache[bench]"``): without it both skip their plot with a warning on
stderr and return False, so that ``hicache bench serve`` still writes ``result.json`` and
``summary.md`` of a run it has already made. They return True when the PNG was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.replay_sim.plotting import pyplot_or_none

__all__ = ["tier_hits", "ttft_cdf"]

_COLORS = {"device": "#2b8a3e", "host": "#1c7ed6", "storage": "#f59f00", "computed": "#adb5bd"}
_LABELS = {"device": "L1 device", "host": "L2 host", "storage": "L3 storage", "computed": "computed (miss)"}



def ttft_cdf(runs: Sequence[dict[str, Any]], path: str, title: str | None = None) -> bool:
    """One TTFT CDF curve (ms, log x axis when the values span more than 20x) per run."""
    plt = pyplot_or_none(path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    spans: list[float] = []
    for s in runs:
        values = sorted(r["ttft_s"] * 1000 for r in s["records"] if r["ok"] and r["ttft_s"] is not None)
        if not values:
            continue
        n = len(values)
        ys = [(i + 1) / n for i in range(n)]
        p50 = s["latency"]["ttft_s"]["p50"]
        ax.step(values, ys, where="post", label=f"{s['label']} (p50 {p50 * 1000:,.0f} ms, n={n})")
        spans.extend((values[0], values[-1]))
    if spans and min(spans) > 0 and max(spans) / min(spans) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "TTFT CDF")
    if spans:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


def tier_hits(s: dict[str, Any], path: str, title: str | None = None) -> bool:
    """Stacked bars: prompt tokens per time bin by tier, for one run."""
    plt = pyplot_or_none(path)
    if plt is None:
        return False
    tl = s["timeline"]
    width = tl["bin_s"]
    xs = [t - width / 2 for t in tl["t"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    bottom = [0] * len(xs)
    for key in ("device", "host", "storage", "computed"):
        vals = tl[key]
        ax.bar(xs, vals, width=width * 0.9, bottom=bottom, color=_COLORS[key], label=_LABELS[key])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("time since start (s), by completion")
    ax.set_ylabel(f"prompt tokens per {width:.2g} s")
    ax.set_title(title or f"prompt tokens by tier: {s['label']}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True
