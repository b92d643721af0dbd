"""One trace per request across Envoy -> gateway -> scheduler -> engine
(README "Tracing"): a sim mesh with `tracing.otlp_endpoint` pointed at an
in-process OTLP/HTTP receiver (oteltap) on a loopback port, one streamed
chat through Envoy, one gRPC Chat through Envoy's public port carrying the
client's own traceparent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import grpc
import pytest
from _spans import OURS as _OURS
from _spans import Spans as _Spans
from _spans import attrs as _attrs
from _spans import free_port as _free_port

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.launcher.mesh import Mesh

oteltap = pytest.importorskip("oteltap", reason="oteltap (the test OTLP receiver) is not installed")

MODEL = "tiny-llama"
_CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


RECEIVER_PORT = _free_port()


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.tracing.otlp_endpoint = f"http://127.0.0.1:{RECEIVER_PORT}"


def _one(spans: list[Any], name: str) -> Any:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} {name} spans: {[s.name for s in spans]}"
    return found[0]


async def _chat_through_envoy(mesh: Mesh, request_id: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "stream": True,
            "max_tokens": 16}
    headers = {"Authorization": f"Bearer {mesh.api_key}", "x-request-id": request_id}
    deltas = 0
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
                                headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-request-id"] == request_id
            async for line in resp.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    deltas += bool(json.loads(text[6:])["choices"][0]["delta"].get("content"))
                if text == "data: [DONE]":
                    break
    assert deltas >= 1


def _chat_over_grpc(mesh: Mesh, request_id: str, traceparent: str) -> None:
    meta = [("authorization", f"Bearer {mesh.api_key}"), ("x-request-id", request_id),
            ("traceparent", traceparent)]
    with grpc.insecure_channel(mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.ChatRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="user",
                                            content="trace me too")],
                                            sampling=common_pb2.SamplingParams(max_tokens=8))
        events = list(stub.Chat(request, metadata=meta, timeout=60))
    assert events[-1].WhichOneof("event") == "finished"


async def test_one_trace_across_envoy_gateway_scheduler_engine(e2e_mesh: Mesh) -> None:
    settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=RECEIVER_PORT)
    async with oteltap.OtelTapHttpProtobufReceiver(settings) as tap:
        spans = _Spans()
        collector = asyncio.create_task(spans.collect(tap))
        try:
            await _check_sse_trace(e2e_mesh, spans)
            await _check_grpc_client_trace(e2e_mesh, spans)
        finally:
            collector.cancel()


async def _check_sse_trace(mesh: Mesh, spans: _Spans) -> None:
    request_id = "trace-e2e-sse-1"
    await _chat_through_envoy(mesh, request_id)
    trace = await spans.wait_for(request_id)
    gateway, admit, generate = (_one(trace, name) for name in _OURS)
    # Parent-linked: the gateway's span is the parent of the scheduler's and the engine's ...
    assert admit.parent_span_id == gateway.span_id and generate.parent_span_id == gateway.span_id
    # ... and continues Envoy's, the root of the trace.
    envoy = [s for s in trace if s.name not in _OURS]
    assert envoy, f"no Envoy span in the trace: {[s.name for s in trace]}"
    roots = [s for s in envoy if s.span_id == gateway.parent_span_id]
    assert len(roots) == 1 and not roots[0].parent_span_id, [(s.name, _attrs(s)) for s in envoy]
    assert _attrs(roots[0]).get("guid:x-request-id") == request_id  # Envoy's own tag of the id
    # The request id on every span of ours, the gateway's view of it.
    g, a, e = _attrs(gateway), _attrs(admit), _attrs(generate)
    assert g["kvmesh.request_id"] == a["kvmesh.request_id"] == e["kvmesh.request_id"] == request_id
    assert g["gen_ai.request.model"] == MODEL and g["gen_ai.operation.name"] == "chat"
    assert g["gen_ai.usage.input_tokens"] > 0 and g["gen_ai.usage.output_tokens"] > 0
    assert g["http.response.status_code"] == 200 and g["kvmesh.status"] == "ok"
    assert "first_token" in {ev.name for ev in gateway.events}
    # The scheduler's decision: queue wait and the policy's score of each engine.
    assert a["kvmesh.queue_wait_s"] >= 0 and a["kvmesh.policy"] == mesh.config.scheduler.policy
    scores = dict(s.split("=") for s in a["kvmesh.placement.scores"])
    assert set(scores) == {"engine-0", "engine-1"} and a["kvmesh.engine"] in scores
    assert all(0.0 <= float(v) <= 1.0 for v in scores.values())
    assert e["kvmesh.engine"] == a["kvmesh.engine"] and e["gen_ai.usage.output_tokens"] > 0
    assert {"first_token", "decode_end"} <= {ev.name for ev in generate.events}
    # Logs link to the trace: the gateway's request line names its trace id.
    log = mesh.log_tail("gateway-0", 400)
    assert f"request {request_id} " in log and f"trace={gateway.trace_id.hex()}" in log


async def _check_grpc_client_trace(mesh: Mesh, spans: _Spans) -> None:
    request_id = "trace-e2e-grpc-1"
    traceparent = f"00-{_CLIENT_TRACE}-00f067aa0ba902b7-01"
    await asyncio.to_thread(_chat_over_grpc, mesh, request_id, traceparent)
    trace = await spans.wait_for(request_id)
    gateway, admit, generate = (_one(trace, name) for name in _OURS)
    assert gateway.trace_id.hex() == _CLIENT_TRACE  # the client's trace, continued
    assert admit.parent_span_id == gateway.span_id and generate.parent_span_id == gateway.span_id
    assert _attrs(gateway)["rpc.grpc.status_code"] == 0 and _attrs(gateway)["gen_ai.operation.name"] == "chat"
    envoy = [s for s in trace if s.name not in _OURS]
    # Envoy continues the client's span; the gateway continues Envoy's.
    assert any(s.span_id == gateway.parent_span_id and s.parent_span_id.hex() == "00f067aa0ba902b7"
               for s in envoy), [(s.name, s.parent_span_id.hex()) for s in envoy]
