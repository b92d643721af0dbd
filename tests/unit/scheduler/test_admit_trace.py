"""`scheduler.admit` spans (admit_trace.py) over the real core on a fake
clock: queue wait, aging promotions at their own times, the policy's
scores, the gateway's context continued; nothing explained when off."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.config import TracingConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.common.tracing import NO_TRACING
from services.common.tracing_otel import OtelTracing
from services.scheduler.admit_trace import AdmitTraces
from services.scheduler.aging import AgingRule
from services.scheduler.events import RequestArrived
from services.scheduler.records import PlacedInfo, QueuedInfo, RejectedInfo, RejectReason

from .helpers import add_engine, admit, make_core, opts, report_load

_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _traces(core, clock):
    exporter = InMemorySpanExporter()
    tracing = OtelTracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9"), "kvmesh-scheduler", "s",
                          exporter=exporter)
    core.explain = True
    aging = AgingRule.from_config(core._config.aging)
    return AdmitTraces(tracing, aging, clock), tracing, exporter


def _request(request_id: str, priority: int) -> scheduler_pb2.AdmitRequest:
    return scheduler_pb2.AdmitRequest(request_id=request_id, model="m", tenant="t", priority=priority,
                                      prompt_tokens=32, max_tokens=16, trace_context={"traceparent": _PARENT})


def test_a_queued_request_ages_then_is_placed_with_its_scores() -> None:
    core, clock = make_core()
    traces, tracing, exporter = _traces(core, clock)
    add_engine(core, "e1", report=False)           # known, not placeable: the request waits
    traces.begin("r1", _request("r1", 2), {})
    queued = admit(core, opts("r1", priority=2))
    assert isinstance(queued, QueuedInfo)
    traces.notice("r1", queued)
    arrived_ns = int(clock.wall() * 1e9)
    clock.advance(core._config.aging.p2_seconds + 5)  # P2 -> P1 on the way
    token = add_engine(core, "e2", report=False)
    placed = [n for rid, n in report_load(core, "e2", token) if rid == "r1"]
    assert len(placed) == 1 and isinstance(placed[0], PlacedInfo) and placed[0].detail is not None
    traces.notice("r1", placed[0])
    traces.closed("r1")
    assert tracing.flush()
    (span,) = exporter.get_finished_spans()
    assert span.name == "scheduler.admit"
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent.span_id == 0xB7AD6B7169203331
    attrs = span.attributes
    assert attrs["kvmesh.request_id"] == "r1" and attrs["kvmesh.admit"] == "admit"
    assert attrs["kvmesh.engine"] == "e2" and attrs["kvmesh.policy"] == core.policy.name
    assert attrs["kvmesh.queue_wait_s"] == pytest.approx(core._config.aging.p2_seconds + 5)
    assert attrs["kvmesh.priority"] == 2 and attrs["kvmesh.priority.effective"] == 1
    assert attrs["kvmesh.placement.kind"] == "cold" and attrs["kvmesh.placement.candidates"] == 1
    (score,) = attrs["kvmesh.placement.scores"]
    assert score.startswith("e2=") and 0.0 <= float(score.split("=")[1]) <= 1.0
    assert attrs["kvmesh.status"] == "placed"
    events = {e.name: e for e in span.events}
    assert set(events) == {"queued", "aging_promotion", "placed"}
    promotion = events["aging_promotion"]
    assert (promotion.attributes["kvmesh.from"], promotion.attributes["kvmesh.to"]) == (2, 1)
    expected_ns = arrived_ns + int(core._config.aging.p2_seconds * 1e9)
    assert abs(promotion.timestamp - expected_ns) < 1_000_000  # at its own moment, not when placed


def test_replace_opens_a_second_span_and_rejection_ends_it() -> None:
    core, clock = make_core()
    traces, tracing, exporter = _traces(core, clock)
    traces.begin("r1", _request("r1", 0), {})
    traces.notice("r1", PlacedInfo("e1", "e1:1", "l1", 0))
    traces.again("r1", "replace", 40)
    traces.notice("r1", RejectedInfo(RejectReason.NO_ENGINE, "no engine", 1.0))
    traces.closed("r1")
    tracing.flush()
    first, second = exporter.get_finished_spans()
    assert first.attributes["kvmesh.admit"] == "admit" and first.attributes["kvmesh.status"] == "placed"
    assert second.attributes["kvmesh.admit"] == "replace" and second.attributes["kvmesh.status"] == "no_engine"
    assert second.attributes["kvmesh.prompt_tokens"] == 40
    assert second.status.description == "no engine"
    assert first.parent.span_id == second.parent.span_id == 0xB7AD6B7169203331
    assert not traces._open


def test_off_explains_nothing() -> None:
    core, clock = make_core()
    traces = AdmitTraces(NO_TRACING, AgingRule.from_config(core._config.aging), clock)
    assert not traces.enabled and not core.explain
    add_engine(core, "e1")
    notices = [n for _, n in core.handle(RequestArrived(opts("r1"))).notices]
    placed = [n for n in notices if isinstance(n, PlacedInfo)]
    assert len(placed) == 1 and placed[0].detail is None
    traces.begin("r1", _request("r1", 1), {})
    for notice in notices:
        traces.notice("r1", notice)
    traces.closed("r1")
    assert not traces._open
