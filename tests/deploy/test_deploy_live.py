"""The dashboard and the alert rules against a running daemon, and a real Prometheus.

* Every metric name any dashboard query or rule uses is a series of the live daemon's
  ``/metrics`` (the test run's daemon: tiny reference model, L1, L2 and a file L3).
* A real ``prometheus`` (temporary data dir, free port, 1 s scrape and evaluation) runs
  deploy/prometheus/prometheus.yml with only its target, intervals and the operator key's
  file changed (it scrapes with the operator's key, as shipped), loads the
  real alerts.yml, scrapes the daemon and returns ``hicache_cached_tokens_total`` equal to
  what ``/metrics`` says (non-zero: the second request was served from L1); every dashboard
  query and every rule then evaluates without error, and every dashboard query returns data.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hicache.bench.loopback_ports import free_port
from tests.deploy.deploy_helpers import (
    DEPLOY,
    LiveDaemon,
    dashboard_targets,
    promql_metric_names,
    rule_exprs,
    stop_process,
    substitute_grafana_vars,
    tool,
)

DASHBOARD = DEPLOY / "grafana" / "hicache.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

REQUIRED_ON_DASHBOARD = {
    "hicache_cached_tokens_total", "hicache_prompt_tokens_total", "hicache_pool_used_tokens",
    "hicache_pool_capacity_tokens", "hicache_transfer_bytes_total", "hicache_prefetch_tokens_total",
    "hicache_backup_tokens_total", "hicache_ttft_seconds_bucket", "hicache_inter_token_latency_seconds_bucket",
    "hicache_queue_requests", "hicache_process_restarts_total", "hicache_process_up",
    "hicache_process_heartbeat_age_seconds", "hicache_storage_up", "hicache_storage_attached",
}
"""Per-tier hits and ratios, pool occupancy, bandwidth per direction, prefetch / backup
rates, TTFT / ITL quantiles, queue depth, restarts, process health (up and heartbeat age),
L3 up where attached."""


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def sample_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_dashboard_structure() -> None:
    """The dashboard is Grafana JSON with unique panel ids, a Prometheus datasource on every
    query, unique refIds per panel, and queries for every topic it must show."""
    d = dashboard()
    assert d["uid"] == "hicache" and d["schemaVersion"] >= 36
    ids = []
    names: set[str] = set()

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            ids.append(p["id"])
            assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
            if p["type"] != "row":
                assert p["datasource"]["type"] == "prometheus" and p["targets"], p["title"]
                refs = [t["refId"] for t in p["targets"]]
                assert len(refs) == len(set(refs)), p["title"]
                for t in p["targets"]:
                    names.update(promql_metric_names(t["expr"]))
            walk(p.get("panels", []))

    walk(d["panels"])
    assert len(ids) == len(set(ids))
    assert REQUIRED_ON_DASHBOARD <= names, REQUIRED_ON_DASHBOARD - names
    variables = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables


def test_promql_parser_finds_names() -> None:
    """The metric-name extraction the tests rely on: functions, keywords, label names,
    durations, strings and Grafana variables are not names; selectors are."""
    expr = ('histogram_quantile(0.99, sum by (le, job) (rate(hicache_ttft_seconds_bucket{job=~"$job", '
            'tier="host"}[$__rate_interval]))) / ignoring (tier) group_left sum(up offset 1h) > bool 5 '
            'and on (instance) hicache:cache_hit_ratio:rate10m')
    assert promql_metric_names(expr) == {"hicache_ttft_seconds_bucket", "up", "hicache:cache_hit_ratio:rate10m"}


def test_every_query_metric_is_live(live_daemon: LiveDaemon) -> None:
    """Every metric name in every dashboard query and every rule is a sample name of the
    live daemon's /metrics (recording rules aside, which alerts.yml defines, and Prometheus'
    own ``up``)."""
    live = {name for name, _labels in sample_values(live_daemon.metrics_text())}
    records = {r["record"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "record" in r}
    queries = [(f"dashboard: {t}", e) for t, e in dashboard_targets(dashboard())] + \
              [(f"rule: {n}", e) for n, e in rule_exprs(ALERTS)]
    assert len(queries) > 30
    for where, expr in queries:
        used = promql_metric_names(expr)
        assert used, f"{where}: no metric in {expr!r}"
        missing = used - live - records - {"up"}
        assert not missing, f"{where}: {sorted(missing)} not in the live /metrics"


class Prometheus:
    """A ``prometheus`` server a test started; stopped by ``stop``."""

    def __init__(self, config: Path, data: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(
                [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={data}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def query(self, expr: str) -> dict[str, Any]:
        try:
            return self.get("/api/v1/query", query=expr)  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())  # type: ignore[no-any-return]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def prometheus(live_daemon: LiveDaemon, tmp_path: Path) -> Any:
    """deploy/prometheus/prometheus.yml pointed at the live daemon, 1 s intervals, the real
    alerts.yml (by absolute path)."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in cfg["rule_files"]]
    job = cfg["scrape_configs"][0]
    assert job["job_name"] == "hicache" and job["metrics_path"] == "/metrics"
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{live_daemon.daemon.port}"]
    job["authorization"]["credentials_file"] = str(live_daemon.operator_key_file)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    p = Prometheus(tmp_path / "prometheus.yml", tmp_path / "data", tmp_path / "prometheus.log")
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()


