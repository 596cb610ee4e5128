"""``hicache replay TRACE``: offline replay of a request trace through the real tree.

Replays a Mooncake-format trace (``timestamp``, ``input_length``, ``output_length``,
chained ``hash_ids`` per block of ``B`` tokens) through ``UnifiedRadixCache`` with the tier
calls the scheduler uses, copies acknowledged at once (``hicache.replay_sim.tiered``).
Prints per tier the hit tokens, hit rate and evictions, the tokens and bytes that would
move per direction, the infinite-capacity ceiling, Belady's offline optimum at the L1
capacity (single tier), LRU told which blocks return (``bounds.returning_lru_hits``) and
every eviction policy's single-tier hit rate there as a fraction of Belady's. ``--sweep`` replays a range of capacities per policy and draws the curves
(PNG); ``--json`` writes every figure.

Capacities (``--l1``, ``--l2``, ``--l3``) are tokens (``3M``, ``65536``) or blocks
(``5859b``); ``--l3 inf`` is an unbounded store. Settings not given on the command line
come from ``--config`` (the daemon's YAML ``cache`` section) or its defaults.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hicache.replay_sim.sizes import DEFAULT_BYTES_PER_TOKEN, fmt_bytes, fmt_tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", default=None,
                        help="Mooncake-format JSON-lines trace (not with --sweep-all)")
    g = parser.add_argument_group("geometry")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per hash_ids block (default: inferred from input_length)")
    g.add_argument("--page-size", type=int, default=None,
                   help="tokens per cache page; must divide the block size (default: the block size)")
    g.add_argument("--token-level", action="store_true",
                   help="replay real synthetic token sequences (slower; same results as page ids)")
    g.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    t = parser.add_argument_group("tiers and policies")
    t.add_argument("--config", default=None, help="daemon config file whose cache section gives the defaults")
    t.add_argument("--l1", default=None, help="L1 capacity: tokens (3M) or blocks (5859b); default 3M")
    t.add_argument("--l2", default=None, help="L2 capacity (0: off; default 0, or the config's L2)")
    t.add_argument("--l3", default=None, help="L3 capacity, 'inf' for unbounded (0: off; default 0)")
    t.add_argument("--eviction", default=None, help="eviction policy of the tiered run (default lru)")
    t.add_argument("--write-policy", default=None,
                   choices=["write_through", "write_through_selective", "write_through_filtered", "write_back"])
    t.add_argument("--backup-policy", default=None, choices=["all", "filtered"],
                   help="L2 -> L3 backups: every L2 write (all, default) or a seen-twice filter once L3 is full")
    t.add_argument("--write-through-threshold", type=int, default=None)
    t.add_argument("--load-back-threshold", type=int, default=None, help="tokens (default 0)")
    t.add_argument("--prefetch-threshold", type=int, default=None, help="tokens (default 0)")
    t.add_argument("--bytes-per-token", type=int, default=None,
                   help=f"KV bytes per token for the byte figures (default {DEFAULT_BYTES_PER_TOKEN})")
    o = parser.add_argument_group("comparison and output")
    o.add_argument("--policies", default=None,
                   help="comma-separated policies to compare single-tier (default: every registered one)")
    o.add_argument("--sweep", nargs="?", const="auto", default=None, metavar="CAPS",
                   help="sweep capacities (comma-separated sizes, or nothing for an automatic range)")
    o.add_argument("--plot", default=None, help="PNG of the sweep (default: <trace>_sweep.png)")
    o.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    o.add_argument("--sweep-all", default=None, metavar="DIR",
                   help="every policy and Belady on every vendored trace under DIR at three sizes each, "
                        "and the tier admissions (hicache.replay_sim.sweep_all); writes --out .md/.csv/.png")
    o.add_argument("--out", default="policy_sweep", metavar="PREFIX", help="--sweep-all output prefix")
    o.add_argument("--no-belady", action="store_true", help="skip the Belady bound")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------- settings
def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve flags over the config file over defaults (values still as given)."""
    s: dict[str, Any] = {
        "l1": "3M", "l2": "0", "l3": "0", "eviction": "lru", "write_policy": "write_through",
        "write_through_threshold": 2, "load_back_threshold": 0, "prefetch_threshold": 0,
        "bytes_per_token": DEFAULT_BYTES_PER_TOKEN, "backup_policy": "all",
    }
    if args.config is not None:
        from hicache.config import kv_bytes_per_token, load_config

        cfg = load_config(args.config)
        c = cfg.cache
        s.update(l1=str(c.l1.tokens), l2=str(c.l2.tokens) if c.l2.enabled else "0",
                 l3="inf" if c.l3.backend != "none" else "0", eviction=c.eviction,
                 write_policy=c.write_policy, write_through_threshold=c.write_through_threshold,
                 load_back_threshold=c.load_back_threshold,
                 prefetch_threshold=c.prefetch.threshold_tokens)
        bpt = kv_bytes_per_token(cfg)
        if bpt:
            s["bytes_per_token"] = bpt
    for k in list(s):
        v = getattr(args, k, None)
        if v is not None:
            s[k] = v
    return s


