"""The cache server's logic (engine mode) over a real tree, without processes.

An "engine" here writes, into each L2 page it was given to save, a value derived from the
exact token prefix that page ends; every lookup then checks that each page it was handed
holds the value of *its own* prefix. That is the correctness property of the whole mode: an
engine is never handed KV that another prefix (or another tenant) wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

import protos
from hicache.cache_server.geometry import attention_shape
from hicache.cache_server.leases import EngineProcess, LeaseTable
from hicache.cache_server.pins import PinEntry
from hicache.cache_server.reservations import RESAVE_SHARE
from hicache.cache_server.server import CacheServer
from hicache.cache_server.sessions import namespaced_salt
from hicache.hashing import HashNamespace
from hicache.memory.allocator import PageAllocator
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import FullComponent
from protos import L2PoolInfo

PS = 4
TTL = 10.0
GEOMETRY = protos.EngineKVGeometry("a" * 64, "bfloat16", PS, 2, 2, 32, "LBHNC")
RUN = 77
RUNTIME = "f" * 64


class Clock:
    """The server's clock, and the engine processes the test has ended (``dead``: pids)."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.dead: set[int] = set()

    def __call__(self) -> float:
        return self.t

    def gone(self, process: EngineProcess) -> bool:
        return process.pid in self.dead


def make_server(l2_pages: int = 32, pinned: tuple[PinEntry, ...] = (), save_wait_s: float = 0.0
                ) -> tuple[CacheServer, Clock]:
    comp = FullComponent(PageAllocator(0, "l1-full"), PageAllocator(l2_pages, "l2-full"))
    cache = UnifiedRadixCache([comp], PS, hasher=HashNamespace(GEOMETRY.model_identity, "bfloat16", PS, "full"))
    clock = Clock()
    pool = L2PoolInfo("inst", "inst-full-l2-0", "/dev/shm", l2_pages, GEOMETRY.page_bytes)
    return CacheServer(cache, None, GEOMETRY, pool, TTL, clock=clock, run=RUN,
                       leases=LeaseTable(TTL, gone=clock.gone), pinned=pinned, save_wait_s=save_wait_s), clock


_pids = iter(range(1000, 10**6))


def register(server: CacheServer, geometry: protos.EngineKVGeometry = GEOMETRY, page_bytes: int | None = None,
             runtime: str = RUNTIME, pid: int = 123, tp: int = 1) -> protos.Message:
    g = geometry
    return server.handle(protos.EngineRegister(1, "engine-a", pid, g, g.page_bytes if page_bytes is None else page_bytes,
                                               runtime, tensor_parallel=tp))


def session_of(server: CacheServer, runtime: str = RUNTIME, pid: int = 123, tp: int = 1) -> int:
    reg = register(server, runtime=runtime, pid=pid, tp=tp)
    assert isinstance(reg, protos.EngineRegistered) and reg.run == RUN
    return reg.session


def content(tokens: list[int], page: int, salt: str = "") -> bytes:
    """What an engine's KV for page ``page`` of ``tokens`` "is": a function of the whole prefix."""
    return hashlib.sha256(repr((salt, tokens[: (page + 1) * PS])).encode()).digest()


def reserve_msg(req: int, session: int, run: int, rid: str, tokens: list[int], start_page: int, salt: str = "",
                base: int = 0) -> protos.Reserve:
    """A ``Reserve`` with one save range."""
    return protos.Reserve(req, session, run, [protos.SaveRange(rid, protos.pack_tokens(tokens), start_page, salt, base)])


def reserve(server: CacheServer, req: int, session: int, run: int, rid: str, tokens: list[int], start_page: int,
            salt: str = "", base: int = 0) -> protos.Reservation:
    """The reservation of a one-range ``Reserve``."""
    ans = server.handle(reserve_msg(req, session, run, rid, tokens, start_page, salt, base))
    assert isinstance(ans, protos.ReserveResult) and len(ans.items) == 1, ans
    return ans.items[0]


class FakeEngine:
    """Saves and loads through the server, writing and checking page contents in a fake L2."""

    def __init__(self, server: CacheServer, l2: dict[int, bytes], runtime: str = RUNTIME) -> None:
        self.server = server
        self.pid = next(_pids)
        self.runtime = runtime
        self.session = session_of(server, runtime, self.pid)
        self.l2 = l2
        self.req = 0

    def next_req(self) -> int:
        self.req += 1
        return self.req

    def save(self, tokens: list[int], start_page: int = 0, salt: str = "", ok: bool = True) -> protos.Reservation:
        ans = reserve(self.server, self.next_req(), self.session, RUN, "r", tokens, start_page, salt)
        assert not ans.code, ans
        for i, page in enumerate(ans.host_pages):
            self.l2[page] = content(tokens, ans.start_page + i, self.runtime + salt)
        if ans.lease:
            self.server.handle(protos.Commit(self.session, RUN, ans.lease, ok))
        return ans

    def lookup(self, tokens: list[int], salt: str = "", release: bool = True) -> protos.LookupResult:
        ans = self.server.handle(protos.Lookup(self.next_req(), self.session, RUN, "r", protos.pack_tokens(tokens), salt))
        assert isinstance(ans, protos.LookupResult), ans
        for i, page in enumerate(ans.host_pages):
            assert self.l2.get(page) == content(tokens, i, self.runtime + salt), f"page {i} of the hit holds other KV"
        if release and ans.lease:
            self.server.handle(protos.Release(self.session, RUN, ans.lease, len(ans.host_pages)))
        return ans


def test_registration_is_refused_with_the_fields_that_differ() -> None:
    server, _ = make_server()
    assert isinstance(register(server), protos.EngineRegistered)
    other = protos.EngineKVGeometry("b" * 64, "float16", 64, 2, 2, 32, "LBHNC")
    ans = register(server, other)
    assert isinstance(ans, protos.EngineError) and ans.code == "refused"
    for name in ("model_identity", "kv_dtype", "block_size"):
        assert name in ans.reason
    assert "num_layers" not in ans.reason
    ans = register(server, page_bytes=GEOMETRY.page_bytes + 1)
    assert isinstance(ans, protos.EngineError) and "page_bytes" in ans.reason


def test_a_refusal_for_another_block_size_names_the_setting_to_change() -> None:
    """A hybrid model's engine whose vLLM raised the block: the refusal says which
    ``cache.page_size`` to set (the engine's block) or which ``--block-size`` to start with."""
    server, _ = make_server()
    ans = register(server, replace(GEOMETRY, block_size=3 * PS))
    assert isinstance(ans, protos.EngineError) and ans.code == "refused"
    assert f"block_size: daemon {PS}, engine {3 * PS}" in ans.reason
    assert f"cache.page_size: {3 * PS}" in ans.reason and f"--block-size {PS}" in ans.reason
    ans = register(server, replace(GEOMETRY, kv_dtype="float16"))  # the block matches: no such advice
    assert isinstance(ans, protos.EngineError) and "kv_dtype" in ans.reason and "cache.page_size" not in ans.reason


def test_unknown_session_and_bad_tokens_are_answered_not_raised() -> None:
    server, _ = make_server()
    ans = server.handle(protos.Lookup(5, 99, RUN, "r", protos.pack_tokens([1, 2, 3, 4])))
    assert isinstance(ans, protos.EngineError) and ans.code == "unknown_session" and ans.req == 5
    s = session_of(server)
    ans = server.handle(protos.Lookup(6, s, RUN, "r", b"\x01\x00\x00"))  # not whole 4-byte ids
    assert isinstance(ans, protos.EngineError) and ans.code == "bad_request"
    ans = reserve(server, 7, s, RUN, "r", [1, 2, 3, 4], -1)
    assert ans.code == "bad_request" and not ans.lease
    ans = server.handle(protos.Ready("x", 1))
    assert isinstance(ans, protos.EngineError)
    ans = register(server, runtime="not hex")
    assert isinstance(ans, protos.EngineError) and ans.code == "bad_request" and "runtime_identity" in ans.reason
    server.handle(protos.Release(s, RUN, 12345))  # unknown lease: dropped
    server.handle(protos.Commit(s, RUN, 12345))
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_a_busy_answer_is_counted_for_its_session_and_changes_nothing_else() -> None:
    """``busy`` (the loop's answer to a lookup or reserve past its engine's queue bound):
    counted in all and for the session it names, which it renews; the request's tokens the
    server held stay held (the engine's next ask sends only the new ones)."""
    server, clock = make_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 3 * PS + 1))
    eng.lookup(tokens[:PS])  # the server now holds the first page's tokens of "r"
    clock.t += TTL - 1
    ans = server.busy(protos.Lookup(40, eng.session, RUN, "r", protos.pack_tokens(tokens[PS:]), "", True, PS))
    assert ans == protos.EngineError(40, protos.BUSY, ans.reason)
    ans = server.busy(reserve_msg(41, eng.session, RUN, "r", tokens, 0))
    assert ans.code == protos.BUSY and ans.req == 41
    server.busy(protos.Lookup(42, 999, RUN, "r", b""))  # no such session: counted in all only
    clock.t += 2  # past the TTL since the lookup, not since the busy answers
    assert server.expire() == 0
    st = server.stats()
    assert st["engine"]["busy"] == 3 and [e["busy"] for e in st["engines"]] == [2]
    more = server.handle(protos.Lookup(43, eng.session, RUN, "r", protos.pack_tokens(tokens[PS:]), "", True, PS))
    assert isinstance(more, protos.LookupResult)  # the base the busy lookup named is still held
    server.check_idle()
    assert server.integrity_error is None


def test_save_then_lookup_returns_the_saved_pages_and_skips_what_is_held() -> None:
    server, _ = make_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 4 * PS + 3))  # 4 full pages and a tail
    first = eng.save(tokens[: 2 * PS])
    assert first.start_page == 0 and len(first.host_pages) == 2
    second = eng.save(tokens, start_page=0)  # the first two pages are held: only pages 2, 3
    assert second.start_page == 2 and len(second.host_pages) == 2
    hit = eng.lookup(tokens)
    assert len(hit.host_pages) == 4 and hit.host_pages[:2] == first.host_pages
    assert eng.lookup(tokens[:PS] + [999] * PS).host_pages == first.host_pages[:1]
    nothing = eng.save(tokens[: 3 * PS])
    assert nothing.lease == 0 and not nothing.host_pages
    server.check_idle()
    assert server.integrity_error is None


def test_a_lookup_lease_protects_its_pages_from_eviction_until_released() -> None:
    server, _ = make_server(l2_pages=4)
    eng = FakeEngine(server, {})
    a = [1] * (4 * PS)
    eng.save(a[: 2 * PS])
    eng.save(a, start_page=2)  # two nodes of two pages each
    hit = eng.lookup(a, release=False)
    assert len(hit.host_pages) == 4 and hit.lease
    blocked = eng.save([2] * (2 * PS))  # L2 is full and every page is leased
    assert not blocked.host_pages and server.counters.reserve_short_pages == 2
    server.handle(protos.Release(eng.session, RUN, hit.lease, 4))
    assert server.counters.loaded_host_pages == 4
    taken = eng.save([2] * (2 * PS))  # now the leaf of ``a`` gives way
    assert len(taken.host_pages) == 2
    assert len(eng.lookup(a).host_pages) == 2
    server.check_idle()
    assert server.integrity_error is None


