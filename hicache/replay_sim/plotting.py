"""matplotlib for the commands that draw PNGs, where it is installed.

matplotlib is in the ``bench`` extra (``pip install "hicache[bench]"``), not a dependency of
the daemon: without it a plot is skipped with a warning and the command still prints its
table and writes its JSON.
"""

from __future__ import annotations

import sys
from typing import Any


def pyplot_or_none(path: str) -> Any | None:
    """pyplot on the Agg backend, or None (after a warning on stderr naming ``path``) without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"warning: matplotlib is not installed: {path} not drawn (install hicache[bench] for plots)",
              file=sys.stderr, flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_capacity_plot(plt: Any, fig: Any, ax: Any, path: str, title: str) -> None:
    """Finish a hit rate against capacity plot (log capacity axis in tokens), write it as a
    PNG at ``path`` and close it."""
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
