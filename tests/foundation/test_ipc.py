"""Typed ZeroMQ sockets over private ipc:// addresses: messages pass, garbage is refused, nothing stalls."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

import protos
from hicache.runtime.ipc import (
    DealerSocket,
    Endpoints,
    PeerProtocolError,
    PullSocket,
    PushSocket,
    RouterSocket,
    ensure_private,
    make_runtime_dir,
)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_runtime_dir_is_private(tmp_path: Path) -> None:
    d = make_runtime_dir(str(tmp_path))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError):
        ensure_private(open_dir)


def test_endpoint_addresses(tmp_path: Path) -> None:
    ipc = Endpoints("ipc", str(tmp_path))
    assert ipc.address("scheduler") == f"ipc://{tmp_path}/scheduler.sock"
    tcp = Endpoints("tcp", tcp_host="127.0.0.1", tcp_base_port=7000)
    assert tcp.address("tokenizer") == "tcp://127.0.0.1:7001"
    with pytest.raises(ValueError):
        ipc.address("nope")


def test_push_pull_passes_accepted_messages_and_refuses_the_rest(ctx: zmq.Context, tmp_path: Path) -> None:
    addr = Endpoints("ipc", str(make_runtime_dir(str(tmp_path)))).address("scheduler")
    pull: PullSocket[protos.SchedulerMessage] = PullSocket(ctx, addr, (protos.GenerateRequest, protos.AbortRequest))
    push: PushSocket[protos.SchedulerMessage] = PushSocket(ctx, addr)
    raw = ctx.socket(zmq.PUSH)
    raw.connect(addr)
    try:
        push.send(protos.AbortRequest("a"))
        assert pull.recv(2000) == protos.AbortRequest("a")
        raw.send(b"\x00garbage")
        with pytest.raises(protos.ProtocolError):
            pull.recv(2000)
        push.send(protos.Cancel(1))  # a valid message, but not for this endpoint
        with pytest.raises(protos.ProtocolError, match="not accepted"):
            pull.recv(2000)
        push.send(protos.AbortRequest("b"))  # still serving after the bad frames
        assert pull.recv(2000) == protos.AbortRequest("b")
        assert pull.recv(10) is None
    finally:
        raw.close(0)
        push.close()
        pull.close()


def test_router_reports_the_peer_of_a_bad_frame(ctx: zmq.Context, tmp_path: Path) -> None:
    addr = Endpoints("ipc", str(make_runtime_dir(str(tmp_path)))).address("controller")
    router: RouterSocket[protos.ControllerMessage] = RouterSocket(ctx, addr, (protos.Cancel,))
    dealer: DealerSocket[protos.Message] = DealerSocket(ctx, addr, (protos.OpDone, protos.ErrorReply),
                                                        identity=b"sched")
    try:
        dealer.send(protos.Cancel(3))
        got = router.recv(2000)
        assert got is not None
        peer, msg = got
        assert peer == b"sched" and msg == protos.Cancel(3)
        router.send(peer, protos.OpDone(3, "cancelled"))
        assert dealer.recv(2000) == protos.OpDone(3, "cancelled")
        dealer.socket.send(b"\xff\xfe")
        with pytest.raises(PeerProtocolError) as info:
            router.recv(2000)
        assert info.value.peer == b"sched"
        router.send(info.value.peer, protos.ErrorReply(str(info.value)))
        reply = dealer.recv(2000)
        assert isinstance(reply, protos.ErrorReply) and "msgpack" in reply.error
    finally:
        dealer.close()
        router.close()
