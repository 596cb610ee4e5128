"""A process's KV event stream (docs/architecture.md §14): a ``TierEventTracker`` on the tree
the process owns and a ``KVEventPublisher``. The process loop calls ``flush`` a few times a
round (after its inbox, before a model call, at the end), each publishing the changes since
the last as one batch (none when nothing changed).

A run: each start of the stream is a new run, named by a random id that every batch carries
(``hicache_run``, ``hicache.kv_events.format``). Its opening (``AllBlocksCleared``, and the
journal's L3 pages) stays in the replay buffer for the run's life, so a subscriber that sees
a new run, whenever it does, replays it from sequence 0.

With ``events.journal`` the stream also keeps the L3 journal (``hicache.kv_events.journal``):
at start it asks the configured L3 which journaled pages survive and publishes them right
after the run's ``AllBlocksCleared``; each flush appends the batch's L3 events to it, the
removals of ``storage_replaced`` included.

Publishing never waits: the batch is encoded and sent non-blocking on the PUB socket, which
drops for a subscriber that fell behind (it sees the sequence gap and replays). Who owns
what: the stream owns the tracker (installed on the tree by the constructor, taken off by
``close``) and the publisher (its replay thread and sockets, closed by ``close``); the tree
stays the process's.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

import zmq

from hicache.config import HicacheConfig
from hicache.kv_events.format import BlockStored, KVEvent
from hicache.kv_events.journal import StorageJournal
from hicache.kv_events.publisher import KVEventPublisher, PublisherStats
from hicache.kv_events.tracker import TierEventTracker, plain_salt
from hicache.tree import Tier, UnifiedRadixCache

log = logging.getLogger("hicache.kv_events")

MAX_BATCH_EVENTS = 1024
"""Events per published batch at most (a restart's L3 announcement can be many)."""


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
    """The events of ``cache``'s tiers ``tiers``, published by the process loop's ``flush``.

    The constructor publishes the run's opening, kept for replay for the run's life
    (``KVEventPublisher`` ``keep``): ``AllBlocksCleared``, then, with a journal, the L3 pages
    the store still holds. Every batch names the run (``run``, a new random id per start)."""

    def __init__(self, cfg: HicacheConfig, cache: UnifiedRadixCache, *, tiers: Collection[Tier],
                 split_salt: Callable[[str], tuple[str | None, str]] = plain_salt) -> None:
        ev = cfg.events
        self.topic = ev.topic if ev.topic is not None else default_topic(cfg)
        self.run = uuid.uuid4().hex[:16]
        self.journal: StorageJournal | None = None
        restored: list[BlockStored] = []
        if ev.journal is not None and Tier.STORAGE in tiers:
            try:
                self.journal = StorageJournal(ev.journal)
            except OSError as exc:
                raise RuntimeError(f"events.journal: cannot use {ev.journal}: {exc}") from exc
            restored = _surviving_l3_pages(cfg, self.journal)
        try:
            self.publisher = KVEventPublisher.for_daemon(cfg, self.topic, run=self.run,
                                                         kept_batches=_batches(1 + len(restored)))
        except zmq.ZMQError as exc:
            raise RuntimeError(f"events: cannot open {ev.endpoint} (replay {ev.replay_endpoint}): {exc}") from exc
        self.tracker = TierEventTracker(cache, tiers=tiers, split_salt=split_salt)
        self.tracker.restored(restored)
        self._publish([*self.tracker.take(), *restored], time.time(), keep=True)  # AllBlocksCleared first
        if self.journal is not None:
            log.info("KV events: announced %d pages L3 still holds of the journal %s",
                     sum(len(e.block_hashes) for e in restored), self.journal.path)
        log.info("KV events: publishing on %s (replay %s), topic %r, run %s", self.publisher.endpoint,
                 self.publisher.replay_endpoint or "off", self.topic, self.run)

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
        events = self.tracker.take()
        if self.journal is not None:
            self.journal.record(events)
        if not self._publish(events, ts):
            return None
        return time.time() - ts

    def storage_evicted(self, hashes: list[str]) -> None:
        """The L3 store evicted these pages on its own: ``BlockRemoved`` (medium ``STORAGE``)
        with the next flush, and in the journal."""
        self.tracker.pages_gone(hashes, Tier.STORAGE)

    def storage_replaced(self) -> None:
        """L3 no longer holds what was announced (the store was detached, cleared or replaced,
        or the controller died): ``BlockRemoved`` of every page announced there, with the
        next flush, and in the journal."""
        self.tracker.storage_replaced()

    def _publish(self, events: list[KVEvent], ts: float, keep: bool = False) -> bool:
        """Publish ``events`` in batches of at most ``MAX_BATCH_EVENTS`` (kept for replay with
        ``keep``); True iff all went."""
        sent = True
        for start in range(0, len(events), MAX_BATCH_EVENTS):
            sent = self.publisher.publish(events[start:start + MAX_BATCH_EVENTS], ts=ts, keep=keep) and sent
        return sent

    def stats(self) -> PublisherStats:
        return self.publisher.stats()

    def close(self) -> None:
        """Publish what is left, stop the publisher (bounded wait), take the tracker off the tree."""
        self.flush()
        self.tracker.close()
        self.publisher.close()


def _batches(events: int) -> int:
    """How many batches ``_publish`` makes of ``events`` events."""
    return -(-events // MAX_BATCH_EVENTS)


def _surviving_l3_pages(cfg: HicacheConfig, journal: StorageJournal) -> list[BlockStored]:
    """The journal's pages that the configured L3 still holds (``StorageJournal.replay``).
    A store that cannot be opened or does not answer announces nothing and leaves the
    journal as it is (its pages may well be there; the next start asks again)."""
    from hicache.storage_settings import storage_settings_from_config
    from storage_backends import FileSettings
    from storage_backends.registry import create_backend

    settings = storage_settings_from_config(cfg.cache.l3)
    if settings is None:
        return []
    if isinstance(settings, FileSettings):  # existence is a stat; the controller keeps the store's index
        settings = dataclasses.replace(settings, scan_on_start=False)
    try:
        backend = create_backend(settings, None)
    except Exception as exc:
        log.error("KV events: cannot open L3 to check the journal (%s); L3 is not announced again", exc)
        return []
    try:
        if not backend.health():
            log.error("KV events: L3 does not answer; its content is not announced again in this run")
            return []
        return journal.replay(backend.exists_each)
    except Exception:
        log.exception("KV events: cannot check the journal against L3; L3 is not announced again")
        return []
    finally:
        backend.close()