def test_prometheus_scrapes_the_daemon(live_daemon: LiveDaemon, prometheus: Prometheus) -> None:
    """A real Prometheus scrapes the daemon with the repository's scrape config and returns
    ``hicache_cached_tokens_total`` per tier equal to the daemon's /metrics, with the L1
    (device) hits of the second request counted; every rule of alerts.yml is loaded and
    evaluates without error; every dashboard query returns data without error."""
    cached = live_daemon.second["meta_info"]["cached_tokens_details"]["device"]
    assert cached > 0, live_daemon.second["meta_info"]
    exposed = {dict(labels)["tier"]: v for (name, labels), v in sample_values(live_daemon.metrics_text()).items()
               if name == "hicache_cached_tokens_total"}
    assert set(exposed) == {"device", "host", "storage"} and exposed["device"] >= cached

    deadline = time.monotonic() + 30
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        r = prometheus.query("hicache_cached_tokens_total")
        assert r["status"] == "success", r
        got = {s["metric"]["tier"]: float(s["value"][1]) for s in r["data"]["result"]}
        if got == exposed:
            break
        time.sleep(0.5)
    assert got == exposed, f"prometheus: {got}, /metrics: {exposed}"
    series = prometheus.query('hicache_cached_tokens_total{tier="device"}')["data"]["result"]
    assert len(series) == 1 and series[0]["metric"]["job"] == "hicache"
    assert series[0]["metric"]["instance"] == f"127.0.0.1:{live_daemon.daemon.port}"
    assert float(prometheus.query('up{job="hicache"}')["data"]["result"][0]["value"][1]) == 1.0

    # the rules: all loaded, evaluated at least once, healthy
    expected = {n for n, _e in rule_exprs(ALERTS)}
    rules: list[dict[str, Any]] = []
    while time.monotonic() < deadline + 15:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if len(rules) == len(expected) and all(r.get("lastEvaluation", "").startswith("2") and
                                               not r["lastEvaluation"].startswith("0001") for r in rules):
            break
        time.sleep(0.5)
    assert {r["name"] for r in rules} == expected
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, bad

    # every dashboard query, as Grafana sends it, once rates have two samples in their window
    exprs = [(t, substitute_grafana_vars(e)) for t, e in dashboard_targets(dashboard())]
    empty: dict[str, str] = {}
    while time.monotonic() < deadline + 30:
        empty = {}
        for title, expr in exprs:
            r = prometheus.query(expr)
            assert r["status"] == "success", f"{title}: {expr}: {r}"
            if not r["data"]["result"]:
                empty[title] = expr
        if not empty:
            break
        time.sleep(1.0)
    assert not empty, f"dashboard queries without data: {empty}"
