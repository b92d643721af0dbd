"""The gateway's span of a request that migrates or is preempted: its events,
and its context in every Admit and Generate message (fake scheduler and
engines, an in-memory exporter behind the gateway's tracer)."""

from __future__ import annotations

import asyncio

import openai
from conftest import KEY_FULL, MODEL, FakeEngine, Mesh
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_gateway_preemption import _chat

from services.common.config import TracingConfig
from services.common.tracing_otel import OtelTracing

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]
_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _trace(mesh: Mesh) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    mesh.gateway.frontdoor.tracing = OtelTracing(
        TracingConfig(otlp_endpoint="http://127.0.0.1:9"), "kvmesh-gateway", exporter=exporter)
    return exporter


async def _span(mesh: Mesh, exporter: InMemorySpanExporter):
    """The request's span, once the gateway ended it (after the client's last byte)."""
    async with asyncio.timeout(10):
        while True:
            mesh.gateway.frontdoor.tracing.flush()
            if exporter.get_finished_spans():
                break
            await asyncio.sleep(0.01)
    (span,) = exporter.get_finished_spans()
    return span


def _context_of(span) -> str:
    return f"{span.context.trace_id:032x}-{span.context.span_id:016x}"


async def test_a_migration_is_an_event_and_every_hop_gets_the_context(mesh: Mesh) -> None:
    exporter = _trace(mesh)
    a = mesh.engines["engine-a"]
    a.break_after, a.answer_tokens = 3, 9
    b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=9))
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0,
                                  timeout=20, default_headers={"traceparent": _PARENT}) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
        [ch async for ch in stream]
    await asyncio.wait_for(mesh.scheduler.admits[0].wait_done(), 10)
    span = await _span(mesh, exporter)
    assert f"{span.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert [e.name for e in span.events] == ["first_token", "migration"]
    migration = span.events[1].attributes
    assert migration["kvmesh.engine"] == "engine-a" and migration["kvmesh.generated_tokens"] == 3
    assert span.attributes["kvmesh.engine"] == "engine-b" and span.attributes["gen_ai.usage.output_tokens"] == 9
    # The span's own context, in the Admit request and in both engines' requests.
    own = _context_of(span)
    assert own in mesh.scheduler.admits[0].request.trace_context["traceparent"]
    assert own in a.requests[0].trace_context["traceparent"]
    assert own in b.requests[0].trace_context["traceparent"]


async def test_a_preemption_is_an_event_then_resumed(mesh: Mesh) -> None:
    exporter = _trace(mesh)
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 4
    await mesh.add_engine(FakeEngine("engine-b", answer_tokens=12))
    scheduler = mesh.scheduler
    scheduler.requeue_engines, scheduler.requeue_queued = ["engine-b"], 1
    events = await _chat(mesh, [4])
    assert events[-1].finished.usage.completion_tokens == 12
    span = await _span(mesh, exporter)
    names = [e.name for e in span.events]
    assert names == ["first_token", "preempted", "resumed"]
    assert span.events[1].attributes["kvmesh.engine"] == "engine-a"
    assert span.events[2].attributes["kvmesh.engine"] == "engine-b"
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.attributes["kvmesh.status"] == "ok"


async def test_off_sends_no_context(mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20,
                                  default_headers={"traceparent": _PARENT}) as c:
        await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert not mesh.scheduler.admits[0].request.trace_context
    assert not mesh.engines["engine-a"].requests[0].trace_context
