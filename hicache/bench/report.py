"""What every benchmark prints: figures, each with the reference measured in the same run.

A ``Figure`` holds a measured median, the reference's median, and their ratio; ``print_table``
shows them, ``write_json`` stores them (with the machine's description) for later comparison.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    value: float
    reference_name: str
    reference: float
    higher_is_better: bool = True
    goal: float | None = None

    @property
    def ratio(self) -> float:
        return self.value / self.reference if self.reference else float("nan")

    @property
    def meets_goal(self) -> bool | None:
        if self.goal is None:
            return None
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal


def interleaved_rates(
    runs: Sequence[Callable[[], int]], repeats: int, warmup: int = 1
) -> list[float]:
    """Median rates of several runs measured in alternation, so drift hits them all alike."""
    for run in runs:
        for _ in range(warmup):
            run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            n = run()
            samples[i].append(n / (time.perf_counter() - t0))
    return [statistics.median(s) for s in samples]


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def print_table(title: str, figures: Sequence[Figure]) -> None:
    rows = [("figure", "value", "reference", "ref value", "ratio", "goal")]
    for f in figures:
        goal = "" if f.goal is None else (">=" if f.higher_is_better else "<=") + f"{f.goal:g}x"
        if f.meets_goal is not None:
            goal += " ok" if f.meets_goal else " MISSED"
        rows.append((f.name, f"{_fmt(f.value)} {f.unit}", f.reference_name, f"{_fmt(f.reference)} {f.unit}",
                     f"{f.ratio:.2f}x", goal))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(title)
    for i, row in enumerate(rows):
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def write_json(path: str, benchmark: str, figures: Sequence[Figure], extra: dict[str, Any] | None = None) -> None:
    doc = {
        "benchmark": benchmark,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "figures": [dict(asdict(f), ratio=f.ratio, meets_goal=f.meets_goal) for f in figures],
    }
    if extra:
        doc.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
