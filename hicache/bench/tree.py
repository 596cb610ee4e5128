"""``hicache bench tree``: radix-tree operations on a seeded chat workload.

About 2,000 requests from ~400 conversations: shared system prompts of 1-4k tokens, each
turn's input = previous input + previous output + a new message of 50-500 tokens, outputs of
50-300 tokens, vocabulary 32,000. Per request: match -> lock -> insert(input+output) ->
unlock -> evict to capacity (200,000 tokens), through the full ``UnifiedRadixCache`` with its
real page allocator. Reported per page size: requests/s, matched tokens/s, hit rate and peak
RSS (the process peak so far), each the median of ``--repeats`` runs after a warm-up; only
the request loop is timed (building the cache and its allocator is not).

Requests carry their token ids as ``array('I')`` and the page allocator is a bare free list
(``checked=False``), matching the reference's mock allocator. It runs once with page indices
as ``list[int]`` (the allocator's default) and once as ``array('q')`` (``array_indices=True``:
no per-index Python objects, which matters at page size 1 where every token is a page); the workload is frozen out of
the garbage collector's scans (``gc.freeze()``), as a long-running server does.

With both index kinds (the default), the table gives the ``array`` figure of each page size
against the ``list`` one measured in the same invocation. The comparison with SGLang's trees
(its ``RadixCache`` and its ``UnifiedRadixCache`` with the Rust tree core) is not made here:
it needs SGLang's own code, which this repository does not carry, so a separate peer harness
runs SGLang's trees and this one on this workload in one invocation.
"""

from __future__ import annotations

import argparse
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.memory.allocator import PageIndices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-sizes", default="1,16,64", help="comma-separated page sizes")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--system-prompts", type=int, default=24)
    parser.add_argument("--capacity", type=int, default=200_000, help="cache capacity in tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="lru", help="eviction policy (lru, slru)")
    parser.add_argument("--indices", choices=("list", "array", "both"), default="both",
                        help="page-index kind the allocator hands out (list[int] or array('q'))")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def make_workload(requests: int, conversations: int, system_prompts: int, seed: int,
                  vocab: int = 32000) -> list[tuple[array[int], array[int]]]:
    """``(input_ids, output_ids)`` per request, in arrival order (seeded). Token ids are
    ``array('I')``, the form a request carries them in (see ``hicache.tree.node.Key``)."""
    import random

    rng = random.Random(seed)

    def toks(n: int) -> array[int]:
        return array("I", [rng.randrange(vocab) for _ in range(n)])

    prompts = [toks(rng.randint(1000, 4000)) for _ in range(system_prompts)]
    turns_left = [0] * conversations
    for _ in range(requests):
        turns_left[rng.randrange(conversations)] += 1
    history: list[array[int] | None] = [None] * conversations
    active = [i for i in range(conversations) if turns_left[i]]
    out: list[tuple[array[int], array[int]]] = []
    while active:
        j = rng.randrange(len(active))
        conv = active[j]
        prev = history[conv]
        base = prompts[conv % system_prompts] if prev is None else prev
        inp = base + toks(rng.randint(50, 500))
        outp = toks(rng.randint(50, 300))
        out.append((inp, outp))
        history[conv] = inp + outp
        turns_left[conv] -= 1
        if not turns_left[conv]:
            active[j] = active[-1]
            active.pop()
    return out


def _joined(a: PageIndices, b: PageIndices) -> PageIndices:
    """``a + b``: two runs from one allocator, so both lists or both arrays."""
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, array) and isinstance(b, array):
        return a + b
    raise TypeError(f"page runs of two kinds: {type(a).__name__} and {type(b).__name__}")


