"""The example configs of ``deploy/config/``, each loaded by a real ``hicache check-config``.

A config that names a checkpoint (``/models/...``, absent here) is checked with that one
key pointed at a tiny local checkpoint (``--set``), and its run without the override must
fail on exactly that key, so the override hides nothing else. Everything else in the
file, including its L2 size against this machine's memory, is checked as written.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from hicache.config import is_loopback_host
from tests.deploy.deploy_helpers import CONFIG_DIR, MODEL_KEY, OPERATOR_SECRET, CheckConfig


def test_every_config_is_covered() -> None:
    """Every YAML file of deploy/config/ is one this module checks (a new one must be added)."""
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(MODEL_KEY)


@pytest.mark.parametrize("name", sorted(MODEL_KEY))
def test_check_config_accepts(name: str, config_checks: dict[str, CheckConfig]) -> None:
    """``hicache check-config`` exits 0 on the file and resolves the keys the file sets to
    the values it wrote (nothing was silently dropped or defaulted)."""
    resolved = config_checks[name].resolved()
    written = yaml.safe_load((CONFIG_DIR / name).read_text())
    key = MODEL_KEY[name]
    supplied = "server.operator.key_file" if OPERATOR_SECRET.get(name, ("",))[0] == "file" else None

    def compare(w: Any, r: Any, path: str) -> None:
        if isinstance(w, dict):
            assert isinstance(r, dict), path
            for k, v in w.items():
                compare(v, r[k], f"{path}.{k}" if path else k)
        elif path not in (key, supplied):
            assert r == w or (isinstance(w, int) and r == float(w)), f"{name}: {path} resolved to {r!r}, wrote {w!r}"

    compare(written, resolved, "")


@pytest.mark.parametrize("name", sorted(k for k, v in MODEL_KEY.items() if v))
def test_checkpoint_is_the_only_missing_piece(name: str, config_checks: dict[str, CheckConfig]) -> None:
    """Without the tiny checkpoint, check-config refuses the file (exit 2) for the checkpoint
    key alone: the override in the accepting run stands in for nothing else."""
    r = config_checks[f"{name} (no checkpoint)"]
    assert r.returncode == 2, r.stdout + r.stderr
    problems = [line.strip() for line in r.stderr.splitlines() if line.startswith("  ")]
    assert problems and all(p.startswith(f"{MODEL_KEY[name]}:") for p in problems), r.stderr


def test_layer_kinds_of_hybrid() -> None:
    """hybrid.yaml combines full attention with other layer kinds (what this build serves)."""
    layers = yaml.safe_load((CONFIG_DIR / "hybrid.yaml").read_text())["model"]["reference"]["layers"]
    assert "full" in layers and {"mamba", "swa"} & set(layers), layers


def test_full_swa_mamba_is_accepted(config_checks: dict[str, CheckConfig]) -> None:
    """A full + swa + mamba pattern is served: check-config accepts it, and hybrid.yaml uses
    all three kinds (and no longer says the pattern is refused)."""
    r = config_checks["hybrid.yaml with full+swa+mamba"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.resolved()["model"]["reference"]["layers"] == ["full", "swa", "mamba"]
    text = (CONFIG_DIR / "hybrid.yaml").read_text()
    assert {"full", "swa", "mamba"} <= set(yaml.safe_load(text)["model"]["reference"]["layers"])
    assert "not both" not in text


def test_engine_mode_config() -> None:
    """vllm-sidecar.yaml is engine mode with a fixed ipc.dir (engines find the socket there)
    and a page size vLLM's CPU backend takes (a multiple of 32)."""
    cfg = yaml.safe_load((CONFIG_DIR / "vllm-sidecar.yaml").read_text())
    assert cfg["engine"]["kind"] == "vllm"
    assert cfg["ipc"]["dir"]
    assert cfg["cache"]["page_size"] % 32 == 0


def test_no_cuda_config() -> None:
    """No config asks for a CUDA L1 (refused by this build): none sets device to cuda."""
    for path in CONFIG_DIR.glob("*.yaml"):
        assert "cuda" not in str(yaml.safe_load(path.read_text()).get("device", "")), path


@pytest.mark.parametrize("name", sorted(MODEL_KEY))
def test_safe_as_shipped(name: str, config_checks: dict[str, CheckConfig]) -> None:
    """A config that listens beyond loopback names the operator's key, from a variable or a
    file a secret provides (never inline), and without that secret check-config refuses it
    naming the key's source (the daemon does not start without its key); KV events, where a
    config names them, stay on loopback."""
    cfg = yaml.safe_load((CONFIG_DIR / name).read_text())
    server = cfg.get("server", {})
    events = cfg.get("events") or {}
    if "endpoint" in events:
        host = events["endpoint"].removeprefix("tcp://").rpartition(":")[0]
        assert is_loopback_host(host), f"{name}: events on {events['endpoint']}"
    if is_loopback_host(server.get("host", "127.0.0.1")):
        assert name not in OPERATOR_SECRET
        return
    kind, where = OPERATOR_SECRET[name]
    operator = server.get("operator") or {}
    assert "key" not in operator and operator.get(f"key_{kind}") == where, (name, operator)
    assert not server.get("allow_unauthenticated"), name
    refused = config_checks[f"{name} (no operator key)"]
    assert refused.returncode == 2, refused.stdout
    assert ("server.operator.key_" + kind) in refused.stderr, refused.stderr
