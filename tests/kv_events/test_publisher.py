"""``KVEventPublisher`` on real ZeroMQ sockets (ipc in a temporary directory, loopback tcp):
vLLM's three frames and sequence numbers, topic filtering, replay of a late subscriber's gap,
the bounded replay buffer, a subscriber that never reads, malformed replay requests, close."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hicache.bench.loopback_ports import free_port
from hicache.kv_events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch
from hicache.kv_events.publisher import END_SEQ, KVEventPublisher, PublisherStats, is_bind_endpoint

TOPIC = "kv@engine-0"


def _events(i: int) -> list[KVEvent]:
    return [BlockStored(block_hashes=[bytes([i % 256]) * 32], parent_block_hash=None, token_ids=[i, i + 1],
                        block_size=2, medium="CPU", extra_keys=[("salt",)]),
            BlockRemoved(block_hashes=[bytes([i % 256]) * 32], medium="GPU")]


def _wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def _connected(sock: zmq.Socket[bytes], connect: Callable[[], object]) -> None:
    """Connect and wait for the ZMTP handshake, then a moment for the subscription to land.

    The poll: a SUB socket that binds sends its subscription to a PUB that connects only
    once it has processed its commands (a libzmq quirk), which a poll makes it do."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    connect()
    assert monitor.poll(5000), "no handshake"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.poll(0)
    time.sleep(0.1)


def _subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, prefix: str = "") -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
    _connected(sub, lambda: sub.connect(endpoint))
    return sub


