"""The L3 journal: what a restarted daemon announces of L3 is exactly what a real file store
still holds of what was announced, whole chains only, and nothing a crash or a dead store
does makes it announce a page L3 does not hold or lose one it does."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.config import config_from_dict
from hicache.kv_events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from hicache.kv_events.journal import StorageJournal
from hicache.kv_events.stream import _surviving_l3_pages
from storage_backends import FileSettings
from storage_backends.file_backend import FileBackend
from storage_backends.page_format import PageLayout

PS = 4
LAYOUT = PageLayout(1, "uint8", (64,))
Page = tuple[bytes | None, tuple[int, ...], object, str | None]
"""parent hash, tokens, extra key, namespace"""


def _h(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def _stored(hashes: list[bytes], parent: bytes | None, rng: random.Random, *, medium: str = "STORAGE",
            salt: str | None = None, namespace: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=[rng.randrange(1000) for _ in range(PS * len(hashes))], block_size=PS,
                       medium=medium, extra_keys=[(salt,)] * len(hashes) if salt else None, namespace=namespace)


def _pages(events: list[KVEvent]) -> dict[bytes, Page]:
    """hash -> what a subscriber learns of the page, from BlockStored events."""
    out: dict[bytes, Page] = {}
    for e in events:
        assert isinstance(e, BlockStored) and e.medium == "STORAGE"
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out[h] = (parent, tuple(e.token_ids[i * PS:(i + 1) * PS]),
                      e.extra_keys[i] if e.extra_keys else None, e.namespace)
            parent = h
    return out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileBackend]:
    backend = FileBackend(FileSettings(dir=str(tmp_path / "l3"), max_size_gb=1.0), LAYOUT)
    yield backend
    backend.close()


def _put(store: FileBackend, hashes: list[bytes]) -> None:
    assert all(store.batch_set([h.hex() for h in hashes], [bytes(64)] * len(hashes)))


def test_a_replay_announces_what_the_store_holds_whole_chains_only(tmp_path: Path, store: FileBackend) -> None:
    rng = random.Random(1)
    a = [_h(rng) for _ in range(3)]            # one sequence: a0 a1 a2, then b0 b1 on a2
    b = [_h(rng) for _ in range(2)]
    c = [_h(rng) for _ in range(2)]            # another, salted, in a namespace
    d = [_h(rng)]                              # stored, then removed
    events: list[KVEvent] = [
        AllBlocksCleared(),
        _stored(a, None, rng),
        _stored([_h(rng)], None, rng, medium="CPU"),   # L2: not L3's business
        _stored(b, a[-1], rng),
        _stored(c, None, rng, salt="tenant-7", namespace="ns1"),
        _stored(d, c[-1], rng, salt="tenant-7", namespace="ns1"),
        BlockRemoved(block_hashes=d, medium="STORAGE"),
        BlockRemoved(block_hashes=[a[0]], medium="CPU"),  # leaves L3's a0 alone
    ]
    journal = StorageJournal(tmp_path / "j" / "l3.journal")
    journal.record(events[:3])
    journal.record(events[3:])
    expected = _pages([e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"
                       and e.block_hashes != d])
    _put(store, a + b + c + d)

    replayed = StorageJournal(journal.path).replay(store.exists_each)
    assert _pages(list(replayed)) == expected
    assert [len(e.block_hashes) for e in replayed] == [5, 2]  # a+b is one chain, c another

    # a page gone from the store takes the pages after it in its chain with it
    store.delete([a[1].hex()])
    replayed = StorageJournal(journal.path).replay(store.exists_each)
    assert _pages(list(replayed)) == {h: p for h, p in expected.items() if h in {a[0], *c}}
    # and the journal was rewritten to what was announced: the next start says the same
    _put(store, [a[1]])  # (a page that comes back without its journal entry is not claimed)
    assert _pages(list(StorageJournal(journal.path).replay(store.exists_each))) == _pages(list(replayed))


def test_parents_come_first_whatever_order_the_backups_were_acknowledged_in(tmp_path: Path,
                                                                             store: FileBackend) -> None:
    rng = random.Random(2)
    parent, child, grandchild = [_h(rng)], [_h(rng)], [_h(rng)]
    journal = StorageJournal(tmp_path / "l3.journal")
    journal.record([_stored(grandchild, child[0], rng)])
    journal.record([_stored(child, parent[0], rng)])
    journal.record([_stored(parent, None, rng)])
    _put(store, parent + child + grandchild)
    replayed = journal.replay(store.exists_each)
    order = [h for e in replayed for h in e.block_hashes]
    assert order == parent + child + grandchild
    assert replayed[0].parent_block_hash is None


def test_a_record_cut_short_by_a_crash_loses_only_itself(tmp_path: Path, store: FileBackend) -> None:
    rng = random.Random(3)
    first, second = [_h(rng), _h(rng)], [_h(rng)]
    journal = StorageJournal(tmp_path / "l3.journal")
    journal.record([_stored(first, None, rng)])
    size = journal.path.stat().st_size
    journal.record([_stored(second, first[-1], rng)])
    with open(journal.path, "r+b") as f:
        f.truncate(size + (journal.path.stat().st_size - size) // 2)
    _put(store, first + second)
    assert [h for e in journal.replay(store.exists_each) for h in e.block_hashes] == first


def test_a_store_that_does_not_answer_announces_nothing_and_keeps_the_journal(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config_from_dict({"cache": {"l3": {"backend": "redis", "redis": {"url": f"redis://127.0.0.1:{port}",
                                                                          "timeout_s": 0.2}}},
                            "events": {"enabled": True, "journal": str(tmp_path / "l3.journal")}})
    rng = random.Random(4)
    journal = StorageJournal(tmp_path / "l3.journal")
    journal.record([_stored([_h(rng), _h(rng)], None, rng)])
    before = journal.path.read_bytes()
    assert _surviving_l3_pages(cfg, journal) == []
    assert journal.path.read_bytes() == before  # its pages may well be there: the next start asks again


def test_the_stream_asks_the_configured_store(tmp_path: Path, store: FileBackend) -> None:
    rng = random.Random(5)
    held, gone = [_h(rng), _h(rng)], [_h(rng)]
    journal = StorageJournal(tmp_path / "l3.journal")
    journal.record([_stored(held, None, rng), _stored(gone, None, rng)])
    _put(store, held)
    cfg = config_from_dict({"cache": {"l3": {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}},
                            "events": {"enabled": True, "journal": str(journal.path)}})
    assert [h for e in _surviving_l3_pages(cfg, journal) for h in e.block_hashes] == held


def test_a_replaced_store_is_removed_in_the_stream_and_in_the_journal(tmp_path: Path, store: FileBackend) -> None:
    """A stream that starts from a journal announces (kept for replay) and counts as in L3
    what the store still holds; after ``storage_replaced`` it removes them all, once, and the
    journal says so: the next start announces none of them though the store still has them
    (the stream cannot know what the store attached next holds)."""
    from hicache.kv_events.stream import KVEventStream
    from hicache.memory.allocator import PageAllocator
    from hicache.tree import FullComponent, Tier, UnifiedRadixCache

    rng = random.Random(8)
    held = [_h(rng), _h(rng)]
    journal = tmp_path / "l3.journal"
    StorageJournal(journal).record([_stored(held, None, rng)])
    _put(store, held)
    cfg = config_from_dict({"cache": {"l3": {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}},
                            "events": {"enabled": True, "endpoint": f"ipc://{tmp_path}/ev.sock",
                                       "replay_endpoint": f"ipc://{tmp_path}/replay.sock", "journal": str(journal)}})

    def stream() -> KVEventStream:
        cache = UnifiedRadixCache([FullComponent(PageAllocator(8, "l1"), PageAllocator(8, "l2"))], PS)
        return KVEventStream(cfg, cache, tiers=tuple(Tier))

    first = stream()
    try:
        assert first.tracker.in_storage == set(held) and first.stats().published_batches == 1
        first.storage_replaced()
        first.storage_replaced()  # nothing is announced any more: nothing to remove
        assert first.flush() is not None and first.flush() is None
        assert first.stats().published_batches == 2
    finally:
        first.close()
    second = stream()
    try:
        assert second.tracker.in_storage == set() and second.run != first.run
    finally:
        second.close()


def test_a_journal_that_cannot_be_written_turns_itself_off(tmp_path: Path) -> None:
    rng = random.Random(6)
    folder = tmp_path / "gone"
    journal = StorageJournal(folder / "l3.journal")
    journal.record([_stored([_h(rng)], None, rng)])
    assert journal.records == 1
    os.remove(journal.path)
    folder.rmdir()
    journal.record([_stored([_h(rng)], None, rng)])  # never raises
    assert not journal.enabled and journal.records == 1
    journal.record([_stored([_h(rng)], None, rng)])
    assert not folder.exists()
