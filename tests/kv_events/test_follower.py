"""``EventFollower`` against a real ``KVEventPublisher`` (ipc sockets): what an engine hands
on from the daemon's stream: only its namespace's pages, removals of what it announced, a
daemon's ``AllBlocksCleared`` as removals, gaps filled from the replay socket (and counted
when they cannot be), a new namespace after a cache reset, a restarted daemon."""

from __future__ import annotations

import time

import pytest
import zmq

from hicache.kv_events.follower import EventFollower, connect_address
from hicache.kv_events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from hicache.kv_events.publisher import KVEventPublisher

MINE, OTHER = "a" * 32, "b" * 32


def stored(tag: int, medium: str = "CPU", namespace: str = MINE) -> BlockStored:
    return BlockStored([bytes([tag]) * 32], None, [tag] * 4, 4, medium, [("s",)], namespace=namespace)


def removed(tag: int, medium: str = "CPU") -> BlockRemoved:
    return BlockRemoved([bytes([tag]) * 32], medium)


def connected(f: EventFollower, pub: KVEventPublisher, timeout_s: float = 10.0) -> None:
    """Until the follower's subscription has landed: removals of a page it never announced
    (they hand on nothing) are published until one arrives live."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the follower never connected"
        pub.publish([removed(255)])
        time.sleep(0.05)
        assert f.take() == []
        if f.next_seq == (pub.stats().last_seq or 0) + 1:
            return


def take_until(f: EventFollower, n: int, timeout_s: float = 5.0) -> list[KVEvent]:
    got: list[KVEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} events, wanted {n}"
        got += f.take()
        time.sleep(0.01)
    time.sleep(0.05)
    return got + f.take()


def test_hands_on_its_namespace_and_turns_a_clear_into_removals(ctx, ipc) -> None:
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), "t", ctx=ctx)
    try:
        pub.publish([AllBlocksCleared(), stored(1), stored(2, namespace=OTHER)])  # before the follower: replayed
        f = EventFollower(pub.endpoint, pub.replay_endpoint, MINE, ctx=ctx)
        assert f.take() == [stored(1)] and f.replayed == 1 and f.missed == 0
        connected(f, pub)
        pub.publish([stored(3, "STORAGE"), removed(2), removed(1), stored(4)])
        assert take_until(f, 3) == [stored(3, "STORAGE"), removed(1), stored(4)]  # 2 was never announced
        pub.publish([AllBlocksCleared()])  # the daemon's new run holds nothing
        assert sorted(take_until(f, 2), key=lambda e: e.medium) == [
            BlockRemoved([bytes([4]) * 32], "CPU"), BlockRemoved([bytes([3]) * 32], "STORAGE")]
        pub.publish([stored(5)])
        assert take_until(f, 1) == [stored(5)]
        f.change_namespace(OTHER)  # a cache reset: the old namespace's pages are gone for this engine
        pub.publish([stored(6), stored(7, namespace=OTHER)])
        assert take_until(f, 2) == [removed(5), stored(7, namespace=OTHER)]
        assert f.missed == 0
        f.close()
    finally:
        pub.close()


def test_a_gap_is_filled_from_the_replay_socket(ctx, ipc) -> None:
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), "t", ctx=ctx, send_hwm=2)
    try:
        f = EventFollower(pub.endpoint, pub.replay_endpoint, MINE, ctx=ctx)
        f._sub.setsockopt(zmq.RCVHWM, 2)
        connected(f, pub)
        first = pub.stats().last_seq
        for i in range(1, 200):  # far more than the pipes hold: most are dropped for this reader
            pub.publish([stored(i)])
        time.sleep(0.2)
        got = f.take()
        pub.publish([stored(200)])  # the batch after the last lost one shows the gap
        got += take_until(f, 200 - len(got))
        assert [e.token_ids[0] for e in got if isinstance(e, BlockStored)] == list(range(1, 201))
        assert f.replayed > 0 and f.missed == 0 and first is not None
        f.close()
    finally:
        pub.close()


def test_without_a_replay_socket_a_gap_is_counted(ctx, ipc) -> None:
    pub = KVEventPublisher(ipc("pub"), None, "t", ctx=ctx)
    try:
        pub.publish([stored(1)])
        pub.publish([stored(2)])
        f = EventFollower(pub.endpoint, None, MINE, ctx=ctx)
        connected(f, pub)  # the first probe to arrive shows the two batches (and any probe) it missed
        missed = f.missed
        assert missed >= 2
        pub.publish([stored(3)])
        assert take_until(f, 1) == [stored(3)] and f.missed == missed
        f.close()
    finally:
        pub.close()


def test_a_restarted_daemon_numbers_from_zero(ctx, ipc) -> None:
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), "t", ctx=ctx)
    f = EventFollower(pub.endpoint, pub.replay_endpoint, MINE, ctx=ctx)
    time.sleep(0.2)
    for i in range(1, 6):
        pub.publish([stored(i)])
    assert len(take_until(f, 5)) == 5
    pub.close()
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), "t", ctx=ctx)  # the new run, same endpoints
    try:
        for i in range(10, 20):  # more than the old run sent before the follower reconnects
            pub.publish([AllBlocksCleared()] if i == 10 else [stored(i)])
        f.restart()  # the connector learns of the new run from its registration
        got: list[KVEvent] = []
        deadline = time.monotonic() + 10
        k = 20
        while not got:  # until the subscriber has reconnected: each batch it misses is replayed
            assert time.monotonic() < deadline, "the follower never reconnected"
            pub.publish([stored(k)])
            k += 1
            time.sleep(0.1)
            got = f.take()
        assert sorted(h[0] for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes) == [1, 2, 3, 4, 5]
        assert [e.token_ids[0] for e in got if isinstance(e, BlockStored)] == list(range(11, k))
        assert f.missed == 0
        f.close()
    finally:
        pub.close()


@pytest.mark.parametrize(("endpoint", "want"), [("tcp://*:5557", "tcp://10.0.0.2:5557"),
                                                ("tcp://daemon:5557", "tcp://daemon:5557"),
                                                ("ipc:///run/hicache/events.sock", "ipc:///run/hicache/events.sock")])
def test_connect_address(endpoint: str, want: str) -> None:
    assert connect_address(endpoint, "10.0.0.2") == want
