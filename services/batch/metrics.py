"""The batch service's metrics, in its own registry (served on `batch.metrics_port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.batch.records import ACTIVE, FINAL

__all__ = ["BatchMetrics"]


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "kvmesh_batch_requests_total",
            "Batch lines this batch service ended, by result: ok (200 in the output file), error (an error "
            "response in the error file), retried (a retriable failure, tried again), resumed (a line of a "
            "dead owner re-attached to its generation), rerun (a dead owner's line whose generation was gone)",
            ["result"], registry=registry,
        )
        self.batches = Gauge(
            "kvmesh_batch_batches", "Batches in the batch database by status", ["status"], registry=registry,
        )
        for status in (*ACTIVE, *FINAL):
            self.batches.labels(status)
        self.tokens = Counter(
            "kvmesh_batch_tokens_total", "Completion tokens generated for batch lines", registry=registry,
        )
        self.in_flight_limit = Gauge(
            "kvmesh_batch_in_flight_limit",
            "Lines the batch service may run at once now (the adaptive window, <= batch.max_in_flight)",
            registry=registry,
        )