def test_a_failed_commit_and_a_duplicate_commit_free_their_pages() -> None:
    server, _ = make_server()
    eng = FakeEngine(server, {})
    tokens = [7] * (3 * PS)
    eng.save(tokens, ok=False)
    assert server.host.used == 0 and not eng.lookup(tokens).host_pages
    # two engines computing the same prompt at once: both reserve, both commit
    other = FakeEngine(server, eng.l2)
    r1 = reserve(server, 1, eng.session, RUN, "x", tokens, 0)
    r2 = reserve(server, 2, other.session, RUN, "y", tokens, 0)
    assert not r1.code and not r2.code
    for r in (r1, r2):
        for i, page in enumerate(r.host_pages):
            eng.l2[page] = content(tokens, i, RUNTIME)
    server.handle(protos.Commit(eng.session, RUN, r1.lease))
    server.handle(protos.Commit(other.session, RUN, r2.lease))
    assert server.counters.commit_duplicate_pages == 3
    assert server.host.used == 3 and eng.lookup(tokens).host_pages == r1.host_pages
    server.check_idle()
    assert server.integrity_error is None


def test_salts_are_separate_namespaces() -> None:
    server, _ = make_server()
    eng = FakeEngine(server, {})
    tokens = [5] * (2 * PS)
    eng.save(tokens, salt="tenant-a")
    assert not eng.lookup(tokens).host_pages
    assert not eng.lookup(tokens, salt="tenant-b").host_pages
    assert len(eng.lookup(tokens, salt="tenant-a").host_pages) == 2


def test_a_silent_engines_leases_are_held_as_orphans_until_its_process_is_gone() -> None:
    server, clock = make_server(l2_pages=6)
    eng = FakeEngine(server, {})
    tokens = [3] * (4 * PS)
    eng.save(tokens[: 2 * PS])
    hit = eng.lookup(tokens, release=False)  # the engine stalls holding a lookup lease ...
    pending = reserve(server, 9, eng.session, RUN, "r", tokens, 2)  # ... and a reservation
    assert hit.lease and pending.lease
    assert server.host.used == 4
    clock.t += TTL / 2
    assert server.expire() == 0
    clock.t += TTL  # silent for more than the TTL: the session ends, its leases become orphans
    assert server.expire() == 2
    assert not server.leases.sessions and len(server.leases.orphans) == 2
    # the engine may still write the reserved pages and read the leased ones: nothing is
    # freed or unlocked, so no other prefix can take them
    assert server.host.used == 4 and server.cache.host_protected_size() == 2 * PS
    other = FakeEngine(server, eng.l2)
    taken = other.save([9] * (4 * PS))
    assert len(taken.host_pages) == 2  # only the two free pages
    assert set(taken.host_pages).isdisjoint(pending.host_pages + hit.host_pages)
    ans = server.handle(protos.Lookup(10, eng.session, RUN, "r", protos.pack_tokens(tokens)))
    assert isinstance(ans, protos.EngineError) and ans.code == "unknown_session"
    server.check_idle()
    assert server.exact_checks == 0  # orphans are open work: no exact check yet
    clock.t += 100 * TTL
    server.expire()
    assert len(server.leases.orphans) == 2  # its process was not seen gone: still held
    clock.dead.add(eng.pid)
    server.expire()
    assert not server.leases.orphans and server.counters.orphans_ended_gone == 2
    assert server.host.used == 4 and server.cache.host_protected_size() == 0  # reserved pages freed
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_time_the_daemon_could_not_listen_is_no_engines_silence() -> None:
    server, clock = make_server()
    eng = FakeEngine(server, {})
    clock.t += TTL * 0.9
    server.leases.credit(TTL * 0.9)  # the loop stalled that long: heartbeats were not read
    clock.t += TTL * 0.5
    assert server.expire() == 0 and eng.session in server.leases.sessions
    clock.t += TTL * 0.6  # silent for 1.1 TTL of listening time
    server.expire()
    assert eng.session not in server.leases.sessions


def test_an_orphan_ends_with_its_late_release_or_commit_and_a_late_commit_inserts_nothing() -> None:
    server, clock = make_server()
    eng = FakeEngine(server, {})
    tokens = [6] * (4 * PS)
    eng.save(tokens[: 2 * PS])
    hit = eng.lookup(tokens, release=False)
    pending = reserve(server, 9, eng.session, RUN, "r", tokens, 2)
    assert len(pending.host_pages) == 2
    clock.t += TTL + 1
    assert server.expire() == 2
    server.handle(protos.Release(eng.session, RUN, hit.lease, 2))  # the stalled worker resumes
    server.handle(protos.Commit(eng.session, RUN, pending.lease, True))
    assert not server.leases.orphans and server.counters.orphans_ended_late == 2
    assert server.counters.committed_pages == 2  # only the first save, made while the session lived
    assert server.host.used == 2 and server.cache.host_protected_size() == 0
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_a_live_engine_keeps_its_leases_however_long_a_step_takes() -> None:
    server, clock = make_server()
    eng = FakeEngine(server, {})
    tokens = [4] * (2 * PS)
    eng.save(tokens)
    hit = eng.lookup(tokens, release=False)
    pending = reserve(server, 3, eng.session, RUN, "r", tokens + [4] * PS, 2)
    assert pending.lease
    for _ in range(1000):  # heartbeats for 500 TTLs: a step stalled that long still owns its pages
        clock.t += TTL / 2
        server.handle(protos.Heartbeat(eng.session, RUN))
        assert server.expire() == 0
    assert hit.lease in server.leases.leases and pending.lease in server.leases.leases
    server.handle(protos.Release(eng.session, RUN, hit.lease, 2))
    server.handle(protos.Commit(eng.session, RUN, pending.lease, True))
    assert server.counters.committed_pages == 3
    server.check_idle()
    assert server.integrity_error is None


def test_messages_of_another_daemon_run_are_refused_and_counted() -> None:
    server, clock = make_server()
    eng = FakeEngine(server, {})
    tokens = [8] * (2 * PS)
    eng.save(tokens)
    hit = eng.lookup(tokens, release=False)
    old = RUN + 1  # a plan made before a restart names the old run; ids restart at 1 in every run
    for msg in (protos.Lookup(1, eng.session, old, "r", protos.pack_tokens(tokens)), reserve_msg(2, eng.session, old, "r", tokens, 0)):
        ans = server.handle(msg)
        assert isinstance(ans, protos.EngineError) and ans.code == "stale_run" and ans.req == msg.req
    server.handle(protos.Release(eng.session, old, hit.lease, 2))  # same session and lease numbers
    server.handle(protos.Commit(eng.session, old, hit.lease, True))
    ans = server.handle(protos.Heartbeat(eng.session, old))  # answered: the engine registers again at once
    assert isinstance(ans, protos.EngineError) and ans.code == "stale_run" and ans.req == 0
    assert server.counters.stale_run == 5
    ans = server.handle(protos.Heartbeat(eng.session + 100, RUN))
    assert isinstance(ans, protos.EngineError) and ans.code == "unknown_session"
    assert server.handle(protos.Heartbeat(eng.session, RUN)) is None
    assert hit.lease in server.leases.leases  # the stale Release did not end this run's lease
    server.handle(protos.Release(eng.session, RUN, hit.lease, 2))
    server.check_idle()
    assert server.integrity_error is None


def test_engines_of_another_runtime_identity_share_no_page() -> None:
    server, _ = make_server()
    amx = FakeEngine(server, {}, runtime="a" * 64)
    vec = FakeEngine(server, amx.l2, runtime="b" * 64)
    twin = FakeEngine(server, amx.l2, runtime="a" * 64)
    tokens = [5] * (3 * PS)
    amx.save(tokens)
    assert not vec.lookup(tokens).host_pages  # another ISA, version or reset generation: no hit
    assert len(twin.lookup(tokens).host_pages) == 3  # the same identity shares
    vec.save(tokens)
    assert len(vec.lookup(tokens).host_pages) == 3 and server.host.used == 6


def test_a_reserve_after_a_gap_saves_the_evicted_prefix_again_within_the_requests_credit() -> None:
    """Pages before ``start_page`` that L2 lost since the request saved them are saved again
    while they fit its credit (a tenth of a page per page of new content it asked); a longer
    gap makes the range save nothing (its pages would follow the gap): an empty reservation
    at the first page L2 lacks, the prefix before it still served."""
    server, _ = make_server(l2_pages=32)
    eng = FakeEngine(server, {})
    tokens = list(range(1, 30 * PS + 1))
    eng.save(tokens[: 20 * PS])  # credit 2.0
    eng.save(tokens[: 22 * PS], start_page=20)  # credit 2.2
    server.cache.host.evict_host(2 * PS)  # L2 lost the leaf: pages 20, 21
    later = eng.save(tokens[: 23 * PS], start_page=22)  # asks from 22; L2 lacks 20..22; 2 <= 2.3
    assert later.start_page == 20 and len(later.host_pages) == 3
    assert len(eng.lookup(tokens[: 23 * PS]).host_pages) == 23
    server.cache.host.evict_host(3 * PS)  # the leaf again: pages 20..22; credit 0.3 + 0.1 < 3
    refused = eng.save(tokens[: 24 * PS], start_page=23)
    assert (refused.lease, refused.start_page, refused.host_pages) == (0, 20, [])
    assert len(eng.lookup(tokens[: 24 * PS]).host_pages) == 20
    c = server.counters
    assert (c.resaved_pages, c.resave_refused_pages, c.save_new_pages) == (2, 3, 20 + 2 + 1)
    assert c.reserved_pages <= (1 + RESAVE_SHARE) * c.save_new_pages
    server.check_idle()
    assert server.integrity_error is None


class Decoder:
    """A running request of ``eng``'s engine that saves each page as it fills, sending only
    its new tokens (``base``), as the connector does."""

    def __init__(self, eng: FakeEngine, rid: str, tokens: list[int]) -> None:
        self.eng, self.rid, self.tokens = eng, rid, tokens
        self.saved = 0  # pages asked so far (the engine's ``start_page``)
        self.known = 0  # tokens the server holds for it

    def step(self, pages: int) -> protos.Reservation:
        """Save up to page ``pages``: a reserve, its pages written, then committed."""
        got = self.plan(pages)
        self.commit(got)
        return got

    def plan(self, pages: int) -> protos.Reservation:
        """The reserve of a save up to page ``pages``, its pages written."""
        end = pages * PS
        got = reserve(self.eng.server, self.eng.next_req(), self.eng.session, RUN, self.rid, self.tokens[self.known:end],
                      self.saved, base=self.known)
        assert not got.code, got
        self.saved, self.known = pages, end
        for i, page in enumerate(got.host_pages):
            self.eng.l2[page] = content(self.tokens, got.start_page + i, self.eng.runtime)
        return got

    def commit(self, got: protos.Reservation) -> None:
        if got.lease:
            self.eng.server.handle(protos.Commit(self.eng.session, RUN, got.lease))


