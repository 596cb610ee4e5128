"""The tree's tier changes as KV events: a subscriber that applies every event, decoded with
vLLM's own ``KVEventBatch``, holds exactly what each tier holds, page for page, after any
sequence of inserts, matches, writes, load-backs, L1 and L2 evictions, backups and flushes
(a random workload against the real tree; the reference for L3 is the set of pages whose
backup was acknowledged)."""

from __future__ import annotations

from array import array

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from hicache.hashing import HashNamespace
from hicache.kv_events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, encode_batch
from hicache.kv_events.tracker import TierEventTracker
from hicache.memory.allocator import PageAllocator
from hicache.tree import FullComponent, SWAComponent, Tier, TreeComponent, UnifiedRadixCache
from tests.support.hybrid_machine import HybridMachine
from tests.support.tree import cache_seq

kv_events = pytest.importorskip("vllm.distributed.kv_events")
DECODER = msgspec.msgpack.Decoder(kv_events.KVEventBatch)


class Subscriber:
    """A router's index: the page hashes each medium holds, built from decoded events only."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}
        self.tokens: dict[bytes, tuple[int, ...]] = {}

    def apply(self, payload: bytes) -> None:
        batch = DECODER.decode(payload)
        for ev in batch.events:
            if isinstance(ev, kv_events.AllBlocksCleared):
                self.held.clear()
            elif isinstance(ev, kv_events.BlockStored):
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    # announced by difference: never stored again before a removal
                    assert h not in self.held.get(ev.medium, set()), f"{ev.medium} page stored twice"
                    self.held.setdefault(ev.medium, set()).add(h)
                    self.tokens[h] = tuple(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                if ev.parent_block_hash is not None:  # a subscriber can chain it to what it knows
                    assert ev.parent_block_hash in self.tokens
            else:
                assert isinstance(ev, kv_events.BlockRemoved)
                for h in ev.block_hashes:
                    self.held.get(ev.medium, set()).discard(h)


def tier_pages(cache: UnifiedRadixCache, slot: str) -> set[bytes]:
    """The page hashes of every node whose Full ``value`` / ``host_value`` is set (and, for
    L1, readable: a load-back in flight is not held yet)."""
    out: set[bytes] = set()
    stack = list(cache.core.roots.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if slot == "value" and n.loading:
            continue
        if n.parent is not None and getattr(n.data[0], slot) is not None:
            out.update(bytes.fromhex(h) for h in cache.hashes.node_hashes(n))
    return out


class EventMachine(HybridMachine):
    """``HybridMachine``'s workload (SWA beside Full, L2 for both), with hashes, a tracker,
    backups, and a subscriber fed every round."""

    @property
    def hasher(self) -> HashNamespace:
        return HashNamespace("test-model", "bf16", self.page_size)

    @initialize()
    def setup(self):
        super().setup()
        comps: list[TreeComponent] = [FullComponent(self.dev, self.host)]
        a, h = self.allocs["swa"]
        comps.append(SWAComponent(a, sliding_window=3, host_allocator=h))
        self.cache = UnifiedRadixCache(comps, self.page_size, write_policy=self.write_policy, hasher=self.hasher)
        self.tracker = TierEventTracker(self.cache)
        self.subscriber = Subscriber()
        self.backups: list = []
        self.stored: set[bytes] = set()

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(i=st.integers(0, 50), ok=st.booleans(), finish=st.booleans())
    def backup(self, i, ok, finish):
        nodes = [n for n in self._nodes() if n.data[0].host_value is not None]
        if nodes:
            op = self.cache.tiers.start_backup(nodes[i % len(nodes)])
            if op is not None:
                self.backups.append((op, [bytes.fromhex(h) for h in op.hashes]))
        if finish and self.backups:
            op, hashes = self.backups.pop(0)
            self.cache.tiers.finish_backup(op, ok)
            if ok:
                self.stored.update(hashes)

    def other_ops_in_flight(self) -> bool:
        return bool(getattr(self, "backups", None))

    def _nodes(self):
        stack, out = list(self.cache.core.roots.values()), []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.parent is not None:
                out.append(n)
        return out

    @invariant()
    def consistent(self):
        if getattr(self, "backups", None):  # a backup in flight: no exact (no-leak) check
            self.cache.check_integrity(exact=False)
        else:
            super().consistent()

    @invariant()
    def index_equals_tiers(self):
        if not hasattr(self, "tracker"):
            return
        self.subscriber.apply(encode_batch(1.0, self.tracker.take()))
        held = self.subscriber.held
        assert held.get("GPU", set()) == tier_pages(self.cache, "value")
        assert held.get("CPU", set()) == tier_pages(self.cache, "host_value")
        assert held.get("STORAGE", set()) == self.stored

    def teardown(self):
        if hasattr(self, "cache"):
            for op, _hashes in self.backups:
                self.cache.tiers.finish_backup(op, False)
        super().teardown()
        if hasattr(self, "tracker"):
            self.subscriber.apply(encode_batch(2.0, self.tracker.take()))
            assert not self.subscriber.held.get("GPU") and not self.subscriber.held.get("CPU")


EventMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestEventsFollowTheTiers = EventMachine.TestCase


def test_events_carry_tokens_parent_salt_and_page_size():
    """One request under a salt, page size 2: the L1 event names its pages, tokens, salt."""
    dev = PageAllocator(64, "l1")
    cache = UnifiedRadixCache([FullComponent(dev, PageAllocator(64, "l2"))], 2,
                              hasher=HashNamespace("m", "bf16", 2))
    tracker = TierEventTracker(cache, tiers=(Tier.DEVICE,))
    cache_seq(cache, dev, list(range(10, 16)), salt="tenant-a")
    cache_seq(cache, dev, list(range(10, 20)), salt="tenant-a")
    events = tracker.take()
    assert isinstance(events[0], AllBlocksCleared)
    first, second = events[1], events[2]
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.token_ids == list(range(10, 16)) and first.block_size == 2 and first.medium == "GPU"
    assert first.parent_block_hash is None
    assert first.extra_keys == [("tenant-a",)] * 3
    assert second.token_ids == [16, 17, 18, 19]
    assert second.parent_block_hash == first.block_hashes[-1]
    # the hashes are the L3 page hashes of the same prefix
    assert [h.hex() for h in first.block_hashes + second.block_hashes] == \
        cache.hashes.hasher_for("tenant-a").hash_pages(array("I", range(10, 20)), None)
    cache.flush()
    removed = tracker.take()
    assert all(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in removed)
    assert {h for e in removed for h in e.block_hashes} == set(first.block_hashes + second.block_hashes)
    tracker.close()
    assert cache.core.observer is None


def test_only_the_tiers_asked_for():
    dev = PageAllocator(64, "l1")
    cache = UnifiedRadixCache([FullComponent(dev, PageAllocator(64, "l2"))], 1, hasher=HashNamespace("m", "bf16", 1))
    tracker = TierEventTracker(cache, tiers=(Tier.HOST,))
    cache_seq(cache, dev, [1, 2, 3])
    assert [type(e) for e in tracker.take()] == [AllBlocksCleared]
    with pytest.raises(RuntimeError, match="already has"):
        TierEventTracker(cache)


def test_a_failure_to_describe_a_change_stops_the_stream_and_never_the_tree():
    """A tracker that cannot make an event (here: no hasher) says ``AllBlocksCleared`` and
    stops; the tree's own call completes and stays consistent."""
    dev = PageAllocator(64, "l1")
    cache = UnifiedRadixCache([FullComponent(dev, PageAllocator(64, "l2"))], 1)  # no hasher
    tracker = TierEventTracker(cache)
    tracker.take()
    cache_seq(cache, dev, [1, 2, 3])
    assert tracker.failed and [type(e) for e in tracker.take()] == [AllBlocksCleared]
    cache_seq(cache, dev, [1, 2, 3, 4])
    assert tracker.take() == []
    assert cache.match_prefix([1, 2, 3, 4]).device_len == 4
    cache.check_integrity(exact=True)