def _recv(sock: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received"
    return sock.recv_multipart()


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    """Every message of one replay, the end marker included, delimiters stripped."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[list[bytes]] = []
    while True:
        frames = _recv(dealer)
        assert frames[0] == b""
        out.append(frames[1:])
        if frames[2] == END_SEQ:
            dealer.close()
            return out


def test_subscriber_gets_vllm_frames_in_order(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    with KVEventPublisher(ipc("pub"), None, TOPIC, data_parallel_rank=2, ctx=ctx) as pub:
        sub = _subscriber(ctx, pub.endpoint)
        for i in range(3):
            assert pub.publish(_events(i), ts=100.0 + i)
        for i in range(3):
            topic, seq, payload = _recv(sub)
            assert topic == TOPIC.encode()
            assert seq == i.to_bytes(8, "big")
            batch = decode_batch(payload)
            assert (batch.ts, batch.events, batch.data_parallel_rank) == (100.0 + i, _events(i), 2)
        _wait_for(lambda: pub.stats().published_batches == 3)
        assert pub.stats() == PublisherStats(published_batches=3, published_events=6, dropped_batches=0,
                                             dropped_events=0, replay_requests=0, last_seq=2)


def test_topic_filtering(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    with KVEventPublisher(ipc("pub"), None, TOPIC, ctx=ctx) as pub:
        other = _subscriber(ctx, pub.endpoint, "kv@engine-1")
        mine = _subscriber(ctx, pub.endpoint, "kv@")
        pub.publish([AllBlocksCleared()])
        assert _recv(mine)[0] == TOPIC.encode()
        assert not other.poll(300)


def test_late_subscriber_fills_the_gap_from_replay(ctx: zmq.Context[zmq.Socket[bytes]],
                                                   ipc: Callable[[str], str]) -> None:
    with KVEventPublisher(ipc("pub"), ipc("replay"), TOPIC, ctx=ctx) as pub:
        assert pub.replay_endpoint == ipc("replay")
        for i in range(5):
            pub.publish(_events(i))
        _wait_for(lambda: pub.stats().published_batches == 5)
        sub = _subscriber(ctx, pub.endpoint)
        pub.publish(_events(5))
        _topic, seq, _payload = _recv(sub)
        first_live = int.from_bytes(seq, "big")
        assert first_live == 5
        replayed = _replay(ctx, pub.replay_endpoint, 0)
        assert replayed[-1] == [b"", END_SEQ, b""]
        assert [int.from_bytes(m[1], "big") for m in replayed[:-1]] == [0, 1, 2, 3, 4, 5]
        for i, (topic, _seq, payload) in enumerate(replayed[:-1]):
            assert topic == TOPIC.encode() and decode_batch(payload).events == _events(i)
        assert pub.stats().replay_requests == 1
        # a start past the end: only the end marker
        assert _replay(ctx, pub.replay_endpoint, 99) == [[b"", END_SEQ, b""]]


def test_replay_buffer_keeps_only_the_newest(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    with KVEventPublisher(ipc("pub"), ipc("replay"), TOPIC, buffer_batches=3, ctx=ctx) as pub:
        for i in range(6):
            pub.publish(_events(i))
        _wait_for(lambda: pub.stats().published_batches == 6)
        replayed = _replay(ctx, ipc("replay"), 0)
        assert [int.from_bytes(m[1], "big") for m in replayed[:-1]] == [3, 4, 5]


def test_kept_batches_outlive_the_replay_buffer_and_every_batch_names_the_run(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    """A run's opening (``keep``) is replayed from 0 however many batches followed, the
    newest ``buffer_batches`` after it; each batch's first event names the run (vLLM's
    decoder ignores the key); ``keep`` after an ordinary batch is refused."""
    msgspec = pytest.importorskip("msgspec")
    vkv = pytest.importorskip("vllm.distributed.kv_events")
    with KVEventPublisher(ipc("pub"), ipc("replay"), TOPIC, buffer_batches=3, ctx=ctx, run="r1",
                          kept_batches=2) as pub:
        assert pub.publish([AllBlocksCleared()], keep=True) and pub.publish(_events(1), keep=True)
        for i in range(2, 10):
            pub.publish(_events(i))
        with pytest.raises(ValueError, match="first batches"):
            pub.publish(_events(10), keep=True)
        replayed = _replay(ctx, ipc("replay"), 0)[:-1]
        assert [int.from_bytes(m[1], "big") for m in replayed] == [0, 1, 7, 8, 9]
        assert [int.from_bytes(m[1], "big") for m in _replay(ctx, ipc("replay"), 1)[:-1]] == [1, 7, 8, 9]
        assert {decode_batch(m[2]).run for m in replayed} == {"r1"}
        assert decode_batch(replayed[0][2]).events == [AllBlocksCleared()]
        vllm_batch = msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(replayed[1][2])
        assert [type(e).__name__ for e in vllm_batch.events] == ["BlockStored", "BlockRemoved"]


def test_a_subscriber_that_never_reads_never_slows_publishing(ctx: zmq.Context[zmq.Socket[bytes]],
                                                               ipc: Callable[[str], str]) -> None:
    """Past the PUB socket's high-water mark the batches are dropped for that subscriber
    alone: every publish returns at once, the subscriber sees the gap in the sequence
    numbers, and the replay socket gives it what it missed. ZeroMQ drops them silently: they
    are not counted as dropped (docs/events.md says so: the gaps are the signal)."""
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), TOPIC, ctx=ctx, send_hwm=10)
    try:
        sub = _subscriber(ctx, pub.endpoint)
        sub.setsockopt(zmq.RCVHWM, 10)
        total = 2_000
        assert all(pub.publish(_events(i)) for i in range(total))  # would hang if a send waited
        got = []
        while sub.poll(500):
            got.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert got and len(got) < total and got == sorted(got)
        missing = sorted(set(range(total)) - set(got))
        replayed = _replay(ctx, pub.replay_endpoint or "", missing[0])
        assert [int.from_bytes(m[1], "big") for m in replayed[:-1]] == list(range(missing[0], total))
        stats = pub.stats()
        assert (stats.published_batches, stats.dropped_batches, stats.last_seq) == (total, 0, total - 1)
    finally:
        pub.close()


def test_unencodable_batch_is_dropped_and_takes_no_sequence_number(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str], caplog: pytest.LogCaptureFixture) -> None:
    with KVEventPublisher(ipc("pub"), None, TOPIC, ctx=ctx) as pub:
        sub = _subscriber(ctx, pub.endpoint)
        pub.publish(["not an event"])  # type: ignore[list-item]
        pub.publish(_events(1))
        assert _recv(sub)[1] == (0).to_bytes(8, "big")
        _wait_for(lambda: pub.stats().published_batches == 1)
        assert (pub.stats().dropped_batches, pub.stats().dropped_events) == (1, 1)


def test_malformed_replay_requests_are_ignored(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hicache.kv_events.publisher")
    with KVEventPublisher(ipc("pub"), ipc("replay"), TOPIC, ctx=ctx) as pub:
        pub.publish(_events(0))
        _wait_for(lambda: pub.stats().published_batches == 1)
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(ipc("replay"))
        for frames in ([b"", b"abc"], [b"\x00" * 8], [b"x", b"\x00" * 8], [b"", b"\x00" * 8, b"more"],
                       [b"", b"\x00" * 9]):
            bad.send_multipart(frames)
        _wait_for(lambda: caplog.text.count("malformed") == 5)
        assert not bad.poll(200)  # no answer to any of them
        bad.close()
        replayed = _replay(ctx, ipc("replay"), 0)
        assert [int.from_bytes(m[1], "big") for m in replayed] == [0, -1 & (2**64 - 1)]
        assert pub.stats().replay_requests == 1
        assert pub.publish(_events(1))
        _wait_for(lambda: pub.stats().published_batches == 2)


def test_close_is_bounded_and_idempotent(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    pub = KVEventPublisher(ipc("pub"), ipc("replay"), TOPIC, ctx=ctx)
    sub = _subscriber(ctx, pub.endpoint)
    assert pub.publish(_events(0))
    assert int.from_bytes(_recv(sub)[1], "big") == 0
    began = time.monotonic()
    pub.close(timeout_s=2.0)
    assert time.monotonic() - began < 2.0
    began = time.monotonic()
    pub.close(timeout_s=5.0)
    assert time.monotonic() - began < 0.1
    assert not pub.publish([AllBlocksCleared()])
    stats = pub.stats()
    assert (stats.published_batches, stats.dropped_batches, stats.dropped_events) == (1, 1, 1)


def test_tcp_port_zero_reads_back_the_bound_port(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher("tcp://*:0", "tcp://127.0.0.1:0", TOPIC, ctx=ctx) as pub:
        assert pub.endpoint.startswith("tcp://0.0.0.0:") and not pub.endpoint.endswith(":0")
        assert pub.replay_endpoint is not None and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        port = int(pub.endpoint.rsplit(":", 1)[1])
        sub = _subscriber(ctx, f"tcp://127.0.0.1:{port}")
        pub.publish(_events(0))
        assert decode_batch(_recv(sub)[2]).events == _events(0)
        assert len(_replay(ctx, pub.replay_endpoint, 0)) == 2


def test_connects_when_the_endpoint_names_a_host(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A subscriber that binds (a collector); the publisher connects to it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    assert not is_bind_endpoint(endpoint)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)
    holder: list[KVEventPublisher] = []
    _connected(sub, lambda: holder.append(KVEventPublisher(endpoint, None, TOPIC, ctx=ctx)))
    with holder[0] as pub:
        assert pub.endpoint == endpoint
        pub.publish([AllBlocksCleared()])
        assert decode_batch(_recv(sub)[2]).events == [AllBlocksCleared()]


@pytest.mark.parametrize("endpoint,binds", [("tcp://*:5557", True), ("tcp://[::1]:5557", True),
                                            ("ipc:///tmp/x", True), ("inproc://x", True),
                                            ("tcp://10.0.0.1:5557", False), ("tcp://localhost:1", False)])
def test_bind_rule_is_vllms(endpoint: str, binds: bool) -> None:
    assert is_bind_endpoint(endpoint) is binds


def test_bad_endpoint_raises_at_construction(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(zmq.ZMQError):
        KVEventPublisher("tcp://*:notaport", None, TOPIC, ctx=ctx)
