"""End to end: a standalone daemon's KV events, decoded with vLLM's own ``KVEventBatch``,
keep a router's index equal to what each tier holds: L1 and L2 page counts equal the pools'
(at rest), L3 page hashes equal the file store's objects one for one; a flush empties L1
and L2 in the index and leaves L3; a restarted daemon (SIGTERM, the same endpoints) is told
by the run every batch names, begins with ``AllBlocksCleared`` and announces again, from its
journal, what L3 still holds (whole chains: pages the store lost between the runs, and the
pages after them, are not announced), all fetched from the replay socket by a subscriber
that missed them; a storage detach and a clear remove every L3 page. In both endpoint
modes: the daemon binds (ipc) and the subscriber connects, or the subscriber binds (tcp) and
the daemon connects. The subscriber is what docs/events.md tells a consumer to do."""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hicache.bench.loopback_ports import free_port
from tests.support.daemon import Daemon

kv_events = pytest.importorskip("vllm.distributed.kv_events")

PS = 16


class Index:
    """A subscriber thread: every batch applied in sequence order to a per-medium page set,
    run by run (a batch of another run than the last: the daemon restarted, numbering from 0
    again, and what that run sent before comes from the replay socket)."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, bind: bool = False) -> None:
        self.replay_endpoint = replay_endpoint
        self.expected = 0
        self.run: str | None = None
        self.runs: list[str] = []
        self.replayed = 0
        self.error: BaseException | None = None
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:  # the daemon's publisher connects to it
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.connections = 0
        """Connections made to a publisher (the first, and one after each restart)."""
        self.decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        self.held: dict[str, set[bytes]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        self.parent: dict[bytes, bytes | None] = {}
        self.tokens: dict[bytes, tuple[int, ...]] = {}
        self.topics: set[bytes] = set()
        self.seqs: list[int] = []
        self.cleared = 0
        self.removed: dict[str, int] = {"GPU": 0, "CPU": 0, "STORAGE": 0}
        self.stored: dict[str, int] = {"GPU": 0, "CPU": 0, "STORAGE": 0}
        self.stored_again = 0
        """Pages stored while the index held them already (announced twice, no removal between)."""
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # the test reads it; a dead thread must not look quiet
            self.error = exc

    def _follow(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self.monitor in ready:
                recv_monitor_message(self.monitor)
                self.connections += 1
            if self.sub not in ready:
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            run = run_of(payload)
            if run != self.run:  # a new run (or the first batch seen): it begins at 0
                self.run, self.expected = run, 0
                self.runs.append(run)
            elif seq < self.expected:
                continue  # applied already, from the replay socket
            if seq > self.expected:  # a gap: batches sent before this socket was connected
                for s, missed in _replay(self.replay_endpoint, self.expected):
                    if s < seq and run_of(missed) == run:
                        self.replayed += 1
                        self.apply(topic, s, missed)
            self.apply(topic, seq, payload)
            self.expected = seq + 1

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        with self.lock:
            self.topics.add(topic)
            self.seqs.append(seq)
            for ev in batch.events:
                if isinstance(ev, kv_events.AllBlocksCleared):
                    self.cleared += 1
                    for pages in self.held.values():
                        pages.clear()
                elif isinstance(ev, kv_events.BlockStored):
                    assert ev.block_size == PS and len(ev.token_ids) == PS * len(ev.block_hashes)
                    self.stored_again += len(self.held[ev.medium].intersection(ev.block_hashes))
                    self.stored[ev.medium] += len(ev.block_hashes)
                    self.held[ev.medium].update(ev.block_hashes)
                    for parent, h in zip([ev.parent_block_hash, *ev.block_hashes], ev.block_hashes, strict=False):
                        self.parent[h] = parent
                    for i, h in enumerate(ev.block_hashes):
                        self.tokens[h] = tuple(ev.token_ids[i * PS:(i + 1) * PS])
                else:
                    self.held[ev.medium].difference_update(ev.block_hashes)
                    self.removed[ev.medium] += len(ev.block_hashes)
            self.last = time.monotonic()

    def quiet(self, for_s: float = 1.0, timeout_s: float = 20.0) -> None:
        """Until no batch came for ``for_s`` (the daemon publishes each round's changes at once)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() - self.last < for_s:
            assert self.error is None, repr(self.error)
            assert time.monotonic() < deadline, "the event stream never went quiet"
            time.sleep(0.1)

    def until(self, what: str, check: Any, timeout_s: float = 20.0) -> None:
        """Until ``check()`` holds (events arrive a little after the change they announce)."""
        deadline = time.monotonic() + timeout_s
        while not check():
            assert self.error is None, repr(self.error)
            assert time.monotonic() < deadline, f"the index never showed {what}: {self.counts()}"
            time.sleep(0.1)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {m: len(p) for m, p in self.held.items()}

    def count(self, medium: str) -> int:
        with self.lock:
            return len(self.held[medium])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)
        self.ctx.term()


