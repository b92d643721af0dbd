"""OpenTelemetry traces for every service, with one small interface and no
cost when off.

    tracing = tracing_for(config.tracing, "gateway")    # NO_TRACING when off
    span = tracing.span("gateway.request", remote=headers, kind=SERVER,
                        attributes={"kvmesh.request_id": rid})
    span.event("first_token")
    call_metadata = span.carrier()                       # W3C traceparent/tracestate
    span.end()
    await tracing.aclose()                               # flushes on service stop

Off (`tracing.otlp_endpoint` empty, the default): `tracing_for` returns
`NO_TRACING`, whose spans are the one `NO_SPAN` -- every method a no-op, no
header read, no allocation -- and the OpenTelemetry SDK is never imported
(tests/unit/test_tracing.py checks sys.modules). Callers never test
`enabled` for correctness, only to skip building attributes that cost
something (a formatted score list, say).

On: tracing_otel.py builds one TracerProvider per service instance (never
the process-global one: several services share a test process, and vLLM
sets the global one in its engine process), sampling ParentBased(ratio),
exporting over OTLP/HTTP (http/protobuf) from a BatchSpanProcessor thread --
serving never waits for an export. Context travels as W3C `traceparent` /
`tracestate`: HTTP headers and gRPC metadata at the public edge, and inside
the mesh the first message of each Admit and Generate call
(`trace_context`, a map: those calls are opened ahead of their request, see
services/gateway/spare_calls.py, so their metadata is fixed before the
request exists). The servers read that field, or the call's metadata.

Span names and attributes (README "Tracing"): `gateway.request`,
`scheduler.admit`, `engine.generate`; `kvmesh.request_id` on each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from services.common.config.tracing import TracingConfig

__all__ = [
    "CLIENT",
    "INTERNAL",
    "NO_SPAN",
    "NO_TRACING",
    "SERVER",
    "TRACE_HEADERS",
    "AttributeValue",
    "Span",
    "Tracing",
    "trace_carrier",
    "tracing_for",
]

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]
Attributes = Mapping[str, AttributeValue]

# Span kinds, as OpenTelemetry's SpanKind names them.
SERVER = "server"
CLIENT = "client"
INTERNAL = "internal"

# The W3C Trace Context headers (lower case: HTTP/2 and gRPC metadata).
TRACE_HEADERS = ("traceparent", "tracestate")


class Span(Protocol):
    """One unit of work. All methods are safe after `end` (they do nothing)."""

    @property
    def recording(self) -> bool:
        """Sampled: attributes and events are kept (False for NO_SPAN)."""

    @property
    def trace_id(self) -> str:
        """32 hex digits of a recorded span's trace, "" otherwise (log lines)."""

    def set(self, key: str, value: AttributeValue) -> None: ...

    def set_many(self, attributes: Attributes) -> None: ...

    def event(self, name: str, attributes: Attributes | None = None, at_unix_ns: int | None = None) -> None:
        """An event now, or at `at_unix_ns` (wall clock, ns since the epoch)."""

    def fail(self, message: str) -> None:
        """Mark the span's status ERROR with `message`."""

    def end(self) -> None:
        """Finish it (idempotent)."""

    def carrier(self) -> dict[str, str]:
        """This span's context as W3C headers, for the next hop ({} for
        NO_SPAN). An unsampled span still passes its decision on."""


class Tracing(Protocol):
    """A service's tracer: `NO_TRACING`, or tracing_otel.OtelTracing."""

    @property
    def enabled(self) -> bool: ...

    def span(
        self, name: str, *, parent: Span | None = None, remote: Mapping[str, str] | None = None,
        kind: str = INTERNAL, attributes: Attributes | None = None,
    ) -> Span:
        """A started span: child of `parent` (a local span), else of the
        context in `remote` (W3C headers: HTTP headers, gRPC metadata, a
        proto map), else a new trace's root."""

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        """Export what has ended so far (blocking; tests and shutdown)."""

    async def aclose(self) -> None:
        """Flush and stop exporting (on service stop; off the event loop)."""


class _NoSpan:
    """The span of tracing off: does nothing, costs a method call."""

    __slots__ = ()
    recording = False
    trace_id = ""

    def set(self, key: str, value: AttributeValue) -> None:
        pass

    def set_many(self, attributes: Attributes) -> None:
        pass

    def event(self, name: str, attributes: Attributes | None = None, at_unix_ns: int | None = None) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass

    def carrier(self) -> dict[str, str]:
        return {}


class _NoTracing:
    __slots__ = ()
    enabled = False

    def span(
        self, name: str, *, parent: Span | None = None, remote: Mapping[str, str] | None = None,
        kind: str = INTERNAL, attributes: Attributes | None = None,
    ) -> Span:
        return NO_SPAN

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        return True

    async def aclose(self) -> None:
        pass


NO_SPAN: Span = _NoSpan()
NO_TRACING: Tracing = _NoTracing()


def tracing_for(config: TracingConfig, role: str, instance: str = "") -> Tracing:
    """The tracer of one service instance: `role` names it
    ("<service_name>-<role>"), `instance` tells replicas apart
    (service.instance.id). NO_TRACING while no endpoint is configured --
    and then nothing of OpenTelemetry is imported."""
    if not config.enabled:
        return NO_TRACING
    from services.common.tracing_otel import OtelTracing  # only now: the SDK costs imports

    return OtelTracing(config, config.service(role), instance)


def trace_carrier(metadata: Mapping[str, str], fallback: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """The W3C headers a server continues from: a request message's own
    `trace_context` (`fallback`) when it carries one, else the call's
    metadata (lower-cased keys). Call it only when tracing is on."""
    if fallback and "traceparent" in fallback:
        return fallback
    return metadata
