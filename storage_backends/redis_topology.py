"""Which circuit breaker guards each page of a Redis store (docs/architecture.md §7).

``Topology`` holds the store's breaker and, in cluster mode, one breaker per node (made on
first use, each with its own health probe), and routes a batch's keys to them by the node
that owns each key's slot. A node that is lost is skipped (no connection attempts on the
data path) until its probe answers, or finds, asking the cluster for its slot map, that the
node owns no slot any more (a replica promoted in its place after a failover): its slots
then route to their new owner. ``up`` is False while the store, or any node of it, is down.

Lock: one, around the making of node breakers; probes and routing take none.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from storage_backends.errors import StorageConfigError
from storage_backends.locks import ForkSafeLock
from storage_backends.redis_client import STORE_ERRORS, StoreClient
from storage_backends.resilience import CircuitBreaker, ExponentialJitterBackoff
from storage_backends.settings import RedisSettings
from storage_backends.stats import StatsCounter

log = logging.getLogger(__name__)


class Topology:
    def __init__(self, settings: RedisSettings, name: str, client: StoreClient, counters: StatsCounter,
                 key: Callable[[str], bytes]) -> None:
        self.settings = settings
        self.name = name
        self._client = client
        self._counters = counters
        self._key = key
        self._lock = ForkSafeLock()
        self._closed = False
        self._nodes: dict[str, CircuitBreaker] = {}
        self.store = self._breaker(name, self.probe)
        """The store's breaker (every key of a standalone server; unrouted keys in a cluster)."""

    def _breaker(self, name: str, probe: Callable[[], bool]) -> CircuitBreaker:
        res = self.settings.resilience
        return CircuitBreaker(name, res.failure_threshold, probe,
                              ExponentialJitterBackoff(res.probe_base_s, res.probe_cap_s),
                              on_change=self._on_breaker_change)

    @property
    def up(self) -> bool:
        return self.store.up and all(b.up for b in list(self._nodes.values()))

    def node(self, name: str) -> CircuitBreaker:
        """The breaker of cluster node ``name`` (``host:port``), created on first use."""
        breaker = self._nodes.get(name)
        if breaker is None:
            with self._lock:
                breaker = self._nodes.get(name)
                if breaker is None:
                    breaker = self._breaker(f"{self.name}@{name}", functools.partial(self.probe_node, name))
                    if self._closed:
                        breaker.close()
                    self._nodes[name] = breaker
        return breaker

    def route(self, hashes: Sequence[str], lo: int, hi: int) -> list[tuple[CircuitBreaker, list[int]]]:
        """Indices ``lo..hi-1`` grouped by the breaker that guards them: the store's breaker
        for a standalone server, the owning node's in cluster mode. May raise a store error
        (the cluster client could not be built)."""
        if not self.settings.cluster:
            return [(self.store, list(range(lo, hi)))]
        client = self._client.conn()
        nodes = client.nodes_manager
        groups: dict[str, list[int]] = {}
        for i in range(lo, hi):
            try:
                name = nodes.get_node_from_slot(client.keyslot(self._key(hashes[i]))).name
            except STORE_ERRORS:
                name = ""  # slot not covered right now: let the cluster client route it
            groups.setdefault(name, []).append(i)
        return [(self.node(name) if name else self.store, idx) for name, idx in groups.items()]

    def close(self) -> None:
        """Close every breaker (their probes stop); a node breaker made later starts closed."""
        self._closed = True
        self.store.close()
        with self._lock:
            nodes = list(self._nodes.values())
        for breaker in nodes:
            breaker.close()

    def probe(self) -> bool:
        """``PING`` (every primary in cluster mode); never raises."""
        try:
            return bool(self._client.conn().ping())
        except STORE_ERRORS as exc:
            log.debug("%s: probe failed: %r", self.name, exc)
            return False
        except StorageConfigError:
            return False

    def probe_node(self, name: str) -> bool:
        """``PING`` cluster node ``name``. When it does not answer, ask the cluster where its
        slots are now (``CLUSTER SLOTS`` through any node): True also once it owns none (a
        replica was promoted in its place, its slots moved, it left). Never raises."""
        try:
            client = self._client.conn()
        except (*STORE_ERRORS, StorageConfigError):
            return False
        try:
            node = client.get_node(node_name=name)
            if node is None or client.get_redis_connection(node).ping():
                return True
        except STORE_ERRORS as exc:
            log.debug("%s: probe of node %s failed: %r", self.name, name, exc)
        try:
            client.nodes_manager.initialize()
            return name not in {n.name for n in client.get_primaries()}
        except STORE_ERRORS as exc:
            log.debug("%s: cannot refresh the cluster's slots: %r", self.name, exc)
            return False

    def _on_breaker_change(self, up: bool) -> None:
        if not up:
            self._counters.add(trips=1)
