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


@pytest.mark.parametrize("old_batches", [2, 30])
def test_a_restarted_daemon_is_told_by_its_run(ctx, ipc, old_batches: int) -> None:
    """The daemon restarts on the same endpoints (bind mode: its first batches go out before
    the follower has reconnected). Whether the old run ended below the new run's first batch
    received (2) or above it (30), the follower sees a new run, fetches the new run's
    beginning from the replay socket (its ``AllBlocksCleared``: removals of everything
    announced) and hands on each page once, by itself."""
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), "t", ctx=ctx, run="run-1")
    f = EventFollower(pub.endpoint, pub.replay_endpoint, MINE, ctx=ctx)
    connected(f, pub)
    for i in range(1, old_batches + 1):
        pub.publish([stored(i)])
    assert len(take_until(f, old_batches)) == old_batches
    pub.close()
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), "t", ctx=ctx, run="run-2")  # the new run
    try:
        pub.publish([AllBlocksCleared()], keep=True)
        for i in range(100, 110):
            pub.publish([stored(i)])
        got: list[KVEvent] = []
        deadline = time.monotonic() + 10
        k = 110
        while not got:  # until the subscriber has reconnected
            assert time.monotonic() < deadline, "the follower never reconnected"
            pub.publish([stored(k)])
            k += 1
            time.sleep(0.1)
            got = f.take()
        got += take_until(f, 0)
        removed_tags = sorted(h[0] for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes)
        assert removed_tags == list(range(1, old_batches + 1))
        assert [e.token_ids[0] for e in got if isinstance(e, BlockStored)] == list(range(100, k))
        assert f.missed == 0 and f.run == "run-2"
        f.close()
    finally:
        pub.close()


@pytest.mark.parametrize(("endpoint", "want"), [("tcp://*:5557", "tcp://10.0.0.2:5557"),
                                                ("tcp://daemon:5557", "tcp://daemon:5557"),
                                                ("ipc:///run/hicache/events.sock", "ipc:///run/hicache/events.sock")])
def test_connect_address(endpoint: str, want: str) -> None:
    assert connect_address(endpoint, "10.0.0.2") == want
