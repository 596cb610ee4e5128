"""``hicache bench serve``: drive a daemon over HTTP with a realistic workload and report
TTFT, inter-token and end-to-end latency, throughput and prompt tokens served per tier.

Targets:

- ``--url URL`` (default ``http://127.0.0.1:30080``): a daemon that is already running.
- ``--compare CONFIG_A CONFIG_B``: start each daemon itself (``python -m hicache serve
  --config ... --set server.port=FREE``), run the same workload against each, stop it with
  SIGTERM (a non-zero exit is an error), and print B against A: TTFT p50 B/A (goal <= 0.4)
  and throughput B/A (goal >= 2). A file L3 gets a fresh directory under the output folder
  unless ``--set``/``--set-a``/``--set-b`` names ``cache.l3.file.dir``.

Workloads (``--workload``): ``multi-turn`` (default), ``shared-prefix``, ``long-doc-qa``,
``trace`` (``--trace FILE``, Mooncake format). Load: closed loop with ``--clients N``
(default 4), open loop with ``--rate R`` (Poisson, ``--seed``), or a trace's own arrival
times scaled by ``--speed`` (the default for a trace whose records all have timestamps).

Output folder (``--out``, default ``bench_serve_results/<time>``): ``result.json`` (every
figure and request), ``summary.md``, ``ttft_cdf.png``, ``tier_hits.png``; with
``--compare`` one subfolder per config plus ``compare.json``, ``compare.md`` and a
``ttft_cdf.png`` with both runs. ``--json PATH`` also writes the figures in the format of
the other benchmarks.

Exit codes: 0 done; 1 some request failed or a daemon did not stop cleanly; 2 bad arguments,
a bad config or trace, or an unreachable daemon.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:30080"
WORKLOADS = ("multi-turn", "shared-prefix", "long-doc-qa", "trace")
# Per-workload defaults of the shared length flags (None = the flag has no default there).
DEFAULTS: dict[str, dict[str, int | None]] = {
    "multi-turn": {"question_len": 128, "output_len": 16, "system_len": 0},
    "shared-prefix": {"question_len": 64, "output_len": 16, "system_len": 512},
    "long-doc-qa": {"question_len": 32, "output_len": 16, "system_len": None},
    "trace": {"question_len": None, "output_len": None, "system_len": None},
}


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("target")
    t.add_argument("--url", default=None, help=f"a running daemon (default {DEFAULT_URL})")
    t.add_argument("--compare", nargs=2, metavar=("CONFIG_A", "CONFIG_B"), default=None,
                   help="start a daemon from each config in turn and compare B against A")
    t.add_argument("--set", dest="set_both", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for both --compare daemons (repeatable)")
    t.add_argument("--set-a", action="append", default=[], metavar="KEY=VALUE", help="override for CONFIG_A only")
    t.add_argument("--set-b", action="append", default=[], metavar="KEY=VALUE", help="override for CONFIG_B only")
    t.add_argument("--labels", nargs=2, metavar=("A", "B"), default=None,
                   help="names of the two runs (default: the config files' names)")
    t.add_argument("--keep-l3", action="store_true", help="keep the fresh L3 directories --compare creates")
    t.add_argument("--start-timeout", type=float, default=300.0, help="seconds a daemon may take to start")
    t.add_argument("--api-key", default=None, help="bearer token for a daemon with keys: the operator's (server.operator or "
                        "server.api_key), since /metrics and --flush are the operator's")
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="multi-turn")
    w.add_argument("--conversations", type=int, default=8, help="multi-turn: chat clients (conversations)")
    w.add_argument("--rounds", type=int, default=5, help="multi-turn: rounds per conversation")
    w.add_argument("--system-len", type=int, default=None,
                   help="multi-turn: shared system prompt (default 0); shared-prefix: per group (default 512)")
    w.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts")
    w.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: questions per system prompt")
    w.add_argument("--documents", type=int, default=4, help="long-doc-qa: documents")
    w.add_argument("--doc-len", type=int, default=1024, help="long-doc-qa: tokens per document")
    w.add_argument("--questions", type=int, default=4, help="long-doc-qa: questions per document")
    w.add_argument("--question-len", type=int, default=None,
                   help="tokens per new question (default: multi-turn 128, shared-prefix 64, long-doc-qa 32)")
    w.add_argument("--output-len", type=int, default=None,
                   help="tokens asked per request (default 16; trace: each record's output_length)")
    w.add_argument("--trace", default=None, help="trace: a Mooncake-format JSON-lines file")
    w.add_argument("--trace-limit", type=int, default=None, help="trace: only the first N records")
    w.add_argument("--block-tokens", type=int, default=None,
                   help="trace: tokens per hash id (default: the trace's block size)")
    w.add_argument("--max-prompt-len", type=int, default=None,
                   help="trace: cut prompts to this length (default: what the context leaves)")
    w.add_argument("--max-output-len", type=int, default=64,
                   help="trace: cap on the records' output_length (default 64)")
    w.add_argument("--max-token-id", type=int, default=255,
                   help="prompt token ids are drawn from 1..N (default 255, valid for every preset)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")
    ld = parser.add_argument_group("load")
    ld.add_argument("--clients", type=int, default=None, help="closed loop with N concurrent clients (default 4)")
    ld.add_argument("--rate", type=_rate, default=None, help="open loop: Poisson arrivals per second (or inf)")
    ld.add_argument("--max-concurrency", type=int, default=None, help="open loop / trace: cap on requests in flight")
    ld.add_argument("--speed", type=float, default=1.0, help="trace: time scale (2 = twice as fast)")
    ld.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests before the run (default 1)")
    ld.add_argument("--flush", action="store_true", help="flush L1 and L2 (POST /cache/flush) before the run")
    ld.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    o = parser.add_argument_group("output")
    o.add_argument("--out", default=None, help="output folder (default bench_serve_results/<time>)")
    o.add_argument("--json", default=None, metavar="PATH", help="also write the figures here (benchmark format)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------- helpers


class UsageError(ValueError):
    """A problem with the arguments (exit code 2)."""


def _pick(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name)
    if value is None:
        value = DEFAULTS[args.workload][name]
    if value is None:
        raise UsageError(f"--{name.replace('_', '-')} is needed for the {args.workload} workload")
    return int(value)


def build_workload(args: argparse.Namespace, max_context: int) -> Any:
    """The workload the arguments describe, checked against ``max_context``.

    Raises ``WorkloadError`` / ``TraceError`` (both ``ValueError``) or ``OSError``.
    """
    from hicache.bench.serve_lib import workloads as wl

    tokens = wl.TokenRange(1, args.max_token_id + 1)
    kind = args.workload
    if kind == "multi-turn":
        w = wl.multi_turn(args.conversations, args.rounds, _pick(args, "question_len"), _pick(args, "output_len"),
                          system_len=_pick(args, "system_len"), seed=args.seed, tokens=tokens)
    elif kind == "shared-prefix":
        w = wl.shared_prefix(args.groups, args.prompts_per_group, _pick(args, "system_len"),
                             _pick(args, "question_len"), _pick(args, "output_len"), seed=args.seed, tokens=tokens)
    elif kind == "long-doc-qa":
        w = wl.long_doc_qa(args.documents, args.doc_len, args.questions, _pick(args, "question_len"),
                           _pick(args, "output_len"), seed=args.seed, tokens=tokens)
    else:
        if not args.trace:
            raise UsageError("--workload trace needs --trace FILE")
        out_cap = args.output_len or args.max_output_len
        max_prompt = args.max_prompt_len or max(1, max_context - out_cap)
        w = wl.trace_workload(args.trace, block_tokens_n=args.block_tokens, limit=args.trace_limit,
                              output_len=args.output_len, max_output_len=args.max_output_len,
                              max_prompt_len=max_prompt, seed=args.seed, tokens=tokens)
    w.check_fits(max_context)
    return w


def build_load(args: argparse.Namespace, workload: Any) -> Any:
    """Closed loop unless ``--rate`` (open) or a timed trace without ``--clients`` (trace)."""
    from hicache.bench.serve_lib.driver import LoadSpec

    if args.rate is not None and args.clients is not None:
        raise UsageError("give --rate (open loop) or --clients (closed loop), not both")
    if args.rate is not None:
        return LoadSpec("open", rate=args.rate, max_concurrency=args.max_concurrency, seed=args.seed)
    if workload.name == "trace" and workload.timed and args.clients is None:
        return LoadSpec("trace", speed=args.speed, max_concurrency=args.max_concurrency, seed=args.seed)
    return LoadSpec("closed", clients=args.clients or 4, seed=args.seed)


async def _warmup(client: Any, n: int, max_token_id: int, seed: int) -> None:
    import random

    rng = random.Random(seed ^ 0x5EED)
    for i in range(n):
        prompt = [rng.randrange(1, max_token_id + 1) for _ in range(32)]
        rec = await client.generate(prompt, 2, cid=-1, turn=i, t0=0.0)
        if not rec.ok:
            raise RuntimeError(f"the warm-up request failed: {rec.error}")


async def _snapshot(client: Any) -> Any:
    from hicache.bench.serve_lib.prom import parse_counters

    text = await client.metrics_text()
    return None if text is None else parse_counters(text)


async def bench_once(url: str, label: str, args: argparse.Namespace, workload_box: dict[str, Any]) -> dict[str, Any]:
    """One run against the daemon at ``url``; the workload is built on first use from the
    daemon's context and kept in ``workload_box`` so a comparison sends the same one.
    Raises ``DaemonError`` if the daemon is unreachable."""
    from tqdm import tqdm

    from hicache.bench.serve_lib.client import HttpClient
    from hicache.bench.serve_lib.driver import drive
    from hicache.bench.serve_lib.results import summarize

    async with HttpClient(url, api_key=args.api_key, timeout_s=args.timeout) as client:
        await client.health()
        info = await client.model_info()
        if "workload" not in workload_box:
            workload_box["workload"] = build_workload(args, info.max_context)
        workload = workload_box["workload"]
        workload.check_fits(info.max_context)
        load = build_load(args, workload)
        if args.flush:
            await client.flush()
        await _warmup(client, args.warmup, args.max_token_id, args.seed)
        before = await _snapshot(client)
        bar = tqdm(total=workload.requests, desc=label, unit="req", disable=args.no_progress, file=sys.stderr,
                   dynamic_ncols=True)
        seen = {"prompt": 0, "cached": 0, "failed": 0}

        def on_done(rec: Any) -> None:
            seen["prompt"] += rec.prompt_tokens
            seen["cached"] += rec.cached_tokens
            seen["failed"] += 0 if rec.ok else 1
            bar.update(1)
            bar.set_postfix(hit=f"{seen['cached'] / max(1, seen['prompt']):.0%}",
                            ttft=f"{(rec.ttft_s or 0) * 1000:.0f}ms", failed=seen["failed"], refresh=False)

        try:
            run = await drive(client, workload, load, on_done)
        finally:
            bar.close()
        after = await _snapshot(client)
    delta = after.minus(before) if before is not None and after is not None else None
    return summarize(run, workload, load, label=label, url=url,
                     model={"name": info.name, "max_context": info.max_context}, metrics_delta=delta)


def write_run(summary: dict[str, Any], folder: Path) -> dict[str, str]:
    """``result.json``, ``summary.md``, ``ttft_cdf.png``, ``tier_hits.png`` in ``folder``;
    returns their paths by name."""
    from hicache.bench.report import write_json
    from hicache.bench.serve_lib import plots
    from hicache.bench.serve_lib.results import markdown

    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": str(folder / "result.json"), "summary": str(folder / "summary.md"),
             "ttft_cdf": str(folder / "ttft_cdf.png"), "tier_hits": str(folder / "tier_hits.png")}
    if not plots.ttft_cdf([summary], files["ttft_cdf"], title=f"TTFT CDF: {summary['label']}"):
        del files["ttft_cdf"]  # matplotlib missing: not drawn, not listed
    if not plots.tier_hits(summary, files["tier_hits"]):
        del files["tier_hits"]
    summary["files"] = files
    write_json(files["json"], "serve", [], extra=summary)
    Path(files["summary"]).write_text(markdown(summary, files), encoding="utf-8")
    return files


def _print_run(s: dict[str, Any]) -> None:
    lat, tp, c = s["latency"], s["throughput"], s["cache"]["responses"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:,.0f} ms"

    rate = "-" if c["hit_rate"] is None else f"{c['hit_rate']:.1%}"
    rps = tp["requests_per_s"] or 0.0
    print(f"{s['label']}: {s['requests']['completed']}/{s['requests']['planned']} requests in {s['duration_s']:.1f} s "
          f"({rps:.3f} req/s, {tp['output_tokens_per_s'] or 0:.1f} out tok/s); "
          f"TTFT p50 {ms(lat['ttft_s']['p50'])} p90 {ms(lat['ttft_s']['p90'])} p99 {ms(lat['ttft_s']['p99'])}; "
          f"ITL p50 {ms(lat['itl_s']['p50'])}; e2e p50 {ms(lat['e2e_s']['p50'])}")
    print(f"  prompt tokens {c['prompt']:,}: L1 {c['device']:,}  L2 {c['host']:,}  L3 {c['storage']:,}  "
          f"computed {c['computed']:,}  (hit rate {rate}); /metrics agrees: {s['cache']['metrics_match']}")


def _default_out() -> Path:
    return Path("bench_serve_results") / time.strftime("%Y%m%d-%H%M%S")


def _has_key(overrides: list[str], key: str) -> bool:
    return any(o.partition("=")[0].strip() == key for o in overrides)


# ---------------------------------------------------------------------------- modes


def _run_url(args: argparse.Namespace, out: Path) -> int:
    import asyncio

    if args.set_both or args.set_a or args.set_b or args.labels:
        raise UsageError("--set, --set-a, --set-b and --labels apply to --compare only")
    url = args.url or DEFAULT_URL
    summary = asyncio.run(bench_once(url, url.split("//")[-1], args, {}))
    files = write_run(summary, out)
    _print_run(summary)
    if args.json:
        from hicache.bench.report import write_json

        write_json(args.json, "serve", [], extra={k: v for k, v in summary.items() if k != "records"})
    print(f"wrote {', '.join(files.values())}")
    return 1 if summary["requests"]["failed"] else 0


def _run_compare(args: argparse.Namespace, out: Path) -> int:
    import asyncio
    import shutil

    from hicache.bench.report import print_table, write_json
    from hicache.bench.serve_lib import plots
    from hicache.bench.serve_lib.daemon import DaemonStopError, ManagedDaemon
    from hicache.bench.serve_lib.results import compare_figures, compare_markdown
    from hicache.config import load_config

    cfg_a, cfg_b = args.compare
    labels = args.labels or [Path(cfg_a).stem, Path(cfg_b).stem]
    if labels[0] == labels[1]:
        labels = [f"{labels[0]}-A", f"{labels[1]}-B"]
    runs: list[dict[str, Any]] = []
    box: dict[str, Any] = {}
    status = 0
    for label, cfg, own in ((labels[0], cfg_a, args.set_a), (labels[1], cfg_b, args.set_b)):
        overrides = [*args.set_both, *own]
        resolved = load_config(cfg, overrides)  # ConfigError (exit 2) before anything starts
        if args.max_token_id >= (resolved.model.reference.vocab_size or 0) and resolved.model.kind == "reference":
            raise UsageError(f"--max-token-id {args.max_token_id} is not below the vocabulary of {cfg} "
                             f"({resolved.model.reference.vocab_size})")
        folder = out / label
        l3_dir: Path | None = None
        if resolved.cache.l3.backend == "file" and not _has_key(overrides, "cache.l3.file.dir"):
            l3_dir = folder / "l3"
            if l3_dir.exists():
                shutil.rmtree(l3_dir)
            overrides.append(f"cache.l3.file.dir={l3_dir.resolve()}")
        daemon = ManagedDaemon(cfg, overrides, log_path=folder / "daemon.log")
        print(f"{label}: starting hicache serve --config {cfg} on port {daemon.port} (log {daemon.log_path})",
              flush=True)
        try:
            daemon.start(args.start_timeout)
            summary = asyncio.run(bench_once(daemon.url, label, args, box))
        finally:
            code = -1
            try:
                if daemon.proc is not None:
                    code = daemon.stop()
            except DaemonStopError as exc:
                print(f"error: {exc}", file=sys.stderr)
            finally:
                daemon.kill()
                if l3_dir is not None and not args.keep_l3:
                    shutil.rmtree(l3_dir, ignore_errors=True)
        summary["daemon"] = {"config": cfg, "overrides": overrides, "exit_code": code, "log": str(daemon.log_path)}
        if code != 0:
            print(f"error: the {label} daemon exited with {code} after SIGTERM; log {daemon.log_path}:\n"
                  f"{daemon.log_tail(2000)}", file=sys.stderr)
            status = 1
        if summary["requests"]["failed"]:
            status = 1
        files = write_run(summary, folder)
        _print_run(summary)
        print(f"  wrote {files['summary']}", flush=True)
        runs.append(summary)
    a, b = runs
    figures = compare_figures(a, b)
    print()
    print_table(f"hicache bench serve --compare ({a['workload']['name']}, {a['workload']['requests']} requests)",
                figures)
    files = {"json": str(out / "compare.json"), "summary": str(out / "compare.md"),
             "ttft_cdf": str(out / "ttft_cdf.png")}
    if not plots.ttft_cdf(runs, files["ttft_cdf"], title=f"TTFT CDF: {b['label']} vs {a['label']}"):
        del files["ttft_cdf"]
    brief = {"runs": [{k: v for k, v in s.items() if k != "records"} for s in runs]}
    write_json(files["json"], "serve", figures, extra=brief)
    if args.json:
        write_json(args.json, "serve", figures, extra=brief)
    Path(files["summary"]).write_text(compare_markdown(a, b, figures, files), encoding="utf-8")
    print(f"wrote {', '.join(files.values())}")
    return status


def run(args: argparse.Namespace) -> int:
    from hicache.bench.serve_lib.client import DaemonError
    from hicache.bench.serve_lib.daemon import DaemonStartError
    from hicache.bench.serve_lib.workloads import TraceError, WorkloadError
    from hicache.config import ConfigError

    if args.compare and args.url:
        print("hicache bench serve: give --url or --compare, not both", file=sys.stderr)
        return 2
    if not 1 <= args.max_token_id:
        print("hicache bench serve: --max-token-id must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else _default_out()
    try:
        return _run_compare(args, out) if args.compare else _run_url(args, out)
    except (UsageError, WorkloadError, TraceError, ConfigError, OSError, DaemonError, DaemonStartError) as exc:
        print(f"hicache bench serve: {exc}", file=sys.stderr)
        return 2
