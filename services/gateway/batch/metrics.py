"""The Batch API's metrics, in the gateway's registry (services/gateway/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.gateway.batch.records import ACTIVE, FINAL

__all__ = ["BatchMetrics"]


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvmesh_gateway_batch_requests_total",
            "Batch lines this gateway ended, by result: ok (200 in the output file), error (an error "
            "response in the error file), retried (a retriable failure, tried again), resumed (a line of a "
            "dead owner re-attached to its generation), rerun (a dead owner's line whose generation was gone)",
            ["result"], registry=registry,
        )
        self.batches = Gauge(
            "kvmesh_gateway_batches",
            "Batches in the shared database by status (every gateway reports the same database)",
            ["status"], registry=registry,
        )
        for status in (*ACTIVE, *FINAL):
            self.batches.labels(status)
        self.tokens = Counter(
            "kvmesh_gateway_batch_tokens_total", "Completion tokens generated for batch lines by this gateway",
            registry=registry,
        )
        self.in_flight_limit = Gauge(
            "kvmesh_gateway_batch_in_flight_limit",
            "Lines this gateway may run at once now (the adaptive window, <= batch.max_in_flight)",
            registry=registry,
        )
