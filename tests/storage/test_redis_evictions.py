"""A real ``redis-server`` that evicts (``maxmemory``) and expires (``ttl_s``) pages on its
own: ``RedisBackend.take_evicted`` tells exactly the pages that are gone, once each, where
the server publishes key events; nothing where it does not, and the server's
configuration is never changed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hicache.bench.local_redis import started
from storage_backends import RedisSettings, create_backend
from storage_backends.redis_backend import RedisBackend
from storage_backends.redis_evictions import wanted_channels
from tests.storage.conftest import FAST, LAYOUT, NO_REDIS, REDIS_SERVER, random_hashes, random_pages

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS)


def _backend(url: str, **overrides: object) -> RedisBackend:
    backend = create_backend(RedisSettings(url=url, key_prefix="ev", resilience=FAST, **overrides), LAYOUT)  # type: ignore[arg-type]
    assert isinstance(backend, RedisBackend)
    return backend


def _told_until(backend: RedisBackend, want: set[str], timeout_s: float = 10.0) -> list[str]:
    told: list[str] = []
    deadline = time.monotonic() + timeout_s
    while set(told) != want and time.monotonic() < deadline:
        told += backend.take_evicted()
        time.sleep(0.05)
    return told


def test_pages_the_server_evicts_are_told_once(tmp_path: Path) -> None:
    with started(tmp_path / "r", ["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru",
                                  "--notify-keyspace-events", "Ee"]) as server:
        backend = _backend(server.url)
        try:
            assert backend.take_evicted() == []  # subscribes
            hashes = random_hashes(300)  # 300 x 16 KiB: more than twice what the server keeps
            for i in range(0, 300, 20):
                backend.batch_set(hashes[i:i + 20], random_pages(20))
            with server.client() as c:
                c.set(b"other-app:key", b"x")  # not a page of this store: never told
            gone = {h for h, present in zip(hashes, backend.exists_each(hashes), strict=True) if not present}
            assert len(gone) > 100
            told = _told_until(backend, gone)
            assert len(told) == len(set(told)) and set(told) == gone
            assert backend.take_evicted() == []
            with server.client() as c:
                assert set(c.config_get("notify-keyspace-events")["notify-keyspace-events"]) == {"E", "e"}
        finally:
            backend.close()


def test_pages_that_expire_are_told(tmp_path: Path) -> None:
    with started(tmp_path / "r", ["--notify-keyspace-events", "Ex"]) as server:
        backend = _backend(server.url, ttl_s=1)
        try:
            backend.take_evicted()
            hashes = random_hashes(5)
            assert all(backend.batch_set(hashes, random_pages(5)))
            told = _told_until(backend, set(hashes))
            assert sorted(told) == sorted(hashes)
            assert backend.exists_each(hashes) == [False] * 5
        finally:
            backend.close()


def test_a_server_without_key_events_is_not_followed_nor_changed(tmp_path: Path) -> None:
    with started(tmp_path / "r", ["--maxmemory", "1mb", "--maxmemory-policy", "allkeys-lru"]) as server:
        backend = _backend(server.url)
        try:
            assert backend.take_evicted() == []
            hashes = random_hashes(100)
            for i in range(0, 100, 20):
                backend.batch_set(hashes[i:i + 20], random_pages(20))
            assert not all(backend.exists_each(hashes))  # it did evict
            time.sleep(0.3)
            assert backend.take_evicted() == []
            with server.client() as c:
                assert c.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""
        finally:
            backend.close()


def test_which_channels_the_servers_setting_enables() -> None:
    assert wanted_channels("", 0) == []
    assert wanted_channels("ex", 0) == []  # keyspace only, no key-event channel
    assert wanted_channels("Ee", 3) == ["__keyevent@3__:evicted"]
    assert wanted_channels("KEA", 0) == ["__keyevent@0__:evicted", "__keyevent@0__:expired"]
    assert wanted_channels("Exe", 1) == ["__keyevent@1__:evicted", "__keyevent@1__:expired"]
