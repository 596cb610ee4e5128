"""What a Redis server removes on its own: evicted (``maxmemory``) and expired (``ttl_s``)
page keys, for ``RedisBackend.take_evicted`` (docs/architecture.md §14).

Redis publishes each key it evicts on ``__keyevent@<db>__:evicted`` and each key that
expires on ``__keyevent@<db>__:expired`` when the server's ``notify-keyspace-events`` holds
``E`` and ``e`` / ``x`` (or ``A``). The listener reads that setting once, never changes it
(a shared or managed server is not ours to configure), and subscribes to what it enables; a
server without them, or one that refuses ``CONFIG GET``, is logged once and not followed.

Delivery is at most once, as Redis' pub/sub is: a key removed while the listener is
disconnected is not told. Standalone Redis only (in a cluster each node publishes its own
keys; not followed).

Threads: one daemon thread per listener reads the subscription and queues the page hashes
of keys with this store's prefix (at most ``max_kept``; older ones are dropped untold);
``take`` and ``close`` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from storage_backends.keys import is_page_hash
from storage_backends.locks import ForkSafeLock

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""Wait before subscribing again after the connection was lost."""


def wanted_channels(flags: str, db: int) -> list[str]:
    """The key-event channels ``notify-keyspace-events`` = ``flags`` publishes that tell a
    page key's removal by the server."""
    if "E" not in flags:
        return []
    out = []
    if "e" in flags or "A" in flags:
        out.append(f"__keyevent@{db}__:evicted")
    if "x" in flags or "A" in flags:
        out.append(f"__keyevent@{db}__:expired")
    return out


class KeyEventListener:
    """Follows a server's evicted / expired key events (see the module docstring).

    ``make_client``: a new redis-py client of the store (the listener owns and closes it).
    ``prefix``: the store's key prefix with its ``:``. ``start`` returns False, and the
    listener stays idle, when the server publishes neither event."""

    def __init__(self, make_client: Callable[[], Any], prefix: bytes, name: str, max_kept: int = 100_000) -> None:
        self._make_client = make_client
        self._prefix = prefix
        self._name = name
        self._lock = ForkSafeLock()
        self._hashes: deque[str] = deque(maxlen=max_kept)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.channels: list[str] = []

    def start(self) -> bool:
        try:
            self._client = self._make_client()
            db = int(self._client.connection_pool.connection_kwargs.get("db", 0))
            flags = str(self._client.config_get("notify-keyspace-events").get("notify-keyspace-events", ""))
        except (RedisError, OSError) as exc:
            log.info("%s: cannot read notify-keyspace-events (%s); evictions and expiries are not announced",
                     self._name, exc)
            self.close()
            return False
        self.channels = wanted_channels(flags, db)
        if not self.channels:
            log.info("%s: the server's notify-keyspace-events (%r) publishes no evicted or expired key events "
                     "(Ee / Ex); evictions and expiries are not announced", self._name, flags)
            self.close()
            return False
        self._thread = threading.Thread(target=self._run, name="l3-redis-keyevents", daemon=True)
        self._thread.start()
        return True

    def take(self) -> list[str]:
        """The page hashes told since the last call, oldest first."""
        with self._lock:
            out = list(self._hashes)
            self._hashes.clear()
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._client is not None:
            try:
                self._client.close()
            except (RedisError, OSError):
                pass
            self._client = None

    def _run(self) -> None:
        pubsub: Any = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(*self.channels)
                msg = pubsub.get_message(timeout=0.5)
                if msg is not None and msg.get("type") == "message":
                    self._note(msg.get("data"))
            except (RedisError, OSError, ValueError) as exc:
                log.debug("%s: key event subscription lost (%s); subscribing again", self._name, exc)
                _close_quietly(pubsub)
                pubsub = None
                self._stop.wait(RETRY_S)
        _close_quietly(pubsub)

    def _note(self, key: object) -> None:
        if not isinstance(key, bytes) or not key.startswith(self._prefix):
            return
        h = key[len(self._prefix):].decode("ascii", "replace")
        if is_page_hash(h):
            with self._lock:
                self._hashes.append(h)


def _close_quietly(pubsub: Any) -> None:
    if pubsub is not None:
        try:
            pubsub.close()
        except (RedisError, OSError):
            pass
