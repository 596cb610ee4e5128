"""Fixtures for engine mode: random-weight checkpoints, real daemons, real vLLM engines.

Checkpoints are saved by ``transformers`` with random weights (nothing is downloaded).
The engines' helpers are ``tests.support.vllm_engines``. Every engine and daemon is stopped
at the end of its module or test, also when the test fails.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.engine_lib.vllm_driver import save_random_model
from hicache.bench.local_redis import RedisProcess, started
from tests.support.redis_servers import NO_REDIS, REDIS_SERVER
from tests.support.vllm_engines import Engines


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``llama-bf16`` (2 layers, 2 kv heads x 32) and ``qwen2-fp32`` (2 layers, 2 kv heads x 32)."""
    base = tmp_path_factory.mktemp("ckpt")
    return {
        "llama-bf16": save_random_model(base / "llama-bf16", arch="llama", dtype="bfloat16", seed=1),
        "qwen2-fp32": save_random_model(base / "qwen2-fp32", arch="qwen2", dtype="float32", seed=2),
    }


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A real ``redis-server`` for the module (skips, with the reason, where none is installed)."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    with started(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private directory with a short path (unix socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hce", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """The module's vLLM engines, stopped when the module is done."""
    e = Engines(tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield e
    finally:
        e.stop_all()
