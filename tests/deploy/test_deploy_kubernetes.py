"""``deploy/kubernetes/``: every built-in resource validated by ``kubernetes-validate``
(strict: unknown fields are errors) against the Kubernetes schemas, the PodMonitor (a CRD
it has no schema for) checked by structure, and what ties the manifests together: the
probes, the volumes the vLLM and hicache containers share, the Secret the Redis password
comes from (an environment variable named by ``cache.l3.redis.password_env``), the requests
and limits against L2, the Service and PodMonitor ports, and each ConfigMap's config accepted
by ``hicache check-config`` with the container's own arguments and environment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_helpers import (
    K8S_DEPLOYMENTS,
    K8S_DIR,
    LLAMA_31_8B,
    CheckConfig,
    container_env,
    deployment_config,
    expand_args,
    hicache_container,
    k8s_docs,
    k8s_find,
    pool_bytes,
    quantity_bytes,
    run,
    secret_env_names,
    tool,
)

CRD_KINDS = {"PodMonitor"}
OPERATOR_SECRET = "hicache-operator"
OPERATOR_VAR = "HICACHE_OPERATOR_KEY"
K8S_VERSIONS = ("1.29.0", "1.37.0")


def builtin_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in k8s_docs() if d["kind"] not in CRD_KINDS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_validate(version: str, tmp_path: Path) -> None:
    """Every built-in resource passes ``kubernetes-validate --strict`` for Kubernetes
    ``version`` (the CRD documents are validated below, by structure)."""
    files = []
    for i, (path, doc) in enumerate(builtin_docs()):
        f = tmp_path / f"{i:02d}-{path.stem}-{doc['kind']}.yaml"
        f.write_text(yaml.safe_dump(doc))
        files.append(str(f))
    assert len(files) >= 8
    proc = run([tool("kubernetes-validate"), "--strict", "-k", version, *files])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(files), proc.stdout + proc.stderr


def test_kubernetes_validate_catches_a_bad_manifest(tmp_path: Path) -> None:
    """The validation is real: a misspelt probe field and a port given as text each fail it."""
    files = []
    for what in ("field", "type"):
        dep = k8s_find("Deployment", "hicache")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        if what == "field":
            c["readinessProbe"]["httpGet"]["paht"] = "/health"  # unknown in strict mode
        else:
            c["ports"][0]["containerPort"] = "thirty"
        files.append(tmp_path / f"bad-{what}.yaml")
        files[-1].write_text(yaml.safe_dump(dep))
    proc = run([tool("kubernetes-validate"), "--strict", *map(str, files)])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "'paht'" in out and "'thirty'" in out, out


def test_podmonitor() -> None:
    """The PodMonitor (monitoring.coreos.com/v1) selects the labels every hicache pod has
    and scrapes /metrics on the container port named in both Deployments, relabelled to
    job="hicache" (what the alert rules match)."""
    pms = [d for _p, d in k8s_docs() if d["kind"] == "PodMonitor"]
    assert len(pms) == 1
    pm = pms[0]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm) <= {"apiVersion", "kind", "metadata", "spec"} and pm["metadata"]["name"]
    spec = pm["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
    selector = spec["selector"]["matchLabels"]
    endpoints = spec["podMetricsEndpoints"]
    assert endpoints, "no podMetricsEndpoints"
    allowed = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings", "scheme",
               "authorization"}
    for ep in endpoints:
        assert set(ep) <= allowed, set(ep) - allowed
        assert ep["path"] == "/metrics"
        auth = ep["authorization"]  # /metrics needs the operator's key: the hicache containers' Secret
        assert auth["type"] == "Bearer" and auth["credentials"] == {"name": OPERATOR_SECRET, "key": "key"}
        for key in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"\d+(ms|s|m|h)", ep[key]), ep[key]
        for r in ep.get("relabelings", []):
            assert r["action"] in ("replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep")
    assert any(r.get("targetLabel") == "job" and r.get("replacement") == "hicache"
               for ep in endpoints for r in ep.get("relabelings", []))
    for name in K8S_DEPLOYMENTS:
        dep = k8s_find("Deployment", name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), f"{name}'s pods are not selected"
        ports = {p["name"] for p in hicache_container(dep)["ports"]}
        assert {ep["port"] for ep in endpoints} & ports, f"{name}: no scraped port"


@pytest.mark.parametrize("name", K8S_DEPLOYMENTS)
def test_probes(name: str) -> None:
    """hicache's readiness probe is /health (503 while a process is dead, stale or draining)
    and its liveness probe /health?live=1 (200 while the HTTP process answers: a degraded
    daemon is taken out of the Service, not restarted); both on the config's server.port."""
    dep = k8s_find("Deployment", name)
    c = hicache_container(dep)
    cfg = yaml.safe_load(deployment_config(dep)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/health?live=1")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, f"{probe}: {get['path']}"
        assert ports.get(get["port"], get["port"]) == cfg["server"]["port"]
    assert c["startupProbe"]["httpGet"]["path"] == "/health?live=1"
    assert cfg["server"]["host"] == "0.0.0.0", "the kubelet probes the pod's IP"


def test_sidecar_shares_shm_and_runtime_dir() -> None:
    """In the vLLM pod both containers mount the same memory-backed emptyDir at /dev/shm, the
    same volume at the config's ipc.dir, the same config and checkpoint paths, and run as
    one non-root uid; vLLM loads hicache.connectors.vllm with the mounted config, with a
    --block-size equal to the daemon's page size and the model engine.model names."""
    dep = k8s_find("Deployment", "vllm-hicache")
    pod = dep["spec"]["template"]["spec"]
    cfg = yaml.safe_load(deployment_config(dep)[1])
    assert cfg["engine"]["kind"] == "vllm"
    volumes = {v["name"]: v for v in pod["volumes"]}
    containers = {c["name"]: c for c in pod["containers"]}
    vllm, hc = containers["vllm"], hicache_container(dep)

    def mounts(c: dict[str, Any]) -> dict[str, str]:
        return {m["mountPath"]: m["name"] for m in c["volumeMounts"]}

    mv, mh = mounts(vllm), mounts(hc)
    assert mv["/dev/shm"] == mh["/dev/shm"] and volumes[mh["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    ipc_dir = cfg["ipc"]["dir"]
    assert mv[ipc_dir] == mh[ipc_dir] and "emptyDir" in volumes[mh[ipc_dir]]
    args = vllm["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "HiCacheConnector" and kv["kv_connector_module_path"] == "hicache.connectors.vllm"
    config_path = kv["kv_connector_extra_config"]["hicache_config"]
    assert config_path == deployment_config(dep)[0]
    config_mount = next(p for p in mh if config_path.startswith(p.rstrip("/") + "/"))
    assert mv[config_mount] == mh[config_mount]
    assert int(args[args.index("--block-size") + 1]) == cfg["cache"]["page_size"]
    assert args[args.index("--model") + 1] == cfg["engine"]["model"]
    model_mount = next(p for p in mh if cfg["engine"]["model"].startswith(p.rstrip("/") + "/"))
    assert mv[model_mount] == mh[model_mount]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    for c in (vllm, hc):
        assert "runAsUser" not in c.get("securityContext", {}), "both containers must run as the pod's uid"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def _effective_redis(dep: dict[str, Any]) -> dict[str, Any]:
    """``cache.l3.redis`` as the hicache container sees it: the ConfigMap's, with the
    container's ``--set cache.l3.redis.KEY=VALUE`` arguments applied (the values as YAML)."""
    redis = dict(yaml.safe_load(deployment_config(dep)[1])["cache"]["l3"]["redis"])
    for arg in expand_args(hicache_container(dep)):
        if arg.startswith("cache.l3.redis."):
            key, _, value = arg.removeprefix("cache.l3.redis.").partition("=")
            redis[key] = yaml.safe_load(value)
    return redis


@pytest.mark.parametrize("name", K8S_DEPLOYMENTS)
def test_redis_password_from_secret(name: str) -> None:
    """The Redis password reaches the daemon from a Secret of the repository as an environment
    variable of the hicache container only (a secretKeyRef), named by
    ``cache.l3.redis.password_env``; no other password source is set, the URL has no user
    info, and neither the ConfigMap nor any container's arguments (expanded as Kubernetes
    does) hold the password or refer to a Secret-sourced variable."""
    dep = k8s_find("Deployment", name)
    c = hicache_container(dep)
    redis = _effective_redis(dep)
    var = redis.get("password_env")
    assert var, f"{name}: cache.l3.redis.password_env is not set: {redis}"
    assert not redis.get("password") and not redis.get("password_file"), redis
    assert "@" not in redis["url"] and "password" not in redis["url"], redis["url"]
    env = next(e for e in c["env"] if e["name"] == var)
    ref = env["valueFrom"]["secretKeyRef"]
    secret = k8s_find("Secret", ref["name"])
    password = secret["stringData"][ref["key"]]
    assert password and "://" not in password, "the Secret holds the password alone, not a URL"
    assert secret_env_names(c) == {var, OPERATOR_VAR}
    text = deployment_config(dep)[1]
    assert password not in text
    for container in dep["spec"]["template"]["spec"]["containers"]:
        args = container.get("args", []) + container.get("command", [])
        assert not any(password in a for a in expand_args(container) + args), container["name"]
        assert not any(f"$({v})" in a for v in secret_env_names(c) for a in args), container["name"]
        if container is not c:
            assert not secret_env_names(container), f"{container['name']} gets a Secret it does not need"


@pytest.mark.parametrize("name", K8S_DEPLOYMENTS)
def test_configmap_config_is_accepted(name: str, config_checks: dict[str, CheckConfig]) -> None:
    """``hicache check-config`` accepts the ConfigMap's config with the hicache container's
    arguments and environment as the kubelet sets them (the Secret's variable in, the
    checkpoint key pointed at a tiny checkpoint): the resolved L3 is the ConfigMap's URL with
    ``password_env`` naming the variable; without the Secret's variable it is refused,
    naming ``cache.l3.redis.password_env`` (so the variable is what the check found)."""
    dep = k8s_find("Deployment", name)
    redis = _effective_redis(dep)
    resolved = config_checks[f"k8s:{name}"].resolved()["cache"]["l3"]["redis"]
    assert resolved["url"] == redis["url"] and resolved["password_env"] == redis["password_env"], resolved
    password = k8s_find("Secret", "hicache-redis")["stringData"]["password"]
    assert password not in config_checks[f"k8s:{name}"].stdout
    refused = config_checks[f"k8s:{name} without the Secret"]
    assert refused.returncode != 0, refused.stdout
    assert "cache.l3.redis.password_env" in refused.stderr and redis["password_env"] in refused.stderr, \
        refused.stderr


def test_vllm_container_loads_the_config_without_the_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            tiny_checkpoint: Path) -> None:
    """The connector in the vllm container reads the same ConfigMap file (``load_config``, as
    ``hicache.connectors.vllm`` does) with the vllm container's environment, which has no
    Redis password: the file must name no password source it would have to find
    (``engine.model`` pointed at a tiny checkpoint, the only other thing the pod supplies)."""
    from hicache.config import load_config

    dep = k8s_find("Deployment", "vllm-hicache")
    vllm = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    hicache_vars = set(container_env(hicache_container(dep)))
    for var in hicache_vars - set(container_env(vllm)):
        monkeypatch.delenv(var, raising=False)
    for key, value in container_env(vllm).items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "hicache.yaml"
    path.write_text(deployment_config(dep)[1])
    cfg = load_config(path, [f"engine.model={tiny_checkpoint}"])
    assert cfg.cache.l3.backend == "redis" and cfg.cache.l3.redis.password_env is None


@pytest.mark.parametrize("name", K8S_DEPLOYMENTS)
def test_resources_cover_l2(name: str) -> None:
    """Requests and limits cover the pools the ConfigMap's config makes, for the model the
    manifests name (bfloat16 Llama-3.1-8B): the /dev/shm emptyDir holds L2; the hicache
    container's memory request holds L2 (and L1 and the weights in builtin mode, where the
    daemon runs the model); in the vLLM pod, vLLM's limit leaves room above its request for
    the L2 pages its worker writes first (tmpfs pages are charged to the first writer)."""
    dep = k8s_find("Deployment", name)
    pod = dep["spec"]["template"]["spec"]
    cfg = yaml.safe_load(deployment_config(dep)[1])
    l1, l2 = pool_bytes(cfg)
    volumes = {v["name"]: v for v in pod["volumes"]}
    c = hicache_container(dep)
    shm = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert quantity_bytes(volumes[shm]["emptyDir"]["sizeLimit"]) >= l2
    need = l2 + (l1 + LLAMA_31_8B["weights_bytes"] if cfg.get("engine", {}).get("kind") != "vllm" else 0)
    request = quantity_bytes(c["resources"]["requests"]["memory"])
    limit = quantity_bytes(c["resources"]["limits"]["memory"])
    assert request >= need and limit >= request, (request, need)
    for other in pod["containers"]:
        if other is c:
            continue
        r, lim = (quantity_bytes(other["resources"][k]["memory"]) for k in ("requests", "limits"))
        assert lim - r >= l2, f"{other['name']}: limit {lim} - request {r} < L2 {l2}"


@pytest.mark.parametrize("name", K8S_DEPLOYMENTS)
def test_service_exposes_the_http_port(name: str) -> None:
    """A Service selects the Deployment's pods and exposes the hicache HTTP / metrics port."""
    dep = k8s_find("Deployment", name)
    svc = k8s_find("Service", name)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    port_names = {p["name"] for p in hicache_container(dep)["ports"]}
    cfg = yaml.safe_load(deployment_config(dep)[1])
    assert any(p["targetPort"] in port_names and p["port"] == cfg["server"]["port"] for p in svc["spec"]["ports"])


def test_every_manifest_is_covered() -> None:
    """Every file of deploy/kubernetes is one of those checked here, and every Deployment
    that runs hicache is in K8S_DEPLOYMENTS."""
    assert {p.name for p in K8S_DIR.glob("*")} == {"hicache.yaml", "vllm-hicache.yaml", "redis-secret.yaml",
                                                   "operator-secret.yaml", "models-pvc.yaml", "podmonitor.yaml"}
    deps = {d["metadata"]["name"] for _p, d in k8s_docs() if d["kind"] == "Deployment"}
    assert deps == set(K8S_DEPLOYMENTS)


@pytest.mark.parametrize("name", K8S_DEPLOYMENTS)
def test_operator_key_from_secret(name: str, config_checks: dict[str, CheckConfig]) -> None:
    """Safe as shipped: the pod's IP is reachable, so the config names the operator's key
    (``server.operator.key_env``), which only the hicache container gets, from the Secret
    hicache-operator (what the PodMonitor scrapes with); the config has no tenant-less
    ``api_key`` and does not allow unauthenticated access; without the operator's variable
    check-config refuses it naming the variable; KV events, if named, stay on loopback."""
    dep = k8s_find("Deployment", name)
    cfg = yaml.safe_load(deployment_config(dep)[1])
    server = cfg["server"]
    assert server["host"] == "0.0.0.0"
    assert server["operator"] == {"key_env": OPERATOR_VAR}, server
    assert "api_key" not in server and not server.get("allow_unauthenticated")
    c = hicache_container(dep)
    ref = next(e for e in c["env"] if e["name"] == OPERATOR_VAR)["valueFrom"]["secretKeyRef"]
    assert ref == {"name": OPERATOR_SECRET, "key": "key"}
    for other in dep["spec"]["template"]["spec"]["containers"]:
        if other is not c:
            assert OPERATOR_VAR not in {e["name"] for e in other.get("env", [])}, other["name"]
    key = k8s_find("Secret", OPERATOR_SECRET)["stringData"]["key"]
    assert key not in config_checks[f"k8s:{name}"].stdout
    refused = config_checks[f"k8s:{name} without the operator key"]
    assert refused.returncode == 2, refused.stdout
    assert "server.operator.key_env" in refused.stderr and OPERATOR_VAR in refused.stderr, refused.stderr
    assert key not in refused.stderr
    assert "endpoint" not in (cfg.get("events") or {}) or "127.0.0.1" in cfg["events"]["endpoint"]
