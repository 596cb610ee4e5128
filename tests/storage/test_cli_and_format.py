"""The ``hicache storage`` command, the page format and the resilience pieces."""

from __future__ import annotations

import io
import json
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.bench.local_redis import RedisProcess
from hicache.cli.main import main
from hicache.storage_settings import BUILTIN_L3_BACKENDS, storage_settings_from_config
from storage_backends import (
    FileSettings,
    PageFormatError,
    PageLayout,
    RedisSettings,
    ResilienceSettings,
    StorageConfigError,
)
from storage_backends.page_format import (
    HEADER_SIZE,
    check_object,
    encode_header,
    verify_object,
)
from storage_backends.resilience import CircuitBreaker, ConstantBackoff, ExponentialJitterBackoff
from tests.storage.conftest import LAYOUT, random_hashes, random_pages


def _fill(store: Path, n: int = 5) -> list[str]:
    from storage_backends import create_backend

    be = create_backend(FileSettings(dir=str(store)), LAYOUT)
    h = random_hashes(n)
    assert be.batch_set(h, random_pages(n)) == [True] * n
    be.close()
    return h


def test_cli_file_stats_verify_gc_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "l3"
    h = _fill(store, 6)
    bad = store / h[0][:2] / f"{h[0]}.page"
    data = bytearray(bad.read_bytes())
    data[HEADER_SIZE] ^= 0xFF
    bad.write_bytes(bytes(data))
    base = ["storage", "--backend", "file", "--dir", str(store)]

    assert main([*base, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["pages"] == 6 and stats["bytes"] == 6 * LAYOUT.object_size

    assert main([*base, "verify"]) == 1
    out = capsys.readouterr().out
    assert h[0] in out and "5 ok, 1 bad" in out and bad.exists()
    assert main([*base, "verify", "--delete"]) == 1
    assert not bad.exists()
    assert main([*base, "verify"]) == 0
    capsys.readouterr()

    assert main([*base, "gc", "--to-gb", str(2 * LAYOUT.object_size / 2**30)]) == 0
    assert "evicted 3 pages" in capsys.readouterr().out
    assert main([*base, "clear"]) == 2
    assert main([*base, "clear", "--yes"]) == 0
    assert "removed 2 pages" in capsys.readouterr().out


def test_cli_redis(redis_process: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    from storage_backends import create_backend

    be = create_backend(RedisSettings(url=redis_process.url, key_prefix="cli"), LAYOUT)
    h = random_hashes(4)
    be.batch_set(h, random_pages(4))
    redis_process.client().set(f"cli:{h[1]}", b"garbage")
    base = ["storage", "--backend", "redis", "--url", redis_process.url, "--key-prefix", "cli"]
    assert main([*base, "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pages"] == 4
    assert main([*base, "verify", "--delete"]) == 1
    assert "3 ok, 1 bad, 1 deleted" in capsys.readouterr().out
    assert main([*base, "gc", "--to-gb", "1"]) == 2
    assert main([*base, "clear", "--yes"]) == 0
    assert be.batch_exists(h) == 0
    be.close()


def test_cli_unreachable_store_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["storage", "--backend", "redis", "--url", "redis://127.0.0.1:1/0", "--timeout", "0.2", "stats"]) == 1
    assert "cannot connect" in capsys.readouterr().err
    assert main(["storage", "--backend", "file", "stats"]) == 2


def test_settings_from_config_duck_typed(tmp_path: Path) -> None:
    file_cfg = SimpleNamespace(backend="file", file=SimpleNamespace(dir=str(tmp_path), max_size_gb=2.5))
    s = storage_settings_from_config(file_cfg)
    assert isinstance(s, FileSettings) and s.dir == str(tmp_path) and s.max_bytes == int(2.5 * 2**30)
    redis_cfg = SimpleNamespace(
        backend="redis",
        redis=SimpleNamespace(
            url="rediss://h:6380/1", cluster=True, password="pw", ttl_s=60, key_prefix="x", timeout_s=0.7
        ),
    )
    r = storage_settings_from_config(redis_cfg)
    assert isinstance(r, RedisSettings)
    assert (r.url, r.cluster, r.password, r.ttl_s, r.key_prefix) == ("rediss://h:6380/1", True, "pw", 60, "x")
    assert r.resilience.timeout_s == 0.7
    assert storage_settings_from_config(SimpleNamespace(backend="none")) is None
    with pytest.raises(StorageConfigError, match="unknown L3 backend 's3'.*available: none, file, redis"):
        storage_settings_from_config(SimpleNamespace(backend="s3"))
    with pytest.raises(StorageConfigError):
        storage_settings_from_config(SimpleNamespace(backend="redis", redis=SimpleNamespace(url="http://x")))


def test_settings_from_the_real_config(tmp_path: Path) -> None:
    config = pytest.importorskip("hicache.config")
    cfg = config.load_config(None, [f"cache.l3.file.dir={tmp_path}"])
    s = storage_settings_from_config(cfg.cache.l3)
    assert isinstance(s, FileSettings) and s.dir == str(tmp_path)
    assert s.resilience.timeout_s == 2.0
    cfg = config.load_config(None, [f"cache.l3.file.dir={tmp_path}", "cache.l3.file.timeout_s=7.5"])
    assert storage_settings_from_config(cfg.cache.l3).resilience.timeout_s == 7.5
    with pytest.raises(config.ConfigError, match="cache.l3.file.timeout_s"):
        config.load_config(None, [f"cache.l3.file.dir={tmp_path}", "cache.l3.file.timeout_s=0"])
    for backend in BUILTIN_L3_BACKENDS:
        assert config.load_config(None, [f"cache.l3.backend={backend}"]).cache.l3.backend == backend
    r = storage_settings_from_config(config.load_config(None, ["cache.l3.backend=redis"]).cache.l3)
    assert isinstance(r, RedisSettings) and r.resilience.timeout_s == config.RedisStoreConfig().timeout_s


def test_the_config_redis_section_and_the_redis_settings_agree() -> None:
    """``cache.l3.redis`` is ``RedisSettings`` seen from the config: both take the keys they
    share from ``RedisConnection``, and ``timeout_s`` is the resilience timeout's."""
    import dataclasses

    from hicache.config import RedisStoreConfig
    from hicache.storage_settings import REDIS_CONFIG_KEYS

    section = {f.name: f for f in dataclasses.fields(RedisStoreConfig)}
    settings = {f.name: f for f in dataclasses.fields(RedisSettings)}
    assert set(section) == {*REDIS_CONFIG_KEYS, "timeout_s"}
    for name in REDIS_CONFIG_KEYS:
        assert section[name].default == settings[name].default, name
        assert section[name].metadata.get("secret", False) == (not settings[name].repr), name
    assert RedisStoreConfig().timeout_s == ResilienceSettings().timeout_s


def test_storage_cli_uses_the_settings_module() -> None:
    import hicache.cli.storage as cli

    assert cli.storage_settings_from_config is storage_settings_from_config


# -- page format ------------------------------------------------------------------------------


def test_header_round_trip_and_fields() -> None:
    payload = random_pages(1)[0]
    (key,) = random_hashes(1)
    obj = encode_header(LAYOUT, payload, key) + payload
    assert len(obj) == LAYOUT.object_size
    assert bytes(check_object(LAYOUT, obj, key)) == payload
    hdr = verify_object(obj, key)
    assert (hdr.layout_id, hdr.dtype, hdr.shape, hdr.payload_size) == (7, "bfloat16", (2, 4, 16, 64), 16384)
    assert hdr.version == 2 and hdr.name == bytes.fromhex(key)[:16] and hdr.names(key)
    assert PageLayout(7, "torch.bfloat16", [2, 4, 16, 64]) == LAYOUT  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        dict(layout_id=-1, dtype="uint8", shape=(1,)),
        dict(layout_id=0, dtype="complex64", shape=(1,)),
        dict(layout_id=0, dtype="uint8", shape=()),
        dict(layout_id=0, dtype="uint8", shape=(0,)),
        dict(layout_id=0, dtype="uint8", shape=(1,) * 9),
    ],
)
def test_bad_layouts_are_refused(bad: dict) -> None:
    with pytest.raises(StorageConfigError):
        PageLayout(**bad)


@given(st.binary(min_size=0, max_size=HEADER_SIZE + 64), st.integers(0, 2**32 - 1))
def test_random_bytes_never_verify(blob: bytes, layout_id: int) -> None:
    layout = PageLayout(layout_id, "uint8", (64,))
    with pytest.raises(PageFormatError):
        check_object(layout, blob, "ab" * 32)


@given(st.integers(0, HEADER_SIZE + 63), st.integers(1, 255))
def test_any_single_byte_change_is_detected(pos: int, xor: int) -> None:
    layout = PageLayout(3, "uint8", (64,))
    payload = bytes(range(64))
    key = "5e" * 32
    obj = bytearray(encode_header(layout, payload, key) + payload)
    obj[pos] ^= xor
    with pytest.raises(PageFormatError):
        check_object(layout, obj, key)


# -- resilience -------------------------------------------------------------------------------


def test_exponential_jitter_backoff_bounds() -> None:
    b = ExponentialJitterBackoff(0.1, 2.0, random.Random(1))
    for n in range(1, 40):
        d = b.compute(n)
        cap = min(2.0, 0.1 * 2 ** (n - 1))
        assert cap / 2 <= d <= cap


def test_breaker_trips_at_threshold_and_probe_reattaches() -> None:
    healthy = threading.Event()
    changes: list[bool] = []
    br = CircuitBreaker("t", 3, healthy.is_set, ConstantBackoff(0.01), on_change=changes.append)
    br.record_failure()
    br.record_failure()
    br.record_success()
    br.record_failure()
    br.record_failure()
    assert br.up
    br.record_failure()
    assert not br.up and changes == [False]
    time.sleep(0.1)
    assert not br.up
    healthy.set()
    deadline = time.monotonic() + 5
    while not br.up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert br.up and changes == [False, True]
    br.close()


def _files(store: Path, pattern: str = "*/*.page") -> list[Path]:
    return sorted(store.glob(pattern))


def test_cli_read_only_commands_keep_a_store_over_the_configs_cap(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``stats`` and ``verify`` open a store far above the config's ``max_size_gb`` (another
    daemon's, a lowered cap) and delete nothing: every page stays, and the counts they print
    are those of the files."""
    store = tmp_path / "l3"
    big = PageLayout(7, "uint8", (1 << 20,))  # 1 MiB pages
    from storage_backends import create_backend

    be = create_backend(FileSettings(dir=str(store)), big)
    hashes = random_hashes(40)
    assert be.batch_set(hashes, random_pages(40, big)) == [True] * 40
    be.close()
    before = {p.name: p.stat().st_size for p in _files(store)}
    assert len(before) == 40
    config = tmp_path / "hicache.yaml"
    config.write_text(f"cache:\n  l3:\n    backend: file\n    file:\n      dir: {store}\n      max_size_gb: 0.01\n")

    assert main(["storage", "--config", str(config), "verify"]) == 0
    out = capsys.readouterr().out
    assert "40 ok, 0 bad" in out, out
    assert main(["storage", "--config", str(config), "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert main(["storage", "--config", str(config), "--set", "cache.l3.file.max_size_gb=0.001", "verify"]) == 0
    capsys.readouterr()
    after = {p.name: p.stat().st_size for p in _files(store)}
    assert after == before, f"{len(before) - len(after)} of 40 pages deleted by read-only commands"
    assert stats["pages"] == len(after) and stats["bytes"] == sum(after.values())


def test_cli_verify_deletes_only_what_it_proves_corrupt_and_says_so(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "l3"
    h = _fill(store, 8)
    bad = store / h[3][:2] / f"{h[3]}.page"
    bad.write_bytes(bad.read_bytes()[:-1])
    config = tmp_path / "hicache.yaml"
    config.write_text(f"cache:\n  l3:\n    backend: file\n    file:\n      dir: {store}\n      max_size_gb: 0.00001\n")
    assert main(["storage", "--config", str(config), "verify", "--delete"]) == 1
    out = capsys.readouterr().out
    assert h[3] in out and "7 ok, 1 bad, 1 deleted" in out, out
    assert {p.name for p in _files(store)} == {f"{x}.page" for x in h if x != h[3]}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_file_commands_show_their_progress_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Every command whose work grows with the store shows its progress: the file store's
    walks by shard (``stats``, ``gc``'s scan, ``clear``), ``verify`` and ``gc``'s evictions by page."""
    store = tmp_path / "l3"
    _fill(store, 6)
    base = ["storage", "--backend", "file", "--dir", str(store)]
    shown = {}
    for action in (["stats"], ["verify"], ["gc", "--to-gb", str(2 * LAYOUT.object_size / 2**30)], ["clear", "--yes"]):
        err = _Terminal()
        monkeypatch.setattr(sys, "stderr", err)
        assert main([*base, *action]) == 0
        shown[action[0]] = err.getvalue()
    monkeypatch.undo()
    capsys.readouterr()
    assert "stats" in shown["stats"] and "256/256" in shown["stats"] and "6 pages found" in shown["stats"]
    assert "verify" in shown["verify"] and "6" in shown["verify"]
    assert "scan" in shown["gc"] and "256/256" in shown["gc"] and "6 pages found" in shown["gc"]
    assert "gc" in shown["gc"] and "4/6" in shown["gc"]
    assert "clear" in shown["clear"] and "256/256" in shown["clear"] and "2 pages removed" in shown["clear"]
