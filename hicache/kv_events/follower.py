"""Following a daemon's KV event stream from an engine (docs/architecture.md §14): what the
connector hands to vLLM's own event publisher (``take_events``), for routers that subscribe
to the engines only.

``EventFollower`` subscribes to the daemon's PUB socket and, on each ``take``, turns the
batches that arrived into the events this engine may announce:

| daemon event                           | handed on                                               |
|----------------------------------------|---------------------------------------------------------|
| ``BlockStored`` of this engine's       | as it is; its hashes are remembered per medium          |
| namespace                              |                                                         |
| ``BlockStored`` of another namespace   | nothing (those pages are not this engine's to load)     |
| ``BlockRemoved``                       | the hashes of it this follower announced, forgotten     |
| ``AllBlocksCleared`` (a daemon run     | ``BlockRemoved`` of every hash announced, per medium:   |
| begins)                                | vLLM's ``AllBlocksCleared`` would also clear the        |
|                                        | engine's own GPU blocks in a router's index             |

A gap in the sequence numbers (batches sent before the socket was connected, or dropped for
a slow reader) is filled from the daemon's replay socket when it has one, waiting at most
``replay_timeout_ms``; without one, or when the replay no longer holds them, the batches are
lost and counted (``missed``). The constructor asks the replay socket for everything it
still holds, so an engine that starts after the daemon learns what L2 and L3 hold already
(as far back as the daemon's replay buffer goes).

Runs: every batch names the daemon run that sent it (``hicache_run``). A batch of another
run than the last one is a restarted daemon, numbering from 0 again: what that run sent
before it (its ``AllBlocksCleared`` and journal pages, which the daemon keeps for replay) is
fetched from the replay socket first, only that run's batches. A batch of the same run below
the next number expected was handed on already (a replay and the live socket overlapped)
and is skipped. A batch without a run (an older daemon) that goes back counts as a new run.
``restart`` is for a caller that learns of a restart another way. Not thread-safe: one
caller (vLLM's scheduler).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import zmq

from hicache.kv_events.format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatchView,
    KVEvent,
    decode_batch,
)

log = logging.getLogger("hicache.kv_events")

END_SEQ = -1
"""The replay's end marker (8 signed big-endian bytes on the wire)."""


def connect_address(endpoint: str, host: str) -> str:
    """Where a client reaches a daemon endpoint that the daemon bound: a wildcard host
    (``tcp://*:5557``) becomes ``host``; ``ipc://`` paths and named hosts stay as they are."""
    if endpoint.startswith("tcp://*:"):
        return f"tcp://{host}:{endpoint.removeprefix('tcp://*:')}"
    return endpoint


class EventFollower:
    """See the module docstring. ``namespace`` None hands on every namespace's pages."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, namespace: str | None, *,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None, replay_timeout_ms: int = 200) -> None:
        self._ctx = ctx if ctx is not None else zmq.Context.instance()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self.namespace = namespace
        self._sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._expected = 0
        self.run: str | None = None
        """The daemon run whose batches this follower takes (None until one arrived)."""
        self._announced: dict[str, set[bytes]] = {}
        self.missed = 0
        """Batches lost: a gap the replay socket could not fill."""
        self.replayed = 0
        """Batches taken from the replay socket."""
        self._pending: list[KVEvent] = []
        self._catch_up(0, None)

    def close(self) -> None:
        self._sub.close(linger=0)

    @property
    def next_seq(self) -> int:
        """The sequence number of the next batch this follower expects from the daemon."""
        return self._expected

    def announced(self, medium: str) -> frozenset[bytes]:
        """The page hashes handed on as held in ``medium`` and not removed since: this
        follower's index of the daemon's content (as of the last ``take``)."""
        return frozenset(self._announced.get(medium, ()))

    def change_namespace(self, namespace: str) -> None:
        """This engine's pages are now ``namespace``'s (a cache reset): what was announced of
        the old one is handed on as removed, on the next ``take``."""
        self.namespace = namespace
        for medium, hashes in self._announced.items():
            if hashes:
                self._pending.append(BlockRemoved(sorted(hashes), medium))
        self._announced.clear()

    def restart(self) -> None:
        """The daemon restarted: its new run numbers batches from 0 (fetched on the next ``take``)."""
        self._expected = 0

    def take(self) -> list[KVEvent]:
        """The events to hand on since the last call (never waits, but for a replay)."""
        out, self._pending = self._pending, []
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("hicache: ignoring a malformed KV event message (%d frames)", len(frames))
                continue
            seq = int.from_bytes(frames[1], "big")
            batch = _decode(frames[2])
            run = batch.run if batch is not None else None
            if (run is not None and run != self.run) or (run is None and seq < self._expected):
                self._expected = 0  # a new run of the daemon: from its beginning
                self.run = run
            elif seq < self._expected:
                continue  # handed on already (from the replay socket)
            if seq > self._expected:
                self._catch_up(self._expected, seq)
                out.extend(self._pending)
                self._pending = []
            if batch is not None:
                self._apply(batch, out)
            self._expected = seq + 1

    def _catch_up(self, start: int, before: int | None) -> None:
        """Batches ``start`` up to ``before`` (all there are: None) of the current run from
        the replay socket, into ``_pending``; what it cannot give counts as missed. With no
        run yet, the replayed batches' run becomes the current one."""
        got = start
        for seq, payload in self._replay(start):
            if before is not None and seq >= before:
                break
            batch = _decode(payload)
            if batch is not None and batch.run is not None:
                if self.run is None:
                    self.run = batch.run
                elif batch.run != self.run:
                    continue  # another run's (the daemon restarted again meanwhile)
            if seq > got:
                self.missed += seq - got
            if batch is not None:
                self._apply(batch, self._pending)
            self.replayed += 1
            got = seq + 1
        if before is not None and got < before:
            self.missed += before - got
            log.warning("hicache: %d KV event batches of the daemon are lost (replay %s)", before - got,
                        self._replay_endpoint or "not configured")
        self._expected = max(self._expected, got)

    def _replay(self, start: int) -> Iterator[tuple[int, bytes]]:
        if self._replay_endpoint is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self._replay_timeout_ms / 1000
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(max(1, int(left * 1000))):
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                yield seq, frames[3]
            log.warning("hicache: the daemon's KV event replay did not finish in %d ms", self._replay_timeout_ms)
        finally:
            dealer.close(linger=0)

    def _apply(self, batch: EventBatchView, out: list[KVEvent]) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                for medium, hashes in self._announced.items():
                    if hashes:
                        out.append(BlockRemoved(sorted(hashes), medium))
                self._announced.clear()
            elif isinstance(ev, BlockStored):
                if self.namespace is None or ev.namespace == self.namespace:
                    self._announced.setdefault(ev.medium, set()).update(ev.block_hashes)
                    out.append(ev)
            else:
                held = self._announced.get(ev.medium, set())
                gone = [h for h in ev.block_hashes if h in held]
                if gone:
                    held.difference_update(gone)
                    out.append(BlockRemoved(gone, ev.medium))


def _decode(payload: bytes) -> EventBatchView | None:
    try:
        return decode_batch(payload)
    except ValueError as exc:
        log.warning("hicache: ignoring a KV event batch that does not decode: %s", exc)
        return None
