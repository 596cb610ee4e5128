"""``hicache events`` as a subprocess against a real ``KVEventPublisher``: one line per event,
gaps filled from the replay socket (or reported as missed), malformed payloads survived,
exit 0 on ``--count`` / ``--timeout-s``, exit 2 on a bad endpoint."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from hicache.bench.loopback_ports import free_port
from hicache.cli.events import describe, endpoint_error
from hicache.kv_events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, encode_batch
from hicache.kv_events.publisher import KVEventPublisher

pytestmark = pytest.mark.processes  # ``hicache events`` as a subprocess

REPO = Path(__file__).resolve().parents[2]
TOPIC = "kv@engine-0"

STORED = BlockStored(block_hashes=[bytes.fromhex("1a2b3c4d") + bytes(28), b"\x02" * 32, b"\x03" * 32],
                     parent_block_hash=bytes.fromhex("9f8e7d6c") + bytes(28), token_ids=list(range(96)),
                     block_size=32, medium="CPU", extra_keys=[("salt-1",)] * 3)
REMOVED = BlockRemoved(block_hashes=[b"\x05" * 32, b"\x06" * 32], medium="STORAGE")


def _batches() -> list[list[KVEvent]]:
    return [[STORED], [REMOVED], [AllBlocksCleared()]]


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hicache", "events", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _feed_until_exit(proc: subprocess.Popen[str], publish: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Publish filler batches until the subscriber exits: it only sees what is published after
    its subscription lands, and a gap is noticed on the next live batch."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("hicache events did not exit")
        publish()
        time.sleep(0.05)


def _filler(pub: KVEventPublisher) -> Callable[[], object]:
    return lambda: pub.publish([BlockRemoved(block_hashes=[b"\xee" * 32], medium="GPU")])


def test_replays_from_seq_and_prints_one_line_per_event(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub_port, replay_port = free_port(), free_port()
    with KVEventPublisher(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}", TOPIC,
                          data_parallel_rank=1, ctx=ctx) as pub:
        for batch in _batches():  # seq 0..2, before anyone listens
            pub.publish(batch, ts=1712345678.25)
        proc = _cli("--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint",
                    f"tcp://127.0.0.1:{replay_port}", "--topic", "kv@", "--from-seq", "0", "--count", "3")
        _feed_until_exit(proc, _filler(pub))
        out, err = proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines == [
        "replayed seq=0 ts=1712345678.250 dp=1 BlockStored medium=CPU blocks=3 first=1a2b3c4d.. "
        "parent=9f8e7d6c.. tokens=96 block_size=32 extra=('salt-1',)",
        "replayed seq=1 ts=1712345678.250 dp=1 BlockRemoved medium=STORAGE blocks=2 first=05050505..",
        "replayed seq=2 ts=1712345678.250 dp=1 AllBlocksCleared",
    ]
    assert "listening on" in err


def test_from_seq_prints_the_replay_at_once_and_no_batch_twice(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """An idle publisher sends nothing live: the replay is printed without waiting for a gap.
    Live batches then follow, none printed twice, whenever the subscription landed."""
    pub_port, replay_port = free_port(), free_port()
    with KVEventPublisher(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}", TOPIC, ctx=ctx) as pub:
        for batch in _batches():
            pub.publish(batch, ts=1712345678.25)
        args = ("--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
                "--from-seq", "1")
        idle = _cli(*args, "--count", "2")
        out, err = idle.communicate(timeout=30)  # nothing is published meanwhile
        assert idle.returncode == 0, err
        assert [line.split(" ts=")[0] for line in out.splitlines()] == ["replayed seq=1", "replayed seq=2"]

        busy = _cli(*args, "--count", "6")
        _feed_until_exit(busy, _filler(pub))
        out, err = busy.communicate()
    assert busy.returncode == 0, err
    seqs = [int(m.group(1)) for m in re.finditer(r"^(?:replayed )?seq=(\d+) ", out, re.MULTILINE)]
    assert seqs == list(range(1, 7)), out
    assert "warning" not in out + err


def test_gap_without_replay_is_reported_as_missed(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    endpoint = f"ipc://{tmp_path / 'pub'}"
    with KVEventPublisher(endpoint, None, TOPIC, ctx=ctx) as pub:
        for batch in _batches():
            pub.publish(batch)
        proc = _cli("--endpoint", endpoint, "--from-seq", "0", "--count", "2")
        _feed_until_exit(proc, _filler(pub))
        out, err = proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    match = re.fullmatch(r"missed (\d+) batches \(seq 0\.\.(\d+)\)", lines[0])
    assert match is not None, lines
    assert int(match.group(1)) >= 3 and int(match.group(2)) == int(match.group(1)) - 1
    first_live = int(match.group(1))
    assert lines[1].startswith(f"seq={first_live} ts=") and lines[1].endswith("BlockRemoved medium=GPU blocks=1 "
                                                                                   "first=eeeeeeee..")
    assert lines[2].startswith(f"seq={first_live + 1} ")


def test_live_events_in_order(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Without --from-seq, whatever arrives first starts the stream; consecutive batches follow."""
    endpoint = f"ipc://{tmp_path / 'pub'}"
    with KVEventPublisher(endpoint, None, TOPIC, ctx=ctx) as pub:
        proc = _cli("--endpoint", endpoint, "--count", "5")
        _feed_until_exit(proc, lambda: pub.publish([AllBlocksCleared(), AllBlocksCleared()]))
        out, err = proc.communicate()
    assert proc.returncode == 0, err
    seqs = [int(re.match(r"seq=(\d+) ", line).group(1)) for line in out.splitlines()]  # type: ignore[union-attr]
    assert len(seqs) == 5 and seqs[0] == seqs[1] and seqs[2] == seqs[3] == seqs[0] + 1 and seqs[4] == seqs[0] + 2


