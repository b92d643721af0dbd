"""The gateway's issue-17 series move when their event happens, with the
right labels: per-request latency by class and model, tokens, refusals by
error code, resumes, heartbeats, pacing for a slow reader, and the same
requests under the OpenTelemetry GenAI and Gateway API Inference Extension
names."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from conftest import KEY_FULL, MODEL, Mesh
from openai.types.chat import ChatCompletionMessageParam

from services.common.clock import FakeClock
from services.common.finish_reason import FinishReason
from services.common.openai_api.requests import SamplingOptions
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import ErrorKind, GatewayError, resume_not_found
from services.gateway.event_stream import EventStream
from services.gateway.events import Emit, Finished, TextDelta, Usage
from services.gateway.jobs import Job
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_meter import RequestMeter

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _chat(mesh: Mesh, priority: str, stream: bool = False, key: str = KEY_FULL) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": MSG, "stream": stream}
    headers = {"Authorization": f"Bearer {key}", "X-Priority": priority}
    async with aiohttp.ClientSession() as s, s.post(f"{mesh.http}/v1/chat/completions", json=body,
                                                    headers=headers) as resp:
        if stream:
            await resp.read()
            return resp.status, {}
        return resp.status, await resp.json()


async def test_requests_by_class_and_model_under_every_name(mesh: Mesh) -> None:
    m: GatewayMetrics = mesh.gateway.metrics
    status0, body0 = await _chat(mesh, "0")
    status2, body2 = await _chat(mesh, "2")
    assert status0 == status2 == 200
    out = body0["usage"]["completion_tokens"] + body2["usage"]["completion_tokens"]
    prompt = body0["usage"]["prompt_tokens"] + body2["usage"]["prompt_tokens"]
    for cls in ("P0", "P2"):
        labels = {"route": "chat", "priority": cls, "model_name": MODEL}
        assert value(m, "kvmesh_gateway_e2e_request_latency_seconds_count", **labels) == 1
        assert value(m, "kvmesh_gateway_time_to_first_token_seconds_count", **labels) == 1
        assert value(m, "kvmesh_gateway_inter_token_latency_seconds_count", **labels) >= 1
        assert value(m, "kvmesh_gateway_prompt_tokens_total", model_name=MODEL, priority=cls) > 0
    assert value(m, "kvmesh_gateway_e2e_request_latency_seconds_count", route="chat", priority="P1",
                 model_name=MODEL) == 0
    tokens = sum(value(m, "kvmesh_gateway_generation_tokens_total", model_name=MODEL, priority=c)
                 for c in ("P0", "P2"))
    assert tokens == out > 0
    gen_ai = {"gen_ai_operation_name": "chat", "gen_ai_request_model": MODEL, "gen_ai_system": "kvmesh",
              "gen_ai_provider_name": "kvmesh"}
    assert value(m, "gen_ai_server_time_to_first_token_seconds_count", **gen_ai) == 2
    assert value(m, "gen_ai_server_time_per_output_token_seconds_count", **gen_ai) == 2
    assert value(m, "gen_ai_server_request_duration_seconds_count", **gen_ai, error_type="") == 2
    assert value(m, "gen_ai_client_operation_duration_seconds_count", **gen_ai, error_type="") == 2
    assert value(m, "gen_ai_client_token_usage_sum", **gen_ai, gen_ai_token_type="input") == prompt
    assert value(m, "gen_ai_client_token_usage_sum", **gen_ai, gen_ai_token_type="output") == out
    gie = {"model_name": MODEL, "target_model_name": MODEL}
    assert value(m, "inference_objective_request_total", **gie) == 2
    assert value(m, "inference_objective_request_duration_seconds_count", **gie) == 2
    assert value(m, "inference_objective_input_tokens_sum", **gie) == prompt
    assert value(m, "inference_objective_output_tokens_sum", **gie) == out
    assert value(m, "inference_objective_running_requests", model_name=MODEL) == 0


async def test_running_requests_while_one_waits(mesh: Mesh) -> None:
    m: GatewayMetrics = mesh.gateway.metrics
    mesh.scheduler.queue_hold = asyncio.Event()
    task = asyncio.create_task(_chat(mesh, "1", stream=True))
    while not mesh.scheduler.admits:
        await asyncio.sleep(0.01)
    assert value(m, "inference_objective_running_requests", model_name=MODEL) == 1
    # heartbeat_seconds is 0.2 here: a queued stream gets heartbeats.
    while value(m, "kvmesh_gateway_heartbeats_total") < 1:
        await asyncio.sleep(0.05)
    mesh.scheduler.queue_hold.set()
    assert (await task)[0] == 200
    assert value(m, "inference_objective_running_requests", model_name=MODEL) == 0


async def test_refusals_by_their_openai_code(mesh: Mesh) -> None:
    m: GatewayMetrics = mesh.gateway.metrics
    status, body = await _chat(mesh, "1", key="sk-wrong")
    assert status == 401
    assert value(m, "kvmesh_gateway_rejections_total", reason=body["error"]["code"]) == 1
    mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_QUEUE_FULL, message="full")
    status, body = await _chat(mesh, "1")
    assert status == 429 and body["error"]["code"] == "reject_code_queue_full"
    assert value(m, "kvmesh_gateway_rejections_total", reason="queue_full") == 1
    assert value(m, "inference_objective_request_error_total", model_name=MODEL, target_model_name=MODEL,
                 error_code="queue_full") == 1
    mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_NO_ENGINE, message="none")
    status, _ = await _chat(mesh, "1")
    assert status == 503 and value(m, "kvmesh_gateway_rejections_total", reason="no_engine") == 1
    assert value(m, "gen_ai_server_request_duration_seconds_count", gen_ai_operation_name="chat",
                 gen_ai_request_model=MODEL, gen_ai_system="kvmesh", gen_ai_provider_name="kvmesh",
                 error_type="no_engine") == 1


def _job(resume_from: int | None = None) -> Job:
    return Job("r1", "completion", MODEL, "t", 0, [1, 2, 3], [], SamplingOptions(), 8, 60.0, 0.0, 0.0, 16,
               resume_from=resume_from)


async def test_resumes_by_result() -> None:
    metrics, clock = GatewayMetrics(), FakeClock()

    async def resumed(emit: Emit) -> None:
        await emit(TextDelta("x", [5], index=3))
        await emit(Finished(FinishReason.STOP, Usage(3, 4, 0)))

    async def refused(emit: Emit) -> None:
        raise resume_not_found()

    await RequestMeter(metrics, _job(resume_from=2), clock).wrap(resumed)(_sink)
    with pytest.raises(GatewayError):
        await RequestMeter(metrics, _job(resume_from=2), clock).wrap(refused)(_sink)
    await RequestMeter(metrics, _job(), clock).wrap(resumed)(_sink)  # not a resume
    assert value(metrics, "kvmesh_gateway_resumes_total", result="resumed") == 1
    assert value(metrics, "kvmesh_gateway_resumes_total", result="resume_not_found") == 1
    assert value(metrics, "gen_ai_client_token_usage_count", gen_ai_operation_name="text_completion",
                 gen_ai_request_model=MODEL, gen_ai_system="kvmesh", gen_ai_provider_name="kvmesh",
                 gen_ai_token_type="output") == 2


async def test_a_failure_after_tokens_is_an_error_not_a_refusal() -> None:
    metrics = GatewayMetrics()

    async def failed(emit: Emit) -> None:
        await emit(TextDelta("x", [5]))
        await emit(Finished(FinishReason.ERROR, Usage(3, 1, 0), "engine gone"))

    await RequestMeter(metrics, _job(), FakeClock()).wrap(failed)(_sink)
    assert value(metrics, "inference_objective_request_error_total", model_name=MODEL, target_model_name=MODEL,
                 error_code="error") == 1
    assert value(metrics, "inference_objective_request_duration_seconds_count", model_name=MODEL,
                 target_model_name=MODEL) == 0
    assert value(metrics, "kvmesh_gateway_generation_tokens_total", model_name=MODEL, priority="P0") == 1
    assert metrics.registry.get_sample_value("kvmesh_gateway_rejections_total", {"reason": "error"}) is None


async def _sink(_event: object) -> None:
    return None


async def test_a_slow_reader_is_paced_until_it_catches_up() -> None:
    metrics = GatewayMetrics()

    async def fast(emit: Emit) -> None:
        for i in range(30):
            await emit(TextDelta("x", [i], index=i + 1))
        await emit(Finished(FinishReason.STOP, Usage(1, 30, 0)))

    stream = EventStream(fast, 30.0, FakeClock(), signals=metrics.stream_signals)
    async with asyncio.timeout(10):  # the reader reads nothing yet: the queue fills
        while value(metrics, "kvmesh_gateway_paced_streams") < 1:
            await asyncio.sleep(0.01)
    assert value(metrics, "kvmesh_gateway_slow_readers_total") == 1
    events = [e async for e in stream]
    await stream.aclose()
    assert sum(len(e.token_ids) for e in events if isinstance(e, TextDelta)) == 30
    assert value(metrics, "kvmesh_gateway_paced_streams") == 0
    assert value(metrics, "kvmesh_gateway_slow_readers_total") == 1  # once per stream


async def test_a_reader_that_keeps_up_is_not_paced() -> None:
    metrics = GatewayMetrics()

    async def slow(emit: Emit) -> None:
        for i in range(5):
            await emit(TextDelta("x", [i]))
            await asyncio.sleep(0.01)
        await emit(Finished(FinishReason.STOP, Usage(1, 5, 0)))

    stream = EventStream(slow, 30.0, FakeClock(), signals=metrics.stream_signals)
    assert len([e async for e in stream]) == 6
    await stream.aclose()
    assert value(metrics, "kvmesh_gateway_slow_readers_total") == 0
    assert value(metrics, "kvmesh_gateway_paced_streams") == 0


def test_error_kinds_without_a_code_use_the_kind() -> None:
    from services.gateway.metrics import error_label
    assert error_label(None, ErrorKind.RATE_LIMITED.value) == "rate_limited"
    assert error_label("reject_code_tenant_full", "overloaded") == "tenant_full"
