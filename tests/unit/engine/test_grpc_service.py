"""The Engine gRPC service in-process on port 0, with the sim backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from engine_helpers import engine_config, engine_stub, free_port, mesh_config, prompt_of, started

from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.backend import GenerationOutput
from services.engine.coalesce import DeltaBuffer
from services.engine.server import EngineService


@pytest.fixture
async def service() -> AsyncIterator[EngineService]:
    engine = engine_config()
    engine.sim.speed_factor = 0.02  # ~0.2 ms per step: streams take a little while
    async with started(EngineService(mesh_config(), engine)) as svc:
        yield svc


@pytest.fixture
async def stub(service: EngineService) -> AsyncIterator[engine_pb2_grpc.EngineStub]:
    async with engine_stub(service) as client:
        yield client


def gen_request(rid: str, prompt: list[int], max_tokens: int = 20, **kw: Any) -> engine_pb2.EngineGenerateMessage:
    return engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw))


async def collect(
    call: grpc.aio.StreamStreamCall[engine_pb2.EngineGenerateMessage, engine_pb2.EngineGenerateEvent],
) -> tuple[list[int], str, engine_pb2.EngineFinished]:
    ids: list[int] = []
    text = ""
    while True:
        event = await call.read()
        if event is grpc.aio.EOF:
            raise AssertionError("stream ended without finished")
        if event.HasField("delta"):  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
            ids += event.delta.token_ids  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
            text += event.delta.text  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
        else:
            return ids, text, event.finished  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_generate_streams_then_finishes_with_usage(stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.write(gen_request("a", prompt_of(40), 30))
    await call.done_writing()
    ids, text, finished = await collect(call)
    assert len(ids) == 30 and text
    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert finished.usage.prompt_tokens == 40 and finished.usage.completion_tokens == 30
    again = stub.Generate()
    await again.write(gen_request("b", prompt_of(40), 30))
    ids2, text2, finished2 = await collect(again)
    assert ids2 == ids and text2 == text
    assert finished2.usage.cached_tokens == 32


async def test_cancel_message_aborts_and_frees_blocks(service: EngineService,
                                                      stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.write(gen_request("c", prompt_of(40), 3000))
    first = await call.read()
    assert first.HasField("delta")
    await call.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))
    _, _, finished = await collect(call)
    assert finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    load = service.backend.load()
    assert load.blocks_used == 0 and load.running == 0


async def test_client_cancelling_the_call_frees_blocks_after_the_resume_grace(
        service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    # A call that breaks without a `cancel` is kept for a resume (detached),
    # then cancelled when the grace runs out (test_engine_resume.py).
    service.runtime.kept.grace_seconds = 0.2
    call = stub.Generate()
    await call.write(gen_request("d", prompt_of(40), 3000))
    await call.done_writing()  # half-close first: must NOT end the generation
    assert (await call.read()).HasField("delta")
    assert service.backend.load().running == 1
    call.cancel()
    await wait_until(lambda: service.backend.load().running == 0)
    await wait_until(lambda: service.runtime.live_count == 0)
    assert service.backend.load().blocks_used == 0


async def test_abort_rpc(service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.write(gen_request("e", prompt_of(10), 3000))
    await call.read()
    assert (await stub.Abort(engine_pb2.AbortRequest(request_id="e"))).found
    _, _, finished = await collect(call)
    assert finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not (await stub.Abort(engine_pb2.AbortRequest(request_id="e"))).found
    assert service.backend.load().blocks_used == 0


async def test_get_info(stub: engine_pb2_grpc.EngineStub) -> None:
    info = await stub.GetInfo(engine_pb2.GetInfoRequest())
    assert info.backend == "sim" and info.engine_id == "engine-0" and info.serving
    assert info.block_size == 16 and info.total_blocks == 256 and info.max_running == 8
    assert info.max_model_len > 0


@pytest.mark.parametrize(("message", "match"), [
    (engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()), "first"),
    (gen_request("x", [], 5), "empty"),
    (gen_request("x", [1, 2], 0), "max_tokens"),
    (gen_request("x", [10**6], 5), "vocabulary"),
    (gen_request("x", [1] * 4000, 5000), "max_model_len"),
    (gen_request("x", [1, 2], 5, priority=7), "priority"),
])
async def test_invalid_argument(stub: engine_pb2_grpc.EngineStub,
                                message: engine_pb2.EngineGenerateMessage, match: str) -> None:
    call = stub.Generate()
    await call.write(message)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()


async def test_empty_stream_is_invalid_argument(stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_duplicate_request_id(service: EngineService, stub: engine_pb2_grpc.EngineStub,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.engine.detached._RELEASE_GRACE_SECONDS", 0.1)  # the sim is fast
    first = stub.Generate()
    await first.write(gen_request("dup", prompt_of(10), 3000))
    await first.read()
    second = stub.Generate()
    await second.write(gen_request("dup", prompt_of(10), 5))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(second)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    # A broken call's generation is kept for a resume (detached.py) and its
    # KV freed only past the resume grace: that, plus a wide margin for a
    # loaded machine, not the 5 s meant for a step or two.
    await wait_until(lambda: service.backend.load().blocks_used == 0,
                     timeout=service.config.resume.grace_seconds + 60.0)


@pytest.mark.parametrize("how", ["broken", "cancelled"])
async def test_placing_a_request_again_ends_its_stale_generation(
        service: EngineService, stub: engine_pb2_grpc.EngineStub, how: str) -> None:
    """A preempted request placed on the same engine again at once: its old
    call was cut (the generation detached for a resume) or said `cancel`
    that the backend has not acted on yet. The new placement ends the old
    generation and runs -- never a 409 for the request's own id."""
    first = stub.Generate()
    await first.write(gen_request("again", prompt_of(10), 3000))
    await first.read()
    if how == "broken":
        first.cancel()
        await wait_until(lambda: service.runtime.kept.detached_count == 1)
    else:
        await first.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))
    second = stub.Generate()
    await second.write(gen_request("again", prompt_of(12), 5))
    tokens, _, finished = await collect(second)
    assert len(tokens) == 5 and finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert service.runtime.kept.detached_count == 0
    first.cancel()
    await wait_until(lambda: service.backend.load().blocks_used == 0)


