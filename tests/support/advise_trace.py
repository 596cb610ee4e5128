"""The closed-form workload of ``hicache advise``'s tests, and a trace file of it.

The closed-form workload (``phases``): phase ``k`` has ``N`` documents of ``D`` pages,
each asked ``R`` times round-robin, every request followed by a fresh one-page question.
When a document comes back, page ``i`` of it has seen ``(N-1)(D+1)`` other pages and the
``i`` pages before it (which the request touched after it) since its last use, so its LRU
reuse distance is ``(N-1)(D+1) + i + 1``; the whole document hits exactly from
``N(D+1) - 1`` pages on, and a phase's pages never meet another phase's.

``A`` and ``B`` are the two phases tests/replay/test_advise.py and
tests/e2e/test_advise_daemon.py advise on.
"""

from __future__ import annotations

import json
from pathlib import Path

A = (4, 7, 5)  # knee 4*8-1 = 31 pages, 4*4*7 = 112 hits of 160
B = (10, 15, 4)  # knee 10*16-1 = 159 pages, 3*10*15 = 450 hits of 640


def phases(*specs: tuple[int, int, int]) -> list[list[int]]:
    """The closed-form workload of the module docstring, one ``(N, D, R)`` per phase."""
    out: list[list[int]] = []
    next_id = 0
    for n, d, rounds in specs:
        docs = [list(range(next_id + k * d, next_id + (k + 1) * d)) for k in range(n)]
        next_id += n * d
        for _ in range(rounds):
            for doc in docs:
                out.append(doc + [next_id])
                next_id += 1
    return out


def write_trace(path: Path, requests: list[list[int]], block: int = 16) -> None:
    path.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": block * len(r), "output_length": 1,
                                        "hash_ids": r}) + "\n" for i, r in enumerate(requests)))
