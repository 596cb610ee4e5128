"""Engine mode with multi-head latent attention (DeepSeek V2, random weights saved here) on
vLLM's CPU MLA backend, at two tensor-parallel ranks.

vLLM's CPU platform turns its own prefix caching off for MLA models (and forces blocks of
16 tokens), so every hit here is hicache's. Each rank holds the whole latent (one 576-wide
vector per token and layer): rank 0 alone copies it into L2, so a page is stored once, not
once per rank, and every rank loads it. The oracle is vLLM alone at two ranks: greedy
outputs through vLLM + hicache equal it token for token, from L2 and from the file L3 after a
daemon restart.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.engine_lib.vllm_driver import VllmProcess, save_random_model
from tests.support.daemon import Daemon
from tests.support.vllm_engines import Engines, ModelStack, engine_config, expected_hit

pytestmark = pytest.mark.timeout(900)

BLOCK = 16  # vLLM's CPU MLA kernel takes blocks of 16 only
LAYERS = 2
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim
PAGE_BYTES = LAYERS * BLOCK * LATENT * 4  # float32
RANKS = 2
MAX_TOKENS = 8

_rnd = random.Random(31)
P = [[_rnd.randrange(1, 1000) for _ in range(n)] for n in (100, 300, 530)]


@pytest.fixture(scope="module")
def stack(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelStack]:
    tmp = tmp_path_factory.mktemp("engine-mla")
    model = save_random_model(tmp / "deepseek_v2", arch="deepseek_v2", layers=LAYERS, heads=4, kv_heads=4,
                              head_dim=32, dtype="float32", seed=8)
    # the reference MLA backend even where the CPU has AMX tiles (vLLM would pick AMX_MLA, which
    # takes no float32 weights and which the connector refuses)
    kw = {"dtype": "float32", "block_size": BLOCK, "tensor_parallel": RANKS, "attention_backend": "CPU_MLA"}
    alone = engines.start(model, "alone", **kw)
    reference = {tuple(p): o for p, o in zip(P, alone.generate(P, MAX_TOKENS)["outputs"], strict=True)}
    alone.stop()
    cfg = engine_config(model, Path(f"/tmp/hcm-{os.getpid()}"), page_size=BLOCK,
                        l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        yield ModelStack(model, daemon, engines, reference, **kw)
    finally:
        daemon.stop()


def _counter(engine: VllmProcess, name: str) -> float:
    return sum(float(m["value"] or 0) for m in engine.metrics(name) if m["name"] == name)


def test_mla_pages_are_stored_once_and_hits_equal_vllm_alone(stack: ModelStack) -> None:
    a = stack.engine("a", log_stats=True)
    first = a.generate(P, MAX_TOKENS)
    stack.check(first, P)
    assert first["cached"] == [0] * len(P)
    st = stack.wait("P's saves", lambda st: st["leases"]["open"] == 0)
    committed = st["engine"]["committed_pages"]
    assert committed >= sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)
    # the latent of a page is copied once (by rank 0), not once per rank
    assert _counter(a, "vllm:hicache_saved_bytes") == committed * PAGE_BYTES
    again = a.generate(P, MAX_TOKENS)  # vLLM keeps no prefix cache for MLA on the CPU: these are hicache's
    stack.check(again, P)
    assert again["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    loaded = sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)
    assert _counter(a, "vllm:hicache_loaded_bytes") == loaded * PAGE_BYTES * RANKS  # every rank loads its copy
    stack.idle_and_intact()


def test_the_file_l3_serves_mla_pages_after_a_daemon_restart(stack: ModelStack) -> None:
    a = stack.engine("a")
    stack.restart_after_backups(BLOCK)
    out = a.generate(P, MAX_TOKENS)
    stack.check(out, P)
    full = [expected_hit(len(p), BLOCK) for p in P]
    # every hit comes from L3 (L2 restarted empty); right after the restart a prefetch has
    # been seen to bring fewer pages than L3 holds (a shorter hit, never a wrong one)
    assert all(0 < got <= want for got, want in zip(out["cached"], full, strict=True)), out["cached"]
    loaded = sum(out["cached"]) // BLOCK
    stack.wait("the loads from L3", lambda st: st["engine"]["loaded_storage_pages"] == loaded)
    stack.idle_and_intact()
