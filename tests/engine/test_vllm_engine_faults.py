"""Engine mode under faults that used to serve wrong KV or fail requests (real vLLM, real daemon).

The oracle is vLLM alone, as in ``test_vllm_engine_mode``: greedy outputs through vLLM +
hicache equal those of the same model in a vLLM without the connector.

* A load that fails (a connector fault point fails the worker's first load) is recomputed
  under vLLM's default ``kv_load_failure_policy`` (``fail``), and the blocks that step
  computed on top of the KV that never arrived are not saved.
* A load that fails in a step where another request hit the loading request's blocks in
  vLLM's own prefix cache: nothing that request computed on them is saved.
* An engine whose runtime identity differs (a fault point makes it report another kernel
  ISA and vLLM version, as an engine on another host would) gets no page of the first.
* A cache reset through vLLM's own ``reset_prefix_cache(reset_connector=True)`` serves
  nothing saved before it; one that vLLM could not do itself (a request held blocks) leaves
  the engine in its namespace.
* Layer-wise loads (``hicache_copy: layer``) whose copies lag behind the forward pass, and
  one that fails at its last layer, give vLLM alone's tokens; so do they when the daemon is
  killed while they copy (it restarts the daemon; the hits come back from L3).
* vLLM's own metrics carry hicache's hits per tier, loads, saves and errors.
* After a daemon restart, asks about a request whose pages come back from L3 that get no
  answer in time (a fault point makes the connector give up on them at once, as against a
  slow daemon loop) cost a short wait, not the hit (it restarts the daemon).
* A daemon that answers every lookup and reserve ``busy`` (``engine.queue_limit`` 0) leaves
  vLLM computing alone: vLLM alone's tokens, no hit, nothing saved, the busy answers counted
  on both sides (last: it restarts the daemon with that setting).

The module shares one daemon (with a file L3) and seven engines (vLLM alone, ``a`` with the
load fault, ``b``, ``c`` with the other identity, ``d`` with the unanswered-asks fault, ``e``
with the load fault and vLLM's own prefix caching, ``l`` loading layer by layer with the load
fault and slowed copies), each started when a test first needs it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.bench.engine_lib.vllm_driver import VllmProcess, connector_config
from hicache.connectors.faults import FAIL_LOADS_ENV, RUNTIME_ENV, SLOW_COPIES_ENV, SLOW_PENDING_ASKS_ENV
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
MAX_TOKENS = 8


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 1000) for _ in range(n)]


P = [_prompt(40 + i, n) for i, n in enumerate([150, 230, 300])]
HEAD = P[0][:128]  # the four full blocks of P[0] that an engine can load
Q = HEAD + _prompt(50, 100)  # shares HEAD; its blocks 4..6 are computed in the step that loads HEAD
# two requests of one step that share HEAD: the first loads it, the second hits those blocks
# in vLLM's own prefix cache (cached when allocated, before the load runs)
Q1, Q2 = HEAD + _prompt(51, 100), HEAD + _prompt(52, 100)
ALL = P + [Q, Q1, Q2]
SLOW_ASKS = 1  # one call given up on: the client then backs off for 0.5 s, as after a timeout
LAYER_LAG_S = 0.2
"""Engine ``l``'s layer loader sleeps this long before each layer: a forward pass outruns it."""


class Stack(ModelStack):
    """The module's daemon and engines (started on first use; ``b`` and ``d`` keep vLLM's
    stats on)."""

    def engine(self, name: str, **kw: Any) -> VllmProcess:
        return super().engine(name, **{"log_stats": name in ("b", "d"), **kw})


