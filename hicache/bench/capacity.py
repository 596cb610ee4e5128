"""``hicache bench capacity``: what one engine-mode daemon sustains for a node of engines.

No model and no vLLM: ``--engines`` simulated engines (``capacity_lib.engine_sim``), each a
process of its own, speak the engine protocol through the connector's own client and copy
pages in and out of the daemon's real shared L2 pool, with prompts from a Mooncake-format
trace (the vendored conversation trace by default; ``capacity_lib.traffic``). The daemon runs
in engine mode over a checkpoint directory that holds only a ``config.json`` (a one-layer
model whose page has ``--page-bytes`` bytes, so millions of pages fit in memory;
``capacity_lib.daemon``).

The load is stepped: level ``f`` runs every engine at ``f`` times the profile's steps and
arrivals per second (the same requests in flight), each level for ``--duration`` seconds
after ``--warmup``. The daemon is started once and keeps its cache across levels. Levels
start at 1 and double while the answers' p99 stays within ``P99_GOAL_MS`` (or halve while it
does not); the **knee** is the highest level whose p99 met it.

Per level, each against its reference measured in the same run:

- the answers' round trip, p50 / p99 / max, per message kind (``Lookup``, ``Reserve``),
  against a bare ZeroMQ round trip of the same request and answer sizes (``reference``), run
  right after the level on the same machine;
- the daemon's CPU (cores, and seconds per thousand requests), its processes read from
  ``/proc``, apart from the simulated engines' own CPU;
- pages committed, loaded, backed up to L3 and prefetched per second (the daemon's stats);
- steps that started late, and calls that got no answer within the connector's timeout.

With ``--flood N`` every level runs twice: first with every engine at the level's rate (the
reference), then with engine 0 at ``N`` times it (the others unchanged). The fairness figure
is the worst p99 of the other engines' answers with the flooder against the same engines'
worst p99 in the reference run (goal: at most ``FLOOD_RATIO_GOAL`` times); the flooder's own
p99 and the ``busy`` answers it got are reported beside it.

Writes ``capacity.json`` (figures with value, reference, ratio, goal, meets_goal, and every
level's numbers) and ``capacity.png`` (latency against load) in ``--out``; prints a progress
line every few seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.capacity_lib.daemon import Daemon, Sample, write_config, write_model
from hicache.bench.capacity_lib.traffic import PROFILES, Load, Profile

P99_GOAL_MS = 1.0
BARE_RATIO_GOAL = 5.0
CPU_GOAL_CORES = 0.5
KNEE_GOAL = 8.0
MAX_LEVEL = 64.0
MIN_LEVEL = 1 / 16
PROGRESS_EVERY_S = 5.0
ENGINE_TIMEOUT_MS = 1000
"""The simulated engines' wait for an answer (a call past it counts as unanswered)."""
BARE_ROUND_TRIPS = 2000
FLOOD_RATIO_GOAL = 2.0
"""One engine at ``--flood`` times its share raises another's p99 by this factor at most."""
KINDS = ("lookup", "reserve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), default="node",
                        help="a named preset (docs/benchmarks.md 'Sizing a node'); the flags below change parts of it")
    parser.add_argument("--engines", type=int, help="simulated engines (processes)")
    parser.add_argument("--steps-per-s", type=float, help="scheduler steps per second of each engine")
    parser.add_argument("--running", type=int, help="requests in flight per engine")
    parser.add_argument("--new-per-s", type=float, help="new requests per second per engine")
    parser.add_argument("--page-size", type=int, help="tokens per page (the engines' block size)")
    parser.add_argument("--page-bytes", type=int, default=512,
                        help="bytes of one page (a multiple of 4 x page size; default 512)")
    parser.add_argument("--l2-pages", type=int, help="L2 pages")
    parser.add_argument("--l3", choices=["none", "file", "redis"], help="the L3 store")
    parser.add_argument("--trace", help="a Mooncake-format trace (default: the vendored conversation trace)")
    parser.add_argument("--max-prompt-tokens", type=int, default=32768)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=8.0, help="unmeasured seconds before each level")
    parser.add_argument("--levels", default="auto",
                        help="'auto' (step until the knee), or load factors, e.g. 1,2,4")
    parser.add_argument("--flood", type=float, default=0.0, metavar="N",
                        help="also run each level with engine 0 at N times the level's rate, against the level "
                             "with every engine at its rate (the fairness figure)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="a daemon config override (repeatable)")
    parser.add_argument("--out", help="output directory (default bench_capacity_results/<time>)")
    parser.add_argument("--json", help="also write the JSON here")


@dataclass
class Level:
    """What one load level measured."""

    factor: float
    rtt_us: dict[str, dict[str, float]] = field(default_factory=dict)
    bare_us: dict[str, dict[str, float]] = field(default_factory=dict)
    daemon_cores: float = 0.0
    process_cores: dict[str, float] = field(default_factory=dict)
    """The daemon's cores per process (launcher, tokenizer, scheduler: the cache server, controller)."""
    engines_cores: float = 0.0
    requests: int = 0
    daemon_cpu_s_per_1k_requests: float = 0.0
    rates: dict[str, float] = field(default_factory=dict)
    late_steps: int = 0
    steps: int = 0
    unanswered: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    flood: float = 1.0
    """Engine 0's rate, times the level's (``--flood``); 1: every engine at the level's."""
    engine_p99_us: list[float] = field(default_factory=list)
    """Each engine's p99 of its answers (lookups and reserves together), by engine index."""
    busy: list[int] = field(default_factory=list)
    """Each engine's lookups and reserves answered ``busy``, by engine index ..."""
    answers: list[int] = field(default_factory=list)
    """... and all its answers."""

    @property
    def p99_ms(self) -> float:
        return max((r["p99"] for r in self.rtt_us.values() if r), default=float("nan")) / 1000


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(0.99 * len(s)))], "max": s[-1], "n": len(s)}


