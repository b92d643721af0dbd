"""The alert rules, as data: groups of alerts whose thresholds come from the
config's `alerts` section (services/common/config/alerts.py) and the metric
names the services export. `render.py` writes them both as the Prometheus
Operator's PrometheusRule and as a plain Prometheus rules file.

`alert_subject` gives the part of an alert that returns series whether or not
the alert fires (the left side of its comparison), so a test can prove every
expression reads series a running mesh exports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from services.common.config import AlertsConfig

__all__ = ["Alert", "RuleGroup", "alert_subject", "rule_groups", "rules_document"]

Severity = Literal["critical", "warning", "info"]
_API = 'route!~"/health.*"'


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: Severity
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {"alert": self.name, "expr": self.expr, "for": self.for_, "labels": {"severity": self.severity},
                "annotations": {"summary": self.summary, "description": self.description}}


@dataclass(frozen=True)
class RuleGroup:
    name: str
    alerts: tuple[Alert, ...]


def rule_groups(cfg: AlertsConfig) -> tuple[RuleGroup, ...]:
    return (_availability(cfg), _latency(cfg), _capacity(cfg))


def rules_document(cfg: AlertsConfig) -> dict[str, Any]:
    """`{"groups": [...]}`: a Prometheus rules file, and a PrometheusRule's spec."""
    return {"groups": [{"name": g.name, "rules": [a.rule() for a in g.alerts]} for g in rule_groups(cfg)]}


def _availability(cfg: AlertsConfig) -> RuleGroup:
    return RuleGroup("kvmesh.availability", (
        Alert("KvmeshSchedulerDown", 'absent(up{job=~".*kvmesh-scheduler.*"} == 1)', "2m", "critical",
              "The kvmesh scheduler is not scraped as up",
              "No request can be placed without the scheduler; check the kvmesh-scheduler pod."),
        # Every replica of several is scraped: one down is a warning (the
        # others place its share at once), all down the outage above.
        Alert("KvmeshSchedulerReplicaDown", 'up{job=~".*kvmesh-scheduler.*"} == 0', "5m", "warning",
              "Scheduler replica {{ $labels.instance }} is not scraped as up",
              "The other replicas place its requests; with none left nothing is placed. "
              "Check the kvmesh-scheduler pod."),
        Alert("KvmeshSchedulerRestarted",
              "changes(max by (job) (kvmesh_scheduler_start_time_seconds)[30m:15s]) > 0", "0m", "warning",
              "The kvmesh scheduler restarted in the last 30 minutes",
              "Its state is soft: gateways re-admit queued requests and re-attach running ones "
              "(kvmesh_gateway_scheduler_readmissions_total); check why it restarted."),
        # inference_pool_ready_pods has a series per configured model, 0 when
        # none serves (an engine that leaves loses its engine_serving series);
        # a model never served in the last hour (configured, not deployed) is
        # not an outage.
        Alert("KvmeshModelNotServed",
              "max by (name) (inference_pool_ready_pods) == 0 "
              "and max by (name) (max_over_time(inference_pool_ready_pods[1h])) > 0", "1m",
              "critical", "No engine serves model {{ $labels.name }}",
              "It was served within the hour; its requests now queue until their time-to-live ends. "
              "Check its engines."),
        Alert("KvmeshNoFreshEngines", 'sum(kvmesh_scheduler_engines{state="fresh"}) == 0', "2m", "critical",
              "The scheduler has no engine reporting",
              "Every request queues; check the kvmesh-engine pods (startup/readiness probes)."),
        Alert("KvmeshStaleEngines", 'max(kvmesh_scheduler_engines{state="stale"}) > 0', "5m", "warning",
              "{{ $value }} engine(s) stopped reporting to the scheduler",
              "A stale engine gets no new requests; its pod may be hung or cut off."),
        Alert("KvmeshEngineDown", 'up{job=~".*kvmesh-engine.*"} == 0', "5m", "warning",
              "Engine {{ $labels.engine }} is not scraped", "The engine pod's metrics port does not answer."),
        Alert("KvmeshEngineFlapping",
              f"max by (engine) (increase(kvmesh_scheduler_engine_flaps_total[15m])) >= {cfg.flaps_per_15m}",
              "0m", "warning", "Engine {{ $labels.engine }} keeps going in and out of service",
              "Serving <-> not-serving transitions within 15 minutes; each one migrates its streams. "
              "Check the engine's log (restarts, hangs, a partition)."),
        Alert("KvmeshEnvoyNoHealthyGateway",
              'sum by (envoy_cluster_name) (envoy_cluster_membership_healthy{envoy_cluster_name=~"gateway.*"}) == 0',
              "1m", "critical", "Envoy has no healthy gateway in {{ $labels.envoy_cluster_name }}",
              "Clients get 503 from the edge; check the kvmesh-gateway pods."),
    ))