@pytest.fixture(scope="module")
def stack(checkpoints: dict[str, Path], engines: Engines, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    llama = checkpoints["llama-bf16"]
    alone = engines.start(llama, "alone")
    out = alone.generate(ALL, MAX_TOKENS)
    alone.stop()
    reference = {tuple(p): o for p, o in zip(ALL, out["outputs"], strict=True)}
    tmp = tmp_path_factory.mktemp("engine-faults")
    l3 = {"backend": "file", "file": {"dir": str(tmp / "l3")}}
    daemon = Daemon(tmp, engine_config(llama, Path(f"/tmp/hcf-{os.getpid()}"), l3=l3), "daemon")
    daemon.start()
    try:
        yield Stack(llama, daemon, engines, reference)
    finally:
        daemon.stop()


def test_a_failed_load_is_recomputed_and_the_blocks_of_its_step_are_not_saved(stack: Stack) -> None:
    b = stack.engine("b")
    stack.check(b.generate([P[0]], MAX_TOKENS), [P[0]])  # HEAD's four pages go to L2
    stack.wait("HEAD's pages", lambda st: st["engine"]["committed_pages"] >= 4)
    failed_before = stack.stats()["engine"]["commit_failed_pages"]
    a = stack.engine("a", env={FAIL_LOADS_ENV: "1"})
    out = a.generate([Q], MAX_TOKENS)  # its load of HEAD fails: vLLM recomputes it
    stack.check(out, [Q])  # under vLLM's default policy the request would have ended in an error
    assert "loading 4 blocks" in a.log_path.read_text()
    # the step that failed to load HEAD computed Q's blocks 4..6 attending to KV that never
    # arrived: they were committed as failed; vLLM then computed Q again from its start, and
    # those blocks were saved from there: another engine loads the whole of Q, its own KV
    st = stack.wait("the failed saves", lambda st: st["engine"]["commit_failed_pages"] >= failed_before + 3)
    assert st["engine"]["commit_failed_pages"] == failed_before + 3
    stack.wait("Q's saves", lambda st: st["leases"]["open"] == 0)
    again = b.generate([Q], MAX_TOKENS)
    stack.check(again, [Q])
    assert again["cached"] == [expected_hit(len(Q), BLOCK)]
    stack.idle_and_intact()


def test_a_failed_load_saves_nothing_another_request_computed_on_it(stack: Stack) -> None:
    """Engine ``e`` keeps vLLM's prefix caching on and its first load fails: ``Q1`` loads HEAD
    and ``Q2``, in the same step, hits HEAD's blocks in vLLM's own cache and computes its
    blocks 4..6 on top of KV that never arrived. Nothing of that step is saved, nor later
    from those blocks before they are computed again: another engine that loads ``Q2``
    from L2 answers as vLLM alone."""
    b = stack.engine("b")
    stack.check(b.generate([P[0]], MAX_TOKENS), [P[0]])
    stack.wait("HEAD's pages", lambda st: st["leases"]["open"] == 0 and st["engine"]["committed_pages"] >= 4)
    e = stack.engine("e", env={FAIL_LOADS_ENV: "1"}, prefix_caching=True)
    out = e.generate([Q1, Q2], MAX_TOKENS)
    stack.check(out, [Q1, Q2])
    assert "loading 4 blocks" in e.log_path.read_text()
    stack.wait("e's saves", lambda st: st["leases"]["open"] == 0)
    for q in (Q2, Q1):  # whatever L2 holds of them now is their own KV
        again = b.generate([q], MAX_TOKENS)
        stack.check(again, [q])
        assert again["cached"][0] >= len(HEAD)
    stack.idle_and_intact()


def test_layer_wise_loads_give_vllm_alones_tokens_while_the_copies_lag_and_a_late_failure_is_recomputed(
        stack: Stack) -> None:
    """Engine ``l`` loads layer by layer (``hicache_copy: layer``) with every layer's copy
    slowed (the forward pass reaches layers not copied yet and must wait for them) and its
    first load failing at its last layer (after the forward pass read the layers before it):
    vLLM alone's tokens, the failed load's blocks recomputed, the next loads whole."""
    b = stack.engine("b")
    stack.check(b.generate(P, MAX_TOKENS), P)
    stack.wait("P's saves", lambda st: st["leases"]["open"] == 0)
    lw = _layer_engine(stack)
    before = _hicache_metrics(lw)
    out = lw.generate(P, MAX_TOKENS)
    stack.check(out, P)
    log_text = lw.log_path.read_text()
    assert f"failed (fault point {FAIL_LOADS_ENV})" in log_text and "vLLM recomputes them" in log_text
    after = _hicache_metrics(lw)
    hits = [expected_hit(len(p), BLOCK) for p in P]
    failed_blocks = after["vllm:hicache_load_errors"] - before.get("vllm:hicache_load_errors", 0.0)
    assert failed_blocks in {h // BLOCK for h in hits}, after  # one load, whole
    assert after["vllm:hicache_loaded_blocks"] - before.get("vllm:hicache_loaded_blocks", 0.0) \
        == sum(hits) // BLOCK - failed_blocks, after
    assert after["vllm:hicache_layer_waits"] > 0, after  # attention layers waited for their copies
    stack.wait("l's loads to be released", lambda st: st["leases"]["open"] == 0)
    again = lw.generate(P, MAX_TOKENS)  # the fault is spent: every load whole
    stack.check(again, P)
    assert again["cached"] == hits
    stack.idle_and_intact()


def _layer_engine(stack: Stack) -> VllmProcess:
    """Engine ``l``: layer-wise loads, its first load failing, every layer's copy slowed."""
    return stack.engine("l", kv_transfer=connector_config(str(stack.daemon.config_path), copy_mode="layer"),
                        env={FAIL_LOADS_ENV: "1", SLOW_COPIES_ENV: str(LAYER_LAG_S)}, log_stats=True)


def _hicache_metrics(engine: VllmProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in engine.metrics("vllm:hicache"):
        name = m["name"] + "".join(f"{{{k}={v}}}" for k, v in sorted(m["labels"].items()) if k == "tier")
        out[name] = out.get(name, 0.0) + float(m["value"] or 0)
    return out


def test_vllm_metrics_show_hicache_hits_loads_and_saves(stack: Stack) -> None:
    b = stack.engine("b")
    before = _hicache_metrics(b)
    prompt = _prompt(60, 200)  # six full blocks, of which vLLM may load six minus the last token's
    b.generate([prompt], MAX_TOKENS)
    stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
    b.generate([prompt], MAX_TOKENS)
    after = _hicache_metrics(b)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:hicache_hit_tokens{tier=host}") == expected_hit(len(prompt), BLOCK), after
    assert delta("vllm:hicache_loaded_blocks") == expected_hit(len(prompt), BLOCK) // BLOCK, after
    assert delta("vllm:hicache_saved_blocks") >= 6 and delta("vllm:hicache_lookups") >= 2, after
    assert delta("vllm:hicache_load_errors") == 0 and delta("vllm:hicache_lookup_misses") == 0, after


def test_an_engine_of_another_isa_and_version_gets_no_page_of_the_first(stack: Stack) -> None:
    b = stack.engine("b")
    stack.check(b.generate(P, MAX_TOKENS), P)  # b holds P in L2
    hit = [expected_hit(len(p), BLOCK) for p in P]
    assert b.generate(P, MAX_TOKENS)["cached"] == hit
    c = stack.engine("c", env={RUNTIME_ENV: json.dumps({"isa": "amx", "vllm": "0.32.9"})})
    first = c.generate(P, MAX_TOKENS)
    stack.check(first, P)
    assert first["cached"] == [0, 0, 0]  # same model, dtype, block size: other bytes, no share
    stack.wait("c's saves", lambda st: st["leases"]["open"] == 0)
    second = c.generate(P, MAX_TOKENS)  # c's own pages: its namespace works
    stack.check(second, P)
    assert second["cached"] == hit
    namespaces = {e["namespace"] for e in stack.stats()["engines"]}
    assert len(namespaces) == 2, namespaces  # a and b share one, c has its own
    stack.idle_and_intact()


def test_a_cache_reset_vllm_could_not_do_leaves_the_engine_in_its_namespace(stack: Stack) -> None:
    """vLLM's own reset fails while a request holds blocks (it keeps them, hashes and all),
    and vLLM then still resets the connector: the connector follows vLLM (answers False)
    and the engine keeps its namespace, so its pages of these weights are still its own."""
    b = stack.engine("b")
    hit = [expected_hit(len(p), BLOCK) for p in P]
    stack.check(b.generate(P, MAX_TOKENS), P)
    stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
    namespaces = {e["namespace"] for e in stack.stats()["engines"]}
    running = b.reset_while_running(P[1], MAX_TOKENS, steps=2)
    assert running["ok"] is False  # vLLM's own reset failed: the request held its blocks
    stack.check({"finish": ["length"], "outputs": running["outputs"]}, [P[1]])
    time.sleep(1.0)  # a registration of a new namespace would show by now
    assert {e["namespace"] for e in stack.stats()["engines"]} == namespaces
    after = b.generate(P, MAX_TOKENS)
    stack.check(after, P)
    assert after["cached"] == hit  # still b's namespace: its pages are served
    stack.idle_and_intact()


def test_a_cache_reset_through_vllm_serves_nothing_saved_before_it(stack: Stack) -> None:
    b = stack.engine("b")
    hit = [expected_hit(len(p), BLOCK) for p in P]
    before = b.generate(P, MAX_TOKENS)
    stack.check(before, P)
    assert before["cached"] == hit
    namespaces = {e["namespace"] for e in stack.stats()["engines"]}
    assert b.reset_prefix_cache(reset_connector=True)  # as vLLM does after a weight update
    # the new namespace is registered before the reset returns: the requests right after it
    # are looked up and saved (were it left to the heartbeat thread, a request could run its
    # prefill before a session was open, and its prompt was never saved)
    assert len({e["namespace"] for e in stack.stats()["engines"]} - namespaces) == 1
    after = b.generate(P, MAX_TOKENS)
    stack.check(after, P)
    assert after["cached"] == [0, 0, 0]
    stack.wait("the saves after the reset", lambda st: st["leases"]["open"] == 0)
    again = b.generate(P, MAX_TOKENS)  # what b saved after the reset is served
    stack.check(again, P)
    assert again["cached"] == hit
    # a, which was not reset, still gets the pages saved before b's reset (its namespace)
    a = stack.engine("a")
    assert a.generate(P, MAX_TOKENS)["cached"] == hit
    stack.idle_and_intact()


def test_a_daemon_killed_while_layer_wise_loads_copy_costs_hits_not_answers(stack: Stack) -> None:
    """Engine ``l`` loads P's hits layer by layer, each layer's copy slowed, and the daemon is
    SIGKILLed once it holds their leases (the copies run from the L2 segment the engine still
    maps, and their leases end against a dead socket): vLLM alone's tokens, then again with
    no daemon at all; after a restart the hits come back (from the file L3)."""
    b = stack.engine("b")
    stack.check(b.generate(P, MAX_TOKENS), P)
    stack.wait("P's saves and their backups", lambda st: st["leases"]["open"] == 0
               and st["tiers"]["in_flight"] == 0)
    lw = _layer_engine(stack)
    d = stack.daemon
    lookups = stack.stats()["engine"]["lookups"]
    t, result = generate_in_background(lw, P, MAX_TOKENS)
    try:
        stack.wait("l's hits to be leased", lambda st: st["engine"]["lookups"] > lookups and st["leases"]["open"] > 0)
    finally:
        assert d.proc is not None
        os.killpg(d.proc.pid, signal.SIGKILL)
        d.proc.wait(30)
        t.join(300)
    assert "out" in result, result.get("error")
    stack.check(result["out"], P)
    stack.check(lw.generate(P, MAX_TOKENS), P)  # no daemon at all
    d.start()
    deadline = time.monotonic() + 60
    while True:  # the connector registers again after its backoff; the hits come back
        out = lw.generate(P, MAX_TOKENS)
        stack.check(out, P)
        if out["cached"] == [expected_hit(len(p), BLOCK) for p in P]:
            break
        assert time.monotonic() < deadline, f"no whole hits within 60 s of the restart: {out['cached']}"
        time.sleep(1.0)
    stack.idle_and_intact()


def test_asks_unanswered_while_pages_come_back_from_l3_cost_no_hit(stack: Stack) -> None:
    """Run last: it restarts the daemon. Engine ``d``, started after the restart, asks about
    prompts whose pages are in L3 only: each lookup is answered pending while they come back,
    and ``d``'s first ask again gets no answer (the call gives up at once, and the client
    backs off as after a timeout). The request keeps waiting and still gets its whole hit, and
    the pages are still counted as L3's (the answer that said so was the one given up on)."""
    b = stack.engine("b")
    stack.check(b.generate(P, MAX_TOKENS), P)  # P in L2, then backed up to the file L3
    stack.wait("the saves", lambda st: st["leases"]["open"] == 0)
    stack.restart_after_backups(BLOCK)  # L2 empty: every hit below is prefetched from L3
    d = stack.engine("d", env={SLOW_PENDING_ASKS_ENV: str(SLOW_ASKS)})
    before = _hicache_metrics(d)
    # one prompt at a time: a request whose *first* lookup falls in the client's backoff is a
    # miss by design (the daemon looks unwell); the fault hits the first prompt's asks again
    answers = [d.generate([p], MAX_TOKENS) for p in P]
    out = {k: [x for a in answers for x in a[k]] for k in ("outputs", "cached", "finish")}
    stack.check(out, P)
    assert out["cached"] == [expected_hit(len(p), BLOCK) for p in P]
    after = _hicache_metrics(d)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:hicache_lookups_unanswered_pending") >= SLOW_ASKS, after  # the fault fired
    assert delta("vllm:hicache_lookup_misses") == 0, after
    assert delta("vllm:hicache_hit_tokens{tier=disk}") == sum(out["cached"]), after
    stack.idle_and_intact()


def test_busy_answers_leave_vllm_computing_alone(stack: Stack) -> None:
    """Run last: it restarts the daemon with ``engine.queue_limit`` 0, so every lookup and
    reserve is answered ``busy`` at once. Engine ``b`` registers with it again and serves
    every request without the cache: vLLM alone's tokens, no token from hicache, nothing
    saved; both sides count the busy answers."""
    b = stack.engine("b")
    daemon = stack.daemon
    assert daemon.stop() == 0
    cfg = yaml.safe_load(daemon.config_path.read_text())
    cfg["engine"]["queue_limit"] = 0
    daemon.config_path.write_text(yaml.safe_dump(cfg))
    daemon.start()
    started = stack.started()
    stack.wait("every engine's new session", lambda st: len(st["engines"]) == started)
    before = _hicache_metrics(b)
    out = b.generate(P, MAX_TOKENS)
    stack.check(out, P)
    assert out["cached"] == [0] * len(P)
    st = stack.stats()
    busy = st["engine"]["busy"]
    assert busy >= len(P) and sum(e["busy"] for e in st["engines"]) == busy  # a lookup of each prompt at least
    assert st["engine"]["lookups"] == 0 and st["engine"]["reserves"] == 0 and st["engine"]["committed_pages"] == 0
    after = _hicache_metrics(b)
    counted = after.get("vllm:hicache_busy_answers", 0.0) - before.get("vllm:hicache_busy_answers", 0.0)
    assert len(P) <= counted <= busy, after
    assert after.get("vllm:hicache_hit_tokens{tier=host}", 0.0) == before.get("vllm:hicache_hit_tokens{tier=host}", 0.0)
    stack.idle_and_intact()
