"""The L3 journal (docs/architecture.md §14): what a daemon announced as stored in L3, kept
in a local file, so that a restarted daemon announces again what L3 still holds.

An L3 object holds a page's KV bytes under its hash, not its tokens or the hash before it, so
the store alone cannot say what a ``BlockStored`` needs. The journal keeps those events.

File format: a sequence of records, each a 4-byte big-endian length and an ``encode_batch``
payload (vLLM's batch encoding, ts 0) holding the ``STORAGE`` events of one publish. A record
cut short by a crash ends the file (what it held is not announced after the restart: the
safe direction, since a router that misses a page only costs a miss).

| call                  | what it does                                                          |
|-----------------------|-----------------------------------------------------------------------|
| ``record(events)``    | appends the ``STORAGE`` ``BlockStored`` / ``BlockRemoved`` of a batch |
|                       | (others are left out); an I/O error turns the journal off, logged     |
| ``replay(exists_each)`` | reads the file: the pages stored and not removed since, asks the    |
|                       | store which still exist, keeps a page only when it and every page     |
|                       | before it in its sequence exist (an L3 hit needs the whole chain),    |
|                       | rewrites the file with just those, and returns them as events         |

``replay`` is called once, at start, before ``record``. Not thread-safe: one process loop owns
it. Nothing here raises into the loop after the constructor: trouble is logged, and the
journal stops (the events on the wire go on).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache.kv_events.format import BlockRemoved, BlockStored, KVEvent, Medium, decode_batch, encode_batch

log = logging.getLogger("hicache.kv_events")

_LENGTH = struct.Struct(">I")
EXISTS_CHUNK = 1024
"""Hashes per ``exists_each`` call at replay."""


@dataclass(frozen=True)
class _Page:
    """One L3 page as a ``BlockStored`` described it."""

    parent: bytes | None
    tokens: tuple[int, ...]
    block_size: int
    extra_key: tuple[object, ...] | None
    namespace: str | None
    lora_id: int | None
    lora_name: str | None


def storage_events(events: Sequence[KVEvent]) -> list[KVEvent]:
    """The events of ``events`` about L3 (medium ``STORAGE``)."""
    return [e for e in events
            if isinstance(e, (BlockStored, BlockRemoved)) and e.medium == Medium.STORAGE.value]


class StorageJournal:
    """The L3 journal at ``path`` (see the module docstring). The constructor creates the
    parent folder; it raises ``OSError`` when it cannot."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.enabled = True
        """False once a write failed: nothing more is recorded in this run."""
        self.records = 0
        """Records appended in this run."""

    # -- replay (at start) ---------------------------------------------------------------

    def replay(self, exists_each: Callable[[Sequence[str]], list[bool]]) -> list[BlockStored]:
        """What L3 still holds of what the journal says was stored, as ``BlockStored`` events
        (parents before children); the file is rewritten to hold just these. ``exists_each``
        is the store's (``StorageBackend.exists_each``). When the journal cannot be read it
        is left as it is and nothing is announced."""
        try:
            pages = self._read_pages()
        except OSError as exc:
            log.error("KV events: cannot read the L3 journal %s (%s); L3 is not announced again", self.path, exc)
            return []
        hexes = [h.hex() for h in pages]
        present: set[bytes] = set()
        for start in range(0, len(hexes), EXISTS_CHUNK):
            chunk = hexes[start:start + EXISTS_CHUNK]
            present.update(bytes.fromhex(h) for h, ok in zip(chunk, exists_each(chunk), strict=True) if ok)
        kept = _whole_chains(pages, present)
        events = _regroup(kept, pages)
        self._rewrite(events)
        return events

    def _read_pages(self) -> dict[bytes, _Page]:
        """Hash -> page for every page stored and not removed since, in the order first stored."""
        pages: dict[bytes, _Page] = {}
        for event in self._read_events():
            if isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    pages.pop(h, None)
                continue
            if not isinstance(event, BlockStored):
                continue
            size = event.block_size
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                key = event.extra_keys[i] if event.extra_keys is not None and i < len(event.extra_keys) else None
                pages.setdefault(h, _Page(parent, tuple(event.token_ids[i * size:(i + 1) * size]), size, key,
                                          event.namespace, event.lora_id, event.lora_name))
                parent = h
        return pages

    def _read_events(self) -> Iterator[KVEvent]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        at = 0
        while at + _LENGTH.size <= len(data):
            (n,) = _LENGTH.unpack_from(data, at)
            if at + _LENGTH.size + n > len(data):
                log.warning("KV events: the L3 journal %s ends in a record cut short; it is left out", self.path)
                return
            try:
                batch = decode_batch(data[at + _LENGTH.size:at + _LENGTH.size + n])
            except ValueError as exc:
                log.warning("KV events: the L3 journal %s has a bad record at byte %d (%s); the rest is left out",
                            self.path, at, exc)
                return
            yield from batch.events
            at += _LENGTH.size + n

    def _rewrite(self, events: list[BlockStored]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                if events:
                    f.write(_frame(events))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("KV events: cannot rewrite the L3 journal %s (%s); it grows on", self.path, exc)

    # -- record (each publish) -----------------------------------------------------------

    def record(self, events: Sequence[KVEvent]) -> None:
        """Append ``events``' L3 events (see the module docstring). Never raises."""
        if not self.enabled:
            return
        wanted = storage_events(events)
        if not wanted:
            return
        try:
            with open(self.path, "ab") as f:
                f.write(_frame(wanted))
            self.records += 1
        except Exception as exc:  # a full disk, a removed folder: the events go on without it
            self.enabled = False
            log.error("KV events: cannot append to the L3 journal %s (%s); L3 content of this run will not be "
                      "announced after a restart", self.path, exc)


def _frame(events: Sequence[KVEvent]) -> bytes:
    payload = encode_batch(0.0, events)
    return _LENGTH.pack(len(payload)) + payload


def _whole_chains(pages: dict[bytes, _Page], present: set[bytes]) -> set[bytes]:
    """The pages of ``present`` whose every ancestor in ``pages`` is present too (a page
    whose parent the journal does not know is a chain of its own)."""
    kept: set[bytes] = set()
    dropped: set[bytes] = set()
    for h in pages:
        path: list[bytes] = []
        cur: bytes | None = h
        ok = True
        while cur is not None and cur not in kept:
            if cur in dropped or cur not in present:
                ok = False
                break
            path.append(cur)
            page = pages.get(cur)
            cur = page.parent if page is not None and page.parent in pages else None
        (kept if ok else dropped).update(path)
    return kept


def _parents_first(kept: set[bytes], pages: dict[bytes, _Page]) -> list[bytes]:
    """``kept`` in journal order, except that a page's parent comes before it."""
    order: list[bytes] = []
    placed: set[bytes] = set()
    for h in pages:
        chain: list[bytes] = []
        cur: bytes | None = h
        while cur is not None and cur in kept and cur not in placed:
            chain.append(cur)
            cur = pages[cur].parent
        order.extend(reversed(chain))
        placed.update(chain)
    return order


def _regroup(kept: set[bytes], pages: dict[bytes, _Page]) -> list[BlockStored]:
    """``kept`` as ``BlockStored`` events, parents first, consecutive pages of one sequence
    (same block size, namespace and LoRA) in one event."""
    events: list[BlockStored] = []
    run: list[bytes] = []

    def close_run() -> None:
        if not run:
            return
        first = pages[run[0]]
        keys = [pages[h].extra_key for h in run]
        events.append(BlockStored(
            block_hashes=list(run), parent_block_hash=first.parent,
            token_ids=[t for h in run for t in pages[h].tokens], block_size=first.block_size,
            medium=Medium.STORAGE.value, extra_keys=keys if any(k is not None for k in keys) else None,
            lora_id=first.lora_id, lora_name=first.lora_name, namespace=first.namespace))
        run.clear()

    for h in _parents_first(kept, pages):
        page = pages[h]
        if run:
            last = pages[run[-1]]
            if not (page.parent == run[-1] and (page.block_size, page.namespace, page.lora_id, page.lora_name)
                    == (last.block_size, last.namespace, last.lora_id, last.lora_name)):
                close_run()
        run.append(h)
    close_run()
    return events
