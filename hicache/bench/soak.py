"""``hicache bench soak --minutes N``: hours of production in minutes, with faults on a schedule.

Starts a Redis server and two daemons (``deploy/bench/soak.yaml``: every tier small, L3 on
that Redis; ``deploy/bench/soak_reference.yaml``: L1 only, the cold reference), then runs
``--clients`` client threads of mixed traffic (``soak_lib.traffic``: multi-turn
conversations, shared system prompts, seeded sampling, streams, aborts after the first
chunk, connections dropped at once, invalid bodies) for ``--minutes``. Every
``--fault-every-s`` seconds a fault cycle:

1. the traffic pauses until the scheduler is idle and has run its integrity check
   (``check_integrity``: every page owned exactly once) once more, the check's evidence;
2. a fault, alternately: the cache controller SIGKILLed (the launcher restarts it), the
   Redis server killed and started again on its port (empty);
3. the traffic resumes; the time until ``/health`` is ok again is recorded.

Every fault kind runs at least once: a run whose ``--minutes`` end before that (a short run,
a slow machine) goes on until the last kind has had its cycle.

Continuously: every output of the checked kinds equals the reference daemon's cold output
(token ids), no request fails but the invalid bodies (each must get a 400), and every
``--sample-s`` the processes' RSS, open files and the daemon's shared memory segments
are sampled (``soak_lib.resources``: they must stay flat after the warm-up). At the end the
daemon must stop cleanly (exit 0, no segment left).

Writes ``summary.json``, ``summary.md`` and ``resources.csv`` to ``--out`` (default a
fresh temporary directory) with the daemons' logs; prints progress every 30 s. Exit code 0
only if every check held.
"""

from __future__ import annotations

import argparse
from typing import Any

