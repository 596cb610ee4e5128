"""The copy thread (``hicache_copy: async``) and vLLM's ``kv_role``, through real vLLM engines.

One daemon, two engines in the disaggregated set-up (docs/engine-mode.md): a prefill engine
P (``kv_producer``: saves, never loads) and a decode engine D (``kv_consumer``: loads, never
saves), both copying on their copy thread. P's copy thread lags on purpose (a fault point
sleeps before each save's copy) while P has KV space for few requests, so the blocks of a
finished request are handed to the next ones while their saves still read them: the fence
must hold the next forward pass until those saves are done, or D would load pages that hold
another request's KV. D's first load fails (a fault point): vLLM recomputes that request. D asking while P's saves
are still in flight waits for them (``engine.save_wait_ms``) and loads every page P computed.
The oracle is vLLM alone's greedy outputs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.engine_lib.vllm_driver import VllmProcess, connector_config
from hicache.connectors.faults import FAIL_LOADS_ENV, SLOW_COPIES_ENV
from tests.support.daemon import Daemon
from tests.support.vllm_engines import Engines, engine_config, expected_hit

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
MAX_TOKENS = 8
PROMPTS = [[random.Random(40 + i).randrange(1, 1000) for _ in range(n)]
           for i, n in enumerate([290, 150, 230, 300, 260, 190, 280, 210, 240, 170])]
IN_FLIGHT = [[random.Random(80 + i).randrange(1, 1000) for _ in range(n)] for i, n in enumerate([270, 200, 310, 180])]
"""Prompts D asks for right after P answered them, while P's lagging copy thread still saves them."""
SHORT = list(range(1, 21))  # shorter than a block: neither looked up nor saved
COPY_LAG_S = 0.3
"""P's copy thread sleeps this long before each save: D's lookups, made a few ms after P
answered, meet saves still in flight even on a busy machine."""
SAVE_WAIT_MS = 10_000
"""How long D's lookups may wait for P's saves here (the default, 500 ms, is for a copy that
takes milliseconds; these are slowed on purpose, one after another)."""
P_BLOCKS = 40  # P's KV space: 1,280 tokens, three or four of these requests at a time


def _pages(prompt: list[int]) -> int:
    """Pages P saves of a request it prefills and answers with one token."""
    return len(prompt) // BLOCK


def _connector(daemon: Daemon, role: str) -> dict[str, Any]:
    return connector_config(str(daemon.config_path), copy_mode="async", role=role)


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _metric(engine: VllmProcess, name: str) -> float:
    """A counter of the engine's connector, once a step of a short request (no lookup, no save)
    carried the counts of the copies that ended after the last steps."""
    engine.generate([SHORT], 2)
    return sum(float(m["value"] or 0) for m in engine.metrics("vllm:hicache") if m["name"] == name)