def _profile(args: argparse.Namespace) -> Profile:
    p = PROFILES[args.profile]
    load = Load(args.steps_per_s or p.load.steps_per_s, args.running or p.load.running,
                args.new_per_s or p.load.new_per_s, p.load.max_batched_tokens)
    return Profile(p.name, args.engines or p.engines, load, args.page_size or p.page_size,
                   args.l2_pages or p.l2_pages, args.l3 or p.l3, p.source)


def default_trace() -> Path | None:
    """The vendored Mooncake conversation trace of a source checkout, if there is one."""
    here = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces" / "mooncake_conversation_trace.jsonl.gz"
    return here if here.is_file() else None


def start_engines(factor: float, profile: Profile, register: Any, address: str, trace: str,
                  args: argparse.Namespace, folder: Path, flood: float = 1.0
                  ) -> tuple[list[Any], list[Path], Any, float]:
    """The level's engine processes (engine 0 at ``flood`` times the level's rate);
    ``(processes, their result files, progress queue, start time)``."""
    from hicache.bench.capacity_lib.engine_sim import EngineArgs, run_engine

    load = profile.load.scaled(factor)
    spawn = mp.get_context("spawn")
    progress = spawn.Queue()
    start_at = time.time() + 3.0  # after every engine process has started
    outs = [folder / f"engine-{i}.json" for i in range(profile.engines)]
    procs = []
    for i in range(profile.engines):
        ea = EngineArgs(i, profile.engines, address, register, ENGINE_TIMEOUT_MS,
                        profile.load.scaled(factor * flood) if i == 0 else load, trace, args.max_prompt_tokens,
                        start_at, args.warmup, args.duration, str(outs[i]))
        p = spawn.Process(target=run_engine, args=(ea, progress), daemon=True)
        p.start()
        procs.append(p)
    return procs, outs, progress, start_at


