"""``hicache events``: subscribe to a KV event publisher (hicache's or vLLM's: the same wire,
``hicache.kv_events.publisher``) and print one line per event.

Lines (stdout), the sequence number and timestamp of the batch first::

    seq=12 ts=1712345678.250 BlockStored medium=CPU blocks=3 first=1a2b3c4d.. parent=9f8e7d6c.. tokens=96 ...
    seq=13 ts=1712345678.300 BlockRemoved medium=STORAGE blocks=2 first=1a2b3c4d..
    seq=14 ts=1712345678.300 AllBlocksCleared
    replayed seq=9 ...                      a batch fetched from the replay socket
    missed 3 batches (seq 10..12)           a gap nothing could fill
    new run 5f0c2d9e41a7b3e1 (was 9a7b6c5d4e3f2a03) at seq=4: replaying it from seq 0
    warning: seq=15: malformed payload: ...

Gaps: after the first batch received (or from ``--from-seq``), a sequence number past the next
one expected is a gap. With ``--replay-endpoint`` the missing batches are fetched from the
replay socket and printed first, marked ``replayed``; what the replay buffer no longer holds,
or every missing batch without a replay socket, is reported as missed. ``--from-seq`` with
``--replay-endpoint`` prints what the replay socket holds from that number at once (an idle
publisher sends no live batch to show the gap); a live batch printed that way is not printed
again.

Runs: a hicache daemon names its run in every batch (``hicache_run``). A batch of another
run than the last one is a restarted daemon, numbering from 0 again: the line ``new run``
says so, and the new run's batches before it (its ``AllBlocksCleared``, the L3 pages its
journal announces again) are fetched from the replay socket, printed ``replayed``, as for any
gap (only that run's batches). A batch of the same run below the number expected was printed
already and is skipped. A publisher without runs (vLLM) whose numbers go back gets a warning.

Exit status: 0 after ``--count`` events or ``--timeout-s`` seconds without a message; 2 for an
endpoint that is not ``tcp://HOST:PORT`` or ``ipc://PATH``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from hicache.kv_events.format import BlockRemoved, BlockStored, KVEvent, decode_batch

if TYPE_CHECKING:
    import zmq

_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s*]+):(\d+)$")
_REPLAY_WAIT_S = 5.0  # the longest a replay may take to answer
_POLL_SLICE_MS = 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="the publisher's PUB socket, tcp://HOST:PORT or ipc://PATH")
    parser.add_argument("--replay-endpoint", default=None,
                        help="its replay socket: fill sequence gaps from it")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    parser.add_argument("--count", type=int, default=None, help="exit after this many events")
    parser.add_argument("--timeout-s", type=float, default=None, help="exit after this many seconds without a message")
    parser.add_argument("--from-seq", type=int, default=None,
                        help="treat the batches from this sequence number on as expected (replays them)")


def endpoint_error(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be connected to, or None."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return None
    match = _TCP.match(endpoint)
    if match is None:
        return "expected tcp://HOST:PORT or ipc://PATH"
    if not 0 < int(match.group(2)) <= 65535:
        return f"port {match.group(2)} out of range"
    return None


def _short(h: bytes) -> str:
    return h.hex()[:8] + (".." if len(h) > 4 else "")


def describe(event: KVEvent) -> str:
    """One event as the text after ``seq=... ts=...``."""
    if isinstance(event, BlockStored):
        parts = [f"BlockStored medium={event.medium or '-'} blocks={len(event.block_hashes)}"]
        if event.block_hashes:
            parts.append(f"first={_short(event.block_hashes[0])}")
        parts.append(f"parent={_short(event.parent_block_hash) if event.parent_block_hash else 'none'}")
        parts.append(f"tokens={len(event.token_ids)} block_size={event.block_size}")
        if event.lora_name is not None or event.lora_id is not None:
            parts.append(f"lora={event.lora_name if event.lora_name is not None else event.lora_id}")
        keys = [k for k in event.extra_keys or [] if k is not None]
        if keys:
            shown = repr(keys[0])
            parts.append(f"extra={shown if len(shown) <= 60 else shown[:57] + '...'}"
                         + ("" if all(k == keys[0] for k in keys) else f" (+{len(keys) - 1} differing)"))
        return " ".join(parts)
    if isinstance(event, BlockRemoved):
        head = f"BlockRemoved medium={event.medium or '-'} blocks={len(event.block_hashes)}"
        return head + (f" first={_short(event.block_hashes[0])}" if event.block_hashes else "")
    return type(event).__name__


@dataclass
class _Printer:
    """Prints batches and counts events against ``limit``."""

    out: TextIO
    limit: int | None
    printed: int = 0

    @property
    def done(self) -> bool:
        return self.limit is not None and self.printed >= self.limit

    def line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def batch(self, seq: int, payload: bytes, replayed: bool) -> None:
        mark = "replayed " if replayed else ""
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            self.line(f"warning: {mark}seq={seq}: malformed payload: {exc}")
            return
        head = f"{mark}seq={seq} ts={batch.ts:.3f}"
        if batch.data_parallel_rank is not None:
            head += f" dp={batch.data_parallel_rank}"
        for event in batch.events:
            if self.done:
                return
            self.line(f"{head} {describe(event)}")
            self.printed += 1


@dataclass
class _Subscriber:
    ctx: zmq.Context[zmq.Socket[bytes]]
    sub: zmq.Socket[bytes]
    replay_endpoint: str | None
    topic: bytes
    printer: _Printer
    expected: int | None = None
    run: str | None = None
    """The run of the last batch (``hicache_run``), None before one or from a publisher without."""
    replayed_below: int | None = None
    """Batches below this number were printed from the replay socket at start (``catch_up``):
    live copies of them are skipped."""

    def _replayed(self, start: int) -> Iterator[tuple[int, bytes]]:
        """(seq, payload) of each batch the replay socket sends from ``start``; raises
        ``TimeoutError`` when it stops answering."""
        import zmq

        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(int(_REPLAY_WAIT_S * 1000)):
                    raise TimeoutError
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.printer.line(f"warning: malformed replay message ({len(frames)} frames)")
                    continue
                _, topic, seq_bytes, payload = frames
                if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                    return
                if topic.startswith(self.topic) and self._of_this_run(payload):
                    yield int.from_bytes(seq_bytes, "big"), payload
        finally:
            dealer.close(linger=0)

    def _of_this_run(self, payload: bytes) -> bool:
        """Whether a replayed batch belongs to the run followed (any, before one is known,
        which it then becomes)."""
        run = _run_of(payload)
        if run is None or self.run is None:
            self.run = self.run or run
            return True
        return run == self.run

    def fill(self, first: int, last: int) -> None:
        """Print batches ``first..last`` from the replay socket, or say they were missed."""
        missing = last - first + 1
        if self.replay_endpoint is None:
            self.printer.line(f"missed {missing} batches (seq {first}..{last})")
            return
        got = 0
        try:
            for seq, payload in self._replayed(first):
                if first <= seq <= last:
                    got += 1
                    self.printer.batch(seq, payload, replayed=True)
                    if self.printer.done:
                        return
        except TimeoutError:
            self.printer.line(f"warning: the replay socket did not answer within {_REPLAY_WAIT_S:.0f}s")
        if got < missing:
            self.printer.line(f"missed {missing - got} batches (seq {first}..{last}): "
                              "not all in the replay buffer")

    def catch_up(self, start: int) -> None:
        """Print every batch the replay socket holds from ``start`` on, now."""
        self.expected = start
        try:
            for seq, payload in self._replayed(start):
                if seq >= self.expected:
                    self.printer.batch(seq, payload, replayed=True)
                    self.expected = seq + 1
                    if self.printer.done:
                        return
        except TimeoutError:
            self.printer.line(f"warning: the replay socket did not answer within {_REPLAY_WAIT_S:.0f}s")
        self.replayed_below = self.expected

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.printer.line(f"warning: malformed message ({len(frames)} frames)")
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        run = _run_of(payload)
        if run is not None and run != self.run:
            if self.run is not None:  # a restarted daemon: its run from the beginning
                self.printer.line(f"new run {run} (was {self.run})"
                                  + (f" at seq={seq}: replaying it from seq 0" if seq else ""))
                self.expected, self.replayed_below = 0, None
            self.run = run
        if self.replayed_below is not None:
            if seq < self.replayed_below:
                return  # printed by catch_up already
            self.replayed_below = None
        if self.expected is not None:
            if seq > self.expected:
                self.fill(self.expected, seq - 1)
                if self.printer.done:
                    return
            elif seq < self.expected and run is not None:
                return  # this run's, printed already (from the replay socket)
            elif seq < self.expected:
                self.printer.line(f"warning: sequence went back from {self.expected - 1} to {seq} "
                                  "(publisher restarted?)")
        self.expected = seq + 1
        self.printer.batch(seq, payload, replayed=False)


def _run_of(payload: bytes) -> str | None:
    """The daemon run a batch names (``hicache_run``); None without one or when it does not decode."""
    try:
        return decode_batch(payload).run
    except ValueError:
        return None


def run(args: argparse.Namespace) -> int:
    for flag, endpoint in (("--endpoint", args.endpoint), ("--replay-endpoint", args.replay_endpoint)):
        if endpoint is None:
            continue
        error = endpoint_error(endpoint)
        if error is not None:
            print(f"hicache events: bad {flag} {endpoint!r}: {error}", file=sys.stderr)
            return 2
    if args.count is not None and args.count < 1:
        print("hicache events: --count must be at least 1", file=sys.stderr)
        return 2
    if args.timeout_s is not None and args.timeout_s <= 0:
        print("hicache events: --timeout-s must be positive", file=sys.stderr)
        return 2

    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        topic = args.topic.encode("utf-8")
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        try:
            sub.connect(args.endpoint)
        except zmq.ZMQError as exc:
            print(f"hicache events: cannot connect to {args.endpoint!r}: {exc}", file=sys.stderr)
            return 2
        print(f"listening on {args.endpoint} topic={args.topic!r}", file=sys.stderr, flush=True)
        printer = _Printer(sys.stdout, args.count)
        state = _Subscriber(ctx, sub, args.replay_endpoint, topic, printer, expected=args.from_seq)
        if args.from_seq is not None and args.replay_endpoint is not None:
            state.catch_up(args.from_seq)
        quiet_since = time.monotonic()
        while not printer.done:
            wait_ms = _POLL_SLICE_MS
            if args.timeout_s is not None:
                left = args.timeout_s - (time.monotonic() - quiet_since)
                if left <= 0:
                    break
                wait_ms = max(1, min(wait_ms, int(left * 1000)))
            if not sub.poll(wait_ms):
                continue
            state.handle(sub.recv_multipart())
            quiet_since = time.monotonic()
        return 0
    finally:
        ctx.destroy(linger=0)
