"""Per-engine queues of the cache server's loop (engine mode): fairness under overload.

The loop reads every engine message waiting on its socket into a queue per engine (its
session; a message without one, ``EngineRegister`` or ``EngineWorker``, into a queue of its
connection) and serves the queues round-robin, one message of each non-empty queue in turn:
an engine that sends ten times its share waits behind its own backlog, not the others'.
``Heartbeat`` is not queued (the loop serves it as it reads it: a session is never judged
silent behind a backlog).

Memory stays bounded: a ``Lookup`` or ``Reserve`` whose queue already holds ``limit``
messages (or when every queue together holds ``total_limit``) is refused (``offer`` answers
``Offer.BUSY``: the loop answers it ``protos.BUSY`` at once). Every other message (a
``Commit``, ``Release``, ``Finished`` ...: each ends what an answered call started) is queued
up to ``hard_limit`` per queue and ``total_limit`` in all, past which it is served at once
(``Offer.NOW``), never dropped.

Within one queue the order is the engine's own (a ``Commit`` after the ``Reserve`` it ends);
between queues there is none.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

import protos

HARD_LIMIT = 4096
"""Messages one queue holds at most (past ``limit``, only those that are never refused)."""

TOTAL_LIMIT = 65536
"""Messages every queue together holds at most."""

REFUSABLE = (protos.Lookup, protos.Reserve)
"""What is answered ``busy`` past a queue's bound: calls the engine goes on without."""

P = TypeVar("P")


class Offer(enum.Enum):
    """What ``EngineQueues.offer`` did with a message."""

    QUEUED = "queued"
    BUSY = "busy"
    """Refused: answer it ``protos.BUSY``."""
    NOW = "now"
    """Not queued (the bounds are reached, or a heartbeat): serve it at once."""


def queue_key(peer: bytes, msg: protos.Message) -> Hashable:
    """The queue of ``msg``: its session, or (no session in it) the connection it came on."""
    session = getattr(msg, "session", None)
    return ("session", session) if isinstance(session, int) else ("peer", peer)


class EngineQueues(Generic[P]):
    """Bounded per-engine FIFO queues served round-robin (see the module docstring).
    ``P``: what identifies the sender to answer (the ROUTER's peer id)."""

    def __init__(self, limit: int, *, hard_limit: int = HARD_LIMIT, total_limit: int = TOTAL_LIMIT) -> None:
        self.limit = limit
        self.hard_limit = max(hard_limit, limit)
        self.total_limit = total_limit
        self._queues: dict[Hashable, deque[tuple[P, protos.Message]]] = {}
        self._turns: deque[Hashable] = deque()  # the non-empty queues, the next to serve first
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def queued(self, key: Hashable) -> int:
        q = self._queues.get(key)
        return len(q) if q is not None else 0

    def offer(self, key: Hashable, peer: P, msg: protos.Message) -> Offer:
        """Queue ``msg`` under ``key`` unless a bound says otherwise (``Offer``)."""
        if isinstance(msg, protos.Heartbeat):
            return Offer.NOW
        n = self.queued(key)
        if isinstance(msg, REFUSABLE):
            if n >= self.limit or self._total >= self.total_limit:
                return Offer.BUSY
        elif n >= self.hard_limit or self._total >= self.total_limit:
            return Offer.NOW
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            self._turns.append(key)
        q.append((peer, msg))
        self._total += 1
        return Offer.QUEUED

    def pop(self) -> tuple[P, protos.Message] | None:
        """The next message to serve: the head of the queue whose turn it is (that queue then
        goes last); None when every queue is empty."""
        if not self._turns:
            return None
        key = self._turns.popleft()
        q = self._queues[key]
        item = q.popleft()
        self._total -= 1
        if q:
            self._turns.append(key)
        else:
            del self._queues[key]
        return item
