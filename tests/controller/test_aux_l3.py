"""SWA pages and Mamba states through L3: the controller's L2 <-> L3 half (``StorageIO``)
in process over real shared pools, the tree's backup / insert_host of auxiliary data, and
the tier manager's messages, with a file store and (when installed) a real Redis.

A corrupt or mismatched auxiliary object must be refused (a miss, deleted), never copied
into L2; an absent one only shortens the match.

Models without a full-attention layer have an index-only Full component (zero-byte pages):
each of its pages goes to L3 as an index marker under the page hash, and a marker that is
corrupt, of another layout or not the marker is refused like any object.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import protos
from controller.storage_io import INDEX_LAYOUT_ID, INDEX_MARKER, PAGED_LAYOUT_ID, StorageIO
from hicache.bench.local_redis import find_redis_server, started
from hicache.config import PrefetchConfig
from hicache.hashing import HashNamespace, PageHasher, component_key, component_keys
from hicache.memory.allocator import PageAllocator
from hicache.memory.layout import PoolLayout, default_directory, new_instance_id, paged_layout, state_layout
from hicache.memory.pools import SharedPools, create_pools
from hicache.scheduler.controller_driver import ControllerDriver, PrefetchTicket
from hicache.tree.cache import InsertParams, UnifiedRadixCache
from hicache.tree.components import FullComponent, MambaComponent, PagedInsert, SWAComponent
from storage_backends import FileSettings, PageLayout, RedisSettings, create_backend

PS = 4
NS = HashNamespace("aux-test-model", "float32", PS)


def _layout(full_layers: int = 2, mamba: bool = True) -> PoolLayout:
    """Full (``full_layers == 0``: index-only), SWA and, with ``mamba``, Mamba pools."""
    inst = new_instance_id()
    comps = [
        paged_layout(inst, "full", PS, 32, 64, num_layers=full_layers, num_kv_heads=2, head_dim=4, dtype="float32"),
        paged_layout(inst, "swa", PS, 32, 64, num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32"),
    ]
    if mamba:
        comps.append(state_layout(inst, "mamba", 8, 16, num_layers=1, shapes=((3, 4), (4, 2)), dtype="float32"))
    return PoolLayout(inst, default_directory(), tuple(comps))


@contextmanager
def _pools(layout: PoolLayout) -> Iterator[SharedPools]:
    p = create_pools(layout)
    try:
        yield p
    finally:
        p.close()
        p.unlink()


@pytest.fixture
def pools() -> Iterator[SharedPools]:
    with _pools(_layout()) as p:
        yield p


@pytest.fixture(params=["swa-only", "swa+mamba-only"])
def index_pools(request: pytest.FixtureRequest) -> Iterator[SharedPools]:
    """The pools of a model without full-attention layers: an index-only Full component."""
    with _pools(_layout(full_layers=0, mamba=request.param == "swa+mamba-only")) as p:
        yield p


def _backend(kind: str, tmp: Path, io: StorageIO) -> Any:
    if kind == "file":
        return create_backend(FileSettings(dir=str(tmp / "l3")), io.layout_for("full"))
    return create_backend(RedisSettings(url=kind, key_prefix="auxtest"), io.layout_for("full"))


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield "file"
        return
    if find_redis_server() is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with started(tmp_path / "redis") as server:
        yield server.url


def _fill(pools: SharedPools, name: str, units: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for u in units:
        vals = []
        for t in pools[name].l2:
            t[u].copy_(torch.randn(t[u].shape, generator=gen))
            vals.append(t[u].clone())
        out.append(torch.cat([v.flatten() for v in vals]))
    return out


def _read(pools: SharedPools, name: str, unit: int) -> torch.Tensor:
    return torch.cat([t[unit].flatten() for t in pools[name].l2])


def _zero(pools: SharedPools, name: str) -> None:
    for t in pools[name].l2:
        t.zero_()


def test_aux_objects_round_trip_bit_exact_and_query(pools: SharedPools, tmp_path: Path, store: str) -> None:
    io = StorageIO(pools, None)
    io.backend = _backend(store, tmp_path, io)
    hashes = PageHasher(NS).hash_pages(list(range(1, 1 + 3 * PS)))
    swa_keys, mamba_keys = component_keys("swa", hashes), component_keys("mamba", hashes[-1:])
    assert len(set(swa_keys) | set(mamba_keys) | set(hashes)) == 7  # separate namespaces
    swa_want = _fill(pools, "swa", [3, 4, 5], 1)
    mamba_want = _fill(pools, "mamba", [2], 2)
    assert io.backup_aux("swa", [3, 4, 5], swa_keys) == 3
    assert io.backup_aux("mamba", [2], mamba_keys) == 1
    assert io.backup_aux("swa", [3, 4, 5], swa_keys) == 3  # already there: skipped
    assert io.query_aux(swa_keys + mamba_keys + component_keys("mamba", hashes[:1])) == [True] * 4 + [False]
    _zero(pools, "swa")
    _zero(pools, "mamba")
    assert io.fetch_aux("swa", swa_keys, [10, 11, 12]) == [True, True, True]
    assert io.fetch_aux("mamba", mamba_keys + component_keys("mamba", hashes[:1]), [7, 8]) == [True, False]
    for u, want in zip([10, 11, 12], swa_want, strict=True):
        assert torch.equal(_read(pools, "swa", u), want)
    assert torch.equal(_read(pools, "mamba", 7), mamba_want[0])
    assert torch.count_nonzero(_read(pools, "mamba", 8)) == 0  # a miss leaves its slot alone
    io.detach()


def test_corrupt_and_mismatched_aux_objects_are_refused(pools: SharedPools, tmp_path: Path) -> None:
    io = StorageIO(pools, None)
    io.backend = _backend("file", tmp_path, io)
    hashes = PageHasher(NS).hash_pages(list(range(1, 1 + 2 * PS)))
    mkeys = component_keys("mamba", hashes)
    skeys = component_keys("swa", hashes)
    _fill(pools, "mamba", [0, 1], 3)
    _fill(pools, "swa", [0, 1], 4)
    assert io.backup_aux("mamba", [0, 1], mkeys) == 2
    assert io.backup_aux("swa", [0, 1], skeys) == 2
    # flip one payload byte of a state object and of an SWA page: checksum mismatch
    for key in (mkeys[0], skeys[1]):
        path = tmp_path / "l3" / key[:2] / f"{key}.page"
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    _zero(pools, "mamba")
    _zero(pools, "swa")
    assert io.fetch_aux("mamba", mkeys, [5, 6]) == [False, True]
    assert torch.count_nonzero(_read(pools, "mamba", 5)) == 0  # never copied into the slot
    assert io.fetch_aux("swa", skeys, [5, 6]) == [True, False]
    assert not (tmp_path / "l3" / mkeys[0][:2] / f"{mkeys[0]}.page").exists()  # deleted
    assert io.query_aux([mkeys[0], skeys[1]]) == [False, False]
    # an SWA page read as a Mamba state (a key under the wrong component) is refused too
    assert io.fetch_aux("mamba", [skeys[0]], [9]) == [False]
    assert torch.count_nonzero(_read(pools, "mamba", 9)) == 0
    stats = io.backend.stats().as_dict()
    assert stats["corrupt"] >= 3
    io.detach()


def test_aux_checks_refuse_bad_ops(pools: SharedPools) -> None:
    io = StorageIO(pools, None)
    good = "a" * 64
    io.check_aux({"swa": [good]}, {"swa": [1]})
    for keys, pages in (({"nope": [good]}, {"nope": [1]}), ({"swa": ["x"]}, {"swa": [1]}),
                        ({"swa": [good]}, {"swa": [1, 2]}), ({"mamba": [good]}, {"mamba": [10**6]}),
                        ({"swa": [good]}, {"mamba": [1]})):
        with pytest.raises(ValueError):
            io.check_aux(keys, pages)


def test_component_keys_name_the_prefix_and_component() -> None:
    h = PageHasher(NS).hash_pages(list(range(2 * PS)))
    other = PageHasher(NS).hash_pages([9] + list(range(1, 2 * PS)))
    assert component_key("full", h[1]) == h[1]
    assert component_key("swa", h[1]) != component_key("mamba", h[1])
    assert component_key("mamba", h[1]) != component_key("mamba", other[1])
    assert component_key("mamba", h[0]) != component_key("mamba", h[1])
    with pytest.raises(ValueError):
        component_key("swa", "not-a-hash")


# ---- the tree and the tier manager, with StorageIO playing the controller ----------------

class AuxRig:
    """A full+swa(+mamba, when the pools have it) tree with L2, a ControllerDriver whose messages
    StorageIO executes."""

    def __init__(self, pools: SharedPools, backend: Any, window: int = 2 * PS) -> None:
        lay = pools.layout
        self.pools = pools
        self.io = StorageIO(pools, backend, "file")
        self.l1 = {c.name: PageAllocator(c.l1_pages, "l1") for c in lay.components}
        self.l2 = {c.name: PageAllocator(c.l2_pages, "l2") for c in lay.components}
        comps = [FullComponent(self.l1["full"], self.l2["full"]), SWAComponent(self.l1["swa"], window, self.l2["swa"])]
        if "mamba" in self.l1:
            comps.append(MambaComponent(self.l1["mamba"], self.l2["mamba"]))
        self.cache = UnifiedRadixCache(comps, PS, hasher=NS)
        self.sent: list[protos.Message] = []
        self.tier = ControllerDriver(self.cache, self.sent.append, load_back_threshold=0,
                                prefetch=PrefetchConfig(threshold_tokens=PS, policy="wait_complete"),
                                l3_enabled=True)

    def run(self) -> None:
        """Execute every message sent (copies as no-ops, L3 through StorageIO) until none is left."""
        while self.sent:
            msg = self.sent.pop(0)
            if isinstance(msg, (protos.WriteToHost, protos.LoadToDevice)):
                self.tier.on_message(protos.OpDone(msg.op_id, "ok", 0))
            elif isinstance(msg, protos.BackupToStorage):
                done = self.io.backup(msg.component, msg.host_pages, msg.hashes)
                for name, units in msg.aux_pages.items():
                    self.io.backup_aux(name, units, msg.aux_keys[name])
                self.tier.on_message(protos.OpDone(msg.op_id, "ok", done))
            elif isinstance(msg, protos.PrefetchQuery):
                n = self.io.query(msg.hashes)
                present = {k: [i for i, p in enumerate(self.io.query_aux(v[:n])) if p] for k, v in msg.aux_keys.items()}
                self.tier.on_message(protos.PrefetchHits(msg.op_id, n, present))
            elif isinstance(msg, protos.PrefetchFetch):
                done = self.io.fetch(msg.component, msg.hashes, msg.host_pages)
                aux = {k: self.io.fetch_aux(k, msg.aux_keys[k], u) for k, u in msg.aux_pages.items()}
                self.tier.on_message(protos.OpDone(msg.op_id, "ok", done, None, aux))

    def compute(self, tokens: list[int]) -> None:
        """A finished request: Full and SWA pages for every page, the Mamba state at the end."""
        n = len(tokens) // PS
        full = self.l1["full"].alloc(n)
        swa = self.l1["swa"].alloc(n)
        assert full is not None and swa is not None
        aux: dict[str, Any] = {"swa": PagedInsert(list(swa))}
        if "mamba" in self.l1:
            slot = self.l1["mamba"].alloc(1)
            assert slot is not None
            aux["mamba"] = slot[0]
        res = self.cache.insert_with(InsertParams(tokens, list(full), aux=aux))
        if res.prefix_len:  # the tree's pages already: the caller's duplicates
            self.l1["full"].free(list(full)[:res.prefix_len // PS])
        self.tier.issue_writes()
        self.run()

    def flush_and_prefetch(self, prompt: list[int]) -> PrefetchTicket:
        """Empty L1 and L2 (nothing of ``prompt`` matches), then ask L3 for ``prompt``."""
        self.cache.flush()
        self.cache.check_integrity(exact=True)
        m = self.cache.match_prefix(prompt)
        assert m.device_len == 0 and m.host_hit_length == 0
        ticket = self.tier.start_prefetch("r", prompt, m)
        assert ticket is not None
        return ticket


def test_hybrid_prefix_survives_l2_eviction_through_l3(pools: SharedPools, tmp_path: Path) -> None:
    io = StorageIO(pools, None)
    backend = _backend("file", tmp_path, io)
    rig = AuxRig(pools, backend)
    prompt = list(range(1, 1 + 6 * PS))
    rig.compute(prompt)
    assert rig.io.counters.backup_pages == 6 + 6 + 1  # Full, SWA pages, one Mamba state
    ticket = rig.flush_and_prefetch(prompt)
    rig.run()
    assert ticket.complete and ticket.arrived_tokens == 6 * PS
    m = rig.cache.match_prefix(prompt, copy_on_match=False)
    assert m.host_hit_length == 6 * PS  # valid for SWA and Mamba from L2
    assert rig.tier.counters.prefetch_aux_units == 7
    rig.cache.flush()
    rig.cache.check_integrity(exact=True)
    rig.io.detach()


def test_missing_or_corrupt_aux_gives_a_shorter_match_never_other_data(pools: SharedPools, tmp_path: Path) -> None:
    io = StorageIO(pools, None)
    backend = _backend("file", tmp_path, io)
    rig = AuxRig(pools, backend)
    short = list(range(1, 1 + 3 * PS))
    prompt = short + list(range(100, 100 + 3 * PS))
    rig.compute(short)  # a Mamba state after page 3
    rig.compute(prompt)  # and after page 6
    hashes = PageHasher(NS).hash_pages(prompt)
    deep = component_key("mamba", hashes[5])
    path = tmp_path / "l3" / deep[:2] / f"{deep}.page"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    rig.cache.flush()
    ticket = rig.tier.start_prefetch("r", prompt, rig.cache.match_prefix(prompt))
    assert ticket is not None
    rig.run()
    m = rig.cache.match_prefix(prompt, copy_on_match=False)
    assert m.host_hit_length == 3 * PS  # the corrupt deeper state was refused
    assert not os.path.exists(path)
    rig.cache.flush()
    rig.cache.check_integrity(exact=True)
    for name in ("full", "swa", "mamba"):
        assert rig.l2[name].free_count == rig.l2[name].capacity
    rig.io.detach()


# ---- an index-only Full component (no full-attention layer): index markers ----------------

def test_index_only_full_pages_go_to_l3_as_markers(index_pools: SharedPools, tmp_path: Path, store: str) -> None:
    io = StorageIO(index_pools, None)
    marker = PageLayout(INDEX_LAYOUT_ID, "uint8", (1,))
    assert not index_pools["full"].holds_bytes
    assert io.layout_for("full") == io.default_layout() == marker  # what the backend is built with
    io.backend = _backend(store, tmp_path, io)
    hashes = PageHasher(NS).hash_pages(list(range(1, 1 + 3 * PS)))
    assert io.query(hashes) == 0
    assert io.backup("full", [0, 1, 2], hashes[:2]) == 2
    assert io.backup("full", [0, 1, 2], hashes) == 3  # the first two already there: skipped
    assert (io.counters.backup_pages, io.counters.backup_skipped) == (3, 2)
    assert io.counters.bytes_written == 3 * len(INDEX_MARKER)
    if store == "file":
        for h in hashes:  # one object per page under its hash: header and the one-byte marker
            raw = (tmp_path / "l3" / h[:2] / f"{h}.page").read_bytes()
            assert len(raw) == marker.object_size == 97 and raw[-1:] == INDEX_MARKER
    assert io.query(hashes) == 3
    assert io.query(hashes[:1] + PageHasher(NS).hash_pages(list(range(50, 50 + PS)), hashes[0])) == 1
    assert io.fetch("full", hashes, [7, 8, 9]) == 3
    assert io.counters.fetch_pages == 3 and io.counters.fetch_missed == 0
    other = PageHasher(NS).hash_pages(list(range(1, 1 + 2 * PS)) + [99] * PS)
    assert io.fetch("full", other, [7, 8, 9]) == 2  # the third page was never written
    io.detach()


def test_wrong_layout_corrupt_or_foreign_markers_are_refused(index_pools: SharedPools, tmp_path: Path) -> None:
    io = StorageIO(index_pools, None)
    io.backend = _backend("file", tmp_path, io)
    hashes = PageHasher(NS).hash_pages(list(range(1, 1 + 4 * PS)))
    assert io.backup("full", [0, 1], hashes[:2]) == 2
    # page 2: a KV page of a model with full-attention layers under the same hash
    with _pools(_layout()) as kv_pools:
        kv_io = StorageIO(kv_pools, None)
        kv_layout = kv_io.default_layout()
        assert kv_layout.layout_id == PAGED_LAYOUT_ID and kv_layout.payload_size > 1
        assert io.backend.batch_set(hashes[2:3], [bytes(kv_layout.payload_size)], kv_layout) == [True]
        # and a marker read as a KV page by that model is refused too (and deleted)
        kv_io.backend = _backend("file", tmp_path, kv_io)
        assert kv_io.fetch("full", hashes[1:2], [0]) == 0
        assert not (tmp_path / "l3" / hashes[1][:2] / f"{hashes[1]}.page").exists()
        kv_io.detach()
    assert io.backup("full", [1], hashes[1:2]) == 1  # written again
    assert io.fetch("full", hashes[:3], [4, 5, 6]) == 2  # the KV page is no marker: refused
    assert not (tmp_path / "l3" / hashes[2][:2] / f"{hashes[2]}.page").exists()  # deleted
    # page 0 corrupt (its marker byte flipped: checksum mismatch)
    path = tmp_path / "l3" / hashes[0][:2] / f"{hashes[0]}.page"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert io.fetch("full", hashes[:2], [4, 5]) == 0
    assert not path.exists()
    # a well-formed object of the marker layout whose payload is not the marker
    assert io.backend.batch_set(hashes[3:4], [b"\x01"], io.layout_for("full")) == [True]
    assert io.fetch("full", hashes[3:4], [4]) == 0
    assert io.backend.stats().as_dict()["corrupt"] == 2  # the KV page and the flipped marker
    io.detach()


def test_all_swa_prefix_survives_l2_eviction_through_l3(index_pools: SharedPools, tmp_path: Path) -> None:
    """The tree and tier manager of a model without full-attention layers: a backup writes a
    marker per Full page and the SWA pages (and Mamba state) as objects; after a flush the
    prefetch finds the chain, fetches the SWA keys it asked for and the prefix matches."""
    io = StorageIO(index_pools, None)
    rig = AuxRig(index_pools, _backend("file", tmp_path, io))
    mamba = "mamba" in index_pools.components
    prompt = list(range(1, 1 + 6 * PS))
    rig.compute(prompt)
    assert rig.io.counters.backup_pages == 6 + 6 + int(mamba)  # markers, SWA pages, the state
    hashes = PageHasher(NS).hash_pages(prompt)
    assert rig.io.query(hashes) == 6
    assert rig.io.query_aux(component_keys("swa", hashes)) == [True] * 6
    ticket = rig.flush_and_prefetch(prompt)
    assert ticket.aux_keys["swa"] == component_keys("swa", hashes)
    rig.run()
    assert ticket.complete and ticket.arrived_tokens == 6 * PS
    assert rig.tier.counters.prefetch_aux_units == 6 + int(mamba)
    m = rig.cache.match_prefix(prompt, copy_on_match=False)
    assert m.host_hit_length == 6 * PS  # valid SWA windows (and state) from L2
    rig.cache.flush()
    rig.cache.check_integrity(exact=True)
    for name in index_pools.components:
        assert rig.l2[name].free_count == rig.l2[name].capacity
    rig.io.detach()


def test_all_swa_prefix_without_its_swa_objects_does_not_match(index_pools: SharedPools, tmp_path: Path) -> None:
    """The markers alone say which prefix L3 holds, not its KV: with the SWA objects gone,
    the prefetched pages are no valid match."""
    io = StorageIO(index_pools, None)
    rig = AuxRig(index_pools, _backend("file", tmp_path, io))
    prompt = list(range(1, 1 + 6 * PS))
    rig.compute(prompt)
    for key in component_keys("swa", PageHasher(NS).hash_pages(prompt)):
        (tmp_path / "l3" / key[:2] / f"{key}.page").unlink()
    rig.cache.flush()
    ticket = rig.tier.start_prefetch("r", prompt, rig.cache.match_prefix(prompt))
    assert ticket is not None
    rig.run()
    assert ticket.complete
    assert rig.cache.match_prefix(prompt, copy_on_match=False).host_hit_length == 0
    rig.cache.flush()
    rig.cache.check_integrity(exact=True)
    rig.io.detach()


def test_prefetch_that_brings_only_aux_data_is_credited(pools: SharedPools, tmp_path: Path) -> None:
    """L2 holds a prompt's Full pages but not its window pages or state (they were evicted):
    the hybrid match stops at 0. A prefetch then finds the Full pages in the tree already and
    brings only the auxiliary objects; the tokens it made matchable are what it credits
    (``arrived_tokens``, reported as ``storage``), not the zero Full pages it kept."""
    io = StorageIO(pools, None)
    rig = AuxRig(pools, _backend("file", tmp_path, io))
    prompt = list(range(1, 1 + 6 * PS))
    rig.compute(prompt)
    rig.cache.flush()
    host = rig.l2["full"].alloc(6)
    assert host is not None
    assert rig.cache.host.insert_host(prompt, list(host)).host_pages_taken == 6  # Full alone, as after aux eviction
    m = rig.cache.match_prefix(prompt, copy_on_match=False)
    assert m.device_len == 0 and m.host_hit_length == 0  # no window, no state: nothing valid
    ticket = rig.tier.start_prefetch("r", prompt, m)
    assert ticket is not None
    rig.run()
    assert ticket.complete
    assert rig.cache.match_prefix(prompt, copy_on_match=False).host_hit_length == 6 * PS
    assert ticket.arrived_tokens == 6 * PS
    rig.cache.flush()
    rig.cache.check_integrity(exact=True)
    rig.io.detach()