def _progress(enabled: bool, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req" if desc == "replay" else "run",
                disable=not enabled or None, leave=False, file=sys.stderr)


# ---------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    from hicache.config import ConfigError
    from hicache.replay_sim.trace import TraceError

    try:
        return _run(args)
    except (TraceError, ConfigError, ValueError, OSError) as exc:
        print(f"hicache replay: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:  # noqa: C901 - a linear report
    import json

    from hicache.replay_sim.bounds import belady_hits, infinite_hits, next_uses, returning_lru_hits
    from hicache.replay_sim.sizes import parse_size
    from hicache.replay_sim.tiered import SimConfig, simulate
    from hicache.replay_sim.trace import load_trace
    from hicache.replay_sim.workload import Workload
    from hicache.tree.policy import POLICIES

    if args.sweep_all is not None:
        return _sweep_all(args, sorted(POLICIES))
    if args.trace is None:
        raise ValueError("name a trace (or --sweep-all DIR)")
    s = _settings(args)
    trace = load_trace(args.trace)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError("--limit must be >= 1")
        trace.blocks = trace.blocks[: args.limit]
        trace.timestamps = trace.timestamps[: args.limit]
        trace.input_lengths = trace.input_lengths[: args.limit]
    work = Workload.build(trace, args.block_size, args.page_size, args.token_level)
    B, P = work.block_size, work.page_size
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else sorted(POLICIES)
    for p in policies + [s["eviction"]]:
        if p not in POLICIES:
            raise ValueError(f"unknown eviction policy {p!r}; choose from {sorted(POLICIES)}")

    def pages_of(text: str, flag: str) -> int | None:
        try:
            return parse_size(str(text)).pages(B, P)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None

    l1 = pages_of(s["l1"], "--l1")
    if not l1:
        raise ValueError("--l1 must be at least one page (and bounded)")
    l2 = pages_of(s["l2"], "--l2")
    if l2 is None:
        raise ValueError("--l2 must be bounded")
    l3 = pages_of(s["l3"], "--l3")
    cfg = SimConfig(l1, l2, l3, P, s["eviction"], s["write_policy"], int(s["write_through_threshold"]),
                    int(s["load_back_threshold"]), int(s["prefetch_threshold"]), int(s["bytes_per_token"]),
                    s["backup_policy"])
    cfg.validate()
    show = not args.no_progress
    total = work.total_pages
    unique = work.unique_pages()
    longest = work.longest_pages()
    out: dict[str, Any] = {
        "trace": {"path": str(args.trace), "requests": trace.requests, "block_size": B, "page_size": P,
                  "blocks": trace.total_blocks, "tokens": total * P, "unique_pages": unique},
    }
    print(f"trace {trace.name}: {trace.requests:,} requests, {trace.total_blocks:,} blocks of {B} tokens "
          f"({fmt_tokens(total * P)} tokens), {unique:,} distinct pages of {P} tokens")

    # ---- the tiered run
    bar = _progress(show, len(work.keys), "replay")
    rep = simulate(work.keys, cfg, work.tree_page_size, bar.update, longest)
    bar.close()
    out["config"] = {k: v for k, v in rep.to_dict()["config"].items()}
    out["run"] = rep.to_dict()
    l2s = fmt_tokens(l2 * P) if l2 else "off"
    l3s = "off" if not cfg.l3_enabled else fmt_tokens(None if l3 is None else l3 * P)
    print(f"config: L1 {fmt_tokens(l1 * P)} tokens ({l1 * P / B:,.0f} blocks), L2 {l2s}, L3 {l3s}; "
          f"eviction {cfg.eviction}, write {cfg.write_policy}, backup {cfg.backup_policy}, load-back >= {cfg.load_back_threshold}, "
          f"prefetch >= {cfg.prefetch_threshold} tokens")
    print(f"\n{'tier':<5} {'capacity':>10} {'hit tokens':>14} {'hit rate':>9} {'evicted tokens':>15}")
    for t in rep.tiers:
        print(f"{t.tier:<5} {fmt_tokens(t.capacity_tokens):>10} {t.hit_tokens:>14,} {100 * t.hit_rate:>8.2f}% "
              f"{t.evicted_tokens:>15,}")
    print(f"{'all':<5} {'':>10} {rep.hit_tokens:>14,} {100 * rep.hit_rate:>8.2f}%")
    moved = ", ".join(f"{d} {fmt_tokens(rep.tokens_moved[d])} tok / {fmt_bytes(rep.bytes_moved[d])}"
                      for d in rep.tokens_moved)
    print(f"moved ({cfg.bytes_per_token:,} B/token): {moved}")
    print(f"replayed in {rep.seconds:.2f} s ({trace.requests / max(rep.seconds, 1e-9):,.0f} requests/s)")

    # ---- bounds and policies at the L1 capacity, single tier
    ceiling = infinite_hits(work.pages) / total if total else 0.0
    out["ceiling"] = ceiling
    nxt = None
    opt = None
    if not args.no_belady:
        nxt = next_uses(work.pages)
        opt = belady_hits(work.pages, l1, nxt) / total if total else 0.0
        out["belady"] = {"capacity_pages": l1, "hit_rate": opt}
        told = returning_lru_hits(work.pages, l1, nxt) / total if total else 0.0
        out["lru_told_what_returns"] = {"capacity_pages": l1, "hit_rate": told,
                                        "of_belady": told / opt if opt else None}
    print(f"\nsingle tier at L1 capacity ({fmt_tokens(l1 * P)} tokens):")
    print(f"  infinite-capacity ceiling {100 * ceiling:6.2f}%")
    if opt is not None:
        print(f"  Belady (offline optimum)  {100 * opt:6.2f}%")
        told_of = f"  ({told / opt:.2f}x Belady)" if opt else ""
        print(f"  LRU told what returns     {100 * told:6.2f}%{told_of}  (a yardstick: knows whether a block"
              " is used again, not when)")
    cmp_rows = {}
    for pol in policies:
        r = simulate(work.keys, SimConfig(l1, page_tokens=P, eviction=pol), work.tree_page_size,
                     longest_pages=longest)
        ratio = r.hit_rate / opt if opt else None
        cmp_rows[pol] = {"hit_rate": r.hit_rate, "of_belady": ratio, "seconds": r.seconds}
        tail = f"  ({ratio:.2f}x Belady)" if ratio is not None else ""
        print(f"  {pol:<25} {100 * r.hit_rate:6.2f}%{tail}")
    out["policies"] = cmp_rows

    # ---- sweep
    if args.sweep is not None:
        from hicache.replay_sim.sweep import auto_capacities, plot_sweep, run_sweep

        if args.sweep == "auto":
            caps = auto_capacities(unique)
        else:
            wanted = [pages_of(x, "--sweep") for x in args.sweep.split(",") if x.strip()]
            caps = [c for c in wanted if c is not None and c >= 1]
            if len(caps) != len(wanted):
                raise ValueError("--sweep capacities must be bounded and at least one page")
        bar = _progress(show, len(caps) * (len(policies) + 1), "sweep")
        res = run_sweep(work, caps, policies, bar.update)
        bar.close()
        print(f"\nsweep (single tier; hit rate, and as a fraction of Belady) in {res.seconds:.1f} s:")
        print(f"{'tokens':>10} {'blocks':>9} " + " ".join(f"{p:>17}" for p in policies) + f" {'Belady':>8}")
        for pt in res.points:
            cells = " ".join(f"{100 * pt.rates[p]:6.2f}% ({pt.ratio(p):.2f}x)" for p in policies)
            print(f"{fmt_tokens(pt.capacity_tokens):>10} {pt.capacity_tokens / B:>9,.0f} {cells} "
                  f"{100 * pt.belady:7.2f}%")
        plot = args.plot or f"{trace.name.rsplit('.', 1)[0]}_sweep.png"
        drawn = plot_sweep(res, plot)
        if drawn:
            print(f"plot: {plot}")
        out["sweep"] = {
            "plot": plot if drawn else None, "ceiling": res.ceiling, "seconds": res.seconds,
            "points": [{"capacity_pages": p.capacity_pages, "capacity_tokens": p.capacity_tokens,
                        "belady": p.belady, "rates": p.rates,
                        "of_belady": {q: p.ratio(q) for q in policies}} for p in res.points],
        }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2, default=str)
        print(f"json: {args.json}")
    return 0


def _sweep_all(args: argparse.Namespace, all_policies: list[str]) -> int:
    from hicache.replay_sim.sweep_all import markdown, plot, run_sweep_all, write_csv

    policies = [p.strip() for p in args.policies.split(",")] if args.policies else all_policies
    for p in policies:
        if p not in all_policies:
            raise ValueError(f"unknown eviction policy {p!r}; choose from {all_policies}")
    show = not args.no_progress

    def progress(line: str) -> None:
        if show:
            print(f"\r\033[K{line}", end="", file=sys.stderr, flush=True)

    res = run_sweep_all(args.sweep_all, policies, progress)
    if show:
        print(file=sys.stderr)
    table = markdown(res)
    with open(f"{args.out}.md", "w", encoding="utf-8") as fh:
        fh.write(table)
    write_csv(res, f"{args.out}.csv")
    print(table)
    print(f"table: {args.out}.md, {args.out}.csv")
    if plot(res, f"{args.out}.png"):
        print(f"plot: {args.out}.png")
    return 0
