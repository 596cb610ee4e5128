"""Every object records the page it belongs to (docs/architecture.md §6): a whole, valid
object under another key, and an object of format version 1 (which records no name), are
refused on every read path (file, Redis, Redis Cluster, ``hicache storage verify``): a
counted miss, deleted, never served as another prefix's KV."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hicache.bench.local_redis import RedisProcess
from hicache.cli.main import main
from storage_backends import FileSettings, RedisSettings, create_backend
from storage_backends.page_format import FORMAT_VERSION, NAME_OFFSET
from tests.storage.conftest import LAYOUT, buffers, random_hashes, random_pages


def _version_1(obj: bytes) -> bytes:
    """``obj`` as an older build wrote it: version 1, the name bytes zero."""
    old = bytearray(obj)
    struct.pack_into("<H", old, 4, 1)
    old[NAME_OFFSET:NAME_OFFSET + 16] = bytes(16)
    return bytes(old)


def _page(root: Path, h: str) -> Path:
    return root / h[:2] / f"{h}.page"


def test_file_object_under_another_name_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    be = create_backend(FileSettings(dir=str(root)), LAYOUT)
    a, b, c = random_hashes(3)
    pages = random_pages(2)
    assert be.batch_set([a, c], pages) == [True, True]
    _page(root, b).parent.mkdir(exist_ok=True)
    _page(root, b).write_bytes(_page(root, a).read_bytes())  # an operator's copy under b's name
    _page(root, c).write_bytes(_version_1(_page(root, c).read_bytes()))
    into = buffers(3)
    assert be.batch_get([a, b, c], into) == [True, False, False]
    assert bytes(into[0]) == pages[0]
    st = be.stats()
    assert st.corrupt == 2 and st.hits == 1
    assert _page(root, a).exists() and not _page(root, b).exists() and not _page(root, c).exists()
    be.close()


def test_redis_object_under_another_name_is_refused(redis_process: RedisProcess) -> None:
    be = create_backend(RedisSettings(url=redis_process.url, key_prefix="n"), LAYOUT)
    raw = redis_process.client()
    a, b, c = random_hashes(3)
    pages = random_pages(2)
    assert be.batch_set([a, c], pages) == [True, True]
    raw.set(f"n:{b}", raw.get(f"n:{a}"))
    raw.set(f"n:{c}", _version_1(raw.get(f"n:{c}")))
    into = buffers(3)
    assert be.batch_get([a, b, c], into) == [True, False, False]
    assert bytes(into[0]) == pages[0]
    assert be.stats().corrupt == 2
    assert raw.exists(f"n:{a}") == 1 and raw.exists(f"n:{b}", f"n:{c}") == 0
    be.close()


def test_redis_cluster_object_under_another_name_is_refused(redis_cluster: str) -> None:
    be = create_backend(RedisSettings(url=redis_cluster, cluster=True, key_prefix="nc"), LAYOUT)
    a, b = random_hashes(2)
    page = random_pages(1)
    assert be.batch_set([a], page) == [True]
    obj = be.read_object(a)
    assert obj is not None
    be._client.conn().set(f"nc:{b}".encode(), obj)
    into = buffers(2)
    assert be.batch_get([a, b], into) == [True, False]
    assert bytes(into[0]) == page[0] and be.stats().corrupt == 1
    assert be.read_object(b) is None
    be.close()


def test_verify_names_the_objects_under_another_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "l3"
    be = create_backend(FileSettings(dir=str(root)), LAYOUT)
    a, b, c = random_hashes(3)
    assert be.batch_set([a, c], random_pages(2)) == [True, True]
    be.close()
    _page(root, b).parent.mkdir(exist_ok=True)
    _page(root, b).write_bytes(_page(root, a).read_bytes())
    _page(root, c).write_bytes(_version_1(_page(root, c).read_bytes()))
    base = ["storage", "--backend", "file", "--dir", str(root)]
    assert main([*base, "verify"]) == 1
    out = capsys.readouterr().out
    assert f"{b}: object names page {a[:32]}" in out, out
    assert f"{c}: format version 1" in out and "1 ok, 2 bad" in out, out
    assert FORMAT_VERSION == 2
    assert main([*base, "verify", "--delete"]) == 1
    assert "1 ok, 2 bad, 2 deleted" in capsys.readouterr().out
    assert sorted(p.name for p in root.glob("*/*.page")) == [f"{a}.page"]
