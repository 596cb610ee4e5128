"""End to end: ``hicache advise`` against the daemon it advises.

1. A daemon with ``server.request_log`` serves a trace through ``hicache bench serve``; the
   log it writes gives ``hicache advise`` the same advice as the trace itself, and its
   ``cached_tokens`` agree with what the responses reported.
2. A daemon started from the config ``hicache advise --write`` recommends, replaying the same
   trace one request at a time, reaches the predicted hit rate within ``TOLERANCE``.

The trace is the closed-form workload of ``tests/support/advise_trace.py`` in pages of 16
tokens: a second working set that only L2 can hold at the budgets given, so the check
covers hits from L1 and from L2. Every request ends in a fresh page, so the daemon's rule
that a prompt's last token is always computed never hides a hit the model counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from hicache.cli.main import main
from tests.support.advise_trace import A, B, phases, write_trace
from tests.support.daemon import DaemonFactory

TOLERANCE = 0.03
"""Predicted and measured hit rates may differ by this much (3 points): the daemon's pools
are page-granular like the replay's, but its running request holds L1 pages the replay
counts as working space only after admission."""


def _base(tmp: Path) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 16, "l1": {"tokens": 4096}, "l2": {"tokens": 16384},
                  "l3": {"backend": "none"}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }


def _bench(url: str, trace: Path, out: Path) -> dict[str, Any]:
    rc = main(["bench", "serve", "--url", url, "--workload", "trace", "--trace", str(trace), "--clients", "1",
               "--warmup", "0", "--max-output-len", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "result.json").read_text())
    assert doc["requests"]["failed"] == 0
    return doc["cache"]["responses"]


def _advise(tmp: Path, trace: Path, name: str, *extra: str) -> dict[str, Any]:
    doc = tmp / f"{name}.json"
    rc = main(["advise", str(trace), "--block-size", "16", "--l1-max", "1600", "--l2-max", "16000",
               "--json", str(doc), "--plot", str(tmp / f"{name}.png"), *extra])
    assert rc == 0
    return json.loads(doc.read_text())


def test_the_request_log_advises_like_the_trace_and_the_advice_holds(daemons: DaemonFactory, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    requests = phases(A, B)
    write_trace(trace, requests)
    log = tmp_path / "requests.jsonl"

    # 1. the log of a daemon with room for everything
    cfg = _base(tmp_path)
    cfg["server"] = {"request_log": str(log)}
    first = daemons(cfg, "logging")
    served = _bench(f"http://127.0.0.1:{first.port}", trace, tmp_path / "bench-log")
    assert first.stop() == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == len(requests)
    assert [x["input_length"] for x in lines] == [16 * len(r) for r in requests]
    assert sum(x["cached_tokens"] for x in lines) == served["cached"]
    assert all("text" not in x and "prompt" not in x for x in lines)
    from_trace = _advise(tmp_path, trace, "trace", "--policies", "lru")
    from_log = _advise(tmp_path, log, "log", "--policies", "lru")
    assert from_log["tiers"] == from_trace["tiers"]
    assert from_log["logged_hit_rate"] == served["hit_rate"] and "logged_hit_rate" not in from_trace
    assert from_log["grid"] == from_trace["grid"]

    # 2. the advised config, served
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(_base(tmp_path)))
    written = tmp_path / "advised.yaml"
    advice = _advise(tmp_path, trace, "advice", "--config", str(base), "--write", str(written))
    assert [t["tokens"] for t in advice["tiers"]] == [35 * 16, 175 * 16, 0]
    advised = yaml.safe_load(written.read_text())
    # L1 gets at least one prefill and a chunk (512 + 256) whatever the advice: more L1 hits,
    # the same hit rate
    assert advised["cache"]["l1"]["tokens"] == 768 and advised["cache"]["l2"]["tokens"] == 2800
    second = daemons(advised, "advised")
    measured = _bench(f"http://127.0.0.1:{second.port}", trace, tmp_path / "bench-advised")
    predicted = advice["predicted_hit_rate"]
    print(f"predicted {predicted:.4f}, measured {measured['hit_rate']:.4f} "
          f"(L1 {measured['device']}, L2 {measured['host']} tokens)")
    assert abs(measured["hit_rate"] - predicted) <= TOLERANCE
    assert measured["host"] > 0  # the second working set came back from L2
