"""The tier layer's registry of in-flight ops, against a controller played by the test.

One op id end to end (the id in the controller message is the id the answer ends), one
table of ops (``ControllerDriver``), and a controller loss that ends every op exactly once and
gives back what each held.
"""

from __future__ import annotations

from array import array

import protos
from hicache.config import PrefetchConfig
from hicache.hashing import HashNamespace
from hicache.memory.allocator import PageAllocator
from hicache.scheduler.controller_driver import BACKUP_RETRY_DELAYS_S, ControllerDriver
from hicache.tree import FullComponent, UnifiedRadixCache


def _key(s: str) -> array:
    return array("I", [ord(ch) for ch in s])


class Rig:
    def __init__(self) -> None:
        self.now = 100.0
        self.dev = PageAllocator(64, "l1")
        self.host = PageAllocator(64, "l2")
        self.cache = UnifiedRadixCache([FullComponent(self.dev, self.host)], 1,
                                       hasher=HashNamespace("test-model", "bf16", 1))
        self.sent: list[protos.ControllerMessage] = []
        self.tier = ControllerDriver(self.cache, self.sent.append, load_back_threshold=1, l3_enabled=True,
                                prefetch=PrefetchConfig(threshold_tokens=1), clock=lambda: self.now)

    def compute(self, s: str) -> None:
        key = _key(s)
        pages = self.dev.alloc(len(key))
        assert pages is not None
        assert self.cache.insert(key, pages).prefix_len == 0

    def take(self, kind: type) -> list:
        out = [m for m in self.sent if isinstance(m, kind)]
        self.sent[:] = [m for m in self.sent if not isinstance(m, kind)]
        return out

    def ok(self, msg: protos.ControllerMessage, pages_done: int = 0):
        return self.tier.on_message(protos.OpDone(msg.op_id, "ok", pages_done))

    def write_and_evict(self, s: str) -> None:
        """``s`` computed, written to L2 (and backed up), then evicted from L1: L2-only."""
        self.compute(s)
        self.tier.issue_writes()
        for w in self.take(protos.WriteToHost):
            assert self.ok(w) is None
        for b in self.take(protos.BackupToStorage):
            assert self.ok(b) is None
        self.cache.evict(full_tokens=len(s))


def test_a_load_is_known_by_the_id_the_controller_sees_and_ends_once() -> None:
    rig = Rig()
    rig.write_and_evict("abcdef")
    m = rig.cache.match_prefix(_key("abcdef"))
    assert m.host_hit_length == 6
    ticket = rig.tier.start_load_back(m, "r1")
    assert ticket is not None and ticket.rid == "r1" and ticket.node is m.last_host_node
    (msg,) = rig.take(protos.LoadToDevice)
    assert msg.op_id == ticket.op_id and ticket.op_id > 0
    assert rig.cache.protected_size() == 6  # the load's new L1 pages: locked until it ends
    assert rig.cache.tiers.open_transfers == 1 and rig.tier.in_flight == 1
    assert rig.ok(msg) is ticket and ticket.ok is True
    assert rig.cache.protected_size() == 0 and rig.cache.tiers.open_transfers == 0
    assert rig.ok(msg) is None  # a second answer for the same id changes nothing
    assert rig.tier.counters.loads == 1
    assert rig.cache.match_prefix(_key("abcdef")).device_len == 6
    rig.cache.check_integrity(exact=True)


def test_every_op_id_is_distinct_across_kinds() -> None:
    rig = Rig()
    rig.compute("abcdef")
    rig.compute("uvwxyz")
    rig.tier.issue_writes()
    rig.tier.start_prefetch("r", _key("0123"), rig.cache.match_prefix(_key("0123")))
    ids = [m.op_id for m in rig.sent]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert rig.tier.in_flight_kinds() == {"write": 2, "query": 1}


def test_controller_loss_ends_every_op_once_and_gives_back_what_each_held() -> None:
    rig = Rig()
    rig.write_and_evict("abcdef")  # L2-only, to be loaded back
    rig.compute("ghijkl")
    rig.compute("uvwxyz")
    rig.tier.issue_writes()
    writes = rig.take(protos.WriteToHost)
    assert len(writes) == 2
    assert rig.ok(writes[0]) is None  # ghijkl in L2: its backup starts and stays in flight
    (backup,) = rig.take(protos.BackupToStorage)
    load = rig.tier.start_load_back(rig.cache.match_prefix(_key("abcdef")), "r1")
    assert load is not None
    fetching = rig.tier.start_prefetch("r2", _key("0123"), rig.cache.match_prefix(_key("0123")))
    querying = rig.tier.start_prefetch("r3", _key("4567"), rig.cache.match_prefix(_key("4567")))
    assert fetching is not None and querying is not None
    rig.tier.on_message(protos.PrefetchHits(fetching.query_op, 4))
    (fetch,) = rig.take(protos.PrefetchFetch)
    assert fetch.op_id == fetching.fetch_op and len(fetching.host_pages) == 4
    late = [writes[1], backup, fetch, *rig.take(protos.LoadToDevice)]
    assert [m.op_id for m in rig.take(protos.PrefetchQuery)] == [fetching.query_op, querying.query_op]
    assert not rig.sent
    assert rig.tier.in_flight_kinds() == {"write": 1, "backup": 1, "load": 1, "fetch": 1, "query": 1}
    assert rig.cache.tiers.open_transfers == 3

    assert rig.tier.on_controller_lost() == 5
    c = rig.tier.counters
    assert (c.writes_failed, c.backups_failed, c.loads_failed) == (1, 1, 1)
    assert load.ok is False and fetching.complete and fetching.arrived_tokens == 0 and querying.complete
    assert rig.tier.in_flight == 0 and rig.cache.tiers.open_transfers == 0
    assert rig.host.used == 12  # abcdef and ghijkl; the failed write's and the fetch's pages freed
    assert rig.dev.used == 12  # ghijkl and uvwxyz; the failed load's pages freed
    rig.cache.check_integrity(exact=True)

    before = vars(c).copy()
    for msg in late:  # answers the dead controller sent: ignored, nothing ended twice
        assert rig.ok(msg, 4) is None
    rig.tier.on_message(protos.PrefetchHits(querying.query_op, 4))
    assert vars(c) == before and not rig.sent
    rig.cache.check_integrity(exact=True)
    m = rig.cache.match_prefix(_key("abcdef"))
    assert m.device_len == 0 and m.host_hit_length == 6  # L2-only again: it can load later


