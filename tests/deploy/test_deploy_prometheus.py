"""``deploy/prometheus/``: the scrape config and the rules checked by ``promtool``, and the
rules' unit tests (``alerts_test.yml``) run by ``promtool test rules``.

The unit tests are shown to test something: with any one alert made unable to fire, or
with the ``for:`` hold of any alert removed, ``promtool test rules`` must fail; so must they
with the L3 alert reading ``hicache_storage_up`` alone (it would fire for a daemon without
L3) or the degraded-process alert firing for every process. Every alert the deployment
needs is present, by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_helpers import DEPLOY, run, tool

PROM = DEPLOY / "prometheus"
ALERTS = PROM / "alerts.yml"
TESTS = PROM / "alerts_test.yml"

REQUIRED_ALERTS = {
    "HicacheStorageDown": "L3 down",
    "HicacheControllerRestarting": "controller restarting",
    "HicacheBackupsAbandoned": "backups to L3 given up on after every retry",
    "HicacheHitRateCollapsed": "hit rate collapsed",
    "HicachePoolsSaturated": "pools saturated with a growing queue",
    "HicacheTTFTHigh": "TTFT p99 over a threshold",
    "HicacheDown": "the daemon's HTTP process down, or the daemon exited",
    "HicacheProcessDegraded": "the scheduler or the controller dead or stale (what /health reports)",
}


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def promtool_test(rules_text: str, tmp_path: Path) -> tuple[int, str]:
    """``promtool test rules`` of alerts_test.yml against ``rules_text`` as alerts.yml."""
    (tmp_path / "alerts.yml").write_text(rules_text)
    (tmp_path / "alerts_test.yml").write_text(TESTS.read_text())
    proc = run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=tmp_path)
    return proc.returncode, proc.stdout + proc.stderr


def test_check_config(tmp_path: Path) -> None:
    """``promtool check config`` accepts prometheus.yml and the rule file it loads; its scrape
    of hicache sends the operator's key from the file the compose secret mounts (promtool
    needs the file: here a copy of the config names one in ``tmp_path``)."""
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    [job] = cfg["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/hicache_operator"}
    (tmp_path / "operator.key").write_text("a-key\n")
    job["authorization"]["credentials_file"] = str(tmp_path / "operator.key")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    proc = run([tool("promtool"), "check", "config", "prometheus.yml"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SUCCESS" in out and "alerts.yml" in out, out


def test_check_rules() -> None:
    """``promtool check rules`` accepts alerts.yml with every rule counted."""
    doc = yaml.safe_load(ALERTS.read_text())
    n = sum(len(g["rules"]) for g in doc["groups"])
    proc = run([tool("promtool"), "check", "rules", str(ALERTS)])
    assert proc.returncode == 0 and f"SUCCESS: {n} rules found" in proc.stdout, proc.stdout + proc.stderr


def test_unit_tests_pass() -> None:
    """``promtool test rules`` passes alerts_test.yml."""
    proc = run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=PROM)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_required_alerts_exist() -> None:
    """Every alert the deployment needs is defined, with a severity, summary and description."""
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(REQUIRED_ALERTS) <= set(rules), set(REQUIRED_ALERTS) - set(rules)
    for name, r in rules.items():
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    """alerts_test.yml expects each alert to fire at some time and to be absent at another."""
    tests = yaml.safe_load(TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert fired == names and quiet == names, (names - fired, names - quiet)


@pytest.mark.parametrize("alert", sorted(REQUIRED_ALERTS))
def test_unit_tests_fail_when_an_alert_cannot_fire(alert: str, tmp_path: Path) -> None:
    """With ``alert``'s expression replaced by one that is never true, the unit tests fail."""
    doc = yaml.safe_load(ALERTS.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if r.get("alert") == alert:
                r["expr"] = "vector(1) == 0"
    code, out = promtool_test(yaml.safe_dump(doc, sort_keys=False), tmp_path)
    assert code != 0 and alert in out, out


MISFIRING = {
    "HicacheStorageDown": "hicache_storage_up == 0",
    "HicacheProcessDegraded": "hicache_process_up <= 1",
}
"""Expressions that fire where the alert must not: L3 "down" on a daemon without L3 (the
expression before ``hicache_storage_attached``), and every process of every daemon."""


@pytest.mark.parametrize("alert", sorted(MISFIRING))
def test_unit_tests_fail_when_an_alert_fires_too_widely(alert: str, tmp_path: Path) -> None:
    """With ``alert``'s expression replaced by one that also matches the quiet cases, the unit
    tests fail: they hold a daemon without L3 and a healthy process that must not alert."""
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == alert]
    assert len(rules) == 1
    rules[0]["expr"] = MISFIRING[alert]
    code, out = promtool_test(yaml.safe_dump(doc, sort_keys=False), tmp_path)
    assert code != 0 and alert in out, out


def test_alerts_read_the_health_and_attachment_series() -> None:
    """The degraded-process alert reads ``hicache_process_up`` (the daemon's own stale limit);
    the L3 alert is gated on ``hicache_storage_attached``."""
    from tests.deploy.deploy_helpers import promql_metric_names

    rules = {r["alert"]: r for r in alert_rules()}
    assert promql_metric_names(rules["HicacheProcessDegraded"]["expr"]) == {"hicache_process_up"}
    assert promql_metric_names(rules["HicacheStorageDown"]["expr"]) == {"hicache_storage_up",
                                                                       "hicache_storage_attached"}


@pytest.mark.parametrize("alert", sorted(r["alert"] for r in alert_rules() if "for" in r))
def test_unit_tests_fail_without_the_hold(alert: str, tmp_path: Path) -> None:
    """With ``alert``'s ``for:`` removed (it would fire at once), the unit tests fail: each
    hold is tested by a quiet case while the condition is already true."""
    doc = yaml.safe_load(ALERTS.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if r.get("alert") == alert:
                del r["for"]
    code, out = promtool_test(yaml.safe_dump(doc, sort_keys=False), tmp_path)
    assert code != 0 and alert in out, out


def test_metric_names_are_hicache_specs() -> None:
    """Every metric an alert or recording rule reads is one hicache/metrics/catalogue.py defines (or
    Prometheus' own ``up``, or a recording rule of the same file)."""
    from hicache.metrics import SPECS
    from tests.deploy.deploy_helpers import promql_metric_names, rule_exprs

    known = {s.name for s in SPECS}
    known |= {f"{s.name}_bucket" for s in SPECS if s.kind == "histogram"}
    records = {r["record"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "record" in r}
    for name, expr in rule_exprs(ALERTS):
        used = promql_metric_names(expr)
        assert used, f"{name}: no metric found in {expr!r}"
        unknown = used - known - records - {"up"}
        assert not unknown, f"{name}: {unknown}"
        assert all(re.fullmatch(r"[a-z_:][a-z0-9_:]*", u) for u in used)
