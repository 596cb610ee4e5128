"""``hicache bench capacity``: the traffic model, the level arithmetic, and a short run through
the CLI against a real engine-mode daemon (simulated engines in their own processes, real
L2 copies, a file L3).

The node profile's full run is a benchmark, not a test; this one runs one level of the
``small`` profile for a few seconds and checks that every figure has its reference and that
the simulated engines' traffic reached the daemon (pages committed, lookups answered).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.capacity import Level, _levels, figures, flood_figures, summarize
from hicache.bench.capacity_lib.daemon import Sample
from hicache.bench.capacity_lib.traffic import DECODED_TOKENS_FROM, Load, trace_prompts
from hicache.cli.main import main
from hicache.replay_sim.trace import Trace


def test_load_keeps_its_running_requests_in_flight() -> None:
    load = Load(steps_per_s=30, running=256, new_per_s=8)
    assert load.decode_tokens == 960  # 256 requests x 30 steps/s / 8 arrivals/s (Little's law)
    faster = load.scaled(4)
    assert (faster.steps_per_s, faster.new_per_s, faster.running) == (120, 32, 256)
    assert faster.decode_tokens == load.decode_tokens


def test_trace_prompts_share_exactly_the_trace_prefixes() -> None:
    trace = Trace("t", blocks=[[0, 1, 2], [0, 1, 5], [7, 8], [0, 9]], timestamps=[0, 1, 2, 3],
                  input_lengths=[3 * 512, 3 * 512, 2 * 512, 600])
    engine0 = trace_prompts(trace, 0, 2, max_prompt_tokens=4096)  # records 0 and 2
    engine1 = trace_prompts(trace, 1, 2, max_prompt_tokens=1100)  # records 1 and 3, cut at 1100
    a, c = engine0.take(), engine0.take()
    b, d = engine1.take(), engine1.take()
    assert a[:1024] == b[:1024] and a[1024] != b[1024]  # blocks 0, 1 shared, then 2 vs 5
    assert len(b) == 1100 and len(d) == 600 and d[:512] == a[:512] and d[512] != a[512]
    assert set(c).isdisjoint(set(a))
    assert engine0.take() == a  # wraps around
    assert max(max(p) for p in (a, b, c, d)) < DECODED_TOKENS_FROM


def test_trace_without_prompts_for_an_engine_is_refused() -> None:
    trace = Trace("one", blocks=[[3]], timestamps=[0], input_lengths=[512])
    with pytest.raises(ValueError, match="no prompt for engine 1 of 2"):
        trace_prompts(trace, 1, 2, max_prompt_tokens=4096)


def test_summarize_takes_rates_and_cores_over_the_window() -> None:
    first = Sample(10.0, {"scheduler": 5.0, "controller": 1.0}, 2.0, {"committed": 100.0, "lookups": 10.0})
    last = Sample(20.0, {"scheduler": 9.0, "controller": 2.0}, 4.0, {"committed": 600.0, "lookups": 110.0})
    result = {"rtt_us": {"lookup": [100.0, 200.0, 300.0], "reserve": [50.0]}, "late_ms": [1.0, 40.0],
              "counts": {"steps": 50, "arrived": 20, "lookup_unanswered": 1}}
    level = summarize(1.0, Load(steps_per_s=30, running=8, new_per_s=2), [result, result], first, last)
    assert level.rtt_us["lookup"]["p50"] == 200.0 and level.rtt_us["lookup"]["max"] == 300.0
    assert level.rtt_us["lookup"]["n"] == 6
    assert level.rates == {"committed": 50.0, "lookups": 10.0}
    assert level.process_cores == {"scheduler": 0.4, "controller": 0.1}
    assert level.daemon_cores == pytest.approx(0.5) and level.engines_cores == pytest.approx(0.2)
    assert level.steps == 100 and level.requests == 40 and level.unanswered == 2
    assert level.late_steps == 2  # 40 ms > one step of 33 ms, in each engine
    assert level.daemon_cpu_s_per_1k_requests == pytest.approx(5.0 / 40 * 1000)


def test_summarize_keeps_each_engines_p99_and_busy_answers_and_the_flood_figures_compare_them() -> None:
    first = Sample(10.0, {}, 0.0, {})
    last = Sample(20.0, {}, 0.0, {})
    flooder = {"rtt_us": {"lookup": [100.0] * 50 + [9000.0] * 50, "reserve": []}, "late_ms": [],
               "counts": {"lookup_busy": 7, "reserve_busy": 2}}
    steady = {"rtt_us": {"lookup": [100.0] * 99, "reserve": [3000.0]}, "late_ms": [], "counts": {}}
    load = Load(steps_per_s=30, running=8, new_per_s=2)
    flooded = summarize(1.0, load, [flooder, steady, steady], first, last)
    assert flooded.engine_p99_us == [9000.0, 3000.0, 3000.0] and flooded.busy == [9, 0, 0]
    assert flooded.answers == [100, 100, 100]
    flooded.flood = 10.0
    calm = {"rtt_us": {"lookup": [1000.0] * 100, "reserve": []}, "late_ms": [], "counts": {}}
    reference = summarize(1.0, load, [calm, calm, calm], first, last)
    fair, own, busy = flood_figures(reference, flooded)
    assert fair.value == 3.0 and fair.reference == 1.0 and fair.meets_goal is False  # 3x the reference's p99
    assert own.value == 9.0 and own.reference == 3.0
    assert busy.value == 9 and busy.reference == 100  # of the flooder's 100 answers


def test_figures_miss_their_goals_when_the_answers_are_slow() -> None:
    level = Level(1.0, rtt_us={"lookup": {"p50": 900.0, "p99": 5000.0, "max": 9000.0, "n": 10}},
                  bare_us={"lookup": {"p50": 40.0, "p99": 100.0, "max": 200.0, "n": 10}}, daemon_cores=0.3)
    by_name = {f.name: f for f in figures(level, knee=0.0)}
    assert by_name["lookup answer p99"].meets_goal is False  # 5 ms against 1 ms
    assert by_name["lookup answer p99 vs bare"].ratio == pytest.approx(50.0)
    assert by_name["daemon CPU"].meets_goal is True
    assert by_name["knee (p99 <= 1 ms)"].meets_goal is False


def test_levels_flag_is_checked() -> None:
    assert _levels("auto") is None and _levels("0.5, 2") == [0.5, 2.0]
    for bad in ("x", "0", "", "-1"):
        with pytest.raises(ValueError, match="--levels"):
            _levels(bad)


@pytest.mark.processes  # the daemon it measures
def test_a_short_capacity_run_measures_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "capacity"
    code = main(["bench", "capacity", "--profile", "small", "--levels", "1", "--warmup", "2", "--duration", "4",
                 "--l2-pages", "4096", "--max-prompt-tokens", "2048", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "capacity.json").read_text())
    names = {f["name"]: f for f in report["figures"]}
    for kind in ("lookup", "reserve"):
        vs_bare = names[f"{kind} answer p99 vs bare"]
        assert vs_bare["value"] > 0 and vs_bare["reference"] > 0  # both sides measured in this run
        assert vs_bare["meets_goal"] in (True, False)
    assert {"daemon CPU", "daemon CPU vs engines' own", "knee (p99 <= 1 ms)"} <= set(names)
    (level,) = report["levels"]
    assert level["rates"]["committed"] > 0 and level["rates"]["lookups"] > 0  # the traffic reached the daemon
    assert level["unanswered"] == 0
    assert level["process_cores"] and level["engines_cores"] > 0
    assert level["daemon_cpu_s_per_1k_requests"] > 0
    assert (out / "capacity.png").stat().st_size > 0