def run_level(factor: float, profile: Profile, daemon: Daemon, register: Any, address: str, trace: str,
              args: argparse.Namespace, folder: Path, flood: float = 1.0) -> Level:
    """One load level (engine 0 at ``flood`` times it): the engines for warm-up + duration,
    then the bare reference."""
    from hicache.bench.capacity_lib.reference import bare_round_trips

    procs, outs, progress, start_at = start_engines(factor, profile, register, address, trace, args, folder, flood)
    pids = [p.pid for p in procs]
    measure_from = start_at + args.warmup
    end = measure_from + args.duration
    first: Sample | None = None
    last: Sample | None = None
    seen: dict[int, tuple[int, float]] = {}
    next_line = time.time() + PROGRESS_EVERY_S
    while any(p.is_alive() for p in procs):
        try:
            i, n, p99 = progress.get(timeout=0.2)
            seen[i] = (n, p99)
        except queue.Empty:
            pass
        now = time.time()
        if first is None and now >= measure_from:
            first = Sample.take(daemon, pids)
        elif first is not None and last is None and now >= end:
            last = Sample.take(daemon, pids)
        if now >= next_line:
            next_line = now + PROGRESS_EVERY_S
            phase = "warm-up" if now < measure_from else f"{min(now, end) - measure_from:.0f}/{args.duration:.0f} s"
            calls = sum(n for n, _ in seen.values())
            worst = max((p for _, p in seen.values() if p == p), default=float("nan"))
            print(f"  level {factor:g}x: {phase}, {calls} answers measured, worst engine p99 {worst / 1000:.2f} ms",
                  flush=True)
    for p in procs:
        p.join(30)
    if first is None or last is None:
        raise RuntimeError(f"level {factor:g}x: the engines ended before the measured window")
    results = []
    for i, out in enumerate(outs):
        if not out.is_file():
            raise RuntimeError(f"engine {i} of level {factor:g}x wrote no results (it failed; see stderr)")
        results.append(json.loads(out.read_text()))
    level = summarize(factor, profile.load.scaled(factor), results, first, last)
    level.flood = flood
    sizes = {}
    for kind in KINDS:
        asks = [x for r in results for x in r["frame_bytes"][kind]]
        answers = [x for r in results for x in r["answer_bytes"][kind]]
        if asks and answers:
            sizes[kind] = (int(statistics.median(asks)), int(statistics.median(answers)))
    bare = bare_round_trips(f"ipc://{folder.resolve()}/bare.sock", sizes, BARE_ROUND_TRIPS) if sizes else {}
    level.bare_us = {k: _stats(v) for k, v in bare.items()}
    return level


def summarize(factor: float, load: Load, results: list[dict[str, Any]], first: Sample, last: Sample) -> Level:
    """A level's figures from the engines' results and the two samples around its window."""
    level = Level(factor)
    wall = last.at - first.at
    for kind in KINDS:
        level.rtt_us[kind] = _stats([x for r in results for x in r["rtt_us"][kind]])
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
    level.counts = counts
    level.steps = counts.get("steps", 0)
    level.late_steps = sum(1 for r in results for x in r["late_ms"] if x > 1000 / load.steps_per_s)
    level.unanswered = counts.get("lookup_unanswered", 0) + counts.get("reserve_unanswered", 0)
    level.requests = counts.get("arrived", 0)
    level.process_cores = {k: (v - first.cpu_s.get(k, 0.0)) / wall for k, v in last.cpu_s.items()}
    level.daemon_cores = sum(level.process_cores.values())
    level.engines_cores = (last.engines_cpu_s - first.engines_cpu_s) / wall
    level.daemon_cpu_s_per_1k_requests = level.daemon_cores * wall / max(1, level.requests) * 1000
    level.rates = {k: (v - first.counters.get(k, 0)) / wall for k, v in last.counters.items()}
    level.engine_p99_us = [_stats([x for kind in KINDS for x in r["rtt_us"][kind]]).get("p99", float("nan"))
                           for r in results]
    level.busy = [r["counts"].get("lookup_busy", 0) + r["counts"].get("reserve_busy", 0) for r in results]
    level.answers = [sum(len(r["rtt_us"][kind]) for kind in KINDS) for r in results]
    return level


def _levels(spec: str) -> list[float] | None:
    if spec == "auto":
        return None
    try:
        out = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--levels: 'auto' or numbers separated by commas, got {spec!r}") from None
    if not out or any(x <= 0 for x in out):
        raise ValueError(f"--levels: positive load factors, got {spec!r}")
    return out


def _print_level(level: Level) -> None:
    parts = []
    for kind, r in level.rtt_us.items():
        if r:
            b = level.bare_us.get(kind, {})
            parts.append(f"{kind} p50 {r['p50'] / 1000:.2f} / p99 {r['p99'] / 1000:.2f} / max {r['max'] / 1000:.1f} ms "
                         f"(bare p50 {b.get('p50', float('nan')) / 1000:.3f} ms)")
    procs = ", ".join(f"{k} {v:.2f}" for k, v in level.process_cores.items())
    flood = f" (engine 0 at {level.flood:g}x: p99 {level.engine_p99_us[0] / 1000:.2f} ms, {level.busy[0]} busy)" \
        if level.flood != 1 and level.engine_p99_us else ""
    print(f"level {level.factor:g}x{flood}: {'; '.join(parts)}; daemon {level.daemon_cores:.2f} cores "
          f"({procs}), engines {level.engines_cores:.2f} cores; "
          f"{level.late_steps}/{level.steps} steps late, {level.unanswered} unanswered", flush=True)


