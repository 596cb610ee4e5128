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
from hicache.scheduler.controller_driver import ControllerDriver
from hicache.tree import FullComponent, UnifiedRadixCache


def _key(s: str) -> array:
    return array("I", [ord(ch) for ch in s])


class Rig:
    def __init__(self) -> None:
        self.dev = PageAllocator(64, "l1")
        self.host = PageAllocator(64, "l2")
        self.cache = UnifiedRadixCache([FullComponent(self.dev, self.host)], 1,
                                       hasher=HashNamespace("test-model", "bf16", 1))
        self.sent: list[protos.ControllerMessage] = []
        self.tier = ControllerDriver(self.cache, self.sent.append, load_back_threshold=1, l3_enabled=True,
                                prefetch=PrefetchConfig(threshold_tokens=1))

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
