"""The boards and rules as code: the checked-in files are what the Python
renders, every query parses (promtool), names only metrics some service
exports (or Envoy's verified stats), and the overlay ships every board."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config import AlertsConfig, load_config
from services.observability.alerts import alert_subject, rules_document
from services.observability.boards import BOARDS
from services.observability.metric_catalogue import exported_metric_names
from services.observability.panels import VARIABLES, substitute
from services.observability.promql import alert_queries, known_names, metric_names, panel_queries
from services.observability.render import DASHBOARD_DIR, PROMETHEUS_RULE, RULES_FILE, rendered_files, stale_files

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian `prometheus`: make setup)")


def _config():
    return load_config(ROOT / "config" / "kvmesh.yaml")


def test_checked_in_files_are_fresh() -> None:
    stale = stale_files(ROOT, _config())
    assert stale == [], f"stale generated files {stale}: run `kvmesh dashboards render` (make dashboards)"


def test_freshness_check_sees_a_changed_threshold(tmp_path: Path) -> None:
    config = _config()
    for path, text in rendered_files(config).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert stale_files(tmp_path, config) == []
    config.alerts.p0_ttft_p99_seconds = 0.75
    assert stale_files(tmp_path, config) == [PROMETHEUS_RULE, RULES_FILE]
    (tmp_path / DASHBOARD_DIR / "old-board.json").write_text("{}")
    assert DASHBOARD_DIR / "old-board.json" in stale_files(tmp_path, config)


def test_prometheus_rule_spec_is_the_plain_rules_file() -> None:
    rule = yaml.safe_load((ROOT / PROMETHEUS_RULE).read_text())
    plain = yaml.safe_load((ROOT / RULES_FILE).read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"] == plain
    names = [r["alert"] for g in plain["groups"] for r in g["rules"]]
    assert len(names) == len(set(names))
    for wanted in ("KvmeshModelNotServed", "KvmeshP0TtftAboveTarget", "KvmeshQueueWaitNearAgingBound",
                   "KvmeshKvCacheFullEverywhere", "KvmeshEngineFlapping", "KvmeshMigrationRate",
                   "KvmeshSchedulerRestarted", "KvmeshRejectionRate"):
        assert wanted in names


def test_thresholds_come_from_the_config() -> None:
    cfg = AlertsConfig(p0_ttft_p99_seconds=1.5, aging_fraction=0.5, rejection_ratio=0.2)
    rules = {r["alert"]: r for g in rules_document(cfg)["groups"] for r in g["rules"]}
    assert rules["KvmeshP0TtftAboveTarget"]["expr"].endswith("> 1.5")
    assert "> 0.5 * max by (priority)" in rules["KvmeshQueueWaitNearAgingBound"]["expr"]
    assert rules["KvmeshRejectionRate"]["expr"].endswith("> 0.2")


def test_overlay_ships_every_board_as_a_sidecar_configmap() -> None:
    kustomization = yaml.safe_load((ROOT / "deploy/overlays/monitoring/kustomization.yaml").read_text())
    files = {f for gen in kustomization["configMapGenerator"] for f in gen["files"]}
    assert files == {f"dashboards/{b.uid}.json" for b in BOARDS}
    assert kustomization["generatorOptions"]["labels"]["grafana_dashboard"] == "1"
    for board in BOARDS:
        text = (ROOT / DASHBOARD_DIR / f"{board.uid}.json").read_text()
        assert len(text.encode()) < 200_000, "a ConfigMap applied client-side keeps a copy in a 256 KiB annotation"


def test_every_metric_a_panel_or_rule_names_is_exported() -> None:
    exported = set().union(*exported_metric_names().values())
    known = known_names(exported)
    queries = panel_queries() + alert_queries(AlertsConfig())
    unknown = {(q.where, n) for q in queries for n in metric_names(q.expr) if n not in known}
    assert unknown == set(), "names no service exports (services/*/metrics.py) and no verified Envoy stat"
    assert all(metric_names(q.expr) for q in queries), "a query naming no metric"


def test_the_metric_check_fails_on_a_misspelt_name() -> None:
    exported = set().union(*exported_metric_names().values())
    assert "kvmesh_gateway_requests_total" in known_names(exported)
    assert metric_names('sum by (status) (rate(kvmesh_gateway_request_total{route!~"/h"}[1m]))') == {
        "kvmesh_gateway_request_total"}
    assert "kvmesh_gateway_request_total" not in known_names(exported)


def test_metric_names_skips_functions_labels_and_keywords() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket'
            '{model_name=~"a|b", le!="x"}[5m]))) > 1e-9 and on (engine) max_over_time(up[30m:15s]) '
            '/ ignoring (x) group_left (y) kvmesh_scheduler_leases offset 5m')
    assert metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket", "up", "kvmesh_scheduler_leases"}


def test_panels_use_only_the_board_variables() -> None:
    for board in BOARDS:
        assert set(board.variables) <= set(VARIABLES)
        titles = [p.title for p in board.panels()]
        assert len(titles) == len(set(titles)), board.uid
        for panel in board.panels():
            assert panel.queries and panel.unit, (board.uid, panel.title)
            for q in panel.queries:
                used = {v for v in VARIABLES if f"${v}" in q.expr}
                assert used <= set(board.variables), (board.uid, panel.title, used)
                assert "$" not in substitute(q.expr), q.expr


def test_grafana_json_has_datasource_and_variables() -> None:
    for board in BOARDS:
        data = json.loads((ROOT / DASHBOARD_DIR / f"{board.uid}.json").read_text())
        assert data["uid"] == board.uid
        variables = [v["name"] for v in data["templating"]["list"]]
        assert variables == ["datasource", *board.variables]
        graphs = [p for p in data["panels"] if p["type"] != "row"]
        assert len(graphs) == len(board.panels())
        for panel in graphs:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24


def test_alert_subject_is_the_compared_side() -> None:
    assert alert_subject('absent(up{job=~".*x.*"} == 1)') == 'up{job=~".*x.*"}'
    assert alert_subject('max by (a) (m{b!="c"}) > 0.8 * max by (a) (n > 0)') == 'max by (a) (m{b!="c"})'
    ratio = "sum(rate(x[5m])) / clamp_min(sum(y), 1e-9)"
    assert alert_subject(f"{ratio} >= 4") == ratio
    assert alert_subject("sum(x)") == "sum(x)"


def _check_rules(path: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], check=False, capture_output=True, text=True,
                          timeout=60)


@needs_promtool
def test_every_query_parses(tmp_path: Path) -> None:
    """Each panel query (variables filled in) and alert subject as a recording
    rule: `promtool check rules` parses every one."""
    queries = panel_queries() + alert_queries(AlertsConfig(), subjects=True)
    rules = [{"record": f"kvmesh:check_{i}", "expr": substitute(q.expr)} for i, q in enumerate(queries)]
    path = tmp_path / "queries.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    result = _check_rules(path)
    assert result.returncode == 0, result.stdout + result.stderr
    path.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": [{"record": "r", "expr": "sum(rate(x[5m])"}]}]}))
    broken = _check_rules(path)
    assert broken.returncode != 0


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("p0_ttft_p99_seconds", 0, "must be > 0"),
    ("aging_fraction", 1.5, "must be within 0 .. 1"),
    ("rejection_ratio", -0.1, "must be within 0 .. 1"),
    ("flaps_per_15m", 0, "must be >= 1"),
])
def test_alert_thresholds_are_validated(tmp_path: Path, key: str, value: float, problem: str) -> None:
    from services.common.config import ConfigError

    path = tmp_path / "kvmesh.yaml"
    data = yaml.safe_load((ROOT / "config" / "kvmesh.yaml").read_text())
    data["alerts"][key] = value
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"alerts\.{key}: {problem}"):
        load_config(path)
