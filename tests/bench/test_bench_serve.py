"""``hicache bench serve``: workload generators (pure), and runs against a real daemon.

The daemon tests start one ``hicache serve`` (tiny preset, L1 + L2 + file L3) for the
module and drive it for a few seconds per run through the CLI, then check the output
folder: every JSON field, valid PNGs, per-tier hits that add up and agree with /metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import yaml

from hicache.bench.serve_lib.client import DaemonError, HttpClient
from hicache.bench.serve_lib.daemon import ManagedDaemon
from hicache.bench.serve_lib.driver import LoadSpec, poisson_arrivals
from hicache.bench.serve_lib.prom import parse_counters
from hicache.bench.serve_lib.results import FIELDS, LATENCY_KEYS, STAT_KEYS
from hicache.bench.serve_lib.workloads import (
    TokenRange,
    TraceError,
    WorkloadError,
    block_tokens,
    long_doc_qa,
    multi_turn,
    shared_prefix,
    trace_workload,
)
from hicache.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- generators


def _all_tokens(w) -> list[int]:
    return [t for c in w.conversations for turn in c.turns for t in turn.tokens]


def test_multi_turn_is_deterministic_under_a_seed() -> None:
    a = multi_turn(4, 3, 32, 8, system_len=16, seed=7)
    b = multi_turn(4, 3, 32, 8, system_len=16, seed=7)
    c = multi_turn(4, 3, 32, 8, system_len=16, seed=8)
    assert a == b
    assert _all_tokens(a) != _all_tokens(c)
    assert a.requests == 12 and len(a.conversations) == 4


def test_multi_turn_history_grows_by_answer_and_question() -> None:
    w = multi_turn(2, 4, 20, 5, system_len=10, seed=1)
    conv = w.conversations[1]
    answers = [[300 + 10 * k + i for i in range(5)] for k in range(3)]
    prev = conv.prompt(0, [])
    assert len(prev) == 10 + 20
    assert prev[:10] == list(w.conversations[0].turns[0].tokens[:10])  # the shared system prompt
    for k in range(1, 4):
        cur = conv.prompt(k, answers[:k])
        assert cur == prev + answers[k - 1] + list(conv.turns[k].tokens)
        assert len(cur) == len(prev) + 5 + 20
        prev = cur
    assert conv.max_prompt_tokens() == len(prev)
    assert w.max_context_needed() == len(prev) + 5
    with pytest.raises(IndexError):
        conv.prompt(2, answers[:1])
    with pytest.raises(WorkloadError, match="context"):
        w.check_fits(len(prev))


@pytest.mark.parametrize("rng", [TokenRange(), TokenRange(5, 9), TokenRange(1, 32000)])
def test_every_generator_stays_in_the_token_range(rng: TokenRange, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]}\n')
    workloads = [
        multi_turn(3, 2, 50, 4, system_len=20, seed=3, tokens=rng),
        shared_prefix(3, 4, 30, 10, 4, seed=3, tokens=rng),
        long_doc_qa(2, 100, 3, 10, 4, seed=3, tokens=rng),
        trace_workload(trace, block_tokens_n=16, seed=3, tokens=rng),
    ]
    for w in workloads:
        toks = _all_tokens(w)
        assert toks and min(toks) >= rng.low and max(toks) < rng.high, w.name
    with pytest.raises(WorkloadError):
        TokenRange(10, 10)


def test_shared_prefix_and_long_doc_qa_share_what_they_should() -> None:
    w = shared_prefix(3, 4, 30, 10, 4, seed=0)
    assert w.requests == 12 and w == shared_prefix(3, 4, 30, 10, 4, seed=0)
    systems = {c.turns[0].tokens[:30] for c in w.conversations}
    assert len(systems) == 3
    assert len({c.turns[0].tokens for c in w.conversations}) == 12
    d = long_doc_qa(3, 64, 2, 8, 4, seed=0)
    docs = {c.turns[0].tokens[:64] for c in d.conversations}
    assert len(docs) == 3 and d.requests == 6
    with pytest.raises(WorkloadError, match="groups"):
        shared_prefix(0, 4, 30, 10, 4)


def test_trace_blocks_map_to_deterministic_tokens(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([
        '{"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [7, 8, 9]}',
        '',
        '{"timestamp": 1500, "input_length": 20, "output_length": 900, "hash_ids": [7, 8]}',
        '{"timestamp": 4000, "input_length": 10, "output_length": 2, "hash_ids": [5]}',
    ]) + "\n")
    w = trace_workload(path, seed=1, max_output_len=64)
    assert w.timed and w.params["trace_block_size"] == 16
    p0, p1, p2 = (c.turns[0] for c in w.conversations)
    assert len(p0.tokens) == 40 and len(p1.tokens) == 20 and len(p2.tokens) == 10
    assert p0.tokens[:20] == p1.tokens  # equal ids at a position: equal prefixes
    assert p0.tokens[:16] == block_tokens(7, 16, seed=1) and p2.tokens == block_tokens(5, 16, seed=1)[:10]
    assert (p0.at_s, p1.at_s, p2.at_s) == (0.0, 0.5, 3.0)
    assert (p0.max_new_tokens, p1.max_new_tokens) == (3, 64)
    assert trace_workload(path, seed=1) == trace_workload(path, seed=1)
    short = trace_workload(path, block_tokens_n=4, max_prompt_len=6, limit=2)
    assert [len(c.turns[0].tokens) for c in short.conversations] == [6, 5]
    assert short.params["truncated"] == 1

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\n{"hash_ids": [1]}\n{"hash_ids": "x"}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:3"):
        trace_workload(bad)
    worse = tmp_path / "worse.jsonl"
    worse.write_text('{"hash_ids": [1]}\nnot json\n')
    with pytest.raises(TraceError, match=r"worse\.jsonl:2"):
        trace_workload(worse)


def test_arrivals_counters_and_load_validation() -> None:
    a = poisson_arrivals(4.0, 200, seed=3)
    assert a == poisson_arrivals(4.0, 200, seed=3) and a != poisson_arrivals(4.0, 200, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert 30 < a[-1] < 70  # mean gap 0.25 s
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    text = ('# TYPE hicache_cached_tokens counter\n'
            'hicache_cached_tokens_total{tier="device"} 10.0\nhicache_cached_tokens_total{tier="host"} 5.0\n'
            '# TYPE hicache_prompt_tokens counter\nhicache_prompt_tokens_total 40.0\n')
    snap = parse_counters(text).to_json()
    assert snap == {"device": 10, "host": 5, "storage": 0, "cached": 15, "prompt": 40, "generation": 0}
    for bad in (dict(clients=0), dict(rate=0.0), dict(speed=-1.0), dict(max_concurrency=0)):
        with pytest.raises(WorkloadError):
            LoadSpec(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- a real daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("bench_serve")
    cfg = {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 16, "l1": {"tokens": 8192}, "l2": {"tokens": 16384},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}},
        "logging": {"level": "warning"},
    }
    path = tmp / "hicache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    d = ManagedDaemon(path, log_path=tmp / "daemon.log")
    d.start(180)
    try:
        yield d
    finally:
        code = d.stop()
        d.kill()
    assert code == 0, d.log_tail()


def _check_output(out: Path) -> dict:
    doc = json.loads((out / "result.json").read_text())
    for key in ("benchmark", "time", "machine", "figures", *FIELDS, "files"):
        assert key in doc, key
    for key in LATENCY_KEYS:
        assert set(STAT_KEYS) <= set(doc["latency"][key]), key
        assert doc["latency"][key]["count"] > 0
        assert doc["latency"][key]["p50"] <= doc["latency"][key]["p90"] <= doc["latency"][key]["p99"]
    assert set(doc["throughput"]) == {"requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
                                      "total_tokens_per_s"}
    assert doc["requests"]["failed"] == 0 and doc["requests"]["completed"] == doc["requests"]["planned"]
    # per-tier hits add up, request by request and in total, and agree with the /metrics deltas
    resp = doc["cache"]["responses"]
    assert resp["device"] + resp["host"] + resp["storage"] == resp["cached"]
    assert resp["cached"] + resp["computed"] == resp["prompt"]
    assert resp["cached"] == doc["tokens"]["cached_per_request_sum"] == sum(r["cached_tokens"] for r in doc["records"])
    for r in doc["records"]:
        assert sum(r["cached_tokens_details"].values()) == r["cached_tokens"]
    assert doc["cache"]["metrics_match"] is True
    assert {t: doc["cache"]["metrics"][t] for t in ("device", "host", "storage")} == \
        {t: resp[t] for t in ("device", "host", "storage")}
    # the scheduler's TTFT breakdown came with every response and fits inside the client's TTFT
    for name in ("queue", "load", "prefill"):
        assert doc["server_timings_ms"][name]["count"] == doc["requests"]["completed"], name
    for r in doc["records"]:
        t = r["timings_ms"]
        assert min(t.values()) >= 0.0
        assert sum(t.values()) <= r["ttft_s"] * 1000 + 1.0
    tl = doc["timeline"]
    assert sum(tl["device"]) + sum(tl["host"]) + sum(tl["storage"]) == resp["cached"]
    for name in ("ttft_cdf.png", "tier_hits.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        try:
            from PIL import Image
        except ImportError:
            import matplotlib.image

            assert matplotlib.image.imread(str(out / name)).shape[0] > 100
        else:
            with Image.open(out / name) as im:
                im.verify()
                assert im.size[0] > 100
    assert (out / "summary.md").read_text().startswith("# hicache bench serve")
    return doc


def test_multi_turn_closed_loop_against_a_daemon(daemon: ManagedDaemon, tmp_path: Path) -> None:
    out = tmp_path / "mt"
    rc = main(["bench", "serve", "--url", daemon.url, "--conversations", "3", "--rounds", "3",
               "--question-len", "48", "--output-len", "4", "--clients", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = _check_output(out)
    assert doc["workload"]["name"] == "multi_turn" and doc["requests"]["planned"] == 9
    assert doc["cache"]["responses"]["cached"] > 0  # rounds 2 and 3 reuse their history
    by_conv: dict[int, list[dict]] = {}
    for r in doc["records"]:
        by_conv.setdefault(r["cid"], []).append(r)
    for recs in by_conv.values():  # each round sends the history + the answer + a new question
        lens = [r["prompt_len"] for r in sorted(recs, key=lambda r: r["turn"])]
        assert lens == [48, 48 + 4 + 48, 2 * (48 + 4) + 48]


def test_shared_prefix_open_loop_against_a_daemon(daemon: ManagedDaemon, tmp_path: Path) -> None:
    out = tmp_path / "gsp"
    rc = main(["bench", "serve", "--url", daemon.url, "--workload", "shared-prefix", "--groups", "2",
               "--prompts-per-group", "4", "--system-len", "64", "--question-len", "16", "--output-len", "3",
               "--rate", "5", "--out", str(out), "--no-progress", "--json", str(tmp_path / "fig.json")])
    assert rc == 0
    doc = _check_output(out)
    assert doc["load"]["mode"] == "open" and doc["load"]["rate"] == 5
    # Open loop: a prompt that arrives before the first of its group has been prefilled
    # cannot hit, so how many hit depends on the machine's speed; some always do.
    assert doc["cache"]["responses"]["cached"] >= 64
    assert json.loads((tmp_path / "fig.json").read_text())["benchmark"] == "serve"


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.bench.loopback_ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["bench", "serve", "--url", url, "--out", str(tmp_path / "x"), "--no-progress"])
    assert rc == 2
    assert f"cannot reach the daemon at {url}" in capsys.readouterr().err

    async def probe() -> None:
        async with HttpClient(url) as client:
            await client.health()

    with pytest.raises(DaemonError, match="cannot reach"):
        asyncio.run(probe())


def test_trace_at_its_own_times_against_a_daemon(daemon: ManagedDaemon, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 64, "output_length": 3,
                                         "hash_ids": [1, 2, 3 + i % 2, 10 + i]}) + "\n" for i in range(6)))
    out = tmp_path / "trace"
    rc = main(["bench", "serve", "--url", daemon.url, "--workload", "trace", "--trace", str(trace),
               "--speed", "0.5", "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = _check_output(out)
    assert doc["load"]["mode"] == "trace" and doc["load"]["speed"] == 0.5
    starts = sorted(r["start_s"] for r in doc["records"])
    assert starts[-1] >= 1.0 - 0.05  # the last record is at 500 ms, at half speed
    assert doc["cache"]["responses"]["cached"] >= 3 * 32  # blocks 1 and 2 are shared by every record

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\n{"hash_ids": [-1]}\n')
    rc = main(["bench", "serve", "--url", daemon.url, "--workload", "trace", "--trace", str(bad),
               "--out", str(tmp_path / "bad"), "--no-progress"])
    assert rc == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
