"""Counters every backend keeps, and the snapshot ``stats()`` returns.

``StatsCounter`` is thread-safe (one lock, held only to add numbers); the snapshot is an
immutable ``StorageStats`` the metrics layer can read without locking.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from storage_backends.locks import ForkSafeLock


@dataclass(frozen=True)
class StorageStats:
    """A point-in-time copy of a backend's counters.

    ``hits``/``misses`` count pages asked for by ``batch_get``; ``corrupt`` counts objects
    that failed verification (each also a miss, each deleted); ``errors`` counts failed
    store operations (connection, I/O, timeout); ``timeouts`` is the subset that timed
    out; ``dropped_writes`` counts pages ``batch_set`` did not store; ``up`` is the circuit
    breaker's state and ``trips`` how often it opened; ``evictions`` counts pages the
    backend itself removed to respect its cap.
    """

    backend: str
    up: bool
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    dropped_writes: int = 0
    errors: int = 0
    timeouts: int = 0
    corrupt: int = 0
    evictions: int = 0
    trips: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


_FIELDS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "writes",
    "dropped_writes",
    "errors",
    "timeouts",
    "corrupt",
    "evictions",
    "trips",
)


class StatsCounter:
    """Monotonic counters, updated by any thread."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._values = dict.fromkeys(_FIELDS, 0)

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` (field=amount); unknown field names raise ``KeyError``."""
        with self._lock:
            values = self._values
            for name, delta in deltas.items():
                values[name] += delta

    def snapshot(self, backend: str, up: bool) -> StorageStats:
        with self._lock:
            return StorageStats(backend=backend, up=up, **self._values)
