"""Keep Python's cyclic garbage collector off the long-lived heap (the radix tree).

With millions of tree objects, a full (generation 2) collection walks them all: close to a
second at a million pages, a pause of the whole loop. ``GcGuard`` moves what survives into
the collector's permanent generation (``gc.freeze``): a collection then walks only what was
made since, and a settle costs what was allocated since the last one, whatever the tree's size.

| call           | what it does                                                              |
|----------------|---------------------------------------------------------------------------|
| ``GcGuard()``  | ``gc.collect()`` then ``gc.freeze()``: the process's startup heap frozen   |
| ``settle(now)``| every ``interval_s`` at most: collect what is not frozen (garbage cycles   |
|                | made since the last settle are freed here), then freeze the survivors;     |
|                | every ``refresh_s``: unfreeze first, so the collection is a full one       |
| ``close()``    | ``gc.unfreeze()``: everything is the collector's again                     |

Frozen objects are still freed by reference counting when their last reference goes; only a
*cycle* that becomes garbage after it was frozen is kept until ``close``. The tree makes no
such cycle: a node it removes is unlinked from its parent, and its LRU links drop their
reference to it (``TreeCore.detach``), so removed nodes go by reference counting alone. Other
long-lived objects (a request that ran for seconds, an exception's traceback) may: the full
collection every ``refresh_s`` frees those, so what a cycle can hold is bounded by what became
garbage in that time, at the cost of one whole-heap walk (tens of ms at a million pages).
"""

from __future__ import annotations

import gc
import time

SETTLE_INTERVAL_S = 1.0
"""How often a loop settles at most: a settle walks what was allocated since the last one."""
REFRESH_S = 600.0
"""How often a settle is a full collection of the whole heap (frozen cycles freed)."""


class GcGuard:
    """Freezes the heap that survives, at most every ``interval_s`` (see the module doc)."""

    def __init__(self, interval_s: float = SETTLE_INTERVAL_S, refresh_s: float = REFRESH_S) -> None:
        self.interval_s = interval_s
        self.refresh_s = refresh_s
        self.settles = 0
        self.refreshes = 0
        self._last = float("-inf")
        self._last_refresh = time.monotonic()
        self.settle(time.monotonic())

    def settle(self, now: float | None = None) -> bool:
        """Collect what is not frozen and freeze the rest, if ``interval_s`` has passed since
        the last settle (always when ``now`` is None). Returns whether it settled."""
        if now is not None:
            if now - self._last < self.interval_s:
                return False
            self._last = now
            if now - self._last_refresh >= self.refresh_s:
                self._last_refresh = now
                self.refreshes += 1
                gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.settles += 1
        return True

    def close(self) -> None:
        """Give every frozen object back to the collector."""
        gc.unfreeze()
