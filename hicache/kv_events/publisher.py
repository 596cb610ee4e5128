"""``KVEventPublisher``: KV event batches on a ZeroMQ PUB socket, as vLLM's
``ZmqEventPublisher`` sends them, with vLLM's replay socket.

Wire (identical to vLLM 0.32, but for the run key a decoder ignores):

- PUB, one message per batch, three frames: the topic (UTF-8), the sequence number (8 bytes,
  unsigned big-endian, 0 for the first batch, +1 per batch published), the payload
  (``format.encode_batch``). Subscribers filter on the topic prefix as ZeroMQ does.
- replay (optional ROUTER): a client (REQ, or DEALER sending an empty delimiter first) sends
  the first sequence number it wants as 8 unsigned big-endian bytes, so the ROUTER reads
  ``[client_id, b"", start]``. It gets back, one message each, every batch still buffered
  with ``seq >= start`` as ``[b"", topic, seq, payload]`` (the delimiter, then the PUB
  frames), then the end marker ``[b"", b"", END_SEQ, b""]`` with ``END_SEQ`` = -1 as 8
  signed big-endian bytes. The buffer holds the last ``buffer_batches`` batches published.
  A malformed request (not three frames, a non-empty delimiter, a start that is not 8
  bytes) is logged and ignored.
- the run: with ``run`` set, every batch carries it under ``hicache_run`` in its first
  event (``format.RUN_KEY``), so a subscriber tells a new run from the first batch it gets.
- kept batches: a batch published with ``keep=True`` (a run's opening: its
  ``AllBlocksCleared`` and the L3 pages its journal announces again) stays in the replay
  buffer for the publisher's life, outside the ``buffer_batches`` that the others share, so
  a subscriber that learns of the run late can still rebuild from sequence 0. Kept batches
  come first: once an ordinary batch went out, ``keep`` is refused (``ValueError``).
  ``kept_batches`` says how many there will be at most, so that a whole replay fits in one
  client's pipe.

Endpoints: ``bind`` True or False binds or connects the PUB socket; None follows vLLM (bind
when the endpoint contains ``*`` or ``::`` or starts with ``ipc://`` or ``inproc://``, connect
otherwise). The replay socket always binds. The daemon's publisher (``for_daemon``) binds
``events.endpoint`` unless ``events.bind`` is false.

Who receives what (docs/operations.md "Security"): with ``curve`` (the daemon's CURVE keys), every
socket it binds is a CURVE server in ZAP domain ``hicache.runtime.ipc.ZAP_EVENTS``, served by a
context of its own whose authenticator admits the subscriber keys
(``authorized_subscribers/``) only. Unless ``tenant_content``, a ``BlockStored`` of a
tenant's namespace (its ``extra_keys`` carry a tenant's effective salt,
``hicache.tenants``) goes out with its page hashes and parent hash but no tokens and no
``extra_keys`` (``format.without_content``): neither the tenant's prompt nor its salt leaves
the process. ``endpoint`` / ``replay_endpoint`` hold the address actually bound (``LAST_ENDPOINT``,
so ``tcp://*:0`` reads back as ``tcp://0.0.0.0:PORT``), or the one connected to. Unlike
vLLM, the data-parallel rank does not shift the port: give each rank its own endpoint.

Threads: ``publish`` encodes the batch and sends it on the PUB socket in the caller's thread,
non-blocking, so a batch leaves the moment its round publishes it (a hand-off to a thread
would wait for that thread to be scheduled: milliseconds on a busy host). It never blocks:
the PUB socket queues at most ``send_hwm`` messages per subscriber and drops the rest *for
that subscriber alone*, silently: ZeroMQ tells the sender nothing, so these losses are not
counted anywhere here; the subscriber sees the gap in the sequence numbers and asks the
replay socket for it. A batch that cannot be encoded or sent (for every subscriber) counts
as dropped (``stats``).
The replay socket is served by a thread of its own, which reads the replay buffer under a
lock; the PUB socket is used only by the thread that calls ``publish`` (the process loop).

``close(timeout_s)`` stops taking batches (``publish`` then returns False and counts the
batch as dropped), stops the replay thread within ``timeout_s``, closes the sockets with
linger 0; a second call does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from hicache.kv_events.format import BlockStored, KVEvent, encode_batch, without_content
from hicache.tenants import split_tenant_salt

if TYPE_CHECKING:
    from hicache.config import HicacheConfig
    from hicache.runtime.ipc import CurveKeys

__all__ = ["END_SEQ", "KVEventPublisher", "PublisherStats", "is_bind_endpoint"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay's end marker."""

_SEND_HWM = 100_000  # vLLM's default PUB high-water mark
_REPLAY_POLL_MS = 50  # how long the replay thread waits for a request before looking at close


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6 and ipc/inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True)
class PublisherStats:
    published_batches: int
    published_events: int
    dropped_batches: int
    dropped_events: int
    replay_requests: int
    last_seq: int | None
    """The sequence number of the last batch sent; None before the first."""


