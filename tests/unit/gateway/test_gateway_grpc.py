"""The public gRPC API (kvmesh.v1.Inference) and gRPC health."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import KEY_FULL, KEY_P1, MODEL, Mesh, expected_answer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
)


def stub(mesh: Mesh) -> tuple[grpc.aio.Channel, inference_pb2_grpc.InferenceStub]:
    channel = grpc.aio.insecure_channel(mesh.grpc_address)
    return channel, inference_pb2_grpc.InferenceStub(channel)


def auth(key: str = KEY_FULL) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


CHAT = inference_pb2.ChatRequest(
    model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="hello world")],
    sampling=common_pb2.SamplingParams(max_tokens=20),
)


async def test_chat_stream(mesh: Mesh) -> None:
    mesh.scheduler.queued_updates = 2
    channel, s = stub(mesh)
    async with channel:
        events = [e async for e in s.Chat(CHAT, metadata=(*auth(), ("x-request-id", "g-1")))]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[:2] == ["queued", "queued"] and kinds[-1] == "finished"
    assert events[0].queued.position == 3 and events[0].queued.priority == inference_pb2.PRIORITY_P1
    assert all(e.request_id == "g-1" for e in events)
    deltas = [e.delta for e in events if e.HasField("delta")]
    prompt = list(mesh.engines["engine-a"].requests[0].prompt_token_ids)
    ids, text = expected_answer(prompt, 6)
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == ids
    done = events[-1].finished
    assert done.finish_reason == common_pb2.FINISH_REASON_STOP
    assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens == len(prompt)


async def test_generate_text_and_token_ids(mesh: Mesh) -> None:
    channel, s = stub(mesh)
    async with channel:
        by_ids = [e async for e in s.Generate(
            inference_pb2.GenerateRequest(model=MODEL, prompt_token_ids=[3, 4, 5],
                                          priority=inference_pb2.PRIORITY_P2),
            metadata=(("x-api-key", KEY_FULL),))]
        by_text = [e async for e in s.Generate(
            inference_pb2.GenerateRequest(model=MODEL, prompt="hello"), metadata=auth())]
    assert "".join(e.delta.text for e in by_ids if e.HasField("delta")) == expected_answer([3, 4, 5], 6)[1]
    assert by_text[-1].finished.usage.completion_tokens == 6
    assert [a.request.priority for a in mesh.scheduler.admits] == [2, 1]


async def test_priority_ceiling_grpc(mesh: Mesh) -> None:
    channel, s = stub(mesh)
    request = inference_pb2.ChatRequest()
    request.CopyFrom(CHAT)
    request.priority = inference_pb2.PRIORITY_P0
    async with channel:
        _ = [e async for e in s.Chat(request, metadata=auth(KEY_P1))]
    assert mesh.scheduler.admits[0].request.priority == 1


async def test_list_models(mesh: Mesh) -> None:
    channel, s = stub(mesh)
    async with channel:
        out = await s.ListModels(inference_pb2.ListModelsRequest(), metadata=auth())
    assert [(m.id, m.engines) for m in out.models] == [(MODEL, 1)]
    assert out.models[0].max_model_len > 0


async def _status(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:  # type: ignore[attr-defined]  # a grpc stream call, typed object here
            pass
    return err.value


async def test_grpc_errors(mesh: Mesh) -> None:
    channel, s = stub(mesh)
    async with channel:
        err = await _status(s.Chat(CHAT))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in err.details()
        err = await _status(s.Chat(CHAT, metadata=auth("sk-bad")))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = await _status(s.Chat(inference_pb2.ChatRequest(model=MODEL), metadata=auth()))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in err.details()
        err = await _status(s.Generate(inference_pb2.GenerateRequest(model=MODEL), metadata=auth()))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.details()
        bad_temp = inference_pb2.ChatRequest()
        bad_temp.CopyFrom(CHAT)
        bad_temp.sampling.temperature = 9
        err = await _status(s.Chat(bad_temp, metadata=auth()))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.details()
        missing = inference_pb2.ChatRequest()
        missing.CopyFrom(CHAT)
        missing.model = "nope"
        err = await _status(s.Chat(missing, metadata=auth()))
        assert err.code() == grpc.StatusCode.NOT_FOUND and MODEL in err.details()
        mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_QUEUE_FULL, message="full")
        err = await _status(s.Chat(CHAT, metadata=auth()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in err.details()
        assert ("retry-after", "1") in tuple(err.trailing_metadata())
        mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_NO_ENGINE)
        err = await _status(s.Chat(CHAT, metadata=auth()))
        assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_grpc_cancel_reaches_engine(mesh: Mesh) -> None:
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 10_000, 0.02
    request = inference_pb2.ChatRequest()
    request.CopyFrom(CHAT)
    request.sampling.max_tokens = 1000
    channel, s = stub(mesh)
    async with channel:
        call = s.Chat(request, metadata=auth())
        deltas = 0
        async for event in call:
            deltas += event.HasField("delta")
            if deltas == 3:
                break
        call.cancel()
        await asyncio.wait_for(engine.cancelled.wait(), 10)
        await asyncio.wait_for(mesh.scheduler.admit_cancelled.wait(), 10)
        assert engine.polite_cancels == 1  # said: not kept for a resume


async def test_grpc_deadline_and_max_generation_time(mesh: Mesh) -> None:
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 10_000, 0.02
    request = inference_pb2.ChatRequest()
    request.CopyFrom(CHAT)
    request.sampling.max_tokens = 1000
    request.max_generation_seconds = 0.3
    channel, s = stub(mesh)
    async with channel:
        events = [e async for e in s.Chat(request, metadata=auth())]
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_TIMEOUT
    assert "limit" in events[-1].finished.message
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    assert engine.polite_cancels == 1  # said: the engine ends it, not kept for a resume
    assert any(e.HasField("delta") for e in events)
    await asyncio.wait_for(engine.cancelled.wait(), 10)


async def test_heartbeats_while_queued_grpc(mesh: Mesh) -> None:
    mesh.scheduler.queue_hold = asyncio.Event()
    mesh.scheduler.update_seconds = 10  # no queued updates: only heartbeats keep it alive
    channel, s = stub(mesh)
    async with channel:
        call = s.Chat(CHAT, metadata=auth())
        kinds = []
        async for event in call:
            kinds.append(event.WhichOneof("event"))
            if kinds.count("heartbeat") == 2:
                mesh.scheduler.queue_hold.set()
        assert kinds[0] == "queued" and kinds[-1] == "finished"


async def test_grpc_health_follows_scheduler(mesh: Mesh) -> None:
    channel = grpc.aio.insecure_channel(mesh.grpc_address)
    async with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):
            reply = await health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Inference"))
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await mesh.servers[0].stop(0)  # the scheduler goes away
        for _ in range(200):
            reply = await health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Inference"))
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
