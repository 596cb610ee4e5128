"""The whole tier path with real processes: tree + ControllerDriver + controller + shared pools + L3.

Every L1 page gets bytes that are a function of its page hash (so of the whole prefix up to
it). After any trip through L2 or L3 and back, the L1 pages a match returns must hold
exactly those bytes.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

import protos
from hicache.config import PrefetchConfig
from hicache.hashing import HashNamespace, PageHasher
from hicache.memory.allocator import PageAllocator
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import FullComponent
from storage_backends import FileSettings
from tests.controller.controller_harness import ControllerHarness

PS = 4
NS = HashNamespace("tier-test-model", "float32", PS)


def page_bytes_for(h: ControllerHarness, page_hash: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(int(page_hash[:12], 16))
    comp = h.pools["full"]
    return [torch.randn(t.select(comp.l1_axis, 0).shape, generator=gen) for t in comp.l1_paged]


def write_l1(h: ControllerHarness, pages: list[int], hashes: list[str]) -> None:
    comp = h.pools["full"]
    for p, hx in zip(pages, hashes, strict=True):
        for t, want in zip(comp.l1_paged, page_bytes_for(h, hx), strict=True):
            t.select(comp.l1_axis, p).copy_(want)


def l1_matches(h: ControllerHarness, pages: list[int], hashes: list[str]) -> bool:
    comp = h.pools["full"]
    return all(torch.equal(t.select(comp.l1_axis, p), want)
               for p, hx in zip(pages, hashes, strict=True)
               for t, want in zip(comp.l1_paged, page_bytes_for(h, hx), strict=True))


class TierRig:
    def __init__(self, h: ControllerHarness, write_policy: str = "write_through",
                 prefetch: PrefetchConfig | None = None, l3: bool = True) -> None:
        self.h = h
        self.l1 = PageAllocator(h.layout.component("full").l1_pages, "l1")
        self.l2 = PageAllocator(h.layout.component("full").l2_pages, "l2")
        self.cache = UnifiedRadixCache([FullComponent(self.l1, self.l2)], PS, hasher=NS,
                                       write_policy=write_policy, write_through_threshold=2)
        self.hasher = PageHasher(NS)
        self.tier = ControllerDriver(self.cache, h.send, load_back_threshold=0,
                                prefetch=prefetch or PrefetchConfig(threshold_tokens=PS), l3_enabled=l3)

    def compute(self, tokens: list[int]) -> None:
        """What a model run does: fresh L1 pages with the prefix's bytes, inserted into the tree."""
        m = self.cache.match_prefix(tokens)
        n = len(tokens) // PS
        have = m.device_len // PS
        new = self.l1.alloc(n - have)
        if new is None:
            self.cache.evict(full_tokens=(n - have) * PS)
            new = self.l1.alloc(n - have)
        assert new is not None
        hashes = self.hasher.hash_pages(tokens)
        write_l1(self.h, list(new), hashes[have:])
        res = self.cache.insert(tokens[: n * PS], list(m.device_indices) + list(new))
        dup = (list(m.device_indices) + list(new))[m.device_len // PS : res.prefix_len // PS]
        if dup:
            self.l1.free(dup)

    def pump(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tier.in_flight:
            msg = self.h.inbox.recv(100)
            if msg is not None:
                self.tier.on_message(msg)
            assert time.monotonic() < deadline, f"ops stuck: {self.tier.in_flight_kinds()}"

    def settle(self) -> None:
        """Issue writes (and the backups they trigger) until nothing is left to move."""
        for _ in range(20):
            self.tier.issue_writes()
            self.pump()
            if not self.cache.tiers.nodes_to_write_to_host():
                return

    def check_served(self, tokens: list[int]) -> None:
        """A match of ``tokens`` (after any load-back) yields L1 pages with the right bytes."""
        m = self.cache.match_prefix(tokens)
        if m.host_hit_length:
            ticket = self.tier.start_load_back(m)
            assert ticket is not None
            self.pump()
            assert ticket.ok
            m = self.cache.match_prefix(tokens)
        n = len(tokens) // PS
        assert m.device_len == n * PS, (m.device_len, m.host_hit_length)
        assert l1_matches(self.h, list(m.device_indices), self.hasher.hash_pages(tokens))
        self.cache.check_integrity(exact=True)


@pytest.fixture
def harness(tmp_path: Path):
    h = ControllerHarness(tmp_path, FileSettings(dir=str(tmp_path / "l3"), scan_on_start=False))
    yield h
    h.close()


def _prompts(seed: int, count: int = 6, pages: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(2 * PS)]
    return [system + [rng.randrange(500) for _ in range(pages * PS)] for _ in range(count)]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_l1_to_l2_and_back_under_each_write_policy(harness: ControllerHarness, policy: str) -> None:
    rig = TierRig(harness, policy, l3=False)
    prompts = _prompts(1)
    for p in prompts:
        rig.compute(p)
        rig.settle()
        if policy == "write_through_selective":
            assert not rig.cache.match_prefix(p).host_hit_length  # a peek counts no hit
            for _ in range(2):  # two requests admitted on it: hit twice now, eligible
                rig.cache.record_hit(rig.cache.match_prefix(p))
            rig.settle()
    if policy == "write_back":
        assert rig.tier.counters.writes == 0  # nothing is written before eviction asks for it
        rig.cache.evict(full_tokens=10**6)
        rig.settle()
        assert rig.tier.counters.writes > 0
    rig.cache.evict(full_tokens=10**6)
    rig.cache.check_integrity(exact=True)
    assert rig.cache.total_size() == 0 or rig.l1.used < rig.l1.capacity
    for p in prompts:
        rig.check_served(p)


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_l3_round_trip_under_each_prefetch_policy(harness: ControllerHarness, policy: str) -> None:
    rig = TierRig(harness, prefetch=PrefetchConfig(policy=policy, threshold_tokens=PS))
    prompts = _prompts(2)
    for p in prompts:
        rig.compute(p)
    rig.settle()
    assert rig.tier.counters.backups > 0
    rig.cache.flush()  # L1 and L2 empty; L3 keeps everything
    rig.cache.check_integrity(exact=True)
    assert rig.l1.used == 0 and rig.l2.used == 0
    for i, p in enumerate(prompts):
        m = rig.cache.match_prefix(p)
        # The first prompt finds nothing; later ones find the shared system prompt loaded.
        assert m.device_len == (0 if i == 0 else 2 * PS) and m.host_hit_length == 0
        ticket = rig.tier.start_prefetch("r", p, m)
        assert ticket is not None
        if policy == "best_effort":
            assert ticket.ready(time.monotonic())  # never waits for L3
        else:  # waits for the fetch (the timeout is far away)
            assert not ticket.complete and not ticket.ready(time.monotonic())
        rig.pump()
        assert ticket.complete and ticket.ready(time.monotonic())
        beyond_l1 = len(p) - len(p) % PS - m.device_len  # every full page not in L1 came from L3
        assert ticket.arrived_tokens == beyond_l1 and rig.cache.match_prefix(p).host_hit_length == beyond_l1
        rig.check_served(p)


def test_timeout_policy_stops_waiting_for_a_slow_l3(harness: ControllerHarness) -> None:
    now = [100.0]
    rig = TierRig(harness, prefetch=PrefetchConfig(policy="timeout", threshold_tokens=PS, timeout_base_s=0.5,
                                                   timeout_per_ki_token_s=0.0))
    rig.tier.clock = lambda: now[0]
    p = _prompts(3, count=1)[0]
    rig.compute(p)
    rig.settle()
    rig.cache.flush()
    # A "slow L3": the test holds the controller's answers back.
    ticket = rig.tier.start_prefetch("r", p, rig.cache.match_prefix(p))
    assert ticket is not None and not ticket.ready(now[0])
    now[0] += 0.6
    assert ticket.ready(now[0]) and not ticket.complete  # the request may go; pages still coming
    rig.pump()
    assert ticket.complete
    rig.check_served(p)


def test_prefetch_of_unknown_pages_finds_nothing(harness: ControllerHarness) -> None:
    rig = TierRig(harness)
    p = _prompts(4, count=1)[0]
    ticket = rig.tier.start_prefetch("r", p, rig.cache.match_prefix(p))
    assert ticket is not None
    rig.pump()
    assert ticket.complete and ticket.arrived_tokens == 0
    assert rig.l2.used == 0
    rig.cache.check_integrity(exact=True)


def test_corrupt_l3_page_is_a_miss_not_a_wrong_page(harness: ControllerHarness, tmp_path: Path) -> None:
    rig = TierRig(harness)
    p = _prompts(5, count=1)[0]
    rig.compute(p)
    rig.settle()
    rig.cache.flush()
    hashes = rig.hasher.hash_pages(p)
    victim = next((tmp_path / "l3").rglob(f"{hashes[3]}.page"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    ticket = rig.tier.start_prefetch("r", p, rig.cache.match_prefix(p))
    assert ticket is not None
    rig.pump()
    assert ticket.arrived_tokens == 3 * PS  # the pages before the corrupt one
    m = rig.cache.match_prefix(p)
    assert m.host_hit_length == 3 * PS
    ticket2 = rig.tier.start_load_back(m)
    rig.pump()
    assert ticket2 is not None and ticket2.ok
    m = rig.cache.match_prefix(p)
    assert l1_matches(harness, list(m.device_indices), hashes[:3])


def test_controller_killed_mid_batch_leaks_nothing_and_recovers(harness: ControllerHarness) -> None:
    rig = TierRig(harness, l3=True)
    prompts = _prompts(6, count=8, pages=6)
    for p in prompts:
        rig.compute(p)
    sent = rig.tier.issue_writes()
    assert sent > 0
    harness.kill()
    failed = rig.tier.on_controller_lost()
    harness.outbox.reset()
    assert failed == sent and rig.tier.counters.writes_failed == sent  # each write failed once
    rig.cache.check_integrity(exact=True)
    assert rig.tier.in_flight == 0 and rig.cache.tiers.open_transfers == 0
    while True:  # answers the dead controller sent before dying are ignored
        try:
            rig.tier.on_message(harness.recv(0.3))
        except TimeoutError:
            break
    rig.cache.check_integrity(exact=True)
    harness.start()
    rig.settle()
    rig.cache.evict(full_tokens=10**6)
    for p in prompts:
        rig.check_served(p)


def test_rejected_ops_are_counted(harness: ControllerHarness) -> None:
    rig = TierRig(harness)
    rig.tier.on_message(protos.OpDone(424242, "rejected", 0, "duplicate"))
    assert rig.tier.counters.rejected == 1
