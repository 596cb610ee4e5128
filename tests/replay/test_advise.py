"""``hicache advise``: the reuse profile against a naive LRU, tier advice against closed forms,
the command line, and the request log's ids.

The closed-form workload is ``tests.support.advise_trace.phases``.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest
import yaml

from hicache.api_server.request_log import chained_page_ids
from hicache.cli.main import main
from hicache.config import load_config
from hicache.replay_sim.advice import Advisor, Budgets
from hicache.replay_sim.bounds import belady_hits
from hicache.replay_sim.reuse import reuse_profile
from hicache.replay_sim.trace import DENSE_LIMIT, Trace, load_trace
from hicache.replay_sim.workload import Workload
from tests.support.advise_trace import A, B, phases, write_trace


def naive_lru_hits(requests: list[list[int]], capacity: int) -> int:
    """Prefix hits of an LRU cache of ``capacity`` pages that touches each request's pages
    deepest first (the traces' reference LRU)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in requests:
        for x in r:
            if x not in lru:
                break
            hits += 1
        for x in reversed(r):
            lru[x] = None
            lru.move_to_end(x)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits


def random_prefix_requests(rng: random.Random, count: int) -> list[list[int]]:
    """Requests that walk a random tree of chained ids (each id has one parent)."""
    children: dict[int | None, list[int]] = {}
    out = []
    for _ in range(count):
        node: int | None = None
        path = []
        for _depth in range(rng.randint(1, 9)):
            kids = children.setdefault(node, [])
            if kids and rng.random() < 0.7:
                node = rng.choice(kids)
            else:
                node = sum(len(v) for v in children.values()) + 1
                kids.append(node)
            path.append(node)
        out.append(path)
    return out


def workload_of(requests: list[list[int]]) -> Workload:
    return Workload.build(Trace("t", requests, [None] * len(requests), [None] * len(requests)), 1, 1)


# ---------------------------------------------------------------------------- reuse profile


def test_reuse_profile_equals_a_naive_prefix_lru_at_every_capacity() -> None:
    rng = random.Random(5)
    for _ in range(25):
        reqs = random_prefix_requests(rng, 70)
        prof = reuse_profile(reqs)
        assert prof.total == sum(len(r) for r in reqs)
        for cap in (1, 2, 3, 5, 8, 13, 21, 40, 100, 10_000):
            assert prof.hits(cap) == naive_lru_hits(reqs, cap), cap


def test_reuse_profile_matches_the_reference_lru_of_the_mooncake_trace(tmp_path: Path) -> None:
    from .test_replay import trace_file

    work = Workload.build(load_trace(trace_file("mooncake_conversation_trace.jsonl", tmp_path)))
    prof = reuse_profile(work.pages)
    # The traces' README: LRU at 1,000 / 2,000 / 5,859 / 10,000 / 20,000 blocks, and the ceiling.
    got = [round(100 * prof.hit_rate(c), 1) for c in (1000, 2000, 5859, 10000, 20000)]
    assert got == [4.5, 5.4, 13.6, 21.2, 28.8]
    assert round(100 * prof.ceiling, 1) == 36.6
    assert prof.unique == 182_790


def test_the_closed_form_workload_has_its_distances() -> None:
    prof = reuse_profile(phases((4, 7, 5)))
    # 16 returning requests, each with distances 25..31 (one per document page).
    assert prof.distances.tolist() == sorted(list(range(25, 32)) * 16)
    assert prof.smallest_reaching(prof.ceiling) == 31
    assert prof.hits(24) == 0 and prof.hits(31) == 112 and prof.total == 160


# ---------------------------------------------------------------------------- advice

TOTAL = 160 + 640


def test_each_tier_is_advised_at_its_closed_form_knee() -> None:
    adv = Advisor(workload_of(phases(A, B)))
    l1, l2, l3 = adv.recommend(Budgets(100, 1000, None), headroom=0)
    assert (l1.pages, l2.pages, l3.pages) == (31, 159, 0)
    assert l1.served == pytest.approx(112 / TOTAL) and l2.served == pytest.approx(450 / TOTAL)
    assert l2.cumulative == pytest.approx(562 / TOTAL)
    assert l3.knee_gain == 0 and l3.belady is None  # nothing past L2: L3 is left off
    for t in (l1, l2):  # Belady beside each tier: one cache of that size, never below LRU
        assert t.belady is not None and t.belady >= t.cumulative
        assert t.belady == pytest.approx(belady_hits(adv.work.pages, t.pages) / TOTAL)

    # L1 large enough for both working sets: it takes both, and nothing is left for L2 / L3.
    l1, l2, l3 = adv.recommend(Budgets(1000, 2000, None), headroom=0)
    assert (l1.pages, l2.pages, l3.pages) == (159, 0, 0)
    # A tier must add more than the gain: with the first phase repeated 20 times, L1 serves
    # 532 of 960 pages at 31 pages, and L2 would add 150 of them (15.6 points), not 20. The
    # same gain sets L1's own knee: at 24 + k pages, 76 returning requests hit k pages each,
    # and the first k within 20 points of 55.4 % is 5 (29 pages: 380 hits, 39.6 %).
    other = Advisor(workload_of(phases((4, 7, 20), (10, 15, 2))))
    l1, l2, l3 = other.recommend(Budgets(100, 1000, None), gain=0.20, headroom=0)
    assert (l1.pages, l2.pages, l3.pages) == (29, 0, 0) and l1.served == pytest.approx(380 / 960)
    # With 5 points: L1 at 31, and L2 where 10 returning documents hit k of their pages
    # within 5 points of 71.0 %: k = 11, 144 + 11 = 155 pages.
    assert [t.pages for t in other.recommend(Budgets(100, 1000, None), gain=0.05, headroom=0)] == [31, 155, 0]
    # No L2: L3 cannot be used (it is read through L2), whatever its budget.
    l1, l2, l3 = adv.recommend(Budgets(100, 0, None), headroom=0)
    assert (l1.pages, l2.pages, l3.pages) == (31, 0, 0)
    # L2 capped below the second knee, L3 unbounded: L3 takes it from there.
    l1, l2, l3 = adv.recommend(Budgets(100, 150, None), headroom=0)
    assert (l1.pages, l2.pages, l3.pages) == (31, 150, 159)
    assert l3.served == pytest.approx(9 * 30 / TOTAL)  # pages 7..15 of the 30 returning documents
    # The default headroom: 10 % over each knee, rounded up, and never over the budget.
    assert [t.pages for t in adv.recommend(Budgets(100, 1000, None))] == [35, 175, 0]
    assert [t.pages for t in adv.recommend(Budgets(100, 170, None))] == [35, 170, 0]


def test_the_advised_sizes_replay_through_the_real_tree_near_the_model() -> None:
    adv = Advisor(workload_of(phases(A, B)))
    advice = adv.advise(Budgets(100, 1000, None), ["lru", "slru", "lfu"], workers=2)
    assert [t.pages for t in advice.tiers] == [35, 175, 0]
    # Exactly at the knees the tree falls off the cliff (it evicts whole nodes): the headroom
    # is what makes the advice hold.
    at_knees = adv.replay(31, 159, 0, "lru")
    assert at_knees.hit_rate < 0.5
    assert set(advice.policies) == {"lru", "slru", "lfu"}
    lru = advice.policies["lru"]
    assert lru.hit_rate == pytest.approx(562 / TOTAL, abs=0.02)
    assert advice.best_policy is not None
    assert advice.predicted_hit_rate == advice.policies[advice.best_policy].hit_rate
    # Forked workers give what one process gives.
    alone = adv.advise(Budgets(100, 1000, None), ["lru"], workers=1)
    assert alone.policies["lru"].hit_tokens == lru.hit_tokens
    assert [r.lru for r in alone.grid] == [r.lru for r in advice.grid]


# ---------------------------------------------------------------------------- the command


def test_the_command_prints_writes_a_valid_config_and_json(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, phases(A, B))
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"cache": {"page_size": 16, "l3": {"file": {"dir": str(tmp_path / "l3")}}},
                                    "server": {"port": 31999}}))
    out, doc = tmp_path / "advised.yaml", tmp_path / "advice.json"
    rc = main(["advise", str(trace), "--config", str(base), "--l1-max", "1600", "--l2-max", "16000",
               "--write", str(out), "--json", str(doc), "--plot", str(tmp_path / "a.png"), "--grid-belady"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "grid" in text and "tiers" in text and "<- advised" in text
    cfg = load_config(out)
    # L1 is written with room for the running requests (8192 + 2048 by default), over the advice
    assert cfg.cache.l1.tokens == 10240 and cfg.cache.l2.tokens == 10240 and cfg.cache.l2.enabled
    assert "L1 written as 10,240 tokens, above the advised 560" in text
    assert cfg.cache.l3.backend == "none"
    assert cfg.server.port == 31999  # the base config's other keys are kept
    d = json.loads(doc.read_text())
    assert [t["tokens"] for t in d["tiers"]] == [35 * 16, 175 * 16, 0]
    assert [t["knee_tokens"] for t in d["tiers"]][:2] == [31 * 16, 159 * 16]
    assert all(r["belady"] is not None and r["belady"] >= r["lru"] - 1e-12 for r in d["grid"])
    assert d["predicted_hit_rate"] == pytest.approx(562 / TOTAL, abs=0.02)


@pytest.mark.parametrize("argv, message", [
    (["--l1-max", "lots"], "--l1-max: not a capacity"),
    (["--l1-max", "0"], "--l1-max must be bounded"),
    (["--l2-max", "inf"], "--l2-max must be bounded"),
    (["--policies", "fifo"], "unknown eviction policy 'fifo'"),
    (["--gain", "0"], "--gain must be between"),
    (["--headroom", "-1"], "--headroom must be between"),
    (["--limit", "0"], "--limit must be >= 1"),
])
def test_bad_arguments_fail_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], message: str) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, phases(A))
    assert main(["advise", str(trace), "--plot", str(tmp_path / "p.png"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_or_broken_trace_fails_with_its_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "x"}\n')
    assert main(["advise", str(bad), "--block-size", "16"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


# ---------------------------------------------------------------------------- request-log ids


def test_request_log_ids_are_chained_per_page_and_salted() -> None:
    a = list(range(100, 140))  # 2.5 pages of 16
    ids = chained_page_ids(a, 16)
    assert len(ids) == 3 and all(0 <= i < 2**63 for i in ids)
    assert chained_page_ids(a[:32] + [7] * 8, 16)[:2] == ids[:2]  # same first two pages
    other = chained_page_ids([1] + a[1:], 16)
    assert all(x != y for x, y in zip(ids, other, strict=True))  # a change in page 0 changes every id
    assert set(chained_page_ids(a, 16, salt="tenant-b")).isdisjoint(ids)


def test_large_ids_are_renumbered_with_their_equalities(tmp_path: Path) -> None:
    reqs = [[2**62 + 5, 2**40], [2**62 + 5, 2**40, 9], [2**62 + 5, 2**50]]
    path = tmp_path / "log.jsonl"
    write_trace(path, reqs)
    tr = load_trace(path)
    assert tr.blocks == [[0, 1], [0, 1, 2], [0, 3]]
    assert all(i < DENSE_LIMIT for ids in tr.blocks for i in ids)
    assert reuse_profile(tr.blocks).hits(None) == reuse_profile([[0, 1], [0, 1, 2], [0, 3]]).hits(None) == 3


def test_the_written_config_keeps_what_the_base_config_needs_of_l2(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, phases(A))  # one working set: L1 takes it, L2 would add nothing
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "cache": {"page_size": 16, "l3": {"backend": "none"}},
        "scheduler": {"max_prefill_tokens": 256, "chunked_prefill_tokens": 128},
        "server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l2_tokens": 1024}},
                                {"tenant": "b", "key": "j" * 32, "quota": {"l2_tokens": 512}}]},
    }))
    out = tmp_path / "advised.yaml"
    assert main(["advise", str(trace), "--config", str(base), "--l1-max", "1600", "--l2-max", "4096",
                 "--write", str(out), "--plot", str(tmp_path / "p.png"), "--policies", "lru"]) == 0
    cfg = load_config(out)
    assert cfg.cache.l1.tokens == 560  # the knee (31 pages) + 10 %, over the floor of 384
    assert cfg.cache.l2.enabled and cfg.cache.l2.tokens == 1536  # the quotas reserve it
    assert sum(k.quota.l2_tokens for k in cfg.server.api_keys if k.quota) == 1536


def test_the_written_config_keeps_a_file_l3_larger_than_the_base_configs_tenant_partitions(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, phases(A))  # one working set: L1 takes it, L3 would add nothing
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "cache": {"page_size": 16, "l3": {"backend": "file", "file": {"max_size_gb": 5}}},
        "scheduler": {"max_prefill_tokens": 256, "chunked_prefill_tokens": 128},
        "server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l3_gb": 2}}]},
    }))
    out = tmp_path / "advised.yaml"
    assert main(["advise", str(trace), "--config", str(base), "--l1-max", "1600", "--l2-max", "4096",
                 "--l3-max", "8192", "--write", str(out), "--plot", str(tmp_path / "p.png"), "--policies", "lru"]) == 0
    cfg = load_config(out)  # valid: the partitions are less than the store
    assert cfg.cache.l3.backend == "file" and 2 < cfg.cache.l3.file.max_size_gb < 2.01
