"""Per-tenant L3 partitions (``server.api_keys[].quota.l3_gb``) in the controller's
``StorageIO`` over real shared pools and real file stores: each op goes to its tenant's
store, a tenant's partition is evicted only by its own writes, and the shared store's
flood never reaches a partition."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from controller.storage_io import StorageIO
from hicache.hashing import HashNamespace, PageHasher
from hicache.memory.layout import PoolLayout, default_directory, new_instance_id, paged_layout
from hicache.memory.pools import SharedPools, create_pools
from hicache.storage_settings import TENANTS_DIR, tenant_partitions
from storage_backends import FileSettings, RedisSettings, StorageConfigError

PS = 4
HASHER = PageHasher(HashNamespace("partition-test-model", "float32", PS))
GB = 1024**3


@pytest.fixture
def pools() -> Iterator[SharedPools]:
    inst = new_instance_id()
    layout = PoolLayout(inst, default_directory(), (
        paged_layout(inst, "full", PS, 8, 32, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32"),))
    p = create_pools(layout)
    try:
        yield p
    finally:
        p.close()
        p.unlink()


def _chains(first: int, n: int) -> list[list[str]]:
    """``n`` distinct two-page hash chains."""
    return [HASHER.hash_pages(list(range(first + 10 * i, first + 10 * i + 2 * PS))) for i in range(n)]


def _store(pools: SharedPools, tmp: Path, pages_shared: int, pages_a: int) -> StorageIO:
    io = StorageIO(pools, None)
    size = io.default_layout().object_size
    settings = FileSettings(dir=str(tmp / "l3"), max_size_gb=(pages_shared + pages_a) * size / GB, low_water=1.0)
    io.attach(settings, {"a": pages_a * size / GB})
    for backend in (io.backend, *io.partitions.values()):  # a start-up scan beside a write may
        assert backend.wait_scan(30)  # count it twice (the safe side: tests/storage/test_file_store.py)
    return io


def test_each_tenant_writes_and_reads_its_own_partition(pools: SharedPools, tmp_path: Path) -> None:
    io = _store(pools, tmp_path, 8, 8)
    pools["full"].l2[0][:2].copy_(torch.arange(2 * pools["full"].l2[0][0].numel()).view_as(pools["full"].l2[0][:2]))
    (mine,), (shared,) = _chains(1, 1), _chains(1000, 1)
    assert io.backup("full", [0, 1], mine, tenant="a") == 2
    assert io.backup("full", [0, 1], shared, tenant="") == 2
    assert io.query(mine, "a") == 2 and io.query(mine, "") == 0  # the partition is a store of its own
    assert io.query(shared, "") == 2 and io.query(shared, "a") == 0
    assert io.query(shared, "b") == 2  # a tenant without a partition uses the shared store
    assert len(list((tmp_path / "l3" / TENANTS_DIR / "a").glob("*/*.page"))) == 2
    want = pools["full"].l2[0][:2].clone()
    pools["full"].l2[0].zero_()
    assert io.fetch("full", mine, [4, 5], "a") == 2
    assert torch.equal(pools["full"].l2[0][4:6], want)
    size = io.size()
    assert size is not None and size.pages == 4
    (held, cap), = io.partition_sizes().values()
    assert held is not None and held.pages == 2 and cap == 8 * io.default_layout().object_size
    io.clear()
    assert io.query(mine, "a") == 0 and io.query(shared, "") == 0
    io.detach()
    assert io.backend is None and not io.partitions


def test_a_flood_of_the_shared_store_never_evicts_a_partition_and_a_partition_evicts_its_own(
        pools: SharedPools, tmp_path: Path) -> None:
    io = _store(pools, tmp_path, 8, 6)
    mine = _chains(1, 3)  # 6 pages: the whole partition
    for chain in mine:
        assert io.backup("full", [0, 1], chain, tenant="a") == 2
    flood = _chains(5000, 40)  # 80 pages through a shared store of 8
    for chain in flood:
        io.backup("full", [0, 1], chain, tenant="")
    assert all(io.query(chain, "a") == 2 for chain in mine)
    assert sum(io.query(chain, "") == 2 for chain in flood) <= 4
    # the tenant writes past its partition: its own oldest pages go, the shared store's stay
    kept = [chain for chain in flood if io.query(chain, "") == 2]
    assert kept
    more = _chains(9000, 3)
    for chain in more:
        io.backup("full", [0, 1], chain, tenant="a")
    assert io.query(mine[0], "a") == 0 and io.query(more[-1], "a") == 2
    (held, cap), = io.partition_sizes().values()
    assert held is not None and held.bytes <= cap
    assert all(io.query(chain, "") == 2 for chain in kept)
    evicted = set(io.take_evicted())
    assert set(mine[0]) <= evicted and set(flood[0]) <= evicted  # both stores tell their evictions
    io.detach()


def test_partitions_are_refused_where_they_cannot_hold() -> None:
    with pytest.raises(StorageConfigError, match="need a file store"):
        tenant_partitions(RedisSettings(url="redis://127.0.0.1:6379/0"), {"a": 1.0})
    with pytest.raises(StorageConfigError, match="must be less than"):
        tenant_partitions(FileSettings(dir="/tmp/x", max_size_gb=2.0), {"a": 1.0, "b": 1.0})
    shared, parts = tenant_partitions(FileSettings(dir="/tmp/x", max_size_gb=3.0), {"b": 0.5, "a": 1.0})
    assert shared.max_size_gb == 1.5 and list(parts) == ["a", "b"]
    assert parts["a"].dir == f"/tmp/x/{TENANTS_DIR}/a" and parts["a"].max_size_gb == 1.0
    same, none = tenant_partitions(FileSettings(dir="/tmp/x", max_size_gb=3.0), {})
    assert same.max_size_gb == 3.0 and none == {}


def test_attaching_a_store_that_cannot_hold_the_partitions_is_refused_and_keeps_the_old_one(
        pools: SharedPools, tmp_path: Path) -> None:
    io = _store(pools, tmp_path, 8, 8)
    old, parts = io.backend, dict(io.partitions)
    with pytest.raises(StorageConfigError, match="need a file store"):
        io.attach(RedisSettings(url="redis://127.0.0.1:6379/0"), {"a": 0.001})
    assert io.backend is old and io.partitions == parts and io.backend_name == "file"
    io.detach()
