"""Tracing on: the OpenTelemetry SDK behind services/common/tracing.py's
interface. Imported only when `tracing.otlp_endpoint` is set.

One TracerProvider per service instance (`OtelTracing`), never the global
one: a test process runs a scheduler, gateways and engines side by side,
each with its own `service.name`. Sampling is ParentBased(TraceIdRatioBased):
a request that brings a `traceparent` keeps its caller's decision, a new
trace is kept with probability `sample_ratio`. Spans leave through a
BatchSpanProcessor (its own thread, batches every few seconds) and the
OTLP/HTTP protobuf exporter; `aclose` flushes them when the service stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common.config.tracing import TracingConfig
from services.common.tracing import CLIENT, SERVER, Attributes, AttributeValue, Span

__all__ = ["OtelSpan", "OtelTracing"]

log = logging.getLogger(__name__)

_KINDS = {SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}
_PROPAGATOR = TraceContextTextMapPropagator()


class OtelSpan:
    """An SDK span behind the `Span` interface."""

    __slots__ = ("_span", "recording")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self.recording = span.is_recording()

    @property
    def trace_id(self) -> str:
        return format(self._span.get_span_context().trace_id, "032x") if self.recording else ""

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def set_many(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def event(self, name: str, attributes: Attributes | None = None, at_unix_ns: int | None = None) -> None:
        self._span.add_event(name, attributes, at_unix_ns)

    def fail(self, message: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self._span.end()  # the SDK ignores (and logs at debug) a second end

    def carrier(self) -> dict[str, str]:
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, trace.set_span_in_context(self._span))
        return out

    @property
    def otel(self) -> trace.Span:
        return self._span


class OtelTracing:
    """One service instance's tracer (see the module docstring)."""

    enabled = True

    def __init__(self, config: TracingConfig, service_name: str, instance: str = "",
                 exporter: SpanExporter | None = None) -> None:
        resource = Resource.create({
            "service.name": service_name,
            "service.namespace": config.service_name,
            "service.instance.id": instance or f"{socket.gethostname()}:{os.getpid()}",
        })
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)), resource=resource)
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=config.traces_url, headers=dict(config.headers) or None,
                                        timeout=config.export_timeout_seconds)
        self._processor = BatchSpanProcessor(exporter)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("kvmesh")
        self._closed = False
        log.info("tracing: %s exports spans to %s (sample ratio %g)", service_name, config.traces_url,
                 config.sample_ratio)

    def span(
        self, name: str, *, parent: Span | None = None, remote: Mapping[str, str] | None = None,
        kind: str = "internal", attributes: Attributes | None = None,
    ) -> Span:
        context = None
        if isinstance(parent, OtelSpan):
            context = trace.set_span_in_context(parent.otel)
        elif remote is not None and remote.get("traceparent"):
            context = _PROPAGATOR.extract(remote)
        span = self._tracer.start_span(name, context=context, kind=_KINDS.get(kind, SpanKind.INTERNAL),
                                       attributes=attributes)
        return OtelSpan(span)

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_seconds * 1000))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shutting the processor down exports what is left: a blocking HTTP
        # post, so off the event loop.
        await asyncio.to_thread(self._provider.shutdown)
