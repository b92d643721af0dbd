"""The panel helper, the local Prometheus's config and the PNG drawing, on
fakes (the real Prometheus runs in tests/e2e/test_e2e_prometheus.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.observability import snapshot
from services.observability.boards import BOARDS
from services.observability.local_prometheus import LocalPrometheus, ScrapeTarget
from services.observability.panels import Board, Panel, Query, Row, latency_quantiles, rate, substitute


def test_rate_and_quantiles_build_the_queries() -> None:
    assert rate("m_total", "a, b", 'x="1"') == 'sum by (a, b) (rate(m_total{x="1"}[$__rate_interval]))'
    p99 = latency_quantiles("h_seconds", "priority", 'priority=~"$priority"', (0.99,))
    assert p99 == (Query('histogram_quantile(0.99, sum by (le, priority) '
                         '(rate(h_seconds_bucket{priority=~"$priority"}[$__rate_interval])))', "{{priority}} p99"),)


def test_substitute_fills_every_variable() -> None:
    expr = 'sum(rate(m{model_name=~"$model", engine=~"$engine", priority=~"$priority"}[$__rate_interval]))'
    assert substitute(expr, "30s") == 'sum(rate(m{model_name=~".*", engine=~".*", priority=~".*"}[30s]))'
    assert 'priority=~"P0"' in substitute(expr, values={"priority": "P0"})
    assert substitute("$modelx") == "$modelx"  # only whole variable names


def test_local_prometheus_scrapes_each_job_every_interval(tmp_path: Path) -> None:
    targets = [ScrapeTarget("kvmesh-engine", "127.0.0.1:1"), ScrapeTarget("kvmesh-engine", "127.0.0.1:2"),
               ScrapeTarget("kvmesh-envoy", "127.0.0.1:3", "/stats/prometheus")]
    config: dict[str, Any] = LocalPrometheus(targets, [tmp_path / "r.yaml"], tmp_path).config()
    assert config["global"]["scrape_interval"] == "1s" and config["rule_files"] == [str(tmp_path / "r.yaml")]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["kvmesh-engine"]["static_configs"] == [{"targets": ["127.0.0.1:1", "127.0.0.1:2"]}]
    assert jobs["kvmesh-envoy"]["metrics_path"] == "/stats/prometheus"


def test_snapshot_draws_series_and_empty_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def fake_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        asked.append(expr)
        if "nothing" in expr:
            return []
        return [{"metric": {"priority": "P0"}, "values": [[start + i, str(i * 0.1)] for i in range(30)]},
                {"metric": {"priority": "P1"}, "values": [[start, "NaN"]]}]

    monkeypatch.setattr(snapshot, "query_range", fake_range)
    board = Board("t", "Test", "", (Row("r", (
        Panel("Some", "s", (Query('m{priority=~"$priority"}', "{{priority}}"),)),
        Panel("None", "percentunit", (Query("nothing", ""),), kind="stat"),
    )),))
    series = snapshot.fetch_panel("http://x", board.panels()[0], 0.0, 60.0, 1.0, "15s")
    assert [s.legend for s in series] == ["P0"]  # the NaN-only series is dropped
    assert asked[0] == 'm{priority=~".*"}'
    (path,) = snapshot.snapshot_boards("http://x", tmp_path, minutes=1, end=1000.0, boards=(board,))
    assert path.name == "t.png" and path.read_bytes()[:4] == b"\x89PNG"


def test_boards_are_the_four_the_issue_names() -> None:
    assert [b.uid for b in BOARDS] == ["kvmesh-fleet", "kvmesh-scheduler", "kvmesh-engine", "kvmesh-edge"]
    titles = {b.uid: {p.title for p in b.panels()} for b in BOARDS}
    assert {"Time to first token", "Tokens / s in and out", "Rejections / s by reason"} <= titles["kvmesh-fleet"]
    assert {"Queue wait by class", "Decision latency by policy"} <= titles["kvmesh-scheduler"]
    assert {"KV blocks by state", "Step time", "Serving"} <= titles["kvmesh-engine"]
    assert {"Healthy gateways (Envoy's view)", "Slow readers and paced streams"} <= titles["kvmesh-edge"]


def test_cli_render_check_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    with pytest.raises(SystemExit) as done:
        main(["dashboards", "render", "--check"])
    assert done.value.code == 0
    with pytest.raises(SystemExit):
        main(["dashboards", "--help"])
    assert "render" in capsys.readouterr().out