def test_a_requests_reserves_resume_from_its_cursor_and_answer_what_a_whole_match_answers() -> None:
    """Requests decoding over many steps while L2 evicts between them (a page, a request's
    tail, its whole prefix) and other requests save the same content ahead of them or start
    again with other tokens: every reservation starts at the first page L2 lacks as a whole
    match of the prefix says, each hit holds its own prefix's KV, and most steps resume."""
    rng = random.Random(5)
    server, _ = make_server(l2_pages=128)
    eng = FakeEngine(server, {})
    salt = namespaced_salt(server.leases.sessions[eng.session].namespace, "")

    def stream() -> list[int]:
        return [rng.randrange(1, 50) for _ in range(40 * PS)]

    shared = stream()
    reqs = {"a": Decoder(eng, "a", shared), "b": Decoder(eng, "b", shared), "c": Decoder(eng, "c", stream())}
    pages = {"a": 16, "b": 12, "c": 14}
    ahead = 0  # reservations that started past what the request saved (another one saved it)
    for step in range(300):
        rid = rng.choice(sorted(reqs))
        r = reqs[rid]
        pages[rid] = min(40, pages[rid] + rng.choice([0, 1, 1, 2]))
        want = server.cache.match_prefix(r.tokens[: pages[rid] * PS], salt).host_hit_length // PS
        asked = r.saved
        got = r.step(pages[rid])
        assert got.start_page == min(want, pages[rid]), (step, rid, got, want)
        ahead += got.start_page > asked
        if got.lease:
            assert len(eng.lookup(r.tokens[: pages[rid] * PS]).host_pages) == pages[rid]
        roll = rng.random()
        if roll < 0.08:
            server.cache.host.evict_host(rng.choice([1, 1, 1, 2, 12]) * PS)
        elif roll < 0.09:
            server.flush()
        if pages[rid] == 40 or 0.09 <= roll < 0.13:  # done, or it starts again with other tokens
            server.handle(protos.Finished(eng.session, RUN, rid))
            reqs[rid], pages[rid] = Decoder(eng, rid, shared if rid != "c" and roll < 0.5 else stream()), 12
    c = server.counters
    assert c.reserve_resumed > c.save_ranges // 2 and c.resaved_pages and c.resave_refused_pages and ahead
    assert c.reserved_pages <= (1 + RESAVE_SHARE) * c.save_new_pages
    server.check_idle()
    assert server.integrity_error is None


def test_a_request_sent_again_with_other_tokens_does_not_start_past_its_open_reservations() -> None:
    """An open reservation of a request lets its next save start past it only while it
    saves a prefix of the request's tokens: sent again with other tokens (``base`` 0), the
    request's save starts where L2 lacks its new prefix, and its cursor walks from the root."""
    server, _ = make_server()
    eng = FakeEngine(server, {})
    a = list(range(1, 4 * PS + 1))
    b = [9] * (4 * PS)
    first = reserve(server, 1, eng.session, RUN, "r", a[: 3 * PS], 0)
    again = reserve(server, 2, eng.session, RUN, "r", b, 0)
    assert (again.start_page, len(again.host_pages)) == (0, 4)
    _fill(eng, a, first)
    _fill(eng, b, again)
    for got in (first, again):
        server.handle(protos.Commit(eng.session, RUN, got.lease))
    assert len(eng.lookup(b).host_pages) == 4 and len(eng.lookup(a).host_pages) == 3


def _decoding_request() -> tuple[CacheServer, Decoder]:
    """A server with a request whose 500-page prompt is saved; 20 pages to decode."""
    server, _ = make_server(l2_pages=600)
    r = Decoder(FakeEngine(server, {}), "r", list(range(1, 520 * PS + 1)))
    r.step(500)  # the prompt
    return server, r


@contextmanager
def _counting_walks(server: CacheServer, walked: list[int]) -> Iterator[None]:
    """While open, the pages of the tree nodes ``TreeCore.walk`` returns are added up in a
    new last entry of ``walked``."""
    core = server.cache.core
    walk = core.walk
    walked.append(0)

    def counting(root, key, n):  # type: ignore[no-untyped-def]
        path = walk(root, key, n)
        walked[-1] += sum(len(x.key) for x in path) // PS
        return path

    core.walk = counting  # type: ignore[method-assign]
    try:
        yield
    finally:
        core.walk = walk  # type: ignore[method-assign]


def test_a_decode_steps_match_walks_only_the_pages_added_since_its_last_reserve() -> None:
    """The tree nodes a reserve walks (``TreeCore.walk``) cover the pages committed since the
    request's last reserve, not its context: constant work per step at any length."""
    server, r = _decoding_request()
    walked: list[int] = []
    for pages in range(501, 520):
        with _counting_walks(server, walked):
            got = r.plan(pages)
        r.commit(got)  # the commit's insert is not the reserve's work
        assert (got.start_page, len(got.host_pages)) == (pages - 1, 1)
    assert walked == [500] + [1] * 18  # the prompt committed after the first reserve, then a page a step


def test_a_decode_steps_commit_compares_only_its_new_pages() -> None:
    """A save's commit inserts from where L2 held the request's prefix at its reservation
    (``Lease.held_node``), not from the root: the tokens its insert compares are the new
    page's, at any context; the tree it leaves is the one a whole walk leaves."""
    server, r = _decoding_request()
    eng, tokens = r.eng, r.tokens
    walked: list[int] = []
    for pages in range(501, 520):
        got = r.plan(pages)
        with _counting_walks(server, walked):
            r.commit(got)
    assert walked == [0] * 19  # the new page is past every node: nothing to compare
    salt = namespaced_salt(server.leases.sessions[eng.session].namespace, "")
    m = server.cache.match_prefix(tokens[: 519 * PS], salt)
    assert m.host_hit_length == 519 * PS
    server.cache.check_integrity(exact=True)


def test_a_lease_commits_its_own_prefix_while_its_requests_tokens_grow_in_place() -> None:
    """A request's held tokens grow in place step by step (no copy of the context); a
    reservation made before a growth still commits exactly its own prefix."""
    server, _ = make_server(l2_pages=64)
    eng = FakeEngine(server, {})
    tokens = list(range(1, 12 * PS + 1))
    r = Decoder(eng, "r", tokens)
    r.step(8)
    held = server.requests.get((eng.session, "r"))
    first = r.plan(9)
    second = r.plan(10)  # its tokens appended to the same array after ``first`` was made
    assert server.requests.get((eng.session, "r")) is held and len(held) == 10 * PS
    assert server.requests.total == 10 * PS
    r.commit(first)
    salt = namespaced_salt(server.leases.sessions[eng.session].namespace, "")
    assert server.cache.match_prefix(tokens, salt).host_hit_length == 9 * PS
    r.commit(second)
    assert server.cache.match_prefix(tokens, salt).host_hit_length == 10 * PS
    server.cache.check_integrity(exact=True)


def _fill(eng: FakeEngine, tokens: list[int], got: protos.Reservation) -> None:
    for i, page in enumerate(got.host_pages):
        eng.l2[page] = content(tokens, got.start_page + i, eng.runtime)


@pytest.mark.parametrize("first_ok", [True, False])
def test_a_save_while_the_requests_earlier_save_is_being_copied_reserves_only_the_new_pages(first_ok: bool) -> None:
    """A request's page fills while its prefill's save is still being copied (no commit yet):
    the second reservation starts where the first one ends, so the prefix is not copied
    twice. If the first save fails, the second one is freed at its commit (a gap): the
    cache is shorter, never wrong."""
    server, _ = make_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 4 * PS + 1))
    first = reserve(server, 1, eng.session, RUN, "r", tokens[: 3 * PS], 0)
    second = reserve(server, 2, eng.session, RUN, "r", tokens, 3)
    assert (first.start_page, len(first.host_pages)) == (0, 3)
    assert (second.start_page, len(second.host_pages)) == (3, 1)
    other = reserve(server, 3, eng.session, RUN, "q", tokens, 0)  # another request: no shortcut
    assert other.start_page == 0 and len(other.host_pages) == 4
    for got in (first, second, other):
        _fill(eng, tokens, got)
    server.handle(protos.Commit(eng.session, RUN, first.lease, first_ok))
    server.handle(protos.Commit(eng.session, RUN, second.lease))
    # not taken by the tree: none, or (after a failed first save) the page past the gap
    assert server.counters.commit_duplicate_pages == (0 if first_ok else 1)
    server.handle(protos.Commit(eng.session, RUN, other.lease, False))
    assert len(eng.lookup(tokens).host_pages) == (4 if first_ok else 0)
    assert server.host.used == (4 if first_ok else 0)
    server.check_idle()
    assert server.integrity_error is None


@pytest.mark.parametrize("first_ok", [False, True])
def test_a_save_asked_again_from_below_its_own_open_reservation_reserves_those_pages_again(first_ok: bool) -> None:
    """The engine asks to save a request's pages again from below its own open reservation
    only when it learned that the step which was to save them failed; that step's failed
    commit comes from the worker, on another socket, and may arrive after the new reserve.
    The new reservation takes those pages again, so the request's recomputed pages are
    saved (before, it started past them, and once the failed commit came the request had
    saved nothing). Had the first save not failed after all, the second is a duplicate."""
    server, _ = make_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 4 * PS + 1))
    first = reserve(server, 1, eng.session, RUN, "r", tokens[: 3 * PS], 0)
    again = reserve(server, 2, eng.session, RUN, "r", tokens, 0)  # asked from page 0 again
    assert (first.start_page, len(first.host_pages)) == (0, 3)
    assert (again.start_page, len(again.host_pages)) == (0, 4)
    for got in (first, again):
        _fill(eng, tokens, got)
    server.handle(protos.Commit(eng.session, RUN, first.lease, first_ok))  # comes late
    server.handle(protos.Commit(eng.session, RUN, again.lease))
    assert server.counters.commit_duplicate_pages == (3 if first_ok else 0)
    assert len(eng.lookup(tokens).host_pages) == 4
    assert server.host.used == 4
    server.check_idle()
    assert server.integrity_error is None