def figures(profile_level: Level, knee: float) -> list[Any]:
    from hicache.bench.report import Figure

    out = []
    for kind, r in profile_level.rtt_us.items():
        b = profile_level.bare_us.get(kind, {})
        if not r or not b:
            continue
        out.append(Figure(f"{kind} answer p99", "ms", r["p99"] / 1000, "goal", P99_GOAL_MS, higher_is_better=False,
                          goal=1.0))
        out.append(Figure(f"{kind} answer p99 vs bare", "ms", r["p99"] / 1000, "bare ZeroMQ p99", b["p99"] / 1000,
                          higher_is_better=False, goal=BARE_RATIO_GOAL))
        out.append(Figure(f"{kind} answer p50 vs bare", "ms", r["p50"] / 1000, "bare ZeroMQ p50", b["p50"] / 1000,
                          higher_is_better=False))
    out.append(Figure("daemon CPU", "cores", profile_level.daemon_cores, "goal", CPU_GOAL_CORES,
                      higher_is_better=False, goal=1.0))
    out.append(Figure("daemon CPU vs engines' own", "cores", profile_level.daemon_cores, "simulated engines",
                      profile_level.engines_cores, higher_is_better=False))
    out.append(Figure("knee (p99 <= 1 ms)", "x profile", knee, "goal", KNEE_GOAL, goal=1.0))
    return out


def flood_figures(reference: Level, flooded: Level) -> list[Any]:
    """The fairness figures of one level run with every engine at its rate (``reference``)
    and again with engine 0 at ``flooded.flood`` times it."""
    from hicache.bench.report import Figure

    steady = max(flooded.engine_p99_us[1:], default=float("nan")) / 1000
    alone = max(reference.engine_p99_us[1:], default=float("nan")) / 1000
    n = f"{flooded.flood:g}x"
    return [
        Figure(f"other engines' worst p99, one engine at {n}", "ms", steady, "the same engines, all at 1x", alone,
               higher_is_better=False, goal=FLOOD_RATIO_GOAL),
        Figure(f"the {n} engine's p99", "ms", flooded.engine_p99_us[0] / 1000, "other engines' worst p99", steady,
               higher_is_better=False),
        Figure(f"busy answers to the {n} engine", "answers", float(flooded.busy[0]), "all its answers",
               float(flooded.answers[0]), higher_is_better=False),
    ]