PROGRESS_EVERY_S = 30.0
PAUSE_TIMEOUT_S = 30.0
FAULT_KINDS = ("controller SIGKILL", "redis restart")
"""The fault cycles, in turn (``Soak._fault_cycle``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs (default 10)")
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--fault-every-s", type=float, default=45.0, help="seconds between fault cycles")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic")
    parser.add_argument("--out", default=None, help="output directory (default: a new temporary one)")


def run(args: argparse.Namespace) -> int:
    return Soak(args).run()


class Soak:
    """One soak run (``run`` returns the exit code)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import tempfile
        import threading
        from pathlib import Path

        from hicache.bench.soak_lib.resources import Sample
        from hicache.bench.soak_lib.traffic import Tally

        if args.minutes <= 0 or args.clients < 1 or args.fault_every_s <= 0 or args.sample_s <= 0:
            raise SystemExit("--minutes, --clients, --fault-every-s and --sample-s must be positive")
        self.args = args
        self.out = Path(args.out or tempfile.mkdtemp(prefix="hicache-soak-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.repo = Path(__file__).resolve().parents[2]
        self.tally = Tally()
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.samples: list[Sample] = []
        self.faults: list[dict[str, Any]] = []
        self.integrity: list[int] = []
        self.problems: list[str] = []

    # ------------------------------------------------------------------ helpers
    def _get(self, port: int, path: str) -> tuple[int, Any]:
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def _processes(self) -> dict[str, int]:
        return dict(self._get(self.daemon.port, "/health")[1].get("processes", {}))

    def _wait_healthy(self, timeout_s: float, replaced: tuple[str, int] | None = None) -> float | None:
        """Seconds until ``/health`` is ok (and, with ``replaced`` = (process, old pid), names
        another pid for that process: a killed process counts as recovered once its successor
        is up, not while the launcher has yet to notice the kill); None if not within
        ``timeout_s``."""
        import time

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                status, body = self._get(self.daemon.port, "/health")
                if status == 200 and (replaced is None
                                      or body.get("processes", {}).get(replaced[0]) not in (None, replaced[1])):
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.1)
        return None

    def _log(self, message: str) -> None:
        import sys
        import time

        print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        from hicache.bench.local_redis import RedisProcess, find_redis_server
        from hicache.bench.loopback_ports import free_port
        from hicache.bench.serve_lib.daemon import ManagedDaemon

        if find_redis_server() is None:
            print("hicache bench soak needs redis-server (apt-get install redis-server)")
            return 2
        self.redis = RedisProcess(self.out / "redis", free_port())
        self.redis.start()
        self.daemon = ManagedDaemon(self.repo / "deploy/bench/soak.yaml", [f"cache.l3.redis.url={self.redis.url}"],
                                    log_path=self.out / "daemon.log")
        self.reference_daemon = ManagedDaemon(self.repo / "deploy/bench/soak_reference.yaml",
                                              log_path=self.out / "reference.log")
        try:
            self.daemon.start()
            self.reference_daemon.start()
            return self._traffic()
        finally:
            self.stop.set()
            self.reference_daemon.kill()
            self.daemon.kill()
            self.redis.kill()

    def _traffic(self) -> int:
        import random
        import threading
        import time

        from hicache.bench.soak_lib.resources import sample, shm_segments
        from hicache.bench.soak_lib.traffic import SYSTEM_PROMPT_TOKENS, Client, Reference
        from hicache.config import load_config

        vocab = load_config(self.repo / "deploy/bench/soak.yaml").model.reference.vocab_size
        if vocab is None:  # load_config fills it from the preset
            raise RuntimeError("deploy/bench/soak.yaml: model.reference.vocab_size is not set")
        rng = random.Random(self.args.seed)
        systems = [[rng.randrange(1, vocab) for _ in range(SYSTEM_PROMPT_TOKENS)] for _ in range(4)]
        reference = Reference(self.reference_daemon.port)
        start_procs = self._processes()
        if self.daemon.proc is None:
            raise RuntimeError("the daemon under test is not running")
        launcher = self.daemon.proc.pid
        self._log(f"daemon {start_procs}, reference on port {self.reference_daemon.port}, redis {self.redis.url}, "
                  f"{self.args.clients} clients for {self.args.minutes:g} min; output in {self.out}")
        clients = [Client(i, self.daemon.port, reference, self.tally, systems, vocab, self.args.seed * 1000 + i)
                   for i in range(self.args.clients)]
        threads = [threading.Thread(target=self._client_loop, args=(c,), daemon=True, name=f"soak-client-{c.index}")
                   for c in clients]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        end = t0 + self.args.minutes * 60
        next_fault = t0 + self.args.fault_every_s
        next_sample = t0
        next_progress = t0 + PROGRESS_EVERY_S
        fault_no = 0
        while time.monotonic() < end or fault_no < len(FAULT_KINDS):
            now = time.monotonic()
            if now >= next_sample:
                self.samples.append(sample(self._processes(), launcher))
                next_sample = now + self.args.sample_s
            if now >= next_fault or now >= end:
                self._fault_cycle(fault_no)
                fault_no += 1
                next_fault = time.monotonic() + self.args.fault_every_s
            if now >= next_progress:
                self._progress(now - t0, reference)
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(0.2)
        self.stop.set()
        self.paused.clear()
        for t in threads:
            t.join(timeout=180)
        self._settle_integrity("end")
        elapsed = time.monotonic() - t0
        end_procs = self._processes()
        code = self.daemon.stop()
        leaked = shm_segments(launcher)
        return self._report(elapsed, reference, start_procs, end_procs, code, leaked)

    def _client_loop(self, client: Any) -> None:
        import time

        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.05)
                continue
            client.run_once()

    # ------------------------------------------------------------------ faults
    def _settle_integrity(self, when: str) -> bool:
        """Wait (traffic paused) until the scheduler is idle and its integrity check count
        went up: a check ran on the quiet tree and passed (a failing check raises in the
        scheduler, which /health would then report)."""
        import time

        before = self._get(self.daemon.port, "/cache/stats")[1].get("integrity_checks", 0)
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while time.monotonic() < deadline:
            stats = self._get(self.daemon.port, "/cache/stats")[1]
            if stats.get("integrity_checks", 0) > before:
                self.integrity.append(stats["integrity_checks"])
                return True
            time.sleep(0.2)
        self.problems.append(f"{when}: no integrity check passed within {PAUSE_TIMEOUT_S:g} s of a pause")
        return False

    def _fault_cycle(self, n: int) -> None:
        import os
        import signal
        import time

        self.paused.set()
        self._settle_integrity(f"fault cycle {n}")
        procs = self._processes()
        kind = FAULT_KINDS[n % len(FAULT_KINDS)]
        if kind == "controller SIGKILL":
            os.kill(procs["controller"], signal.SIGKILL)
        else:
            self.redis.kill()
            time.sleep(1.0)
            self.redis.start()
        t = time.time()
        self.paused.clear()
        time.sleep(0.5)  # let /health see the loss before waiting for its recovery
        recovery = self._wait_healthy(120.0, ("controller", procs["controller"]) if kind == "controller SIGKILL"
                                      else None)
        after = self._processes()
        if recovery is None:
            self.problems.append(f"{kind} at cycle {n}: /health not ok within 120 s")
        if kind.startswith("controller") and after.get("controller") == procs.get("controller"):
            self.problems.append(f"controller SIGKILL at cycle {n}: the controller was not restarted")
        self.faults.append({"cycle": n, "kind": kind, "t": t, "recovery_s": None if recovery is None
                            else round(recovery + 0.5, 2)})
        self._log(f"fault {n}: {kind}; healthy again after {self.faults[-1]['recovery_s']} s")

    def _progress(self, elapsed: float, reference: Any) -> None:
        from hicache.bench.soak_lib.traffic import Outcome

        last = self.samples[-1] if self.samples else None
        rss = sum(last.rss_kib.values()) // 1024 if last else 0
        self._log(f"{elapsed / 60:.1f} min: {self.tally.total()} requests, {self.tally.total(Outcome.FAILED)} failed, "
                  f"{self.tally.total(Outcome.MISMATCH)} mismatched, {len(self.faults)} faults, "
                  f"RSS {rss} MiB, fds {sum(last.fds.values()) if last else 0}, "
                  f"shm {last.shm_segments if last else 0}, {reference.computed} reference outputs")

    # ------------------------------------------------------------------ the report
    def _report(self, elapsed: float, reference: Any, start: dict[str, int], end: dict[str, int], code: int,
                leaked: int) -> int:
        import csv
        import json
        import statistics

        from hicache.bench.soak_lib.resources import verdict
        from hicache.bench.soak_lib.traffic import CHECKED, Kind, Outcome

        counts = {f"{k}/{o}": n for (k, o), n in sorted(self.tally.counts.items())}
        bad = [f"{k}: {n} {o}" for (k, o), n in sorted(self.tally.counts.items())
               if o != Outcome.OK.value and (Kind(k) in CHECKED or Kind(k) in (Kind.BAD, Kind.ABORT))]
        flat = verdict(self.samples)
        restarts = sum(1 for f in self.faults if f["kind"].startswith("controller"))
        checks = {
            "outputs equal the cold reference, no request failed but the injected bad ones": not bad,
            "every bad request got a 400": self.tally.counts[(Kind.BAD.value, Outcome.OK.value)] > 0
            and not self.tally.counts[(Kind.BAD.value, Outcome.FAILED.value)],
            "RSS, open files and shared memory stayed flat": flat.flat,
            "integrity checks passed at every pause": not self.problems and len(self.integrity) == len(self.faults) + 1,
            "the scheduler and tokenizer were never restarted": all(start.get(n) == end.get(n)
                                                                   for n in ("scheduler", "tokenizer")),
            "the daemon stopped cleanly (exit 0, no shared memory left)": code == 0 and leaked == 0,
        }
        recoveries = [f["recovery_s"] for f in self.faults if f["recovery_s"] is not None]
        summary = {
            "minutes": round(elapsed / 60, 2), "clients": self.args.clients, "seed": self.args.seed,
            "requests": self.tally.total(), "requests_per_s": round(self.tally.total() / elapsed, 2),
            "by_kind": counts, "reference_outputs": reference.computed,
            "prompt_tokens_checked": self.tally.prompt_tokens, "cached_tokens_checked": self.tally.cached_tokens,
            "hit_ratio": round(self.tally.cached_tokens / self.tally.prompt_tokens, 3) if self.tally.prompt_tokens else 0,
            "faults": self.faults, "controller_restarts_injected": restarts,
            "recovery_s_median": statistics.median(recoveries) if recoveries else None,
            "integrity_checks_at_pauses": self.integrity, "resources": flat.rows,
            "problems": self.problems + bad, "failures": self.tally.failures[:20],
            "exit_code": code, "shm_left": leaked, "checks": checks, "passed": all(checks.values()),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with open(self.out / "resources.csv", "w", newline="") as f:
            w = csv.writer(f)
            names = sorted({n for s in self.samples for n in s.rss_kib})
            w.writerow(["t", *(f"{n}_rss_kib" for n in names), *(f"{n}_fds" for n in names), "shm_segments"])
            for s in self.samples:
                w.writerow([round(s.t, 1), *(s.rss_kib.get(n, "") for n in names), *(s.fds.get(n, "") for n in names),
                            s.shm_segments])
        lines = [f"# hicache bench soak: {summary['minutes']} min, {summary['requests']} requests "
                 f"({summary['requests_per_s']}/s), {len(self.faults)} faults", "",
                 "| check | held |", "|---|---|", *(f"| {k} | {'yes' if v else 'NO'} |" for k, v in checks.items()),
                 "", "| requests (kind/outcome) | count |", "|---|---|",
                 *(f"| {k} | {n} |" for k, n in counts.items()), "",
                 f"Hit ratio of the checked requests: {summary['hit_ratio']} "
                 f"({self.tally.cached_tokens} of {self.tally.prompt_tokens} prompt tokens); "
                 f"{reference.computed} cold reference outputs; recovery after a fault (median): "
                 f"{summary['recovery_s_median']} s.", "",
                 "| resource | after warm-up | end | growth | allowed | flat |", "|---|---|---|---|---|---|",
                 *(f"| {r['what']} | {r.get('after_warmup')} | {r.get('end')} | {r.get('growth')} | "
                   f"{r.get('allowed')} | {r.get('flat')} |" for r in flat.rows)]
        if summary["problems"]:
            lines += ["", "Problems:", *(f"- {p}" for p in summary["problems"])]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0 if summary["passed"] else 1