def _written_and_evicted(key: list[int]) -> tuple[UnifiedRadixCache, TierEventTracker]:
    """A cache (page size 2, write-through) holding ``key`` in L2 only; its tracker's events
    so far taken."""
    dev = PageAllocator(64, "l1")
    cache = UnifiedRadixCache([FullComponent(dev, PageAllocator(64, "l2"))], 2, hasher=HashNamespace("m", "bf16", 2))
    tracker = TierEventTracker(cache)
    cache_seq(cache, dev, key)
    for node in cache.tiers.nodes_to_write_to_host():
        op = cache.tiers.start_write(node)
        assert op is not None
        cache.tiers.finish_write(op, True)
    cache.evict(cache.total_size() + 1)
    assert cache.total_size() == 0
    tracker.take()
    return cache, tracker


@pytest.mark.parametrize("ok", [True, False])
def test_a_load_back_is_announced_when_it_lands_and_never_when_it_fails(ok: bool) -> None:
    """L1 pages of a load-back in flight are not readable: nothing is announced at its start;
    ``BlockStored`` GPU at a finish that landed, nothing at all at one that failed."""
    key = list(range(1, 9))
    cache, tracker = _written_and_evicted(key)
    op = cache.tiers.start_load_back(cache.match_prefix(key))
    assert op is not None and cache.total_size() == 8  # the pages are set, not yet readable
    assert tracker.take() == []
    cache.tiers.finish_load_back(op, ok)
    events = tracker.take()
    if not ok:
        assert events == []
        return
    assert [type(e) for e in events] == [BlockStored] and events[0].medium == "GPU"
    assert events[0].token_ids == key and events[0].block_hashes == \
        [bytes.fromhex(h) for h in cache.hashes.hasher_for("").hash_pages(array("I", key), None)]


