"""The gateway's `gateway.request` span helpers: nothing read or built when
tracing is off; the client's status (HTTP or gRPC) and outcome when on."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.config import TracingConfig
from services.common.tracing import NO_SPAN, NO_TRACING
from services.common.tracing_otel import OtelTracing
from services.gateway import request_trace
from services.gateway.errors import ErrorKind, GatewayError


class _Untouchable(dict):
    def get(self, *_args: object, **_kw: object) -> None:
        raise AssertionError("headers read with tracing off")


def _tracing() -> tuple[OtelTracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return OtelTracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9"), "kvmesh-gateway", exporter=exporter), exporter


def test_off_reads_no_header() -> None:
    span = request_trace.start(NO_TRACING, _Untouchable(), "chat")
    assert span is NO_SPAN
    request_trace.failed(span, GatewayError(ErrorKind.RATE_LIMITED, "slow down"))
    request_trace.finished(span, 3, 200)


def test_statuses_and_outcomes() -> None:
    tracing, exporter = _tracing()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ok = request_trace.start(tracing, {"traceparent": parent}, "completion")
    request_trace.finished(ok, 7, 200)
    limited = request_trace.start(tracing, {}, "chat")
    request_trace.failed(limited, GatewayError(ErrorKind.RATE_LIMITED, "slow down", code="rate_limited"), 0)
    unavailable = request_trace.start(tracing, {}, "grpc.Chat")
    request_trace.failed(unavailable, GatewayError(ErrorKind.UNAVAILABLE, "no engine"), grpc=True)
    gone = request_trace.start(tracing, {}, "chat")
    request_trace.failed(gone, asyncio.CancelledError(), 2)
    tracing.flush()
    by_route = {s.attributes["kvmesh.route"] + str(i): s for i, s in enumerate(exporter.get_finished_spans())}
    first, second, third, fourth = by_route.values()
    assert format(first.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert first.attributes["gen_ai.operation.name"] == "text_completion"
    assert (first.attributes["http.response.status_code"], first.attributes["kvmesh.status"]) == (200, "ok")
    assert first.attributes["gen_ai.usage.output_tokens"] == 7
    assert (second.attributes["http.response.status_code"], second.attributes["kvmesh.status"]) == (429, "rate_limited")
    assert second.status.description == "slow down"
    assert third.attributes["rpc.grpc.status_code"] == 14 and third.attributes["gen_ai.operation.name"] == "chat"
    assert (fourth.attributes["http.response.status_code"], fourth.attributes["kvmesh.status"]) == (499, "cancelled")
