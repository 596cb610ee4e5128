"""Config loading: defaults, overrides, and every problem reported at once with its key path."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hicache.config import ConfigError, HicacheConfig, config_from_dict, dump_yaml, load_config

REPO = Path(__file__).resolve().parents[2]


def _problems(raw: dict, overrides: list[str] | None = None) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)
    out: dict[str, str] = {}
    for p in info.value.problems:
        out[p.path] = f"{out[p.path]}; {p.reason}" if p.path in out else p.reason
    return out


def test_empty_file_and_no_file_give_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HICACHE_CONFIG", raising=False)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    a, b = load_config(empty), load_config(None)
    assert a == b
    assert a.cache.page_size == 16 and a.model.kind == "reference" and a.cache.l3.backend == "file"
    assert a.model.reference.layers == ("full", "full")  # filled from the tiny preset
    assert a.server.host == "127.0.0.1"


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.page_size = 1  # type: ignore[misc]


def test_resolved_config_round_trips_through_yaml() -> None:
    cfg = config_from_dict({"cache": {"page_size": 4, "l1": {"tokens": 64}}})
    again = config_from_dict(yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg


def test_overrides_are_typed_and_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  page_size: 8\n")
    cfg = load_config(path, ["cache.page_size=32", "cache.l3.redis.cluster=true", "server.api_key=secret",
                             "model.reference.layers=[full, swa]"])
    assert cfg.cache.page_size == 32 and cfg.cache.l3.redis.cluster is True
    assert cfg.server.api_key == "secret" and cfg.model.reference.layers == ("full", "swa")


def test_env_var_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cache: {page_size: 64, l1: {tokens: 1024}, l2: {tokens: 4096}}\n")
    monkeypatch.setenv("HICACHE_CONFIG", str(path))
    assert load_config(None).cache.page_size == 64


def test_all_problems_are_reported_with_their_paths() -> None:
    probs = _problems({
        "cache": {"page_size": 12, "l2": {"tokens": "many"}, "l3": {"backend": "redis", "redis": {"url": "http://x"}}},
        "server": {"prot": 1},
        "scheduler": {"policy": "smart"},
    })
    assert set(probs) == {"cache.page_size", "cache.l2.tokens", "cache.l3.redis.url", "server.prot",
                          "scheduler.policy"}
    assert "power of two" in probs["cache.page_size"]
    assert "integer" in probs["cache.l2.tokens"]
    assert "unknown key" in probs["server.prot"]
    assert "one of" in probs["scheduler.policy"]


def test_an_engine_mode_page_is_the_engines_block_and_need_not_be_a_power_of_two() -> None:
    """vLLM sizes a GDN hybrid's block so one page holds a layer's state (96 tokens, say); the
    builtin model keeps power-of-two pages."""
    engine = {"engine": {"kind": "vllm", "model": "/m"}, "cache": {"page_size": 96, "l2": {"tokens": 96 * 64}}}
    assert "cache.page_size" not in _problems(engine)
    assert "cache.l2.tokens" not in _problems(engine)
    assert "positive" in _problems({**engine, "cache": {"page_size": 0, "l2": {"tokens": 96}}})["cache.page_size"]
    assert "cache.l2.tokens" in _problems({**engine, "cache": {"page_size": 96, "l2": {"tokens": 100}}})
    assert "power of two" in _problems({"cache": {"page_size": 96}})["cache.page_size"]


@pytest.mark.parametrize(("raw", "path", "needle"), [
    ({"cache": {"l2": {"tokens": 100}}}, "cache.l2.tokens", "multiple of cache.page_size"),
    ({"cache": {"l2": {"tokens": 2 ** 50}}}, "cache.l2.tokens", "host memory"),
    ({"cache": {"l1": {"tokens": 0}}}, "cache.l1.tokens", "> 0"),
    ({"cache": {"l2": {"enabled": False}}}, "cache.l3.backend", "cache.l2.enabled"),
    ({"cache": {"l3": {"backend": "redis", "redis": {"url": "redis://host:99999"}}}}, "cache.l3.redis.url", "port"),
    ({"cache": {"l3": {"backend": "redis", "redis": {"url": "redis://h/abc"}}}}, "cache.l3.redis.url", "database"),
    ({"cache": {"write_through_threshold": 0}}, "cache.write_through_threshold", ">= 1"),
    ({"cache": {"prefetch": {"policy": "eager"}}}, "cache.prefetch.policy", "one of"),
    ({"model": {"kind": "hf"}}, "model.path", "required"),
    ({"model": {"reference": {"num_heads": 6, "num_kv_heads": 4}}}, "model.reference.num_kv_heads", "divide"),
    ({"model": {"reference": {"layers": ["full", "moe"]}}}, "model.reference.layers[1]", "one of"),
    ({"device": "gpu"}, "device", "cuda"),
    ({"server": {"port": 70000}}, "server.port", "0..65535"),
    ({"cache": {"l1": {"tokens": True}}}, "cache.l1.tokens", "integer"),
    ({"cache": {"l2": {"enabled": "yes"}}}, "cache.l2.enabled", "true or false"),
    ({"cache": "big"}, "cache", "mapping"),
    ({"ipc": {"curve": True}}, "ipc.curve", "unknown key"),
    ({"cache": {"eviction": "s3fifo"}}, "cache.eviction", "one of"),
    ({"device": "cuda"}, "device", "host memory"),
    ({"server": {"body_timeout_s": -1}}, "server.body_timeout_s", "> 0"),
    ({"server": {"controller_op_timeout_s": 0.5}}, "server.controller_op_timeout_s", ">= 1.0"),
    ({"server": {"served_model_names": []}}, "server.served_model_names", "at least one"),
    ({"server": {"served_model_names": ["a", "a"]}}, "server.served_model_names", "repeat"),
    ({"engine": {"kind": "vllm"}}, "engine.model", "required"),
    ({"engine": {"kind": "vllm", "model": "/nonexistent"}}, "engine.model", "config.json"),
    ({"engine": {"kind": "vllm", "model": "/nonexistent"}}, "ipc.dir", "fixed runtime directory"),
    ({"engine": {"kind": "gpu"}}, "engine.kind", "one of"),
    ({"engine": {"lease_ttl_s": 0}}, "engine.lease_ttl_s", "> 0"),
    ({"events": {"enabled": True, "endpoint": "localhost:5557"}}, "events.endpoint", "ZeroMQ endpoint"),
    ({"events": {"enabled": True, "replay_endpoint": "tcp://127.0.0.1:5557"}}, "events.replay_endpoint", "differ"),
    ({"events": {"enabled": True, "replay_batches": 0}}, "events.replay_batches", "> 0"),
    ({"events": {"enabled": "on"}}, "events.enabled", "true or false"),
    ({"events": {"enabled": True, "journal": "/tmp/j"}, "cache": {"l3": {"backend": "none"}}},
     "events.journal", "needs an L3"),
    ({"events": {"enabled": True, "journal": " "}}, "events.journal", "file path"),
    ({"server": {"request_log": ""}}, "server.request_log", "file path"),
    ({"cache": {"pinned": [{"name": "a", "text": "x"}, {"name": "a", "token_ids": [1]}]}}, "cache.pinned[1].name",
     "pinned twice"),
    ({"cache": {"pinned": [{"name": "a b", "text": "x"}]}}, "cache.pinned[0].name", "letters, digits"),
    ({"cache": {"pinned": [{"name": "a", "text": "x", "token_ids": [1]}]}}, "cache.pinned[0]", "exactly one"),
    ({"cache": {"pinned": [{"name": "a"}]}}, "cache.pinned[0]", "exactly one"),
    ({"cache": {"pinned": [{"name": "a", "text": "x", "tiers": ["l3"]}]}}, "cache.pinned[0].tiers", "subset"),
    ({"cache": {"l2": {"enabled": False}, "l3": {"backend": "none"},
                "pinned": [{"name": "a", "text": "x", "tiers": ["l2"]}]}}, "cache.pinned[0].tiers", "l2"),
    ({"cache": {"pinned": [{"name": "a", "text": "x", "tenant": "acme"}]}}, "cache.pinned[0].tenant", "not a tenant"),
    ({"cache": {"pinned_fraction": 1.0}}, "cache.pinned_fraction", "(0, 0.9]"),
    ({"cache": {"pinned": [{"name": "a", "text": "x"}]}, "server": {"api_keys": [{"tenant": "t", "key": "k" * 32}]}},
     "cache.pinned[0].tenant", "never be hit"),
    ({"engine": {"kind": "vllm"}, "cache": {"pinned": [{"name": "a", "text": "x"}]}}, "cache.pinned[0]", "token_ids"),
    ({"engine": {"kind": "vllm"}, "cache": {"pinned": [{"name": "a", "token_ids": [1], "tiers": ["l1"]}]}},
     "cache.pinned[0]", "engines keep L1"),
    ({"server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l2_tokens": 10}}]}},
     "server.api_keys[0].quota.l2_tokens", "positive multiple"),
    ({"server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l2_tokens": 2 ** 20}}]}},
     "server.api_keys", "they reserve L2"),
    ({"server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l2_tokens": 64}},
                              {"tenant": "a", "key": "j" * 32, "quota": {"l2_tokens": 64}}]}},
     "server.api_keys[1].quota", "has a quota already"),
    ({"server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {}}]}},
     "server.api_keys[0].quota", "names no bound"),
    ({"server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l3_gb": -1}}]}},
     "server.api_keys[0].quota.l3_gb", "> 0"),
    ({"cache": {"l3": {"backend": "redis"}}, "server": {"api_keys": [{"tenant": "a", "key": "k" * 32,
                                                                      "quota": {"l3_gb": 1}}]}},
     "server.api_keys[0].quota.l3_gb", "blind to tenants"),
    ({"cache": {"l3": {"file": {"max_size_gb": 0}}},
      "server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l3_gb": 1}}]}},
     "server.api_keys[0].quota.l3_gb", "max_size_gb > 0"),
    ({"cache": {"l3": {"file": {"max_size_gb": 2}}},
      "server": {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l3_gb": 1}},
                              {"tenant": "b", "key": "j" * 32, "quota": {"l3_gb": 1}}]}},
     "server.api_keys", "they reserve L3"),
])
def test_single_problems(raw: dict, path: str, needle: str) -> None:
    probs = _problems(raw)
    assert path in probs, probs
    assert needle in probs[path]


def test_valid_redis_urls() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://user:pw@cache.internal:6380", "unix:///run/redis.sock"):
        cfg = config_from_dict({"cache": {"l3": {"backend": "redis", "redis": {"url": url}}}})
        assert cfg.cache.l3.redis.url == url


def test_bad_override_syntax() -> None:
    probs = _problems({}, ["cache.page_size"])
    assert "--set" in probs
    probs = _problems({"cache": {"page_size": 4}}, ["cache.page_size.x=1"])
    assert "cache.page_size" in probs


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(top)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_check_config_cli_prints_the_resolved_config(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    out = _cli("check-config", str(empty))
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert config_from_dict(resolved) == load_config(empty)
    assert set(resolved) == {f.name for f in dataclasses.fields(HicacheConfig)}


def test_check_config_cli_reports_three_mistakes_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  page_size: 3\n  l1: {tokens: -5}\nserver: {hostname: x}\n")
    out = _cli("check-config", str(bad))
    assert out.returncode == 2
    for path in ("cache.page_size", "cache.l1.tokens", "server.hostname"):
        assert path in out.stderr
    assert "3 problem(s)" in out.stderr


def test_cli_help_and_version() -> None:
    out = _cli("--help")
    assert out.returncode == 0 and "check-config" in out.stdout and "bench" in out.stdout
    out = _cli("version")
    assert out.returncode == 0 and out.stdout.startswith("hicache ")


def test_config_modules_import_only_the_ones_above_them() -> None:
    """``hicache/config/__init__.py``'s table orders the package's modules; each imports only
    those before it (no cycle, at import time or inside a function)."""
    import ast

    import hicache.config

    order = ["schema", "sizing", "security", "validation", "loading"]
    root = Path(hicache.config.__file__).parent
    assert {p.stem for p in root.glob("*.py")} - {"__init__"} == set(order)
    for i, name in enumerate(order):
        tree = ast.parse((root / f"{name}.py").read_text(encoding="utf-8"))
        used = {node.module.removeprefix("hicache.config.") for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hicache.config")}
        assert used <= set(order[:i]), (name, sorted(used - set(order[:i])))