def test_a_load_back_replaced_by_a_request_is_announced_once() -> None:
    """A request that computes the pages of a node still loading fills it with its own: those
    are announced (once); the load's finish announces nothing more."""
    key = list(range(1, 9))
    cache, tracker = _written_and_evicted(key)
    op = cache.tiers.start_load_back(cache.match_prefix(key))
    assert op is not None
    cache_seq(cache, cache.full.allocator, key)
    cache.tiers.finish_load_back(op, True)
    events = tracker.take()
    assert [(type(e), e.medium) for e in events] == [(BlockStored, "GPU")]
    assert events[0].token_ids == key


def test_l3_is_announced_by_difference() -> None:
    """A backup acknowledged again, or one of a node split from an announced one, announces
    only pages not announced in L3 yet, each run chained to the page before it; an eviction
    names only announced pages; ``storage_replaced`` removes them all, once."""
    key = list(range(1, 9))
    cache, tracker = _written_and_evicted(key)
    node = cache.match_prefix(key).last_host_node
    hashes = [bytes.fromhex(h) for h in cache.hashes.node_hashes(node)]

    def back_up(n) -> list[KVEvent]:
        op = cache.tiers.start_backup(n)
        assert op is not None
        cache.tiers.finish_backup(op, True)
        return tracker.take()

    first = back_up(node)
    assert [(type(e), e.medium, e.block_hashes) for e in first] == [(BlockStored, "STORAGE", hashes)]
    assert back_up(node) == []  # the store holds them already: nothing changed
    tracker.pages_gone([hashes[2].hex(), "ab" * 32], Tier.STORAGE)  # one announced, one never
    assert tracker.take() == [BlockRemoved([hashes[2]], "STORAGE")]
    again = back_up(node)  # only the page that was gone, chained to the one before it
    assert len(again) == 1 and again[0].block_hashes == [hashes[2]]
    assert again[0].parent_block_hash == hashes[1] and again[0].token_ids == key[4:6]
    tracker.storage_replaced()
    removed = tracker.take()
    assert len(removed) == 1 and sorted(removed[0].block_hashes) == sorted(hashes)
    tracker.storage_replaced()
    assert tracker.take() == [] and tracker.in_storage == set()