def run_of(payload: bytes) -> str | None:
    """The daemon run a batch names: ``hicache_run`` in its first event (vLLM's decoder drops
    the key, so a consumer reads it from the msgpack document)."""
    events = msgpack.unpackb(payload, raw=False)[1]
    return events[0].get("hicache_run") if events else None


def _store_objects(root: Path) -> set[bytes]:
    return {bytes.fromhex(p.name.removesuffix(".page")) for p in root.glob("*/*.page")}


def _descends_from(h: bytes, ancestor: bytes, parent: dict[bytes, bytes | None]) -> bool:
    cur = parent.get(h)
    while cur is not None:
        if cur == ancestor:
            return True
        cur = parent.get(cur)
    return False


def _config(tmp: Path, endpoint: str | None = None) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": PS, "l1": {"tokens": 1024}, "l2": {"tokens": 2048},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}},
                  "prefetch": {"threshold_tokens": 1, "policy": "wait_complete"}},
        "events": {"enabled": True, "endpoint": endpoint or f"ipc://{tmp}/events.sock",
                   "replay_endpoint": f"ipc://{tmp}/events-replay.sock", "journal": str(tmp / "l3.journal")},
        "logging": {"level": "warning"},
    }


def _admin(d: Daemon, method: str, path: str, body: Any = None) -> None:
    """A storage admin call, again while the daemon says it is busy (a transfer in flight)."""
    deadline = time.monotonic() + 20
    while True:
        status, answer = d.request(method, path, body)
        if status == 200:
            return
        assert "busy" in str(answer) and time.monotonic() < deadline, (status, answer)
        time.sleep(0.2)


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """The batches the replay socket sends back from ``start`` (vLLM's protocol)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            frames = sock.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return seqs
            seqs.append((seq, frames[3]))
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_the_index_follows_every_tier_through_a_flush_a_restart_and_storage_changes(tmp_path: Path,
                                                                                    mode: str) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}" if mode == "connect" else None
    cfg = _config(tmp_path, endpoint)
    cfg["events"]["bind"] = mode == "bind"  # connect: the subscriber binds, the daemon connects to it
    d = Daemon(tmp_path, cfg, "a")
    index = Index(cfg["events"]["endpoint"], cfg["events"]["replay_endpoint"], bind=mode == "connect")
    d.start()
    try:
        rng = random.Random(7)
        stems = [[rng.randrange(1, 250) for _ in range(96)] for _ in range(3)]
        prompts = [stems[i % 3] + [rng.randrange(1, 250) for _ in range(rng.randrange(20, 200))]
                   for i in range(12)]
        for p in prompts:  # more than L1 (1024 tokens) and L2 (2048) hold: both evict
            d.generate(p, n=4)
        stats = d.wait_tiers_idle("writes and backups done")
        index.quiet()
        assert stats["l1"]["full"]["used_tokens"] == index.count("GPU") * PS > 0
        assert stats["l2"]["full"]["used_tokens"] == index.count("CPU") * PS > 0
        assert index.held["STORAGE"] == _store_objects(tmp_path / "l3") and index.held["STORAGE"]
        assert index.topics == {f"kv@{socket.gethostname()}@hicache-reference-tiny".encode()}
        assert index.seqs == list(range(len(index.seqs)))  # no gap
        assert index.cleared == 1  # the run's first event

        # a subscriber that missed the beginning gets it from the replay socket
        assert [s for s, _ in _replay(cfg["events"]["replay_endpoint"], 0)] == index.seqs

        status, _ = d.request("POST", "/cache/flush")
        assert status == 200
        index.until("L1 and L2 empty", lambda: index.count("GPU") == index.count("CPU") == 0)
        assert index.held["STORAGE"] == _store_objects(tmp_path / "l3")
        samples = d.metric_samples()
        assert samples[("hicache_kv_events_total", frozenset({("outcome", "published")}))] > 0
        for p in prompts[:4]:  # L1 and L2 hold pages again: the restart must clear them
            d.generate(p, n=4)
        d.wait_tiers_idle("writes and backups done")
        index.quiet()
        assert index.count("GPU") > 0 and index.count("CPU") > 0
    finally:
        assert d.stop() == 0

    index.quiet()
    old_run, old_last = index.run, index.expected - 1
    # L3 loses two pages while no daemon runs: the first page of one stem's chain, and a leaf
    # of another; the third stem's chain is the prefix the new run brings back
    stored = set(index.held["STORAGE"])
    parents = {index.parent[h] for h in stored}
    roots = {index.tokens[h]: h for h in stored if index.parent[h] is None}
    kept_root = roots[tuple(prompts[-1][:PS])]
    root = roots[tuple(stems[0][:PS])]
    assert kept_root != root and len(roots) == 3
    leaf = next(h for h in sorted(stored) if h not in parents and h not in roots.values()
                and not _descends_from(h, root, index.parent) and not _descends_from(h, kept_root, index.parent))
    lost = {leaf, root} | {h for h in stored if _descends_from(h, root, index.parent)}
    for h in (leaf, root):
        (tmp_path / "l3" / h.hex()[:2] / f"{h.hex()}.page").unlink()
    d2 = Daemon(tmp_path, cfg, "b")
    connected = index.connections
    d2.start()
    try:
        # the new run's first batches (AllBlocksCleared, the journal's pages) may go out
        # before the subscriber is connected again; the first batch it gets names a new run,
        # and the replay socket gives it the run's beginning. An idle restarted daemon sends
        # nothing (docs/events.md), so the subscriber must be connected again before the
        # request whose batches tell it of the run: ZeroMQ reconnects every 100 to 200 ms, and
        # a request of the tiny model can end, its last batch published, within that
        index.until("the subscriber connected to the new run", lambda: index.connections > connected)
        out = d2.generate(prompts[-1], n=4)
        assert out["meta_info"]["cached_tokens_details"]["storage"] > 0
        stats = d2.wait_tiers_idle("the load-back done", backed_up=False)  # (L3 holds the prefix already)
        index.until("the new run's clear", lambda: index.cleared == 2)
        index.quiet()
        assert index.cleared == 2 and index.run != old_run and len(index.runs) == 2
        assert old_last > 0  # (the old run's numbers went past the new run's first ones)
        # ... but announced again what L3 still holds, whole chains only
        announced = index.held["STORAGE"]
        assert announced >= stored - lost and not announced & lost - _store_objects(tmp_path / "l3")
        assert announced == _store_objects(tmp_path / "l3") - (lost - {leaf, root})
        assert stats["l1"]["full"]["used_tokens"] == index.count("GPU") * PS > 0
        assert stats["l2"]["full"]["used_tokens"] == index.count("CPU") * PS > 0

        # the store detached: L3 holds nothing the index may keep
        _admin(d2, "DELETE", "/cache/storage")
        index.until("L3 empty after the detach", lambda: index.count("STORAGE") == 0)
        # attached again, backed up into, then cleared: the index follows each
        _admin(d2, "PUT", "/cache/storage", {"store": "default"})  # cache.l3 itself: the same directory
        d2.generate(prompts[1] + [7, 7, 7, 7] * 8, n=4)
        d2.wait_tiers_idle("the new pages written", backed_up=False)  # (prefetched pages are not backed up)
        index.until("the new backups", lambda: index.count("STORAGE") > 0)
        index.quiet()
        assert index.held["STORAGE"] <= _store_objects(tmp_path / "l3")
        _admin(d2, "POST", "/cache/storage/clear")
        index.until("L3 empty after the clear", lambda: index.count("STORAGE") == 0)
        index.quiet()
        assert _store_objects(tmp_path / "l3") == set() and index.count("STORAGE") == 0
        assert index.stored_again == 0, index.stored  # only changes are announced
        stats = d2.get("/cache/stats")
        assert stats["l1"]["full"]["used_tokens"] == index.count("GPU") * PS > 0
        assert stats["l2"]["full"]["used_tokens"] == index.count("CPU") * PS > 0
    finally:
        assert d2.stop() == 0
        index.close()


def test_pages_the_l3_store_evicts_leave_the_index(tmp_path: Path) -> None:
    """A file store capped at 40 pages evicts on its own; the controller reports what it
    evicted and the index follows, page for page."""
    cfg = _config(tmp_path)
    object_bytes = PS * 2 * 2 * 2 * 16 * 4 + 96  # tiny: 2 layers x K,V x 2 heads x 16 dims, float32; header
    cfg["cache"]["l3"]["file"]["max_size_gb"] = 40 * object_bytes / 1024**3
    d = Daemon(tmp_path, cfg, "capped")
    index = Index(cfg["events"]["endpoint"], cfg["events"]["replay_endpoint"])
    d.start()
    try:
        rng = random.Random(11)
        for _ in range(10):  # ~90 pages to back up
            d.generate([rng.randrange(1, 250) for _ in range(rng.randrange(100, 180))], n=2)
        d.wait_tiers_idle("writes and backups done")
        on_disk = _store_objects(tmp_path / "l3")
        assert all(p.stat().st_size == object_bytes for p in (tmp_path / "l3").glob("*/*.page"))
        index.until("the store's evictions", lambda: index.held["STORAGE"] == on_disk)
        index.quiet()
        assert index.held["STORAGE"] == _store_objects(tmp_path / "l3") == on_disk
        assert index.removed["STORAGE"] > 0 and len(on_disk) <= 40
    finally:
        assert d.stop() == 0
        index.close()
