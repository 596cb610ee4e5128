"""``hicache advise TRACE``: tier sizes and a config from the operator's own traffic.

Reads a Mooncake-format trace, or the request log the daemon writes when
``server.request_log`` is set (the same format, with 64-bit page hashes as ids). Prints:

- a grid of capacities, each with LRU's hit rate, the prefill tokens it saves and Belady's
  offline optimum for one cache of that size;
- each tier (L1, L2, L3) at its knee within its budget: the size past which growing it adds
  at most ``--gain`` points, what it serves, Belady beside it; a tier that adds no more than
  that is left off;
- the recommended sizes replayed through the real tree with each eviction policy (the
  figure ``hicache bench serve`` replaying the same trace should reach);
- the recommended config, written as YAML with ``--write`` (over ``--config`` when given).

The model behind the sizes is in ``hicache.replay_sim.advice``. Budgets (``--l1-max``,
``--l2-max``, ``--l3-max``) default to the sizes in ``--config`` (or the embedded defaults)
for L1 and L2, and unbounded for L3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.replay_sim.sizes import DEFAULT_BYTES_PER_TOKEN, fmt_bytes, fmt_tokens

if TYPE_CHECKING:
    from hicache.config import HicacheConfig
    from hicache.replay_sim.advice import Advice, Advisor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake-format JSON-lines trace, or a server.request_log file")
    g = parser.add_argument_group("geometry")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per hash id (default: inferred from input_length)")
    g.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the block size)")
    g.add_argument("--limit", type=int, default=None, help="only the first N requests")
    b = parser.add_argument_group("budgets")
    b.add_argument("--config", default=None, help="daemon config: budgets, bytes per token, base of --write")
    b.add_argument("--l1-max", default=None, help="most L1 may have: tokens (3M) or blocks (5859b)")
    b.add_argument("--l2-max", default=None, help="most L2 may have (0: no L2)")
    b.add_argument("--l3-max", default=None, help="most L3 may have, 'inf' for no limit (0: no L3; default inf)")
    b.add_argument("--gain", type=float, default=1.0,
                   help="points of hit rate a tier must add to be worth growing (default 1)")
    b.add_argument("--headroom", type=float, default=10.0,
                   help="percent added to each tier's knee (a knee is often a cliff; default 10)")
    b.add_argument("--bytes-per-token", type=int, default=None,
                   help=f"KV bytes per token (default: from --config's model, else {DEFAULT_BYTES_PER_TOKEN})")
    o = parser.add_argument_group("output")
    o.add_argument("--policies", default=None, help="eviction policies to replay, comma-separated (default: all)")
    o.add_argument("--grid-belady", action="store_true",
                   help="Belady for every row of the grid, not only beside the tiers (one pass per row)")
    o.add_argument("--workers", type=int, default=None,
                   help="processes for the Belady runs and replays (default: one per core)")
    o.add_argument("--write", default=None, metavar="PATH", help="write the recommended config as YAML")
    o.add_argument("--plot", default=None, help="PNG of the curves (default: <trace>_advice.png)")
    o.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")


def run(args: argparse.Namespace) -> int:
    from hicache.config import ConfigError
    from hicache.replay_sim.trace import TraceError

    try:
        return _run(args)
    except (TraceError, ConfigError, ValueError, OSError) as exc:
        print(f"hicache advise: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    from hicache.config import config_from_dict, kv_bytes_per_token, load_config
    from hicache.replay_sim.advice import Advisor, Budgets
    from hicache.replay_sim.sizes import parse_size
    from hicache.replay_sim.trace import load_trace
    from hicache.replay_sim.workload import Workload
    from hicache.tree.policy import POLICIES

    t0 = time.perf_counter()
    cfg = load_config(args.config) if args.config is not None else config_from_dict({})
    trace = load_trace(args.trace)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError("--limit must be >= 1")
        trace.blocks = trace.blocks[: args.limit]
    if not trace.requests:
        raise ValueError(f"{args.trace}: the trace has no requests")
    work = Workload.build(trace, args.block_size, args.page_size)
    B, P = work.block_size, work.page_size
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else sorted(POLICIES)
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown eviction policy {p!r}; choose from {sorted(POLICIES)}")
    if not 0 < args.gain < 100:
        raise ValueError("--gain must be between 0 and 100 points")
    if not 0 <= args.headroom <= 100:
        raise ValueError("--headroom must be between 0 and 100 percent")
    # Without --config, the embedded reference model's tiny KV would understate every size.
    bpt = args.bytes_per_token or (kv_bytes_per_token(cfg) if args.config else None) or DEFAULT_BYTES_PER_TOKEN

    def pages_of(text: str, flag: str) -> int | None:
        try:
            return parse_size(str(text)).pages(B, P)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None

    c = cfg.cache
    l1 = pages_of(args.l1_max if args.l1_max is not None else str(c.l1.tokens), "--l1-max")
    l2 = pages_of(args.l2_max if args.l2_max is not None else str(c.l2.tokens if c.l2.enabled else 0), "--l2-max")
    l3 = pages_of(args.l3_max if args.l3_max is not None else "inf", "--l3-max")
    if not l1:
        raise ValueError("--l1-max must be bounded and at least one page")
    if l2 is None:
        raise ValueError("--l2-max must be bounded")
    budgets = Budgets(l1, l2, l3)

    advisor = Advisor(work)
    t_profile = time.perf_counter() - t0
    workers = args.workers or os.cpu_count() or 1
    advice = advisor.advise(budgets, policies, args.gain / 100, args.headroom / 100, args.grid_belady, bpt,
                            workers)
    seconds = time.perf_counter() - t0
    _print(trace.name, trace.requests, advice, bpt)
    print(f"\nadvised in {seconds:.1f} s (reuse profile {t_profile:.2f} s; "
          f"{trace.requests / max(seconds, 1e-9):,.0f} requests/s)")

    doc = _document(args.trace, trace.requests, B, advice, bpt, seconds)
    served = logged_hit_rate(args.trace, args.limit)
    if served is not None:
        print(f"the daemon that wrote this request log served {100 * served:.2f}% of its prompt tokens from its "
              f"tiers; the advised config: {100 * advice.predicted_hit_rate:.2f}%")
        doc["logged_hit_rate"] = served
    if args.write:
        raw = recommended_config(args.config, advice, bpt)
        _write_yaml(raw, args.write)
        print(f"config: {args.write}")
        advised_l1 = advice.tier("L1").pages * advice.page_tokens
        if raw["cache"]["l1"]["tokens"] > advised_l1:
            print(f"  L1 written as {raw['cache']['l1']['tokens']:,} tokens, above the advised {advised_l1:,}: "
                  "running requests need one prefill and a chunk of L1 (scheduler.max_prefill_tokens + "
                  "chunked_prefill_tokens)")
        doc["config"] = raw
    plot = args.plot or f"{Path(trace.name).stem}_advice.png"
    if plot_advice(advisor, advice, plot, title=f"{trace.name}: hit rate by capacity"):
        print(f"plot: {plot}")
        doc["plot"] = plot
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
        print(f"json: {args.json}")
    return 0


def _print(name: str, requests: int, advice: Advice, bpt: int) -> None:
    P = advice.page_tokens
    print(f"trace {name}: {requests:,} requests, {fmt_tokens(advice.total_pages * P)} prompt tokens in pages "
          f"of {P}, {advice.unique_pages:,} distinct pages; ceiling (unbounded cache) {100 * advice.ceiling:.2f}%")
    print("\ngrid (one LRU cache of each size; Belady = offline optimum; saved = prefill tokens not computed):")
    print(f"{'tokens':>10} {'KV bytes':>11} {'LRU':>8} {'saved':>10} {'Belady':>8} {'LRU/Belady':>10}")
    for row in advice.grid:
        opt = "" if row.belady is None else f"{100 * row.belady:7.2f}%"
        ratio = "" if not row.belady else f"{row.lru / row.belady:9.2f}x"
        print(f"{fmt_tokens(row.pages * P):>10} {fmt_bytes(row.pages * P * bpt):>11} {100 * row.lru:7.2f}% "
              f"{fmt_tokens(round(row.lru * advice.total_pages) * P):>10} {opt:>8} {ratio:>10}")
    print(f"\ntiers (knee: past it, growing to the budget adds <= {100 * advice.gain:g} point; "
          f"advised: the knee + {100 * advice.headroom:g} %, within the budget):")
    print(f"{'tier':<4} {'budget':>10} {'knee':>10} {'knee adds':>9} {'advised':>10} {'serves':>8} "
          f"{'cumulative':>10} {'Belady':>8}")
    for t in advice.tiers:
        size = fmt_tokens(t.pages * P) if t.pages else "off"
        budget = fmt_tokens(None if t.budget is None else t.budget * P) if t.budget != 0 else "0"
        opt = "" if t.belady is None else f"{100 * t.belady:7.2f}%"
        print(f"{t.tier:<4} {budget:>10} {fmt_tokens(t.knee * P):>10} {100 * t.knee_gain:8.2f}% {size:>10} "
              f"{100 * t.served:7.2f}% {100 * t.cumulative:9.2f}% {opt:>8}")
    if advice.policies:
        print("\nthe advised sizes through the real tree, per eviction policy (hit rate by tier):")
        print(f"{'policy':<8} {'L1':>8} {'L2':>8} {'L3':>8} {'all':>8} {'saved':>10}")
        for pol, rep in advice.policies.items():
            by = {t.tier: t.hit_rate for t in rep.tiers}
            cells = " ".join(f"{100 * by[x]:7.2f}%" if x in by else f"{'-':>8}" for x in ("L1", "L2", "L3"))
            mark = "  <- advised" if pol == advice.best_policy else ""
            print(f"{pol:<8} {cells} {100 * rep.hit_rate:7.2f}% {fmt_tokens(rep.hit_tokens):>10}{mark}")


def _document(path: str, requests: int, block: int, advice: Advice, bpt: int, seconds: float) -> dict[str, Any]:
    P = advice.page_tokens
    return {
        "trace": {"path": str(path), "requests": requests, "block_size": block, "page_size": P,
                  "tokens": advice.total_pages * P, "unique_pages": advice.unique_pages},
        "bytes_per_token": bpt, "ceiling": advice.ceiling, "gain": advice.gain, "headroom": advice.headroom, "seconds": seconds,
        "grid": [{"tokens": r.pages * P, "lru": r.lru, "belady": r.belady} for r in advice.grid],
        "tiers": [{"tier": t.tier, "tokens": t.pages * P, "budget_tokens": None if t.budget is None else t.budget * P,
                   "knee_tokens": t.knee * P, "knee_gain": t.knee_gain, "serves": t.served,
                   "cumulative": t.cumulative, "belady": t.belady} for t in advice.tiers],
        "policies": {p: {"hit_rate": r.hit_rate, "tiers": {t.tier: t.hit_rate for t in r.tiers}}
                     for p, r in advice.policies.items()},
        "best_policy": advice.best_policy, "predicted_hit_rate": advice.predicted_hit_rate,
    }


def recommended_config(base: str | None, advice: Advice, bpt: int) -> dict[str, Any]:
    """The YAML mapping of ``base`` (a config file; None: empty) with the advised tier sizes and
    policy set, checked by the config loader (``ConfigError`` if the result is not valid).
    L1 gets at least ``written_l1_floor``; L2 at least L1, and stays on (at least the
    tenants' quotas) where the base config's quotas or pins need it; a file L3 stays larger
    than the base's tenant partitions (``quota.l3_gb``)."""
    import yaml

    from hicache.config import config_from_dict

    raw: dict[str, Any] = {}
    if base is not None:
        raw = yaml.safe_load(Path(base).read_text(encoding="utf-8")) or {}
    cfg = config_from_dict(raw)
    cache = raw.setdefault("cache", {})
    P = advice.page_tokens
    page = cfg.cache.page_size
    l1, l2, l3 = (advice.tier(t).pages * P for t in ("L1", "L2", "L3"))
    cache.setdefault("l1", {})["tokens"] = l1_tokens = max(written_l1_floor(cfg), -(-l1 // page) * page)
    # what the base config itself needs of L2: its tenants' quotas reserve it, pins may name it
    quotas = sum(k.quota.l2_tokens for k in cfg.server.api_keys if k.quota is not None)
    partitions = sum(k.quota.l3_gb for k in cfg.server.api_keys if k.quota is not None)
    if quotas or partitions or any(p.tiers is not None and "l2" in p.tiers for p in cfg.cache.pinned):
        l2 = max(l2, quotas, page)  # (L3 is read into and written from L2)
    l2_section = cache.setdefault("l2", {})
    l2_section["enabled"] = bool(l2)
    if l2:
        l2_section["tokens"] = max(l1_tokens, -(-l2 // page) * page)  # L2 holds what L1 holds
    l3_section = cache.setdefault("l3", {})
    if not l3 and not partitions:
        l3_section["backend"] = "none"
    else:
        backend = cfg.cache.l3.backend if cfg.cache.l3.backend != "none" else "file"
        l3_section["backend"] = backend
        if backend == "file":
            gb = -(-l3 * bpt // 10**6) / 1000  # whole megabytes, in GB
            # the tenants' partitions are carved from it: it stays larger than they are
            l3_section.setdefault("file", {})["max_size_gb"] = max(gb, round(partitions + 0.001, 3))
    if advice.best_policy is not None:
        cache["eviction"] = advice.best_policy
    config_from_dict(raw)
    return raw


def logged_hit_rate(path: str, limit: int | None) -> float | None:
    """Cached over prompt tokens of a ``server.request_log`` (its ``cached_tokens``); None for
    a trace without them."""
    import json

    cached = prompt = 0
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if limit is not None and n >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            c, p = rec.get("cached_tokens"), rec.get("input_length")
            if type(c) is not int or type(p) is not int:
                return None
            cached, prompt = cached + c, prompt + p
    return cached / prompt if prompt else None


def written_l1_floor(cfg: HicacheConfig) -> int:
    """The least L1 a written config gets: room for one prefill at its largest and a chunk
    (``scheduler.max_prefill_tokens`` + ``chunked_prefill_tokens``, whole pages), what the
    running requests need whatever the cache holds. The hit rates are those of the advised
    size or more."""
    s, page = cfg.scheduler, cfg.cache.page_size
    return -(-(s.max_prefill_tokens + min(s.chunked_prefill_tokens, s.max_prefill_tokens)) // page) * page


def _write_yaml(raw: dict[str, Any], path: str) -> None:
    import yaml

    header = "# written by `hicache advise`: tier sizes at their knees, eviction by replay\n"
    Path(path).write_text(header + yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")


def plot_advice(advisor: Advisor, advice: Advice, path: str, title: str) -> bool:
    """The LRU curve, Belady's points and the advised tier sizes as a PNG; False (with a
    warning) when matplotlib is not installed."""
    import numpy as np

    from hicache.replay_sim.plotting import pyplot_or_none, save_capacity_plot

    plt = pyplot_or_none(path)
    if plt is None:
        return False

    P = advice.page_tokens
    top = max(2, advice.unique_pages)
    xs = np.unique(np.geomspace(1, top, 200).astype(np.int64))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.plot(xs * P, [100 * advisor.profile.hit_rate(int(x)) for x in xs], label="LRU")
    opt = [(r.pages * P, 100 * r.belady) for r in advice.grid if r.belady is not None]
    if opt:
        ax.plot(*zip(*opt, strict=True), "k--", marker="s", ms=3, label="Belady (offline optimum)")
    ax.axhline(100 * advice.ceiling, color="grey", lw=0.8, ls=":", label="unbounded cache")
    for t, colour in zip(advice.tiers, ("tab:red", "tab:orange", "tab:green"), strict=True):
        if t.pages:
            ax.axvline(t.pages * P, color=colour, lw=1, label=f"{t.tier} advised")
    save_capacity_plot(plt, fig, ax, path, title)
    return True
