"""The gateway's Prometheus metrics, in its own CollectorRegistry (never the
global one, so several gateways can live in one test process)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.common.finish_reason import FinishReason
from services.common.health_http import OnceDrain, Probes, add_health_routes, add_metrics_route
from services.common.label_cache import LabelCache
from services.common.metric_labels import PRIORITY_LABELS
from services.gateway.field_metrics import FieldMetrics

__all__ = ["GatewayMetrics", "StreamCount", "StreamSignals", "error_label", "metrics_app"]

# Interactive TTFT targets are < 0.5 s (P0) and < 2 s (P1); batch can wait minutes.
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
# A preempted request waits for a slot in its class again: seconds (a P0 burst
# ends) to minutes (batch work under a long interactive peak).
_PREEMPTED_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
# Arrival to the last token: a short interactive answer (seconds) to a long
# batch generation (many minutes).
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Labels of the per-request latency histograms (and token counters).
_REQUEST_LABELS = ["route", "priority", "model_name"]


class StreamCount:
    """The in-flight gauge, also counted here so a draining gateway can
    wait for it to reach zero (`wait_idle`) without polling. Transports call
    `inc()` / `dec()` as on a Gauge."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def inc(self) -> None:
        self.count += 1
        self._gauge.inc()
        self._idle.clear()

    def dec(self) -> None:
        self.count -= 1
        self._gauge.dec()
        if self.count <= 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        while self.count > 0:
            await self._idle.wait()


def error_label(code: str | None, kind: str) -> str:
    """The metric label of a refusal: its OpenAI error code, the scheduler's
    reject codes without their `reject_code_` prefix (`queue_full`,
    `no_engine`); the error kind where no code was set."""
    return (code or kind).removeprefix("reject_code_")


class StreamSignals:
    """What an event stream (services/gateway/event_stream.py) reports:
    heartbeats sent, and pacing for a slow reader (a gauge of streams paced
    now; each stream counted once as a slow reader)."""

    def __init__(self, heartbeats: Counter, paced_streams: Gauge, slow_readers: Counter) -> None:
        self._heartbeats = heartbeats
        self._paced = paced_streams
        self._slow = slow_readers

    def heartbeat(self) -> None:
        self._heartbeats.inc()

    def paced(self, paced: bool, first: bool = False) -> None:
        if paced:
            self._paced.inc()
            if first:
                self._slow.inc()
        else:
            self._paced.dec()


