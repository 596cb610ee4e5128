"""The order in which waiting requests are considered for admission (``scheduler.policy``).

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first (by the last pass's match), then arrival order.
- ``dfs-weight``: requests sharing a prefix go together: requests are grouped by the tree
  node their match ended on, and groups with more waiting requests go first (the first
  seed's depth-first weighting, flattened to one level).
- ``random``: a seeded shuffle (a baseline).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class _Waiting(Protocol):
    arrival: float


W = TypeVar("W", bound=_Waiting)


def order_waiting(requests: Sequence[W], policy: str, match_len: Callable[[W], int],
                  group_of: Callable[[W], object], rng: random.Random) -> list[W]:
    """``requests`` in the order the policy considers them (a new list)."""
    reqs = list(requests)
    if policy == "fcfs":
        return sorted(reqs, key=lambda r: r.arrival)
    if policy == "lpm":
        return sorted(reqs, key=lambda r: (-match_len(r), r.arrival))
    if policy == "dfs-weight":
        groups: dict[int, list[W]] = {}
        for r in sorted(reqs, key=lambda r: r.arrival):
            groups.setdefault(id(group_of(r)), []).append(r)
        ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0].arrival))
        return [r for g in ordered for r in g]
    if policy == "random":
        rng.shuffle(reqs)
        return reqs
    raise ValueError(f"unknown scheduler policy {policy!r}")