def test_malformed_payloads_print_a_warning_and_continue(tmp_path: Path,
                                                         ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    endpoint = f"ipc://{tmp_path / 'pub'}"
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(endpoint)
    seq = 0

    def publish() -> None:
        nonlocal seq
        payload = b"\xc1 not msgpack" if seq % 2 == 0 else encode_batch(5.0, [AllBlocksCleared()])
        raw.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])
        seq += 1

    proc = _cli("--endpoint", endpoint, "--count", "2")
    _feed_until_exit(proc, publish)
    out, err = proc.communicate()
    raw.close()
    assert proc.returncode == 0, err
    assert any(line.startswith("warning: seq=") and "malformed payload" in line for line in out.splitlines())
    assert sum(line.endswith("AllBlocksCleared") for line in out.splitlines()) == 2


def test_exits_after_timeout_of_silence(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    endpoint = f"ipc://{tmp_path / 'pub'}"
    with KVEventPublisher(endpoint, None, TOPIC, ctx=ctx):
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "hicache", "events", "--endpoint", endpoint,
                               "--timeout-s", "0.5"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert time.monotonic() - began < 30


@pytest.mark.parametrize("args", [["--endpoint", "localhost:5557"], ["--endpoint", "tcp://host"],
                                  ["--endpoint", "tcp://127.0.0.1:99999"],
                                  ["--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", "udp://x:1"]])
def test_bad_endpoint_exits_2(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "hicache", "events", *args, "--timeout-s", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "hicache events: bad --" in proc.stderr


@pytest.mark.parametrize("endpoint,ok", [("tcp://127.0.0.1:5557", True), ("tcp://[::1]:5557", True),
                                         ("tcp://vllm-0.svc:5557", True), ("ipc:///tmp/kv", True),
                                         ("tcp://*:5557", False), ("tcp://h:0", False), ("ipc://", False)])
def test_endpoint_check(endpoint: str, ok: bool) -> None:
    assert (endpoint_error(endpoint) is None) is ok


def test_describe_without_parent_or_extra_keys() -> None:
    event = BlockStored(block_hashes=[b"\xab\xcd"], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                        medium="GPU", lora_name="adapter")
    assert describe(event) == "BlockStored medium=GPU blocks=1 first=abcd parent=none tokens=2 block_size=2 " \
                              "lora=adapter"


class _Lines:
    """A running ``hicache events``'s stdout lines, read as they come (a thread)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def feed_until(self, publish: Callable[[], object], check: Callable[[list[str]], bool],
                   timeout_s: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not check(list(self.lines)):
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "\n".join(self.lines)
            publish()
            time.sleep(0.05)
        return list(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.thread.join(5)


def _forwarder(ctx: zmq.Context[zmq.Socket[bytes]], publishers: str, subscribers: str) -> threading.Thread:
    """A ZeroMQ forwarder (XSUB <- publishers that connect, XPUB -> subscribers), as a broker
    that connect-mode publishers use; it ends when ``ctx`` is destroyed."""
    def run() -> None:
        xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        xsub.bind(publishers)
        xpub.bind(subscribers)
        try:
            zmq.proxy(xsub, xpub)
        except zmq.ZMQError:  # the context was destroyed: the test is over
            pass
        finally:
            xsub.close(0)
            xpub.close(0)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_a_restarted_daemon_is_replayed_from_its_beginning(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]],
                                                           mode: str) -> None:
    """The publisher restarts (a new run) with fewer batches sent before it than the first one
    the subscriber then receives: ``hicache events`` sees the new run by its id, says so, and
    prints the new run's ``AllBlocksCleared`` and kept pages from the replay socket, by itself."""
    replay = f"ipc://{tmp_path / 'replay'}"
    if mode == "bind":
        pub_at = sub_at = f"ipc://{tmp_path / 'pub'}"
    else:  # the publisher connects to a forwarder the subscriber connects to as well
        pub_at, sub_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        _forwarder(ctx, pub_at, sub_at)
    pub = KVEventPublisher(pub_at, replay, TOPIC, ctx=ctx, run="run-one")
    out = _Lines(_cli("--endpoint", sub_at, "--replay-endpoint", replay))
    try:
        out.feed_until(_filler(pub), lambda lines: len(lines) >= 2)
        pub.close()
        pub = KVEventPublisher(pub_at, replay, TOPIC, ctx=ctx, run="run-two")
        pub.publish([AllBlocksCleared()], keep=True)
        pub.publish([STORED], keep=True)
        for _ in range(40):  # the new run is far ahead before the subscriber can see it
            _filler(pub)()
        lines = out.feed_until(_filler(pub), lambda lines: any(re.match(r"(replayed )?seq=1 ", line)
                                                                for line in lines))
    finally:
        out.stop()
        pub.close()
    # bind: the new run's first batches went out before the subscriber reconnected, and are
    # replayed; connect: the forwarder kept the subscription, and they may come live
    new = [i for i, line in enumerate(lines) if line.startswith("new run run-two (was run-one)")]
    assert len(new) == 1, lines
    after = lines[new[0] + 1:]
    assert re.match(r"(replayed )?seq=0 .* AllBlocksCleared$", after[0]), lines
    assert re.match(r"(replayed )?seq=1 .* BlockStored medium=CPU blocks=3 ", after[1]), lines
    assert not any(line.startswith(("missed", "warning")) for line in lines), lines
    if mode == "bind":
        assert lines[new[0]].endswith(": replaying it from seq 0") and after[0].startswith("replayed "), lines