class GatewayMetrics:
    def __init__(self, replica: int = 0) -> None:
        self.registry = CollectorRegistry()
        # `child(metric, *labels)`: metric.labels(*labels), kept for the next request.
        self.child = LabelCache()
        labels = {"replica": str(replica)}
        self.requests = Counter(
            "kvmesh_gateway_requests_total", "Requests by route and final status",
            ["route", "status"], registry=self.registry,
        )
        self._add_latency_metrics(self.registry)
        self.active_streams = StreamCount(Gauge(
            "kvmesh_gateway_active_streams", "Requests in flight (queued or generating)",
            registry=self.registry,
        ))
        self.draining = Gauge(
            "kvmesh_gateway_draining", "1 while the gateway drains (after SIGTERM): not ready, still serving",
            registry=self.registry,
        )
        self.drain_cut = Counter(
            "kvmesh_gateway_drain_cut_total",
            "Streams still open at the drain bound, closed without cancelling their generations "
            "(their clients resume elsewhere)", registry=self.registry,
        )
        self.migrations = Counter(
            "kvmesh_gateway_migrations_total", "Streams moved to another engine after an engine failure",
            registry=self.registry,
        )
        self.stalls = Counter(
            "kvmesh_gateway_engine_stalls_total",
            "Engine streams declared lost for silence past the live first-token or stall deadline "
            "(services/gateway/stall_watch.py); each then migrates like a failure",
            registry=self.registry,
        )
        self.preemptions = Counter(
            "kvmesh_gateway_preemptions_total",
            "Streams stopped on their engine because the scheduler gave the slot to a higher class "
            "(each continues later from the next token), by the stream's priority",
            ["priority"], registry=self.registry,
        )
        self.preempted_seconds = Histogram(
            "kvmesh_gateway_preempted_seconds",
            "Time a preempted stream waited for its next placement (or its end), by the stream's priority",
            ["priority"], buckets=_PREEMPTED_BUCKETS, registry=self.registry,
        )
        self.readmissions = Counter(
            "kvmesh_gateway_scheduler_readmissions_total",
            "Requests re-admitted (queued) or re-attached (running) after a scheduler restart",
            ["state"], registry=self.registry,
        )
        self.finished = Counter(
            "kvmesh_gateway_finished_total", "Generations by finish reason",
            ["reason"], registry=self.registry,
        )
        self._add_request_metrics(self.registry)
        self.field = FieldMetrics(self.registry)
        self.info = Gauge("kvmesh_gateway_info", "Gateway replica", list(labels), registry=self.registry)
        self.info.labels(**labels).set(1)
        self._zero_known_series()

    def _zero_known_series(self) -> None:
        """Every child whose label values are known before any event, at 0: a
        board or alert reading a counter that does not exist yet sees
        nothing, not 0. (Children keyed by a route, a model or an error code
        appear with their first request.)"""
        for label in PRIORITY_LABELS:
            self.preemptions.labels(label)
        for state in ("queued", "running"):       # lease_link.py's re-admissions
            self.readmissions.labels(state)
        for reason in FinishReason:
            self.finished.labels(reason.value)
        for result in ("resumed", "cancelled"):   # the outcomes that are not an error code
            self.resumes.labels(result)

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        """Per-request latency histograms, by route, priority class and model."""
        self.ttft = Histogram(
            "kvmesh_gateway_time_to_first_token_seconds", "Arrival at the gateway to the first token",
            _REQUEST_LABELS, buckets=_TTFT_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "kvmesh_gateway_inter_token_latency_seconds", "Mean gap between tokens within each engine delta",
            _REQUEST_LABELS, buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvmesh_gateway_e2e_request_latency_seconds",
            "Arrival at the gateway to the request's end (its last event), every outcome",
            _REQUEST_LABELS, buckets=_E2E_BUCKETS, registry=r,
        )

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Tokens, refusals, resumes and the stream's own signals (heartbeats,
        pacing for a slow reader)."""
        self.prompt_tokens = Counter(
            "kvmesh_gateway_prompt_tokens", "Prompt tokens of admitted requests",
            ["model_name", "priority"], registry=r,
        )
        self.generation_tokens = Counter(
            "kvmesh_gateway_generation_tokens", "Tokens generated and relayed to clients (counted at each "
            "request's end)", ["model_name", "priority"], registry=r,
        )
        self.rejections = Counter(
            "kvmesh_gateway_rejections", "Requests answered with an error status (refused before any token; "
            "or, not streamed, failed), by the OpenAI error code answered (invalid_api_key, queue_full, "
            "no_engine, rate_limit_exceeded, ...)",
            ["reason"], registry=r,
        )
        self.resumes = Counter(
            "kvmesh_gateway_resumes", "Stream resumes (Last-Event-ID / ResumeFrom): resumed, or the error code "
            "that refused it (resume_not_found, resume_gap, ...), or cancelled", ["result"], registry=r,
        )
        self.heartbeats = Counter(
            "kvmesh_gateway_heartbeats", "Heartbeats sent on idle streams (SSE comments, gRPC heartbeat events)",
            registry=r,
        )
        self.paced_streams = Gauge(
            "kvmesh_gateway_paced_streams", "Streams whose client reads slower than tokens arrive, now: their "
            "event queue filled, deltas are merged and the engine coalesces", registry=r,
        )
        self.slow_readers = Counter(
            "kvmesh_gateway_slow_readers", "Streams that fell behind their client's reading at least once "
            "(counted once per stream)", registry=r,
        )
        self.stream_signals = StreamSignals(self.heartbeats, self.paced_streams, self.slow_readers)

    def rejected(self, reason: str) -> None:
        """A refusal answered with an error status (the transports' error
        boundary): `reason` is the OpenAI error code (`error_label`)."""
        self.rejections.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_app(
    metrics: GatewayMetrics, probes: Probes | None = None, drain: OnceDrain | None = None
) -> web.Application:
    """The metrics port: /metrics, the probes and POST /drain
    (services/common/health_http.py)."""
    app = web.Application()
    add_metrics_route(app, metrics.render)
    add_health_routes(app, probes or Probes(), drain)
    return app