class Pair:
    def __init__(self, daemon: Daemon, prefill: VllmProcess, decode: VllmProcess,
                 reference: dict[tuple[int, ...], list[int]]) -> None:
        self.daemon, self.prefill, self.decode, self.reference = daemon, prefill, decode, reference

    def check(self, out: dict[str, Any], prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> None:
        assert out["finish"] == ["length"] * len(prompts), out["finish"]
        for p, o in zip(prompts, out["outputs"], strict=True):
            assert o == self.reference[tuple(p)][:max_tokens], f"a {len(p)}-token prompt diverged from vLLM alone"

    def engine_stats(self) -> dict[str, Any]:
        return self.daemon.get("/cache/stats")["engine"]


@pytest.fixture(scope="module")
def pair(checkpoints: dict[str, Path], engines: Engines, tmp_path_factory: pytest.TempPathFactory,
         short_dir_module: Path) -> Iterator[Pair]:
    model = checkpoints["qwen2-fp32"]
    alone = engines.start(model, "alone", dtype="float32")
    out = alone.generate(PROMPTS + IN_FLIGHT, MAX_TOKENS)
    alone.stop()
    reference = {tuple(p): o for p, o in zip(PROMPTS + IN_FLIGHT, out["outputs"], strict=True)}
    tmp = tmp_path_factory.mktemp("copy-modes")
    cfg = engine_config(model, short_dir_module)
    cfg["engine"]["save_wait_ms"] = SAVE_WAIT_MS
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        prefill = engines.start(model, "prefill", kv_transfer=_connector(daemon, "kv_producer"), log_stats=True, dtype="float32",
                                num_blocks=P_BLOCKS, max_model_len=512, env={SLOW_COPIES_ENV: str(COPY_LAG_S)})
        decode = engines.start(model, "decode", kv_transfer=_connector(daemon, "kv_consumer"), log_stats=True, dtype="float32",
                               max_model_len=512, env={FAIL_LOADS_ENV: "1"})
        yield Pair(daemon, prefill, decode, reference)
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def short_dir_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="hcm", dir="/tmp"))  # unix socket paths stay short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_lagging_copy_thread_saves_what_vllm_computed_while_vllm_reuses_the_blocks(pair: Pair) -> None:
    prefilled = pair.prefill.generate(PROMPTS, 1)  # the proxy's first leg: prefill, one token
    pair.check(prefilled, PROMPTS, 1)
    assert prefilled["cached"] == [0] * len(PROMPTS)
    want = sum(_pages(p) for p in PROMPTS)
    st = pair.daemon.wait_for_stats("P's saves to be committed", lambda s: s["engine"]["committed_pages"] == want
                                    and s["leases"]["open"] == 0, 60)
    assert st["engine"]["commit_failed_pages"] == 0
    # the blocks of finished requests were handed on while their saves still read them
    # (vLLM's metrics arrive a moment after the step that counted them)
    _wait(lambda: _metric(pair.prefill, "vllm:hicache_fence_waits") > 0, "a forward pass waiting for a save")


def test_the_decode_engine_loads_asynchronously_and_gives_vllm_alones_tokens(pair: Pair) -> None:
    before = pair.engine_stats()
    out = pair.decode.generate(PROMPTS, MAX_TOKENS)  # the proxy's second leg: the whole request
    pair.check(out, PROMPTS)
    hits = [expected_hit(len(p), BLOCK) for p in PROMPTS]
    # its first load failed (fault point): that request was recomputed whole, the others loaded
    failed = [i for i, (got, want) in enumerate(zip(out["cached"], hits, strict=True)) if got != want]
    assert len(failed) == 1 and out["cached"][failed[0]] == 0, (out["cached"], hits)
    _wait(lambda: _metric(pair.decode, "vllm:hicache_load_errors") == hits[failed[0]] // BLOCK,
          "the failed load's blocks counted")
    after = pair.daemon.wait_for_stats("D's loads to be released", lambda s: s["leases"]["open"] == 0, 30)["engine"]
    # a consumer never saves: the daemon holds no more pages than the prefill engine gave it
    assert after["reserves"] == before["reserves"] and after["committed_pages"] == before["committed_pages"]
    assert _metric(pair.decode, "vllm:hicache_saved_blocks") == 0


def test_the_decode_engine_waits_for_saves_in_flight_and_loads_every_page(pair: Pair) -> None:
    waits = pair.engine_stats()["lookup_save_waits"]
    prefilled = pair.prefill.generate(IN_FLIGHT, 1)  # P's copy thread sleeps COPY_LAG_S before each save
    pair.check(prefilled, IN_FLIGHT, 1)
    out = pair.decode.generate(IN_FLIGHT, MAX_TOKENS)  # at once: P still saves
    pair.check(out, IN_FLIGHT)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in IN_FLIGHT]
    assert pair.engine_stats()["lookup_save_waits"] > waits  # D's lookups met saves in flight and waited
    pair.daemon.wait_for_stats("D's loads to be released", lambda s: s["leases"]["open"] == 0, 30)


def test_a_producer_never_loads(pair: Pair) -> None:
    lookups = pair.engine_stats()["lookups"]
    again = pair.prefill.generate(PROMPTS[:3], MAX_TOKENS)
    pair.check(again, PROMPTS[:3])
    assert again["cached"] == [0, 0, 0]  # every page is in L2, and P computed them all again
    assert pair.engine_stats()["lookups"] == lookups