def plot(levels: list[Level], path: Path, title: str) -> None:
    from hicache.replay_sim.plotting import pyplot_or_none

    plt = pyplot_or_none(str(path))
    if plt is None:
        return
    levels = sorted(levels, key=lambda lv: lv.factor)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [lv.factor for lv in levels]
    for kind in ("lookup", "reserve"):
        for q, style in (("p50", "-o"), ("p99", "-s")):
            ys = [lv.rtt_us.get(kind, {}).get(q, float("nan")) / 1000 for lv in levels]
            ax.plot(xs, ys, style, label=f"{kind} {q}")
        ax.plot(xs, [lv.bare_us.get(kind, {}).get("p99", float("nan")) / 1000 for lv in levels], ":",
                label=f"bare ZeroMQ p99 ({kind} sizes)")
    ax.axhline(P99_GOAL_MS, color="grey", linestyle="--", label="p99 goal")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("load (x the profile's steps and arrivals per second)")
    ax.set_ylabel("answer round trip (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from hicache.bench.local_redis import started
    from hicache.bench.report import print_table, write_json
    from hicache.cache_server.geometry import geometry_from_config
    from hicache.config import load_config

    profile = _profile(args)
    try:
        fixed = _levels(args.levels)
        trace = args.trace or default_trace()
        if trace is None:
            raise ValueError("no trace: pass --trace (the vendored one is in a source checkout's tests/data/traces)")
        if args.flood and (args.flood <= 1 or profile.engines < 2):
            raise ValueError("--flood: a factor above 1, with two engines or more")
        if profile.engines < 1 or profile.load.running < 1 or profile.load.steps_per_s <= 0 \
                or profile.load.new_per_s <= 0 or args.duration <= 0 or args.warmup < 0:
            raise ValueError("engines, running, steps and arrivals per second and --duration must be positive")
    except ValueError as exc:
        print(f"hicache bench capacity: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("bench_capacity_results") / time.strftime("%Y%m%d-%H%M%S")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    work = Path(f"/tmp/hcap-{os.getpid()}")  # unix socket paths must stay short
    work.mkdir(parents=True, exist_ok=True)
    print(f"hicache bench capacity: profile {profile.name}: {profile.engines} engines x {profile.load.steps_per_s:g} "
          f"steps/s, {profile.load.running} running, {profile.load.new_per_s:g} new/s each; page {profile.page_size} "
          f"tokens / {args.page_bytes} bytes; L2 {profile.l2_pages:,} pages; L3 {profile.l3}", flush=True)
    levels: list[Level] = []
    flooded: dict[float, Level] = {}
    with started(work / "redis") if profile.l3 == "redis" else _nothing() as redis:
        try:
            model = write_model(work / "model", profile.page_size, args.page_bytes)
            config = write_config(out / "hicache.yaml", model, profile, work, redis.url if redis else None)
        except ValueError as exc:
            print(f"hicache bench capacity: {exc}", file=sys.stderr)
            return 2
        cfg = load_config(str(config), args.overrides)
        geometry = geometry_from_config(cfg)
        import protos

        register = protos.EngineRegister(0, "bench", 0, geometry, geometry.page_bytes, "b" * 64)
        address = f"ipc://{work / 'ipc' / 'engine.sock'}"
        daemon = Daemon(config, args.overrides, out / "daemon.log", profile.page_size)
        daemon.start()
        try:
            factor = 1.0
            for i in range(64):
                if fixed is not None:
                    if i >= len(fixed):
                        break
                    factor = fixed[i]
                folder = out / f"level-{factor:g}"
                folder.mkdir(exist_ok=True)
                level = run_level(factor, profile, daemon, register, address, str(trace), args, folder)
                levels.append(level)
                _print_level(level)
                if args.flood:
                    folder = out / f"level-{factor:g}-flood-{args.flood:g}"
                    folder.mkdir(exist_ok=True)
                    flooded[factor] = run_level(factor, profile, daemon, register, address, str(trace), args, folder,
                                                args.flood)
                    _print_level(flooded[factor])
                if fixed is not None:
                    continue
                ok = level.p99_ms <= P99_GOAL_MS
                below = [lv for lv in levels if lv.p99_ms <= P99_GOAL_MS]
                above = [lv for lv in levels if lv.p99_ms > P99_GOAL_MS]
                if ok and not above and factor < MAX_LEVEL:
                    factor *= 2
                elif not ok and not below and factor > MIN_LEVEL:
                    factor /= 2
                else:
                    break
        except (RuntimeError, OSError) as exc:
            print(f"hicache bench capacity: {exc}", file=sys.stderr)
            return 1
        finally:
            daemon.stop()
            shutil.rmtree(work, ignore_errors=True)
    knee = max((lv.factor for lv in levels if lv.p99_ms <= P99_GOAL_MS), default=0.0)
    at_profile = next((lv for lv in levels if lv.factor == 1.0), levels[0])
    figs = figures(at_profile, knee)
    if at_profile.factor in flooded:
        figs += flood_figures(at_profile, flooded[at_profile.factor])
    print_table(f"hicache bench capacity, profile {profile.name} at {at_profile.factor:g}x", figs)
    extra = {"profile": {**asdict(profile), "page_bytes": args.page_bytes}, "knee": knee,
             "levels": [{**asdict(lv), "p99_ms": lv.p99_ms} for lv in levels],
             "flooded": [{**asdict(lv), "p99_ms": lv.p99_ms} for lv in flooded.values()]}
    write_json(str(out / "capacity.json"), "capacity", figs, extra=extra)
    if args.json:
        write_json(args.json, "capacity", figs, extra=extra)
    plot(levels, out / "capacity.png", f"hicache bench capacity: {profile.name} profile")
    print(f"results in {out}")
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
