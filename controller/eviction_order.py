"""The L3 store's own evictions, told after the backup answers that name their pages
(docs/architecture.md §14).

The controller sends the scheduler, on one ordered socket, the answers of L3 backups (an
answer that a backup is done makes the scheduler's KV events announce its pages as stored in
L3) and the pages the store evicted on its own (``StorageEvicted``: announced as removed).
The events follow that order. A backup runs on a worker thread: it finds a page in the store
(written by it, or there already) and answers later, while the store may evict that page in
between (the same backup's writes make room, or another's do). Told before that answer, the
eviction would read "removed, then stored" for a page the store no longer holds.

``EvictionGate`` orders them. An evicted page that a running backup names is held until that
backup's answer went out; one that a backup answered since the last round names may have been
evicted before that backup wrote it again. Either way the page is checked once more when it
may go: the eviction is told only if the store does not hold it now (one that does was written
again after the eviction, and its backup's answer already said so). Any other eviction goes
at once, as before.

| call (the controller's main loop only) | when                                           |
|----------------------------------------|------------------------------------------------|
| ``backup_started(op_id, hashes)``      | a backup is handed to a worker                 |
| ``backup_answered(op_id)``             | its answer was forwarded to the scheduler      |
| ``release(evicted, holds)``            | each round, with what the store evicted since: |
|                                        | the evictions that may be told now, in order   |

``holds`` (``StorageIO.holds_each``) is asked only about the pages above, which a backup in
flight named: a few, and only when evictions meet backups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence


class EvictionGate:
    """See the module docstring. Not thread-safe: the controller's main loop owns it."""

    def __init__(self) -> None:
        self._running: dict[int, list[str]] = {}  # backup op id -> the page hashes it names
        self._named: Counter[str] = Counter()  # page hash -> running backups naming it
        self._answered: set[str] = set()  # pages named by backups answered since the last release
        self._held: dict[str, None] = {}  # evictions waiting for a backup's answer, oldest first

    def backup_started(self, op_id: int, hashes: Sequence[str]) -> None:
        self._running[op_id] = list(hashes)
        self._named.update(hashes)

    def backup_answered(self, op_id: int) -> None:
        """The answer of ``op_id`` went out (any op id: one that is not a backup is ignored)."""
        hashes = self._running.pop(op_id, None)
        if not hashes:
            return
        self._named.subtract(hashes)
        for h in hashes:
            if self._named[h] <= 0:
                del self._named[h]
        self._answered.update(hashes)

    def release(self, evicted: Sequence[str], holds: Callable[[list[str]], list[bool]]) -> list[str]:
        """The evictions to tell now, of ``evicted`` (just taken from the store) and of those
        held before; ``holds`` says which pages the store holds now."""
        out: list[str] = []
        check: list[str] = []
        for h in evicted:
            if h in self._named:
                self._held[h] = None
            elif h in self._answered:
                check.append(h)
            else:
                out.append(h)
        free = [h for h in self._held if h not in self._named]
        for h in free:
            del self._held[h]
        check.extend(free)
        self._answered.clear()
        if check:
            out.extend(h for h, held in zip(check, holds(check), strict=True) if not held)
        return out

    @property
    def held(self) -> int:
        """Evictions waiting for a backup's answer."""
        return len(self._held)
