"""The cache server loop's per-engine queues (``hicache.cache_server.queues``): round-robin
order, the bounds past which a lookup or reserve is refused ``busy``, heartbeats never queued."""

from __future__ import annotations

import protos
from hicache.cache_server.queues import EngineQueues, Offer, queue_key


def _lookup(session: int, req: int) -> protos.Lookup:
    return protos.Lookup(req, session, 1, f"r{req}", b"")


def _drain(q: EngineQueues[bytes]) -> list[tuple[int, int]]:
    out = []
    while (got := q.pop()) is not None:
        msg = got[1]
        out.append((getattr(msg, "session", -1), getattr(msg, "req", getattr(msg, "lease", 0))))
    return out


def test_queues_are_served_in_turn_each_in_its_own_order() -> None:
    q: EngineQueues[bytes] = EngineQueues(100)
    for r in range(1, 7):
        assert q.offer(queue_key(b"a", _lookup(1, r)), b"a", _lookup(1, r)) is Offer.QUEUED
    for r in (11, 12):
        assert q.offer(queue_key(b"b", _lookup(2, r)), b"b", _lookup(2, r)) is Offer.QUEUED
    assert len(q) == 8
    assert _drain(q) == [(1, 1), (2, 11), (1, 2), (2, 12), (1, 3), (1, 4), (1, 5), (1, 6)]
    assert len(q) == 0 and q.pop() is None


def test_past_its_bound_a_queue_refuses_lookups_and_reserves_but_keeps_what_ends_a_call() -> None:
    q: EngineQueues[bytes] = EngineQueues(2, hard_limit=3)
    key = ("session", 1)
    assert [q.offer(key, b"a", _lookup(1, r)) for r in (1, 2, 3)] == [Offer.QUEUED, Offer.QUEUED, Offer.BUSY]
    assert q.offer(key, b"a", protos.Reserve(4, 1, 1, [])) is Offer.BUSY
    assert q.offer(("session", 2), b"b", _lookup(2, 5)) is Offer.QUEUED  # another engine's own bound
    assert q.offer(key, b"a", protos.Commit(1, 1, 7)) is Offer.QUEUED  # up to the hard bound
    assert q.offer(key, b"a", protos.Release(1, 1, 8)) is Offer.NOW  # past it: served at once, not dropped
    assert q.offer(key, b"a", protos.Heartbeat(1, 1, 9)) is Offer.NOW  # never queued
    assert q.queued(key) == 3 and len(q) == 4


def test_every_queue_together_is_bounded() -> None:
    q: EngineQueues[bytes] = EngineQueues(10, total_limit=3)
    assert [q.offer(("session", s), b"x", _lookup(s, s)) for s in range(4)] == [Offer.QUEUED] * 3 + [Offer.BUSY]
    assert q.offer(("session", 9), b"x", protos.Finished(9, 1, "r")) is Offer.NOW


def test_a_bound_of_zero_refuses_every_lookup_and_reserve() -> None:
    q: EngineQueues[bytes] = EngineQueues(0)
    assert q.offer(("session", 1), b"a", _lookup(1, 1)) is Offer.BUSY
    assert q.offer(("session", 1), b"a", protos.Commit(1, 1, 2)) is Offer.QUEUED


def test_a_message_without_a_session_is_queued_by_its_connection() -> None:
    reg = protos.EngineRegister(1, "e", 1, protos.EngineKVGeometry("a" * 64, "bfloat16", 4, 2, 2, 32, "LBHNC"), 1,
                                "c" * 64)
    assert queue_key(b"peer", reg) == ("peer", b"peer")
    assert queue_key(b"peer", _lookup(3, 1)) == ("session", 3)