def run_workload(workload: list[tuple[array[int], array[int]]], page_size: int, capacity: int,
                 policy: str = "lru", array_indices: bool = False) -> tuple[int, int, int, float]:
    """Replay once through a fresh cache; returns (requests, matched tokens, input tokens,
    seconds spent in the request loop)."""
    import time

    from hicache.memory.allocator import PageAllocator
    from hicache.tree.cache import UnifiedRadixCache
    from hicache.tree.components import FullComponent

    max_req = max(len(i) + len(o) for i, o in workload)
    cap_pages = capacity // page_size
    # a bare free list, like the reference's mock allocator (no double-free tracking)
    alloc = PageAllocator(cap_pages + max_req // page_size + 2, checked=False, array_indices=array_indices)
    cache = UnifiedRadixCache([FullComponent(alloc)], page_size, eviction_policy=policy)
    ps = page_size
    matched = 0
    total_in = 0
    core = cache.core
    t0 = time.perf_counter()
    for inp, outp in workload:
        m = cache.match_prefix(inp)
        cache.record_hit(m)  # admitted at once: its hit counted (as a scheduler does)
        lock = cache.inc_lock_ref(m.last_device_node)
        seq = inp + outp
        have = len(m.device_indices)
        need = -(-len(seq) // ps) - have
        new = alloc.alloc(need)
        if new is None:
            cache.evict(need * ps)
            new = alloc.alloc(need)
            if new is None:
                raise RuntimeError("benchmark: out of pages with everything unlocked")
        pages = _joined(m.device_indices, new)
        aligned = len(seq) // ps
        r = cache.insert(seq, pages, prev_prefix_len=m.device_len)
        dup = pages[have:r.prefix_len // ps]
        if dup:
            alloc.free(dup)
        if aligned < len(pages):
            alloc.free(pages[aligned:])
        cache.dec_lock_ref(lock)
        over = core.dev_total[0] - cap_pages
        if over > 0:
            cache.evict(over * ps)
        matched += m.device_len
        total_in += len(inp)
    return len(workload), matched, total_in, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    import gc
    import resource
    import statistics
    import time

    from hicache.bench.report import Figure, print_table, write_json

    sizes = [int(x) for x in args.page_sizes.split(",") if x.strip()]
    kinds = ["list", "array"] if args.indices == "both" else [args.indices]
    t0 = time.perf_counter()
    workload = make_workload(args.requests, args.conversations, args.system_prompts, args.seed)
    print(f"workload: {len(workload)} requests, {sum(len(i) for i, _ in workload):,} input tokens "
          f"(built in {time.perf_counter() - t0:.1f}s)")
    gc.collect()
    gc.freeze()  # the workload is long-lived: keep it out of the collector's scans, as a server would
    figures: list[Figure] = []
    extra: dict[str, dict[str, float]] = {}
    for kind in kinds:
        as_array = kind == "array"
        for ps in sizes:
            run_workload(workload, ps, args.capacity, args.policy, as_array)  # warm-up
            rates, mrates = [], []
            hit = 0.0
            for _ in range(args.repeats):
                gc.collect()
                n, matched, total, dt = run_workload(workload, ps, args.capacity, args.policy, as_array)
                rates.append(n / dt)
                mrates.append(matched / dt)
                hit = matched / total
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            req_s, tok_s = statistics.median(rates), statistics.median(mrates)
            if as_array and f"{ps}/list" in extra:
                figures.append(Figure(f"requests/s, page {ps}, array indices", "req/s", req_s,
                                      "list indices, same run", extra[f"{ps}/list"]["requests_per_s"]))
            print(f"page {ps:>2}, {kind:<5} indices: {req_s:>8,.0f} req/s, {tok_s:>13,.0f} matched tokens/s, "
                  f"hit rate {hit:.1%}, peak RSS {rss_mb:,.0f} MiB")
            extra[f"{ps}/{kind}"] = {"requests_per_s": req_s, "matched_tokens_per_s": tok_s,
                                     "hit_rate": hit, "peak_rss_mib": rss_mb}
    if figures:
        print_table("hicache bench tree (reference: list page indices, measured in the same run)", figures)
    if args.json:
        write_json(args.json, "tree", figures, {"per_config": extra, "policy": args.policy})
    return 0
