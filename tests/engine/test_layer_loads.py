"""The layer loader of ``hicache_copy: layer`` (``hicache.connectors.layer_loads``), without vLLM:
layers in order, a wait for one layer only, a failed load's later layers left alone."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.connectors.layer_loads import LayerLoad, LayerLoads

pytestmark = pytest.mark.timeout(60)

LAYERS = 4


def _load(rid: str, log: list[tuple[str, int]], gate: dict[int, threading.Event] | None = None,
          fail_at: int | None = None) -> LayerLoad:
    def copy(i: int) -> int:
        if gate is not None:
            assert gate[i].wait(10)
        if i == fail_at:
            raise OSError(f"{rid}: layer {i} could not be read")
        log.append((rid, i))
        return 100
    return LayerLoad(rid, 2, [lambda i=i: copy(i) for i in range(LAYERS)])


def test_layers_are_copied_in_order_and_a_wait_returns_once_its_layer_is_done() -> None:
    loader = LayerLoads(LAYERS)
    try:
        log: list[tuple[str, int]] = []
        gate = {i: threading.Event() for i in range(LAYERS)}
        a, b = _load("a", log, gate), _load("b", log)
        loader.start([a, b])
        with pytest.raises(RuntimeError, match="not finished"):  # one step at a time
            loader.start([_load("c", log)])
        waited: list[int] = []

        def forward() -> None:  # as vLLM's attention layers call wait_for_layer_load
            for i in range(LAYERS):
                loader.wait(i)
                waited.append(i)
        t = threading.Thread(target=forward)
        t.start()
        time.sleep(0.1)
        assert waited == [] and log == []  # layer 0 of "a" is held: nothing of layer 0 is done
        gate[0].set()
        gate[1].set()
        deadline = time.monotonic() + 5
        while len(waited) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert waited == [0, 1]  # layer 2 is not copied yet: its wait goes on
        assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
        gate[2].set()
        gate[3].set()
        t.join(5)
        assert waited == list(range(LAYERS))
        done, seconds = loader.finish()
        assert done == [a, b] and all(x.ok and x.copied == 100 * LAYERS for x in done) and seconds > 0
        assert loader.wait(0) == 0.0 and loader.finish() == ([], 0.0)  # nothing in flight
    finally:
        loader.close()


def test_a_load_that_fails_copies_nothing_more_and_the_others_go_on() -> None:
    before: list[int] = []
    loader = LayerLoads(LAYERS, before_layer=lambda: before.append(1))
    try:
        log: list[tuple[str, int]] = []
        bad, good = _load("bad", log, fail_at=1), _load("good", log)
        loader.start([bad, good])
        done, _ = loader.finish()
        assert [x.ok for x in done] == [False, True]
        assert "layer 1 could not be read" in bad.error and bad.copied == 100  # layer 0 only
        assert [i for rid, i in log if rid == "bad"] == [0]
        assert [i for rid, i in log if rid == "good"] == list(range(LAYERS))
        assert len(before) == LAYERS  # the fault point runs before each layer
        loader.start([_load("next", log)])  # the next step starts once this one is finished
        assert loader.finish()[0][0].ok
    finally:
        loader.close()


def test_a_load_must_name_every_layer() -> None:
    loader = LayerLoads(LAYERS)
    try:
        with pytest.raises(ValueError, match="each of the 4 layers"):
            loader.start([LayerLoad("short", 1, [lambda: 0] * (LAYERS - 1))])
        assert not loader.in_flight
    finally:
        loader.close()
