"""Compare eviction policies on the replay traces (not collected by pytest; run it directly).

    python -m tests.tree.policy_comparison [TRACE_DIR]

Prints the block-level prefix hit rate of every policy next to the LRU and Belady (OPT)
references from the traces' README.
"""

from __future__ import annotations

import os
import sys
import time

from hicache.tree.policy import POLICIES
from hicache.tree.replay_core import load_mooncake, replay

# (file, capacity in blocks, README LRU %, README OPT %)
CASES = [
    ("mooncake/conversation_trace.jsonl", 1000, 4.5, 19.1),
    ("mooncake/conversation_trace.jsonl", 5859, 13.6, 35.3),
    ("mooncake/conversation_trace.jsonl", 20000, 28.8, 36.6),
    ("mooncake/synthetic_trace.jsonl", 1000, 8.4, 27.7),
    ("mooncake/synthetic_trace.jsonl", 5859, 30.9, 55.0),
    ("mooncake/synthetic_trace.jsonl", 10000, 42.4, 61.8),
    ("synthetic/sglang_hicache_blog_multiturn_p64.jsonl", 10000, 26.2, 53.3),
    ("synthetic/sglang_hicache_blog_multiturn_p64.jsonl", 20000, 68.7, 78.9),
    ("synthetic/sglang_gsp_default_p64.jsonl", 1024, 39.2, 69.7),
    ("synthetic/sglang_gsp_default_p64.jsonl", 2048, 75.6, 88.2),
    ("synthetic/lmcache_mrqa_readme_c256.jsonl", 100, 23.2, 77.1),
    ("synthetic/lmcache_mrqa_readme_c256.jsonl", 200, 77.1, 77.1),
]


def main(trace_dir: str) -> int:
    policies = sorted(POLICIES)
    header = f"{'trace':<44} {'C':>6} {'LRU ref':>8} {'OPT ref':>8} " + " ".join(f"{p:>7}" for p in policies)
    print(header)
    cache: dict[str, list[list[int]]] = {}
    for name, cap, lru_ref, opt_ref in CASES:
        path = os.path.join(trace_dir, name)
        if not os.path.exists(path):
            print(f"{name}: missing, skipped")
            continue
        reqs = cache.setdefault(path, load_mooncake(path))
        t = time.perf_counter()
        rates = [replay(reqs, cap, p).hit_rate * 100 for p in policies]
        cells = " ".join(f"{r:6.1f}%" for r in rates)
        print(f"{name:<44} {cap:>6} {lru_ref:7.1f}% {opt_ref:7.1f}% {cells}   ({time.perf_counter() - t:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/traces"))
