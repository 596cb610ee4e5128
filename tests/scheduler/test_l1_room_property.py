"""Full tiers slow requests down and never fail them, at any L1 / L2 size that admits them.

A property test over random L1 and L2 sizes, write policies, page sizes and traffic: prompts
sharing prefixes, submitted in waves, served by the scheduler over the daemon's pools with
the controller's copies and a file L3 executed in-process, each controller op answered
(and, for a copy, executed) only after a random number of steps, so load-backs,
prefetches, writes and holds are in flight while requests run. Every request must finish
without an error, with the output of a cold run of its prompt; the cache must end exact
and every reservation returned (``Rig.assert_idle``). After every step each component's
L1 room (free + evictable - reserved) is not negative: what running requests were promised
is there. The budget table of docs/architecture.md §5 is what makes it hold.
"""

from __future__ import annotations

import random
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protos
from hicache.config import HicacheConfig, config_from_dict
from tests.support.rigs import L3Rig, Rig, gen

NEW_TOKENS = 8
_cold: dict[tuple[str, tuple[int, ...]], list[int]] = {}
_cold_rigs: dict[str, Rig] = {}


def _cfg(layers: tuple[str, ...], page_size: int, l1_tokens: int, l2_tokens: int, policy: str,
         enabled: bool = True) -> HicacheConfig:
    return config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": list(layers), "sliding_window": 32}},
        "cache": {"page_size": page_size, "l1": {"tokens": l1_tokens, "state_slots": 16},
                  "l2": {"tokens": l2_tokens, "state_slots": 32} if enabled else {"enabled": False},
                  "l3": {"backend": "none"}, "write_policy": policy, "load_back_threshold": page_size},
        "scheduler": {"chunked_prefill_tokens": 128, "max_prefill_tokens": 256},
    })


def cold(layers: tuple[str, ...], prompt: list[int]) -> list[int]:
    """The greedy output of ``prompt`` computed with nothing cached."""
    key = ("+".join(layers), tuple(prompt))
    if key not in _cold:
        rig = _cold_rigs.get(key[0])
        if rig is None:
            rig = _cold_rigs[key[0]] = Rig(_cfg(layers, 16, 8192, 0, "write_through", enabled=False))
        rid = f"cold-{len(_cold)}"
        rig.run([gen(rid, prompt, NEW_TOKENS)])
        _cold[key] = rig.tokens(rid)
        rig.cache.flush()
    return _cold[key]


class SlowController(L3Rig):
    """An L3Rig whose controller answers each op after 0 to ``max_delay`` pumps (a copy is
    executed when it is answered, as the controller executes it before acknowledging)."""

    def __init__(self, cfg: HicacheConfig, l3_dir: str, rng: random.Random, max_delay: int) -> None:
        super().__init__(cfg, l3_dir)
        self.rng = rng
        self.max_delay = max_delay
        self.backlog: list[tuple[int, protos.ControllerMessage]] = []

    def pump(self) -> None:
        msgs, self.inbox[:] = list(self.inbox), []
        self.backlog.extend((self.rng.randint(0, self.max_delay), m) for m in msgs)
        due = [m for wait, m in self.backlog if wait <= 0]
        self.backlog = [(wait - 1, m) for wait, m in self.backlog if wait > 0]
        for msg in due:
            self.answer(msg)

    def drain(self) -> None:
        while self.backlog or self.inbox:
            self.max_delay = 0
            self.pump()


@settings(max_examples=9, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), l1_pages=st.integers(40, 96), l2_factor=st.sampled_from([1.0, 1.5, 3.0]),
       policy=st.sampled_from(["write_through", "write_back"]), max_delay=st.integers(0, 4),
       layers=st.sampled_from([("full", "full"), ("full", "swa", "mamba", "full")]))
def test_no_request_fails_for_lack_of_room(seed: int, l1_pages: int, l2_factor: float, policy: str,
                                           max_delay: int, layers: tuple[str, ...]) -> None:
    ps = 16
    rng = random.Random(seed)
    l1 = l1_pages * ps
    l2 = int(l1_pages * l2_factor) * ps
    longest = min(560, l1 - NEW_TOKENS)  # every request fits L1 on its own
    bases = [[rng.randrange(3, 500) for _ in range(longest)] for _ in range(3)]
    prompts = []
    for _ in range(rng.randint(10, 18)):
        shared = rng.randrange(40, min(500, longest) + 1)
        total = rng.randrange(shared, longest + 1)
        base = rng.choice(bases)
        prompts.append(base[:shared] + [rng.randrange(3, 500) for _ in range(total - shared)])
    with tempfile.TemporaryDirectory() as l3:
        rig = SlowController(_cfg(layers, ps, l1, l2, policy), l3, rng, max_delay)
        try:
            pending = list(enumerate(prompts))
            for _ in range(5000):
                if pending and rng.random() < 0.3:  # a wave of up to 8 requests
                    for _ in range(rng.randint(1, 8)):
                        if pending:
                            i, p = pending.pop(0)
                            rig.sched.submit(gen(f"r{i}", p, NEW_TOKENS))
                if not pending and not rig.sched.busy and not rig.tier.in_flight and not rig.backlog:
                    break
                rig.sched.step()
                rig.pump()
                for kind in rig.sched.budget.kinds:  # what running requests were promised is there
                    assert rig.sched.budget.room(kind) >= 0, (kind, rig.sched.budget.room(kind))
                if rng.random() < 0.02:
                    rig.cache.flush()  # what POST /cache/flush does, mid-traffic
            rig.drain()
            assert not rig.sched.busy and not rig.tier.in_flight, "traffic did not finish"
            rig.assert_idle()
            for i, p in enumerate(prompts):
                final = rig.final(f"r{i}")
                assert final.finish_reason == "length", (f"r{i}", final.finish_reason, final.error)
                assert rig.tokens(f"r{i}") == cold(layers, p), f"r{i}: output differs from the cold run"
        finally:
            rig.close()
