"""``hicache check-config`` refuses what ``hicache serve`` refuses at start: exit 2, the dotted
key path and the reason on stderr (``hicache.daemon.startup_checks``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300,
    "max_position_embeddings": 512, "hidden_act": "silu",
}

MISTRAL_SWA = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
"""Every layer sliding-window: served with an index-only Full component."""


def _checkpoint(root: Path, name: str, config: dict[str, Any], weights: str | None = "model.safetensors") -> str:
    """A checkpoint directory as far as the start checks read it: config.json and the names
    of its weight files (the checks list them; they never read them)."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / weights).write_bytes(b"")
    return str(path)


def _run(tmp: Path, command: str, cfg: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = [str(path)] if command == "check-config" else ["--config", str(path)]
    return subprocess.run([sys.executable, "-m", "hicache", command, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def _hf(path: str, **cache: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model": {"kind": "hf", "path": path}}
    if cache:
        cfg["cache"] = cache
    return cfg


def _swa(**cache: Any) -> dict[str, Any]:
    """A full+swa reference model (window 64, pages of 16) with ``cache`` merged in."""
    tiers = {k: {**({"tokens": 65536} if k == "l1" else {}), **cache.pop(k, {})} for k in ("l1", "l2")}
    return {"model": {"reference": {"layers": ["full", "swa"], "sliding_window": 64}},
            "cache": {"page_size": 16, **tiers, **cache}}


# (name, config built from the temporary directory, key path, a word of the reason)
CASES: list[tuple[str, Any, str, str]] = [
    ("cuda", lambda t: {"device": "cuda"}, "device", "host memory"),
    ("cuda-n", lambda t: {"device": "cuda:1"}, "device", "host memory"),
    ("mamba-only", lambda t: {"model": {"reference": {"layers": ["mamba", "mamba"]}}},
     "model.reference.layers", "at least one attention layer"),
    ("hf-missing", lambda t: _hf(str(t / "nowhere")), "model.path", "does not exist"),
    ("hf-no-config", lambda t: _hf(str(t)), "model.path", "config.json"),
    ("hf-architecture", lambda t: _hf(_checkpoint(t, "gpt2", {**LLAMA, "architectures": ["GPT2LMHeadModel"]})),
     "model.path", "unsupported architecture"),
    ("hf-bin-weights", lambda t: _hf(_checkpoint(t, "bin", LLAMA, "pytorch_model.bin")), "model.path",
     "safetensors"),
    ("hf-l2-over-ram", lambda t: _hf(_checkpoint(t, "llama", LLAMA), l2={"tokens": 2**40}), "cache.l2.tokens",
     "host memory"),
    ("tokenizer", lambda t: {"tokenizer": {"path": str(t / "tokenizer.json")}}, "tokenizer.path", "tokenizer.json"),
    ("s3fifo", lambda t: {"cache": {"eviction": "s3fifo"}}, "cache.eviction", "one of lru, lfu, slru, sieve, arc"),
    ("curve", lambda t: {"ipc": {"transport": "tcp", "curve": True}}, "ipc.curve", "unknown key"),
    ("header-timeout", lambda t: {"server": {"header_timeout_s": 0}}, "server.header_timeout_s", "> 0"),
    ("swa-l1-zero", lambda t: _swa(l1={"swa_tokens": 0}), "cache.l1.swa_tokens", "must be > 0, got 0"),
    ("swa-l1-negative", lambda t: _swa(l1={"swa_tokens": -16}), "cache.l1.swa_tokens", "must be > 0"),
    ("swa-l1-not-paged", lambda t: _swa(l1={"swa_tokens": 4100}), "cache.l1.swa_tokens",
     "multiple of cache.page_size (16), got 4100"),
    ("swa-l1-above-full", lambda t: _swa(l1={"swa_tokens": 65536 + 16}), "cache.l1.swa_tokens",
     "<= cache.l1.tokens (65536)"),
    # one prefilling request: swa_request_pages(64, 2048, 16) = 128 + 8 + 1 pages, and its
    # match's window, 4 + 1 pages: 142 pages
    ("swa-l1-below-minimum", lambda t: _swa(l1={"swa_tokens": 2256}), "cache.l1.swa_tokens",
     "at least 2272 tokens, got 2256"),
    ("swa-l2-zero", lambda t: _swa(l2={"swa_tokens": 0}), "cache.l2.swa_tokens", "must be > 0"),
    ("swa-l2-not-paged", lambda t: _swa(l2={"swa_tokens": 24}), "cache.l2.swa_tokens",
     "multiple of cache.page_size (16)"),
    ("swa-l2-above-full", lambda t: _swa(l2={"swa_tokens": 262144 + 16}), "cache.l2.swa_tokens",
     "<= cache.l2.tokens (262144)"),
]


@pytest.mark.parametrize(("make", "path", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_config_refuses_with_the_key_path(tmp_path: Path, make: Any, path: str, needle: str) -> None:
    out = _run(tmp_path, "check-config", make(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    line = next((ln for ln in out.stderr.splitlines() if ln.strip().startswith(f"{path}:")), None)
    assert line is not None, out.stderr
    assert needle in line, line
    assert out.stdout == ""


def test_every_start_problem_is_reported_at_once(tmp_path: Path) -> None:
    cfg = {**_hf(_checkpoint(tmp_path, "bin", LLAMA, "pytorch_model.bin")),
           "tokenizer": {"path": str(tmp_path / "missing")}}
    out = _run(tmp_path, "check-config", cfg)
    assert out.returncode == 2
    assert "2 problem(s)" in out.stderr
    assert "  model.path:" in out.stderr and "  tokenizer.path:" in out.stderr


@pytest.mark.parametrize("layers", [["full", "swa", "mamba"], ["mamba", "full", "swa", "full"]])
def test_full_swa_and_mamba_together_pass(tmp_path: Path, layers: list[str]) -> None:
    out = _run(tmp_path, "check-config", {"model": {"reference": {"layers": layers}}})
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["model"]["reference"]["layers"] == layers


def _l3(tmp: Path, backend: str) -> dict[str, Any]:
    return {"backend": "file", "file": {"dir": str(tmp / "l3")}} if backend == "file" else {"backend": backend}


@pytest.mark.parametrize("backend", ["none", "file"])
@pytest.mark.parametrize("layers", [["swa"], ["swa", "swa"], ["swa", "mamba"]])
def test_patterns_without_a_full_layer_pass_with_or_without_l3(tmp_path: Path, layers: list[str],
                                                               backend: str) -> None:
    out = _run(tmp_path, "check-config", {"model": {"reference": {"layers": layers}},
                                          "cache": {"l3": _l3(tmp_path, backend)}})
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["model"]["reference"]["layers"] == layers
    assert resolved["cache"]["l3"]["backend"] == backend


@pytest.mark.parametrize("backend", ["none", "file"])
def test_an_all_swa_hf_checkpoint_passes_with_or_without_l3(tmp_path: Path, backend: str) -> None:
    out = _run(tmp_path, "check-config", {**_hf(_checkpoint(tmp_path, "mistral", MISTRAL_SWA)),
                                          "cache": {"l3": _l3(tmp_path, backend)}})
    assert out.returncode == 0, out.stderr


def test_a_servable_hf_config_passes(tmp_path: Path) -> None:
    out = _run(tmp_path, "check-config", _hf(_checkpoint(tmp_path, "llama", LLAMA)))
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["model"]["kind"] == "hf"


@pytest.mark.parametrize(("make", "path"), [
    (lambda t: {"model": {"reference": {"layers": ["mamba"]}}}, "model.reference.layers"),
    (lambda t: _hf(_checkpoint(t, "bin", LLAMA, "pytorch_model.bin")), "model.path"),
], ids=["layers", "hf-weights"])
def test_serve_refuses_the_same_configs_before_starting(tmp_path: Path, make: Any, path: str) -> None:
    cfg = {**make(tmp_path), "server": {"port": 0}}
    out = _run(tmp_path, "serve", cfg)
    assert out.returncode == 2, out.stderr
    assert f"  {path}:" in out.stderr
    assert "is serving" not in out.stderr


def test_the_swa_pool_sizes_resolve_to_their_default(tmp_path: Path) -> None:
    """Unset, ``cache.l1.swa_tokens`` is ``swa_pool_tokens``' default: 2 * 32 running
    requests * swa_request_pages(64, 1, 16) (1 + 8 + 1 pages) + ceil((8192 + 2048) / 16)
    pages = 1280 pages, far below the Full pool; L2 gets the same share of its tokens."""
    out = _run(tmp_path, "check-config", _swa())
    assert out.returncode == 0, out.stderr
    cache = yaml.safe_load(out.stdout)["cache"]
    assert cache["l1"]["swa_tokens"] == 1280 * 16 == 20480
    assert cache["l2"]["swa_tokens"] == 262144 * 20480 // 65536 == 81920
    out = _run(tmp_path, "check-config", _swa(l1={"swa_tokens": 4096}, l2={"swa_tokens": 8192}))
    assert out.returncode == 0, out.stderr
    cache = yaml.safe_load(out.stdout)["cache"]
    assert (cache["l1"]["swa_tokens"], cache["l2"]["swa_tokens"]) == (4096, 8192)  # set: kept as given
    out = _run(tmp_path, "check-config", {"model": {"reference": {"layers": ["full", "mamba"]}}})
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["cache"]["l1"]["swa_tokens"] is None  # no swa layers: no pool
