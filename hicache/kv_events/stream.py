"""A process's KV event stream (docs/architecture.md §14): a ``TierEventTracker`` on the tree
the process owns and a ``KVEventPublisher``. The process loop calls ``flush`` a few times a
round (after its inbox, before a model call, at the end), each publishing the changes since
the last as one batch (none when nothing changed).

Publishing never waits: the batch is encoded and sent non-blocking on the PUB socket, which
drops for a subscriber that fell behind (it sees the sequence gap and replays). Who owns
what: the stream owns the tracker (installed on the tree by the constructor, taken off by
``close``) and the publisher (its replay thread and sockets, closed by ``close``); the tree
stays the process's.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Collection
from pathlib import Path

import zmq

from hicache.config import HicacheConfig
from hicache.kv_events.publisher import KVEventPublisher, PublisherStats
from hicache.kv_events.tracker import TierEventTracker, plain_salt
from hicache.tree import Tier, UnifiedRadixCache

log = logging.getLogger("hicache.kv_events")


def model_name(cfg: HicacheConfig) -> str:
    """The name the topic carries: the first served model name, else the checkpoint's
    directory name, else the reference model's preset."""
    if cfg.server.served_model_names:
        return cfg.server.served_model_names[0]
    path = cfg.engine.model if cfg.engine.kind == "vllm" else cfg.model.path
    if path:
        return Path(path).name
    return f"hicache-reference-{cfg.model.reference.preset}"


def default_topic(cfg: HicacheConfig) -> str:
    """``kv@<pod>@<model>``, the shape llm-d's KV-event subscribers expect (the pod is this
    host's name)."""
    return f"kv@{socket.gethostname()}@{model_name(cfg)}"


class KVEventStream:
    """The events of ``cache``'s tiers ``tiers``, published by the process loop's ``flush``."""

    def __init__(self, cfg: HicacheConfig, cache: UnifiedRadixCache, *, tiers: Collection[Tier],
                 split_salt: Callable[[str], tuple[str | None, str]] = plain_salt) -> None:
        ev = cfg.events
        self.topic = ev.topic if ev.topic is not None else default_topic(cfg)
        try:
            self.publisher = KVEventPublisher(ev.endpoint, ev.replay_endpoint, self.topic,
                                              buffer_batches=ev.replay_batches)
        except zmq.ZMQError as exc:
            raise RuntimeError(f"events: cannot open {ev.endpoint} (replay {ev.replay_endpoint}): {exc}") from exc
        self.tracker = TierEventTracker(cache, tiers=tiers, split_salt=split_salt)
        log.info("KV events: publishing on %s (replay %s), topic %r", self.publisher.endpoint,
                 self.publisher.replay_endpoint or "off", self.topic)

    @classmethod
    def open(cls, cfg: HicacheConfig, cache: UnifiedRadixCache, *, tiers: Collection[Tier],
             split_salt: Callable[[str], tuple[str | None, str]] = plain_salt) -> KVEventStream | None:
        """The stream when ``events.enabled``, else None."""
        if not cfg.events.enabled:
            return None
        return cls(cfg, cache, tiers=tiers, split_salt=split_salt)

    def flush(self) -> float | None:
        """Publish the events since the last flush as one batch (never blocks). Returns the
        seconds from the oldest change in it to its send, None when none was sent."""
        if not self.tracker.pending():
            return None
        ts = self.tracker.first_change_at
        if not self.publisher.publish(self.tracker.take(), ts=ts):
            return None
        return time.time() - ts

    def stats(self) -> PublisherStats:
        return self.publisher.stats()

    def close(self) -> None:
        """Publish what is left, stop the publisher (bounded wait), take the tracker off the tree."""
        self.flush()
        self.tracker.close()
        self.publisher.close()