class KVEventPublisher:
    """See the module docstring."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer_batches: int = 10_000, data_parallel_rank: int | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None, *, send_hwm: int = _SEND_HWM,
                 run: str | None = None, kept_batches: int = 1, bind: bool | None = None,
                 curve: CurveKeys | None = None, tenant_content: bool = False) -> None:
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be at least 1, got {buffer_batches}")
        self._tenant_content = tenant_content
        self._own_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        if curve is not None:
            from hicache.runtime.ipc import open_context

            ctx = self._own_ctx = open_context(keys=curve)
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self.run = run
        """The run every batch names (``format.RUN_KEY``); None: no run key (vLLM's bytes)."""
        self._kept: list[tuple[int, bytes]] = []  # the run's opening batches (``keep``), for good
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0

        self._lock = threading.Lock()  # the buffer and the counters below
        self._published_batches = 0
        self._published_events = 0
        self._dropped_batches = 0
        self._dropped_events = 0
        self._replay_requests = 0
        self._last_seq: int | None = None

        self._closing = threading.Event()
        self._closed = False

        ctx = ctx if ctx is not None else zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(send_hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if bind if bind is not None else is_bind_endpoint(endpoint):
                self._curve_server(self._pub, curve)
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # a whole replay must fit in one client's pipe, or the ROUTER drops its tail
                self._replay.setsockopt(zmq.SNDHWM, buffer_batches + kept_batches + 16)
                self._curve_server(self._replay, curve)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            if self._own_ctx is not None:
                self._own_ctx.destroy(linger=0)
            raise
        self._thread: threading.Thread | None = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replays, name="kv-event-replay", daemon=True)
            self._thread.start()

    @classmethod
    def for_daemon(cls, cfg: HicacheConfig, topic: str, *, run: str | None = None,
                   kept_batches: int = 1) -> KVEventPublisher:
        """The daemon's publisher, as ``cfg.events`` says: bound (``bind``), CURVE when the
        daemon has keys (``ipc.curve_keys_dir``) unless ``allow_insecure_tcp``, tenants'
        tokens and salts only with ``tenant_content``; ``run`` and ``kept_batches`` as the
        constructor's."""
        ev = cfg.events
        curve = None
        if cfg.ipc.curve_keys_dir and not ev.allow_insecure_tcp:
            from hicache.runtime.ipc import load_curve_keys

            curve = load_curve_keys(cfg.ipc.curve_keys_dir)
            if not curve.subscribers:
                log.warning("KV events use CURVE but %s/authorized_subscribers admits no key: no one can subscribe "
                            "(`hicache keygen --subscriber NAME`)", cfg.ipc.curve_keys_dir.rstrip("/"))
        return cls(ev.endpoint, ev.replay_endpoint, topic, buffer_batches=ev.replay_batches, run=run,
                   kept_batches=kept_batches, bind=ev.bind, curve=curve, tenant_content=ev.tenant_content)

    @staticmethod
    def _curve_server(sock: zmq.Socket[bytes], curve: CurveKeys | None) -> None:
        if curve is not None:
            from hicache.runtime.ipc import ZAP_EVENTS, curve_server

            curve_server(sock, curve, ZAP_EVENTS)

    def _shown(self, event: KVEvent) -> KVEvent:
        """``event`` as published: a tenant's ``BlockStored`` without its tokens and salt
        unless ``tenant_content`` (the module docstring)."""
        if self._tenant_content or not isinstance(event, BlockStored) or not event.extra_keys:
            return event
        first = event.extra_keys[0]
        salt = first[0] if first else None
        if isinstance(salt, str) and split_tenant_salt(salt) is not None:
            return without_content(event)
        return event

    # -- the caller's side -----------------------------------------------------------------

    def publish(self, events: Sequence[KVEvent], ts: float | None = None, *, keep: bool = False) -> bool:
        """Encode and send one batch (``ts`` defaults to now); never blocks. False, and the
        batch counted as dropped, when it cannot be encoded or sent or the publisher is
        closed. ``keep``: a run's opening batch, kept for replay for good (module doc)."""
        if keep and self._next_seq > len(self._kept):
            raise ValueError("only a run's first batches can be kept for replay")
        if self._closing.is_set():
            self._count_dropped(1, len(events))
            return False
        try:
            payload = encode_batch(time.time() if ts is None else ts, [self._shown(e) for e in events], self._rank,
                                   self.run)
        except Exception:
            log.exception("cannot encode a KV event batch of %d events; dropped", len(events))
            self._count_dropped(1, len(events))
            return False
        seq = self._next_seq
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # only a full pipe: the subscribers behind see the gap and may replay
        except zmq.ZMQError as exc:
            log.warning("cannot send a KV event batch: %s; dropped", exc)
            self._count_dropped(1, len(events))
            return False
        self._next_seq += 1
        with self._lock:
            (self._kept if keep else self._buffer).append((seq, payload))
            self._published_batches += 1
            self._published_events += len(events)
            self._last_seq = seq
        return True

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(self._published_batches, self._published_events, self._dropped_batches,
                                  self._dropped_events, self._replay_requests, self._last_seq)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop taking batches, stop the replay thread (bounded wait), close; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._pub.close(linger=0)
        if self._thread is not None:  # it closes the replay socket as it ends
            self._thread.join(max(0.0, timeout_s))
            if self._thread.is_alive():
                log.warning("KV event replay thread still running %.1fs after close", timeout_s)
        if self._own_ctx is not None and (self._thread is None or not self._thread.is_alive()):
            self._own_ctx.destroy(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the replay thread -----------------------------------------------------------------

    def _serve_replays(self) -> None:
        replay = self._replay
        assert replay is not None
        try:
            while not self._closing.is_set():
                if not replay.poll(_REPLAY_POLL_MS):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    log.warning("ignoring a malformed KV event replay request (%d frames: %s)",
                                len(frames), [len(f) for f in frames])
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    self._replay_requests += 1
                    batches = [(seq, payload) for seq, payload in (*self._kept, *self._buffer)
                               if seq >= start_seq]
                try:
                    for seq, payload in batches:
                        replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                                              flags=zmq.NOBLOCK)
                    replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("KV event replay client's queue is full; reply cut short")
        except Exception:
            log.exception("KV event replay thread failed")
        finally:
            replay.close(linger=0)

    def _count_dropped(self, batches: int, events: int) -> None:
        with self._lock:
            self._dropped_batches += batches
            self._dropped_events += events