def _latency(cfg: AlertsConfig) -> RuleGroup:
    target = cfg.p0_ttft_p99_seconds
    return RuleGroup("kvmesh.latency", (
        Alert("KvmeshP0TtftAboveTarget",
              "histogram_quantile(0.99, sum by (le, model_name) "
              f'(rate(kvmesh_gateway_time_to_first_token_seconds_bucket{{priority="P0"}}[5m]))) > {target:g}',
              "10m", "warning", f"P0 p99 time to first token above its {target:g} s target",
              "Interactive requests wait too long for their first token (alerts.p0_ttft_p99_seconds): "
              "look at queue wait and KV usage on the scheduler and engine boards."),
        Alert("KvmeshSlowFirstToken",
              "histogram_quantile(0.95, sum by (le) (rate(kvmesh_gateway_time_to_first_token_seconds_bucket[5m]))) > 5",
              "10m", "warning", "p95 time to first token above 5 s",
              "Measured at the gateways over every class (queueing + prefill)."),
        Alert("KvmeshQueueWaitNearAgingBound",
              "max by (priority) (kvmesh_scheduler_oldest_wait_seconds) > "
              f"{cfg.aging_fraction:g} * max by (priority) (kvmesh_scheduler_aging_bound_seconds > 0)",
              "5m", "warning", "{{ $labels.priority }} requests wait close to their aging bound",
              f"The oldest queued request of the class waited over {cfg.aging_fraction:.0%} of "
              "scheduler.aging: the class is not being served; add engines or lower the load."),
        Alert("KvmeshQueueBuilding", "sum(kvmesh_scheduler_queue_length) > 100", "10m", "warning",
              "{{ $value }} requests queued at the scheduler for 10 minutes",
              "The engines are saturated; add engines (GPUs) or lower the load."),
    ))


def _capacity(cfg: AlertsConfig) -> RuleGroup:
    return RuleGroup("kvmesh.capacity", (
        Alert("KvmeshKvCacheFullEverywhere",
              f"min by (model_name) (vllm:kv_cache_usage_perc) > {cfg.kv_cache_full_ratio:g}", "10m", "warning",
              "Every engine of {{ $labels.model_name }} has a full KV cache",
              "New requests wait or preempt others; raise kv_cache_gib or add engines."),
        Alert("KvmeshKvCacheFull", f"max by (engine) (vllm:kv_cache_usage_perc) > {cfg.kv_cache_full_ratio:g}",
              "15m", "info", "Engine {{ $labels.engine }} keeps its KV cache full",
              "Requests there wait or are preempted; size kv_cache_gib or add engines."),
        Alert("KvmeshMigrationRate", f"sum(rate(kvmesh_gateway_migrations_total[10m])) * 60 > "
              f"{cfg.migrations_per_minute:g}", "10m", "warning",
              "{{ $value | humanize }} streams per minute migrate to another engine",
              "Engines keep failing under running streams; see the engine board (health, flaps)."),
        Alert("KvmeshRejectionRate",
              "sum(rate(kvmesh_gateway_rejections_total[5m])) / "
              f"clamp_min(sum(rate(kvmesh_gateway_requests_total{{{_API}}}[5m])), 1e-9) > {cfg.rejection_ratio:g}",
              "10m", "warning", f"More than {cfg.rejection_ratio:.0%} of requests are refused",
              "kvmesh_gateway_rejections_total by reason: queue full, rate limits, no engine, bad requests."),
        Alert("KvmeshGatewayErrors",
              f'sum(rate(kvmesh_gateway_requests_total{{status=~"5..|UNAVAILABLE|INTERNAL", {_API}}}[5m])) / '
              f"clamp_min(sum(rate(kvmesh_gateway_requests_total{{{_API}}}[5m])), 1e-9) > 0.05",
              "10m", "warning", "More than 5% of requests fail at the gateways",
              "kvmesh_gateway_requests_total by status; see the gateway and engine logs."),
    ))


# ---------------------------------------------------------------- subject

_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")


def alert_subject(expr: str) -> str:
    """What the alert compares: the expression left of its top-level
    comparison, or the argument of `absent(...)`. It returns series while the
    mesh runs, firing or not."""
    text = expr.strip()
    if text.startswith("absent(") and text.endswith(")"):
        return alert_subject(text[len("absent("):-1])
    depth, quote = 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and any(text.startswith(op, i) for op in _COMPARISONS):
            return text[:i].strip()
    return text
