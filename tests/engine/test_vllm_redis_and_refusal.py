"""Engine mode with a Qwen2 model in float32, vLLM blocks of 64 and Redis as L3.

After a daemon restart (L2 empty) the prefix comes back from a real ``redis-server``; the
outputs equal vLLM alone's. Then the same engine meets a daemon that serves another model:
it is refused (no hit, no wrong page), and every answer is still vLLM alone's.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from hicache.bench.local_redis import RedisProcess
from tests.support.daemon import Daemon
from tests.support.vllm_engines import Engines, engine_config, expected_hit

pytestmark = pytest.mark.timeout(900)

BLOCK = 64
MAX_TOKENS = 6
PROMPTS = [[random.Random(10 + i).randrange(1, 1000) for _ in range(n)] for i, n in enumerate([200, 330, 500])]


def test_redis_l3_qwen2_fp32_block_64_and_a_daemon_of_another_model(
        checkpoints: dict[str, Path], engines: Engines, redis_server: RedisProcess, tmp_path: Path) -> None:
    qwen = checkpoints["qwen2-fp32"]
    alone = engines.start(qwen, "alone", block_size=BLOCK, dtype="float32")
    reference = alone.generate(PROMPTS, MAX_TOKENS)["outputs"]
    alone.stop()
    run_dir = Path(f"/tmp/hcr-{os.getpid()}")
    l3 = {"backend": "redis", "redis": {"url": redis_server.url, "key_prefix": "hc-test"}}
    daemon = Daemon(tmp_path, engine_config(qwen, run_dir, page_size=BLOCK, l3=l3), "daemon")
    daemon.start()
    try:
        e = engines.start(qwen, "e", hicache=daemon, block_size=BLOCK, dtype="float32")
        first = e.generate(PROMPTS, MAX_TOKENS)
        assert first["outputs"] == reference and first["cached"] == [0, 0, 0]
        hit = [expected_hit(len(p), BLOCK) for p in PROMPTS]
        again = e.generate(PROMPTS, MAX_TOKENS)
        assert again["outputs"] == reference and again["cached"] == hit
        deadline = time.monotonic() + 30  # backups to L3 run behind the saves
        while redis_server.keys() < sum(h // BLOCK for h in hit):
            assert time.monotonic() < deadline, f"{redis_server.keys()} pages in Redis"
            time.sleep(0.2)
        assert daemon.stop() == 0
        daemon.start()  # L2 is empty: the pages come from Redis
        from_redis = e.generate(PROMPTS, MAX_TOKENS)
        assert from_redis["outputs"] == reference and from_redis["cached"] == hit
        deadline = time.monotonic() + 10  # the engine's releases are fire-and-forget
        while daemon.get("/cache/stats")["engine"]["loaded_storage_pages"] != sum(h // BLOCK for h in hit):
            assert time.monotonic() < deadline, daemon.get("/cache/stats")["engine"]
            time.sleep(0.2)
        assert daemon.stop() == 0
        # the same socket, a daemon of another model: the engine is refused and serves alone
        other = Daemon(tmp_path, engine_config(checkpoints["llama-bf16"], run_dir, page_size=BLOCK, l3=l3),
                       "other")
        other.start()
        try:
            alone_again = e.generate(PROMPTS, MAX_TOKENS)
            assert alone_again["outputs"] == reference and alone_again["cached"] == [0, 0, 0]
            # the engine's heartbeat thread asks the new daemon to register it; its requests
            # may all run before that (a request without a session neither looks up nor saves)
            stats = other.wait_for_stats("the engine's refusal", lambda s: s["engine"]["refused"] >= 1, 30)
            assert not stats["engines"]
            assert stats["engine"]["lookups"] == 0
            assert "refused this engine" in e.log_path.read_text()
        finally:
            assert other.stop() == 0
    finally:
        daemon.kill_all()
