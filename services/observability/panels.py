"""The panel helper every board uses: a board is a list of rows of panels, a
panel a few PromQL queries with a unit, and `grafana_json` lays it out.

Queries use Grafana's template variables, and only these: `$model`, `$engine`,
`$priority` (multi-value, "All" = `.*`, so always under `=~`) and
`$__rate_interval`. `substitute` fills them in for anything that is not Grafana
(the tests, `snapshot.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "VARIABLES",
    "Board",
    "Panel",
    "Query",
    "Row",
    "grafana_json",
    "latency_quantiles",
    "rate",
    "substitute",
]

RATE = "$__rate_interval"
# Template variables: name -> (label_values query or custom list, label).
VARIABLES: dict[str, tuple[str, str]] = {
    "model": ("label_values(vllm:num_requests_running, model_name)", "model"),
    "engine": ('label_values(vllm:num_requests_running{model_name=~"$model"}, engine)', "engine"),
    "priority": ("P0,P1,P2", "priority class"),
}
_VAR = re.compile(r"\$(__rate_interval|model|engine|priority)\b")
PanelKind = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    """One PromQL expression and its legend (`{{label}}` placeholders)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A graph (or a single-number stat) of its queries, in Grafana unit
    `unit` ("s", "reqps", "percentunit", "short", "ops", "ms")."""

    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    kind: PanelKind = "timeseries"


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("kvmesh",)
    variables: tuple[str, ...] = field(default=("model", "priority"))

    def panels(self) -> list[Panel]:
        return [p for row in self.rows for p in row.panels]


def rate(metric: str, by: str = "", selector: str = "") -> str:
    """`sum [by (...)] (rate(metric{selector}[$__rate_interval]))`."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def latency_quantiles(histogram: str, by: str, selector: str = "",
                      quantiles: tuple[float, ...] = (0.5, 0.95, 0.99)) -> tuple[Query, ...]:
    """p50/p95/p99 of a Prometheus histogram (`histogram` without `_bucket`),
    one series per `by` label value."""
    legend = " ".join("{{" + label.strip() + "}}" for label in by.split(",") if label.strip())
    grouping = f"le, {by}" if by else "le"
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({grouping}) "
            f"(rate({histogram}_bucket{{{selector}}}[{RATE}])))",
            f"{legend} p{round(q * 100)}".strip(),
        )
        for q in quantiles
    )


def substitute(expr: str, rate_interval: str = "1m", values: dict[str, str] | None = None) -> str:
    """The query as Grafana sends it with "All" selected (`.*`), or with the
    given variable values; `$__rate_interval` becomes `rate_interval`."""
    chosen = values or {}

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        return rate_interval if name == "__rate_interval" else chosen.get(name, ".*")

    return _VAR.sub(one, expr)


# ---------------------------------------------------------------- Grafana JSON

_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_WIDTH = 24
_HEIGHT = 8


def grafana_json(board: Board) -> dict[str, Any]:
    """The board as a Grafana dashboard (schema 39): rows of panels, three
    (stat: four) to a line, over a Prometheus datasource variable."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in board.rows:
        panels.append({"type": "row", "title": row.title, "collapsed": False, "id": len(panels) + 1,
                       "gridPos": {"x": 0, "y": y, "w": _WIDTH, "h": 1}, "panels": []})
        y += 1
        x = 0
        for panel in row.panels:
            width = 6 if panel.kind == "stat" else 8
            height = 4 if panel.kind == "stat" else _HEIGHT
            if x + width > _WIDTH:
                x, y = 0, y + _HEIGHT
            panels.append(_panel_json(panel, len(panels) + 1, {"x": x, "y": y, "w": width, "h": height}))
            x += width
        y += _HEIGHT
    return {
        "uid": board.uid,
        "title": board.title,
        "description": board.description,
        "tags": list(board.tags),
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": [_datasource_variable(), *(_variable(v) for v in board.variables)]},
        "panels": panels,
    }


def _panel_json(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    targets = [
        {"refId": chr(ord("A") + i), "datasource": _DATASOURCE, "expr": q.expr, "legendFormat": q.legend,
         "range": True}
        for i, q in enumerate(panel.queries)
    ]
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": _DATASOURCE,
        "gridPos": grid,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": panel.unit, **({"custom": custom} if panel.kind == "timeseries" else {})},
                        "overrides": []},
        "options": ({"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                     "tooltip": {"mode": "multi", "sort": "desc"}}
                    if panel.kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}}),
    }


def _datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1}


def _variable(name: str) -> dict[str, Any]:
    query, label = VARIABLES[name]
    common = {"name": name, "label": label, "multi": True, "includeAll": True, "allValue": ".*",
              "current": {"text": "All", "value": "$__all"}, "hide": 0}
    if name == "priority":
        options = [{"text": p, "value": p, "selected": False} for p in query.split(",")]
        return {**common, "type": "custom", "query": query, "options": options}
    return {**common, "type": "query", "datasource": _DATASOURCE, "refresh": 2, "sort": 1,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query}
