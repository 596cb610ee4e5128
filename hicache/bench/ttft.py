"""``hicache bench ttft``: time to first token of one long prompt served from each tier.

Starts its own daemon (``--config``, default ``deploy/bench/ttft.yaml``: the ``bench``
preset, L1 room for two 4k prompts, a big L2 and a file L3 in a temporary directory) and,
per repetition, with a fresh random prompt:

1. ``cold``: the prompt on an empty cache (the reference);
2. ``L1``: the same prompt again;
3. ``L2``: after two other prompts of the same length pushed it out of L1;
4. ``L3``: after ``POST /cache/flush`` emptied L1 and L2.

Each request asks for one token, so its end-to-end time is its TTFT plus the HTTP round
trip. Every case must return the cold output ids (else the run fails), and the daemon's
``timings_ms`` break the hit cases down: queue (arrival to admission, including the
load-back / prefetch wait), load (the L2->L1 copy alone) and prefill (the uncached suffix
and the first token). Medians over ``--repeats``; ratios against cold in the same run.
"""

from __future__ import annotations

import argparse
from typing import Any

CASES = ("cold", "L1", "L2", "L3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="daemon config (default: deploy/bench/ttft.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the daemon's config (repeatable)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-token-id", type=int, default=30000, help="prompt ids are drawn from [1, this)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    import json
    import random
    import statistics
    import tempfile
    import time
    import urllib.request
    from pathlib import Path

    from hicache.bench.report import Figure, print_table, write_json
    from hicache.bench.serve_lib.daemon import DaemonStartError, ManagedDaemon

    config = args.config or str(Path(__file__).resolve().parents[2] / "deploy" / "bench" / "ttft.yaml")
    tmp = tempfile.TemporaryDirectory(prefix="hicache-ttft-")
    overrides = [f"cache.l3.file.dir={tmp.name}/l3", *args.overrides]
    daemon = ManagedDaemon(config, overrides, log_path=f"{tmp.name}/daemon.log")

    def post(path: str, body: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(daemon.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=900) as resp:
            out = json.load(resp)
        return time.perf_counter() - t0, out

    def generate(ids: list[int]) -> tuple[float, dict[str, Any]]:
        return post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})

    rng = random.Random(0)
    times: dict[str, list[float]] = {c: [] for c in CASES}
    parts: dict[str, dict[str, list[float]]] = {c: {"queue": [], "load": [], "prefill": []} for c in CASES}
    tiers = {"L1": "device", "L2": "host", "L3": "storage"}
    try:
        daemon.start()
    except DaemonStartError as exc:
        print(f"hicache: {exc}")
        return 2
    try:
        for rep in range(args.repeats):
            prompt = [rng.randrange(1, args.max_token_id) for _ in range(args.prompt_tokens)]
            fillers = [[rng.randrange(1, args.max_token_id) for _ in range(args.prompt_tokens)] for _ in range(2)]
            expected = None
            for case in CASES:
                if case == "L2":
                    for f in fillers:
                        generate(f)
                    time.sleep(0.5)  # let the write-through copies of the fillers finish
                elif case == "L3":
                    time.sleep(0.5)  # let the backups to L3 finish
                    post("/cache/flush", None)
                t, out = generate(prompt)
                meta = out["meta_info"]
                if expected is None:
                    expected = out["output_ids"]
                elif out["output_ids"] != expected:
                    print(f"hicache: {case} hit gave {out['output_ids']}, cold gave {expected}")
                    return 1
                if case in tiers and meta["cached_tokens_details"][tiers[case]] < args.prompt_tokens // 2:
                    print(f"hicache: repetition {rep}: the {case} case was not served from {tiers[case]}: {meta}")
                    return 1
                times[case].append(t)
                for k in ("queue", "load", "prefill"):
                    parts[case][k].append(meta["timings_ms"][k])
        cold = statistics.median(times["cold"])
        figures = [Figure(f"TTFT {case} ({args.prompt_tokens} tokens)", "ms", statistics.median(times[case]) * 1000,
                          "cold prefill", cold * 1000, higher_is_better=False,
                          goal={"L2": 0.05, "L3": 0.1}.get(case)) for case in CASES[1:]]
        print_table(f"hicache bench ttft (medians of {args.repeats}; one output token)", figures)
        print("breakdown in the scheduler (median ms): case: queue (of which load-back) + prefill")
        for case in CASES:
            q, ld, pf = (statistics.median(parts[case][k]) for k in ("queue", "load", "prefill"))
            print(f"  {case:4s}  {q:8.1f} ({ld:.1f}) + {pf:8.1f}")
        if args.json:
            write_json(args.json, "ttft", figures, {"breakdown_ms": parts, "times_s": times})
    finally:
        code = daemon.stop()
        tmp.cleanup()
    return 0 if code == 0 else 1