@pytest.mark.parametrize("seed", range(6))
def test_random_engines_never_get_another_prefixes_pages(seed: int) -> None:
    """Several engines saving, loading, dying and coming back over a small L2: every hit
    holds exactly its own prefix's pages, and idle checks find no leak."""
    rnd = random.Random(seed)
    server, clock = make_server(l2_pages=12)
    l2: dict[int, bytes] = {}
    engines = [FakeEngine(server, l2) for _ in range(3)]
    stems = [[rnd.randrange(1, 50) for _ in range(2 * PS)] for _ in range(3)]
    open_leases: list[tuple[FakeEngine, int]] = []
    for _ in range(300):
        eng = rnd.choice(engines)
        stem = rnd.choice(stems)
        tokens = stem + [rnd.randrange(1, 4) for _ in range(rnd.randrange(0, 4) * PS)]
        salt = rnd.choice(["", "", "t"])
        op = rnd.random()
        if op < 0.4:
            eng.save(tokens, rnd.randrange(0, 2), salt, ok=rnd.random() > 0.1)
        elif op < 0.8:
            keep = rnd.random() < 0.2
            ans = eng.lookup(tokens, salt, release=not keep)
            if keep and ans.lease:
                open_leases.append((eng, ans.lease))
        elif op < 0.9 and open_leases:
            e, lease = open_leases.pop(rnd.randrange(len(open_leases)))
            e.server.handle(protos.Release(e.session, RUN, lease, 0))
        else:  # an engine dies; a new one takes its place
            i = rnd.randrange(len(engines))
            dead = engines[i]
            open_leases = [(e, x) for e, x in open_leases if e is not dead]
            clock.t += TTL + 1
            for e in engines:
                if e is not dead:
                    server.handle(protos.Heartbeat(e.session, RUN))
            server.expire()  # its leases are orphans ...
            clock.dead.add(dead.pid)
            server.expire()  # ... until its process is seen gone
            engines[i] = FakeEngine(server, l2)
        server.cache.check_integrity()
    for e, lease in open_leases:
        server.handle(protos.Release(e.session, RUN, lease, 0))
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def make_tiered_server(pinned: tuple[PinEntry, ...] = ()) -> tuple[CacheServer, Clock, list[protos.Message]]:
    """A server whose tier manager sends to a list (the test plays the controller)."""
    from hicache.config import PrefetchConfig
    from hicache.scheduler.controller_driver import ControllerDriver

    server, clock = make_server(pinned=pinned)
    sent: list[protos.Message] = []
    tier = ControllerDriver(server.cache, sent.append, prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=PS),
                       l3_enabled=True, clock=clock)
    server.tier = tier
    return server, clock, sent


def test_a_lookup_never_waits_for_its_prefetch_and_counts_what_came_from_l3() -> None:
    server, clock, sent = make_tiered_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 6 * PS + 1))
    eng.save(tokens[: 2 * PS])  # L2 holds two pages; L3 (the test) will hold three more
    first = server.handle(protos.Lookup(50, eng.session, RUN, "r", protos.pack_tokens(tokens)))
    assert isinstance(first, protos.LookupResult) and first.req == 50 and first.pending, first
    assert not first.lease and not first.host_pages and server.prefetching == 1  # nothing locked meanwhile
    query = sent[-1]
    assert isinstance(query, protos.PrefetchQuery) and len(query.hashes) == 4
    ask_again = protos.Lookup(51, eng.session, RUN, "r", b"", "", True, len(tokens))  # by base: no token resent
    again = server.handle(ask_again)
    assert isinstance(again, protos.LookupResult) and again.pending
    server.tier.on_message(protos.PrefetchHits(query.op_id, 3))
    fetch = sent[-1]
    assert isinstance(fetch, protos.PrefetchFetch) and len(fetch.host_pages) == 3
    assert server.handle(ask_again).pending  # type: ignore[union-attr]  # the fetch runs
    for i, page in enumerate(fetch.host_pages):  # the "controller" reads L3 into L2
        eng.l2[page] = content(tokens, 2 + i, RUNTIME)
    server.tier.on_message(protos.OpDone(fetch.op_id, "ok", 3))
    answer = server.handle(ask_again)
    assert isinstance(answer, protos.LookupResult) and not answer.pending
    assert len(answer.host_pages) == 5 and answer.storage_pages == 3
    for i, page in enumerate(answer.host_pages):
        assert eng.l2[page] == content(tokens, i, RUNTIME)
    server.handle(protos.Release(eng.session, RUN, answer.lease, 5))
    assert server.counters.loaded_storage_pages == 3 and server.counters.loaded_host_pages == 2
    assert server.counters.lookup_pending == 3 and server.counters.lookup_tokens_received == len(tokens)
    # the same request asking again is not prefetched a second time, and its hit still names
    # the three pages that came from L3 (the answer that said so may never have reached the
    # engine: a call that gave up before it arrived)
    again = server.handle(protos.Lookup(52, eng.session, RUN, "r", protos.pack_tokens(tokens)))
    assert isinstance(again, protos.LookupResult) and len(again.host_pages) == 5 and again.storage_pages == 3
    server.handle(protos.Release(eng.session, RUN, again.lease, 0))
    server.check_idle()
    assert server.integrity_error is None


def test_a_prefetch_that_finds_nothing_answers_a_miss_and_one_of_a_finished_request_is_cancelled() -> None:
    server, clock, sent = make_tiered_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 3 * PS + 1))
    assert server.handle(protos.Lookup(60, eng.session, RUN, "s", protos.pack_tokens(tokens))).pending  # type: ignore[union-attr]
    query = sent[-1]
    assert isinstance(query, protos.PrefetchQuery)
    server.tier.on_message(protos.PrefetchHits(query.op_id, 0))  # L3 has nothing
    answer = server.handle(protos.Lookup(61, eng.session, RUN, "s", protos.pack_tokens(tokens)))
    assert isinstance(answer, protos.LookupResult) and answer.req == 61 and not answer.pending
    assert not answer.host_pages and not server.prefetching
    # a request that ends while its prefetch runs: the prefetch is cancelled, nothing stays held
    assert server.handle(protos.Lookup(62, eng.session, RUN, "t", protos.pack_tokens([9] * (3 * PS)))).pending  # type: ignore[union-attr]
    assert server.prefetching == 1
    server.handle(protos.Finished(eng.session, RUN, "t"))
    assert not server.prefetching and server.tier.in_flight == 0
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_a_reserve_sends_only_the_tokens_the_server_does_not_hold_for_the_request() -> None:
    server, _ = make_server(l2_pages=64)
    eng = FakeEngine(server, {})
    prompt = list(range(1, 3 * PS + 2))  # three full pages and one token
    usable = 3 * PS
    ans = server.handle(protos.Lookup(1, eng.session, RUN, "q", protos.pack_tokens(prompt[:usable])))
    assert isinstance(ans, protos.LookupResult) and not ans.host_pages
    tokens = list(prompt)
    received = []
    for page in range(3, 40):  # the prompt's pages, then one page per block of decode
        while len(tokens) < (page + 1) * PS:
            tokens.append(len(tokens) % 97 + 1)
        base = usable if page == 3 else page * PS
        before = server.counters.reserve_tokens_received
        r = reserve(server, 2, eng.session, RUN, "q", tokens[base:(page + 1) * PS], 0 if page == 3 else page, "",
                    base)
        assert not r.code, r
        received.append(server.counters.reserve_tokens_received - before)
        for i, p in enumerate(r.host_pages):
            eng.l2[p] = content(tokens, r.start_page + i, RUNTIME)
        server.handle(protos.Commit(eng.session, RUN, r.lease, True))
    assert set(received[1:]) == {PS}  # constant in the context length: one block's tokens
    assert len(eng.lookup(tokens[: 40 * PS]).host_pages) == 40  # and the tree has every page right
    for rid in ("q", "r"):  # the request, and the lookup above
        server.handle(protos.Finished(eng.session, RUN, rid))
    assert server.stats()["requests"] == {"held": 0, "tokens": 0}
    server.check_idle()
    assert server.integrity_error is None


def test_a_reserve_naming_tokens_the_server_lacks_is_answered_unknown_request() -> None:
    server, clock = make_server()
    eng = FakeEngine(server, {})
    tokens = [3] * (3 * PS)
    ans = server.handle(protos.Reserve(1, eng.session, RUN, [
        protos.SaveRange("never-seen", protos.pack_tokens(tokens[PS:]), 1, "", PS),
        protos.SaveRange("r", protos.pack_tokens(tokens[2 * PS:]), 2, "", 5 * PS),
        protos.SaveRange("s", protos.pack_tokens(tokens), 0)]))  # one range of three the server can serve
    assert isinstance(ans, protos.ReserveResult), ans
    assert [r.code for r in ans.items] == ["unknown_request", "unknown_request", ""], ans
    assert len(ans.items[2].host_pages) == 3 and not ans.items[0].lease
    server.handle(protos.Commit(eng.session, RUN, ans.items[2].lease, False))
    ans = server.handle(protos.Lookup(5, eng.session, RUN, "never-seen", protos.pack_tokens(tokens[PS:]), "", True, PS))
    assert isinstance(ans, protos.EngineError) and ans.code == "unknown_request", ans
    assert server.counters.unknown_requests == 3 and server.host.used == 0
    other = FakeEngine(server, eng.l2)  # another session never shares a request's tokens
    server.handle(protos.Lookup(3, eng.session, RUN, "r", protos.pack_tokens(tokens)))
    ans = reserve(server, 4, other.session, RUN, "r", tokens[PS:], 1, "", PS)
    assert ans.code == "unknown_request"
    clock.t += TTL + 1  # a session that expires forgets its requests
    server.handle(protos.Heartbeat(other.session, RUN))
    server.expire()
    assert server.stats()["requests"]["held"] == 0


# ---------------------------------------------------------------------- tensor parallelism


def test_a_rank_count_that_does_not_divide_the_kv_heads_is_refused() -> None:
    server, _ = make_server()
    for tp in (0, 3, 65):  # GEOMETRY has 2 KV heads
        ans = register(server, tp=tp)
        assert isinstance(ans, protos.EngineError) and ans.code == "bad_request" and "tensor_parallel" in ans.reason
    assert isinstance(register(server, tp=2), protos.EngineRegistered)


