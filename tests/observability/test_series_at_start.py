"""Issue 29: a board or alert that reads a counter which does not exist yet
sees nothing, not 0. So every series a board or rule names exists in its
service's registry right after the service built it -- at 0 -- unless its
label values come only with traffic (a route, a model, an engine id, an
error code): those are listed in OPEN with the reason, and the list is
checked both ways (a listed one that exists at start is stale)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from services.batch.metrics import BatchMetrics
from services.common.clock import FakeClock
from services.common.config import AlertsConfig, load_config
from services.engine.backend import LoadSnapshot
from services.engine.metrics import EngineMetrics
from services.gateway.metrics import GatewayMetrics
from services.gateway.response_cache.metrics import CacheMetrics
from services.observability.metric_catalogue import exported_metric_names
from services.observability.promql import ENVOY_METRICS, alert_queries, metric_names, panel_queries
from services.scheduler.core import SchedulerCore

ROOT = Path(__file__).resolve().parents[2]

_MODEL = "the model's first request"
OPEN = {
    "kvmesh_gateway_requests_total": "route and status: the first request's",
    "kvmesh_gateway_time_to_first_token_seconds_bucket": _MODEL,
    "kvmesh_gateway_inter_token_latency_seconds_bucket": _MODEL,
    "kvmesh_gateway_e2e_request_latency_seconds_bucket": _MODEL,
    "kvmesh_gateway_prompt_tokens_total": _MODEL,
    "kvmesh_gateway_generation_tokens_total": _MODEL,
    "kvmesh_gateway_rejections_total": "the OpenAI error code answered: an open set (any code a refusal has)",
    "gen_ai_server_time_to_first_token_seconds_bucket": _MODEL,
    "gen_ai_server_time_per_output_token_seconds_bucket": _MODEL,
    "gen_ai_server_request_duration_seconds_bucket": _MODEL,
    "gen_ai_client_operation_duration_seconds_bucket": _MODEL,
    "gen_ai_client_token_usage_sum": _MODEL,
    "inference_objective_request_total": _MODEL,
    "inference_objective_request_error_total": _MODEL,
    "inference_objective_running_requests": _MODEL,
    "kvmesh_scheduler_engine_serving": "the engine's id: it appears when the engine registers",
    "kvmesh_scheduler_engine_flaps_total": "the engine's id: it appears when the engine registers",
    "kvmesh_scheduler_reported_prefix_hit_rate": "the engine's id: it appears with its first load report",
}


def _at_start() -> dict[str, CollectorRegistry]:
    """Each service's registry as the service builds it, before any event."""
    gateway = GatewayMetrics()
    CacheMetrics(gateway.registry, "embedded")
    batch = BatchMetrics()
    scheduler = SchedulerCore(load_config(ROOT / "config" / "kvmesh.yaml"), FakeClock())
    engine = EngineMetrics("engine-0", "m", lambda: LoadSnapshot(0, 0, 0, 1, 0, 0, []))
    return {"gateway": gateway.registry, "scheduler": scheduler.metrics.registry, "engine": engine.registry,
            "batch": batch.registry}


def _named() -> set[str]:
    names: set[str] = set()
    for q in panel_queries() + alert_queries(AlertsConfig()):
        names |= metric_names(q.expr)
    return names - ENVOY_METRICS - {"up"}


def _samples(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


def test_every_named_series_with_known_labels_exists_at_start() -> None:
    exported, registries = exported_metric_names(), _at_start()
    missing, stale = [], []
    for name in sorted(_named()):
        services = [s for s, names in exported.items() if name in names]
        assert services, f"{name}: no service exports it"
        present = any(name in _samples(registries[s]) for s in services)
        if name in OPEN:
            if present:
                stale.append(name)
        elif not present:
            missing.append(f"{name} ({', '.join(services)})")
    assert missing == [], "named by a board or rule, absent until its first event:\n" + "\n".join(missing)
    assert stale == [], f"in OPEN yet present at start: {stale}"
    assert set(OPEN) <= _named(), sorted(set(OPEN) - _named())


def test_the_issue_29_examples_read_zero() -> None:
    gateway = _at_start()["gateway"]
    assert gateway.get_sample_value("kvmesh_gateway_resumes_total", {"result": "resumed"}) == 0.0
    for priority in ("P0", "P1", "P2"):
        assert gateway.get_sample_value("kvmesh_gateway_preemptions_total", {"priority": priority}) == 0.0


def test_a_changed_policy_has_its_series_at_zero() -> None:
    core = SchedulerCore(load_config(ROOT / "config" / "kvmesh.yaml"), FakeClock())
    other = next(name for name in core.policy_names() if name != core.policy.name)
    core._use_policy(other)
    registry = core.metrics.registry
    assert registry.get_sample_value("kvmesh_scheduler_placements_total", {"policy": other, "kind": "warm"}) == 0.0
    assert registry.get_sample_value("kvmesh_scheduler_decision_seconds_count", {"policy": other}) == 0.0
