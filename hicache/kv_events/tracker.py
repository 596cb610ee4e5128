"""What the tree's tiers hold, as KV events (docs/architecture.md §14).

``TierEventTracker`` is the tree's ``ContentObserver`` (``hicache.tree.content``): each
change of the Full pages a tier holds becomes one event, kept until the process loop takes
the round's events (``take``) and publishes them as one batch.

| tree call                           | event                                                         |
|-------------------------------------|---------------------------------------------------------------|
| ``pages_added(node, tier)``         | ``BlockStored``: the node's page hashes, the hash of the page |
|                                     | before it (None under a root), its tokens, the page size, the |
|                                     | medium of the tier, ``extra_keys`` ``(cache_salt,)`` per page |
|                                     | when the request had a salt                                   |
| ``pages_dropped(node, tier)``       | ``BlockRemoved``: the node's page hashes, the medium          |
| ``pages_gone(hashes, tier)``        | ``BlockRemoved`` of those hashes (not a tree call: the L3     |
|                                     | store's own evictions, through the process loop)              |
| ``storage_replaced()``              | ``BlockRemoved`` (``STORAGE``) of every page announced in L3  |
|                                     | (not a tree call: the store was detached, cleared or replaced,|
|                                     | or its controller died)                                       |

L3 is announced by difference (the tree does not keep L3 residency, and a backup of pages
the store already holds is acknowledged like a write): the tracker keeps the set of pages it
announced as in L3 (``in_storage``, about 100 bytes a page), and a backup's ``BlockStored``
names only the pages not in it (a run of them per event, each chained to the page before
it), a ``BlockRemoved`` only the pages in it. ``restored`` adds the pages a restart
announces from the journal. So a subscriber never sees a page stored twice without a removal
between, and its ``STORAGE`` set is this set exactly.

Mediums: L1 ``GPU`` (vLLM's name for the engine's own KV blocks, whatever the device), L2
``CPU``, L3 ``STORAGE``. The hashes are hicache's page hashes (docs/architecture.md §6: the
32-byte SHA-256 chain over the namespace and the tokens), not vLLM's block hashes; the tokens
and the parent hash in each ``BlockStored`` let a subscriber index by its own hash. A tracker
built with ``tiers`` leaves the other tiers' changes out. Not thread-safe: it runs inside the
tree's calls, on the loop that owns the tree, and never raises into them.

A batch's ``ts`` is the wall-clock time of its oldest event (``first_change_at``), so a
subscriber's receive time minus ``ts`` is the whole lag from a tier's change to its index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from hicache.hashing import HASH_BYTES
from hicache.kv_events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium
from hicache.tree import UnifiedRadixCache
from hicache.tree.content import Tier
from hicache.tree.node import TreeNode

log = logging.getLogger("hicache.kv_events")

MEDIUM_OF_TIER = {Tier.DEVICE: Medium.GPU, Tier.HOST: Medium.CPU, Tier.STORAGE: Medium.STORAGE}


def plain_salt(tree_salt: str) -> tuple[str | None, str]:
    """(no namespace, the request's ``cache_salt``): the tree keys by the salt unchanged
    (standalone mode)."""
    return None, tree_salt


class TierEventTracker:
    """Turns ``cache``'s tier changes into KV events (see the module docstring).

    Installing it (the constructor) makes it ``cache.core.observer``; ``close`` takes it off.
    ``split_salt`` maps the salt a tree root is keyed by to (namespace, the request's
    ``cache_salt``): engine mode prefixes the salt with the engines' namespace, which goes in
    ``BlockStored.namespace``. The first event is
    ``AllBlocksCleared``: a new run of the daemon holds nothing of what an earlier run said.
    """

    def __init__(self, cache: UnifiedRadixCache, *, tiers: Collection[Tier] = tuple(Tier),
                 split_salt: Callable[[str], tuple[str | None, str]] = plain_salt) -> None:
        if cache.core.observer is not None:
            raise RuntimeError("the tree already has a content observer")
        self._cache = cache
        self._tiers = frozenset(tiers)
        self._split_salt = split_salt
        self.failed = False
        """An event could not be made; no more are (see ``_fail``)."""
        self._events: list[KVEvent] = [AllBlocksCleared()]
        self.in_storage: set[bytes] = set()
        """The pages announced as held in L3 and not removed since (module doc)."""
        self.first_change_at = time.time()
        """Wall-clock time of the oldest event not yet taken (the batch's ``ts``)."""
        cache.core.observer = self

    def close(self) -> None:
        if self._cache.core.observer is self:
            self._cache.core.observer = None

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first (the caller owns the list)."""
        events, self._events = self._events, []
        return events

    def pending(self) -> int:
        return len(self._events)

    # -- ContentObserver -------------------------------------------------------------

    def pages_added(self, node: TreeNode, tier: Tier) -> None:
        if tier not in self._tiers or self.failed:
            return
        try:
            self._stored(node, tier)
        except Exception:
            self._fail()

    def pages_dropped(self, node: TreeNode, tier: Tier) -> None:
        if tier not in self._tiers or self.failed:
            return
        try:
            self._removed(self._cache.hashes.node_hashes(node), tier)
        except Exception:
            self._fail()

    def pages_gone(self, hashes: list[str], tier: Tier) -> None:
        """Pages ``tier`` lost without the tree's knowledge (the L3 store's own eviction):
        ``BlockRemoved`` of those announced there (an auxiliary object's key, or a page never
        announced, is left out)."""
        if tier not in self._tiers or self.failed or not hashes:
            return
        try:
            self._removed(hashes, tier)
        except Exception:
            self._fail()

    def storage_replaced(self) -> None:
        """L3 no longer holds what was announced (its store was detached, cleared, replaced,
        or the controller that reported its evictions died): ``BlockRemoved`` of it all."""
        if Tier.STORAGE not in self._tiers or self.failed or not self.in_storage:
            return
        gone, self.in_storage = sorted(self.in_storage), set()
        self._add(BlockRemoved(block_hashes=gone, medium=Medium.STORAGE.value))

    def restored(self, events: Collection[KVEvent]) -> None:
        """``events`` (``BlockStored`` of L3, a restart's journal) were published as they are:
        their pages are announced in L3 from now on."""
        for e in events:
            if isinstance(e, BlockStored) and e.medium == Medium.STORAGE.value:
                self.in_storage.update(e.block_hashes)

    def _fail(self) -> None:
        """An event could not be made (a bug): the stream can no longer say exactly what the
        tiers hold, so it says they hold nothing it knows of (``AllBlocksCleared``) and stops.
        The tree's own call goes on unharmed."""
        log.exception("KV events: cannot describe a tier change; the event stream stops (AllBlocksCleared)")
        self.failed = True
        self._add(AllBlocksCleared())

    def _removed(self, hashes: list[str], tier: Tier) -> None:
        pages = [bytes.fromhex(h) for h in hashes]
        if tier is Tier.STORAGE:
            pages = [h for h in dict.fromkeys(pages) if h in self.in_storage]
            self.in_storage.difference_update(pages)
            if not pages:
                return
        self._add(BlockRemoved(block_hashes=pages, medium=MEDIUM_OF_TIER[tier].value))

    def _stored(self, node: TreeNode, tier: Tier) -> None:
        d = self._cache.hashes.node_digests(node)
        hashes = [d[i:i + HASH_BYTES] for i in range(0, len(d), HASH_BYTES)]
        parent = node.parent
        parent_digest = parent.hash_value[-HASH_BYTES:] if parent is not None and parent.parent is not None \
            and parent.hash_value else None
        namespace, salt = self._split_salt(self._cache.salt_of(node))
        tokens = list(node.key)
        ps = self._cache.page_size
        for start, end in self._new_runs(hashes, tier):
            parent_hash = hashes[start - 1] if start else parent_digest
            self._add(BlockStored(
                block_hashes=hashes[start:end],
                parent_block_hash=parent_hash,
                token_ids=tokens[start * ps:end * ps],
                block_size=ps,
                medium=MEDIUM_OF_TIER[tier].value,
                extra_keys=[(salt,)] * (end - start) if salt else None,
                namespace=namespace,
            ))

    def _new_runs(self, hashes: list[bytes], tier: Tier) -> list[tuple[int, int]]:
        """The ``[start, end)`` runs of ``hashes`` to announce: all of them, but in L3 only the
        pages not announced there yet (which become announced)."""
        if tier is not Tier.STORAGE:
            return [(0, len(hashes))]
        runs: list[tuple[int, int]] = []
        for i, h in enumerate(hashes):
            if h in self.in_storage:
                continue
            self.in_storage.add(h)
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return runs

    def _add(self, event: KVEvent) -> None:
        if not self._events:
            self.first_change_at = time.time()
        self._events.append(event)
