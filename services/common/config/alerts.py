"""Thresholds of the alert rules, under `alerts` in the YAML. No service reads
them: `kvmesh dashboards render` writes them into the rule files
(services/observability/alerts.py; deploy/overlays/monitoring/). Bounds are
checked at load by `validation.py`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AlertsConfig"]


@dataclass
class AlertsConfig:
    """When an alert fires. Change one, then `kvmesh dashboards render` (the
    freshness test fails until the checked-in rules match this file)."""

    # The P0 (interactive) class's target for p99 time to first token at the
    # gateways, seconds. > 0. 0.5 s: the interactive target kvmesh's TTFT
    # buckets are built around (a chat turn that starts within half a second
    # feels immediate).
    p0_ttft_p99_seconds: float = 0.5
    # Alert when a class's oldest queued request has waited this fraction of
    # its aging bound (scheduler.aging). Within 0 .. 1 (exclusive of 0). 0.8:
    # a class that close to promotion is not being served.
    aging_fraction: float = 0.8
    # KV cache usage (0..1) above which every engine of a model counts as
    # full. Within 0 .. 1. 0.95: vLLM preempts near full.
    kv_cache_full_ratio: float = 0.95
    # Refused requests (kvmesh_gateway_rejections_total) over all requests
    # above which the rejection alert fires. Within 0 .. 1. 5%: a few
    # refusals are clients' mistakes; more means the mesh turns work away.
    rejection_ratio: float = 0.05
    # Streams migrated to another engine per minute above which the
    # migration alert fires. > 0. 5/min: an engine dying now and then
    # migrates a batch at once; a steady stream means engines keep failing.
    migrations_per_minute: float = 5.0
    # Serving <-> not-serving transitions of one engine within 15 minutes
    # above which it counts as flapping. >= 1. 4: two restarts.
    flaps_per_15m: int = 4