def test_a_tensor_parallel_page_enters_the_tree_only_once_every_rank_wrote_its_shard() -> None:
    server, _ = make_server()
    session = session_of(server, tp=2)
    tokens = [7] * (2 * PS)

    def hit_pages() -> int:
        ans = server.handle(protos.Lookup(50, session, RUN, "probe", protos.pack_tokens(tokens)))
        assert isinstance(ans, protos.LookupResult)
        if ans.lease:
            server.handle(protos.Release(session, RUN, ans.lease, 0, protos.ALL_RANKS))
        return len(ans.host_pages)

    first = reserve(server, 2, session, RUN, "r", tokens, 0)
    server.handle(protos.Commit(session, RUN, first.lease, True, 0))
    assert hit_pages() == 0  # rank 1 has not written its heads yet
    server.handle(protos.Commit(session, RUN, first.lease, True, 0))  # a repeat counts once
    server.handle(protos.Commit(session, RUN, first.lease, True, 2))  # no rank 2: dropped
    assert hit_pages() == 0 and first.lease in server.leases.leases
    server.handle(protos.Commit(session, RUN, first.lease, True, 1))
    assert hit_pages() == 2 and server.counters.committed_pages == 2

    longer = tokens + [8] * (2 * PS)
    failed = reserve(server, 3, session, RUN, "r", longer, 2)
    server.handle(protos.Commit(session, RUN, failed.lease, False, 1))  # one rank could not write
    server.handle(protos.Commit(session, RUN, failed.lease, True, 0))
    assert server.counters.commit_failed_pages == 2 and server.host.used == 2
    given_back = reserve(server, 4, session, RUN, "r", longer, 2)
    server.handle(protos.Commit(session, RUN, given_back.lease, False, protos.ALL_RANKS))  # no rank saw it
    assert server.counters.commit_failed_pages == 4 and server.host.used == 2

    hit = server.handle(protos.Lookup(5, session, RUN, "r", protos.pack_tokens(longer)))
    assert isinstance(hit, protos.LookupResult) and len(hit.host_pages) == 2
    server.handle(protos.Release(session, RUN, hit.lease, 2, 0))
    assert server.cache.host_protected_size() == 2 * PS  # rank 1 may still be reading them
    server.handle(protos.Release(session, RUN, hit.lease, 1, 1))
    assert server.cache.host_protected_size() == 0
    assert server.counters.loaded_host_pages == 1  # the fewest any rank loaded
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_an_expired_tensor_parallel_engine_keeps_its_orphans_until_its_workers_are_gone_too() -> None:
    server, clock = make_server()
    engine_pid, workers = 500, (501, 502)
    session = session_of(server, pid=engine_pid, tp=2)
    for rank, pid in enumerate(workers):
        server.handle(protos.EngineWorker(RUN, engine_pid, 0, "", rank, pid, 0))
    tokens = [9] * (4 * PS)
    late = reserve(server, 2, session, RUN, "r", tokens[: 2 * PS], 0)
    stuck = reserve(server, 3, session, RUN, "s", [5] * (2 * PS), 0)
    for lease in (late.lease, stuck.lease):
        server.handle(protos.Commit(session, RUN, lease, True, 0))  # rank 1 stalls before its commits
    clock.t += TTL + 1
    assert server.expire() == 2
    server.handle(protos.Commit(session, RUN, late.lease, True, 1))  # rank 1 resumes: the orphan ends, unsaved
    assert server.counters.orphans_ended_late == 1 and server.counters.committed_pages == 0
    clock.dead.add(engine_pid)  # the engine core died; rank 1's process still runs
    server.expire()
    assert stuck.lease in server.leases.orphans and server.host.used == 2
    clock.dead.add(workers[0])
    server.expire()
    assert stuck.lease in server.leases.orphans
    clock.dead.add(workers[1])
    server.expire()
    assert not server.leases.orphans and server.counters.orphans_ended_gone == 1
    assert server.host.used == 0 and not server.leases.workers
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_an_mla_model_is_one_latent_head_and_every_rank_holds_it_whole() -> None:
    raw = {"num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
    assert attention_shape(raw) == (3, 1, 576, "mla")
    mla = protos.EngineKVGeometry("a" * 64, "bfloat16", PS, 3, 1, 576, "LBHNC", "mla")
    assert mla.page_bytes == 3 * PS * 576 * 2  # one latent vector per token and layer, no K/V pair
    comp = FullComponent(PageAllocator(0, "l1-full"), PageAllocator(8, "l2-full"))
    cache = UnifiedRadixCache([comp], PS, hasher=HashNamespace(mla.model_identity, "bfloat16", PS, "full"))
    server = CacheServer(cache, None, mla, L2PoolInfo("inst", "seg", "/dev/shm", 8, mla.page_bytes), TTL, run=RUN)
    for tp, ok in ((2, True), (8, True), (0, False)):  # one latent head, any rank count
        ans = register(server, mla, tp=tp)
        assert isinstance(ans, protos.EngineRegistered) == ok, ans
    as_kv = register(server, replace(mla, kv_kind="kv"))  # an engine that kept per-head K/V (MLA off)
    assert isinstance(as_kv, protos.EngineError) and "kv_kind" in as_kv.reason


def test_a_request_asked_about_many_times_counts_one_hit() -> None:
    """vLLM asks about a waiting request on every step: its first lease counts the hit in the
    tree, asking again and its reservations do not; another request counts its own."""
    from hicache.cache_server.sessions import namespaced_salt

    server, _ = make_server()
    eng = FakeEngine(server, {})
    tokens = list(range(1, 3 * PS + 1))
    eng.save(tokens)  # saving counts no hit
    salt = namespaced_salt(server.leases.sessions[eng.session].namespace, "")

    def hits() -> int:
        return server.cache.match_prefix(tokens, salt).last_host_node.hit_count

    assert hits() == 0

    def ask(rid: str) -> None:
        ans = server.handle(protos.Lookup(eng.next_req(), eng.session, RUN, rid, protos.pack_tokens(tokens)))
        assert isinstance(ans, protos.LookupResult) and len(ans.host_pages) == 3, ans
        server.handle(protos.Release(eng.session, RUN, ans.lease, 0))

    for _ in range(6):
        ask("waiting")
    reserve(server, eng.next_req(), eng.session, RUN, "waiting", tokens + [5] * PS, 0)
    assert hits() == 1
    ask("another")
    assert hits() == 2


WINDOW_TOKENS = 2 * PS
WINDOWED = protos.EngineKVGeometry("c" * 64, "bfloat16", PS, 2, 2, 32, "LBHNC", window_layers=1)


def make_window_server(l2_pages: int = 32, window_pages: int = 8) -> CacheServer:
    """A server for a model with one full and one window layer, a window of two pages."""
    from hicache.tree.components import SWAComponent

    comps = [FullComponent(PageAllocator(0, "l1-full"), PageAllocator(l2_pages, "l2-full")),
             SWAComponent(PageAllocator(0, "l1-swa"), WINDOW_TOKENS, PageAllocator(window_pages, "l2-swa"))]
    cache = UnifiedRadixCache(comps, PS, hasher=HashNamespace(WINDOWED.model_identity, "bfloat16", PS, "full"))
    pool = L2PoolInfo("inst", "inst-full-l2-0", "/dev/shm", l2_pages, WINDOWED.full_page_bytes,
                      "inst-swa-l2-0", window_pages, WINDOWED.window_page_bytes)
    clock = Clock()
    return CacheServer(cache, None, WINDOWED, pool, TTL, clock=clock, run=RUN, leases=LeaseTable(TTL, gone=clock.gone))


def window_session(server: CacheServer, window_tokens: int = WINDOW_TOKENS) -> protos.Message:
    g = WINDOWED
    return server.handle(protos.EngineRegister(1, "engine-w", 321, g, g.page_bytes, RUNTIME,
                                               window_tokens=window_tokens))


def test_a_window_model_keeps_the_window_parts_of_each_saved_ranges_last_window_only() -> None:
    """A page is a full part and a window part: a save of six pages takes six full parts and
    the window parts of its last two pages; a hit is valid only where the window before it
    is whole, and answers the window parts of that window."""
    server = make_window_server()
    assert isinstance(window_session(server, WINDOW_TOKENS + 2), protos.EngineError)  # reads 9 tokens back: refused
    assert isinstance(register(server), protos.EngineError)  # no window layers: other pages
    reg = window_session(server, WINDOW_TOKENS + 1)  # reads 8 tokens before a hit: what the daemon keeps
    assert isinstance(reg, protos.EngineRegistered) and reg.pool.window_segment == "inst-swa-l2-0"
    assert reg.pool.page_bytes == WINDOWED.full_page_bytes and reg.pool.window_pages == 8
    s = reg.session
    tokens = list(range(1, 6 * PS + 1))
    res = reserve(server, 2, s, RUN, "r", tokens, 0)
    assert len(res.host_pages) == 6 and len(res.window_pages) == 2
    server.handle(protos.Commit(s, RUN, res.lease, True))
    assert server.stats()["l2"]["swa"]["used_tokens"] == 2 * PS  # the window only, not 6 pages of it
    hit = server.handle(protos.Lookup(3, s, RUN, "a", protos.pack_tokens(tokens)))
    assert isinstance(hit, protos.LookupResult)
    assert hit.host_pages == res.host_pages and hit.window_pages == res.window_pages
    shorter = server.handle(protos.Lookup(4, s, RUN, "b", protos.pack_tokens(tokens[: 5 * PS])))
    assert isinstance(shorter, protos.LookupResult) and not shorter.lease  # page 3 has no window part: no hit
    # the request goes on: pages 6 and 7 with their window; a hit at 6 pages stays valid
    more = list(range(1, 8 * PS + 1))
    res2 = reserve(server, 5, s, RUN, "r", more, 6)
    assert res2.start_page == 6 and len(res2.host_pages) == 2 and len(res2.window_pages) == 2
    server.handle(protos.Commit(s, RUN, res2.lease, True))
    long_hit = server.handle(protos.Lookup(6, s, RUN, "c", protos.pack_tokens(more)))
    assert isinstance(long_hit, protos.LookupResult) and long_hit.window_pages == res2.window_pages
    assert len(long_hit.host_pages) == 8
    for ans in (hit, long_hit):
        server.handle(protos.Release(s, RUN, ans.lease, len(ans.host_pages)))
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_a_leased_window_is_never_evicted_and_a_failed_save_frees_its_window_parts() -> None:
    """Three window parts in L2: while a lookup holds A's window, a save of B finds no room
    for its window (B is kept without one: no hit); once released, C's save evicts A's
    window parts, and A no longer hits (its window is gone), but never half."""
    server = make_window_server(window_pages=3)
    reg = window_session(server)
    assert isinstance(reg, protos.EngineRegistered)
    s = reg.session
    a, b, c = ([k] * (3 * PS) for k in (1, 2, 3))

    def save(tokens: list[int], rid: str, ok: bool = True) -> protos.Reservation:
        res = reserve(server, 9, s, RUN, rid, tokens, 0)
        server.handle(protos.Commit(s, RUN, res.lease, ok))
        return res

    def lookup(tokens: list[int], rid: str) -> protos.LookupResult:
        ans = server.handle(protos.Lookup(10, s, RUN, rid, protos.pack_tokens(tokens)))
        assert isinstance(ans, protos.LookupResult)
        return ans

    assert len(save(a, "a").window_pages) == 2
    held = lookup(a, "a2")
    assert len(held.host_pages) == 3 and len(held.window_pages) == 2
    assert save(b, "b").window_pages == [] and not lookup(b, "b2").lease  # no room beside A's locked window
    assert save(c, "c", ok=False).window_pages == []  # still no room; its full parts are freed
    assert server.stats()["l2"]["swa"]["used_tokens"] == 2 * PS
    server.handle(protos.Release(s, RUN, held.lease, 3))
    assert len(save(c, "c2").window_pages) == 2  # A's window parts give way
    assert not lookup(a, "a3").lease and lookup(c, "c3").window_pages
    failed_d = reserve(server, 11, s, RUN, "d", [4] * (3 * PS), 0)
    used = server.stats()["l2"]["swa"]["used_tokens"]
    server.handle(protos.Commit(s, RUN, failed_d.lease, False))
    assert server.stats()["l2"]["swa"]["used_tokens"] == used - len(failed_d.window_pages) * PS
    server.expire()
    for lease in list(server.leases.leases.values()):
        server.handle(protos.Release(s, RUN, lease.lease_id, 0))
    server.check_idle()
    assert server.integrity_error is None


def test_a_prefix_other_requests_go_on_from_gets_its_window_from_the_next_one_that_holds_it() -> None:
    """A shared prefix S (4 pages): A = S + X saved whole keeps the window of its end only, so
    S + anything else has no hit. B = S + Y, computed in one step (it holds every window
    block: ``window_from`` 0), saves Y's pages and the windows before both S's end and its own;
    then C = S + Z hits S. An engine that no longer holds S's window blocks
    (``window_from`` past them) is asked for none."""
    server = make_window_server()
    reg = window_session(server)
    assert isinstance(reg, protos.EngineRegistered)
    s = reg.session
    shared = list(range(1, 4 * PS + 1))

    def save(tokens: list[int], rid: str, window_from: int = 0) -> protos.Reservation:
        msg = protos.Reserve(7, s, RUN, [protos.SaveRange(rid, protos.pack_tokens(tokens), 0, "", 0, window_from)])
        ans = server.handle(msg)
        assert isinstance(ans, protos.ReserveResult)
        res = ans.items[0]
        if res.lease:
            server.handle(protos.Commit(s, RUN, res.lease, True))
        return res

    def hit(tokens: list[int], rid: str) -> int:
        ans = server.handle(protos.Lookup(8, s, RUN, rid, protos.pack_tokens(tokens)))
        assert isinstance(ans, protos.LookupResult)
        if ans.lease:
            server.handle(protos.Release(s, RUN, ans.lease, len(ans.host_pages)))
        return len(ans.host_pages)

    a = save(shared + [500] * (2 * PS), "a")
    assert a.window_at == [4, 5]
    assert hit(shared + [700] * PS, "c0") == 0
    late = save(shared + [600] * (2 * PS), "b0", window_from=3)  # S's window blocks are gone there
    assert late.start_page == 4 and late.window_at == [4, 5]
    b = save(shared + [650] * (2 * PS), "b", window_from=0)
    assert b.start_page == 4 and b.window_at == [2, 3, 4, 5] and len(b.host_pages) == 2
    assert hit(shared + [700] * PS, "c") == 4
    again = save(shared, "d")  # S's window is held now: nothing to save
    assert again.lease == 0 and not again.window_at
    other = [9] * (4 * PS)
    save(other + [10] * PS, "e")
    alone = save(other, "f")  # a request that is the held prefix alone: its window parts only
    assert alone.lease and not alone.host_pages and alone.window_at == [2]  # page 3 has one from "e"
    assert hit(other, "g") == 4
    server.check_idle()
    assert server.integrity_error is None


def test_a_decoding_request_keeps_the_window_of_its_prompt_end_and_of_its_current_end_only() -> None:
    """Saves of one request: its prompt (6 pages and a token: ``repeat_end`` 6), then one decoded page at a
    time up to 10 pages. The window parts it brought for each decoded end are dropped once
    they fall out of the next end's window, so L2 keeps the prompt end's window and the
    current end's: hits end at 6 or 10 pages, not at 8."""
    server = make_window_server()
    reg = window_session(server)
    assert isinstance(reg, protos.EngineRegistered)
    s = reg.session
    tokens = list(range(1, 10 * PS + 1))

    def save(pages: int, repeat_end: int = 0) -> protos.Reservation:
        first = 0 if pages == 6 else pages - 1
        item = protos.SaveRange("r", protos.pack_tokens(tokens[: pages * PS]), first, "", 0,
                                max(0, pages - 3), repeat_end)
        ans = server.handle(protos.Reserve(9, s, RUN, [item]))
        assert isinstance(ans, protos.ReserveResult)
        res = ans.items[0]
        server.handle(protos.Commit(s, RUN, res.lease, True))
        return res

    def hit(pages: int, rid: str) -> int:
        ans = server.handle(protos.Lookup(8, s, RUN, rid, protos.pack_tokens(tokens[: pages * PS])))
        assert isinstance(ans, protos.LookupResult)
        if ans.lease:
            server.handle(protos.Release(s, RUN, ans.lease, len(ans.host_pages)))
        return len(ans.host_pages)

    assert save(6, repeat_end=6).window_at == [4, 5]
    for pages in (7, 8, 9, 10):
        assert save(pages).window_at == [pages - 1]  # the rest of its window is held
    assert server.stats()["l2"]["swa"]["used_tokens"] == 4 * PS  # the prompt's window and the end's
    assert server.counters.dropped_window_pages == 2
    assert [hit(p, f"h{p}") for p in (6, 8, 10)] == [6, 6, 10]
    server.check_idle()
    assert server.integrity_error is None


def test_a_prompt_of_whole_pages_keeps_the_window_where_it_hits_when_asked_again() -> None:
    """A prompt of exactly 6 pages is saved whole, but asked again it can hit 5 pages only
    (the engine computes its last token): its save brings the windows before both."""
    server = make_window_server()
    reg = window_session(server)
    assert isinstance(reg, protos.EngineRegistered)
    s = reg.session
    tokens = list(range(1, 6 * PS + 1))
    ans = server.handle(protos.Reserve(1, s, RUN, [protos.SaveRange("r", protos.pack_tokens(tokens), 0, "", 0, 0, 5)]))
    assert isinstance(ans, protos.ReserveResult) and ans.items[0].window_at == [3, 4, 5]
    server.handle(protos.Commit(s, RUN, ans.items[0].lease, True))
    hit = server.handle(protos.Lookup(2, s, RUN, "again", protos.pack_tokens(tokens[: 5 * PS])))
    assert isinstance(hit, protos.LookupResult) and len(hit.host_pages) == 5 and len(hit.window_pages) == 2
    server.handle(protos.Release(s, RUN, hit.lease, 5))
    server.check_idle()
    assert server.integrity_error is None


def unit(tokens: list[int], page: int, what: str) -> bytes:
    """What an engine's ``what`` (a page's part, a state) for page ``page`` of ``tokens`` "is"."""
    return hashlib.sha256(repr((what, tokens[: (page + 1) * PS])).encode()).digest()


class RandomTraffic:
    """Random engine traffic over one server, 400 operations: requests that start (a prefix
    of a shared stem and new tokens) and save as they grow, in chunks or a page at a time,
    sometimes after decoding a page (``save(session, rid, tokens, saved, step)``: the model's
    own save of pages ``[saved, step)``); lookups of a running request's prefix or of a new
    prompt (``check(tokens, answer)``: the model's own check), a third of whose leases stay
    held a while; requests ending. Integrity is checked after every operation, and exactly
    once idle at the end, every lease released."""

    def __init__(self, server: CacheServer, sessions: list[int], seed: int) -> None:
        self.server, self.sessions, self.rnd = server, sessions, random.Random(seed)

    def run(self, save: Callable[[int, str, list[int], int, int], None],
            check: Callable[[list[int], protos.LookupResult], None]) -> None:
        rnd, server = self.rnd, self.server
        stems = [[rnd.randrange(1, 30) for _ in range(3 * PS)] for _ in range(3)]
        open_leases: list[tuple[int, int]] = []
        live: list[tuple[int, str, list[int], int]] = []  # (session, rid, tokens, pages saved)
        rids = iter(range(10**6))
        for _ in range(400):
            op = rnd.random()
            if op < 0.35 or not live:  # a request starts: its prompt, saved in one step or in chunks
                tokens = rnd.choice(stems)[: rnd.randrange(1, 4) * PS] + [rnd.randrange(1, 4) for _ in range(
                    rnd.randrange(0, 5) * PS + rnd.randrange(0, PS))]
                live.append((rnd.choice(self.sessions), f"r{next(rids)}", tokens, 0))
            if op < 0.7 and live:  # a running request saves its next pages (a chunk or a decoded page)
                i = rnd.randrange(len(live))
                s, rid, tokens, saved = live[i]
                if rnd.random() < 0.3:
                    tokens = tokens + [rnd.randrange(1, 4) for _ in range(PS)]  # it decoded a page
                end = len(tokens) // PS
                if end > saved:
                    step = rnd.choice([end, min(end, saved + 1)])
                    save(s, rid, tokens, saved, step)
                    live[i] = (s, rid, tokens, step)
            elif op < 0.9:  # a lookup: a prefix of a running request, or of a stem and something new
                if live and rnd.random() < 0.5:
                    asked = rnd.choice(live)[2]
                    tokens = asked[: rnd.randrange(1, len(asked) + 1)]
                else:
                    tokens = rnd.choice(stems)[: rnd.randrange(1, 4) * PS] + [rnd.randrange(1, 4) for _ in range(
                        rnd.randrange(0, 5) * PS)]
                tokens = tokens[: len(tokens) // PS * PS]
                s = rnd.choice(self.sessions)
                ans = server.handle(protos.Lookup(2, s, RUN, f"q{next(rids)}", protos.pack_tokens(tokens)))
                assert isinstance(ans, protos.LookupResult)
                check(tokens, ans)
                if ans.lease:
                    if rnd.random() < 0.3:
                        open_leases.append((s, ans.lease))
                    else:
                        server.handle(protos.Release(s, RUN, ans.lease, len(ans.host_pages)))
            elif open_leases:
                s, lease = open_leases.pop(rnd.randrange(len(open_leases)))
                server.handle(protos.Release(s, RUN, lease, 0))
            if rnd.random() < 0.05:
                live = [x for x in live if rnd.random() < 0.5]  # requests finish
            server.cache.check_integrity()
        for s, lease in open_leases:
            server.handle(protos.Release(s, RUN, lease, 0))
        server.check_idle()
        assert server.integrity_error is None and server.exact_checks == 1


def _sessions(server: CacheServer, register_one: Callable[[CacheServer], protos.Message]) -> list[int]:
    out = []
    for _ in range(3):
        reg = register_one(server)
        assert isinstance(reg, protos.EngineRegistered)
        out.append(reg.session)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_window_engines_never_get_another_prefixes_parts(seed: int) -> None:
    """Requests of a window model saving as they grow (prompts, chunks, decoded pages, some
    failing), lookups holding leases, engines dying, over pools small enough to evict: every
    hit holds exactly its own prefix's full parts and the window parts of its last window
    (the window before it is whole), and idle checks find no leak."""
    server = make_window_server(l2_pages=24, window_pages=7)
    traffic = RandomTraffic(server, _sessions(server, window_session), seed)
    full: dict[int, bytes] = {}
    window: dict[int, bytes] = {}

    def save(s: int, rid: str, tokens: list[int], saved: int, step: int) -> None:
        window_from = max(0, saved * PS - WINDOW_TOKENS) // PS
        repeat = (len(tokens) - 1) // PS if step == len(tokens) // PS else 0
        item = protos.SaveRange(rid, protos.pack_tokens(tokens[: step * PS]), saved, "", 0, window_from, repeat)
        ans = server.handle(protos.Reserve(1, s, RUN, [item]))
        assert isinstance(ans, protos.ReserveResult)
        res = ans.items[0]
        assert all(j >= window_from for j in res.window_at)
        for k, page in enumerate(res.host_pages):
            full[page] = unit(tokens, res.start_page + k, "full")
        for j, page in zip(res.window_at, res.window_pages, strict=True):
            window[page] = unit(tokens, j, "window")
        if res.lease:
            server.handle(protos.Commit(s, RUN, res.lease, traffic.rnd.random() > 0.1))

    def check(tokens: list[int], ans: protos.LookupResult) -> None:
        n = len(ans.host_pages)
        for k, page in enumerate(ans.host_pages):
            assert full[page] == unit(tokens, k, "full"), f"full part {k} of the hit holds other KV"
        assert len(ans.window_pages) * PS >= min(WINDOW_TOKENS, n * PS)  # the window before the hit is whole
        for k, page in enumerate(ans.window_pages):
            assert window[page] == unit(tokens, n - len(ans.window_pages) + k, "window"), "window part of other KV"

    traffic.run(save, check)


STATEFUL = protos.EngineKVGeometry("c" * 64, "bfloat16", PS, 2, 2, 32, "LBHNC", state_layers=2, state_bytes=1000)
"""A model with two attention layers and two state layers (a GDN's), whose states are kept at some page ends."""


def make_state_server(l2_pages: int = 32, state_slots: int = 4) -> CacheServer:
    from hicache.tree.components import MambaComponent

    comps = [FullComponent(PageAllocator(0, "l1-full"), PageAllocator(l2_pages, "l2-full")),
             MambaComponent(PageAllocator(0, "l1-mamba"), PageAllocator(state_slots, "l2-mamba"))]
    cache = UnifiedRadixCache(comps, PS, hasher=HashNamespace(STATEFUL.model_identity, "bfloat16", PS, "full"))
    pool = L2PoolInfo("inst", "inst-full-l2-0", "/dev/shm", l2_pages, STATEFUL.page_bytes,
                      state_segment="inst-mamba-l2-0", state_slots=state_slots,
                      state_bytes=STATEFUL.state_part_bytes)
    clock = Clock()
    return CacheServer(cache, None, STATEFUL, pool, TTL, clock=clock, run=RUN, leases=LeaseTable(TTL, gone=clock.gone))


def state_session(server: CacheServer, state_bytes: int = STATEFUL.state_bytes, tp: int = 1) -> protos.Message:
    g = dataclasses.replace(STATEFUL, state_bytes=state_bytes)
    return server.handle(protos.EngineRegister(1, "engine-s", 322, g, g.page_bytes, RUNTIME, tensor_parallel=tp))


class StateEngine:
    """Saves pages and the states after some of them, writing each as a function of its own
    prefix, and checks that every page and state a lookup hands it is its own prefix's."""

    def __init__(self, server: CacheServer) -> None:
        self.server = server
        reg = state_session(server)
        assert isinstance(reg, protos.EngineRegistered), reg
        self.session = reg.session
        self.pages: dict[int, bytes] = {}
        self.states: dict[int, bytes] = {}
        self.req = 0

    def save(self, rid: str, tokens: list[int], state_pages: list[int], ok: bool = True) -> protos.Reservation:
        self.req += 1
        item = protos.SaveRange(rid, protos.pack_tokens(tokens), 0, state_pages=state_pages)
        ans = self.server.handle(protos.Reserve(self.req, self.session, RUN, [item]))
        assert isinstance(ans, protos.ReserveResult), ans
        got = ans.items[0]
        for i, page in enumerate(got.host_pages):
            self.pages[page] = content(tokens, got.start_page + i)
        for j, slot in zip(got.state_at, got.state_slots, strict=True):
            self.states[slot] = content(tokens, j, "state")
        if got.lease:
            self.server.handle(protos.Commit(self.session, RUN, got.lease, ok))
        return got

    def lookup(self, tokens: list[int], release: bool = True) -> protos.LookupResult:
        self.req += 1
        ans = self.server.handle(protos.Lookup(self.req, self.session, RUN, f"q{self.req}", protos.pack_tokens(tokens)))
        assert isinstance(ans, protos.LookupResult), ans
        for i, page in enumerate(ans.host_pages):
            assert self.pages[page] == content(tokens, i), f"page {i} is another prefix's"
        if ans.host_pages:
            assert self.states[ans.state_slot] == content(tokens, len(ans.host_pages) - 1, "state")
        else:
            assert ans.state_slot == -1
        if ans.lease and release:
            self.server.handle(protos.Release(self.session, RUN, ans.lease, len(ans.host_pages)))
        return ans


def test_a_state_model_hits_only_after_a_page_whose_state_is_kept() -> None:
    """The pages of every saved prefix are kept, a state only after the pages the engine
    offered one for; a hit ends at the last page with a state, and a later save that offers
    the state at a branch point inside a held prefix makes that point a hit."""
    server = make_state_server()
    assert isinstance(state_session(server, state_bytes=999), protos.EngineError)  # another state layout
    assert isinstance(register(server), protos.EngineError)  # no state layers: other pages
    e = StateEngine(server)
    rnd = random.Random(3)
    a = [rnd.randrange(1, 100) for _ in range(6 * PS)]
    got = e.save("a", a, state_pages=[5, 9])  # 9: beyond the range, not kept
    assert len(got.host_pages) == 6 and got.state_at == [5]
    assert len(e.lookup(a + [1]).host_pages) == 6
    branch = a[: 3 * PS] + [rnd.randrange(100, 200) for _ in range(3 * PS)]
    assert e.lookup(branch + [1]).host_pages == []  # a's pages 0-2 are held, but no state after page 2
    got = e.save("b", branch, state_pages=[2, 5])  # the branch point's state and its own end's
    assert got.start_page == 3 and len(got.host_pages) == 3 and got.state_at == [2, 5]
    assert len(e.lookup(branch + [1]).host_pages) == 6
    other = a[: 3 * PS] + [7] * (2 * PS)
    assert len(e.lookup(other).host_pages) == 3  # the branch point is a hit now
    assert len(e.lookup(a + [1]).host_pages) == 6  # and a's end still is
    assert server.counters.committed_states == 3
    assert server.stats()["l2"]["mamba"] == {"used_slots": 3, "capacity_slots": 4, "reserved_slots": 0,
                                             "slot_bytes": 2000}
    assert e.save("a2", a, state_pages=[5]).lease == 0  # all of it held: nothing to save
    server.check_idle()
    assert server.integrity_error is None and server.exact_checks == 1


def test_a_leased_state_is_never_evicted_and_a_failed_save_frees_its_states() -> None:
    server = make_state_server(state_slots=2)
    e = StateEngine(server)
    rnd = random.Random(4)
    prompts = [[rnd.randrange(1, 100) for _ in range(3 * PS)] for _ in range(4)]
    e.save("p0", prompts[0], state_pages=[2])
    held = e.lookup(prompts[0] + [1], release=False)  # p0's state locked under the lease
    assert len(held.host_pages) == 3
    e.save("p1", prompts[1], state_pages=[2])
    e.save("p2", prompts[2], state_pages=[2])  # the pool is full: p1's state goes, p0's is leased
    assert len(e.lookup(prompts[0] + [1]).host_pages) == 3
    assert e.lookup(prompts[1] + [1]).host_pages == []  # its pages stay, without a state: no hit
    assert len(e.lookup(prompts[2] + [1]).host_pages) == 3
    server.handle(protos.Release(e.session, RUN, held.lease, 3))
    used = server.stats()["l2"]["mamba"]["used_slots"]
    failed = e.save("p3", prompts[3], state_pages=[2], ok=False)
    assert failed.state_at == [2]
    assert server.stats()["l2"]["mamba"]["used_slots"] == used - 1  # one evicted to make room, then freed
    assert e.lookup(prompts[3] + [1]).host_pages == []
    server.check_idle()
    assert server.integrity_error is None


@pytest.mark.parametrize("seed", range(6))
def test_random_state_engines_never_get_another_prefixes_pages_or_states(seed: int) -> None:
    """Requests of a GDN model saving as they grow (chunks and decoded pages; the engine
    offers the state at a save's end, at its prompt's last page before its last token and at
    an earlier page where it branches off another request; some saves fail), lookups holding
    leases, over pools small enough to evict pages and states: every hit holds exactly its
    own prefix's pages and the state after its last page, and idle checks find no leak."""
    server = make_state_server(l2_pages=24, state_slots=5)
    traffic = RandomTraffic(server, _sessions(server, state_session), seed)
    pages: dict[int, bytes] = {}
    states: dict[int, bytes] = {}
    hits: list[int] = []

    def save(s: int, rid: str, tokens: list[int], saved: int, step: int) -> None:
        offered = {step - 1, (len(tokens) - 1) // PS - 1}
        if traffic.rnd.random() < 0.3:
            offered.add(traffic.rnd.randrange(0, step))  # a branch point
        offered = {j for j in offered if 0 <= j < step}
        item = protos.SaveRange(rid, protos.pack_tokens(tokens[: step * PS]), saved, state_pages=sorted(offered))
        ans = server.handle(protos.Reserve(1, s, RUN, [item]))
        assert isinstance(ans, protos.ReserveResult)
        res = ans.items[0]
        assert set(res.state_at) <= offered
        for k, page in enumerate(res.host_pages):
            pages[page] = unit(tokens, res.start_page + k, "page")
        for j, slot in zip(res.state_at, res.state_slots, strict=True):
            states[slot] = unit(tokens, j, "state")
        if res.lease:
            server.handle(protos.Commit(s, RUN, res.lease, traffic.rnd.random() > 0.1))

    def check(tokens: list[int], ans: protos.LookupResult) -> None:
        n = len(ans.host_pages)
        for k, page in enumerate(ans.host_pages):
            assert pages[page] == unit(tokens, k, "page"), f"page {k} of the hit holds other KV"
        if n:
            assert states[ans.state_slot] == unit(tokens, n - 1, "state"), "the hit's state is another prefix's"
            hits.append(n)
        else:
            assert ans.state_slot == -1

    traffic.run(save, check)
    assert len(hits) > 10 and server.counters.committed_states > 5  # hits, and states evicted (5 slots)


# ---------------------------------------------------------------------------- pinned prefixes

SYSTEM = list(range(100, 100 + 5 * PS + 2))  # 5 whole pages and 2 tokens


def test_a_pin_waits_for_an_engines_save_then_survives_every_flood() -> None:
    server, _ = make_server(l2_pages=16, pinned=(PinEntry("system", tuple(SYSTEM)),))
    assert server.pins is not None and server.pins.pins == []  # nothing before an engine registers
    eng = FakeEngine(server, {})
    (pin,) = server.stats()["pinned"]
    assert pin["state"] == "waiting" and pin["tokens"] == 5 * PS
    eng.save(SYSTEM + [1, 2, 3, 4, 5, 6])  # the first request that starts with it
    assert server.stats()["pinned"][0]["state"] == "pinned"
    rng = random.Random(2)
    for i in range(12):  # 12 x 4 pages through an L2 of 16, 5 of them pinned
        eng.save([rng.randrange(1000, 9000) for _ in range(4 * PS)], salt=f"flood-{i}")
    hit = eng.lookup(SYSTEM + [7] * PS)
    assert len(hit.host_pages) == 5  # every whole page of the pin, with its own KV (checked by lookup)
    server.check_idle()
    assert server.integrity_error is None


def _pin_states(server: CacheServer) -> list[tuple[str, str]]:
    return [(p["namespace"], p["state"]) for p in server.stats()["pinned"]]


def _namespace(eng: FakeEngine) -> str:
    return next(e["namespace"] for e in eng.server.stats()["engines"] if e["session"] == eng.session)


def test_pins_end_with_their_namespaces_last_session_and_the_share_holds_for_every_namespace() -> None:
    """An engine that resets its cache five times (a new namespace each time, the old
    session left to expire) ends with one namespace's pins locked, not five; a second live
    namespace waits for the share (``no_room``) and starts once the first ends. The saves
    of later requests find room: none is cut short."""
    server, clock = make_server(l2_pages=32, pinned=(PinEntry("system", tuple(SYSTEM)),))  # share: 16 pages
    assert server.pins is not None
    l2: dict[int, bytes] = {}
    rng = random.Random(5)
    eng: FakeEngine | None = None
    for round_ in range(5):
        new = FakeEngine(server, l2, runtime=f"{round_:x}" * 64)  # the reset engine's new identity
        clock.t += TTL + 1  # the old session is left to expire; the new one is alive
        server.handle(protos.Heartbeat(new.session, RUN))
        server.expire()
        eng = new
        assert _pin_states(server) == [(_namespace(eng), "waiting")]
        eng.save(SYSTEM + [round_] * PS)
        assert _pin_states(server) == [(_namespace(eng), "pinned")]
        assert server.stats()["l2"]["full"]["locked_tokens"] == 5 * PS
        assert len(server.pins.pins) == 1  # what a commit looks through does not grow with dead namespaces
    assert eng is not None
    for i in range(12):  # later saves find room: 12 x 6 pages through the 27 pages left beside the pin
        eng.save([rng.randrange(1000, 9000) for _ in range(6 * PS)], salt=f"after-{i}")
    assert server.stats()["engine"]["reserve_short_pages"] == 0
    assert len(eng.lookup(SYSTEM + [9] * PS).host_pages) == 5  # the live namespace's pin held through it
    # a second live namespace (another identity beside it): its pins wait for the share
    share_full, clock = make_server(l2_pages=16, pinned=(PinEntry("system", tuple(SYSTEM)),))  # share: 8 pages
    first = FakeEngine(share_full, {})
    first.save(SYSTEM + [1] * PS)
    other = FakeEngine(share_full, first.l2, runtime="e" * 64)
    assert _pin_states(share_full) == [(_namespace(first), "pinned"), (_namespace(other), "no_room")]
    other.save(SYSTEM + [2] * PS)
    assert share_full.stats()["l2"]["full"]["locked_tokens"] == 5 * PS  # 10 pages would pass the share of 8
    clock.t += TTL + 1
    share_full.handle(protos.Heartbeat(other.session, RUN))
    share_full.expire()  # the first engine's session ends: its pin lets go, the other's starts
    assert _pin_states(share_full) == [(_namespace(other), "pinned")]  # its pages are in L2 already
    assert share_full.stats()["l2"]["full"]["locked_tokens"] == 5 * PS
    share_full.check_idle()
    assert share_full.integrity_error is None


def test_pins_past_the_l2_share_stop_the_start_naming_them() -> None:
    with pytest.raises(ValueError, match="pinned prefix 'big' .* does not fit L2's share"):
        make_server(l2_pages=16, pinned=(PinEntry("a", tuple(range(4 * PS))), PinEntry("big", tuple(range(6 * PS)))))
    with pytest.raises(ValueError, match="less than one page"):
        make_server(pinned=(PinEntry("tiny", (1, 2)),))


def test_a_pin_comes_back_from_l3_when_the_first_engine_registers() -> None:
    server, _clock, sent = make_tiered_server(pinned=(PinEntry("system", tuple(SYSTEM)),))
    l2: dict[int, bytes] = {}
    eng = FakeEngine(server, l2)
    (pin,) = server.stats()["pinned"]
    assert pin["state"] == "loading"
    query = sent[-1]
    assert isinstance(query, protos.PrefetchQuery) and len(query.hashes) == 5
    server.tier.on_message(protos.PrefetchHits(query.op_id, 5))  # type: ignore[union-attr]  # L3 holds it all
    fetch = sent[-1]
    assert isinstance(fetch, protos.PrefetchFetch)
    for i, page in enumerate(fetch.host_pages):  # the "controller" reads L3 into L2
        l2[page] = content(SYSTEM, i, RUNTIME)
    server.tier.on_message(protos.OpDone(fetch.op_id, "ok", 5))  # type: ignore[union-attr]
    server.pins.poll()  # type: ignore[union-attr]
    (pin,) = server.stats()["pinned"]
    assert pin["state"] == "pinned" and pin["from_l3_tokens"] == 5 * PS
    assert len(eng.lookup(SYSTEM).host_pages) == 5  # a hit before any engine computed it here
    server.check_idle()
    assert server.integrity_error is None


# -- a save in flight (engine.save_wait_ms) -----------------------------------------------------------


def _reserve_uncommitted(eng: FakeEngine, tokens: list[int], start_page: int = 0) -> protos.Reservation:
    """``eng`` reserves the pages of ``tokens`` and writes them, but has not committed yet
    (its copy still runs)."""
    ans = reserve(eng.server, eng.next_req(), eng.session, RUN, "prefill", tokens, start_page)
    assert ans.lease and not ans.code, ans
    for i, page in enumerate(ans.host_pages):
        eng.l2[page] = content(tokens, ans.start_page + i, eng.runtime)
    return ans


def _ask(eng: FakeEngine, tokens: list[int], local_pages: int = 0, rid: str = "decode") -> protos.LookupResult:
    ans = eng.server.handle(protos.Lookup(eng.next_req(), eng.session, RUN, rid, protos.pack_tokens(tokens),
                                          local_pages=local_pages))
    assert isinstance(ans, protos.LookupResult), ans
    for i, page in enumerate(ans.host_pages):
        assert eng.l2.get(page) == content(tokens, i, eng.runtime), f"page {i} of the hit holds other KV"
    return ans


def test_a_lookup_waits_for_another_engines_save_in_flight_and_then_hits_all_of_it() -> None:
    server, clock = make_server(save_wait_s=0.5)
    l2: dict[int, bytes] = {}
    prefill, decode = FakeEngine(server, l2), FakeEngine(server, l2)
    tokens = list(range(100, 100 + 5 * PS + 2))
    prefill.save(tokens[: 2 * PS])  # the first two pages are in L2 already
    saving = _reserve_uncommitted(prefill, tokens)
    assert saving.start_page == 2 and len(saving.host_pages) == 3
    first = _ask(decode, tokens)
    assert first.pending and not first.lease and not first.host_pages
    clock.t += 0.1
    assert _ask(decode, tokens).pending
    assert server.counters.lookup_save_waits == 2
    server.handle(protos.Commit(prefill.session, RUN, saving.lease, True))
    hit = _ask(decode, tokens)
    assert not hit.pending and len(hit.host_pages) == 5
    server.handle(protos.Release(decode.session, RUN, hit.lease, 5))
    server.check_idle()


def test_the_wait_is_bounded_per_request_and_then_the_lookup_takes_what_l2_holds() -> None:
    server, clock = make_server(save_wait_s=0.5)
    l2: dict[int, bytes] = {}
    prefill, decode = FakeEngine(server, l2), FakeEngine(server, l2)
    tokens = list(range(200, 200 + 4 * PS))
    prefill.save(tokens[:PS])
    stuck = _reserve_uncommitted(prefill, tokens)  # its commit never comes
    assert _ask(decode, tokens).pending
    clock.t += 0.49
    assert _ask(decode, tokens).pending
    clock.t += 0.02
    late = _ask(decode, tokens)
    assert not late.pending and len(late.host_pages) == 1
    server.handle(protos.Release(decode.session, RUN, late.lease, 1))
    # the same request never waits again, even for another save in flight
    other = _reserve_uncommitted(FakeEngine(server, l2), tokens + [7] * PS, start_page=0)
    assert other.lease
    assert not _ask(decode, tokens).pending
    # another request has its own budget
    assert _ask(decode, tokens, rid="another").pending
    server.handle(protos.Commit(prefill.session, RUN, stuck.lease, False))


def test_no_wait_for_pages_the_engine_holds_itself_or_for_another_prefix() -> None:
    server, _ = make_server(save_wait_s=0.5)
    l2: dict[int, bytes] = {}
    prefill, decode = FakeEngine(server, l2), FakeEngine(server, l2)
    tokens = list(range(300, 300 + 4 * PS))
    prefill.save(tokens[:PS])
    saving = _reserve_uncommitted(prefill, tokens)  # pages 1..3
    held = _ask(decode, tokens, local_pages=4)  # vLLM's own prefix cache holds them all
    assert not held.pending and len(held.host_pages) == 1
    server.handle(protos.Release(decode.session, RUN, held.lease, 1))
    assert _ask(decode, tokens, local_pages=3, rid="r2").pending  # the last page is still to come
    # the same page at the same place after another first page: not this save
    other = [9999] * PS + tokens[PS:]
    prefill.save(other[:PS])
    assert not _ask(decode, other, rid="r3").pending
    server.handle(protos.Commit(prefill.session, RUN, saving.lease, True))
    assert server.counters.lookup_save_waits == 1


def test_an_orphaned_or_failed_reservation_is_not_waited_for() -> None:
    server, clock = make_server(save_wait_s=0.5)
    l2: dict[int, bytes] = {}
    prefill = FakeEngine(server, l2)
    tokens = list(range(400, 400 + 3 * PS))
    failed = _reserve_uncommitted(prefill, tokens)
    server.handle(protos.Commit(prefill.session, RUN, failed.lease, False))
    decode = FakeEngine(server, l2)
    assert not _ask(decode, tokens, rid="a").pending
    _reserve_uncommitted(prefill, tokens)
    assert _ask(decode, tokens, rid="b").pending
    clock.t += TTL + 1
    server.handle(protos.Heartbeat(decode.session, RUN))  # the decode engine stays; the prefill one went silent
    assert server.expire() == 1
    assert not _ask(decode, tokens, rid="c").pending


def test_no_wait_when_save_wait_is_zero() -> None:
    server, _ = make_server(save_wait_s=0.0)
    l2: dict[int, bytes] = {}
    prefill, decode = FakeEngine(server, l2), FakeEngine(server, l2)
    tokens = list(range(500, 500 + 3 * PS))
    saving = _reserve_uncommitted(prefill, tokens)
    assert not _ask(decode, tokens).pending
    server.handle(protos.Commit(prefill.session, RUN, saving.lease, True))
    assert server.counters.lookup_save_waits == 0
