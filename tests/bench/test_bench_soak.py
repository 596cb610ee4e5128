"""``hicache bench soak``: a short run through the CLI (real daemons, a real Redis, real
faults) must pass every check, and the verdicts it reports must be able to fail.

The full-length run (10 minutes and more) is a benchmark, not a test; this one runs for
about 40 seconds with a fault cycle every 12 seconds, so both faults (a controller SIGKILL
and a Redis restart) happen at least once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.local_redis import find_redis_server
from hicache.bench.soak_lib.resources import Sample, verdict
from hicache.bench.soak_lib.traffic import Kind, Outcome, Tally
from hicache.cli.main import main


def _samples(rss: list[int], shm: list[int]) -> list[Sample]:
    return [Sample(float(i), {"scheduler": r}, {"scheduler": 30}, s) for i, (r, s) in enumerate(zip(rss, shm, strict=True))]


def test_resource_verdict_flags_growth_and_leaked_segments() -> None:
    flat = _samples([500_000] * 20, [2] * 20)
    assert verdict(flat).flat
    growing = _samples([500_000 + 10_000 * i for i in range(20)], [2] * 20)  # +190 MiB over the run
    assert not verdict(growing).flat
    leaking = _samples([500_000] * 20, [2] * 10 + [3] * 10)
    assert not verdict(leaking).flat
    assert not verdict(flat[:5]).flat  # too few samples prove nothing


def test_tally_counts_outcomes_per_kind() -> None:
    t = Tally()
    t.record(Kind.TURN, Outcome.OK)
    t.record(Kind.TURN, Outcome.MISMATCH, {"got": [1], "want": [2]})
    assert t.total() == 2 and t.total(Outcome.MISMATCH) == 1 and t.failures[0]["kind"] == "turn"


@pytest.mark.processes  # the soak's daemons
@pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed (apt-get install redis-server)")
def test_a_short_soak_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    code = main(["bench", "soak", "--minutes", "0.7", "--fault-every-s", "12", "--sample-s", "2",
                 "--clients", "3", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, json.dumps({k: summary[k] for k in ("checks", "problems", "failures")}, indent=1)
    assert summary["passed"] and all(summary["checks"].values())
    kinds = {k.split("/")[0] for k in summary["by_kind"]}
    assert {"turn", "shared", "stream", "bad"} <= kinds  # the mix was sent
    assert {f["kind"] for f in summary["faults"]} == {"controller SIGKILL", "redis restart"}
    assert summary["cached_tokens_checked"] > 0  # outputs compared included cache hits
    assert (out / "summary.md").read_text().startswith("# hicache bench soak")
    assert len((out / "resources.csv").read_text().splitlines()) > 10