async def test_a_placement_racing_its_old_calls_cancel_waits_for_it(
        service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    """The new call of a re-placed request can be read before its old call's
    `cancel` (another HTTP/2 stream): the placement waits a moment for the
    old owner to let go and then runs -- not a 409 for the request's own id
    (the demo run's one duplicate_request_id after an engine kill)."""
    first = stub.Generate()
    await first.write(gen_request("raced", prompt_of(10), 3000))
    await first.read()
    second = stub.Generate()
    await second.write(gen_request("raced", prompt_of(12), 5))
    late = asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(
        first.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))))
    try:
        tokens, _, finished = await collect(second)
    finally:
        late.cancel()
    assert len(tokens) == 5 and finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    first.cancel()
    await wait_until(lambda: service.backend.load().blocks_used == 0)


async def test_draining_refuses_new_work_but_finishes_running(service: EngineService,
                                                              stub: engine_pb2_grpc.EngineStub) -> None:
    running = stub.Generate()
    await running.write(gen_request("r", prompt_of(10), 50))
    await running.read()
    service.runtime.drain()
    refused = stub.Generate()
    await refused.write(gen_request("n", prompt_of(10), 5))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(refused)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    _, _, finished = await collect(running)
    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_health_not_serving_until_backend_started() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    gate = asyncio.Event()
    svc = EngineService(mesh_config(), engine_config())
    real_start = svc.backend.start

    async def slow_start() -> None:
        await gate.wait()
        await real_start()

    svc.backend.start = slow_start  # type: ignore[method-assign]  # a slow start in place of the backend's own
    starting = asyncio.create_task(svc.start())
    try:
        await wait_until(lambda: svc.port != 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest(service="kvmesh.v1.Engine")
            await wait_until(lambda: svc._server is not None)
            status = (await health.Check(req)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            call = engine_pb2_grpc.EngineStub(channel).Generate()
            await call.write(gen_request("early", [1, 2], 2))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            gate.set()
            await starting
            assert (await health.Check(req)).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
        await asyncio.gather(starting, return_exceptions=True)
        await svc.stop()


async def test_metrics_use_vllm_names() -> None:
    import aiohttp

    port = free_port()
    svc = EngineService(mesh_config(), engine_config(metrics_port=port))
    await svc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
            call = engine_pb2_grpc.EngineStub(channel).Generate()
            await call.write(gen_request("m", prompt_of(40), 5))
            await collect(call)
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            body = await resp.text()
        for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                     "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{",
                     "vllm:prompt_tokens_total{", "vllm:generation_tokens_total{",
                     "vllm:time_to_first_token_seconds_bucket{"):
            assert name in body, name
        assert 'vllm:generation_tokens_total{engine="engine-0",model_name="sim"} 5.0' in body
    finally:
        await svc.stop()


async def test_delta_buffer_merges_and_never_drops() -> None:
    buffer = DeltaBuffer()
    for i in range(100):
        buffer.push(GenerationOutput(token_ids=[i], text=f"{i},"))
    buffer.push(GenerationOutput(token_ids=[], text="", finish_reason="length", completion_tokens=100))
    out = await buffer.take()
    assert out.token_ids == list(range(100)) and out.text == "".join(f"{i}," for i in range(100))
    assert out.finish_reason == "length" and out.completion_tokens == 100
    buffer.push(GenerationOutput(token_ids=[1], text="late"))  # after the final: ignored
    assert buffer.pending_tokens() == 0


async def test_slow_reader_gets_every_token(stub: engine_pb2_grpc.EngineStub) -> None:
    reference = stub.Generate()
    await reference.write(gen_request("ref", prompt_of(12), 400))
    expected, _, _ = await collect(reference)
    call = stub.Generate()
    await call.write(gen_request("slow", prompt_of(12), 400))
    ids: list[int] = []
    while True:
        event = await call.read()
        if event.HasField("finished"):
            break
        ids += event.delta.token_ids
        await asyncio.sleep(0.002)
    assert ids == expected


async def test_a_call_opened_ahead_serves_a_request_later_and_ends_on_stop() -> None:
    """Gateways open their next Generate call before they need it: it must
    serve a request sent much later, and one still unused must end at once on
    stop instead of holding the server's grace period."""
    engine = engine_config()
    svc = EngineService(mesh_config(), engine)
    await svc.start()
    stopped = False
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            ahead = stub.Generate()
            await wait_until(lambda: len(svc._servicer.idle_calls._waiting) == 1)
            await ahead.write(gen_request("later", prompt_of(8), max_tokens=5))
            ids, _, finished = await collect(ahead)
            assert len(ids) == 5 and finished.usage.completion_tokens == 5
            unused = stub.Generate()
            await wait_until(lambda: len(svc._servicer.idle_calls._waiting) == 1)
            await asyncio.wait_for(svc.stop(), timeout=30)
            stopped = True
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(unused.read(), timeout=10)
            assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    finally:
        if not stopped:
            await svc.stop()
