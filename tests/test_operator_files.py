"""The operator's files (etc/grafana/, etc/prometheus/) against a real daemon's /metrics and promtool.

A query naming a metric the daemon does not export draws an empty panel or an alert that never
fires, and nothing says so: every name is held to what a real daemon's endpoint declares.
"""
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mcpd.testing import free_port
from set_up_tools import require

ETC = Path(__file__).resolve().parent.parent / "etc"
DASHBOARDS = sorted((ETC / "grafana").glob("*.json"))
RULES = ETC / "prometheus" / "mcpd-rules.yml"
RULES_TEST = ETC / "prometheus" / "mcpd-rules.test.yml"
METRIC_NAME = re.compile(r"(?<![A-Za-z0-9_:])mcpd[_:][A-Za-z0-9_:]*")
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
# Grafana's variables, as the dashboard's queries use them, replaced by what Prometheus can parse.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*", "$model": ".*"}


@pytest.fixture(scope="module")
def exported(module_daemon, module_redis_server) -> set[str]:
    """Every sample name the daemon's endpoint declares, including families without samples yet
    (a histogram before its first observation still has its _bucket, _count and _sum), with the
    HTTP listener and the cluster on so that their families are there too."""
    d = module_daemon(metrics={"listen": "127.0.0.1:0"}, http={"listen": f"127.0.0.1:{free_port()}"},
                      cluster={"redis": module_redis_server.url, "node_id": "a"})
    d.wait_until(lambda: d.status()["cluster"].get("nodes"), what="the first cluster heartbeat reported")
    with urllib.request.urlopen(d.status()["metrics"], timeout=30) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    names = {sample.name for family in families for sample in family.samples}
    names |= {family.name + suffix for family in families for suffix in SAMPLE_SUFFIXES.get(family.type, ())}
    return names


def promtool() -> str:
    """promtool on PATH or in the virtual environment (the Makefile's test set-up puts it there)."""
    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.prefix) / "bin"))
    return require(found, "promtool", "neither on PATH nor in the venv: `make setup-test` extracts it from "
                   "Debian's prometheus package, which needs apt and that package")


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def rules() -> list[dict]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def panel_queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every expression naming metrics: the panels' PromQL and the variables' label_values()."""
    variables = [variable["query"] for variable in dashboard["templating"]["list"]]
    return panel_queries(dashboard) + [q["query"] if isinstance(q, dict) else q for q in variables]


def names_in(expression: str) -> set[str]:
    return set(METRIC_NAME.findall(expression))


def test_dashboards_are_grafana_imports_with_a_prometheus_input():
    assert DASHBOARDS, "no dashboard under etc/grafana/"
    uids = [json.loads(path.read_text())["uid"] for path in DASHBOARDS]
    assert len(set(uids)) == len(uids), f"an import would replace another dashboard: {uids}"
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30, path
        inputs = {i["name"]: i for i in dashboard["__inputs"]}
        assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
        panels = dashboard["panels"]
        assert len({p["id"] for p in panels}) == len(panels), f"{path.name}: panel ids repeat"
        graphs = [p for p in panels if p["type"] != "row"]
        assert graphs, path
        for panel in graphs:
            assert panel["title"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
            targets = panel["targets"]
            assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
            assert all(t["datasource"] == panel["datasource"] and t["expr"] for t in targets), panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_name_only_exported_metrics(exported, path):
    for query in dashboard_queries(json.loads(path.read_text())):
        assert names_in(query), f"{query!r} names no mcpd metric"
        assert names_in(query) <= exported, f"{path.name}: {sorted(names_in(query) - exported)} not exported"


def test_rule_expressions_name_only_exported_or_recorded_metrics(exported):
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        assert names_in(rule["expr"]) <= exported | recorded, (rule.get("alert") or rule["record"],
                                                                sorted(names_in(rule["expr"]) - exported - recorded))


def test_rules_pass_promtool_check():
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_pass_their_promtool_unit_tests():
    done = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_unit_test_that_fires_it():
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    cases = [case for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    assert alerts and alerts <= fired, f"alerts no test fires: {sorted(alerts - fired)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_are_valid_promql(path, tmp_path):
    """promtool parses each panel's query (Grafana's variables filled in) as a recording rule's."""
    queries = panel_queries(json.loads(path.read_text()))
    for variable, value in GRAFANA_VARIABLES.items():
        queries = [query.replace(variable, value) for query in queries]
    as_rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"query_{i}", "expr": query}
                                                          for i, query in enumerate(queries)]}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(as_rules))
    done = subprocess.run([promtool(), "check", "rules", str(tmp_path / "queries.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
