"""What the boards and rules read: the metric names a PromQL expression
names, every query of every board and rule, and the Envoy stats kvmesh reads.

`ENVOY_METRICS` are names from Envoy's admin `/stats/prometheus` (Envoy
counters carry no `_total`), checked against a running Envoy by the
Prometheus end-to-end test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.config import AlertsConfig
from services.observability.alerts import alert_subject, rule_groups
from services.observability.boards import BOARDS

__all__ = ["ENVOY_METRICS", "NamedQuery", "alert_queries", "metric_names", "panel_queries"]

ENVOY_METRICS = frozenset({
    "envoy_cluster_membership_healthy",
    "envoy_cluster_membership_total",
    "envoy_cluster_upstream_rq_xx",
    "envoy_cluster_upstream_rq_timeout",
    "envoy_cluster_upstream_rq_time_bucket",
    "envoy_cluster_health_check_failure",
    "envoy_http_downstream_rq_xx",
    "envoy_http_downstream_rq_active",
    "envoy_http_downstream_cx_active",
})
# Prometheus's own series for every target.
_PROMETHEUS = frozenset({"up"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACED = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
                       "group_left", "group_right"})


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, labels,
    keywords or numbers)."""
    text = _STRING.sub('""', expr)
    previous = None
    while previous != text:  # innermost braces and brackets first
        previous, text = text, _BRACED.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}


@dataclass(frozen=True)
class NamedQuery:
    """A query and where it comes from ("board / panel / legend" or
    "alert NAME")."""

    where: str
    expr: str


def panel_queries() -> list[NamedQuery]:
    return [NamedQuery(f"{board.uid} / {panel.title} / {q.legend or q.expr}", q.expr)
            for board in BOARDS for panel in board.panels() for q in panel.queries]


def alert_queries(cfg: AlertsConfig, subjects: bool = False) -> list[NamedQuery]:
    """Every alert's expression, or (`subjects`) what it compares."""
    return [NamedQuery(f"alert {a.name}", alert_subject(a.expr) if subjects else a.expr)
            for group in rule_groups(cfg) for a in group.alerts]


def known_names(exported: set[str]) -> set[str]:
    return exported | ENVOY_METRICS | _PROMETHEUS
