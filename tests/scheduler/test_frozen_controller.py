"""A controller that answers nothing (frozen): requests that need no tier are not held by it,
and a request that does wait on it shows as a stall where ``/health`` and ``/metrics`` look.

The controller is the in-process one of ``L2Rig``; "frozen" means its inbox is never pumped.
The scheduler's and the tier manager's clocks are a fake one the test advances.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from hicache.config import config_from_dict
from hicache.metrics import Metrics
from hicache.runtime.heartbeat import HeartbeatWriter, heartbeat_stalls
from hicache.scheduler.controller_driver import COPY_PATIENCE_S
from tests.support.rigs import L2Rig, cold_tokens, gen


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cfg(l2: bool = True):  # type: ignore[no-untyped-def]
    return config_from_dict({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 16, "l1": {"tokens": 1024}, "l2": {"tokens": 4096} if l2 else {"enabled": False},
                  "l3": {"backend": "none"}, "load_back_threshold": 16},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
    })


def _rig() -> tuple[L2Rig, Clock]:
    rig, clock = L2Rig(_cfg()), Clock()
    rig.tier.clock = clock
    rig.sched.clock = clock
    return rig, clock


def test_requests_that_need_no_tier_are_served_while_the_controller_answers_nothing() -> None:
    """Each finished request's pages go to L2 by a write that locks them in L1 until the
    controller answers; with a frozen controller those locks would pile up until no new
    request fits L1 (for the op timeout: 60 s by default). Once a copy is overdue
    (``COPY_PATIENCE_S``) no new write starts, so every request is served from L1 alone."""
    rig, clock = _rig()
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 500) for _ in range(150)] for _ in range(12)]  # 10 pages each, L1 has 64
    try:
        for i, p in enumerate(prompts):
            rig.sched.submit(gen(f"r{i}", p, 4))
            for _ in range(200):  # one after the other; the controller never answers
                if not rig.sched.busy:
                    break
                rig.sched.step()
                clock.now += 0.5
        assert rig.tier.in_flight > 0, "the frozen controller was sent nothing: the test shows nothing"
        assert not rig.sched.busy, f"requests still waiting for L1 pages that in-flight writes lock: " \
                                   f"{[r.rid for r in rig.sched.waiting]}"
        cold = _cfg(l2=False)
        for i, p in enumerate(prompts):
            assert rig.final(f"r{i}").finish_reason == "length"
            assert rig.tokens(f"r{i}") == cold_tokens(cold, f"r{i}", p, 4)
        rig.tier.on_controller_lost()  # the restart that a hung controller gets
        rig.inbox.clear()
        rig.assert_idle()
    finally:
        rig.close()


def test_a_request_waiting_on_a_frozen_controller_is_a_stall_until_it_answers() -> None:
    rig, clock = _rig()
    prompt = [random.Random(42).randrange(3, 500) for _ in range(200)]
    try:
        rig.run([gen("first", prompt, 4)])  # computed and written to L2
        rig.cache.evict(10**6)  # now L2-only: the next request loads it back
        assert rig.sched.stalled_since is None
        rig.sched.submit(gen("again", prompt, 4))
        rig.sched.step()
        began = clock.now
        assert rig.tier.in_flight == 1 and rig.sched.stalled_since == began  # waiting for the load
        for _ in range(5):
            clock.now += 1.0
            rig.sched.step()
        assert rig.sched.stalled_since == began and clock.now - began > COPY_PATIENCE_S
        rig.pump()  # the controller answers
        rig.run([])
        assert rig.sched.stalled_since is None
        assert rig.tokens("again") == rig.tokens("first") and rig.final("again").usage.cached_host > 0  # type: ignore[union-attr]
    finally:
        rig.close()


def test_a_stall_is_written_beside_the_heartbeat_and_makes_the_process_down(tmp_path: Path) -> None:
    writer = HeartbeatWriter(tmp_path, "scheduler")
    assert heartbeat_stalls(tmp_path) == {}
    writer.stalled(time.monotonic() - 7.0)
    stalls = heartbeat_stalls(tmp_path)
    assert set(stalls) == {"scheduler"} and 7.0 <= stalls["scheduler"] < 60.0
    writer.beat(force=True)  # a beat does not clear it: the loop turns, the work does not move
    assert "scheduler" in heartbeat_stalls(tmp_path)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.set_process_health({"scheduler": 0.1}, {"scheduler": True}, 5.0, stalls)
    assert registry.get_sample_value("hicache_process_up", {"process": "scheduler"}) == 0
    assert registry.get_sample_value("hicache_process_stalled_seconds", {"process": "scheduler"}) >= 7.0
    writer.stalled(None)
    assert heartbeat_stalls(tmp_path) == {}
    metrics.set_process_health({"scheduler": 0.1}, {"scheduler": True}, 5.0, {})
    assert registry.get_sample_value("hicache_process_up", {"process": "scheduler"}) == 1
    assert registry.get_sample_value("hicache_process_stalled_seconds", {"process": "scheduler"}) == 0
    writer.stalled(time.monotonic())
    writer.close()
    HeartbeatWriter(tmp_path, "scheduler").close()  # a restarted process takes the file over: no stall
    assert heartbeat_stalls(tmp_path) == {}
