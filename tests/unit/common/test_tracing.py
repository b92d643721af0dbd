"""services/common/tracing.py: off is a no-op that imports nothing of
OpenTelemetry; on, spans continue W3C contexts and reach the exporter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from services.common.config import ConfigError, MeshConfig, TracingConfig, validate_config
from services.common.tracing import NO_SPAN, NO_TRACING, SERVER, trace_carrier, tracing_for

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]

_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
_PARENT_UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def _otel(ratio: float = 1.0):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.common.tracing_otel import OtelTracing

    exporter = InMemorySpanExporter()
    config = TracingConfig(otlp_endpoint="http://127.0.0.1:9", sample_ratio=ratio)
    return OtelTracing(config, "kvmesh-test", "t0", exporter=exporter), exporter


def test_off_is_the_no_op_tracer():
    tracing = tracing_for(TracingConfig(), "gateway")
    assert tracing is NO_TRACING and not tracing.enabled
    span = tracing.span("gateway.request", remote={"traceparent": _PARENT}, kind=SERVER)
    assert span is NO_SPAN and not span.recording and span.trace_id == ""
    span.set("a", 1)
    span.set_many({"b": "c"})
    span.event("first_token", {"x": 1})
    span.fail("no")
    span.end()
    span.end()
    assert span.carrier() == {}
    assert tracing.flush() is True


def test_off_imports_no_opentelemetry():
    """Every service built with the default config, one request's spans
    asked for: nothing of OpenTelemetry is loaded."""
    code = textwrap.dedent("""
        import asyncio, sys
        from services.common.config import MeshConfig
        from services.common.tracing import tracing_for
        from services.scheduler.server import SchedulerService
        import services.gateway.server, services.engine.server, services.gateway.request_trace
        config = MeshConfig()
        SchedulerService(config)
        tracing = tracing_for(config.tracing, "gateway")
        services.gateway.request_trace.start(tracing, {"traceparent": "x"}, "chat").end()
        asyncio.run(tracing.aclose())
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        print("LOADED", loaded)
        sys.exit(1 if loaded else 0)
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_on_continues_a_remote_parent_and_exports():
    tracing, exporter = _otel()
    assert tracing.enabled
    root = tracing.span("gateway.request", remote={"traceparent": _PARENT}, kind=SERVER,
                        attributes={"kvmesh.request_id": "r1"})
    assert root.recording and root.trace_id == "0af7651916cd43dd8448eb211c80319c"
    child = tracing.span("scheduler.admit", remote=root.carrier())
    local = tracing.span("inner", parent=root)
    child.event("placed")
    child.fail("refused")
    for span in (local, child, root):
        span.end()
    assert tracing.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"gateway.request", "scheduler.admit", "inner"}
    request = spans["gateway.request"]
    assert request.parent is not None and request.parent.span_id == 0xB7AD6B7169203331
    assert request.attributes["kvmesh.request_id"] == "r1"
    for name in ("scheduler.admit", "inner"):
        assert spans[name].context.trace_id == request.context.trace_id
        assert spans[name].parent.span_id == request.context.span_id
    assert [e.name for e in spans["scheduler.admit"].events] == ["placed"]
    assert spans["scheduler.admit"].status.description == "refused"


def test_on_carrier_is_w3c():
    tracing, _ = _otel()
    span = tracing.span("x")
    carrier = span.carrier()
    version, trace_id, span_id, flags = carrier["traceparent"].split("-")
    assert (version, trace_id) == ("00", span.trace_id) and len(span_id) == 16
    assert int(flags, 16) & 1  # sampled
    span.end()


def test_sampling_is_parent_based():
    tracing, exporter = _otel(ratio=0.0)
    new = tracing.span("new")  # ratio 0: a new trace is not kept ...
    assert not new.recording and new.trace_id == ""
    assert not int(new.carrier()["traceparent"][-2:], 16) & 1  # ... and says so downstream
    followed = tracing.span("followed", remote={"traceparent": _PARENT})  # a sampled parent wins
    dropped = tracing.span("dropped", remote={"traceparent": _PARENT_UNSAMPLED})
    assert followed.recording and not dropped.recording
    for span in (new, followed, dropped):
        span.end()
    tracing.flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["followed"]


def test_garbage_traceparent_starts_a_new_trace():
    tracing, _ = _otel()
    span = tracing.span("x", remote={"traceparent": "not-a-traceparent"})
    assert span.recording and len(span.trace_id) == 32
    span.end()


def test_trace_carrier_prefers_the_message():
    meta = {"traceparent": "meta"}
    assert trace_carrier(meta, {"traceparent": "msg"}) == {"traceparent": "msg"}
    assert trace_carrier(meta, {}) is meta


def test_config_urls_and_bounds():
    config = TracingConfig(otlp_endpoint="http://collector:4318/")
    assert config.traces_url == "http://collector:4318/v1/traces" and config.service("gateway") == "kvmesh-gateway"
    assert TracingConfig(otlp_endpoint="https://x/v1/traces").traces_url == "https://x/v1/traces"
    for bad, field in [
        (TracingConfig(otlp_endpoint="collector:4318"), "otlp_endpoint"),
        (TracingConfig(otlp_endpoint="http://x", sample_ratio=1.5), "sample_ratio"),
        (TracingConfig(service_name=""), "service_name"),
        (TracingConfig(headers={"Bad Header": "x"}), "headers"),
        (TracingConfig(export_timeout_seconds=0), "export_timeout_seconds"),
    ]:
        with pytest.raises(ConfigError, match=f"tracing.{field}"):
            validate_config(MeshConfig(tracing=bad))
    validate_config(MeshConfig(tracing=TracingConfig(otlp_endpoint="http://127.0.0.1:4318",
                                                     headers={"authorization": "Bearer x"})))
