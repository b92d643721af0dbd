"""Which metric names each service exports: built from the services' real
metric classes and their registries (never a hand-kept list), so a test can
fail when a dashboard panel or an alert names a metric no service exports.

Two views, both keyed "gateway" | "scheduler" | "engine" | "batch":

- `exported_metric_families()`: family names as prometheus_client registers
  them (a counter without its `_total`: `kvmesh_gateway_rejections`).
- `exported_metric_names()`: every sample name that can appear in that
  service's /metrics exposition, i.e. what a PromQL query names: counters
  as `<family>_total` (and `<family>_created`), histograms as `_bucket`,
  `_sum`, `_count` (and `_created`), summaries as `_sum`, `_count`, gauges
  as the family name, info as `<family>_info`. Series with labels are listed
  whether or not a child exists yet (a labelled counter shows up in the
  exposition only after its first event).

It imports the four services' metric modules, so it lives with the
dashboards that read it (services/observability), not in services/common,
which no service module depends the other way on.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

__all__ = ["SERVICES", "exported_metric_families", "exported_metric_names", "sample_names"]

SERVICES = ("gateway", "scheduler", "engine", "batch")

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gauge": ("",),
    "unknown": ("",),
}


def _registries() -> dict[str, CollectorRegistry]:
    from services.batch.metrics import BatchMetrics
    from services.engine.backend import LoadSnapshot
    from services.engine.metrics import EngineMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.response_cache.metrics import CacheMetrics
    from services.scheduler.metrics import SchedulerMetrics

    def idle() -> LoadSnapshot:
        return LoadSnapshot(0, 0, 0, 1, 0, 0, [])

    gateway = GatewayMetrics()
    CacheMetrics(gateway.registry, "embedded")   # the response cache's, on the gateway's registry
    return {
        "gateway": gateway.registry,
        "scheduler": SchedulerMetrics().registry,
        "engine": EngineMetrics("catalogue", "catalogue", idle).registry,
        "batch": BatchMetrics().registry,
    }


def _families(registry: CollectorRegistry) -> dict[str, str]:
    """family name -> type, for every collector in the registry."""
    return {family.name: family.type for family in registry.collect()}


def sample_names(family: str, kind: str) -> set[str]:
    """The sample names a family of this type appears under."""
    return {family + suffix for suffix in _SUFFIXES.get(kind, ("",))}


def exported_metric_families() -> dict[str, set[str]]:
    return {service: set(_families(r)) for service, r in _registries().items()}


def exported_metric_names() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for service, registry in _registries().items():
        names: set[str] = set()
        for family, kind in _families(registry).items():
            names |= sample_names(family, kind)
        out[service] = names
    return out