def _fail(rig: Rig, msg: protos.ControllerMessage) -> None:
    assert rig.tier.on_message(protos.OpDone(msg.op_id, "failed", 0, error="store timed out")) is None


def _written(rig: Rig, s: str) -> protos.BackupToStorage:
    """``s`` computed and written to L2: its backup, sent and not answered."""
    rig.compute(s)
    rig.tier.issue_writes()
    for w in rig.take(protos.WriteToHost):
        rig.ok(w)
    (b,) = rig.take(protos.BackupToStorage)
    return b


def _written_with_failed_backup(rig: Rig, s: str) -> protos.BackupToStorage:
    b = _written(rig, s)
    _fail(rig, b)
    return b


def test_a_failed_backup_is_tried_again_after_its_delay_until_one_succeeds() -> None:
    rig = Rig()
    b = _written_with_failed_backup(rig, "abcdef")
    assert rig.tier.counters.backups_failed == 1 and rig.tier.backups_waiting == 1
    assert rig.tier.retry_backups() == 0 and not rig.sent  # not due yet
    rig.now += BACKUP_RETRY_DELAYS_S[0]
    assert rig.tier.retry_backups() == 1
    (again,) = rig.take(protos.BackupToStorage)
    assert again.op_id != b.op_id and again.hashes == b.hashes and again.host_pages == b.host_pages
    assert rig.ok(again) is None
    c = rig.tier.counters
    assert (c.backups, c.backups_failed, c.backup_retries, c.backups_abandoned) == (1, 1, 1, 0)
    assert rig.tier.backups_waiting == 0 and rig.cache.tiers.open_transfers == 0
    rig.cache.check_integrity(exact=True)


def test_a_backup_that_keeps_failing_is_abandoned_after_the_last_delay() -> None:
    rig = Rig()
    _written_with_failed_backup(rig, "abcdef")
    for delay in BACKUP_RETRY_DELAYS_S:
        rig.now += delay
        assert rig.tier.retry_backups() == 1
        _fail(rig, rig.take(protos.BackupToStorage)[0])
    c = rig.tier.counters
    assert (c.backups_failed, c.backup_retries, c.backups_abandoned) == (len(BACKUP_RETRY_DELAYS_S) + 1,
                                                                      len(BACKUP_RETRY_DELAYS_S), 1)
    rig.now += 3600
    assert rig.tier.retry_backups() == 0 and not rig.sent and rig.tier.backups_waiting == 0
    assert rig.cache.match_prefix(_key("abcdef")).device_len == 6  # the data itself is untouched
    rig.cache.check_integrity(exact=True)


def test_a_retry_covers_a_span_split_since() -> None:
    rig = Rig()
    failed = _written_with_failed_backup(rig, "abcdef")
    key = _key("abcXYZ")  # splits abcdef at abc: a new node above it holds abc
    pages = rig.dev.alloc(6)
    assert pages is not None
    res = rig.cache.insert(key, pages)
    assert res.prefix_len == 3
    rig.dev.free(pages[:3])
    rig.now += BACKUP_RETRY_DELAYS_S[0]
    assert rig.tier.retry_backups() == 2  # abc, then def: abcdef's span in two nodes
    sent = rig.take(protos.BackupToStorage)
    assert [len(b.host_pages) for b in sent] == [3, 3]
    assert sent[0].hashes + sent[1].hashes == failed.hashes
    assert sent[0].host_pages + sent[1].host_pages == failed.host_pages
    for b in sent:
        rig.ok(b)
    assert rig.tier.backups_waiting == 0 and rig.cache.tiers.open_transfers == 0
    rig.cache.check_integrity(exact=True)


def test_a_retry_skips_pages_that_left_l2() -> None:
    rig = Rig()
    _written_with_failed_backup(rig, "abcdef")
    rig.cache.evict(full_tokens=6)
    rig.cache.host.evict_host(6)
    m = rig.cache.match_prefix(_key("abcdef"))
    assert m.device_len == 0 and m.host_hit_length == 0
    rig.now += BACKUP_RETRY_DELAYS_S[0]
    assert rig.tier.retry_backups() == 0 and not rig.sent and rig.tier.backups_waiting == 0
    rig.cache.check_integrity(exact=True)


def test_backups_lost_with_their_controller_wait_for_the_next_one() -> None:
    rig = Rig()
    b = _written(rig, "abcdef")
    rig.tier.on_controller_lost()
    rig.tier.run = None
    rig.now += 60
    assert rig.tier.retry_backups() == 0 and rig.tier.backups_waiting == 1  # no controller
    rig.tier.run = 2
    rig.tier.l3_enabled = False
    assert rig.tier.retry_backups() == 0 and rig.tier.backups_waiting == 1  # L3 not confirmed yet
    rig.tier.l3_enabled = True
    assert rig.tier.retry_backups() == 1
    (again,) = rig.take(protos.BackupToStorage)
    assert again.run == 2 and again.hashes == b.hashes
